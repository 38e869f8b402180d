"""Coverage-guided fuzz target (Atheris, libFuzzer) for attention() and, below
it, the Cython entry points of the native kernels.

    make fuzz                    # time-boxed run on the sanitizer build (FUZZ_SECONDS, default 120)
    python tests/fuzz/fuzz_attention.py -max_total_time=60 tests/fuzz/corpus

Each input decodes into one call: arbitrary shapes (ranks 1-5, zero-sized axes),
strides (transposed, stepped and Fortran-ordered views), dtypes (float16/32/64,
ints, complex, object, mixed), tunables (in range and absurd), scales and
special values (NaN, +-inf, -0.0, denormals, 1e38) written into the inputs; then
attn_mask (broadcastable or not, bool, float, int, with NaN/inf), alibi_slopes,
dropout_p and dropout_seed (in range and not), or the same arrays as a packed varlen call
(attention_varlen, with fuzzed cu_seqlens).
What must hold:
- a call either succeeds or raises one of the errors attention() documents
  (docs/api.md, attnkern/_api.py), with the library's own message: a ValueError
  or TypeError naming the bad argument, a ValueError for NaN/inf inputs or a
  FloatingPointError for an overflowing result (both only with
  check_finite=True), a MemoryError for work buffers that cannot be allocated,
  a RuntimeError only for a kernel that is not available here (none of the
  fuzzed ones is unavailable where the tests run). Any other exception, or one of
  these with another message (NumPy's, the C entry point's "invalid arguments"
  that validation should have caught), a crash or a sanitizer report is a
  finding;
- a successful call on finite inputs matches the float64 reference within the
  bound of attnkern_bench.accuracy for its dtype and kernel, float16 and
  bfloat16 included;
- the Cython entry point `_attn.forward`, given consistent or inconsistent
  arrays and any tunables, raises ValueError or matches the reference, and
  `_attn.check_problem` never accepts sizes that overflow 64-bit arithmetic.

Atheris instruments attnkern's Python modules for coverage; the C code is built
with GCC here, whose sanitizers catch memory and UB errors but which cannot
emit libFuzzer's coverage callbacks (that needs clang's -fsanitize=fuzzer-no-link),
so the C paths are reached through the shapes, tunables and values that the
Python coverage and the corpus steer to.
"""

from __future__ import annotations

import re
import sys
import warnings

import atheris
import ml_dtypes
import numpy as np

with atheris.instrument_imports(include=["attnkern"]):
    import attnkern
    from attnkern.backends.native import _attn
from attnkern_bench.accuracy import conditioning, kernel_tolerance

