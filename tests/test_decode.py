"""native.flash's decode path (flash-decoding on the CPU, attn_decode_chunk in
attn_common.h): a few query rows per k/v head (kv_group * Nq <= 128, Nq <= 16) against
a long cache (Nk >= 1024) run one work item per (k/v head, key chunk), the group's
query rows as one block, and a log-sum-exp combine of the chunks in key order.

Checked against the float64 reference (attnkern.reference) on fresh random inputs,
with every feature the path takes (bottom-right causal, windows, key lengths, softcap,
masks, ALiBi; GQA groups 1, 4 and 8), float32, float64, bfloat16 and float16; that the
path is taken (_attn.last_split(): the chunks of the last call); and that its result is
bit-identical for every thread count (the chunks depend on the shape only)."""

import numpy as np
import pytest

import attnkern
from attnkern.backends.native import _attn
from attnkern_bench.accuracy import conditioning, tolerance
from conftest import ISAS

ml_dtypes = pytest.importorskip("ml_dtypes")

# (B, H, H_kv, Nq, Nk) and features
CASES = {
    "mha-nq1": dict(shape=(1, 3, 3, 1, 1500)),
    "gqa4-causal": dict(shape=(2, 8, 2, 4, 3000), causal="bottom_right"),
    "gqa8-nq16": dict(shape=(1, 8, 1, 16, 20000), causal="bottom_right"),
    "gqa4-lengths": dict(shape=(2, 4, 1, 3, 5000), causal="bottom_right", key_lengths=[5000, 777]),
    "lengths-zero": dict(shape=(3, 2, 1, 2, 2048), key_lengths=[2048, 0, 3]),
    "window": dict(shape=(1, 4, 2, 5, 4096), causal="bottom_right", window=(700, 0)),
    "window-both": dict(shape=(1, 4, 4, 6, 2100), window=(300, 40)),
    "top-left-causal": dict(shape=(1, 2, 1, 8, 2048), causal=True),  # rows see only the first keys
    "softcap": dict(shape=(1, 4, 2, 2, 2048), softcap=3.0, scale=0.5),
    "everything": dict(shape=(2, 8, 2, 3, 3333), causal="bottom_right", window=(1000, 0), key_lengths=[3333, 1200],
                       softcap=5.0),
}


def make(case, dtype, seed=0, d=32, dv=24):
    b, h, hkv, nq, nk = case["shape"]
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, h, nq, d)).astype(dtype)
    k = rng.standard_normal((b, hkv, nk, d)).astype(dtype)
    v = rng.standard_normal((b, hkv, nk, dv)).astype(dtype)
    return q, k, v


def features(case):
    f = {n: case[n] for n in ("causal", "window", "softcap", "scale") if n in case}
    if "key_lengths" in case:
        f["key_lengths"] = np.array(case["key_lengths"], np.int64)
    return f


def native(q, k, v, threads=2, **feats):
    out, lse = attnkern.attention(q, k, v, kernel="native.flash", num_threads=threads, return_lse=True, **feats)
    return out, lse, _attn.last_split()


def check(out, lse, q, k, v, factor=2.0, **feats):
    ref, ref_lse = attnkern.reference(q, k, v, return_lse=True, **feats)
    dtype = q.dtype
    bound = tolerance(dtype) * factor * max(1.0, np.abs(ref).max()) * conditioning(q, k, feats.get("scale"))
    err = np.abs(out.astype(np.float64) - ref).max()
    assert err <= bound, f"out: max abs error {err:.3g} > {bound:.3g}"
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse.astype(np.float64)), empty)
    assert (out[np.broadcast_to(empty[..., None], out.shape)] == 0).all()
    assert np.abs(lse.astype(np.float64)[~empty] - ref_lse[~empty]).max(initial=0) <= 10 * bound


