"""cuda.flash's FP8 (float8 e4m3) forward on Hopper (attnkern._fp8, flash_wgmma.cu's
ATTNKERN_FP8 variant) and its helpers.

Here, without a GPU: the Hadamard matrix (orthonormal, q H (k H)^T = q k^T), quantize_fp8's
per-tensor scales (amax / 448) and its rounding (e4m3: within 2^-4 relative of each value),
V^T's key order, kernel_info, and the refusals that need no GPU.

With ATTNKERN_TEST_GPU=1 on an H100/H200: against the float64 reference on fresh random inputs
(plain, top-left and bottom-right causal, grouped k/v heads, lengths that are not a multiple
of the 128-key tile, a negative scale), out and lse. Two bounds, each able to fail:
- against the exact answer for the FP8 inputs (the reference on the dequantized q, k, v):
  the kernel's own error, P rounded to e4m3 (x 256) being its main part, within 1.5 x that
  of a float64 emulation that rounds P the same way (global row max), plus 5e-3 for the
  bfloat16 output's rounding (2^-9 relative, twice);
- against the float64 answer for the unquantized inputs, next to our bfloat16 kernel's on
  the same inputs: FP8 <= 40 x bfloat16 (e4m3 keeps 4 significant bits, bfloat16 8: a rounding
  step 2^4 = 16 times larger, and P is rounded to e4m3 on top; docs/gpu-fp8.md states the
  measured ratios).
Hadamard: on inputs with outlier channels (4 of q's and k's 128 channels 5 times larger: their
products are a few large terms of each score, whose rounding errors the rotation spreads over
128 terms that round independently) the rotation must lower the error; on Gaussian inputs it
must not raise it by more than 25%.
Bit-identical repeats; refusals (other head sizes, features, kernels, dtypes, a GPU of
another compute capability, unaligned tensors). The float64, Hadamard, repeat and keyless-row
tests run for each FP8 division (DIVISIONS: cp.async and TMA producers, 128-192-key tiles, the
exponent variants); V^T's kernel (flash_fp8_vt.cu) against the torch copy byte for byte; descales
kept on the GPU (quantize_fp8(device_scales=True)): the same answer, no synchronizing torch call,
and a descale that is not positive and finite reported through check_finite; a call shape's plan
(the second call on) bit-identical to the general way, forget_plans() dropping it."""

import math
import os

import numpy as np
import pytest

import attnkern
from attnkern.backends.cuda import cpp

torch = pytest.importorskip("torch")

GPU = os.environ.get("ATTNKERN_TEST_GPU") == "1" and torch.cuda.is_available() and \
    torch.cuda.get_device_capability() == (9, 0)
gpu = pytest.mark.skipif(not GPU, reason="FP8 runs on Hopper (ATTNKERN_TEST_GPU=1 on an H100/H200)")


# ---------------------------------------------------------------- without a GPU

@pytest.mark.parametrize("d", [1, 2, 16, 64, 128, 256])
def test_hadamard_is_orthonormal_and_keeps_scores(d):
    h = attnkern.hadamard_matrix(d, dtype=torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(d, dtype=torch.float64), atol=1e-12)
    assert torch.equal(h.abs(), torch.full((d, d), 1 / math.sqrt(d), dtype=torch.float64))
    g = torch.Generator().manual_seed(d)
    q, k = torch.randn(5, d, generator=g, dtype=torch.float64), torch.randn(7, d, generator=g, dtype=torch.float64)
    assert torch.allclose((q @ h) @ (k @ h).T, q @ k.T, atol=1e-10)


@pytest.mark.parametrize("d", [0, 3, 96, 2.0])
def test_hadamard_refuses_sizes_not_a_power_of_two(d):
    with pytest.raises(ValueError, match="power of two"):
        attnkern.hadamard_matrix(d)


