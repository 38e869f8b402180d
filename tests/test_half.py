"""float16 and bfloat16 in native.flash and native.tiled, on every instruction set
this machine has (ATTNKERN_ISA forces each path: the converting one on generic,
avx2 and avx512, vdpbf16ps dot products for bfloat16 flash on avx512bf16).

Accuracy. Inputs are drawn in float64 and rounded to the half dtype; the
reference is computed in float64 on those rounded inputs, so the error measured
is the kernel's own. The bounds are attnkern_bench.accuracy's (its docstring
derives them): products, softmax and accumulators are float32, so what remains
is rounding to the half dtype, with unit roundoff u = 2^-8 (bfloat16) or 2^-11
(float16): the output is rounded once (u), and the vdpbf16ps and AMX paths
(bfloat16 flash on avx512bf16 and amx) also round each probability to bfloat16
before P V (about 2u more). So max|out - ref| <= 2u * max(1, max|v|) * kappa on
the converting paths and 4u on the rounding ones; the log-sum-exp, rounded once
(plus u from the rounded row sum on the bfloat16 path), within 2u of the
reference, row by row, relative to max(1, |ref|).
"""

import ml_dtypes
import numpy as np
import pytest
import torch

import attnkern
from attnkern.backends.native import _attn
from conftest import ISAS, assert_lse_matches_reference, assert_matches_reference, forced_isa, random_qkv

BF16, F16 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)
HALF_KERNELS = ["native.flash", "native.tiled"]


def check_half(out, lse, q, k, v, causal, kernel, isa, scale=None):
    assert out.dtype == q.dtype and lse.dtype == q.dtype
    assert_matches_reference(out, q, k, v, causal=causal, scale=scale, kernel=kernel, isa=isa)
    assert_lse_matches_reference(lse, q, k, causal=causal, scale=scale)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kernel", HALF_KERNELS)
@pytest.mark.parametrize("causal", [False, True])
def test_half_matches_float64_reference(dtype, isa, kernel, causal):
    rng = np.random.default_rng(abs(hash((dtype.name, isa, kernel, causal))) % 2**32)
    # odd sizes: a partial last key block of odd length, odd D (a zero-padded pair), Dv
    # past one register tile, more query rows than one block
    for nq, nk, d, dv, bq, bk in [(70, 45, 33, 40, 16, 40), (37, 37, 64, 64, 8, 16), (5, 200, 7, 3, 256, 64)]:
        q, k, v = random_qkv(rng, (2,), nq, nk, d, dv, dtype=dtype)
        with forced_isa(isa):
            out, lse = attnkern.attention(q, k, v, causal=causal, kernel=kernel, block_q=bq, block_k=bk,
                                          num_threads=2, return_lse=True)
        check_half(out, lse, q, k, v, causal, kernel, isa)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("isa", ISAS)
def test_half_scale_and_magnitude(dtype, isa):
    """A sharper softmax (larger inputs, another scale) stays within the bound, kappa included."""
    q, k, v = random_qkv(7, (3,), 50, 70, 16, dtype=dtype, magnitude=3.0)
    with forced_isa(isa):
        out, lse = attnkern.attention(q, k, v, scale=0.4, kernel="native.flash", block_q=32, block_k=32,
                                      return_lse=True)
    check_half(out, lse, q, k, v, False, "native.flash", isa, scale=0.4)


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bfloat16", "float16"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kernel", HALF_KERNELS)
def test_half_bit_identical_for_every_thread_count(dtype, isa, kernel):
    q, k, v = random_qkv(11, (3,), 150, 150, 32, dtype=dtype)
    with forced_isa(isa):
        runs = [attnkern.attention(q, k, v, causal=causal, kernel=kernel, block_q=32, block_k=48, num_threads=t,
                                   return_lse=True)
                for causal in (False, True) for t in (1, 2, 3)]
    for i in (0, 3):
        for other in runs[i + 1:i + 3]:
            assert np.array_equal(runs[i][0].view(np.uint16), other[0].view(np.uint16))
            assert np.array_equal(runs[i][1].view(np.uint16), other[1].view(np.uint16))


