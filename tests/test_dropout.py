"""dropout_p / dropout_seed: the Philox4x32-10 mask (attnkern._philox, attn_common.h's
attn_philox) against Random123's known answers; the C kernels' mask bit for bit equal
to NumPy's; forward and backward against the float64 reference, which applies the same
mask (so elementwise, not statistically); determinism across thread counts and runs;
the keep rate and the expectation of the output; seeds from NumPy's and torch's
global generators; the kernels that refuse dropout."""

import os
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkern
from attnkern import _philox
from attnkern_bench.accuracy import conditioning, tolerance
from conftest import ISAS, forced_isa

DROPOUT = [k for k in attnkern.kernels() if "dropout" in attnkern.kernel_info(k)["features"]
           and attnkern.kernel_info(k)["available"] and attnkern.kernel_info(k)["device"] == "cpu"]


def assert_close(got, ref, q, k, dtype, factor=1.0, what=""):
    bound = tolerance(dtype) * factor * max(1.0, np.abs(ref).max(initial=0)) * conditioning(q, k)
    err = np.abs(np.asarray(got, np.float64) - ref).max(initial=0)
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


def inputs(shape_q, shape_kv, dtype, seed=0, dv=None):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape_q).astype(dtype), rng.standard_normal(shape_kv).astype(dtype),
            rng.standard_normal((*shape_kv[:-1], dv or shape_kv[-1])).astype(dtype))


def test_philox_gives_random123s_known_answers():
    words = _philox.philox4x32_10(0, 0, 0, 0, 0)
    assert [int(w) for w in words] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    words = _philox.philox4x32_10(*[0xFFFFFFFF] * 4, 2**64 - 1)
    assert [int(w) for w in words] == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    words = _philox.philox4x32_10(0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0x299F31D0A4093822)
    assert [int(w) for w in words] == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def kept_by_kernel(kernel, p, seed, batch=2, nq=16, nk=24, isa=None):
    """The kernel's keep mask, read back from its output: q = 0 gives P = 1/nk, and
    v = the identity gives out[b, i, j] = Z[b, i, j] / nk."""
    q = np.zeros((batch, nq, 4))
    k = np.ones((batch, nk, 4))
    v = np.broadcast_to(np.eye(nk), (batch, nk, nk)).copy()
    with forced_isa(isa):
        out = attnkern.attention(q, k, v, dropout_p=p, dropout_seed=seed, kernel=kernel)
    return out * nk * (1 - p) > 0.5


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_the_c_mask_is_numpys_bit_for_bit(isa, p):
    seed = 2**40 + 12345
    got = kept_by_kernel("native.flash", p, seed, isa=isa)
    b, i, j = np.ogrid[:2, :16, :24]
    np.testing.assert_array_equal(got, _philox.keep(seed, p, b, i, j))
    np.testing.assert_array_equal(kept_by_kernel("numpy.naive", p, seed), got)


def test_keep_rate_and_the_expected_output():
    p, batch, nq, nk = 0.3, 4, 128, 128
    kept = kept_by_kernel("native.flash", p, 99, batch, nq, nk)
    n = kept.size
    # binomial: the kept count within 6 standard deviations of n (1 - p)
    assert abs(kept.sum() - n * (1 - p)) <= 6 * np.sqrt(n * p * (1 - p))
    q, k, _ = inputs((batch, nq, 8), (batch, nk, 8), np.float64)
    out = attnkern.attention(q, k, np.ones((batch, nk, 3)), dropout_p=p, dropout_seed=5, kernel="native.flash")
    # each row's sum_j P_ij Z_ij has mean 1; the mean of batch * nq rows within 6 of its standard errors
    rows = out[..., 0]
    assert abs(rows.mean() - 1) <= 6 * rows.std() / np.sqrt(rows.size)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", ["plain", "causal-gqa", "mask-window", "bottom_right-lengths-softcap"])