@pytest.fixture(params=ISAS)
def isa(request, monkeypatch):
    monkeypatch.setenv("ATTNKERN_ISA", request.param)
    return request.param


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", CASES)
def test_decode_matches_the_reference_and_takes_the_split_path(isa, dtype, name):
    case = CASES[name]
    q, k, v = make(case, dtype)
    out, lse, chunks = native(q, k, v, **features(case))
    assert chunks >= 2, "the decode path was not taken"
    check(out, lse, q, k, v, **features(case))


@pytest.mark.parametrize("kind", ["bfloat16", "float16"])
def test_half_caches_take_the_decode_path(isa, kind):
    dtype = np.dtype(ml_dtypes.bfloat16) if kind == "bfloat16" else np.dtype(np.float16)
    for name in ("gqa4-causal", "gqa4-lengths", "everything"):
        case = CASES[name]
        q, k, v = (x.astype(dtype) for x in make(case, np.float32))
        out, lse, chunks = native(q, k, v, **features(case))
        assert chunks >= 2, name
        ref, ref_lse = attnkern.reference(q, k, v, return_lse=True, **features(case))
        assert np.abs(out.astype(np.float64) - ref).max() < 2e-2, name
        fin = np.isfinite(ref_lse)
        assert np.abs(lse.astype(np.float64)[fin] - ref_lse[fin]).max() < 5e-2, name


def test_mask_and_alibi_on_the_decode_path(isa):
    case = dict(shape=(2, 8, 2, 4, 2500))
    q, k, v = make(case, np.float64)
    b, h, _, nq, nk = case["shape"]
    rng = np.random.default_rng(1)
    slopes = rng.uniform(0.001, 0.01, h)
    for mask in (rng.random((b, 1, nq, nk)) < 0.7, rng.standard_normal((1, h, nq, nk)).astype(np.float64),
                 None):
        for alibi in (None, slopes):
            feats = dict(causal="bottom_right", attn_mask=mask, alibi_slopes=alibi)
            if mask is None and alibi is None:
                continue
            out, lse, chunks = native(q, k, v, **feats)
            assert chunks >= 2
            check(out, lse, q, k, v, **feats)


@pytest.mark.parametrize("name", ["gqa4-causal", "gqa8-nq16", "everything", "window-both"])
def test_decode_bit_identical_for_every_thread_count(isa, name):
    case = CASES[name]
    q, k, v = make(case, np.float32)
    first = native(q, k, v, threads=1, **features(case))
    for threads in (2, 3):
        again = native(q, k, v, threads=threads, **features(case))
        assert again[2] == first[2]
        assert np.array_equal(first[0], again[0]) and np.array_equal(first[1], again[1]), threads


def test_shapes_off_the_decode_path():
    """Many queries, dropout and wide groups keep the ordinary path; so do short caches
    (under 1024 keys) with no more keys than queries or over 64 rows per k/v row."""
    rng = np.random.default_rng(2)
    for (b, h, hkv, nq, nk), kw in (((1, 4, 4, 16, 16), {}), ((1, 4, 4, 8, 5), {}), ((1, 32, 4, 16, 1000), {}),
                                    ((1, 4, 4, 17, 4096), {}), ((1, 32, 1, 8, 4096), {}),
                                    ((1, 4, 4, 1, 4096), dict(dropout_p=0.1, dropout_seed=3))):
        q = rng.standard_normal((b, h, nq, 16)).astype(np.float32)
        k = rng.standard_normal((b, hkv, nk, 16)).astype(np.float32)
        attnkern.attention(q, k, k, kernel="native.flash", **kw)
        assert _attn.last_split() == 0, (b, h, hkv, nq, nk, kw)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_short_caches_take_the_decode_path(isa, dtype):
    """Under 1024 keys (one or two chunks), one query or more keys than queries, at most
    64 rows per k/v row: the decode path, against float64 and the same for every
    thread count; a single key included."""
    for b, h, hkv, nq, nk in ((1, 8, 2, 1, 1), (2, 8, 2, 1, 37), (1, 4, 4, 16, 17), (1, 32, 8, 2, 1000),
                              (2, 4, 1, 3, 512), (1, 4, 2, 1, 513)):
        case = dict(shape=(b, h, hkv, nq, nk))
        q, k, v = make(case, dtype, seed=nk)
        for feats in ({"causal": "bottom_right"}, {"causal": True}, {"window": (5, 0), "causal": "bottom_right"}):
            out, lse, chunks = native(q, k, v, **feats)
            assert chunks == (1 if nk <= 512 else 2), case
            check(out, lse, q, k, v, **feats)
            one = native(q, k, v, threads=1, **feats)
            assert np.array_equal(one[0], out) and np.array_equal(one[1], lse), case


