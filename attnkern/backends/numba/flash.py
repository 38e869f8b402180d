"""numba.flash: FlashAttention-2 order on the CPU, compiled by Numba.

One prange task per (batch*head, query block); each task streams K/V blocks
and keeps a running max, sum and output accumulator per query row, so no
N x N buffer exists and every output row is computed by one thread in a fixed
order (bit-identical results for any thread count). The two products of a
block, S = Q K^T and P V, are np.dot calls, which Numba compiles to the BLAS
gemm of SciPy's cython_blas; the caller keeps that BLAS to one thread (each
task's gemm runs on the task's thread, so its sums do not depend on the thread
count). Numba's own loops, 4 x 4 tiles of dot products along the head size,
spent as many instructions on the horizontal sums as on the FMAs at D = 64. Scores live in the log2
domain (q is pre-scaled by scale*log2(e)) and 2^x is a polynomial whose
exponent field gets the integer part added (LLVM bitcasts, which it vectorises); a libm
exp call per score would cost more than the two matmuls (Numba has no vector
exp without Intel's SVML). Importing this module imports Numba; functions are
compiled on first use per dtype and cached on disk (cache=True).
"""

from __future__ import annotations

import types as types_module

import numpy as np
from numba import njit, prange, types
from numba.extending import intrinsic, overload

# The exp2-domain constants of the C kernels (native/attn_common.h), repeated here
# because Numba compiles module constants into the code; tests/test_numba.py checks
# they equal the C ones (attnkern.backends.native._attn.LOG2E, EXP2_F32, EXP2_F64).
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# 2^f for |f| <= 1/2, lowest degree first (float32: degree 5, constant exactly 1, rel. err
# 1.7e-7 in float32; float64: Taylor degree 13, 2e-16).
EXP2_F32 = (1.0, 0.6931469776433113, 0.2402224213749696,
            0.0555073371388895, 0.009671509212427367, 0.0013264722783000956)
EXP2_F64 = (1.0, 0.6931471805599453, 0.2402265069591007, 0.055504108664821576,
            0.009618129107628477, 0.0013333558146428441, 0.00015403530393381606,
            1.5252733804059838e-05, 1.3215486790144305e-06, 1.0178086009239696e-07,
            7.054911620801121e-09, 4.44553827187081e-10, 2.5678435993488196e-11,
            1.3691488853904124e-12)

# "reassoc" lets LLVM vectorise the reductions and "contract" fuse a*b+c into FMAs:
# neither approximates anything, and the compiled code, with it the rounding, is the
# same on every call. numba.flash's fastmath=1 compiles flash_forward_fast with all of
# LLVM's fast-math flags (also approximate functions and reciprocals, no NaN/inf/-0
# guarantees): the final normalisation becomes a multiply by 1 / sum, np.exp2 and
# np.log2 approximate.
_ACCURATE_FLAGS = {"contract", "reassoc"}
_JIT = dict(nogil=True, cache=True, fastmath=_ACCURATE_FLAGS, error_model="numpy")
_JIT_FAST = dict(_JIT, fastmath=True)


# a float type's integer type of the same width, and back
_REINTERPRET = {types.float32: types.int32, types.int32: types.float32, types.float64: types.int64,
                types.int64: types.float64}


@intrinsic
def _reinterpret(typingctx, x):
    """x's bit pattern as the integer (float) type of its width: an LLVM bitcast,
    which Numba has no scalar spelling for."""
    to = _REINTERPRET.get(x)
    if to is None:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(to))
    return to(x), codegen


