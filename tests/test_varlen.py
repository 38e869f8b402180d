"""attention_varlen / attention_varlen_backward: packed (total, heads, D) sequences in
FlashAttention's varlen layout, each sequence checked against the float64 reference
of that sequence alone (per-sequence causal alignment, GQA, windows, softcap,
dropout with the packed indices as Philox counters), lse (H, total_q), empty
sequences, torch autograd, and the errors that say what to fix."""

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkern
from attnkern import _philox
from attnkern_bench.accuracy import conditioning, tolerance

KERNELS = ["native.flash", "numpy.naive"]


def packed(lens_q, lens_k, heads=4, heads_kv=2, d=8, dv=6, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int64)
    q = rng.standard_normal((cu_q[-1], heads, d)).astype(dtype)
    k = rng.standard_normal((cu_k[-1], heads_kv, d)).astype(dtype)
    v = rng.standard_normal((cu_k[-1], heads_kv, dv)).astype(dtype)
    return q, k, v, cu_q, cu_k


def per_sequence(q, k, v, cu_q, cu_k, dout=None, **kw):
    """The reference's out (total_q, H, Dv), lse (H, total_q) and gradients, one sequence
    at a time; dropout's counters are the packed indices (the reference's private
    _dropout_offset)."""
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]))
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    grads = [np.zeros(x.shape) for x in (q, k, v)]
    for s in range(len(cu_q) - 1):
        (a, b), (c, e) = cu_q[s:s + 2], cu_k[s:s + 2]
        if a == b or c == e:
            continue
        sq, sk, sv = (x[lo:hi].transpose(1, 0, 2) for x, lo, hi in ((q, a, b), (k, c, e), (v, c, e)))
        args = {**kw, "_dropout_offset": (int(a), int(c))}
        o, l = attnkern.reference(sq, sk, sv, return_lse=True, **args)
        out[a:b], lse[:, a:b] = o.transpose(1, 0, 2), l
        if dout is not None:
            for g, part, lo, hi in zip(grads, attnkern.reference_backward(sq, sk, sv, dout[a:b].transpose(1, 0, 2),
                                                                          **args), (a, c, c), (b, e, e)):
                g[lo:hi] = part.transpose(1, 0, 2)
    return out, lse, grads


def assert_close(got, ref, q, k, dtype, factor=1.0, what=""):
    bound = tolerance(dtype) * factor * max(1.0, np.abs(ref).max(initial=0)) * conditioning(q, k)
    err = np.abs(np.asarray(got, np.float64) - ref).max(initial=0)
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize("extra", [{}, {"window": (2, 1)}, {"softcap": 4.0}])
def test_forward_and_backward_match_each_sequence_alone(kernel, dtype, causal, extra):
    if causal and "window" in extra:
        extra = {"window": (2, 0)}
    q, k, v, cu_q, cu_k = packed([3, 0, 7, 5, 1], [4, 3, 7, 2, 0], dtype=dtype)
    dout = np.random.default_rng(1).standard_normal((q.shape[0], 4, 6)).astype(dtype)
    kw = {"causal": causal, **extra}
    out, lse = attnkern.attention_varlen(q, k, v, cu_q, cu_k, 7, 7, kernel=kernel, return_lse=True, **kw)
    ref, ref_lse, ref_grads = per_sequence(q, k, v, cu_q, cu_k, dout, **kw)
    assert out.shape == (q.shape[0], 4, 6) and lse.shape == (4, q.shape[0]) and out.dtype == dtype
    assert_close(out, ref, q, k, dtype, what="out")
    assert (np.isneginf(lse) == np.isneginf(ref_lse)).all()
    fin = np.isfinite(ref_lse)
    assert np.abs(lse[fin] - ref_lse[fin]).max() <= 50 * tolerance(dtype) * conditioning(q, k)
    if kernel == "numpy.naive":
        return
    grads = attnkern.attention_varlen_backward(q, k, v, out, dout, lse, cu_q, cu_k, kernel=kernel, **kw)
    for g, r, x, name in zip(grads, ref_grads, (q, k, v), ("dq", "dk", "dv")):
        assert g.shape == x.shape
        assert_close(g, r, q, k, dtype, factor=8 * np.abs(dout).max(), what=name)