def test_chunks_depend_on_the_shape_only():
    """At most about 256 (k/v row, chunk) items, chunks a multiple of 512 keys (one chunk
    per k/v row from 256 k/v rows: still the grouped path)."""
    rng = np.random.default_rng(3)
    for hkv, nk, want in ((1, 1024, 2), (8, 131072, 32), (64, 8192, 4), (256, 8192, 1)):
        q = rng.standard_normal((1, hkv, 1, 8)).astype(np.float32)
        k = np.zeros((1, hkv, nk, 8), np.float32)
        attnkern.attention(q, k, k, kernel="native.flash")
        assert _attn.last_split() == want, (hkv, nk)


def test_nonfinite_inputs_are_reported_on_the_decode_path():
    case = dict(shape=(1, 4, 2, 2, 3000))
    q, k, v = make(case, np.float32)
    for where in (0, 1700, 2999):  # keys the window makes no row read included
        kk = k.copy()
        kk[0, 1, where, 0] = np.nan
        with pytest.raises(ValueError, match="k"):
            attnkern.attention(q, kk, v, kernel="native.flash", causal="bottom_right", window=(100, 0))
        assert _attn.last_split() >= 2


def unaligned(x):
    """x copied into a buffer one element past a vector boundary (NumPy aligns its own)."""
    buf = np.empty(x.size + 1, x.dtype)[1:]
    buf[:] = x.ravel()
    return buf.reshape(x.shape)


@pytest.mark.parametrize("kind", ["float32", "float64", "bfloat16", "float16"])
@pytest.mark.parametrize("dv", [64, 128])
def test_v_rows_read_in_place_when_dv_fills_the_tiles(isa, kind, dv):
    """dv a multiple of the register tile's columns: P V reads V's own rows (no packed
    copy), also where they are not vector-aligned; half K panels are widened in the
    transpose's registers; against float64, and bit-identical for every thread count."""
    dtype = np.dtype(ml_dtypes.bfloat16) if kind == "bfloat16" else np.dtype(kind)
    for name in ("gqa4-causal", "gqa8-nq16", "everything"):
        case = CASES[name]
        q, k, v = (x.astype(dtype) for x in make(case, np.float32, seed=5, d=dv, dv=dv))
        for vv in (v, unaligned(v)):
            out, lse, chunks = native(q, k, vv, **features(case))
            assert chunks >= 2, name
            if kind in ("bfloat16", "float16"):
                ref = attnkern.reference(q, k, vv, **features(case))
                assert np.abs(out.astype(np.float64) - ref).max() < 2e-2, name
            else:
                check(out, lse, q, k, vv, **features(case))
            one = native(q, k, vv, threads=1, **features(case))
            assert np.array_equal(one[0], out) and np.array_equal(one[1], lse), name