def _exp2_f32(x, n, shift):
    """x[:n] = 2^(x[:n] - shift) in place, for x <= shift, and returns their sum; an
    exponent below -126 (and -inf) gives exactly 0. One pass: the shift is subtracted,
    2^r put into the exponent and the sum taken in the loop that evaluates the polynomial."""
    c0, c1, c2, c3, c4, c5 = EXP2_F32
    total = np.float32(0.0)
    for j in range(n):
        t = max(x[j] - shift, np.float32(-126.0))
        r = np.floor(t + np.float32(0.5))
        f = t - r
        p = np.float32(c5)
        p = p * f + np.float32(c4)
        p = p * f + np.float32(c3)
        p = p * f + np.float32(c2)
        p = p * f + np.float32(c1)
        p = p * f + np.float32(c0)
        # multiply p (in [0.7, 1.42]) by 2^r by adding r to its exponent; r = -126 marks an
        # underflow, flushed to 0
        ri = np.int32(r)
        y = _reinterpret(np.int32(_reinterpret(p) + (ri << np.int32(23)))) if ri > np.int32(-126) else np.float32(0.0)
        x[j] = y
        total += y
    return total


def _exp2_f64(x, n, shift):
    """The float64 twin of _exp2_f32: an exponent below -1022 (and -inf) gives exactly 0."""
    total = 0.0
    c = EXP2_F64
    for j in range(n):
        t = max(x[j] - shift, -1022.0)
        r = np.floor(t + 0.5)
        f = t - r
        p = c[13]
        p = p * f + c[12]
        p = p * f + c[11]
        p = p * f + c[10]
        p = p * f + c[9]
        p = p * f + c[8]
        p = p * f + c[7]
        p = p * f + c[6]
        p = p * f + c[5]
        p = p * f + c[4]
        p = p * f + c[3]
        p = p * f + c[2]
        p = p * f + c[1]
        p = p * f + c[0]
        ri = np.int64(r)
        y = _reinterpret(np.int64(_reinterpret(p) + (ri << np.int64(52)))) if ri > np.int64(-1022) else 0.0
        x[j] = y
        total += y
    return total


def exp2_inplace(x, n, shift):
    """2^(x - shift) in place for the first n entries of x (x <= shift), in x's dtype;
    returns their sum."""


# the polynomial 2^x calls no library function and clamps -inf with max before use,
# so it is compiled one way (all fast-math flags, as it was measured) for both variants
@overload(exp2_inplace, jit_options=dict(fastmath=True, error_model="numpy"))
def _exp2_inplace_typed(x, n, shift):
    # chosen when Numba types the call, so each dtype compiles only its own version
    return _exp2_f32 if x.dtype == types.float32 else _exp2_f64