@pytest.mark.parametrize("hadamard", [False, True])
def test_quantize_fp8_scales_and_rounding(hadamard):
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 3, 40, 128, generator=g) * s for s in (1.0, 5.0, 0.01))
    r = attnkern.quantize_fp8(q, k, v, hadamard=hadamard)
    assert all(x.dtype == torch.float8_e4m3fn and x.shape == y.shape for x, y in zip(r[:3], (q, k, v)))
    h = attnkern.hadamard_matrix(128) if hadamard else torch.eye(128)
    for x8, x, ds in ((r.q, q @ h, r.descale_q), (r.k, k @ h, r.descale_k), (r.v, v, r.descale_v)):
        assert ds == pytest.approx(float(x.abs().max()) / 448, rel=1e-6)  # amax / 448
        back = x8.float() * ds
        assert float(back.abs().max()) == pytest.approx(float(x.abs().max()), rel=1e-6)  # amax maps to 448
        # round to nearest: within half a step, 2^-4 relative for normal values (2^-6 and up), and
        # half the subnormal step 2^-10 (in units of the scale) below
        bound = torch.maximum(x.abs() * 2.0**-4, torch.full_like(x, 2.0**-10 * ds))
        assert bool(((back - x).abs() <= bound * (1 + 1e-6)).all())
    assert r.kwargs() == {"descale_q": r.descale_q, "descale_k": r.descale_k, "descale_v": r.descale_v}
    kept = attnkern.quantize_fp8(q, k, v, hadamard=hadamard, device_scales=True)  # the scales as tensors
    for a, b, x8, y8 in zip(r[3:], kept[3:], r[:3], kept[:3]):
        assert isinstance(b, torch.Tensor) and b.shape == (1,) and float(b) == pytest.approx(a, rel=1e-6)
        assert (x8.float() - y8.float()).abs().max() <= x8.float().abs().max() * 2.0**-3  # a rounding at most


def test_quantize_fp8_of_zeros_and_its_refusals():
    z = torch.zeros(4, 128)
    r = attnkern.quantize_fp8(z, z, z)
    assert (r.descale_q, r.descale_k, r.descale_v) == (1.0, 1.0, 1.0) and not r.q.float().any()
    with pytest.raises(TypeError, match="q must be a torch tensor"):
        attnkern.quantize_fp8(np.zeros((4, 128)), z, z)
    with pytest.raises(TypeError, match="k must be a torch tensor"):
        attnkern.quantize_fp8(z, z.to(torch.float8_e4m3fn), z)
    with pytest.raises(ValueError, match="NaN or inf"):
        attnkern.quantize_fp8(z, z, torch.full((4, 128), math.nan))
    with pytest.raises(ValueError, match="one head size"):
        attnkern.quantize_fp8(z, torch.zeros(4, 64), z)


def test_v_transpose_follows_the_fragment_order():
    """Column 16h + 4t + 2a + b of each 32 holds key 16h + 8a + 2t + b; zeros past nk."""
    nk = 200
    v = (torch.arange(nk).repeat(128, 1).T % 251).to(torch.uint8).reshape(1, nk, 128).view(torch.float8_e4m3fn)
    vt = cpp.fp8_transpose_v(v, 128).view(torch.uint8)
    assert vt.shape == (1, 128, 256)
    for col in range(256):
        c, rest = divmod(col, 32)
        h, rest = divmod(rest, 16)
        t, rest = divmod(rest, 4)
        a, b = divmod(rest, 2)
        key = 32 * c + 16 * h + 8 * a + 2 * t + b
        want = key % 251 if key < nk else 0
        assert vt[0, :, col].tolist() == [want] * 128, col


