"""alibi_slopes (FlashAttention's ALiBi): -slope * |i + Nk - Nq - j| added to the score of
query i and key j (Nk: the sequence's key length), per head or per (sequence, head);
native.flash forward and backward against the float64 reference, the reference against
the formula written here as an explicit additive mask, varlen, and the errors."""

import numpy as np
import pytest

import attnkern
from attnkern_bench.accuracy import conditioning, tolerance
from conftest import ISAS, forced_isa


def assert_close(got, ref, q, k, dtype, factor=1.0, what=""):
    bound = tolerance(dtype) * factor * max(1.0, np.abs(ref).max(initial=0)) * conditioning(q, k)
    err = np.abs(np.asarray(got, np.float64) - ref).max(initial=0)
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


def inputs(nq, nk, dtype, seed=0, heads=4, heads_kv=2):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((2, heads, nq, 8)).astype(dtype), rng.standard_normal((2, heads_kv, nk, 8)).astype(dtype),
            rng.standard_normal((2, heads_kv, nk, 5)).astype(dtype), rng.uniform(0.01, 1.0, (2, heads)))


@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("per", ["head", "sequence"])
def test_the_reference_is_the_formula_as_an_additive_mask(causal, per):
    q, k, v, slopes = inputs(5, 9, np.float64)
    slopes = slopes[0] if per == "head" else slopes
    i, j = np.arange(5)[:, None], np.arange(9)[None, :]
    bias = -np.broadcast_to(slopes, (2, 4))[..., None, None] * np.abs(i + 9 - 5 - j)
    expect = attnkern.reference(q, k, v, causal=causal, attn_mask=bias)
    np.testing.assert_allclose(attnkern.reference(q, k, v, causal=causal, alibi_slopes=slopes), expect, atol=1e-14)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kw", [{}, {"causal": True}, {"causal": "bottom_right", "key_lengths": [9, 4]},
                                {"window": (3, 2), "softcap": 5.0, "dropout_p": 0.2, "dropout_seed": 3}])
def test_native_forward_and_backward(isa, dtype, kw):
    q, k, v, slopes = inputs(7, 9, dtype)
    kw = {"alibi_slopes": slopes, **kw}
    dout = np.random.default_rng(1).standard_normal((2, 4, 7, 5)).astype(dtype)
    with forced_isa(isa):
        out, lse = attnkern.attention(q, k, v, kernel="native.flash", return_lse=True, block_q=3, block_k=4, **kw)
        grads = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="native.flash", block_q=3, block_k=4,
                                            **kw)
    assert_close(out, attnkern.reference(q, k, v, **kw), q, k, dtype, factor=2, what="out")
    for g, r, name in zip(grads, attnkern.reference_backward(q, k, v, dout, **kw), ("dq", "dk", "dv")):
        assert_close(g, r, q, k, dtype, factor=16 * np.abs(dout).max(), what=name)
    np.testing.assert_allclose(attnkern.attention(q, k, v, kernel="numpy.naive", **kw),
                               attnkern.reference(q, k, v, **kw), atol=50 * tolerance(dtype))


def test_varlen_slopes_per_head_and_per_sequence():
    rng = np.random.default_rng(2)
    cu_q, cu_k = np.array([0, 3, 8]), np.array([0, 6, 10])
    q, k, v = rng.standard_normal((8, 4, 8)), rng.standard_normal((10, 2, 8)), rng.standard_normal((10, 2, 8))
    for slopes in (rng.uniform(0, 1, 4), rng.uniform(0, 1, (2, 4))):
        kw = {"alibi_slopes": slopes, "causal": "bottom_right"}
        out, lse = attnkern.attention_varlen(q, k, v, cu_q, cu_k, kernel="native.flash", return_lse=True, **kw)
        dout = rng.standard_normal(out.shape)
        grads = attnkern.attention_varlen_backward(q, k, v, out, dout, lse, cu_q, cu_k, kernel="native.flash", **kw)
        for s in range(2):
            (a, b), (c, e) = cu_q[s:s + 2], cu_k[s:s + 2]
            sq, sk, sv, sd = (x[lo:hi].transpose(1, 0, 2) for x, lo, hi in ((q, a, b), (k, c, e), (v, c, e),
                                                                           (dout, a, b)))
            sk_kw = {"alibi_slopes": slopes if slopes.ndim == 1 else slopes[s], "causal": "bottom_right"}
            np.testing.assert_allclose(out[a:b].transpose(1, 0, 2), attnkern.reference(sq, sk, sv, **sk_kw),
                                       atol=1e-12)
            for g, r, lo, hi in zip(grads, attnkern.reference_backward(sq, sk, sv, sd, **sk_kw), (a, c, c),
                                    (b, e, e)):
                np.testing.assert_allclose(g[lo:hi].transpose(1, 0, 2), r, atol=1e-12)


@pytest.mark.parametrize("slopes, error, words", [
    (np.ones(3), ValueError, r"shape \(4,\) or \(2, 4\)"),
    (np.ones((3, 4)), ValueError, r"shape \(4,\) or \(2, 4\)"),
    (np.array([1.0, np.nan, 1, 1]), ValueError, "finite"),
    (np.array(["a"] * 4), TypeError, "real numbers"),
])
def test_bad_slopes_say_what_to_fix(slopes, error, words):
    q, k, v, _ = inputs(3, 3, np.float32)
    with pytest.raises(error, match=words):
        attnkern.attention(q, k, v, alibi_slopes=slopes)


def test_torch_sdpa_refuses_alibi_and_auto_runs_it():
    q, k, v, slopes = inputs(3, 3, np.float32)
    assert "alibi" not in attnkern.kernel_info("torch.sdpa")["features"]
    if attnkern.kernel_info("torch.sdpa")["available"]:
        with pytest.raises(ValueError, match="ALiBi"):
            attnkern.attention(q, k, v, alibi_slopes=slopes[0], kernel="torch.sdpa")
    attnkern.attention(q, k, v, alibi_slopes=slopes[0])


def test_array_features_are_never_taken_for_neutral():
    """attention()'s CUDA fast paths are taken only when every feature keyword is unused
    (_api._plain). An array there (NumPy slopes beside torch CUDA tensors, a mask) must
    count as used, not be compared elementwise with the neutral value (which raised
    'truth value of an array is ambiguous' instead of running the call)."""
    torch = pytest.importorskip("torch")
    from attnkern import _api

    assert _api._plain({"attn_mask": None, "alibi_slopes": None, "dropout_p": 0.0, "dropout_seed": None})
    assert not _api._plain({"alibi_slopes": np.ones(8)})
    assert not _api._plain({"alibi_slopes": np.ones(1)})
    assert not _api._plain({"attn_mask": torch.zeros(4, 4, dtype=torch.bool)})
    assert not _api._plain({"dropout_p": 0.1})
    assert _api._plain({"dropout_p": np.float32(0.0)})