def test_four_dimensional_input_and_auto_kernel():
    q, k, v = random_qkv(3, (2, 2), 40, 40, 16, dtype=BF16)
    out = attnkern.attention(q, k, v)  # kernel="auto": native.flash takes bfloat16
    assert out.shape == (2, 2, 40, 16) and out.dtype == BF16
    assert np.array_equal(out.view(np.uint16), attnkern.attention(q, k, v, kernel="native.flash").view(np.uint16))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_torch_half_tensors(dtype):
    q, k, v = random_qkv(5, (2,), 33, 47, 24, dtype=BF16 if dtype == "bfloat16" else F16)
    as_torch = (lambda x: torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)) if dtype == "bfloat16" \
        else torch.from_numpy
    qt, kt, vt = map(as_torch, (q, k, v))
    out, lse = attnkern.attention(qt, kt, vt, causal=True, kernel="native.flash", return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == getattr(torch, dtype) and lse.dtype == out.dtype
    expected, expected_lse = attnkern.attention(q, k, v, causal=True, kernel="native.flash", return_lse=True)
    assert np.array_equal(out.view(torch.int16).numpy(), expected.view(np.int16))
    assert np.array_equal(lse.view(torch.int16).numpy(), expected_lse.view(np.int16))


HALF_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_meets_flashattentions_rule(dtype, causal):
    """Half-precision gradients through autograd against the float64 gradient of the
    rounded inputs, by FlashAttention's rule: error <= 2x torch SDPA's own error in
    the same dtype + atol (u * max(1, max|ref|), one rounding of the result)."""
    from attnkern_bench.accuracy import UNIT_ROUNDOFF, reference_backward

    gen = torch.Generator().manual_seed(7)
    tdt = HALF_TORCH[dtype]
    for shape, blocks in (((1, 2, 200, 40), (64, 48)), ((2, 1, 96, 16), (256, 256)), ((1, 2, 160, 64), (64, 96))):
        q, k, v, dout = (torch.randn(shape, generator=gen, dtype=torch.float64).to(tdt) for _ in range(4))
        ref = reference_backward(*(x.double().numpy() for x in (q, k, v, dout)), causal=causal)
        ours = [x.clone().requires_grad_() for x in (q, k, v)]
        attnkern.attention(*ours, causal=causal, kernel="native.flash", block_q=blocks[0],
                           block_k=blocks[1]).backward(dout)
        theirs = [x.clone().requires_grad_() for x in (q, k, v)]
        torch.nn.functional.scaled_dot_product_attention(*theirs, is_causal=causal).backward(dout)
        for name, a, t, r in zip(("dq", "dk", "dv"), ours, theirs, ref):
            assert a.grad.dtype == tdt and a.grad.shape == a.shape
            err = np.abs(a.grad.double().numpy() - r).max()
            bound = 2 * np.abs(t.grad.double().numpy() - r).max() + UNIT_ROUNDOFF[dtype] * max(1, np.abs(r).max())
            assert err <= bound, f"{name} {shape} causal={causal}: error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("isa", ISAS)
def test_half_backward_is_bit_identical_for_every_thread_count_and_as_attention_backward(isa):
    rng = np.random.default_rng(8)
    q, k, v = random_qkv(rng, (2,), 70, 90, 24, 16, BF16)
    dout = rng.standard_normal((2, 70, 16)).astype(BF16)
    with forced_isa(isa):
        out, lse = attnkern.attention(q, k, v, causal=True, kernel="native.flash", return_lse=True)
        results = [attnkern.attention_backward(q, k, v, out, dout, lse, causal=True, kernel="native.flash",
                                               block_q=16, block_k=32, num_threads=t) for t in (1, 2, 3)]
        for other in results[1:]:
            for a, b in zip(results[0], other):
                assert a.dtype == BF16 and np.array_equal(a.view(np.uint16), b.view(np.uint16))
        # the caller's lse (rounded to bfloat16) against the float64 gradient
        from attnkern_bench.accuracy import reference_backward
        ref = reference_backward(*(x.astype(np.float64) for x in (q, k, v, dout)), causal=True)
        for got, r in zip(results[0], ref):
            assert np.abs(got.astype(np.float64) - r).max() <= 0.05 * max(1, np.abs(r).max())


def test_torch_backward_in_bfloat16_and_under_autocast():
    """bfloat16 CPU tensors train through native.flash's backward, also when
    torch.autocast(cpu, bfloat16) makes them; gradients come back in bfloat16."""
    torch.manual_seed(9)
    lin = torch.nn.Linear(16, 48)
    x = torch.randn(2, 30, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v = lin(x).reshape(2, 30, 3, 16).unbind(2)
        assert q.dtype == torch.bfloat16
        out = attnkern.attention(q, k, v, causal=True, kernel="native.flash")
    out.float().square().sum().backward()
    grad = lin.weight.grad.clone()
    lin.zero_grad()
    q, k, v = lin(x).reshape(2, 30, 3, 16).unbind(2)
    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).square().sum().backward()
    assert torch.isfinite(grad).all()
    assert (grad - lin.weight.grad).abs().max() <= 0.05 * lin.weight.grad.abs().max()


def test_naive_refuses_half_precision():
    q, k, v = random_qkv(1, (1,), 8, 8, 4, dtype=F16)
    with pytest.raises(TypeError, match="native.naive does not take float16"):
        attnkern.attention(q, k, v, kernel="native.naive")
    with pytest.raises(ValueError, match="native.naive takes float32 and float64 only"):
        _attn.forward_half("naive", "generic", "float16", *(x.view(np.uint16) for x in (q, k, v, q)),
                           False, 0.5, 8, 8, 1)


def _edge_floats():
    """Float32 values around every rounding boundary of both half formats, plus random ones."""
    rng = np.random.default_rng(0)
    bits = np.concatenate([
        np.arange(0, 2**32, 4099, dtype=np.uint64).astype(np.uint32),  # a sweep of all exponents
        rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32),
    ])
    x = bits.view(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, 65504, 65519.99, 65520, 65536, 6.1e-5, 5.96e-8, 2.98e-8,
                        2.99e-8, 1e-10, 3.3895314e38, 3.4e38], np.float32)
    x = np.concatenate([x[np.isfinite(x) | np.isinf(x)], special, -special])
    return np.ascontiguousarray(x)