@pytest.mark.parametrize("kind", ["float32", "bfloat16"])
def test_varlen_sequences_with_decode_shapes_match_calls_of_their_own(monkeypatch, kind):
    """One packed varlen call: the sequences with a decode shape (a long cache, or a short
    one with few queries) run the decode path, so each sequence is bit-identical to a
    call of its own, for every thread count."""
    from attnkern import _api

    dtype = np.dtype(ml_dtypes.bfloat16) if kind == "bfloat16" else np.dtype(kind)
    lq, lk = [1, 3, 16, 2, 20], [2000, 40, 16, 1100, 30]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int64) for x in (lq, lk))
    rng = np.random.default_rng(6)
    q = rng.standard_normal((cu_q[-1], 8, 64)).astype(dtype)
    k = rng.standard_normal((cu_k[-1], 2, 64)).astype(dtype)
    v = rng.standard_normal((cu_k[-1], 2, 64)).astype(dtype)
    args = dict(kernel="native.flash", causal="bottom_right", return_lse=True)
    out, lse = attnkern.attention_varlen(q, k, v, cu_q, cu_k, **args)
    two = attnkern.attention_varlen(q, k, v, cu_q, cu_k, num_threads=2, **args)
    assert out.tobytes() == two[0].tobytes() and lse.tobytes() == two[1].tobytes()
    monkeypatch.setattr(_api, "_packed_kernel", lambda *a, **kw: None)  # one call per sequence
    out1, lse1 = attnkern.attention_varlen(q, k, v, cu_q, cu_k, **args)
    assert out.tobytes() == out1.tobytes() and lse.tobytes() == lse1.tobytes()


# The direct path (attn_decode.h: the AVX-512 and AVX2 units): bfloat16 and float16 caches
# at head sizes of whole 2-vector multiples, float32 with up to 4 rows per k/v row.
# (B, H, H_kv, Nq, Nk) and features: GQA 32 over 8 (4 and 64 rows per k/v row; bfloat16
# over 8 rows takes K's pairs transposed where the unit has vdpbf16ps), no GQA (one row),
# key lengths, short caches (one key to a partial 16-key group) and long ones.
DIRECT = {
    "gqa32-8-nq1": ((1, 32, 8, 1, 4100), {"causal": "bottom_right"}),
    "gqa32-8-nq16": ((1, 32, 8, 16, 1500), {"causal": "bottom_right"}),
    "mha-nq1": ((2, 4, 4, 1, 2600), {}),
    "mha-nq2": ((1, 4, 4, 2, 1200), {"causal": "bottom_right"}),
    "mha-lengths": ((2, 4, 4, 1, 2100), {"causal": "bottom_right", "key_lengths": [2100, 333]}),
    "gqa-nq2-window": ((1, 8, 2, 2, 1300), {"causal": "bottom_right", "window": (200, 0)}),
    "gqa12-nq1": ((1, 24, 2, 1, 1111), {"causal": "bottom_right"}),  # 12 rows: a part tile of 8
    "short-1": ((1, 32, 8, 1, 1), {"causal": "bottom_right"}),
    "short-17": ((1, 32, 8, 1, 17), {"causal": "bottom_right"}),
    "short-600": ((2, 8, 8, 1, 600), {"causal": "bottom_right"}),
    "short-nq3": ((1, 8, 2, 3, 100), {"causal": "bottom_right"}),
}
DIRECT_KINDS = ["bfloat16", "float16", "float32"]


def host(kind):
    return np.dtype(ml_dtypes.bfloat16) if kind == "bfloat16" else np.dtype(kind)


def within_dtype_bound(out, lse, q, k, v, feats):
    """attnkern_bench.accuracy's bound of the dtype (float32 probabilities): scaled
    error of the output and lse error of the rows that see a key."""
    from attnkern_bench.accuracy import lse_tolerance

    ref, ref_lse = attnkern.reference(q, k, v, return_lse=True, **feats)
    per = max(1.0, np.abs(v.astype(np.float64)).max()) * conditioning(q, k, feats.get("scale"))
    err = np.abs(out.astype(np.float64) - ref).max() / per
    assert err <= tolerance(q.dtype), f"scaled error {err:.3g} > {tolerance(q.dtype):.3g}"
    seen = np.isfinite(ref_lse)
    assert np.array_equal(np.isneginf(lse.astype(np.float64)), ~seen)
    lerr = (np.abs(lse.astype(np.float64)[seen] - ref_lse[seen]) / np.maximum(1, np.abs(ref_lse[seen]))).max(initial=0)
    assert lerr <= lse_tolerance(q.dtype), f"lse error {lerr:.3g}"