KERNELS = ["native.flash", "native.tiled", "native.naive", "numpy.naive"]
SPECIAL = [np.nan, np.inf, -np.inf, -0.0, 1e-40, 5e-324, 1e38, -1e38, 3.4e38]
DTYPES = [np.float32, np.float64, np.float16, np.int32, np.complex64, object, ml_dtypes.bfloat16]
# attention()'s documented errors on host arrays, each with the start of the library's message:
# (type, pattern, only with check_finite=True); a RuntimeError only for an unavailable kernel
DOCUMENTED = [
    (TypeError, r"[qkv] has dtype \S+; attnkern supports ", False),
    (TypeError, r"[qkv] must be an array of numbers, got ", False),
    (TypeError, r"[qkv] cannot be converted to a NumPy array: ", False),
    (TypeError, r"q, k, v must share one dtype, got ", False),
    (TypeError, r"scale must be a real number or None, got ", False),
    (TypeError, r"\S+ does not take \S+ inputs \(it takes ", False),
    (TypeError, r"\S+: \w+ must be an integer in \[", False),
    (ValueError, r"[qkv] has \d+ dimension\(s\), shape .*; expected 2 to 4", False),
    (ValueError, r"q, k, v must have the same leading \(batch, head\) dimensions, got ", False),
    (ValueError, r"q and k must have the same feature size D, got ", False),
    (ValueError, r"k and v must have the same sequence length, got ", False),
    (ValueError, r"the feature size D of q and k is 0; attention needs D >= 1", False),
    (ValueError, r"k and v have no keys \(sequence length 0\)", False),
    (ValueError, r"scale must be finite, got ", False),
    (ValueError, r"\S+: \w+=-?\d+ is out of range; allowed: ", False),
    (ValueError, r"[qkv] contains NaN or infinity; pass finite values", True),
    (FloatingPointError, r"\S+ produced non-finite values: q k\^T \* scale overflows ", True),
    (MemoryError, r"native\.\w+: out of memory", False),
    (ValueError, r"\S+ does not support .*; kernels that support this call's features", False),
    (ValueError, r"attn_mask of shape .* does not broadcast to the attention weights' shape", False),
    (TypeError, r"attn_mask has dtype \S+; it must be bool", False),
    (TypeError, r"an additive attn_mask must be ", False),
    (ValueError, r"attn_mask contains NaN or \+infinity", True),
    (ValueError, r"dropout_p must lie in \[0, 1\)", False),
    (TypeError, r"dropout_p must be a number in \[0, 1\)", False),
    (TypeError, r"dropout_seed must be an integer", False),
    (TypeError, r"cu_seqlens_[qk] must be int32 or int64", False),
    (ValueError, r"cu_seqlens_[qk] must (be 1-D|start at 0|be non-decreasing|end at the packed length)", False),
    (ValueError, r"cu_seqlens_q and cu_seqlens_k must have one length per sequence", False),
    (ValueError, r"[qkv] has shape .*; attention_varlen takes packed", False),
    (ValueError, r"q has \d+ heads and k, v have \d+: the query heads H must be a multiple", False),
    (ValueError, r"k and v must have the same \(total_k, heads\)", False),
    (ValueError, r"q and k must have the same feature size D >= 1, got ", False),
    (TypeError, r"attention_varlen takes host arrays", False),
    (ValueError, r"alibi_slopes must (have shape|be finite)", False),
    (TypeError, r"alibi_slopes must hold real numbers", False),
]


def documented(exc: BaseException, kernel: str, check: bool) -> bool:
    """Whether exc is an error attention() documents for this call, with its message."""
    if type(exc) is RuntimeError:
        return (not attnkern.kernel_info(kernel)["available"]
                and str(exc).startswith(f"kernel {kernel} is not available here: "))
    return any(type(exc) is kind and re.match(pattern, str(exc)) and (check or not needs_check)
               for kind, pattern, needs_check in DOCUMENTED)