def test_forward_and_backward_match_the_reference_elementwise(isa, dtype, case):
    rng = np.random.default_rng(3)
    q, k, v = inputs((2, 4, 11, 8), (2, 2 if "gqa" in case else 4, 14, 8), dtype, dv=6)
    kw = {"dropout_p": 0.25, "dropout_seed": 1234}
    kw.update({"plain": {}, "causal-gqa": {"causal": True},
               "mask-window": {"attn_mask": rng.random((2, 1, 11, 14)) < 0.8, "window": (4, 4)},
               "bottom_right-lengths-softcap": {"causal": "bottom_right", "key_lengths": [14, 9],
                                                "softcap": 2.0}}[case])
    dout = rng.standard_normal((2, 4, 11, 6)).astype(dtype)
    with forced_isa(isa):
        out, lse = attnkern.attention(q, k, v, kernel="native.flash", return_lse=True, block_q=4, block_k=6, **kw)
        grads = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="native.flash", block_q=4, block_k=6,
                                            **kw)
    ref, ref_lse = attnkern.reference(q, k, v, return_lse=True, **kw)
    assert_close(out, ref, q, k, dtype, factor=2, what="out")
    undropped = attnkern.reference(q, k, v, return_lse=True, **{**kw, "dropout_p": 0.0})[1]
    np.testing.assert_array_equal(ref_lse, undropped)  # the lse is of the undropped softmax
    fin = np.isfinite(ref_lse)
    assert np.abs(lse[fin] - ref_lse[fin]).max() <= 50 * tolerance(dtype) * conditioning(q, k)
    for g, r, name in zip(grads, attnkern.reference_backward(q, k, v, dout, **kw), ("dq", "dk", "dv")):
        assert_close(g, r, q, k, dtype, factor=16 * max(1.0, np.abs(dout).max()), what=name)


def test_numpy_naive_matches_the_reference_with_dropout():
    q, k, v = inputs((2, 3, 7, 8), (2, 3, 9, 8), np.float64)
    kw = {"dropout_p": 0.5, "dropout_seed": 7, "causal": "bottom_right"}
    np.testing.assert_allclose(attnkern.attention(q, k, v, kernel="numpy.naive", **kw),
                               attnkern.reference(q, k, v, **kw), atol=1e-13)


@settings(max_examples=20, deadline=None)
@given(nq=st.integers(1, 10), nk=st.integers(1, 10), p=st.floats(0.0, 0.95), seed=st.integers(0, 2**64 - 1),
       causal=st.sampled_from([False, True, "bottom_right"]), dtype=st.sampled_from([np.float32, np.float64]),
       blocks=st.sampled_from([(1, 1), (2, 3), (16, 16)]))
def test_hypothesis_forward_and_backward(nq, nk, p, seed, causal, dtype, blocks):
    q, k, v = inputs((1, 2, nq, 8), (1, 2, nk, 8), dtype, seed=seed % 1000, dv=3)
    dout = np.random.default_rng(seed % 1000).standard_normal((1, 2, nq, 3)).astype(dtype)
    kw = {"dropout_p": p, "dropout_seed": seed, "causal": causal}
    out, lse = attnkern.attention(q, k, v, kernel="native.flash", return_lse=True, block_q=blocks[0],
                                  block_k=blocks[1], **kw)
    scale = 1 / (1 - p)
    assert_close(out, attnkern.reference(q, k, v, **kw), q, k, dtype, factor=2 * scale, what="out")
    grads = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="native.flash", block_q=blocks[0],
                                        block_k=blocks[1], **kw)
    for g, r, name in zip(grads, attnkern.reference_backward(q, k, v, dout, **kw), ("dq", "dk", "dv")):
        assert_close(g, r, q, k, dtype, factor=16 * scale * scale * max(1.0, np.abs(dout).max()), what=name)


def test_bit_identical_across_thread_counts_and_runs():
    q, k, v = inputs((2, 4, 37, 16), (2, 2, 45, 16), np.float32)
    kw = {"dropout_p": 0.2, "dropout_seed": 42, "kernel": "native.flash", "block_q": 8, "block_k": 16,
          "causal": True}
    runs = [attnkern.attention(q, k, v, num_threads=t, return_lse=True, **kw) for t in (1, 2, 2)]
    assert all(o.tobytes() == runs[0][0].tobytes() and l.tobytes() == runs[0][1].tobytes() for o, l in runs)
    dout = np.ones_like(runs[0][0])
    grads = [attnkern.attention_backward(q, k, v, *runs[0][:1], dout, runs[0][1], num_threads=t, **kw)
             for t in (1, 2)]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(*grads))


