"""cuda.naive and cuda.flash's Numba kernels (float64, float32 where the CUDA
C++ kernels of cpp.py do not run, and everything under the simulator), written
with numba-cuda. Importing this module imports numba.cuda; kernels are compiled
on first use for each (dtype, tile shape, padded head size) and kept per process.

cuda.naive (three launches, the N x N scores in device memory)
    1. qk_scores: S = Q K^T * scale, a shared-memory tiled matmul; each block
       loads a T x T tile of Q and of K, the K tile stored transposed (padded
       by one column: no bank conflicts) so the inner loop reads both tiles
       along rows. Causal tiles wholly above the diagonal only write -inf.
    2. softmax_rows: one block per row; max and sum reduced with warp shuffles
       inside each warp and shared memory across warps; exp(s - max), so it is
       stable for any score magnitude.
    3. pv_matmul: O = P V, the same tiling; causal rows stop at the diagonal.
cuda.flash (one launch, FlashAttention-2 forward; no N x N buffer)
    Each block owns block_q queries and streams K/V tiles of block_k keys
    through shared memory. A thread computes a 4 x 4 tile of scores in
    registers (its rows ty + r*RG, keys tx + c*KG: strided, so reads of the
    shared tiles are conflict-free or broadcast), keeps the running max, sum
    and a 4-row slice of the output accumulator in registers, and exchanges
    row maxima with the other KG threads of its row group by warp shuffles.
    Scores are in the log2 domain (Q pre-scaled by scale*log2(e)); the row
    sum is reduced across the group only once, at the end. Causal blocks
    stream only the K/V tiles up to the diagonal.
    Every index is unsigned and the inner loops walk running offsets (see
    flash_kernel). docs/kernels.md describes the design, docs/results.md the
    current measurements.
    Log-sum-exp: a variant compiled with_lse also writes each row's
    lse = (m + log2(l)) * ln 2 from its final max m and sum l (log2 domain);
    without it the kernel has no store of lse at all.
    Dropout: a featured variant multiplies each tile of P by the Philox mask's
    Z (philox4x32_10, attnkern._philox's stream) after the row sums.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import config, cuda, float64, int64, uint64

from ... import _philox
from ..._gpuarray import GpuArray
from .arrays import workspace
from .launch import LN2, LOG2E, SHARED_BYTES, _device_lengths, launch, round_up, take_dynamic_shared

MICRO = (4, 4)  # rows and keys per thread in cuda.flash's score tile
FULL_MASK = 0xFFFFFFFF
INLINE = {} if config.ENABLE_CUDASIM else {"forceinline": True}  # the simulator takes no such option

if config.ENABLE_CUDASIM:
    # Numba's CUDA simulator has no warp shuffles (and runs a Python thread per
    # GPU thread, with slow barriers). Our kernels reduce with every thread of
    # the block converged, so a reduction through shared memory between two
    # block-wide barriers gives every lane its group's result, as on the GPU.
    @cuda.jit(device=True)
    def lane_reduce(value, width, is_max):
        buf = cuda.shared.array(1024, float64)
        tid = cuda.threadIdx.x + cuda.blockDim.x * (cuda.threadIdx.y + cuda.blockDim.y * cuda.threadIdx.z)
        cuda.syncthreads()
        buf[tid] = value
        cuda.syncthreads()
        first = tid - tid % width
        acc = buf[first]
        for i in range(first + 1, first + width):
            acc = max(acc, buf[i]) if is_max else acc + buf[i]
        cuda.syncthreads()
        return type(value)(acc)
else:
    @cuda.jit(device=True, **INLINE)
    def lane_reduce(value, width, is_max):
        """The max (is_max) or sum of value over each aligned group of `width`
        lanes (a power of two up to 32), returned to every lane: a butterfly
        of warp shuffles, no shared memory."""
        offset = width // 2
        while offset > 0:
            other = cuda.shfl_xor_sync(FULL_MASK, value, offset)
            value = max(value, other) if is_max else value + other
            offset //= 2
        return value


# ---------------------------------------------------------------- cuda.naive

@functools.cache
def naive_kernels(dtype: str, tile: int):
    """The three kernels of cuda.naive for one dtype and square tile size, on
    flat arrays with unsigned indices and walking offsets, as flash_kernel."""
    T = tile
    TP = T + 1  # the padded row stride: a column of the tile spans every bank
    TILE, TILE_PADDED = T * T, T * TP  # shared tile sizes: constants of the closure, as Numba needs
    ftype = np.dtype(dtype).type
    NEG_INF = ftype(-np.inf)
    ZERO = ftype(0)
    # two warps in the simulator, whose threads are Python threads: still a
    # cross-warp reduction, with a quarter of the threads
    SOFTMAX_THREADS = 64 if config.ENABLE_CUDASIM else 256
    WARPS = SOFTMAX_THREADS // 32
    U = np.uint64
    U_T, U_TP, U_ST, U_32 = U(T), U(TP), U(SOFTMAX_THREADS), U(32)
    U_0, U_1 = U(0), U(1)

    @cuda.jit
    def qk_scores(q, k, s, nq, nk, d, scale, causal):
        # q, k: flat (batch, n, d) rows; s: flat (batch, nq, nk)
        nq, nk, d = uint64(nq), uint64(nk), uint64(d)
        b = uint64(cuda.blockIdx.z)
        row0 = uint64(cuda.blockIdx.y) * U_T
        col0 = uint64(cuda.blockIdx.x) * U_T
        ty = uint64(cuda.threadIdx.y)
        tx = uint64(cuda.threadIdx.x)
        row = row0 + ty
        col = col0 + tx
        at = (b * nq + row) * nk + col
        if causal and col0 > row0 + U_T - U_1:  # the whole tile is above the diagonal
            if row < nq and col < nk:
                s[at] = NEG_INF
            return
        tq = cuda.shared.array(TILE, ftype)
        tkt = cuda.shared.array(TILE_PADDED, ftype)  # K tile transposed: tkt[t, j] = k[col0 + j, t]
        krow = col0 + ty
        qa = (b * nq + row) * d + tx  # q[b, row, t0 + tx] at qa + t0
        ka = (b * nk + krow) * d + tx  # k[b, krow, t0 + tx] at ka + t0
        acc = ZERO
        for t0 in range(U_0, d, U_T):
            tq[ty * U_T + tx] = q[qa + t0] if row < nq and t0 + tx < d else ZERO
            tkt[tx * U_TP + ty] = k[ka + t0] if krow < nk and t0 + tx < d else ZERO
            cuda.syncthreads()
            a, c = ty * U_T, tx  # tq[ty, t] and tkt[t, tx] along t
            for _ in range(T):
                acc += tq[a] * tkt[c]
                a += U_1
                c += U_TP
            cuda.syncthreads()
        if row < nq and col < nk:
            s[at] = NEG_INF if causal and col > row else acc * scale

    @cuda.jit(device=True)
    def _block_reduce(value, partial, lane, warp, is_max):
        """The max or sum of value over the block, returned to every thread."""
        value = lane_reduce(value, 32, is_max)
        if lane == U_0:
            partial[warp] = value
        cuda.syncthreads()
        value = partial[0]
        for w in range(1, WARPS):
            value = max(value, partial[w]) if is_max else value + partial[w]
        cuda.syncthreads()  # partial is reused by the next reduction
        return value

    @cuda.jit
    def softmax_rows(s, nq, nk):
        # s: flat (batch, nq, nk); a block per row
        nq, nk = uint64(nq), uint64(nk)
        b = uint64(cuda.blockIdx.y)
        row = uint64(cuda.blockIdx.x)
        tid = uint64(cuda.threadIdx.x)
        lane = tid % U_32
        warp = tid // U_32
        partial = cuda.shared.array(WARPS, ftype)
        at = (b * nq + row) * nk
        m = NEG_INF
        for j in range(tid, nk, U_ST):
            m = max(m, s[at + j])
        m = _block_reduce(m, partial, lane, warp, True)
        total = ZERO
        for j in range(tid, nk, U_ST):
            e = math.exp(s[at + j] - m)  # the row max is finite: key 0 is always visible
            s[at + j] = e
            total += e
        total = _block_reduce(total, partial, lane, warp, False)
        inv = ftype(1) / total
        for j in range(tid, nk, U_ST):
            s[at + j] *= inv

    @cuda.jit
    def pv_matmul(p, v, out, nq, nk, dv, causal):
        # p: flat (batch, nq, nk); v: flat (batch, nk, dv) rows; out: flat (batch, nq, dv)
        nq, nk, dv = uint64(nq), uint64(nk), uint64(dv)
        b = uint64(cuda.blockIdx.z)
        row0 = uint64(cuda.blockIdx.y) * U_T
        col0 = uint64(cuda.blockIdx.x) * U_T
        ty = uint64(cuda.threadIdx.y)
        tx = uint64(cuda.threadIdx.x)
        row = row0 + ty
        col = col0 + tx
        tp = cuda.shared.array(TILE, ftype)
        tv = cuda.shared.array(TILE_PADDED, ftype)
        kend = min(nk, row0 + U_T) if causal else nk  # p is 0 right of the diagonal
        pa = (b * nq + row) * nk + tx  # p[b, row, j0 + tx] at pa + j0
        va = (b * nk + ty) * dv + col  # v[b, j0 + ty, col] at va + j0 * dv
        acc = ZERO
        for j0 in range(U_0, kend, U_T):
            tp[ty * U_T + tx] = p[pa + j0] if row < nq and j0 + tx < nk else ZERO
            tv[ty * U_TP + tx] = v[va + j0 * dv] if j0 + ty < nk and col < dv else ZERO
            cuda.syncthreads()
            a, c = ty * U_T, tx  # tp[ty, t] and tv[t, tx] along t
            for _ in range(T):
                acc += tp[a] * tv[c]
                a += U_1
                c += U_TP
            cuda.syncthreads()
        if row < nq and col < dv:
            out[(b * nq + row) * dv + col] = acc

    return qk_scores, softmax_rows, pv_matmul, SOFTMAX_THREADS


def naive(q, k, v, out, causal: bool, scale: float, tile: int) -> None:
    """out = softmax(q k^T * scale) v on GpuArrays (batch, n, d) (cuda_arrays)."""
    batch, nq, d = q.shape
    nk, dv = k.shape[1], v.shape[2]
    qk_scores, softmax_rows, pv_matmul, threads = naive_kernels(q.dtype.name, tile)
    scores = workspace(batch * nq * nk, q.dtype, q.owner)
    launch(qk_scores, (-(-nk // tile), -(-nq // tile), batch), (tile, tile), q, k, scores, nq, nk, d,
           q.dtype.type(scale), bool(causal))
    launch(softmax_rows, (nq, batch), threads, scores, nq, nk)
    launch(pv_matmul, (-(-dv // tile), -(-nq // tile), batch), (tile, tile), scores, v, out, nq, nk, dv, bool(causal))


def naive_workspace_bytes(batch: int, nq: int, nk: int, itemsize: int) -> int:
    return batch * nq * nk * itemsize


# ---------------------------------------------------------------- cuda.flash

@cuda.jit(device=True, **INLINE)
def tile_products(acc, rows, cols, steps, a, a_at, a_row_step, a_step, b, b_at, b_col_step, b_step, fa, fb):
    """acc[r, c] += sum over `steps` of a[a_at + r*a_row_step] * b[b_at + c*b_col_step],
    both offsets advancing by a_step and b_step each step: one thread's register
    tile of a product of two shared-memory tiles. Offsets are unsigned and walk,
    rather than being recomputed from signed 2-D indices (see flash_kernel);
    inlined into a kernel whose rows/cols/steps are constants, the loops unroll."""
    for _ in range(steps):
        for r in range(rows):
            fa[r] = a[a_at + uint64(r) * a_row_step]
        for c in range(cols):
            fb[c] = b[b_at + uint64(c) * b_col_step]
        for r in range(rows):
            for c in range(cols):
                acc[r, c] += fa[r] * fb[c]
        a_at += a_step
        b_at += b_step


def flash_shared_bytes(block_q: int, block_k: int, d: int, dv: int, itemsize: int, micro=MICRO) -> int:
    """Shared memory of one cuda.flash block: Q tile, K^T-or-P tile, V tile."""
    dp, dvp = flash_padded_dims(block_k, d, dv, micro)
    return (block_q * (dp + 1) + max(dp, block_q) * (block_k + 1) + block_k * dvp) * itemsize


def flash_padded_dims(block_k: int, d: int, dv: int, micro=MICRO) -> tuple[int, int]:
    """Head sizes rounded up (zero-filled) so one compiled kernel serves many D."""
    kg = block_k // micro[1]
    return round_up(d, 16), round_up(dv, max(16, kg))


@cuda.jit(device=True, **INLINE)
def key_range(row, off, wl, wr, length):
    """[lo, hi) of the keys query row `row` sees (int64): lo = row + off - wl (0 for
    wl = -1), hi = min(length, row + off + wr + 1) (length for wr = -1); off is 0
    (top-left) or length - nq (bottom-right), causal is wr = 0. hi <= lo: none."""
    diag = int64(row) + off
    lo = max(int64(0), diag - wl) if wl >= 0 else int64(0)
    hi = min(length, max(int64(0), diag + wr + 1)) if wr >= 0 else length
    return lo, hi


@cuda.jit(device=True)
def masked(s, mask, is_bool, at, munit, neg_inf):
    """A visible score s with the attention mask's element mask[at]: neg_inf where
    a bool mask is false, else s plus the additive value times munit (the size of
    a mask unit in the scores' units)."""
    if is_bool:
        return s if mask[at] else neg_inf
    return s + mask[at] * munit


@cuda.jit(device=True)
def mask_base(b, heads, sb, sh):
    """The mask element offset of folded batch row b: (b // heads) sb + (b % heads) sh."""
    return b // uint64(heads) * uint64(sb) + b % uint64(heads) * uint64(sh)


# Philox4x32-10 (attnkern._philox, attn_common.h's attn_philox), in uint64 arithmetic on
# 32-bit values: each product of two 32-bit words fits 64 bits, its high half is the
# mulhi; every operand is uint64 (Numba turns uint64 mixed with int64 into float64).
# The constants are _philox's, as uint64 globals (compile-time constants to Numba).
PHILOX_M0, PHILOX_M1 = np.uint64(_philox._M0), np.uint64(_philox._M1)
PHILOX_W0, PHILOX_W1 = np.uint64(_philox._W0), np.uint64(_philox._W1)
LOW32, SHIFT32 = np.uint64(0xFFFFFFFF), np.uint64(32)
NO_GROUP = np.uint64(2**64 - 1)  # a key group (counter // 4) no key has: a cache of Philox words starts empty


@cuda.jit(device=True, **INLINE)
def philox4x32_10(c0, c1, c2, c3, seed):
    """The four words of Philox4x32-10 for counter (c0, c1, c2, c3), each taken mod
    2^32, and key (seed mod 2^32, seed // 2^32): uint64 values below 2^32."""
    c0, c1, c2, c3 = uint64(c0) & LOW32, uint64(c1) & LOW32, uint64(c2) & LOW32, uint64(c3) & LOW32
    k0, k1 = uint64(seed) & LOW32, uint64(seed) >> SHIFT32
    for _ in range(10):
        p0, p1 = PHILOX_M0 * c0, PHILOX_M1 * c2
        c0, c1, c2, c3 = (p1 >> SHIFT32) ^ c1 ^ k0, p1 & LOW32, (p0 >> SHIFT32) ^ c3 ^ k1, p0 & LOW32
        k0, k1 = (k0 + PHILOX_W0) & LOW32, (k1 + PHILOX_W1) & LOW32  # the last bump is unused
    return c0, c1, c2, c3


@cuda.jit(device=True, **INLINE)
def pick_word(w0, w1, w2, w3, j):
    """Word j % 4 of a Philox output."""
    pick = uint64(j) & uint64(3)
    if pick == uint64(0):
        return w0
    if pick == uint64(1):
        return w1
    return w2 if pick == uint64(2) else w3


@cuda.jit(device=True, **INLINE)
def dropout_factor(seed, thr, zscale, zero, b, i, j):
    """Dropout's factor Z of folded batch row b, query counter i, key counter j:
    zscale (1 / (1 - p)) where word j % 4 of Philox4x32-10((j // 4, i, b, 0), seed)
    is >= thr (round(p 2^32)), else zero."""
    j = uint64(j)
    w0, w1, w2, w3 = philox4x32_10(j >> uint64(2), i, b, uint64(0), seed)
    return zscale if pick_word(w0, w1, w2, w3, j) >= thr else zero


@functools.cache
def flash_kernel(dtype: str, block_q: int, block_k: int, dp: int, dvp: int, micro=MICRO, with_lse: bool = False,
                 featured: bool = False, mask_kind: int = 0, alibi: bool = False, dropout: bool = False):
    """cuda.flash's kernel for one dtype, tile shape and padded head sizes;
    micro: the (rows, keys) of scores each thread holds; with_lse: the variant
    that also writes each row's log-sum-exp (the other never touches lse);
    featured: the variant that takes the attention features (kv_group, lens per
    sequence of seq_rows batch rows, bottom_right, window sides, the softcap in the
    log2 domain's units: launch.KernelFeatures); the plain one ignores them.
    dropout (featured only): the variant that multiplies each tile of P by the
    Philox mask's Z after the row sums (so lse stays the undropped softmax's),
    in a pass over the tile in shared memory, one Philox call per 4 keys of a row.

    Every index is an unsigned 64-bit integer, the global arrays are flat and
    the inner loops walk running offsets: for a signed index Numba emits a
    negative-index wraparound select, integer work that would sit beside the
    16 FMAs of each step of Q K^T."""
    ftype = np.dtype(dtype).type
    NEG_INF = ftype(-np.inf)
    ZERO = ftype(0)
    TM, TN = micro
    RG = block_q // TM  # row groups: thread ty owns rows ty + r*RG
    KG = block_k // TN  # threads per row group: thread tx owns keys tx + c*KG
    CV = dvp // KG  # output columns per thread: tx + c*KG
    NT = RG * KG
    BQ, BK, DP, DVP = block_q, block_k, dp, dvp
    SQ_LD, SKP_LD = DP + 1, BK + 1  # padded row strides of the Q and K^T/P tiles
    # sizes and shapes as constants of the closure: Numba needs them at compile time
    SQ_SIZE, SKP_SIZE, SV_SIZE = BQ * SQ_LD, max(DP, BQ) * SKP_LD, BK * DVP
    S_SHAPE, O_SHAPE, FRAG = (TM, TN), (TM, CV), max(TM, TN, CV)
    U = np.uint64
    U_BQ, U_BK, U_DP, U_DVP, U_KG = U(BQ), U(BK), U(DP), U(DVP), U(KG)
    U_SQ_LD, U_SKP_LD = U(SQ_LD), U(SKP_LD)
    U_RG_SQ, U_RG_SKP = U(RG * SQ_LD), U(RG * SKP_LD)  # from one of a thread's rows to the next
    U_0, U_1 = U(0), U(1)
    WITH_LSE = bool(with_lse)  # a constant of the closure: the variant without lse compiles no store
    FEAT = bool(featured)  # likewise: the plain variant compiles none of the features' work
    MASKED, IS_BOOL = FEAT and mask_kind != 0, mask_kind == 1  # the attention mask's (launch.MASK_KINDS)
    ALIBI = FEAT and bool(alibi)  # ALiBi's -slope |i + len - nq - j|
    DROPOUT = FEAT and bool(dropout)
    BK4 = BK // 4  # groups of 4 keys (one Philox call each) in a row of the P tile
    U_BK4, U_4 = U(BK4), U(4)
    F_LN2 = ftype(LN2)
    # one shared array holds the three tiles; past the static limit it is the launch's
    # dynamic shared memory (size 0 here; launch() passes the bytes and raises the limit)
    SMEM_SIZE = SQ_SIZE + SKP_SIZE + SV_SIZE
    SMEM_BYTES = SMEM_SIZE * np.dtype(dtype).itemsize
    SMEM_STATIC = 0 if SMEM_BYTES > SHARED_BYTES else SMEM_SIZE
    SKP_AT, SV_AT = SQ_SIZE, SQ_SIZE + SKP_SIZE

    @cuda.jit
    def flash_forward(q, k, v, out, lse, nq, nk, d, dv, qscale, causal, kv_group, lens, seq_rows, bottom_right, wl,
                      wr, capl, mask, mheads, msb, msh, msi, msj, munit, slopes, aunit, dseed, dthr, dscale, di0, dj0):
        # q, k, v, out: flat arrays of (batch, n, d) rows, lse of (batch, nq) (unused
        # unless WITH_LSE); every index below is unsigned; the features (after
        # causal) are read only by the featured variant, dropout's (dseed...) by its
        # dropout variant
        nq, nk, d, dv = uint64(nq), uint64(nk), uint64(d), uint64(dv)
        b = uint64(cuda.blockIdx.y)
        q0 = uint64(cuda.blockIdx.x) * U_BQ
        tid = uint64(cuda.threadIdx.x)
        tx = tid % U_KG
        ty = tid // U_KG
        q_rows, kv_rows = b * nq, b * nk  # this head's first row in q/out and in k/v
        j_first, kend, length = U_0, min(nk, q0 + U_BQ) if causal else nk, nk
        off, wr_c = int64(0), int64(0)
        if FEAT:
            kv_rows = b // uint64(kv_group) * nk
            length = uint64(lens[b // uint64(seq_rows)])
            off = int64(length) - int64(nq) if bottom_right else int64(0)
            wr_c = int64(0) if causal else int64(wr)
            # the key tiles some row of the block sees: from the first row's lo to the last row's hi
            lo, _ = key_range(q0, off, int64(wl), wr_c, int64(length))
            _, hi = key_range(min(q0 + U_BQ, nq) - U_1, off, int64(wl), wr_c, int64(length))
            j_first, kend = uint64(lo) // U_BK * U_BK, uint64(hi) if hi > lo else U_0
        mat = mask_base(b, mheads, msb, msh) if MASKED else U_0
        slope = slopes[b] * aunit if ALIBI else ZERO

        smem = cuda.shared.array(SMEM_STATIC, ftype)
        sq = smem[:SKP_AT]
        skp = smem[SKP_AT:SV_AT]  # K^T while scores are computed, then P
        sv = smem[SV_AT:SMEM_SIZE]
        s = cuda.local.array(S_SHAPE, ftype)
        o = cuda.local.array(O_SHAPE, ftype)
        m = cuda.local.array(TM, ftype)
        lsum = cuda.local.array(TM, ftype)
        fa = cuda.local.array(FRAG, ftype)  # fragments of the two operands of a product step
        fb = cuda.local.array(FRAG, ftype)

        for n in range(tid, BQ * DP, NT):
            i, t = uint64(n) // U_DP, uint64(n) % U_DP
            row = q0 + i
            sq[i * U_SQ_LD + t] = q[(q_rows + row) * d + t] * qscale if row < nq and t < d else ZERO
        for r in range(TM):
            m[r] = NEG_INF
            lsum[r] = ZERO
            for c in range(CV):
                o[r, c] = ZERO

        for j0 in range(j_first, kend, U_BK):
            cuda.syncthreads()  # the previous tile's P and V are consumed
            # keys past the row's length are never read (they may hold anything)
            for n in range(tid, BK * DP, NT):
                j, t = uint64(n) // U_DP, uint64(n) % U_DP
                key = j0 + j
                skp[t * U_SKP_LD + j] = k[(kv_rows + key) * d + t] if key < length and t < d else ZERO
            for n in range(tid, BK * DVP, NT):
                j, e = uint64(n) // U_DVP, uint64(n) % U_DVP
                key = j0 + j
                sv[n] = v[(kv_rows + key) * dv + e] if key < length and e < dv else ZERO
            cuda.syncthreads()

            for r in range(TM):
                for c in range(TN):
                    s[r, c] = ZERO
            # s += Q[rows] K^T[:, keys], from sq[ty, t] and skp[t, tx] along t
            tile_products(s, TM, TN, DP, sq, ty * U_SQ_LD, U_RG_SQ, U_1, skp, tx, U_KG, U_SKP_LD, fa, fb)
            cuda.syncthreads()  # K^T is consumed: skp now takes P

            for r in range(TM):
                row = q0 + ty + U(r * RG)
                mt = NEG_INF
                if FEAT:
                    lo, hi = key_range(row, off, int64(wl), wr_c, int64(length))
                for c in range(TN):
                    key = j0 + tx + U(c * KG)
                    if FEAT:
                        if capl > 0:  # the softcap, in the log2 domain, before the mask
                            s[r, c] = capl * math.tanh(s[r, c] / capl)
                        if int64(key) < lo or int64(key) >= hi:
                            s[r, c] = NEG_INF
                        else:
                            if ALIBI:  # after the softcap, before the mask, as the CPU's
                                s[r, c] -= slope * ftype(abs(int64(row) + int64(length) - int64(nq) - int64(key)))
                            if MASKED and row < nq:
                                s[r, c] = masked(s[r, c], mask, IS_BOOL, mat + row * uint64(msi) + key * uint64(msj),
                                                 munit, NEG_INF)
                    elif key >= nk or (causal and key > row):
                        s[r, c] = NEG_INF
                    mt = max(mt, s[r, c])
                mnew = max(m[r], lane_reduce(mt, KG, True))
                # plain: mnew is finite (key 0 is visible to every row, and it is in the first
                # tile); a featured row that has seen no key yet keeps -inf, its p and sums 0
                mref = ZERO if FEAT and mnew == NEG_INF else mnew
                alpha = math.exp2(m[r] - mref)
                m[r] = mnew
                part = ZERO
                for c in range(TN):
                    p = math.exp2(s[r, c] - mref)
                    part += p
                    skp[(ty + U(r * RG)) * U_SKP_LD + tx + U(c * KG)] = p
                lsum[r] = lsum[r] * alpha + part  # this thread's keys only; summed at the end
                for c in range(CV):
                    o[r, c] *= alpha
            cuda.syncthreads()
            if DROPOUT:
                # P times Z, 4 consecutive keys of a row per step: their counters (query
                # di0 + row, key dj0 + key) share one Philox call unless dj0 splits them
                for n in range(tid, BQ * BK4, NT):
                    i, jg = uint64(n) // U_BK4, uint64(n) % U_BK4
                    at = i * U_SKP_LD + jg * U_4
                    jc = j0 + jg * U_4 + uint64(dj0)
                    group = NO_GROUP
                    w0, w1, w2, w3 = U_0, U_0, U_0, U_0
                    for c in range(4):
                        if (jc >> uint64(2)) != group:
                            group = jc >> uint64(2)
                            w0, w1, w2, w3 = philox4x32_10(group, q0 + i + uint64(di0), b, U_0, dseed)
                        skp[at] = skp[at] * dscale if pick_word(w0, w1, w2, w3, jc) >= dthr else ZERO
                        at += U_1
                        jc += U_1
                cuda.syncthreads()

            # o += P[rows] V[:, columns], from P[ty, j] and sv[j, tx] along j
            tile_products(o, TM, CV, BK, skp, ty * U_SKP_LD, U_RG_SKP, U_1, sv, tx, U_KG, U_DVP, fa, fb)

        for r in range(TM):
            total = lane_reduce(lsum[r], KG, False)
            row = q0 + ty + U(r * RG)
            inv = ftype(1) / total if total > ZERO else ZERO  # a row that saw no key: 0
            for c in range(CV):
                e = tx + U(c * KG)
                if row < nq and e < dv:
                    out[(q_rows + row) * dv + e] = o[r, c] * inv
            if WITH_LSE:
                # m (the row max, the same in every lane of the group) and total are in
                # the log2 domain: lse = ln(sum_j exp(scale q.k_j)) = (m + log2(total)) ln 2
                if tx == U_0 and row < nq:
                    lse[q_rows + row] = (m[r] + math.log2(total)) * F_LN2 if total > ZERO else NEG_INF

    if SMEM_STATIC == 0:
        take_dynamic_shared(flash_forward, SMEM_BYTES)
    return flash_forward, NT


def feature_args(feat, nk: int, ftype, lens_like) -> tuple:
    """The Numba kernels' feature arguments (kv_group, lens, seq_rows, bottom_right,
    wl, wr, capl, mask, mheads, msb, msh, msi, msj, munit, slopes, aunit, dseed,
    dthr, dscale, di0, dj0) of a launch.KernelFeatures (the softcap, mask and ALiBi
    units in the log2 domain's; dropout's seed, threshold, 1 / (1 - p) and counter
    offsets); lens_like stands in for lens, mask and slopes where the kernel does not
    read them (feat None: a plain call), and without key lengths lens is one length,
    nk, for every row."""
    if feat is None:
        return (1, lens_like, 1, False, -1, -1, ftype(0), lens_like, 1, 0, 0, 0, 0, ftype(0), lens_like, ftype(0),
                *dropout_args(None, ftype))
    # one length for every row: copied to the GPU once per nk (a copy per call would wait for it)
    lens = feat.lens if feat.lens is not None else _device_lengths(np.array([nk], np.int32).tobytes())
    mask = lens_like if feat.mask is None else mask_flat(feat.mask)
    return (feat.kv_group, lens, feat.seq_rows if feat.lens is not None else 1 << 62, bool(feat.bottom_right),
            feat.window_left, feat.window_right, ftype(feat.softcap * LOG2E), mask, feat.mask_heads,
            *feat.mask_strides(), ftype(LOG2E), lens_like if feat.alibi is None else feat.alibi, ftype(LOG2E),
            *dropout_args(feat, ftype))


def dropout_args(feat, ftype) -> tuple:
    """(dseed, dthr, dscale, di0, dj0): dropout's seed, keep threshold round(p 2^32),
    Z = 1 / (1 - p) in the kernel's float (as the CPU kernels round it) and the
    counter offsets of query and key (attnkern._philox); zeros without dropout."""
    U = np.uint64
    if feat is None or not feat.dropout_p > 0:
        return (U(0), U(0), ftype(0), U(0), U(0))
    i0, j0 = feat.dropout_offset
    return (U(feat.dropout_seed), U(_philox.threshold(feat.dropout_p)), ftype(1.0 / (1.0 - feat.dropout_p)), U(i0),
            U(j0))


def mask_flat(mask):
    """A flat GpuArray over every element a 4-D mask view (byte strides) reaches."""
    if mask.contiguous and mask._flat is not None:  # the simulator's
        return GpuArray((mask.size,), mask.dtype, None, mask._flat)
    extent = 1 + sum((n - 1) * st for n, st in zip(mask.shape, mask.strides)) // mask.dtype.itemsize
    return GpuArray((extent,), mask.dtype, None, ptr=mask.ptr, owner=mask.owner, contiguous=True)


def flash_launch(q, k, v, out, causal: bool, scale: float, block_q: int, block_k: int, micro=MICRO, lse=None,
                 feat=None):
    """(kernel, grid, block, args) of flash(): launch() takes them, or Prepared.
    feat: a launch.KernelFeatures, or None (the plain kernel)."""
    batch, nq, d = q.shape
    dp, dvp = flash_padded_dims(block_k, d, v.shape[2], micro)
    kernel, threads = flash_kernel(q.dtype.name, block_q, block_k, dp, dvp, micro, lse is not None, feat is not None,
                                   0 if feat is None else feat.mask_kind, feat is not None and feat.alibi is not None,
                                   feat is not None and feat.dropout_p > 0)
    # without lse the kernel never reads its lse argument: out stands in for it
    return (kernel, (-(-nq // block_q), batch), threads,
            (q, k, v, out, out if lse is None else lse, nq, k.shape[1], d, v.shape[2], q.dtype.type(scale * LOG2E),
             bool(causal), *feature_args(feat, k.shape[1], q.dtype.type, out)))


def flash(q, k, v, out, causal: bool, scale: float, block_q: int, block_k: int, micro=MICRO, lse=None,
          feat=None) -> None:
    """out = softmax(q k^T * scale) v on GpuArrays (batch, n, d) (cuda_arrays);
    lse: None, or a GpuArray (batch, nq) of out's dtype to fill with each row's
    natural-log log-sum-exp of the scaled, masked scores; feat: a
    launch.KernelFeatures or None."""
    kernel, grid, block, args = flash_launch(q, k, v, out, causal, scale, block_q, block_k, micro, lse, feat)
    launch(kernel, grid, block, *args)