@pytest.mark.parametrize("dims", [(128, 128), (64, 32), (32, 96)])
@pytest.mark.parametrize("kind", DIRECT_KINDS)
@pytest.mark.parametrize("name", DIRECT)
def test_direct_decode_matches_the_reference_for_every_thread_count(isa, kind, dims, name):
    shape, feats = DIRECT[name]
    if kind == "float32" and shape[1] // shape[2] * shape[3] > 4:
        pytest.skip("float32 takes the direct path up to 4 rows per k/v row")
    feats = {n: (np.array(x, np.int64) if n == "key_lengths" else x) for n, x in feats.items()}
    d, dv = dims
    q, k, v = (x.astype(host(kind)) for x in make(dict(shape=shape), np.float32, seed=shape[-1], d=d, dv=dv))
    out, lse, chunks = native(q, k, v, threads=2, **feats)
    assert chunks >= 1, "the decode path was not taken"
    within_dtype_bound(out, lse, q, k, v, feats)
    one = native(q, k, v, threads=1, **feats)
    assert one[0].tobytes() == out.tobytes() and one[1].tobytes() == lse.tobytes()
    moved = native(unaligned(q), unaligned(k), unaligned(v), threads=2, **feats)  # rows off vector boundaries
    assert moved[0].tobytes() == out.tobytes() and moved[1].tobytes() == lse.tobytes()


@pytest.mark.parametrize("kind", DIRECT_KINDS)
def test_direct_decode_reports_nonfinite_cache_rows(isa, kind):
    q, k, v = (x.astype(host(kind)) for x in make(dict(shape=(1, 8, 2, 1, 3000)), np.float32, d=64, dv=64))
    # the scan reads the elements' bits: infinities of both signs and NaN anywhere in a
    # row (its first and last element, in a block's vectors or its odd last key's), and
    # the dtype's largest finite values are finite
    for which, where, col, bad in (("k", 5, 3, np.inf), ("v", 2999, 63, -np.inf), ("k", 1700, 0, np.nan),
                                   ("v", 0, 31, np.nan), ("k", 2999, 32, -np.inf)):
        kk, vv = k.copy(), v.copy()
        (kk if which == "k" else vv)[0, 1, where, col] = bad
        with pytest.raises(ValueError, match=which):
            attnkern.attention(q, kk, vv, kernel="native.flash", causal="bottom_right")
        assert _attn.last_split() >= 2
    big = np.finfo(host(kind)).max if kind != "bfloat16" else ml_dtypes.finfo(ml_dtypes.bfloat16).max
    kk, vv = k.copy(), v.copy()
    kk[0, 1, 7, 5], kk[0, 0, 2999, 63], vv[0, 1, 1700, 0], vv[0, 0, 2999, 62] = big, -big, big, -big
    out = attnkern.attention(q * 0, kk, vv, kernel="native.flash", causal="bottom_right")
    assert _attn.last_split() >= 2 and not np.isnan(np.asarray(out, np.float64)).any()


def test_other_build_says_what_is_missing(tmp_path):
    """other_build (A/B timing of two builds) refuses a path that is no extension file
    with a message naming it, and leaves this build's kernels in place."""
    from attnkern.backends import native

    with pytest.raises(FileNotFoundError, match="no compiled extension"):
        with native.other_build(str(tmp_path / "missing.so")):
            pass
    q = np.ones((1, 1, 1, 8), np.float32)
    assert np.isfinite(attnkern.attention(q, q, q, kernel="native.flash")).all()
