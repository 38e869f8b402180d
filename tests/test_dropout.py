"""dropout_p / dropout_seed: the Philox4x32-10 mask (attnkern._philox, attn_common.h's
attn_philox) against Random123's known answers; the C kernels' mask bit for bit equal
to NumPy's; forward and backward against the float64 reference, which applies the same
mask (so elementwise, not statistically); determinism across thread counts and runs;
the keep rate and the expectation of the output; seeds from NumPy's and torch's
global generators; the kernels that refuse dropout."""

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


def test_cuda_flash_states_its_dropout_dtypes():
    """cuda.flash has dropout in float32 and float64 only (its Numba kernels; the CUDA
    C++ kernels of float16/bfloat16 have no Philox): the registry says so as data
    (feature_dtypes), refuses half calls with dropout naming the dtypes, leaves it out
    of the kernels named for a half call with dropout, and kernel_info shows it."""
    from attnkern import _registry

    flash = _registry.get("cuda.flash")
    assert "dropout" in flash.features and "dropout" in flash.features_of_backward()
    assert flash.feature_dtypes == {"dropout": ("float32", "float64")}
    for dtype in ("float32", "float64"):
        assert "dropout" in flash.features_in(dtype)
        assert not [r for r in flash.not_supported_reasons(dtype=dtype, features=frozenset({"dropout"}), backward=True)
                    if r[0] == "features"]
    for dtype in ("float16", "bfloat16"):
        assert flash.features_in(dtype) == flash.features - {"dropout"}
        why = dict(flash.not_supported_reasons(dtype=dtype, features=frozenset({"dropout", "gqa"})))["features"]
        assert why == (f"does not support dropout on the probabilities (dropout_p > 0) in {dtype} (it has dropout "
                       "on the probabilities (dropout_p > 0) only in float32, float64)")
        assert "cuda.flash" not in _registry.supporting(frozenset({"dropout"}), dtype=dtype)
        assert not dict(flash.not_supported_reasons(dtype=dtype, features=frozenset({"gqa"}))).get("features")
    assert "cuda.flash" in _registry.supporting(frozenset({"dropout"}), backward=True, dtype="float32")
    assert attnkern.kernel_info("cuda.flash")["feature_dtypes"] == {"dropout": ["float32", "float64"]}
    assert all(attnkern.kernel_info(k)["feature_dtypes"] == {} for k in attnkern.kernels() if k != "cuda.flash")


def test_autocast_policy_computes_dropout_where_the_kernel_has_it():
    """Under autocast the op computes in the region's dtype only where the kernel (auto:
    those auto picks on that device) has dropout in it, else in float32: on CUDA,
    cuda.flash has no float16/bfloat16 dropout."""
    from attnkern import _api

    assert not _api._dropout_takes("auto", "float16", "cuda")
    assert not _api._dropout_takes("cuda.flash", "bfloat16", "cuda")
    assert _api._dropout_takes("cuda.flash", "float32", "cuda")
    assert _api._dropout_takes("auto", "bfloat16", "cpu")
    assert not _api._dropout_takes("torch.sdpa", "bfloat16", "cpu")
    assert not _api._dropout_takes("no.such.kernel", "float32", "cpu")
