"""cuda.naive and cuda.flash: attention kernels for NVIDIA GPUs, written with
numba-cuda. Importing this module imports numba.cuda; kernels are compiled on
first use for each (dtype, tile shape, padded head size) and kept per process.

The two kernels, and cuda.flash's backward:

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
    measurements, including the variants that are not kept.
    Log-sum-exp: a variant compiled with_lse also writes each row's
    lse = (m + log2(l)) * ln 2 from its final max m and sum l (log2 domain);
    without it the kernel has no store of lse at all.
cuda.flash backward (three launches, FlashAttention-2 order, deterministic)
    P is recomputed from the saved lse (P_ij = 2^(s_ij - lse_i log2 e), no row
    max, no N x N buffer). 1. flash_backward_delta: D_i = dO_i . O_i, a thread
    per row. 2. flash_backward_dkdv: a block per block_k keys, a thread per
    key; it streams the tiles of block_q queries that can see its keys (causal:
    from the diagonal on) with their dO rows, lse and D through shared memory
    (every thread reads the same element: a broadcast) and accumulates dK_j and
    dV_j in thread-local arrays of the padded head size. 3. flash_backward_dq:
    a block per block_q queries, a thread per query, K/V tiles of block_k keys
    streamed (causal: up to the diagonal), dQ_i accumulated the same way. Each
    gradient row is summed by one thread over the queries or keys in order: no
    atomics, and results that depend neither on the tiles nor on scheduling.
    Tiles are block_q and block_k as given (0: 64), halved until shared memory
    fits (backends/cuda/__init__.py, _flash_backward_tiles).
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import threading

import numpy as np
from numba import config, cuda, float64, int32, uint64

LOG2E = math.log2(math.e)  # scores in the log2 domain: exp(s) = 2^(s * LOG2E)
LN2 = math.log(2.0)  # back from the log2 domain: ln(x) = log2(x) * LN2
SHARED_BYTES = 48 * 1024  # static shared memory per block (CUDA's limit without opt-in)
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


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# ---------------------------------------------------------------- launches

class RawKernel:
    """A compiled Numba kernel launched below Numba's dispatcher: the driver's
    kernel handle and a launch configuration per (grid, block) are kept, and
    arguments go to the driver as Numba's calling convention lays them out
    (see launch), with no typing of Python values and no array objects made per
    call. That dispatch is most of a call's overhead at small sizes."""

    def __init__(self, compiled):
        from cuda.core import LaunchConfig
        from cuda.core import launch as core_launch
        from numba.cuda.cudadrv import driver

        self._kernel = compiled._codelibrary.get_cufunc().kernel
        self._launch, self._config = core_launch, LaunchConfig
        self._stream = driver._to_core_stream(0)  # the legacy default stream, as Numba's own launches
        self._configs = {}

    def __call__(self, grid: tuple, block: tuple, args: list) -> None:
        cfg = self._configs.get((grid, block))
        if cfg is None:
            cfg = self._configs[grid, block] = self._config(grid=grid, block=block, shmem_size=0)
        self._launch(self._stream, cfg, self._kernel, *args)


_RAW: dict = {}  # dispatcher -> RawKernel; each of our dispatchers is always called with one signature
_RAW_LOCK = threading.Lock()


def _dim3(x) -> tuple:
    x = (x,) if isinstance(x, int) else tuple(x)
    return x + (1,) * (3 - len(x))