@pytest.mark.parametrize("isa", ISAS)
def test_conversions_round_like_numpy(isa):
    """Each unit's conversions (portable C on generic, F16C for float16 elsewhere) round
    to nearest even exactly as NumPy and ml_dtypes do, and widen every float16 exactly."""
    x = _edge_floats()
    for kind, dtype in (("bfloat16", BF16), ("float16", F16)):
        bits, back = _attn.convert_half(isa, kind, x)
        with np.errstate(over="ignore"):  # float32 beyond float16's range becomes infinity, as it should
            expected = x.astype(dtype).view(np.uint16)
        assert np.array_equal(bits, expected), kind
        assert np.array_equal(back, bits.view(dtype).astype(np.float32)), kind
    every = np.arange(2**16, dtype=np.uint16).view(F16)
    every = every[np.isfinite(every)]
    bits, back = _attn.convert_half(isa, "float16", every.astype(np.float32))
    assert np.array_equal(bits, every.view(np.uint16)) and np.array_equal(back, every.astype(np.float32))
    nan = np.array([np.nan], np.float32)
    for kind, dtype in (("bfloat16", BF16), ("float16", F16)):
        assert np.isnan(_attn.convert_half(isa, kind, nan)[1]).all()


def test_amx_says_why_it_cannot_run_here():
    # the amx ISA needs AMX-TILE, AMX-BF16 and the OS's tile data permission; without them
    # it is listed but not supported, with a reason, and forcing it is a RuntimeError
    assert "amx" in _attn.ISAS
    if "amx" in attnkern.supported_isas():
        assert _attn.isa_reason("amx") == ""
        return
    reason = _attn.isa_reason("amx")
    assert reason and attnkern.active_isa() != "amx"
    q = np.ones((1, 8, 4), BF16)
    with forced_isa("amx"), pytest.raises(RuntimeError, match="ATTNKERN_ISA='amx'.*not supported"):
        attnkern.attention(q, q, q, kernel="native.flash")


@pytest.mark.parametrize("isa", ISAS)
def test_half_backward_keeps_the_lse_of_longer_rows(isa):
    """attention_backward with out and lse of whole rows and k, v one block of their keys
    (a ring step): the given lse is not the block's own, so the half backward uses it as
    given, and equals the float32 backward of the widened arrays rounded to bfloat16
    (on avx512bf16, whose bfloat16 backward rounds P and dS to bfloat16 for its products,
    within that rounding); with the block's own (rounded) lse it uses its float32
    recomputation instead."""
    rng = np.random.default_rng(10)
    q, k, v = random_qkv(rng, (2,), 40, 64, 16, 8, BF16)
    dout = rng.standard_normal((2, 40, 8)).astype(BF16)
    with forced_isa(isa):
        out, lse = attnkern.attention(q, k, v, kernel="native.flash", return_lse=True)
        block = (q, k[:, :32], v[:, :32])
        half = attnkern.attention_backward(*block, out, dout, lse, kernel="native.flash")
        wide = attnkern.attention_backward(*(x.astype(np.float32) for x in (*block, out, dout, lse)),
                                           kernel="native.flash")
        for h, w in zip(half, wide):
            if isa == "avx512bf16":
                assert np.abs(h.astype(np.float64) - w).max() <= 2 ** -6 * max(1, np.abs(w).max())
            else:
                assert np.array_equal(h.view(np.uint16), w.astype(BF16).view(np.uint16))
        own = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="native.flash")
        plain = attnkern.attention_backward(*(x.astype(np.float32) for x in (q, k, v, out, dout, lse)),
                                            kernel="native.flash")
        assert any(not np.array_equal(h.view(np.uint16), w.astype(BF16).view(np.uint16)) for h, w in zip(own, plain))