def test_seeds_come_from_numpys_and_torchs_global_generators():
    q, k, v = inputs((1, 2, 8, 8), (1, 2, 8, 8), np.float64)
    np.random.seed(3)
    a = attnkern.attention(q, k, v, dropout_p=0.5)
    np.random.seed(3)
    b = attnkern.attention(q, k, v, dropout_p=0.5)
    c = attnkern.attention(q, k, v, dropout_p=0.5)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    torch = pytest.importorskip("torch")
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    torch.manual_seed(8)
    a = attnkern.attention(tq, tk, tv, dropout_p=0.5)
    torch.manual_seed(8)
    b = attnkern.attention(tq, tk, tv, dropout_p=0.5)
    assert torch.equal(a, b)


def test_torch_autograd_regenerates_the_forwards_mask():
    torch = pytest.importorskip("torch")
    q, k, v = inputs((1, 2, 6, 8), (1, 2, 7, 8), np.float64)
    dout = np.random.default_rng(0).standard_normal((1, 2, 6, 8))
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    mask = np.random.default_rng(1).random((6, 7)) < 0.8
    kw = {"dropout_p": 0.3, "dropout_seed": 77, "attn_mask": mask, "causal": "bottom_right"}
    out = attnkern.attention(tq, tk, tv, kernel="native.flash", **kw)
    out.backward(torch.from_numpy(dout))
    np.testing.assert_allclose(out.detach().numpy(), attnkern.reference(q, k, v, **kw), atol=1e-12)
    for g, r in zip((tq.grad, tk.grad, tv.grad), attnkern.reference_backward(q, k, v, dout, **kw)):
        np.testing.assert_allclose(g.numpy(), r, atol=1e-12)


def test_kernels_without_dropout_refuse_it():
    q, k, v = inputs((1, 2, 4, 8), (1, 2, 4, 8), np.float32)
    assert "native.flash" in DROPOUT and "numpy.naive" in DROPOUT
    for name in attnkern.kernels():
        info = attnkern.kernel_info(name)
        if info["available"] and info["device"] == "cpu" and name not in DROPOUT:
            with pytest.raises(ValueError, match="dropout.*native.flash"):
                attnkern.attention(q, k, v, dropout_p=0.1, dropout_seed=1, kernel=name)


@pytest.mark.parametrize("kw, error, words", [
    ({"dropout_p": 1.0}, ValueError, r"\[0, 1\)"),
    ({"dropout_p": -0.1}, ValueError, r"\[0, 1\)"),
    ({"dropout_p": "0.1"}, TypeError, "number"),
    ({"dropout_p": True}, TypeError, "number"),
    ({"dropout_p": 0.1, "dropout_seed": 1.5}, TypeError, "integer"),
    ({"dropout_p": 0.1, "dropout_seed": True}, TypeError, "integer"),
])
def test_bad_dropout_arguments_say_what_to_fix(kw, error, words):
    q, k, v = inputs((1, 2, 4, 8), (1, 2, 4, 8), np.float32)
    with pytest.raises(error, match=words):
        attnkern.attention(q, k, v, **kw)


def test_torch_tensors_take_seeds_up_to_2_64():
    """A seed of 2^63 or more (the API takes seeds mod 2^64) also passes through the torch op
    (an int64 tensor holds it as its two's complement): the NumPy call's output."""
    torch = pytest.importorskip("torch")
    q, k, v = inputs((1, 2, 9, 8), (1, 2, 10, 8), np.float32)
    for seed in (2**64 - 3, 2**63, 2**63 - 1):
        want = attnkern.attention(q, k, v, kernel="native.flash", dropout_p=0.4, dropout_seed=seed)
        got = attnkern.attention(*(torch.from_numpy(x) for x in (q, k, v)), kernel="native.flash", dropout_p=0.4,
                                 dropout_seed=seed)
        np.testing.assert_array_equal(got.numpy(), want)