def launch(dispatcher, grid, block, *args) -> None:
    """dispatcher[grid, block](*args) where each GpuArray argument is passed as its
    flat 1-D Numba view. The first launch of a dispatcher goes through Numba (it
    compiles there); later ones through RawKernel, with a GpuArray as the fields
    of Numba's 1-D C-contiguous array (meminfo, parent, size, itemsize, data
    pointer, shape, stride), a bool as is, NumPy scalars and Python ints and floats
    as the C types Numba types them as (int64, float64, and the NumPy scalar's own)."""
    from .arrays import GpuArray

    raw = None if config.ENABLE_CUDASIM else _RAW.get(dispatcher)
    if raw is None:
        dispatcher[grid, block](*(a.flat if isinstance(a, GpuArray) else a for a in args))
        if not config.ENABLE_CUDASIM:
            with _RAW_LOCK:
                if dispatcher not in _RAW and len(dispatcher.overloads) == 1:
                    _RAW[dispatcher] = RawKernel(next(iter(dispatcher.overloads.values())))
        return
    flat = []
    for a in args:
        if isinstance(a, GpuArray):
            n, itemsize = a.size, a.dtype.itemsize
            flat += (0, 0, n, itemsize, a.ptr, n, itemsize)
        elif isinstance(a, bool):
            flat.append(a)
        elif isinstance(a, int):
            flat.append(ctypes.c_int64(a))
        elif isinstance(a, float):
            flat.append(ctypes.c_double(a))
        else:
            flat.append(_CTYPES[a.dtype.name](a))
    raw(_dim3(grid), _dim3(block), flat)


_CTYPES = {"float32": ctypes.c_float, "float64": ctypes.c_double, "int32": ctypes.c_int32,
           "int64": ctypes.c_int64, "uint16": ctypes.c_uint16, "uint32": ctypes.c_uint32, "uint64": ctypes.c_uint64}


# ---------------------------------------------------------------- finite checks

SCAN_BLOCKS, SCAN_THREADS = (2, 32) if config.ENABLE_CUDASIM else (528, 256)
# the exponent bits, all set for NaN and infinity, of each float dtype's bit pattern
_EXPONENT = {"float16": (np.uint16, 0x7C00), "bfloat16": (np.uint16, 0x7F80),
             "float32": (np.uint32, 0x7F800000), "float64": (np.uint64, 0x7FF0000000000000)}


@functools.cache
def nonfinite_kernel(itemsize: int):
    """A scan of up to four flat arrays of one width, viewed as unsigned integers:
    flags[i] = 1 where array i has an element whose exponent bits are all set."""

    @cuda.jit(device=True)
    def seen(a, n, mask, start, stride):
        for i in range(start, n, stride):
            if (a[i] & mask) == mask:
                return True
        return False

    @cuda.jit
    def scan(a0, a1, a2, a3, n0, n1, n2, n3, mask0, mask1, mask2, mask3, flags):
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        if seen(a0, n0, mask0, start, stride):
            flags[0] = 1
        if seen(a1, n1, mask1, start, stride):
            flags[1] = 1
        if seen(a2, n2, mask2, start, stride):
            flags[2] = 1
        if seen(a3, n3, mask3, start, stride):
            flags[3] = 1

    return scan


_FLAGS = threading.local()  # per thread: mapped host memory the scan writes its four flags to


def nonfinite(arrays) -> list[bool]:
    """For each of up to four GpuArrays (all of one itemsize), whether it holds a
    NaN or an infinity; one launch, flags in mapped host memory, one wait."""
    from .arrays import GpuArray

    flags = getattr(_FLAGS, "flags", None)
    if flags is None:
        flags = _FLAGS.flags = cuda.mapped_array(4, dtype=np.int32)
        _FLAGS.view = GpuArray((4,), np.int32, None, ptr=flags.device_ctypes_pointer.value or 0, owner=flags)
        _FLAGS.stream = cuda.default_stream()
    flags[:] = 0
    itype, mask = _EXPONENT[arrays[0].dtype.name]
    ints = [GpuArray((a.size,), itype, None, ptr=a.ptr, owner=a.owner) for a in arrays]
    while len(ints) < 4:
        ints.append(ints[0])
    sizes = [x.size for x in ints[:len(arrays)]] + [0] * (4 - len(arrays))
    launch(nonfinite_kernel(np.dtype(itype).itemsize), SCAN_BLOCKS, SCAN_THREADS, *ints, *sizes,
           *([itype(mask)] * 4), _FLAGS.view)
    _FLAGS.stream.synchronize()
    return [bool(f) for f in flags[:len(arrays)]]


# ---------------------------------------------------------------- cuda.naive