@pytest.mark.skipif(not {"avx512", "avx512bf16"} <= set(ISAS), reason="needs AVX512_BF16 (vdpbf16ps)")
@pytest.mark.parametrize("shape, features", [
    ((2, 2, 150, 64), {}),                                         # full panels: the vector packs
    ((1, 3, 77, 40), {"causal": True}),                            # odd rows, d not a multiple of 32
    ((2, 4, 96, 32), {"causal": "bottom_right", "window": (40, 0), "softcap": 20.0}),  # features, GQA below
])
def test_bfloat16_backward_on_dot_products(shape, features):
    """bfloat16's backward on avx512bf16 takes its five products on vdpbf16ps pairs (P and dS
    rounded to bfloat16, float32 sums): its gradients differ from the float32 products'
    (avx512) but meet the same bound against the float64 gradient (8 unit roundoffs of
    the largest), and are bit-identical for every thread count, with grouped k/v heads and
    features too. FlashAttention's rule against torch: test_backward_meets_flashattentions_rule."""
    from attnkern_bench.accuracy import UNIT_ROUNDOFF

    rng = np.random.default_rng(11)
    b, h, n, d = shape
    hkv = h // 2 if h % 2 == 0 else h
    q = rng.standard_normal((b, h, n, d)).astype(BF16)
    k, v = (rng.standard_normal((b, hkv, n + 5, d)).astype(BF16) for _ in range(2))
    dout = rng.standard_normal((b, h, n, d)).astype(BF16)
    ref = list(attnkern.reference_backward(*(x.astype(np.float64) for x in (q, k, v, dout)), **features))
    for i in (1, 2):  # per query head: dk and dv of a k/v head sum over the query heads it serves
        ref[i] = ref[i].reshape(b, hkv, h // hkv, *ref[i].shape[2:]).sum(axis=2) if ref[i].shape[1] != hkv else ref[i]
    grads = {}
    for isa in ("avx512", "avx512bf16"):
        with forced_isa(isa):
            out, lse = attnkern.attention(q, k, v, kernel="native.flash", return_lse=True, **features)
            runs = [attnkern.attention_backward(q, k, v, out, dout, lse, kernel="native.flash", block_q=64,
                                               block_k=48, num_threads=t, **features) for t in (1, 2, 3)]
        for other in runs[1:]:
            assert all(np.array_equal(a.view(np.uint16), o.view(np.uint16)) for a, o in zip(runs[0], other))
        grads[isa] = runs[0]
        for name, g, r in zip(("dq", "dk", "dv"), runs[0], ref):
            assert g.dtype == BF16 and g.shape == r.shape
            err = np.abs(g.astype(np.float64) - r).max()
            assert err <= 8 * UNIT_ROUNDOFF["bfloat16"] * max(1, np.abs(r).max()), (isa, name, err)
    assert any(not np.array_equal(a.view(np.uint16), o.view(np.uint16))
               for a, o in zip(grads["avx512"], grads["avx512bf16"]))


def test_amx_backward_is_refused_where_amx_cannot_run():
    """The amx unit's backward (float32 products: no tiles in the backward yet) runs only
    where AMX runs; elsewhere forcing it says why, as the forward does."""
    if "amx" in attnkern.supported_isas():
        pytest.skip("AMX runs here")
    q = np.ones((1, 8, 4), BF16)
    out, lse = attnkern.attention(q, q, q, kernel="native.flash", return_lse=True)
    with forced_isa("amx"), pytest.raises(RuntimeError, match="ATTNKERN_ISA='amx'.*not supported"):
        attnkern.attention_backward(q, q, q, out, q, lse, kernel="native.flash")