@njit(inline="always", **_JIT)
def _row_max(x, n, init):
    """max(init, x[0:n]) in eight independent chains: one chain waits a max's latency
    for every score (LLVM does not vectorise a max reduction here); the max is exact,
    so the result does not depend on the order."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = init
    j = 0
    while j + 8 <= n:
        a0 = max(a0, x[j])
        a1 = max(a1, x[j + 1])
        a2 = max(a2, x[j + 2])
        a3 = max(a3, x[j + 3])
        a4 = max(a4, x[j + 4])
        a5 = max(a5, x[j + 5])
        a6 = max(a6, x[j + 6])
        a7 = max(a7, x[j + 7])
        j += 8
    for jj in range(j, n):
        a0 = max(a0, x[jj])
    return max(max(max(a0, a1), max(a2, a3)), max(max(a4, a5), max(a6, a7)))


# rows of a causal diagonal block multiplied together: smaller chunks skip more of the
# masked triangle, larger ones make larger (faster) gemm calls
_CHUNK = 64


def _flash_forward(q, k, v, out, causal, scale, block_q, block_k, lse, want_lse):
    """out[b] = softmax(q[b] k[b]^T * scale) v[b] for (batch, n, d) C-contiguous arrays;
    with want_lse, lse[b, i] = the natural-log log-sum-exp of row i's scaled, masked scores."""
    batch, nq, d = q.shape
    nk = k.shape[1]
    dv = v.shape[2]
    dtype = q.dtype
    n_qblocks = (nq + block_q - 1) // block_q
    ntasks = batch * n_qblocks
    qscale = scale * LOG2E
    for task in prange(ntasks):
        # causal: the heaviest query blocks (most keys) first, for the dynamic chunks
        qb = (n_qblocks - 1 - task % n_qblocks) if causal else task % n_qblocks
        b = task // n_qblocks
        i0 = qb * block_q
        rows = min(block_q, nq - i0)
        # per-task workspace, allocated once and reused over the K/V blocks
        qs = np.empty((rows, d), dtype)
        sbuf = np.empty(rows * block_k, dtype)  # the scores of a block, then P, (rows, nkeys) C-contiguous
        pv = np.empty((rows, dv), dtype)
        acc = np.zeros((rows, dv), dtype)
        m = np.full(rows, -np.inf, dtype)
        lsum = np.zeros(rows, dtype)
        for i in range(rows):
            for t in range(d):
                qs[i, t] = q[b, i0 + i, t] * qscale
        # top-left causal mask: row i sees keys j <= i. With it, the key blocks end at the
        # block's first row (split): the keys before it, which every row sees, go in whole
        # blocks, and only the blocks from there on cross the diagonal
        kend = min(nk, i0 + rows) if causal else nk
        split = min(i0, kend) if causal else kend
        j0 = 0
        while j0 < kend:
            nkeys = min(block_k, (split if j0 < split else kend) - j0)
            # a causal block that crosses the diagonal (some row sees fewer than nkeys keys)
            # goes in chunks of _CHUNK rows, each only up to the last key its last row sees:
            # the masked triangle is not multiplied, in either product
            chunk = _CHUNK if causal and j0 + nkeys > i0 + 1 else rows
            for r0 in range(0, rows, chunk):
                r1 = min(rows, r0 + chunk)
                ncols = min(nkeys, i0 + r1 - j0) if causal else nkeys
                if ncols <= 0:  # rows above the block's first key: nothing to add
                    continue
                # this chunk's scores, then P: (r1 - r0, ncols) C-contiguous, inside rows r0..r1 of
                # the block's (rows, nkeys) area of sbuf
                s = sbuf[r0 * nkeys:r0 * nkeys + (r1 - r0) * ncols].reshape((r1 - r0, ncols))
                # S = Q K^T and, below, P V: BLAS gemm calls (single-threaded: see the caller)
                np.dot(qs[r0:r1], k[b, j0:j0 + ncols].T, s)
                for i in range(r0, r1):
                    si = s[i - r0]
                    # keys of this block row i sees: all, or up to the diagonal (top-left causal)
                    valid = max(0, min(ncols, i0 + i + 1 - j0)) if causal else ncols
                    mb = _row_max(si, valid, m[i])
                    if mb == -np.inf:  # every key so far is masked for this row: p = 0
                        si[:ncols] = 0
                        continue
                    psum = exp2_inplace(si, valid, mb)
                    si[valid:ncols] = 0  # masked: p = 0, so P V adds nothing for them
                    alpha = np.exp2(m[i] - mb)  # 0 on the row's first block (m = -inf)
                    m[i] = mb
                    lsum[i] = lsum[i] * alpha + psum
                    if alpha != 1:
                        for e in range(dv):
                            acc[i, e] *= alpha
                np.dot(s, v[b, j0:j0 + ncols], pv[r0:r1])
                for i in range(r0, r1):
                    for e in range(dv):
                        acc[i, e] += pv[i, e]
            j0 += nkeys
        for i in range(rows):
            # a division (correctly rounded); fastmath's "arcp" turns it into a multiply by 1 / sum
            for e in range(dv):
                out[b, i0 + i, e] = acc[i, e] / lsum[i]
            if want_lse:  # m is in the log2 domain
                lse[b, i0 + i] = (m[i] + np.log2(lsum[i])) * LN2


def _renamed(f, name: str):
    """f under another name: Numba's disk cache is keyed by the function's qualified
    name, and the two variants of one function must not share entries."""
    g = types_module.FunctionType(f.__code__, f.__globals__, name, f.__defaults__, f.__closure__)
    g.__qualname__ = name
    g.__doc__ = f.__doc__
    return g


# fastmath=0 (accurate) and fastmath=1 (all of LLVM's fast-math flags)
flash_forward = njit(parallel=True, **_JIT)(_renamed(_flash_forward, "flash_forward"))
flash_forward_fast = njit(parallel=True, **_JIT_FAST)(_renamed(_flash_forward, "flash_forward_fast"))