def test_the_backward_needs_the_forwards_seed():
    q, k, v = inputs((1, 2, 4, 8), (1, 2, 4, 8), np.float32)
    out, lse = attnkern.attention(q, k, v, dropout_p=0.2, dropout_seed=1, return_lse=True)
    with pytest.raises(ValueError, match="dropout_seed is required"):
        attnkern.attention_backward(q, k, v, out, out, lse, dropout_p=0.2)


@pytest.mark.parametrize("kind", ["bfloat16", "float16"])
def test_half_forward_with_dropout_mask_and_alibi(kind):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from attnkern_bench.accuracy import kernel_tolerance

    dtype = np.dtype(ml_dtypes.bfloat16) if kind == "bfloat16" else np.dtype(np.float16)
    q, k, v = (x.astype(dtype) for x in inputs((2, 4, 9, 16), (2, 4, 11, 16), np.float32))
    kw = {"dropout_p": 0.3, "dropout_seed": 4, "causal": "bottom_right", "alibi_slopes": np.full(4, 0.1),
          "attn_mask": np.random.default_rng(0).random((9, 11)) < 0.8}
    out = attnkern.attention(q, k, v, kernel="native.flash", **kw)
    ref = attnkern.reference(q, k, v, **kw)
    bound = kernel_tolerance("native.flash", dtype, None) / 0.7 * max(1.0, np.abs(ref).max()) * conditioning(q, k)
    assert np.abs(out.astype(np.float64) - ref).max() <= bound


def test_cuda_flash_has_dropout_in_every_dtype():
    """cuda.flash has dropout in all four dtypes (float16/bfloat16 on its CUDA C++ tensor-core
    kernels, float32/float64 on its Numba kernels), forward and backward: no per-dtype limit on
    dropout in the registry or kernel_info, and auto may pick it for a half call with dropout."""
    from attnkern import _registry

    flash = _registry.get("cuda.flash")
    assert "dropout" in flash.features and "dropout" in flash.features_of_backward()
    # every dtype but FP8's forward (float8_e4m3fn), which has no features but grouped k/v heads and bottom-right
    assert flash.feature_dtypes["dropout"] == ("float32", "float64", "float16", "bfloat16")
    for dtype in ("float32", "float64", "float16", "bfloat16"):
        assert "dropout" in flash.features_in(dtype)
        assert not [r for r in flash.not_supported_reasons(dtype=dtype, features=frozenset({"dropout", "gqa"}),
                                                            backward=True) if r[0] == "features"]
        assert "cuda.flash" in _registry.supporting(frozenset({"dropout"}), backward=True, dtype=dtype)
    for k in attnkern.kernels():
        info = attnkern.kernel_info(k)
        only = set(info["feature_dtypes"].get("dropout", info["dtypes"]))
        assert only == set(info["dtypes"]) - {"float8_e4m3fn"}, k


def test_autocast_policy_computes_dropout_where_the_kernel_has_it():
    """Under autocast the op computes in the region's dtype only where the kernel (auto:
    those auto picks on that device) has dropout in it, else in float32: cuda.flash has
    it in float16 and bfloat16 too."""
    from attnkern import _api

    assert _api._dropout_takes("auto", "float16", "cuda")
    assert _api._dropout_takes("cuda.flash", "bfloat16", "cuda")
    assert _api._dropout_takes("cuda.flash", "float32", "cuda")
    assert _api._dropout_takes("auto", "bfloat16", "cpu")
    assert not _api._dropout_takes("torch.sdpa", "bfloat16", "cpu")
    assert not _api._dropout_takes("no.such.kernel", "float32", "cpu")


# ---------------------------------------------------------------- cuda.flash in float16/bfloat16 (a GPU only)
# flash_mma.cu's and flash_bwd_mma.cu's dropout variants: the simulator runs no CUDA C++, so these
# run with ATTNKERN_TEST_GPU=1 on a GPU (on Hopper too, where dropout runs mma.sync, not wgmma).
SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
half_gpu = pytest.mark.skipif(SIMULATED, reason="cuda.flash's float16/bfloat16 kernels are CUDA C++ (a GPU only)")