def test_dropout_uses_the_packed_indices_as_counters():
    """With q = 0 (P = 1 / len_k) and v = the identity over the packed keys, out gives
    each sequence's keep mask, whose Philox counters are (head, packed query index,
    packed key index)."""
    lens_q, lens_k = [3, 5], [4, 6]
    total_k = sum(lens_k)
    q = np.zeros((8, 2, 4))
    k = np.ones((total_k, 2, 4))
    v = np.broadcast_to(np.eye(total_k)[:, None, :], (total_k, 2, total_k)).copy()
    cu_q, cu_k = np.array([0, 3, 8]), np.array([0, 4, 10])
    p, seed = 0.4, 2024
    for kernel in KERNELS:
        out = attnkern.attention_varlen(q, k, v, cu_q, cu_k, dropout_p=p, dropout_seed=seed, kernel=kernel)
        for s in range(2):
            i = np.arange(cu_q[s], cu_q[s + 1])
            j = np.arange(cu_k[s], cu_k[s + 1])
            got = out[i][:, :, j] * lens_k[s] * (1 - p) > 0.5  # (queries, heads, keys)
            expect = _philox.keep(seed, p, np.arange(2)[None, :, None], i[:, None, None], j[None, None, :])
            np.testing.assert_array_equal(got, expect, err_msg=kernel)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dropout_forward_and_backward_match_each_sequence_alone(dtype):
    q, k, v, cu_q, cu_k = packed([4, 6, 2], [5, 3, 6], dtype=dtype)
    dout = np.random.default_rng(2).standard_normal((12, 4, 6)).astype(dtype)
    kw = {"dropout_p": 0.3, "dropout_seed": 9, "causal": "bottom_right"}
    out, lse = attnkern.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, kernel="native.flash", **kw)
    ref, ref_lse, ref_grads = per_sequence(q, k, v, cu_q, cu_k, dout, **kw)
    assert_close(out, ref, q, k, dtype, factor=2, what="out")
    grads = attnkern.attention_varlen_backward(q, k, v, out, dout, lse, cu_q, cu_k, kernel="native.flash", **kw)
    for g, r, name in zip(grads, ref_grads, ("dq", "dk", "dv")):
        assert_close(g, r, q, k, dtype, factor=16 * np.abs(dout).max(), what=name)


@settings(max_examples=15, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=4),
       causal=st.sampled_from([False, True, "bottom_right"]), heads=st.sampled_from([(2, 2), (4, 1)]))
def test_hypothesis_lengths(lens, causal, heads):
    q, k, v, cu_q, cu_k = packed([a for a, _ in lens], [b for _, b in lens], *heads, seed=len(lens))
    out = attnkern.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, kernel="native.flash")
    ref = per_sequence(q, k, v, cu_q, cu_k, causal=causal)[0]
    assert_close(out, ref, q, k, np.float64)


def test_torch_autograd_through_attention_varlen():
    torch = pytest.importorskip("torch")
    q, k, v, cu_q, cu_k = packed([3, 4], [5, 2])
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    out = attnkern.attention_varlen(tq, tk, tv, torch.from_numpy(cu_q), torch.from_numpy(cu_k), causal=True,
                                    kernel="native.flash")
    dout = np.random.default_rng(3).standard_normal(out.shape)
    out.backward(torch.from_numpy(dout))
    ref, _, grads = per_sequence(q, k, v, cu_q, cu_k, dout, causal=True)
    np.testing.assert_allclose(out.detach().numpy(), ref, atol=1e-12)
    for g, r in zip((tq.grad, tk.grad, tv.grad), grads):
        np.testing.assert_allclose(g.numpy(), r, atol=1e-12)


@pytest.mark.parametrize("change, error, words", [
    ({"cu_seqlens_q": np.array([1, 3, 8])}, ValueError, "start at 0"),
    ({"cu_seqlens_q": np.array([0, 5, 3, 8])}, ValueError, "non-decreasing"),
    ({"cu_seqlens_q": np.array([0, 3, 7])}, ValueError, "end at the packed length 8"),
    ({"cu_seqlens_q": np.array([0.0, 3, 8])}, TypeError, "int32 or int64"),
    ({"cu_seqlens_q": np.array([[0, 3, 8]])}, ValueError, "1-D"),
    ({"cu_seqlens_k": np.array([0, 10])}, ValueError, "one length per sequence"),
    ({"max_seqlen_q": 4}, ValueError, "smaller than the longest sequence, 5"),
    ({"max_seqlen_k": 1.5}, TypeError, "integer"),
    ({"k": np.zeros((10, 3, 4))}, ValueError, "multiple of the k/v heads"),
    ({"q": np.zeros((8, 4))}, ValueError, "packed"),
    ({"q": np.zeros((8, 0, 4))}, ValueError, "multiple of the k/v heads"),
    ({"dropout_p": 1.5}, ValueError, r"\[0, 1\)"),
    ({"dropout_seed": "x", "dropout_p": 0.1}, TypeError, "integer"),
])
def test_bad_arguments_say_what_to_fix(change, error, words):
    args = {"q": np.zeros((8, 4, 4)), "k": np.zeros((10, 2, 4)), "v": np.zeros((10, 2, 4)),
            "cu_seqlens_q": np.array([0, 3, 8]), "cu_seqlens_k": np.array([0, 4, 10]), **change}
    if "k" in change:
        args["v"] = np.zeros((10, 3, 4))
    with pytest.raises(error, match=words):
        attnkern.attention_varlen(**args)