def test_fp8_divisions_and_their_refusals():
    """The FP8 divisions flash_wgmma.cu has: cp.async copies at 128-key tiles, the TMA at 128-192
    keys (multiples of e4m3's 32-key step); V^T tiles take whole 128-key blocks of shared memory."""
    for text in ("wg2k128s3e", "wg2k128s3pet", "wg2k160s3pet", "wg2k192s2pet", "wg2k192s3pet", "wg2k192s3et",
                 "wg2k192s2petx1", "wg2k192s2petx8", "wg2k128s3ex16"):
        cpp.fp8_config_check(division(text))
    assert str(division("wg2k192s2petx4")) == "wg2k192s2petx4" and str(cpp.FP8_DEFAULT) == "wg2k192s2petx1"
    with pytest.raises(ValueError, match="exponent variant"):  # every 25th of 24 8-key tiles
        cpp.fp8_config_check(division("wg2k192s2petx25"))
    with pytest.raises(ValueError, match="in FP8 only"):  # no exponent variant in float16/bfloat16
        division("wg2k176s2petx1").check(128)
    # P rounded during the softmax (c: cvt, i: integer operations): with an exponent variant, not h
    for text in ("wg2k192s2petx1c", "wg2k192s2petx1i", "wg2k192s2petx8i", "wg2k128s3ex1c"):
        cpp.fp8_config_check(division(text))
        assert str(division(text)) == text
    for text in ("wg2k192s2petc", "wg2k192s2petx1hc", "wg2k192s2peti"):
        with pytest.raises(ValueError, match="c or i with an x and no h"):
            cpp.fp8_config_check(division(text))
    with pytest.raises(ValueError, match="pack3"):  # an unknown one named as such
        cpp.fp8_config_check(cpp.WgmmaConfig(2, 192, 2, pingpong=True, early_k=True, tma=True, fp8_exp=1, fp8_pack=3))
    for text, why in (("wg2k192s3e", "128-key tiles with cp.async"), ("wg2k176s2pet", r"\(128, 160, 192\) keys"),
                      ("wg2k64s3et", r"\(128, 160, 192\) keys"), ("wg3k128", "warp-specialized")):
        with pytest.raises(ValueError, match=why):
            cpp.fp8_config_check(division(text))
    with pytest.raises(ValueError, match="shared memory"):  # 16 KB Q, 4 x (24 KB K + 32 KB V^T)
        cpp.fp8_config_check(division("wg2k192s4pet"))
    # Q, then per stage a K tile (block_k rows of 128 bytes) and a V^T tile (128 rows of 128-key blocks)
    assert division("wg2k128s3pet").shared_bytes(128, 1) == 128 * 128 + 3 * (128 * 128 + 128 * 128) + 1024 + 96
    assert division("wg2k192s2pet").shared_bytes(128, 1) == 128 * 128 + 2 * (192 * 128 + 128 * 256) + 1024 + 64


def division(text):
    """A WgmmaConfig from its name (wg2k192s2pet: 2 consumers, 192-key tiles, 2 stages, ping-pong,
    early K, TMA)."""
    return cpp.WgmmaConfig.parse(text)


def test_backward_and_varlen_refuse_fp8():
    x8 = torch.zeros(1, 2, 8, 128).to(torch.float8_e4m3fn)
    x = torch.zeros(1, 2, 8, 128)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(TypeError, match="attention_backward has no FP8: v is torch.float8_e4m3fn"):
        attnkern.attention_backward(x, x, x8, x, x, torch.zeros(1, 2, 8))
    with pytest.raises(TypeError, match="attention_varlen has no FP8: q is"):
        attnkern.attention_varlen(x8[0].transpose(0, 1), x8[0].transpose(0, 1), x8[0].transpose(0, 1), cu, cu)
    with pytest.raises(TypeError, match="attention_varlen_backward has no FP8: k is"):
        attnkern.attention_varlen_backward(x[0], x8[0], x[0], x[0], x[0], torch.zeros(2, 8), cu, cu)


def test_kernel_info_lists_fp8_forward_only():
    info = attnkern.kernel_info("cuda.flash")
    assert "float8_e4m3fn" in info["dtypes"] and "float8_e4m3fn" not in info["backward_dtypes"]
    for feature in ("window", "key_lengths", "softcap", "mask", "alibi", "dropout", "varlen"):
        assert "float8_e4m3fn" not in info["feature_dtypes"][feature], feature
    for feature in ("gqa", "bottom_right"):
        assert feature in info["features"] and feature not in info["feature_dtypes"]
    assert all("float8_e4m3fn" not in attnkern.kernel_info(k)["dtypes"] for k in attnkern.kernels()
               if k != "cuda.flash")