@half_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_flash_half_mask_is_the_cpus_bit_for_bit(dtype):
    """q = 0 (P = 1/nk) and v = the identity (nk = D = 128): out = Z / nk, the forward's keep
    mask read back, equals attnkern._philox's for every folded batch row, each kept element
    exactly 1 / (1 - p) in the dtype over nk, and the keep rate lies within a binomial bound;
    dout = the identity (nq = D) reads the backward's mask back from dv = (P Z)^T dO."""
    import torch

    n, tdt = 128, getattr(torch, dtype)
    for p, seed in ((0.3, 2**40 + 12345), (0.75, 2**64 - 3)):
        q = torch.zeros((2, 3, n, n), dtype=tdt, device="cuda")
        k = torch.ones_like(q)
        eye = torch.eye(n, dtype=tdt, device="cuda").expand(2, 3, n, n).contiguous()
        out, lse = attnkern.attention(q, k, eye, kernel="cuda.flash", dropout_p=p, dropout_seed=seed,
                                      return_lse=True)
        got = out.float().cpu().numpy().reshape(6, n, n)
        b, i, j = np.ogrid[:6, :n, :n]
        want = _philox.keep(seed, p, b, i, j)
        np.testing.assert_array_equal(got > 0, want)
        z = float(torch.tensor(1 / (1 - p), dtype=tdt))
        assert (got[want] == z / n).all() and not got[~want].any()
        assert abs(want.sum() - want.size * (1 - p)) <= 6 * np.sqrt(want.size * p * (1 - p))
        dv = attnkern.attention_backward(q, k, eye, out, eye, lse, kernel="cuda.flash", dropout_p=p,
                                         dropout_seed=seed)[2]
        back = dv.float().cpu().numpy().reshape(6, n, n).transpose(0, 2, 1)  # dv[j, i] = Z_ij / nq
        np.testing.assert_array_equal(back > 0, want)


# (lead, H_kv, nq, nk, D, keywords, bool mask): GQA with causal, D 64 and 128, MQA with every feature
HALF_CASES = {
    "gqa-causal-d64": ((2, 4), 2, 150, 197, 64, dict(causal=True, dropout_p=0.2, dropout_seed=7), False),
    "d128": ((1, 2), 2, 77, 300, 128, dict(dropout_p=0.5, dropout_seed=2**64 - 7), False),
    "gqa-d128-bottom_right": ((2, 2), 1, 130, 129, 128, dict(causal="bottom_right", dropout_p=0.1,
                                                             dropout_seed=12), False),
    "mqa-everything": ((2, 4), 1, 70, 190, 64, dict(causal="bottom_right", window=(40, 0), key_lengths=[190, 25],
                                                     softcap=3.0, alibi_slopes=[0.5, 0.25, 0.125, 0.0625],
                                                     dropout_p=0.3, dropout_seed=2**63 + 5), True),
}