@functools.cache
def naive_kernels(dtype: str, tile: int):
    """The three kernels of cuda.naive for one dtype and square tile size."""
    T = tile
    TILE, TILE_PADDED = (T, T), (T, T + 1)  # padded: a column of the tile spans every bank
    ftype = np.dtype(dtype).type
    NEG_INF = ftype(-np.inf)
    ZERO = ftype(0)
    # two warps in the simulator, whose threads are Python threads: still a
    # cross-warp reduction, with a quarter of the threads
    SOFTMAX_THREADS = 64 if config.ENABLE_CUDASIM else 256
    WARPS = SOFTMAX_THREADS // 32

    @cuda.jit
    def qk_scores(q, k, s, scale, causal):
        b = cuda.blockIdx.z
        row0 = cuda.blockIdx.y * T
        col0 = cuda.blockIdx.x * T
        ty = cuda.threadIdx.y
        tx = cuda.threadIdx.x
        row = row0 + ty
        col = col0 + tx
        nq, d = q.shape[1], q.shape[2]
        nk = k.shape[1]
        if causal and col0 > row0 + T - 1:  # the whole tile is above the diagonal
            if row < nq and col < nk:
                s[b, row, col] = NEG_INF
            return
        tq = cuda.shared.array(TILE, ftype)
        tkt = cuda.shared.array(TILE_PADDED, ftype)  # K tile transposed: tkt[t, j] = k[col0 + j, t]
        acc = ZERO
        for t0 in range(0, d, T):
            tq[ty, tx] = q[b, row, t0 + tx] if row < nq and t0 + tx < d else ZERO
            krow = col0 + ty
            tkt[tx, ty] = k[b, krow, t0 + tx] if krow < nk and t0 + tx < d else ZERO
            cuda.syncthreads()
            for t in range(T):
                acc += tq[ty, t] * tkt[t, tx]
            cuda.syncthreads()
        if row < nq and col < nk:
            s[b, row, col] = NEG_INF if causal and col > row else acc * scale

    @cuda.jit(device=True)
    def _block_reduce(value, partial, lane, warp, is_max):
        """The max or sum of value over the block, returned to every thread."""
        value = lane_reduce(value, 32, is_max)
        if lane == 0:
            partial[warp] = value
        cuda.syncthreads()
        value = partial[0]
        for w in range(1, WARPS):
            value = max(value, partial[w]) if is_max else value + partial[w]
        cuda.syncthreads()  # partial is reused by the next reduction
        return value

    @cuda.jit
    def softmax_rows(s):
        b = cuda.blockIdx.y
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        lane = tid % 32
        warp = tid // 32
        nk = s.shape[2]
        partial = cuda.shared.array(WARPS, ftype)
        x = s[b, row]
        m = NEG_INF
        for j in range(tid, nk, SOFTMAX_THREADS):
            m = max(m, x[j])
        m = _block_reduce(m, partial, lane, warp, True)
        total = ZERO
        for j in range(tid, nk, SOFTMAX_THREADS):
            e = math.exp(x[j] - m)  # the row max is finite: key 0 is always visible
            x[j] = e
            total += e
        total = _block_reduce(total, partial, lane, warp, False)
        inv = ftype(1) / total
        for j in range(tid, nk, SOFTMAX_THREADS):
            x[j] *= inv

    @cuda.jit
    def pv_matmul(p, v, out, causal):
        b = cuda.blockIdx.z
        row0 = cuda.blockIdx.y * T
        col0 = cuda.blockIdx.x * T
        ty = cuda.threadIdx.y
        tx = cuda.threadIdx.x
        row = row0 + ty
        col = col0 + tx
        nq, nk = p.shape[1], p.shape[2]
        dv = v.shape[2]
        tp = cuda.shared.array(TILE, ftype)
        tv = cuda.shared.array(TILE_PADDED, ftype)
        kend = min(nk, row0 + T) if causal else nk  # p is 0 right of the diagonal
        acc = ZERO
        for j0 in range(0, kend, T):
            tp[ty, tx] = p[b, row, j0 + tx] if row < nq and j0 + tx < nk else ZERO
            vrow = j0 + ty
            tv[ty, tx] = v[b, vrow, col] if vrow < nk and col < dv else ZERO
            cuda.syncthreads()
            for t in range(T):
                acc += tp[ty, t] * tv[t, tx]
            cuda.syncthreads()
        if row < nq and col < dv:
            out[b, row, col] = acc

    return qk_scores, softmax_rows, pv_matmul, SOFTMAX_THREADS


