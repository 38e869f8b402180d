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
    """Short caches, many queries, dropout and wide groups keep the ordinary path."""
    rng = np.random.default_rng(2)
    for (b, h, hkv, nq, nk), kw in (((1, 4, 4, 1, 1000), {}), ((1, 4, 4, 17, 4096), {}),
                                    ((1, 32, 1, 8, 4096), {}),
                                    ((1, 4, 4, 1, 4096), dict(dropout_p=0.1, dropout_seed=3))):
        q = rng.standard_normal((b, h, nq, 16)).astype(np.float32)
        k = rng.standard_normal((b, hkv, nk, 16)).astype(np.float32)
        attnkern.attention(q, k, k, kernel="native.flash", **kw)
        assert _attn.last_split() == 0, (b, h, hkv, nq, nk, kw)


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