@half_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", HALF_CASES)
def test_cuda_flash_half_dropout_by_flash_attentions_rule(dtype, name):
    """cuda.flash's float16/bfloat16 forward and backward with dropout against the float64
    reference with the same Philox mask, by FlashAttention's rule (at most twice the error
    of torch ops in the same dtype with that mask, plus two roundings of the largest value);
    bit-identical repeats; another seed gives another output; torch autograd gives
    attention_backward's gradients; auto picks cuda.flash."""
    import torch
    from test_cuda_backward import _half_case, _mask_peer
    from test_features import err

    from attnkern_bench.accuracy import UNIT_ROUNDOFF

    lead, h_kv, nq, nk, d, kw, masked = HALF_CASES[name]
    q, k, v, dout = _half_case(torch, dtype, lead, nq, nk, d, zlib.crc32(name.encode()) % 1000, kv_heads=h_kv)
    mask = np.random.default_rng(3).random((nq, nk)) < 0.8 if masked else np.ones((nq, nk), bool)
    if masked:
        kw = dict(kw, attn_mask=mask)
    host = [x.double().cpu().numpy() for x in (q, k, v, dout)]
    refs = [attnkern.reference(*host[:3], **kw), *attnkern.reference_backward(*host, **kw)]
    peer = _mask_peer(q, k, v, dout, mask, kw)
    gkw = dict(kw, attn_mask=torch.from_numpy(mask).cuda()) if masked else kw
    out, lse = attnkern.attention(q, k, v, kernel="cuda.flash", return_lse=True, **gkw)
    grads = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="cuda.flash", **gkw)
    u = UNIT_ROUNDOFF[dtype]
    for what, r, p, a in zip(("out", "dq", "dk", "dv"), refs, peer, (out, *grads)):
        a = a.double().cpu().numpy()
        assert a.shape == r.shape and np.isfinite(a).all(), what
        limit = 2 * err(p, r) + 2 * u * max(1.0, np.abs(r).max())
        assert err(a, r) <= limit, f"{what}: {err(a, r):.3g} > {limit:.3g}"
    again = attnkern.attention(q, k, v, kernel="cuda.flash", return_lse=True, **gkw)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)
    regrads = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="cuda.flash", **gkw)
    assert all(torch.equal(a, b) for a, b in zip(grads, regrads))
    other = attnkern.attention(q, k, v, kernel="cuda.flash", **dict(gkw, dropout_seed=kw["dropout_seed"] - 1))
    assert not torch.equal(other, out)
    assert torch.equal(attnkern.attention(q, k, v, **gkw), out)  # auto: cuda.flash
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    attnkern.attention(*leaves, kernel="cuda.flash", **gkw).backward(dout)
    assert all(torch.equal(g, leaf.grad) for g, leaf in zip(grads, leaves))


@half_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_flash_half_dropout_with_unaligned_key_counters(dtype):
    """attention_varlen on cuda.flash (packed sequences in one launch) offsets the Philox
    counters by each sequence's first packed query and key: keys starting at 5 (not a
    multiple of 4) take the kernels' path that draws each element alone. Forward and
    gradients against the float64 reference of each sequence with the same counters; the
    keep mask read back bit for bit."""
    import ml_dtypes
    from test_varlen import packed, per_sequence

    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
    lens_q, lens_k = [3, 45, 0, 20], [5, 18, 9, 0]  # 32 keys in all
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, heads=4, heads_kv=2, d=32, dv=32, dtype=np.float32, seed=5)
    q, k, v = (x.astype(np_dtype) for x in (q, k, v))
    dout = np.random.default_rng(6).standard_normal((q.shape[0], 4, 32)).astype(np_dtype)
    kw = dict(causal="bottom_right", dropout_p=0.4, dropout_seed=99)
    out, lse = attnkern.attention_varlen(q, k, v, cu_q, cu_k, kernel="cuda.flash", return_lse=True, **kw)
    grads = attnkern.attention_varlen_backward(q, k, v, out, dout, lse, cu_q, cu_k, kernel="cuda.flash", **kw)
    host = [x.astype(np.float64) for x in (q, k, v, dout)]
    ref, _, ref_grads = per_sequence(*host[:3], cu_q, cu_k, host[3], **kw)
    assert_close(out, ref, host[0], host[1], np_dtype, factor=1 / 0.6, what="out")
    for g, r, name in zip(grads, ref_grads, ("dq", "dk", "dv")):
        assert_close(g, r, host[0], host[1], np_dtype, factor=8 * np.abs(host[3]).max() / 0.6, what=name)
    # the mask: q = 0 (P = 1 / len_k), v = the identity over the 32 packed keys (D = 32)
    zq = np.zeros_like(q)
    eye = np.broadcast_to(np.eye(32)[:, None, :], (32, 2, 32)).astype(np_dtype)
    got = attnkern.attention_varlen(zq, np.ones_like(k), eye, cu_q, cu_k, kernel="cuda.flash", dropout_p=0.4,
                                    dropout_seed=99)  # no causal mask: every key is seen
    for s in range(len(lens_q)):
        i, j = np.arange(cu_q[s], cu_q[s + 1]), np.arange(cu_k[s], cu_k[s + 1])
        if not i.size or not j.size:
            continue
        expect = _philox.keep(99, 0.4, np.arange(4)[None, :, None], i[:, None, None], j[None, None, :])
        np.testing.assert_array_equal(got[i][:, :, j].astype(np.float32) > 0, expect)