def test_descales_need_fp8_inputs_and_fp8_needs_cuda():
    x = torch.zeros(1, 8, 128)
    with pytest.raises(ValueError, match="float8_e4m3fn torch tensors only"):
        attnkern.attention(x, x, x, descale_q=1.0)
    x8 = x.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="must be CUDA tensors"):
        attnkern.attention(x8, x8, x8, descale_q=1.0, descale_k=1.0, descale_v=1.0)
    with pytest.raises(TypeError, match="all of dtype torch.float8_e4m3fn: k is torch.float32"):
        attnkern.attention(x8, x, x8, descale_q=1.0, descale_k=1.0, descale_v=1.0)
    with pytest.raises(ValueError, match="cuda.flash only"):
        attnkern.attention(x8, x8, x8, kernel="native.flash", descale_q=1.0, descale_k=1.0, descale_v=1.0)


# ---------------------------------------------------------------- on Hopper


def rms_error(out, ref) -> float:
    """rms(out - ref) / rms(ref), both as float64."""
    out, ref = torch.as_tensor(np.asarray(out, np.float64)), torch.as_tensor(np.asarray(ref, np.float64))
    return float((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


def host64(x):
    return x.double().cpu().numpy()


def dequantized(r):
    return tuple(host64(x.double() * s) for x, s in zip(r[:3], r[3:]))


def emulate(r, causal, scale):
    """The FP8 kernel's arithmetic in float64 (GPU): exact scores of the dequantized inputs, P
    (against the row's global max) times 256 rounded to e4m3, the row sum unrounded."""
    q, k, v = (x.double() * s for x, s in zip(r[:3], r[3:]))
    group = q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1
    k, v = (x.repeat_interleave(group, dim=-3) if group > 1 else x for x in (k, v))
    s = (q @ k.transpose(-1, -2)) * scale
    nq, nk = s.shape[-2:]
    if causal:
        off = nk - nq if causal == "bottom_right" else 0
        keep = torch.arange(nk, device=s.device)[None, :] <= torch.arange(nq, device=s.device)[:, None] + off
        s = s.masked_fill(~keep, -math.inf)
    p = torch.exp(s - s.amax(-1, keepdim=True))
    p8 = (p * 256).to(torch.float8_e4m3fn).double() / 256
    return (p8 @ v) / p.sum(-1, keepdim=True)


def inputs(shape_q, shape_kv, seed, outliers=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(s, generator=g, device="cuda") for s in (shape_q, shape_kv, shape_kv))
    if outliers:  # 4 channels of q and k 5 times larger (the same in both)
        ch = torch.randperm(q.shape[-1], generator=g, device="cuda")[:4]
        q[..., ch] *= 5
        k[..., ch] *= 5
    return q, k, v


# the FP8 divisions the GPU tests run (each test below for each, FP8_DEFAULT swapped): the cp.async
# one and the TMA ones with ping-pong at 128, 160 and 192 keys a tile (dev/gpu_fp8_measure.py's),
# and the default's exponent variants (x1: P's 2^8 in the exponent; xk: also every k-th 8-key
# tile's probabilities by exp2_fma; x1h: the exponentials two at a time in half precision; x1c, x1i:
# P rounded to e4m3 during the softmax, by cvt and by integer operations; x8i: x8's with the latter)
DIVISIONS = ["wg2k128s3e", "wg2k128s3pet", "wg2k160s3pet", "wg2k192s2pet", "wg2k192s3pet", "wg2k192s2petx1",
             "wg2k192s2petx4", "wg2k192s2petx6", "wg2k192s2petx8", "wg2k192s2petx1h", "wg2k192s2petx1c",
             "wg2k192s2petx1i", "wg2k192s2petx8i"]


@pytest.fixture(params=DIVISIONS)
def fp8_division(request, monkeypatch):
    """Each FP8 division as the default in turn (attention() runs cpp.FP8_DEFAULT)."""
    monkeypatch.setattr(cpp, "FP8_DEFAULT", division(request.param))
    return request.param


@gpu
@pytest.mark.parametrize("nk", [1, 31, 128, 200, 1000, 4103])
def test_v_transpose_kernel_matches_the_torch_copy(nk):
    """flash_fp8_vt.cu writes the bytes of fp8_transpose_v (the fragment order, zeros past nk)."""
    from attnkern._gpuarray import GpuArray
    from attnkern.backends.cuda import launch

    g = torch.Generator(device="cuda").manual_seed(nk)
    v = torch.randint(0, 256, (3, nk, 128), generator=g, device="cuda", dtype=torch.uint8)
    want = cpp.fp8_transpose_v(v.view(torch.float8_e4m3fn), cpp.FP8_VT_KEYS)
    vt = torch.full(want.shape, 0xAB, dtype=torch.uint8, device="cuda")  # every byte must be written
    torch.cuda.synchronize()
    kernel, grid, block, args = cpp.fp8_vt_launch(GpuArray(tuple(v.shape), np.uint8, None, ptr=v.data_ptr(), owner=v),
                                                  GpuArray(tuple(vt.shape), np.uint8, None, ptr=vt.data_ptr(),
                                                           owner=vt))
    launch.launch(kernel, grid, block, *args)
    torch.cuda.synchronize()
    assert torch.equal(vt, want)


@gpu
@pytest.mark.parametrize("vt_kernel", [False, True])
def test_fp8_same_bits_either_v_transpose(vt_kernel, monkeypatch):
    q, k, v = inputs((1, 4, 300, 128), (1, 2, 333, 128), seed=21)
    r = attnkern.quantize_fp8(q, k, v)
    monkeypatch.setattr(cpp, "FP8_VT_KERNEL", not vt_kernel)
    want = attnkern.attention(*r[:3], causal="bottom_right", **r.kwargs())
    monkeypatch.setattr(cpp, "FP8_VT_KERNEL", vt_kernel)
    assert torch.equal(attnkern.attention(*r[:3], causal="bottom_right", **r.kwargs()), want)


CASES = [  # (q shape, k/v shape, causal)
    ((1, 4, 512, 128), (1, 4, 512, 128), False),
    ((1, 4, 512, 128), (1, 4, 512, 128), True),
    ((2, 4, 300, 128), (2, 2, 700, 128), "bottom_right"),  # grouped k/v heads, Nk not a multiple of 128
    ((2, 4, 77, 128), (2, 4, 200, 128), False),
    ((3, 130, 128), (3, 333, 128), True),
    ((1000, 128), (1000, 128), "bottom_right"),
    ((1, 2, 2048, 128), (1, 2, 2048, 128), True),  # many tiles: the ping-pong's turns, the ring's phases
]


@gpu
@pytest.mark.parametrize("shape_q, shape_kv, causal", CASES)
def test_fp8_matches_float64(shape_q, shape_kv, causal, fp8_division):
    q, k, v = inputs(shape_q, shape_kv, seed=hash((shape_q, causal)) % 2**31)
    r = attnkern.quantize_fp8(q, k, v)
    scale = 1 / math.sqrt(128)
    out, lse = attnkern.attention(*r[:3], causal=causal, return_lse=True, **r.kwargs())
    assert out.dtype == lse.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == q.shape[:-1]
    ref8, lse8 = attnkern.reference(*dequantized(r), causal=causal, return_lse=True)
    own, emu = rms_error(host64(out), ref8), rms_error(host64(emulate(r, causal, scale)), ref8)
    assert own <= 1.5 * emu + 5e-3, f"FP8 kernel {own:.3g} against emulated P rounding {emu:.3g}"
    # lse in bfloat16: its rounding (2^-9 relative) and the scores' (the descales' product in float32)
    assert np.allclose(host64(lse), lse8, rtol=2**-7, atol=2**-7)
    ref = attnkern.reference(host64(q), host64(k), host64(v), causal=causal)
    bf16 = attnkern.attention(*(x.bfloat16() for x in (q, k, v)), causal=causal)
    fp8_err, bf16_err = rms_error(host64(out), ref), rms_error(host64(bf16), ref)
    assert fp8_err <= 40 * bf16_err, f"FP8 {fp8_err:.3g} vs bfloat16 {bf16_err:.3g}"


@gpu
def test_fp8_negative_scale_and_descales(fp8_division):
    q, k, v = inputs((2, 2, 256, 128), (2, 2, 256, 128), seed=5)
    r = attnkern.quantize_fp8(q * 3, k, v / 7)
    out = attnkern.attention(*r[:3], scale=-0.05, **r.kwargs())
    ref = attnkern.reference(*dequantized(r), scale=-0.05)
    assert rms_error(host64(out), ref) <= 1.5 * rms_error(host64(emulate(r, False, -0.05)), ref) + 5e-3


@gpu
@pytest.mark.parametrize("causal", [False, True])
def test_hadamard_lowers_the_error_with_outliers(causal, fp8_division):
    errs = {}
    for outliers in (False, True):
        q, k, v = inputs((1, 8, 1024, 128), (1, 8, 1024, 128), seed=11 + outliers, outliers=outliers)
        ref = attnkern.reference(host64(q), host64(k), host64(v), causal=causal)
        for had in (False, True):
            r = attnkern.quantize_fp8(q, k, v, hadamard=had)
            errs[outliers, had] = rms_error(host64(attnkern.attention(*r[:3], causal=causal, **r.kwargs())), ref)
    assert errs[True, True] < errs[True, False], errs
    assert errs[False, True] <= 1.25 * errs[False, False], errs


@gpu
def test_fp8_bit_identical_repeats(fp8_division):
    q, k, v = inputs((2, 8, 1000, 128), (2, 4, 1500, 128), seed=3)
    r = attnkern.quantize_fp8(q, k, v)
    outs = [attnkern.attention(*r[:3], causal="bottom_right", return_lse=True, **r.kwargs()) for _ in range(3)]
    assert all(torch.equal(o[0], outs[0][0]) and torch.equal(o[1], outs[0][1]) for o in outs[1:])


@gpu
def test_fp8_empty_and_keyless_rows(fp8_division):
    q8 = torch.zeros(1, 2, 64, 128, device="cuda").to(torch.float8_e4m3fn)
    k8 = torch.zeros(1, 2, 0, 128, device="cuda").to(torch.float8_e4m3fn)
    out, lse = attnkern.attention(q8, k8, k8, return_lse=True, descale_q=1.0, descale_k=1.0, descale_v=1.0)
    assert not out.any() and bool(torch.isinf(lse).all())
    # top-left causal with Nk < Nq: rows past Nk still see keys; bottom-right: the first rows see none
    q, k, v = inputs((1, 2, 200, 128), (1, 2, 64, 128), seed=9)
    r = attnkern.quantize_fp8(q, k, v)
    out = attnkern.attention(*r[:3], causal="bottom_right", **r.kwargs())
    assert not out[:, :, :136].any()
    ref = attnkern.reference(*dequantized(r), causal="bottom_right")
    assert rms_error(host64(out[:, :, 136:]), ref[:, :, 136:]) < 0.05


@gpu
def test_fp8_descales_on_the_device():
    """quantize_fp8(device_scales=True) keeps the scales on the GPU and attention's kernel reads them
    there: the same answer as with Python floats, and no host synchronization on the way."""
    q, k, v = inputs((2, 4, 700, 128), (2, 2, 900, 128), seed=17)
    host = attnkern.quantize_fp8(q, k, v)
    dev = attnkern.quantize_fp8(q, k, v, device_scales=True)
    for a, b in zip(host[3:], dev[3:]):
        assert isinstance(b, torch.Tensor) and b.is_cuda and b.shape == (1,) and float(b) == pytest.approx(a, rel=1e-6)
    ref = attnkern.attention(*host[:3], causal="bottom_right", **host.kwargs())
    out = attnkern.attention(*dev[:3], causal="bottom_right", **dev.kwargs())
    assert rms_error(host64(out), host64(ref)) < 2e-3  # the scales' float32 roundings, in other places
    mixed = attnkern.attention(*host[:3], causal="bottom_right", **{**host.kwargs(), "descale_v": dev.descale_v})
    assert rms_error(host64(mixed), host64(ref)) < 2e-3
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing torch call raises
    try:
        x = attnkern.quantize_fp8(q, k, v, device_scales=True)
        again = attnkern.attention(*x[:3], causal="bottom_right", check_finite=False, **x.kwargs())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(again, out)


@gpu
@pytest.mark.parametrize("device_scales", [False, True])
def test_fp8_planned_calls_match_the_first(device_scales):
    """The second call of a call shape runs its plan (_fp8._Plan: prepared launches of V^T's and the
    attention kernel): bit-identical to the first call's general way on fresh inputs of that shape,
    with other descales, lse and check_finite; an unaligned or non-contiguous input still takes the
    general way (its refusal); forget_plans() drops the plans."""
    from attnkern import _fp8
    from attnkern.backends import cuda as cuda_backend

    cuda_backend.forget_plans()
    shapes = ((2, 4, 700, 128), (2, 2, 900, 128))
    first = attnkern.quantize_fp8(*inputs(*shapes, seed=31), device_scales=device_scales)
    want = attnkern.attention(*first[:3], causal="bottom_right", return_lse=True, **first.kwargs())
    assert len(_fp8._plans()) == 1
    plan = next(iter(_fp8._plans().values()))
    again = attnkern.attention(*first[:3], causal="bottom_right", return_lse=True, **first.kwargs())
    assert torch.equal(again[0], want[0]) and torch.equal(again[1], want[1])
    assert next(iter(_fp8._plans().values())) is plan  # used, not made again
    fresh = attnkern.quantize_fp8(*inputs(*shapes, seed=32), device_scales=device_scales)
    planned = attnkern.attention(*fresh[:3], causal="bottom_right", return_lse=True, **fresh.kwargs())
    if not device_scales:  # other host descales: another key, so the general way; then its plan
        planned = attnkern.attention(*fresh[:3], causal="bottom_right", return_lse=True, **fresh.kwargs())
    cuda_backend.forget_plans()
    assert not _fp8._plans()
    general = attnkern.attention(*fresh[:3], causal="bottom_right", return_lse=True, **fresh.kwargs())
    assert torch.equal(planned[0], general[0]) and torch.equal(planned[1], general[1])
    ref = attnkern.reference(*dequantized(fresh), causal="bottom_right")
    assert rms_error(host64(planned[0]), ref) < 0.05
    q8 = fresh.q
    unaligned = torch.empty(q8.numel() + 16, dtype=torch.uint8, device="cuda")[1:1 + q8.numel()]
    unaligned = unaligned.view(torch.float8_e4m3fn).view(q8.shape)
    with pytest.raises(ValueError, match="16-byte aligned"):
        attnkern.attention(unaligned, *fresh[1:3], causal="bottom_right", return_lse=True, **fresh.kwargs())
    with pytest.raises(ValueError, match="contiguous"):
        wide = torch.zeros((*q8.shape[:-1], 256), dtype=torch.uint8, device="cuda")[..., :128]
        attnkern.attention(wide.view(torch.float8_e4m3fn), *fresh[1:3],
                           causal="bottom_right", return_lse=True, **fresh.kwargs())


@gpu
def test_fp8_device_descales_checked_in_the_kernel():
    x8 = torch.ones(1, 2, 64, 128, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones(1, device="cuda")
    with pytest.raises(FloatingPointError, match="not positive and finite"):
        attnkern.attention(x8, x8, x8, descale_q=one, descale_k=-one, descale_v=1.0)
    out = attnkern.attention(x8, x8, x8, descale_q=one, descale_k=one, descale_v=one * math.inf, check_finite=False)
    assert bool(torch.isnan(out).all())
    with pytest.raises(ValueError, match="descale_v as a CUDA tensor must have one element"):
        attnkern.attention(x8, x8, x8, descale_q=one, descale_k=one, descale_v=torch.ones(2, device="cuda"))
    out = attnkern.attention(x8, x8, x8, descale_q=one * 0.5, descale_k=one, descale_v=2.0)
    assert torch.equal(out, torch.full_like(out, 2.0))  # every score equal: the mean of v, 1 x 2


@gpu
def test_fp8_refusals(monkeypatch):
    x8 = torch.zeros(1, 2, 64, 128, device="cuda").to(torch.float8_e4m3fn)
    ds = {"descale_q": 1.0, "descale_k": 1.0, "descale_v": 1.0}
    small = torch.zeros(1, 2, 64, 64, device="cuda").to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="D = Dv = 128 only"):
        attnkern.attention(small, small, small, **ds)
    for feature, value in (("window", (16, 0)), ("softcap", 30.0), ("key_lengths", [10]), ("dropout_p", 0.1),
                           ("alibi_slopes", np.ones(2))):
        with pytest.raises(ValueError, match=f"{feature} is not supported in FP8"):
            attnkern.attention(x8, x8, x8, **{feature: value}, **ds)
    with pytest.raises(ValueError, match="descale_v= is missing"):
        attnkern.attention(x8, x8, x8, descale_q=1.0, descale_k=1.0)
    with pytest.raises(ValueError, match="positive and finite"):
        attnkern.attention(x8, x8, x8, **{**ds, "descale_k": -1.0})
    with pytest.raises(ValueError, match="no tunables"):
        attnkern.attention(x8, x8, x8, block_q=64, **ds)
    with pytest.raises(TypeError, match="float8_e4m3fn: v is torch.float8_e5m2"):
        attnkern.attention(x8, x8, torch.zeros(1, 2, 64, 128, device="cuda").to(torch.float8_e5m2), **ds)
    odd = torch.zeros(1 + 2 * 64 * 128, device="cuda").to(torch.float8_e4m3fn)[1:].view(1, 2, 64, 128)
    with pytest.raises(ValueError, match="q must start at a 16-byte aligned address"):
        attnkern.attention(odd, x8, x8, **ds)
    nan = x8.clone()
    nan.view(torch.uint8)[0, 0, 3, 5] = 0x7F
    with pytest.raises(ValueError, match="k has NaN"):
        attnkern.attention(x8, nan, x8, **ds)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    with pytest.raises(ValueError, match="compute capability 8.9"):
        attnkern.attention(x8, x8, x8, **ds)


@gpu
def test_fp8_p_rounded_during_the_softmax_same_answer(monkeypatch):
    """x1c rounds P with x1's cvt, only earlier: the same bits; x1i rounds by integer operations,
    whose ties go away from zero where cvt's go to even: the same lse (the row sums are of the
    unrounded probabilities) and the same output but in the few rows where a tie falls."""
    q, k, v = inputs((2, 4, 1000, 128), (2, 2, 1500, 128), seed=17)
    r = attnkern.quantize_fp8(q, k, v)
    outs = {}
    for text in ("wg2k192s2petx1", "wg2k192s2petx1c", "wg2k192s2petx1i"):
        monkeypatch.setattr(cpp, "FP8_DEFAULT", division(text))
        for causal in (False, True, "bottom_right"):  # plain and featured (grouped k/v heads) kernels
            outs[text, causal] = attnkern.attention(*r[:3], causal=causal, return_lse=True, **r.kwargs())
    for causal in (False, True, "bottom_right"):
        (out, lse), (out_c, lse_c), (out_i, lse_i) = (outs[t, causal] for t in ("wg2k192s2petx1", "wg2k192s2petx1c",
                                                                                "wg2k192s2petx1i"))
        assert torch.equal(out_c, out) and torch.equal(lse_c, lse)
        assert torch.equal(lse_i, lse)
        rows = (out_i != out).any(-1)
        assert float(rows.float().mean()) < 0.02, float(rows.float().mean())
        assert float((out_i.float() - out.float()).abs().max()) <= 0.1 * float(out.float().abs().max())