def naive(q, k, v, out, causal: bool, scale: float, tile: int) -> None:
    """out = softmax(q k^T * scale) v on GpuArrays (batch, n, d) (cuda_arrays)."""
    batch, nq, _ = q.shape
    nk, dv = k.shape[1], v.shape[2]
    qk_scores, softmax_rows, pv_matmul, threads = naive_kernels(q.dtype.name, tile)
    q, k, v, out = (x.view() for x in (q, k, v, out))
    scores = cuda.device_array((batch, nq, nk), dtype=q.dtype)
    qk_scores[(-(-nk // tile), -(-nq // tile), batch), (tile, tile)](q, k, scores, q.dtype.type(scale), causal)
    softmax_rows[(nq, batch), threads](scores)
    pv_matmul[(-(-dv // tile), -(-nq // tile), batch), (tile, tile)](scores, v, out, causal)


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


@functools.cache
def flash_kernel(dtype: str, block_q: int, block_k: int, dp: int, dvp: int, micro=MICRO, with_lse: bool = False):
    """cuda.flash's kernel for one dtype, tile shape and padded head sizes;
    micro: the (rows, keys) of scores each thread holds; with_lse: the variant
    that also writes each row's log-sum-exp (the other never touches lse).

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
    F_LN2 = ftype(LN2)

    @cuda.jit
    def flash_forward(q, k, v, out, lse, nq, nk, d, dv, qscale, causal):
        # q, k, v, out: flat arrays of (batch, n, d) rows, lse of (batch, nq) (unused
        # unless WITH_LSE); every index below is unsigned
        nq, nk, d, dv = uint64(nq), uint64(nk), uint64(d), uint64(dv)
        b = uint64(cuda.blockIdx.y)
        q0 = uint64(cuda.blockIdx.x) * U_BQ
        tid = uint64(cuda.threadIdx.x)
        tx = tid % U_KG
        ty = tid // U_KG
        q_rows, kv_rows = b * nq, b * nk  # this head's first row in q/out and in k/v

        sq = cuda.shared.array(SQ_SIZE, ftype)
        skp = cuda.shared.array(SKP_SIZE, ftype)  # K^T while scores are computed, then P
        sv = cuda.shared.array(SV_SIZE, ftype)
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

        kend = min(nk, q0 + U_BQ) if causal else nk
        for j0 in range(U_0, kend, U_BK):
            cuda.syncthreads()  # the previous tile's P and V are consumed
            for n in range(tid, BK * DP, NT):
                j, t = uint64(n) // U_DP, uint64(n) % U_DP
                key = j0 + j
                skp[t * U_SKP_LD + j] = k[(kv_rows + key) * d + t] if key < nk and t < d else ZERO
            for n in range(tid, BK * DVP, NT):
                j, e = uint64(n) // U_DVP, uint64(n) % U_DVP
                key = j0 + j
                sv[n] = v[(kv_rows + key) * dv + e] if key < nk and e < dv else ZERO
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
                for c in range(TN):
                    key = j0 + tx + U(c * KG)
                    if key >= nk or (causal and key > row):
                        s[r, c] = NEG_INF
                    mt = max(mt, s[r, c])
                mnew = max(m[r], lane_reduce(mt, KG, True))
                # mnew is finite: key 0 is visible to every row, and it is in the first tile
                alpha = math.exp2(m[r] - mnew)
                m[r] = mnew
                part = ZERO
                for c in range(TN):
                    p = math.exp2(s[r, c] - mnew)
                    part += p
                    skp[(ty + U(r * RG)) * U_SKP_LD + tx + U(c * KG)] = p
                lsum[r] = lsum[r] * alpha + part  # this thread's keys only; summed at the end
                for c in range(CV):
                    o[r, c] *= alpha
            cuda.syncthreads()

            # o += P[rows] V[:, columns], from P[ty, j] and sv[j, tx] along j
            tile_products(o, TM, CV, BK, skp, ty * U_SKP_LD, U_RG_SKP, U_1, sv, tx, U_KG, U_DVP, fa, fb)

        for r in range(TM):
            total = lane_reduce(lsum[r], KG, False)
            row = q0 + ty + U(r * RG)
            inv = ftype(1) / total
            for c in range(CV):
                e = tx + U(c * KG)
                if row < nq and e < dv:
                    out[(q_rows + row) * dv + e] = o[r, c] * inv
            if WITH_LSE:
                # m (the row max, the same in every lane of the group) and total are in
                # the log2 domain: lse = ln(sum_j exp(scale q.k_j)) = (m + log2(total)) ln 2
                if tx == U_0 and row < nq:
                    lse[q_rows + row] = (m[r] + math.log2(total)) * F_LN2

    return flash_forward, NT


def flash(q, k, v, out, causal: bool, scale: float, block_q: int, block_k: int, micro=MICRO, lse=None) -> None:
    """out = softmax(q k^T * scale) v on GpuArrays (batch, n, d) (cuda_arrays);
    lse: None, or a GpuArray (batch, nq) of out's dtype to fill with each row's
    natural-log log-sum-exp of the scaled, masked scores."""
    batch, nq, d = q.shape
    dp, dvp = flash_padded_dims(block_k, d, v.shape[2], micro)
    kernel, threads = flash_kernel(q.dtype.name, block_q, block_k, dp, dvp, micro, lse is not None)
    # without lse the kernel never reads its lse argument: out stands in for it
    launch(kernel, (-(-nq // block_q), batch), threads, q, k, v, out, out if lse is None else lse, nq, k.shape[1], d,
           v.shape[2], q.dtype.type(scale * LOG2E), bool(causal))


# ---------------------------------------------------------------- cuda.flash, float16 and bfloat16

MMA_DTYPES = ("float16", "bfloat16")
MMA_BLOCK_Q, MMA_THREADS = 64, 128  # query rows and threads of a block (flash_mma.cu's BM, NTHREADS)


def mma_head_size_ok(d: int, dv: int) -> bool:
    """Whether the tensor-core kernel takes this head size: D = Dv, a multiple of 16 up to 128."""
    return d == dv and d % 16 == 0 and 16 <= d <= 128


@functools.cache
def flash_mma_kernel(dtype: str, d: int):
    """cuda.flash's tensor-core kernel for float16 or bfloat16 and head size d:
    a numba-cuda kernel whose body calls the CUDA C++ device function of
    flash_mma.cu, compiled by numba-cuda (NVRTC) with the constants for this
    dtype and head size and linked into the kernel. The C++ holds the tensor-core
    (mma.sync, ldmatrix) and asynchronous-copy instructions as inline PTX: Numba's
    Python kernels reach neither, while numba-cuda still compiles, caches and
    launches the kernel as it does the others (launch(), RawKernel)."""
    from numba.cuda import types as nbtypes

    name = f"attnkern_flash_mma_{dtype}_{d}"
    with open(os.path.join(os.path.dirname(__file__), "flash_mma.cu")) as f:
        body = f.read()
    source = f"#define ATTNKERN_D {d}\n#define ATTNKERN_BF16 {int(dtype == 'bfloat16')}\n#define ATTNKERN_NAME {name}\n"
    u64, i32 = nbtypes.uint64, nbtypes.int32
    sig = nbtypes.void(u64, u64, u64, u64, u64, i32, i32, nbtypes.float32, i32, i32)
    attend = cuda.declare_device(name, sig, link=[cuda.CUSource(source + body)], abi="c")

    @cuda.jit
    def flash_mma(q, k, v, out, lse, nq, nk, scale_log2, causal, with_lse):
        attend(q, k, v, out, lse, nq, nk, scale_log2, causal, with_lse)

    return flash_mma


def flash_mma(q, k, v, out, causal: bool, scale: float, lse=None) -> None:
    """out = softmax(q k^T * scale) v on float16 or bfloat16 GpuArrays (batch, n, d)
    on tensor cores; lse: None, or a GpuArray (batch, nq) of out's dtype to fill."""
    batch, nq, d = q.shape
    nk = k.shape[1]
    arrays = (q, k, v, out) if lse is None else (q, k, v, out, lse)
    if any(a.ptr % 16 for a in arrays[:3]) or any(a.ptr % 4 for a in arrays[3:]):
        raise ValueError("cuda.flash: float16/bfloat16 inputs must start at 16-byte aligned addresses "
                         "(pass a fresh contiguous tensor: .contiguous() or .clone())")
    kernel = flash_mma_kernel(q.dtype.name, d)
    u = np.uint64
    launch(kernel, (-(-nq // MMA_BLOCK_Q), batch), MMA_THREADS, u(q.ptr), u(k.ptr), u(v.ptr), u(out.ptr),
           u(out.ptr if lse is None else lse.ptr), np.int32(nq), np.int32(nk), np.float32(scale * LOG2E),
           np.int32(bool(causal)), np.int32(lse is not None))


# ---------------------------------------------------------------- cuda.flash backward

def flash_backward_padded_dims(d: int, dv: int) -> tuple[int, int]:
    """Head sizes of the backward's per-thread rows, rounded up (zero-filled) to
    16: compile-time sizes, so their loops unroll, and one kernel serves many D."""
    return round_up(d, 16), round_up(dv, 16)


def flash_backward_shared_bytes(block_q: int, block_k: int, d: int, dv: int, itemsize: int) -> int:
    """Shared memory of the larger of the backward's two blocks: the dK/dV block's
    Q and dO tiles with their lse and D, the dQ block's K and V tiles."""
    dp, dvp = flash_backward_padded_dims(d, dv)
    return max(block_q * (dp + dvp + 2), block_k * (dp + dvp)) * itemsize


DELTA_THREADS = 32 if config.ENABLE_CUDASIM else 128


@functools.cache
def flash_backward_delta_kernel(dtype: str):
    """D_i = dO_i . O_i for every row of (batch * nq): one thread per row."""
    ZERO = np.dtype(dtype).type(0)
    U_1 = np.uint64(1)

    @cuda.jit
    def flash_backward_delta(out, dout, delta, rows, dv):
        rows, dv = uint64(rows), uint64(dv)
        row = uint64(cuda.grid(1))
        if row < rows:
            acc = ZERO
            at = row * dv
            for _ in range(dv):
                acc += dout[at] * out[at]
                at += U_1
            delta[row] = acc

    return flash_backward_delta


@functools.cache
def flash_backward_kernels(dtype: str, block_q: int, block_k: int, dp: int, dvp: int):
    """cuda.flash's two backward kernels for one dtype, tile shape and padded
    head sizes: (dK/dV over key blocks of block_k threads, dQ over query blocks
    of block_q threads). Unsigned indices, as in flash_kernel."""
    ftype = np.dtype(dtype).type
    ZERO = ftype(0)
    F_LOG2E = ftype(LOG2E)
    BQ, BK, DP, DVP = block_q, block_k, dp, dvp
    SQ_SIZE, SDO_SIZE = BQ * DP, BQ * DVP  # the dK/dV block's Q and dO tiles
    SK_SIZE, SV_SIZE = BK * DP, BK * DVP  # the dQ block's K and V tiles
    U = np.uint64
    U_BQ, U_BK, U_DP, U_DVP = U(BQ), U(BK), U(DP), U(DVP)
    U_0, U_1 = U(0), U(1)

    @cuda.jit
    def flash_backward_dkdv(q, k, v, dout, lse, delta, dk, dv, nq, nk, d, dvn, qscale, scale, causal):
        # flat arrays of (batch, n, d) rows; lse and delta: (batch, nq). Thread tid owns key k0 + tid.
        nq, nk, d, dvn = uint64(nq), uint64(nk), uint64(d), uint64(dvn)
        b = uint64(cuda.blockIdx.y)
        k0 = uint64(cuda.blockIdx.x) * U_BK
        tid = uint64(cuda.threadIdx.x)
        key = k0 + tid
        live = key < nk
        q_rows, kv_rows = b * nq, b * nk

        sq = cuda.shared.array(SQ_SIZE, ftype)
        sdo = cuda.shared.array(SDO_SIZE, ftype)
        slse = cuda.shared.array(BQ, ftype)  # lse in the log2 domain
        sdelta = cuda.shared.array(BQ, ftype)
        kj = cuda.local.array(DP, ftype)
        vj = cuda.local.array(DVP, ftype)
        dkj = cuda.local.array(DP, ftype)
        dvj = cuda.local.array(DVP, ftype)

        at = (kv_rows + key) * d
        for t in range(DP):
            ut = uint64(t)
            kj[t] = k[at + ut] if live and ut < d else ZERO
            dkj[t] = ZERO
        at = (kv_rows + key) * dvn
        for e in range(DVP):
            ue = uint64(e)
            vj[e] = v[at + ue] if live and ue < dvn else ZERO
            dvj[e] = ZERO

        # causal: query i sees key j when j <= i; the first query tile that sees a key of this block holds row k0
        i_first = (k0 // U_BQ) * U_BQ if causal else U_0
        for i0 in range(i_first, nq, U_BQ):
            cuda.syncthreads()  # the previous tiles are consumed
            for n in range(tid, SQ_SIZE, BK):
                i, t = uint64(n) // U_DP, uint64(n) % U_DP
                row = i0 + i
                sq[n] = q[(q_rows + row) * d + t] if row < nq and t < d else ZERO
            for n in range(tid, SDO_SIZE, BK):
                i, e = uint64(n) // U_DVP, uint64(n) % U_DVP
                row = i0 + i
                sdo[n] = dout[(q_rows + row) * dvn + e] if row < nq and e < dvn else ZERO
            for n in range(tid, BQ, BK):
                row = i0 + uint64(n)
                slse[n] = lse[q_rows + row] * F_LOG2E if row < nq else ZERO
                sdelta[n] = delta[q_rows + row] if row < nq else ZERO
            cuda.syncthreads()
            if live:
                qa, da = U_0, U_0  # row i's offsets in the Q and dO tiles
                for i in range(U_0, min(U_BQ, nq - i0)):
                    if not (causal and key > i0 + i):
                        s = ZERO
                        for t in range(DP):
                            s += sq[qa + uint64(t)] * kj[t]
                        # P_ij from the forward's lse, scores in the log2 domain; the dQ kernel
                        # computes the same products in the same order, so the same P and dS
                        p = math.exp2(s * qscale - slse[i])
                        dp = ZERO
                        for e in range(DVP):
                            g = sdo[da + uint64(e)]
                            dvj[e] += p * g
                            dp += g * vj[e]
                        ds = p * (dp - sdelta[i])
                        for t in range(DP):
                            dkj[t] += ds * sq[qa + uint64(t)]
                    qa += U_DP
                    da += U_DVP

        if live:
            at = (kv_rows + key) * d
            for t in range(DP):
                ut = uint64(t)
                if ut < d:
                    dk[at + ut] = dkj[t] * scale
            at = (kv_rows + key) * dvn
            for e in range(DVP):
                ue = uint64(e)
                if ue < dvn:
                    dv[at + ue] = dvj[e]

    @cuda.jit
    def flash_backward_dq(q, k, v, dout, lse, delta, dq, nq, nk, d, dvn, qscale, scale, causal):
        # thread tid owns query row q0 + tid
        nq, nk, d, dvn = uint64(nq), uint64(nk), uint64(d), uint64(dvn)
        b = uint64(cuda.blockIdx.y)
        q0 = uint64(cuda.blockIdx.x) * U_BQ
        tid = uint64(cuda.threadIdx.x)
        row = q0 + tid
        live = row < nq
        q_rows, kv_rows = b * nq, b * nk

        sk = cuda.shared.array(SK_SIZE, ftype)
        sv = cuda.shared.array(SV_SIZE, ftype)
        qi = cuda.local.array(DP, ftype)
        doi = cuda.local.array(DVP, ftype)
        dqi = cuda.local.array(DP, ftype)

        at = (q_rows + row) * d
        for t in range(DP):
            ut = uint64(t)
            qi[t] = q[at + ut] if live and ut < d else ZERO
            dqi[t] = ZERO
        at = (q_rows + row) * dvn
        for e in range(DVP):
            ue = uint64(e)
            doi[e] = dout[at + ue] if live and ue < dvn else ZERO
        lse2 = lse[q_rows + row] * F_LOG2E if live else ZERO
        di = delta[q_rows + row] if live else ZERO

        kend = min(nk, q0 + U_BQ) if causal else nk
        for j0 in range(U_0, kend, U_BK):
            cuda.syncthreads()
            for n in range(tid, SK_SIZE, BQ):
                j, t = uint64(n) // U_DP, uint64(n) % U_DP
                key = j0 + j
                sk[n] = k[(kv_rows + key) * d + t] if key < nk and t < d else ZERO
            for n in range(tid, SV_SIZE, BQ):
                j, e = uint64(n) // U_DVP, uint64(n) % U_DVP
                key = j0 + j
                sv[n] = v[(kv_rows + key) * dvn + e] if key < nk and e < dvn else ZERO
            cuda.syncthreads()
            if live:
                ka, va = U_0, U_0  # key j's offsets in the K and V tiles
                for j in range(U_0, min(U_BK, nk - j0)):
                    if causal and j0 + j > row:
                        break  # and every later key of the tile
                    s = ZERO
                    for t in range(DP):
                        s += qi[t] * sk[ka + uint64(t)]
                    p = math.exp2(s * qscale - lse2)  # as in flash_backward_dkdv, bit for bit
                    dp = ZERO
                    for e in range(DVP):
                        dp += doi[e] * sv[va + uint64(e)]
                    ds = p * (dp - di)
                    for t in range(DP):
                        dqi[t] += ds * sk[ka + uint64(t)]
                    ka += U_DP
                    va += U_DVP

        if live:
            at = (q_rows + row) * d
            for t in range(DP):
                ut = uint64(t)
                if ut < d:
                    dq[at + ut] = dqi[t] * scale

    return flash_backward_dkdv, flash_backward_dq


def flash_backward(q, k, v, out, dout, lse, dq, dk, dv, causal: bool, scale: float, block_q: int, block_k: int) -> None:
    """dq, dk, dv (GpuArrays to fill) of out = softmax(q k^T * scale) v, given
    dout and the forward's out and lse, on GpuArrays (batch, n, d)."""
    batch, nq, d = q.shape
    nk, dvn = k.shape[1], v.shape[2]
    if batch == 0:
        return
    ftype = q.dtype.type
    dp, dvp = flash_backward_padded_dims(d, dvn)
    dkdv_kernel, dq_kernel = flash_backward_kernels(q.dtype.name, block_q, block_k, dp, dvp)
    delta = cuda.device_array(max(batch * nq, 1), dtype=q.dtype)
    sizes = (nq, nk, d, dvn, ftype(scale * LOG2E), ftype(scale), causal)
    if nq:
        rows = batch * nq
        flash_backward_delta_kernel(q.dtype.name)[-(-rows // DELTA_THREADS), DELTA_THREADS](
            out.flat, dout.flat, delta, rows, dvn)
        dq_kernel[(-(-nq // block_q), batch), block_q](q.flat, k.flat, v.flat, dout.flat, lse.flat, delta, dq.flat,
                                                       *sizes)
    if nk:  # with no queries this writes zeros
        dkdv_kernel[(-(-nk // block_k), batch), block_k](q.flat, k.flat, v.flat, dout.flat, lse.flat, delta,
                                                         dk.flat, dv.flat, *sizes)