def test_native_flash_runs_the_batch_in_one_call_bit_identical_to_one_call_per_sequence(monkeypatch):
    """native.flash has "varlen": one C call schedules (sequence, head, block) work items,
    each sequence computed exactly as a call of its own; and the same for every thread
    count."""
    from attnkern import _api
    from attnkern.backends import native

    assert "varlen" in attnkern.kernel_info("native.flash")["features"]
    assert "varlen" in attnkern.kernel_info("native.flash")["backward_features"]
    q, k, v, cu_q, cu_k = packed([3, 0, 9, 5, 1, 17], [4, 3, 0, 6, 2, 20], dtype=np.float32)
    dout = np.random.default_rng(4).standard_normal((q.shape[0], 4, 6)).astype(np.float32)
    calls = []
    forward = native._attn.forward
    monkeypatch.setattr(native._attn, "forward", lambda *a, **kw: calls.append(1) or forward(*a, **kw))
    for kw in ({"causal": "bottom_right", "dropout_p": 0.3, "dropout_seed": 5}, {"window": (2, 1), "softcap": 3.0}):
        calls.clear()
        args = {"kernel": "native.flash", "block_q": 4, "block_k": 4, **kw}
        out, lse = attnkern.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **args)
        assert len(calls) == 1
        grads = attnkern.attention_varlen_backward(q, k, v, out, dout, lse, cu_q, cu_k, **args)
        with monkeypatch.context() as m:
            m.setattr(_api, "_packed_kernel", lambda *a, **kw: None)  # one call per sequence
            out1, lse1 = attnkern.attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, **args)
            grads1 = attnkern.attention_varlen_backward(q, k, v, out, dout, lse, cu_q, cu_k, **args)
        assert out.tobytes() == out1.tobytes() and lse.tobytes() == lse1.tobytes()
        assert all(a.tobytes() == b.tobytes() for a, b in zip(grads, grads1))
        one, two = (attnkern.attention_varlen(q, k, v, cu_q, cu_k, num_threads=t, **args) for t in (1, 2))
        assert one.tobytes() == two.tobytes()


@pytest.mark.parametrize("kind", ["bfloat16", "float16"])
def test_half_forward(kind):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    dtype = np.dtype(ml_dtypes.bfloat16) if kind == "bfloat16" else np.dtype(np.float16)
    q, k, v, cu_q, cu_k = packed([5, 7], [6, 9], d=16, dv=16)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    out = attnkern.attention_varlen(q, k, v, cu_q, cu_k, causal="bottom_right", kernel="native.flash")
    ref = per_sequence(q, k, v, cu_q, cu_k, causal="bottom_right")[0]
    from attnkern_bench.accuracy import kernel_tolerance
    bound = kernel_tolerance("native.flash", dtype, None) * max(1.0, np.abs(ref).max()) * conditioning(q, k)
    assert np.abs(out.astype(np.float64) - ref).max() <= bound


def test_zero_query_heads_over_k_v_heads_is_an_error_not_a_division_by_zero():
    with pytest.raises(ValueError, match="multiple of the k/v heads"):
        attnkern.attention(np.zeros((0, 3, 4)), np.zeros((2, 3, 4)), np.zeros((2, 3, 4)))


def test_dv_zero_gives_each_sequences_lse():
    q, k, v, cu_q, cu_k = packed([3, 4], [5, 2], dv=6)
    out, lse = attnkern.attention_varlen(q, k, v[..., :0], cu_q, cu_k, return_lse=True, causal="bottom_right")
    _, ref_lse, _ = per_sequence(q, k, v, cu_q, cu_k, causal="bottom_right")
    assert out.shape == (7, 4, 0)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-12)