def array(fdp, shape, dtype):
    n = int(np.prod(shape)) if shape else 1
    raw = fdp.ConsumeFloatListInRange(min(n, 4096), -4.0, 4.0)
    a = np.resize(np.asarray(raw or [0.0], dtype=np.float64), n).reshape(shape)
    if n and fdp.ConsumeIntInRange(0, 7) == 0:  # a special value somewhere
        a.flat[fdp.ConsumeIntInRange(0, n - 1)] = fdp.PickValueInList(SPECIAL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = a.astype(dtype) if dtype is not object else a.astype(object)
    layout = fdp.ConsumeIntInRange(0, 3)
    if layout == 1 and a.ndim >= 2:  # a transposed view of a transposed copy: same values, strided
        a = np.ascontiguousarray(np.swapaxes(a, -1, -2)).swapaxes(-1, -2)
    elif layout == 2 and a.ndim >= 1:  # every other row of a larger array
        big = np.repeat(a, 2, axis=-2 if a.ndim >= 2 else -1)
        a = big[..., ::2, :] if a.ndim >= 2 else big[::2]
    elif layout == 3:
        a = np.asfortranarray(a)
    return a


def shapes(fdp):
    rank = fdp.ConsumeIntInRange(1, 5)
    lead = tuple(fdp.ConsumeIntInRange(0, 3) for _ in range(max(0, rank - 2)))
    nq, nk = fdp.ConsumeIntInRange(0, 70), fdp.ConsumeIntInRange(0, 70)
    d, dv = fdp.ConsumeIntInRange(0, 40), fdp.ConsumeIntInRange(0, 40)
    if rank == 1:
        return (d,), (d,), (dv,)
    q, k, v = (*lead, nq, d), (*lead, nk, d), (*lead, nk, dv)
    if fdp.ConsumeIntInRange(0, 9) == 0:  # mismatched on purpose
        k = (*lead, nk, fdp.ConsumeIntInRange(0, 40))
    return q, k, v


def tunables(fdp, kernel):
    params = {}
    for name in attnkern.kernel_info(kernel)["params"]:
        if fdp.ConsumeBool():
            params[name] = fdp.PickValueInList([0, 1, 2, 3, 7, 16, 64, 255, 1024, 4096, 10**6, -1, 2**40])
    return params


def check_against_reference(out, q, k, v, causal, scale, bound, **feats):
    if not all(np.isfinite(x).all() for x in (q, k, v)):
        return
    ref = attnkern.reference(q, k, v, causal=causal, scale=scale, **feats)
    if not np.isfinite(ref).all():
        return
    # the bound of attnkern_bench.accuracy (`bound`: its value for the dtype and kernel), with
    # max|v| in place of max(1, max|v|): the fuzzer's inputs reach tiny magnitudes, where an
    # absolute floor of 1 would hide errors; there the output's own rounding is absolute, at
    # most half the dtype's smallest subnormal
    vmax = float(np.abs(v.astype(np.float64)).max(initial=0.0))
    tiny = float(ml_dtypes.finfo(out.dtype).smallest_subnormal)
    bound = bound * max(vmax, 1e-30) * conditioning(q, k, scale) * 4 + tiny
    err = float(np.abs(out.astype(np.float64) - ref).max(initial=0.0))
    if not err <= bound:
        raise AssertionError(f"error {err:.3g} > bound {bound:.3g} for q {q.shape} {q.dtype}, causal={causal}, "
                             f"scale={scale}")


def one_attention(fdp):
    kernel = fdp.PickValueInList(KERNELS)
    qs, ks, vs = shapes(fdp)
    dtype = fdp.PickValueInList(DTYPES)
    q, k = array(fdp, qs, dtype), array(fdp, ks, dtype)
    v = array(fdp, vs, fdp.PickValueInList(DTYPES) if fdp.ConsumeIntInRange(0, 9) == 0 else dtype)
    causal = fdp.ConsumeBool()
    scale = None if fdp.ConsumeBool() else fdp.PickValueInList([0.0, -0.0, 1.0, -2.5, 1e-30, 1e30, np.nan, np.inf,
                                                                fdp.ConsumeRegularFloat()])
    check = fdp.ConsumeIntInRange(0, 3) != 0
    params = tunables(fdp, kernel)
    feats, varlen = features(fdp, q, k)  # none where the input is exhausted: the plain call
    if varlen is not None:
        one_varlen(fdp, q, k, v, causal, scale, kernel, check, params, varlen, feats)
        return
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            out = attnkern.attention(q, k, v, causal=causal, scale=scale, kernel=kernel, check_finite=check,
                                     **feats, **params)
    except (ValueError, TypeError, MemoryError, FloatingPointError, RuntimeError) as exc:
        if documented(exc, kernel, check):
            return
        raise
    if out.shape != (*qs[:-1], vs[-1]) and len(qs) > 1:
        raise AssertionError(f"output shape {out.shape} for q {qs}, v {vs}")
    if np.dtype(q.dtype) != out.dtype:
        raise AssertionError(f"output dtype {out.dtype} for inputs of {q.dtype}")
    if not np.isfinite(out).all():
        # scores that overflow the dtype give NaN/inf; documented only without the scans
        if check:
            raise AssertionError(f"a non-finite result passed check_finite=True (q {q.shape} {q.dtype})")
        return
    if feats.get("attn_mask") is not None and not np.isfinite(np.asarray(feats["attn_mask"], np.float64)).all():
        return  # -inf entries: rows the reference may leave empty too, but 0 * inf in its sums is not ours
    if feats.get("dropout_p") and feats.get("dropout_seed") is None:
        return  # a seed drawn inside attention(): the reference cannot know it
    check_against_reference(out, q, k, v, causal, scale,
                            kernel_tolerance(kernel, out.dtype) / (1 - feats.get("dropout_p", 0.0)), **feats)


def features(fdp, q, k):
    """attn_mask / dropout keywords for attention(), or packed varlen offsets: ({...}, None)
    or ({dropout keywords}, (cu_seqlens_q, cu_seqlens_k))."""
    choice = fdp.ConsumeIntInRange(0, 5)
    feats = {}
    if choice in (1, 3) and q.ndim >= 2:
        lead, nq, nk = q.shape[:-2], q.shape[-2], k.shape[-2]
        full = (*lead, nq, nk)
        shape = tuple(x if fdp.ConsumeBool() else 1 for x in full)[fdp.ConsumeIntInRange(0, len(full)):]
        if fdp.ConsumeIntInRange(0, 7) == 0:  # does not broadcast
            shape = (*shape[:-1], (shape[-1] if shape else 0) + 2)
        kind = fdp.PickValueInList([bool, np.float32, np.float64, np.float16, np.int32])
        rng = np.random.default_rng(fdp.ConsumeIntInRange(0, 2**16))
        mask = rng.random(shape) < 0.7 if kind is bool else rng.standard_normal(shape).astype(kind)
        if kind not in (bool, np.int32) and mask.size and fdp.ConsumeIntInRange(0, 3) == 0:
            mask.flat[fdp.ConsumeIntInRange(0, mask.size - 1)] = fdp.PickValueInList([np.nan, np.inf, -np.inf])
        feats["attn_mask"] = mask
    if choice == 4:  # ALiBi slopes, per head or per sequence and head (or of a wrong shape)
        heads = q.shape[-3] if q.ndim >= 3 else 1
        shape = fdp.PickValueInList([(heads,), (q.shape[0] if q.ndim == 4 else 1, heads), (heads + 1,), ()])
        slopes = np.random.default_rng(fdp.ConsumeIntInRange(0, 2**16)).uniform(-1, 2, shape)
        if slopes.size and fdp.ConsumeIntInRange(0, 5) == 0:
            slopes.flat[0] = fdp.PickValueInList([np.nan, np.inf, 1e30])
        feats["alibi_slopes"] = slopes
    if choice in (2, 3, 5):
        feats["dropout_p"] = fdp.PickValueInList([0.0, 0.1, 0.5, 0.99, 1.0, -0.5, np.nan, "0.1", True])
        feats["dropout_seed"] = fdp.PickValueInList([0, 1, 2**63, 2**64 + 5, -7, 1.5, None, "x"])
    if choice == 5:
        rng = np.random.default_rng(fdp.ConsumeIntInRange(0, 2**16))
        nseq = fdp.ConsumeIntInRange(0, 4)
        cuts = [np.sort(rng.integers(0, max(1, x.shape[0] + 1), nseq)) if x.ndim else np.zeros(0, int)
                for x in (q, k)]
        cu = [np.concatenate([[0], c, [x.shape[0] if x.ndim else 0]]).astype(np.int32) for c, x in zip(cuts, (q, k))]
        if fdp.ConsumeIntInRange(0, 5) == 0:  # broken on purpose
            cu[fdp.ConsumeIntInRange(0, 1)] = fdp.PickValueInList([cu[0][::-1], cu[0].astype(float), cu[0] + 1,
                                                                   cu[0][:, None]])
        return feats, tuple(cu)
    return feats, None


def one_varlen(fdp, q, k, v, causal, scale, kernel, check, params, cu, feats):
    """The arrays as a packed varlen call; each sequence checked against the reference alone."""
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            out = attnkern.attention_varlen(q, k, v, *cu, causal=causal, scale=scale, kernel=kernel,
                                            check_finite=check, **feats, **params)
    except (ValueError, TypeError, MemoryError, FloatingPointError, RuntimeError) as exc:
        if documented(exc, kernel, check):
            return
        raise
    if out.shape != (q.shape[0], q.shape[1], v.shape[2]) or out.dtype != q.dtype:
        raise AssertionError(f"varlen output {out.shape} {out.dtype} for q {q.shape}, v {v.shape}")
    if feats.get("dropout_p") or not np.isfinite(out).all():
        return
    for s in range(len(cu[0]) - 1):
        (a, b), (c, e) = cu[0][s:s + 2], cu[1][s:s + 2]
        if a == b or c == e:
            if (out[a:b] != 0).any():
                raise AssertionError("a varlen sequence without keys gave a non-zero output")
            continue
        sq, sk, sv = (x[lo:hi].transpose(1, 0, 2) for x, lo, hi in ((q, a, b), (k, c, e), (v, c, e)))
        check_against_reference(out[a:b].transpose(1, 0, 2), sq, sk, sv, causal, scale,
                                kernel_tolerance(kernel, out.dtype))


def one_entry_point(fdp):
    algo = fdp.PickValueInList(["naive", "tiled", "flash"])
    isa = fdp.PickValueInList(list(attnkern.supported_isas()))
    dtype = fdp.PickValueInList([np.float32, np.float64])
    b, nq, nk = (fdp.ConsumeIntInRange(0, 3), fdp.ConsumeIntInRange(0, 40), fdp.ConsumeIntInRange(0, 40))
    d, dv = fdp.ConsumeIntInRange(0, 24), fdp.ConsumeIntInRange(0, 24)
    dims = [(b, nq, d), (b, nk, d), (b, nk, dv), (b, nq, dv)]
    if fdp.ConsumeIntInRange(0, 4) == 0:  # one array inconsistent with the others
        i = fdp.ConsumeIntInRange(0, 3)
        dims[i] = tuple(x + fdp.ConsumeIntInRange(1, 3) * (j == fdp.ConsumeIntInRange(0, 2))
                        for j, x in enumerate(dims[i]))
    rng = np.random.default_rng(fdp.ConsumeIntInRange(0, 2**31))
    q, k, v = (rng.standard_normal(s).astype(dtype) for s in dims[:3])
    out = np.full(dims[3], np.nan, dtype)
    causal = fdp.ConsumeBool()
    scale = fdp.PickValueInList([0.125, 1.0, -1.0, 0.0, np.nan, np.inf, 1e30])
    bq, bk, nt = (fdp.PickValueInList([0, 1, 5, 64, 1024, 1025, -3]), fdp.PickValueInList([0, 1, 17, 256, 4096, 4097]),
                  fdp.PickValueInList([0, 1, 2, 3, 256, 257, -1]))
    try:
        _attn.forward(algo, isa, q, k, v, out, causal, scale, bq, bk, nt)
    except (ValueError, MemoryError):
        return
    if not (1 <= bq <= 1024 and 1 <= bk <= 4096 and 1 <= nt <= 256 and np.isfinite(scale) and nk >= 1 and d >= 1):
        raise AssertionError(f"forward accepted block_q={bq} block_k={bk} num_threads={nt} scale={scale} nk={nk} d={d}")
    if b and nq and dv and np.isfinite(out).all():
        check_against_reference(out, q, k, v, causal, scale, kernel_tolerance(f"native.{algo}", out.dtype))
    elif b and nq and dv and np.isfinite(scale) and abs(scale) < 1e4:
        raise AssertionError(f"non-finite output from finite inputs, scale {scale}")


def one_size_check(fdp):
    algo = fdp.PickValueInList(["naive", "tiled", "flash"])
    dims = [fdp.PickValueInList([0, 1, 3, 2**20, 2**31, 2**32 + 1, 2**40, 2**62, 2**63 - 1])
            for _ in range(5)]
    status = _attn.check_problem(algo, "generic", *dims)
    batch, nq, nk, d, dv = dims
    if status == "ok":
        width = max(d, dv) + 64
        if batch * nq * width >= 2**63 or batch * nk * width >= 2**63 or nq * (nk + 64) >= 2**60:
            raise AssertionError(f"check_problem accepted {dims}")


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    target = fdp.ConsumeIntInRange(0, 5)
    if target <= 3:
        one_attention(fdp)
    elif target == 4:
        one_entry_point(fdp)
    else:
        one_size_check(fdp)


def main(argv) -> None:
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
