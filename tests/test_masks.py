"""attn_mask= (boolean or additive, broadcast as torch SDPA takes it) on every kernel
that has it (kernel_info(name)["features"] lists "mask"), forward and backward,
against the float64 reference (attnkern.reference, which adds the mask to explicit
scores), alone and with the other features; rows the mask hides entirely; torch
tensors and autograd; and the errors that say what to fix."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkern
from attnkern_bench.accuracy import conditioning, kernel_tolerance, tolerance
from conftest import ISAS, forced_isa

MASKED = [k for k in attnkern.kernels() if "mask" in attnkern.kernel_info(k)["features"]
          and attnkern.kernel_info(k)["available"] and attnkern.kernel_info(k)["device"] == "cpu"]
MASKED_BACKWARD = [k for k in MASKED if "mask" in attnkern.kernel_info(k)["backward_features"]]


def assert_close(got, ref, q, k, dtype, factor=1.0, what="", kernel=None):
    bound = (tolerance(dtype) if kernel is None else kernel_tolerance(kernel, dtype, None)) * factor
    bound *= max(1.0, np.abs(ref).max(initial=0)) * conditioning(q, k)
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all(), f"{what}: not finite"
    err = np.abs(got - ref).max(initial=0)
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


def inputs(shape_q, shape_kv, dtype, seed=0, dv=None):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(shape_q).astype(dtype)
    k = rng.standard_normal(shape_kv).astype(dtype)
    v = rng.standard_normal((*shape_kv[:-1], dv or shape_kv[-1])).astype(dtype)
    return q, k, v


def make_mask(kind, shape, dtype, rng):
    """A mask of `shape`: bool (True about 70%), additive float (finite, and -inf where
    a bool would be False), or float with finite values only."""
    keep = rng.random(shape) < 0.7
    if kind == "bool":
        return keep
    if kind == "neginf":
        return np.where(keep, rng.standard_normal(shape), -np.inf).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


MASK_SHAPES = [(2, 3, 5, 7), (1, 3, 5, 7), (2, 1, 1, 7), (5, 7), (7,), (3, 1, 7), (1, 1, 5, 1)]


@pytest.mark.parametrize("kernel", MASKED)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["bool", "neginf", "float"])
@pytest.mark.parametrize("mshape", MASK_SHAPES)
def test_forward_matches_the_reference(kernel, dtype, kind, mshape):
    rng = np.random.default_rng(len(mshape))
    q, k, v = inputs((2, 3, 5, 8), (2, 3, 7, 8), dtype, dv=6)
    mask = make_mask(kind, mshape, dtype, rng)
    ref, ref_lse = attnkern.reference(q, k, v, attn_mask=mask, return_lse=True)
    out, lse = attnkern.attention(q, k, v, attn_mask=mask, kernel=kernel, return_lse=True)
    assert out.dtype == dtype
    assert_close(out, ref, q, k, dtype, what=f"{kernel} out")
    assert (np.isneginf(lse) == np.isneginf(ref_lse)).all()
    fin = np.isfinite(ref_lse)
    assert np.abs(lse[fin] - ref_lse[fin]).max(initial=0) <= 50 * tolerance(dtype) * conditioning(q, k)


def test_a_bool_mask_equals_its_additive_form_and_torch_sdpa():
    torch = pytest.importorskip("torch")
    q, k, v = inputs((2, 3, 5, 8), (2, 3, 7, 8), np.float64)
    mask = np.random.default_rng(3).random((2, 1, 5, 7)) < 0.6
    mask[..., 0] = True  # torch's math kernel gives NaN for a row that sees nothing
    expect = torch.nn.functional.scaled_dot_product_attention(*map(torch.from_numpy, (q, k, v)),
                                                              attn_mask=torch.from_numpy(mask)).numpy()
    for kernel in MASKED:
        got = attnkern.attention(q, k, v, attn_mask=mask, kernel=kernel)
        add = attnkern.attention(q, k, v, attn_mask=np.where(mask, 0.0, -np.inf), kernel=kernel)
        np.testing.assert_allclose(got, expect, atol=1e-12, err_msg=kernel)
        np.testing.assert_array_equal(got, add)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", ["plain", "causal", "bottom_right", "gqa-window", "lengths-softcap"])
def test_native_forward_and_backward_with_the_other_features(isa, dtype, case):
    rng = np.random.default_rng(7)
    q, k, v = inputs((2, 4, 9, 8), (2, 2 if case == "gqa-window" else 4, 13, 8), dtype, dv=5)
    kw = {"attn_mask": make_mask("neginf", (2, 4, 9, 13), dtype, rng)}
    kw.update({"plain": {}, "causal": {"causal": True}, "bottom_right": {"causal": "bottom_right"},
               "gqa-window": {"window": (3, 2)},
               "lengths-softcap": {"key_lengths": [13, 6], "softcap": 3.0}}[case])
    dout = rng.standard_normal((2, 4, 9, 5)).astype(dtype)
    with forced_isa(isa):
        out, lse = attnkern.attention(q, k, v, kernel="native.flash", return_lse=True, block_q=4, block_k=5, **kw)
        grads = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="native.flash", block_q=4, block_k=5,
                                            **kw)
    assert_close(out, attnkern.reference(q, k, v, **kw), q, k, dtype, what="out")
    for g, r, name in zip(grads, attnkern.reference_backward(q, k, v, dout, **kw), ("dq", "dk", "dv")):
        assert g.shape == r.shape
        assert_close(g, r, q, k, dtype, factor=8 * max(1.0, np.abs(dout).max()), what=name)


@pytest.mark.parametrize("kind", ["bfloat16", "float16"])
def test_half_forward_takes_a_mask(kind):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    dtype = np.dtype(ml_dtypes.bfloat16) if kind == "bfloat16" else np.dtype(np.float16)
    q, k, v = inputs((2, 2, 9, 16), (2, 2, 11, 16), np.float32)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    rng = np.random.default_rng(0)
    for mask in (rng.random((9, 11)) < 0.7, rng.standard_normal((2, 1, 9, 11)).astype(np.float32),
                 rng.standard_normal((9, 11)).astype(dtype)):
        out = attnkern.attention(q, k, v, attn_mask=mask, kernel="native.flash", causal=True)
        ref = attnkern.reference(q, k, v, attn_mask=mask, causal=True)
        assert_close(out, ref, q, k, dtype, what=kind, kernel="native.flash")


@pytest.mark.parametrize("kernel", MASKED)
def test_rows_the_mask_hides_get_zero_and_lse_minus_inf(kernel):
    q, k, v = inputs((1, 2, 6, 8), (1, 2, 5, 8), np.float32)
    mask = np.ones((1, 2, 6, 5), bool)
    mask[0, 0, 1] = False
    mask[0, 1, 4] = False
    fmask = np.where(mask, 0, -np.inf).astype(np.float32)
    for m in (mask, fmask):
        out, lse = attnkern.attention(q, k, v, attn_mask=m, kernel=kernel, return_lse=True)
        assert np.isfinite(out).all()
        assert (out[0, 0, 1] == 0).all() and (out[0, 1, 4] == 0).all()
        assert np.isneginf(lse[~mask.any(-1)]).all() and np.isfinite(lse[mask.any(-1)]).all()
        if kernel in MASKED_BACKWARD:
            dq, dk, dv = attnkern.attention_backward(q, k, v, out, np.ones_like(out), lse, attn_mask=m,
                                                     kernel=kernel)
            assert np.isfinite(dq).all() and (dq[0, 0, 1] == 0).all() and (dq[0, 1, 4] == 0).all()


@settings(max_examples=25, deadline=None)
@given(nq=st.integers(1, 12), nk=st.integers(1, 12), heads=st.sampled_from([(2, 2), (4, 2), (3, 1)]),
       dims=st.sampled_from(["full", "heads", "2d", "keys", "queries"]), causal=st.sampled_from([False, True,
                                                                                             "bottom_right"]),
       kind=st.sampled_from(["bool", "neginf", "float"]), dtype=st.sampled_from([np.float32, np.float64]),
       window=st.sampled_from([None, (2, None), (1, 3)]), seed=st.integers(0, 2**16), blocks=st.sampled_from(
           [(1, 1), (3, 2), (16, 16)]))
def test_hypothesis_forward_and_backward(nq, nk, heads, dims, causal, kind, dtype, window, seed, blocks):
    if causal and window is not None:
        window = (window[0], 0)
    rng = np.random.default_rng(seed)
    h, hkv = heads
    q, k, v = inputs((2, h, nq, 8), (2, hkv, nk, 8), dtype, seed=seed, dv=4)
    mshape = {"full": (2, h, nq, nk), "heads": (h, 1, nk), "2d": (nq, nk), "keys": (nk,),
              "queries": (2, 1, nq, 1)}[dims]
    kw = {"attn_mask": make_mask(kind, mshape, dtype, rng), "causal": causal, "window": window}
    dout = rng.standard_normal((2, h, nq, 4)).astype(dtype)
    out, lse = attnkern.attention(q, k, v, kernel="native.flash", return_lse=True, block_q=blocks[0],
                                  block_k=blocks[1], **kw)
    assert_close(out, attnkern.reference(q, k, v, **kw), q, k, dtype, what="out")
    grads = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="native.flash", block_q=blocks[0],
                                        block_k=blocks[1], **kw)
    for g, r, name in zip(grads, attnkern.reference_backward(q, k, v, dout, **kw), ("dq", "dk", "dv")):
        assert_close(g, r, q, k, dtype, factor=8 * max(1.0, np.abs(dout).max()), what=name)


def test_mask_threads_bit_identical():
    q, k, v = inputs((2, 4, 33, 16), (2, 2, 41, 16), np.float32)
    mask = np.random.default_rng(1).standard_normal((2, 1, 33, 41)).astype(np.float32)
    kw = {"attn_mask": mask, "causal": "bottom_right", "kernel": "native.flash", "block_q": 8, "block_k": 16}
    o1, l1 = attnkern.attention(q, k, v, num_threads=1, return_lse=True, **kw)
    o2, l2 = attnkern.attention(q, k, v, num_threads=2, return_lse=True, **kw)
    assert o1.tobytes() == o2.tobytes() and l1.tobytes() == l2.tobytes()
    dout = np.ones_like(o1)
    g1 = attnkern.attention_backward(q, k, v, o1, dout, l1, num_threads=1, **kw)
    g2 = attnkern.attention_backward(q, k, v, o1, dout, l1, num_threads=2, **kw)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(g1, g2))


def test_torch_tensors_and_autograd_pass_the_mask_through():
    torch = pytest.importorskip("torch")
    q, k, v = inputs((1, 2, 6, 8), (1, 2, 7, 8), np.float64)
    mask = np.random.default_rng(2).random((6, 7)) < 0.7
    mask[:, 0] = True
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    out = attnkern.attention(tq, tk, tv, attn_mask=torch.from_numpy(mask), kernel="native.flash", causal=True)
    out.sum().backward()
    eq, ek, ev = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    both = torch.from_numpy(mask) & torch.ones(6, 7, dtype=torch.bool).tril()
    expect = torch.nn.functional.scaled_dot_product_attention(eq, ek, ev, attn_mask=both)
    expect.sum().backward()
    torch.testing.assert_close(out, expect)
    for a, b in ((tq, eq), (tk, ek), (tv, ev)):
        torch.testing.assert_close(a.grad, b.grad)


def test_kernels_without_masks_refuse_and_auto_picks_one_that_has_them():
    q, k, v = inputs((1, 2, 4, 8), (1, 2, 4, 8), np.float32)
    mask = np.ones((4, 4), bool)
    without = [n for n in attnkern.kernels() if "mask" not in attnkern.kernel_info(n)["features"]
               and attnkern.kernel_info(n)["available"] and attnkern.kernel_info(n)["device"] == "cpu"]
    for name in without:
        with pytest.raises(ValueError, match="attention mask.*native.flash"):
            attnkern.attention(q, k, v, attn_mask=mask, kernel=name)
    attnkern.attention(q, k, v, attn_mask=mask)  # auto


@pytest.mark.parametrize("mask, error, words", [
    (np.ones((3, 4), bool), ValueError, "does not broadcast"),
    (np.ones((2, 2, 2, 4, 4), bool), ValueError, "does not broadcast"),
    (np.ones((4, 4), np.int32), TypeError, "bool"),
    (np.ones((4, 4), np.float64), TypeError, "float32"),
    (np.full((4, 4), np.nan, np.float32), ValueError, "NaN"),
    (np.full((4, 4), np.inf, np.float32), ValueError, "infinity"),
])
def test_bad_masks_say_what_to_fix(mask, error, words):
    q, k, v = inputs((1, 2, 4, 8), (1, 2, 4, 8), np.float32)
    with pytest.raises(error, match=words):
        attnkern.attention(q, k, v, attn_mask=mask)