# ---------------------------------------------------------------- cuda.flash: packed sequences in one launch
# flash_mma.cu's and flash_bwd_mma.cu's ATTNKERN_VARLEN variants (float16/bfloat16, CUDA C++: a GPU
# only, ATTNKERN_TEST_GPU=1). The oracle is the float64 reference of each sequence alone; the bound is
# FlashAttention's rule with cuda.flash's own per-sequence calls as the peer (at most twice their
# error plus two roundings of the largest value): the one launch is no worse than one call a sequence.
SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
half_gpu = pytest.mark.skipif(SIMULATED, reason="cuda.flash's float16/bfloat16 kernels are CUDA C++ (a GPU only)")

# (lens_q, lens_k, H, H_kv, D, keywords): empty sequences (no queries, no keys), sequences shorter
# than a block and longer than several, GQA, both causal alignments, window, softcap, ALiBi
CUDA_VARLEN_CASES = {
    "short-and-empty-d64": ([3, 0, 130, 1, 17, 0], [5, 7, 100, 0, 300, 0], 4, 2, 64, {}),
    "causal-gqa-d128": ([70, 200, 5], [70, 260, 9], 4, 1, 128, {"causal": True}),
    "bottom_right-window-softcap": ([64, 1, 129], [200, 33, 129], 2, 2, 64,
                                    {"causal": "bottom_right", "window": (40, 0), "softcap": 5.0}),
    "alibi-per-sequence": ([9, 150], [30, 150], 4, 2, 128, {"alibi_slopes": [[0.5, 0.25, 0.125, 0.0625],
                                                                           [0.1, 0.2, 0.3, 0.4]]}),
}


def _per_sequence_calls(q, k, v, cu_q, cu_k, dout, kw):
    """cuda.flash's out and gradients one (H, len, D) call a sequence (the peer), float64."""
    out = np.zeros(q.shape[:2] + (v.shape[2],))
    grads = [np.zeros(x.shape) for x in (q, k, v)]
    for s in range(len(cu_q) - 1):
        (a, b), (c, e) = cu_q[s:s + 2], cu_k[s:s + 2]
        if a == b or c == e:
            continue
        seq_kw = dict(kw)
        if np.ndim(kw.get("alibi_slopes")) == 2:
            seq_kw["alibi_slopes"] = kw["alibi_slopes"][s]
        sq, sk, sv, sd = (np.ascontiguousarray(x[lo:hi].transpose(1, 0, 2))
                          for x, lo, hi in ((q, a, b), (k, c, e), (v, c, e), (dout, a, b)))
        o, lse = attnkern.attention(sq, sk, sv, kernel="cuda.flash", return_lse=True, **seq_kw)
        out[a:b] = o.transpose(1, 0, 2)
        for g, part, lo, hi in zip(grads, attnkern.attention_backward(sq, sk, sv, o, sd, lse, kernel="cuda.flash",
                                                                      **seq_kw), (a, c, c), (b, e, e)):
            g[lo:hi] = part.transpose(1, 0, 2)
    return out, grads


def _reference_per_sequence(q, k, v, cu_q, cu_k, dout, kw):
    """per_sequence's reference, with (nseq, H) ALiBi slopes taken row by row."""
    if np.ndim(kw.get("alibi_slopes")) != 2:
        return per_sequence(q, k, v, cu_q, cu_k, dout, **kw)
    out, lse, grads = per_sequence(q, k, v, cu_q, cu_k, dout, **dict(kw, alibi_slopes=kw["alibi_slopes"][0]))
    for s in range(1, len(cu_q) - 1):
        o, l, g = per_sequence(q, k, v, cu_q, cu_k, dout, **dict(kw, alibi_slopes=kw["alibi_slopes"][s]))
        (a, b), (c, e) = cu_q[s:s + 2], cu_k[s:s + 2]
        out[a:b], lse[:, a:b] = o[a:b], l[:, a:b]
        for full, part, lo, hi in zip(grads, g, (a, c, c), (b, e, e)):
            full[lo:hi] = part[lo:hi]
    return out, lse, grads


@half_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", CUDA_VARLEN_CASES)
def test_cuda_flash_runs_packed_sequences_in_one_launch(dtype, name):
    """attention_varlen and its backward on cuda.flash in float16/bfloat16: one launch over
    (query blocks, heads, sequences) (kernel_info has varlen in these dtypes), out, lse and the
    gradients against the float64 reference of each sequence by FlashAttention's rule with the
    per-sequence calls as the peer; rows that see no key give 0 and lse -inf; keys of sequences
    without queries get zero gradients; bit-identical repeats."""
    import ml_dtypes

    from attnkern import _api
    from attnkern_bench.accuracy import UNIT_ROUNDOFF

    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
    lens_q, lens_k, heads, heads_kv, d, kw = CUDA_VARLEN_CASES[name]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, heads, heads_kv, d, d, np.float32, seed=len(name))
    q, k, v = (x.astype(np_dtype) for x in (q, k, v))
    dout = np.random.default_rng(4).standard_normal((q.shape[0], heads, d)).astype(np_dtype)
    if "alibi_slopes" in kw:
        kw = dict(kw, alibi_slopes=np.array(kw["alibi_slopes"]))
    info = attnkern.kernel_info("cuda.flash")
    assert "varlen" in info["features"] and info["feature_dtypes"]["varlen"] == ["float16", "bfloat16"]
    packed_call = _api._packed_call(_api._varlen(q, k, v, cu_q, cu_k, None, None, kw.get("alibi_slopes")),
                                    kw.get("causal", False), None, kw.get("window"), kw.get("softcap"), 0.0, None)
    assert _api._packed_kernel(packed_call, "cuda.flash", backward=True) is not None  # one call, not a loop
    out, lse = attnkern.attention_varlen(q, k, v, cu_q, cu_k, kernel="cuda.flash", return_lse=True, **kw)
    grads = attnkern.attention_varlen_backward(q, k, v, out, dout, lse, cu_q, cu_k, kernel="cuda.flash", **kw)
    host = [x.astype(np.float64) for x in (q, k, v, dout)]
    ref, ref_lse, ref_grads = _reference_per_sequence(*host[:3], cu_q, cu_k, host[3], kw)
    peer, peer_grads = _per_sequence_calls(q, k, v, cu_q, cu_k, dout, kw)
    u = UNIT_ROUNDOFF[dtype]
    for what, a, p, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (peer, *peer_grads), (ref, *ref_grads)):
        a = np.asarray(a, np.float64)
        assert a.shape == r.shape and np.isfinite(a).all(), what
        err, peer_err = np.abs(a - r).max(initial=0), np.abs(p - r).max(initial=0)
        limit = 2 * peer_err + 2 * u * max(1.0, np.abs(r).max(initial=0))
        assert err <= limit, f"{what}: {err:.3g} > {limit:.3g} (per-sequence calls: {peer_err:.3g})"
    lse = np.asarray(lse, np.float64)
    assert (np.isneginf(lse) == np.isneginf(ref_lse)).all()
    fin = np.isfinite(ref_lse)
    assert np.abs(lse[fin] - ref_lse[fin]).max(initial=0) <= 4 * u * max(1.0, np.abs(ref_lse[fin]).max(initial=0))
    assert not np.asarray(out, np.float64)[np.isneginf(ref_lse).T].any()
    for s in range(len(lens_q)):
        if lens_q[s] == 0:  # keys no query sees
            assert not np.asarray(grads[1][cu_k[s]:cu_k[s + 1]], np.float64).any()
    again = attnkern.attention_varlen(q, k, v, cu_q, cu_k, kernel="cuda.flash", **kw)
    regrads = attnkern.attention_varlen_backward(q, k, v, out, dout, lse.astype(np_dtype), cu_q, cu_k,
                                                 kernel="cuda.flash", **kw)
    assert again.tobytes() == out.tobytes()
    assert all(a.tobytes() == b.tobytes() for a, b in zip(grads, regrads))


def test_cuda_flash_states_where_it_packs_sequences():
    """kernel_info says cuda.flash has varlen in float16/bfloat16 only; in float32 and float64
    attention_varlen runs it one sequence at a time (the simulator runs float32 here), and a
    packed float32 call handed to it directly is refused saying so."""
    from attnkern import _registry
    from attnkern.backends.cuda import _cuda_flash

    flash = _registry.get("cuda.flash")
    assert flash.feature_dtypes["varlen"] == ("float16", "bfloat16")
    assert "varlen" in flash.features_in("bfloat16") and "varlen" not in flash.features_in("float32")
    q, k, v, cu_q, cu_k = packed([3, 5], [4, 2], 2, 2, 8, 8, np.float32)
    out = attnkern.attention_varlen(q, k, v, cu_q, cu_k, kernel="cuda.flash", block_q=8, block_k=8)
    assert_close(out, per_sequence(*(x.astype(np.float64) for x in (q, k, v)), cu_q, cu_k)[0], q, k, np.float32)
    features = _registry.Features(cu_seqlens_q=cu_q.astype(np.int64), cu_seqlens_k=cu_k.astype(np.int64))
    with pytest.raises(ValueError, match="float16 and bfloat16 only, not float32"):
        _cuda_flash(np.zeros((2, 8, 8), np.float32), np.zeros((2, 6, 8), np.float32), np.zeros((2, 6, 8), np.float32),
                    False, 0.35, features=features)
