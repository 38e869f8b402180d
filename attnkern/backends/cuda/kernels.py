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
    current measurements.
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
import dataclasses
import functools
import math
import os
import struct
import threading
import time

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
    """A compiled Numba kernel launched below Numba's dispatcher, with the driver's
    cuLaunchKernel (through cuda.bindings) on the legacy default stream, as Numba's
    own launches: no typing of Python values, no array objects, no launch
    configuration objects per call. That dispatch is most of a call's overhead
    at small sizes. Parameters come as the address of an array of pointers to
    their values (Prepared)."""

    def __init__(self, compiled, shared: int = 0):
        from cuda.bindings import driver as cu

        handle = compiled._codelibrary.get_cufunc().handle  # a CUkernel or CUfunction: both launch
        self._function = cu.CUfunction(int(handle))
        self._shared = shared  # dynamic shared memory bytes of every launch
        self._stream = cu.CUstream(_LEGACY_STREAM)
        self._launch = cu.cuLaunchKernel
        self._success = cu.CUresult.CUDA_SUCCESS

    def __call__(self, grid: tuple, block: tuple, params: int) -> None:
        if not getattr(_THREAD, "context", False):  # the context must be current on this thread
            cuda.current_context()
            _THREAD.context = True
        (err,) = self._launch(self._function, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                              self._shared, self._stream, params, 0)
        if err != self._success:
            raise RuntimeError(f"cuLaunchKernel failed: {err!r}")


def shared_limit() -> int:
    """The most shared memory one block may have on the current GPU (with the
    kernel's limit raised), or the static limit where there is no GPU (the simulator)."""
    if config.ENABLE_CUDASIM:
        return SHARED_BYTES
    return _optin_limit(cuda.get_current_device().id)


@functools.cache  # asked on every call that picks a tile; a device's limit does not change
def _optin_limit(device_id: int) -> int:
    return cuda.get_current_device().MAX_SHARED_MEMORY_PER_BLOCK_OPTIN


def dynamic_raw_kernel(compiled, shared: int) -> RawKernel:
    """The RawKernel of a compiled kernel that takes `shared` bytes of dynamic shared
    memory, its limit raised to that (the driver refuses launches above 48 KB without)."""
    from numba.cuda.cudadrv import driver as nbdriver

    limit = shared_limit()
    if shared > limit:
        raise ValueError(f"a kernel needs {shared} bytes of shared memory; this GPU allows {limit}")
    cufunc = compiled._codelibrary.get_cufunc()
    attr = nbdriver.binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    nbdriver.driver.cuKernelSetAttribute(attr, shared, cufunc.handle, cufunc.device.id)
    return RawKernel(compiled, shared)


_THREAD = threading.local()  # per thread: whether Numba made its context current there
_LEGACY_STREAM = 0  # the stream handle our kernels run on, as Numba's own launches
_RAW: dict = {}  # dispatcher -> RawKernel; each of our dispatchers is always called with one signature
_RAW_LOCK = threading.Lock()
_DYNAMIC_SHARED: dict = {}  # dispatcher -> bytes of dynamic shared memory its launches take


def _dim3(x) -> tuple:
    x = (x,) if isinstance(x, int) else tuple(x)
    return x + (1,) * (3 - len(x))


class Addr:
    """A kernel argument that is a GpuArray's device address, as a uint64 (the
    CUDA C++ kernels take their arrays so)."""

    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array


_MASK64 = (1 << 64) - 1
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _words(args, roles=()):
    """Kernel arguments as Numba's calling convention lays them out, one 64-bit
    word per parameter (a narrower value in its low bytes, which is all the
    driver copies): a GpuArray as the fields of Numba's 1-D C-contiguous array
    (meminfo, parent, size, itemsize, data pointer, shape, stride), an Addr as
    its array's address, a bool as is, Python ints and floats as the C types
    Numba types them as (int64, float64), NumPy scalars as their own. Returns
    (words, [(word index, role index)]) where a GpuArray's or an Addr's array
    is `roles[role index]` (by identity)."""
    from .arrays import GpuArray

    words, slots = [], []
    for a in args:
        array = a.array if isinstance(a, Addr) else a if isinstance(a, GpuArray) else None
        if array is not None:
            role = next((i for i, r in enumerate(roles) if r is array), None)
            if isinstance(a, GpuArray):
                n, itemsize = a.size, a.dtype.itemsize
                words += (0, 0, n, itemsize)
                at = len(words)
                words += (a.ptr, n, itemsize)
            else:
                at = len(words)
                words.append(array.ptr)
            if role is not None:
                slots.append((at, role))
        elif isinstance(a, bool):
            words.append(int(a))
        elif isinstance(a, int):
            words.append(a & _MASK64)
        elif isinstance(a, float):
            words.append(struct.unpack("<Q", struct.pack("<d", a))[0])
        else:  # a NumPy scalar: its own bits
            words.append(int(a.view(_UINT[a.dtype.itemsize])))
    return words, slots


class Prepared:
    """One kernel's launch with everything fixed but some arrays' addresses:
    calling it with the addresses of the roles (in order) writes them into its
    parameter words and launches. Its parameter memory is its own: use one from
    one thread at a time."""

    def __init__(self, raw: RawKernel, grid, block, args, roles=()):
        words, self._slots = _words(args, roles)
        self._raw, self._grid, self._block = raw, _dim3(grid), _dim3(block)
        self._words = (ctypes.c_uint64 * max(len(words), 1))(*words)
        base = ctypes.addressof(self._words)
        self._params = (ctypes.c_void_p * max(len(words), 1))(*range(base, base + 8 * len(words), 8))
        self._params_at = ctypes.addressof(self._params)

    def __call__(self, *ptrs) -> None:
        words = self._words
        for at, role in self._slots:
            words[at] = ptrs[role]
        self._raw(self._grid, self._block, self._params_at)


def raw_kernel(dispatcher):
    """The RawKernel of a dispatcher that has been launched once (compiled), else None."""
    return None if config.ENABLE_CUDASIM else _RAW.get(dispatcher)


def launch(dispatcher, grid, block, *args) -> None:
    """dispatcher[grid, block](*args) where each GpuArray argument is passed as its
    flat 1-D Numba view and an Addr as its array's address (a uint64). The first
    launch of a dispatcher goes through Numba (it compiles there); later ones
    through RawKernel, the arguments laid out as _words says."""
    raw = raw_kernel(dispatcher)
    if raw is None:
        from .arrays import GpuArray

        flat = [a.flat if isinstance(a, GpuArray) else np.uint64(a.array.ptr) if isinstance(a, Addr) else a
                for a in args]
        shared = _DYNAMIC_SHARED.get(dispatcher, 0)
        if shared and not config.ENABLE_CUDASIM:
            # the limit must be raised before the first launch: compile for these
            # arguments' types, raise it, and launch below the dispatcher from now on
            compiled = dispatcher.compile(tuple(dispatcher.typeof_pyval(a) for a in flat))
            with _RAW_LOCK:
                _RAW.setdefault(dispatcher, dynamic_raw_kernel(compiled, shared))
            return launch(dispatcher, grid, block, *args)
        dispatcher[grid, block, 0, shared](*flat)
        if not config.ENABLE_CUDASIM:
            with _RAW_LOCK:
                if dispatcher not in _RAW and len(dispatcher.overloads) == 1:
                    _RAW[dispatcher] = RawKernel(next(iter(dispatcher.overloads.values())))
        return
    Prepared(raw, grid, block, args)()


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
_NO_FLAGS = bytes(16)


def _flags():
    """This thread's four flags: (a GpuArray over them, their host address, the mapped array)."""
    from .arrays import GpuArray

    f = getattr(_FLAGS, "f", None)
    if f is None:
        host = cuda.mapped_array(4, dtype=np.int32)
        view = GpuArray((4,), np.int32, None, ptr=host.device_ctypes_pointer.value or 0, owner=host)
        f = _FLAGS.f = (view, host.ctypes.data, host)
    return f


def _scan_launch(arrays, flags):
    """(kernel, grid, block, args) of one scan over up to four GpuArrays of one
    dtype: each viewed as unsigned integers of its width, a grid no larger than
    the largest needs."""
    from .arrays import GpuArray

    itype, mask = _EXPONENT[arrays[0].dtype.name]
    ints = [GpuArray((a.size,), itype, None, ptr=a.ptr, owner=a.owner) for a in arrays]
    sizes = [x.size for x in ints] + [0] * (4 - len(ints))
    while len(ints) < 4:
        ints.append(ints[0])
    blocks = max(1, min(SCAN_BLOCKS, -(-max(sizes) // SCAN_THREADS)))
    return (nonfinite_kernel(np.dtype(itype).itemsize), blocks, SCAN_THREADS,
            (*ints, *sizes, *([itype(mask)] * 4), flags)), ints


SPIN_S = 1e-3  # how long _wait polls before it leaves the wait to the driver
_DRIVER = []  # cuda.bindings.driver and the legacy default stream's handle object, found on first use


def _driver():
    if not _DRIVER:
        from cuda.bindings import driver as cu

        _DRIVER.extend((cu, cu.CUstream(_LEGACY_STREAM)))
    return _DRIVER


def _wait() -> None:
    """Waits for the legacy default stream, which our kernels run on: records an
    event there and polls it for up to SPIN_S, then waits in the driver. A wait
    in the driver can put the thread to sleep, and waking it costs tens of
    microseconds, more than the finite checks' whole wait at small sizes."""
    cu, stream = _driver()
    event = getattr(_FLAGS, "event", None)
    if event is None:
        err, event = cu.cuEventCreate(int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
        _check(err, "cuEventCreate")
        _FLAGS.event = event  # one per thread, kept for the thread's life
    _check(cu.cuEventRecord(event, stream)[0], "cuEventRecord")
    query, not_ready, deadline = cu.cuEventQuery, cu.CUresult.CUDA_ERROR_NOT_READY, None
    while True:
        (err,) = query(event)
        if err != not_ready:
            return _check(err, "cuEventQuery")
        if deadline is None:
            deadline = time.perf_counter() + SPIN_S
        elif time.perf_counter() > deadline:
            return _check(cu.cuEventSynchronize(event)[0], "cuEventSynchronize")


def _check(err, what: str) -> None:
    if err != _driver()[0].CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{what} failed: {err!r}")


def nonfinite(arrays) -> list[bool]:
    """For each of up to four GpuArrays (all of one itemsize), whether it holds a
    NaN or an infinity; one launch, flags in mapped host memory, one wait."""
    view, at, _ = _flags()
    ctypes.memset(at, 0, 16)
    kernel, grid, block, args = _scan_launch(arrays, view)[0]
    launch(kernel, grid, block, *args)
    _wait()
    return [bool(f) for f in np.frombuffer(ctypes.string_at(at, 16), np.int32)[:len(arrays)]]


class FiniteScan:
    """nonfinite() prepared for arrays of fixed dtype and sizes at addresses given
    per call: calling it with the arrays' addresses returns whether any of them
    holds a NaN or an infinity. prepare() returns None until the scan has been
    launched once (compiled). It writes this thread's flags: one thread's."""

    def __init__(self, prepared, at):
        self._prepared, self._at = prepared, at

    @classmethod
    def prepare(cls, dtype, sizes):
        from .arrays import GpuArray

        view, at, _ = _flags()
        roles = [GpuArray((n,), dtype, None, ptr=0) for n in sizes]
        (kernel, grid, block, args), ints = _scan_launch(roles, view)
        raw = raw_kernel(kernel)
        if raw is None:
            return None
        return cls(Prepared(raw, grid, block, args, ints[:len(sizes)]), at)

    def __call__(self, *ptrs) -> bool:
        ctypes.memset(self._at, 0, 16)
        self._prepared(*ptrs)
        _wait()
        return ctypes.string_at(self._at, 16) != _NO_FLAGS


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
    from .arrays import workspace

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
    # one shared array holds the three tiles; past the static limit it is the launch's
    # dynamic shared memory (size 0 here; launch() passes the bytes and raises the limit)
    SMEM_SIZE = SQ_SIZE + SKP_SIZE + SV_SIZE
    SMEM_BYTES = SMEM_SIZE * np.dtype(dtype).itemsize
    SMEM_STATIC = 0 if SMEM_BYTES > SHARED_BYTES else SMEM_SIZE
    SKP_AT, SV_AT = SQ_SIZE, SQ_SIZE + SKP_SIZE

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

    if SMEM_STATIC == 0:
        _DYNAMIC_SHARED[flash_forward] = SMEM_BYTES
    return flash_forward, NT


def flash_launch(q, k, v, out, causal: bool, scale: float, block_q: int, block_k: int, micro=MICRO, lse=None):
    """(kernel, grid, block, args) of flash(): launch() takes them, or Prepared."""
    batch, nq, d = q.shape
    dp, dvp = flash_padded_dims(block_k, d, v.shape[2], micro)
    kernel, threads = flash_kernel(q.dtype.name, block_q, block_k, dp, dvp, micro, lse is not None)
    # without lse the kernel never reads its lse argument: out stands in for it
    return (kernel, (-(-nq // block_q), batch), threads,
            (q, k, v, out, out if lse is None else lse, nq, k.shape[1], d, v.shape[2], q.dtype.type(scale * LOG2E),
             bool(causal)))


def flash(q, k, v, out, causal: bool, scale: float, block_q: int, block_k: int, micro=MICRO, lse=None) -> None:
    """out = softmax(q k^T * scale) v on GpuArrays (batch, n, d) (cuda_arrays);
    lse: None, or a GpuArray (batch, nq) of out's dtype to fill with each row's
    natural-log log-sum-exp of the scaled, masked scores."""
    kernel, grid, block, args = flash_launch(q, k, v, out, causal, scale, block_q, block_k, micro, lse)
    launch(kernel, grid, block, *args)


# ---------------------------------------------------------------- cuda.flash, float32 register-blocked

@dataclasses.dataclass(frozen=True)
class SimtConfig:
    """How the float32 CUDA C++ kernel (flash_simt.cu) divides its work: block_q
    query rows and block_k keys a tile per block; each thread holds rows x keys
    scores (and rows x the head size / (block_k / keys) output columns)."""

    block_q: int = 64
    block_k: int = 64
    rows: int = 4
    keys: int = 8

    @property
    def key_groups(self) -> int:
        return self.block_k // self.keys

    @property
    def threads(self) -> int:
        return self.block_q // self.rows * self.key_groups

    def padded_d(self, d: int) -> int:
        """The head size the tiles hold: d rounded up so each key group's output
        columns are whole float4 chunks."""
        return round_up(d, 4 * self.key_groups)

    def shared_bytes(self, d: int) -> int:
        """Q, two K and two V tiles (rows padded by 4 floats) and P (rows padded by 8)."""
        ld = self.padded_d(d) + 4
        return (self.block_q * ld + 4 * self.block_k * ld + self.block_q * (self.block_k + 8)) * 4

    def __str__(self) -> str:
        return f"{self.block_q}x{self.block_k}t{self.rows}x{self.keys}"


SIMT_BLOCK_Q, SIMT_BLOCK_K = (32, 64, 128), (32, 64)  # the float32 kernel's tiles (of up to 64 x 64 area)


def simt_config(d: int, block_q: int = 0, block_k: int = 0) -> SimtConfig | None:
    """The float32 kernel's division for tile block_q x block_k at head size d (0:
    the default's, 64 x 64 up to d = 64, 64 x 32 above), or None where it has no
    such tile or the tile's shared memory exceeds this GPU's limit. Each thread
    holds 4 rows and 8 keys of scores (4 keys in 32-key tiles)."""
    bq, bk = block_q or 64, block_k or (64 if d <= 64 else 32)
    if bq not in SIMT_BLOCK_Q or bk not in SIMT_BLOCK_K or bq * bk > 4096:
        return None
    config = SimtConfig(bq, bk, 4, 8 if bk >= 64 else 4)
    return config if config.shared_bytes(d) <= shared_limit() else None


def simt_applies(d: int, dv: int) -> bool:
    """Whether the float32 kernel takes this head size: D = Dv, a multiple of 4 up to 128."""
    return d == dv and d % 4 == 0 and 4 <= d <= 128


def simt_aligned(*ptrs) -> bool:
    """Whether the float32 kernel can take arrays at these addresses (q, k, v, out[,
    lse]): 16-byte aligned (its float4 reads and writes), lse 4-byte aligned."""
    return not any(p % 16 for p in ptrs[:4]) and not any(p % 4 for p in ptrs[4:])


def flash_simt_kernel(d: int, config: SimtConfig | None = None):
    """cuda.flash's register-blocked float32 kernel for head size d: the CUDA C++
    device function of flash_simt.cu in a numba-cuda kernel, built and launched as
    the tensor-core kernel is (flash_mma_kernel)."""
    config = config or simt_config(d)
    return _linked_kernel("flash_simt.cu", f"attnkern_flash_simt_{config.padded_d(d)}_{config}",
                          (("DP", config.padded_d(d)), ("BM", config.block_q), ("BN", config.block_k),
                           ("TM", config.rows), ("TN", config.keys)),
                          ("u64",) * 5 + ("i32", "i32", "i32", "f32", "i32", "i32"), config.threads,
                          config.shared_bytes(d))


def flash_simt_launch(q, k, v, out, causal: bool, scale: float, lse=None, config: SimtConfig | None = None):
    """(kernel, grid, block, args) of the float32 kernel: launch() takes them, or Prepared."""
    batch, nq, d = q.shape
    config = config or simt_config(d)
    return (flash_simt_kernel(d, config), (-(-nq // config.block_q), batch), config.threads,
            (Addr(q), Addr(k), Addr(v), Addr(out), Addr(out if lse is None else lse), np.int32(nq),
             np.int32(k.shape[1]), np.int32(d), np.float32(scale * LOG2E), np.int32(bool(causal)),
             np.int32(lse is not None)))


def flash_simt(q, k, v, out, causal: bool, scale: float, lse=None, config: SimtConfig | None = None) -> None:
    """out = softmax(q k^T * scale) v on float32 GpuArrays (batch, n, d), d = dv a
    multiple of 4 up to 128, at simt_aligned addresses; lse: None, or a GpuArray
    (batch, nq) to fill."""
    kernel, grid, block, args = flash_simt_launch(q, k, v, out, causal, scale, lse, config)
    launch(kernel, grid, block, *args)


@functools.cache
def _linked_kernel(source: str, name: str, defines: tuple, params: tuple, threads: int, shared: int):
    """A numba-cuda kernel whose body calls the CUDA C++ device function `name` of
    `source` (a file beside this one, after flash_common.cuh), compiled by numba-cuda (NVRTC) with the
    constants ATTNKERN_<key> of `defines` ((key, value) pairs; and NAME, DYNAMIC) prepended, linked into
    the kernel and compiled here for its one signature (params: "u64", "i32",
    "f32"); registered for launch() below the dispatcher, with `shared` bytes of
    dynamic shared memory where they exceed the static limit."""
    from numba.cuda import types as nbtypes

    dynamic = shared > SHARED_BYTES
    here = os.path.dirname(__file__)
    body = ""
    for part in ("flash_common.cuh", source):  # the shared definitions first: NVRTC has no include path here
        with open(os.path.join(here, part)) as f:
            body += f.read() + "\n"
    defines = {**dict(defines), "NAME": name, "DYNAMIC": int(dynamic)}
    text = "".join(f"#define ATTNKERN_{key} {value}\n" for key, value in defines.items())
    types = {"u64": nbtypes.uint64, "i32": nbtypes.int32, "f32": nbtypes.float32}
    sig = nbtypes.void(*(types[p] for p in params))
    attend = cuda.declare_device(name, sig, link=[cuda.CUSource(text + body)], abi="c")
    args = ", ".join(f"a{i}" for i in range(len(params)))
    # a kernel of len(params) parameters that passes them on (Numba needs the names)
    scope = {"attend": attend}
    exec(f"def kernel({args}):\n    attend({args})\n", scope)
    kernel = cuda.jit(sig, launch_bounds=threads)(scope["kernel"])
    compiled = next(iter(kernel.overloads.values()))
    raw = dynamic_raw_kernel(compiled, shared) if dynamic else RawKernel(compiled)
    with _RAW_LOCK:
        _RAW[kernel] = raw
    return kernel


# ---------------------------------------------------------------- cuda.flash on tensor cores

MMA_DTYPES = ("float16", "bfloat16")  # the input dtypes of flash_mma.cu; float32 runs flash_tf32.cu


@dataclasses.dataclass(frozen=True)
class MmaConfig:
    """How a tensor-core kernel (flash_mma.cu for float16/bfloat16, flash_tf32.cu
    for float32) divides its work: `mt` 16-row mma tiles a warp (each K and V
    fragment read from shared memory feeds mt of them), `warps` warps a block,
    `block_k` keys a K/V tile, and whether Q's fragments are reloaded from shared
    memory every tile (`q_smem`, which frees the registers they would hold) or kept
    in registers."""

    mt: int = 1
    warps: int = 8
    block_k: int = 64
    q_smem: bool = False

    @property
    def block_q(self) -> int:
        return 16 * self.mt * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def shared_bytes(self, d: int, itemsize: int = 2) -> int:
        """Shared memory of one block at head size d: Q (if q_smem) and two K and two
        V tiles; 2-byte rows padded to d + 8 elements, float32 Q and K rows to d + 8
        and V rows to d + 4 (flash_tf32.cu)."""
        q_rows = self.block_q if self.q_smem else 0
        if itemsize == 2:
            return (q_rows + 4 * self.block_k) * (d + 8) * 2
        return ((q_rows + 2 * self.block_k) * (d + 8) + 2 * self.block_k * (d + 4)) * 4

    def __str__(self) -> str:
        return f"mt{self.mt}w{self.warps}k{self.block_k}{'qs' if self.q_smem else ''}"


def mma_config(d: int, dtype: str = "bfloat16") -> MmaConfig:
    """A tensor-core kernel's default work division at head size d. float16/bfloat16:
    FlashAttention-2's (4 warps of 32 query rows, 64-key tiles), with Q's fragments
    in registers up to d = 64 and reloaded from shared memory above, where the output
    accumulators of 32 rows leave no registers for them. float32 (3xTF32): 128 query
    rows and 64-key tiles, Q in shared memory, up to d = 64 in the same 4 warps,
    above it in 8 warps of 16 rows, as its registers allow (tf32_division).
    dev/gpu_flash_versions.py compares divisions."""
    if dtype == "float32":
        return tf32_division(d, *TF32_DEFAULT_TILE)
    return MmaConfig(mt=2, warps=4, block_k=64, q_smem=d > 64)


# flash_tf32.cu's tiles (block_q, block_k), and its default tile
TF32_BLOCK_Q, TF32_BLOCK_K = (64, 128), (32, 64)
TF32_DEFAULT_TILE = (128, 64)


def tf32_division(d: int, block_q: int, block_k: int) -> MmaConfig:
    """flash_tf32.cu's division for a tile: Q reloaded from shared memory (its split
    fragments and the output's two accumulators leave no registers for it), 4 warps
    of 16 rows for 64 query rows; for 128, up to d = 64 FlashAttention-2's 4 warps of
    2 mma tiles (each K and V fragment feeds two), above that 8 warps of one (two
    would spill). dev/gpu_flash_versions.py compares divisions."""
    mt = 2 if block_q == 128 and d <= 64 else 1
    return MmaConfig(mt=mt, warps=block_q // (16 * mt), block_k=block_k, q_smem=True)


def tf32_config(d: int, dv: int, block_q: int = 0, block_k: int = 0) -> MmaConfig | None:
    """The float32 tensor-core kernel's division for tile block_q x block_k (0: the
    default's) at head sizes d, dv, or None where it does not take them (D = Dv a
    multiple of 16 up to 128; tiles 64 or 128 x 32 or 64) or the tile's shared
    memory exceeds this GPU's limit."""
    if not mma_head_size_ok(d, dv):
        return None
    bq, bk = block_q or TF32_DEFAULT_TILE[0], block_k or TF32_DEFAULT_TILE[1]
    if bq not in TF32_BLOCK_Q or bk not in TF32_BLOCK_K:
        return None
    config = tf32_division(d, bq, bk)
    return config if config.shared_bytes(d, 4) <= shared_limit() else None


def tf32_aligned(*ptrs) -> bool:
    """Whether the float32 tensor-core kernel can take arrays at these addresses (q,
    k, v, out[, lse]): 16-byte aligned inputs, 8-byte aligned out (float2 writes)."""
    return not any(p % 16 for p in ptrs[:3]) and not ptrs[3] % 8 and not any(p % 4 for p in ptrs[4:])


def mma_head_size_ok(d: int, dv: int) -> bool:
    """Whether the tensor-core kernels take this head size: D = Dv, a multiple of 16 up to 128."""
    return d == dv and d % 16 == 0 and 16 <= d <= 128


@dataclasses.dataclass(frozen=True)
class WgmmaConfig:
    """How flash_wgmma.cu (float16/bfloat16 on Hopper's warpgroup MMAs) divides its
    work: `warpgroups` of 4 warps and 64 query rows a block, `block_k` keys a K/V tile."""

    warpgroups: int = 3
    block_k: int = 128

    def check(self, d: int) -> None:
        """ValueError unless flash_wgmma.cu has this division and head size."""
        if self.warpgroups not in (1, 2, 3) or self.block_k not in (64, 128) or d not in WGMMA_HEAD_SIZES:
            raise ValueError(f"flash_wgmma.cu has 1-3 warpgroups, 64- or 128-key tiles and D = 64 or 128, not "
                             f"{self} at D = {d}")

    @property
    def block_q(self) -> int:
        return 64 * self.warpgroups

    @property
    def threads(self) -> int:
        return 128 * self.warpgroups

    def shared_bytes(self, d: int, itemsize: int = 2) -> int:
        """Shared memory of one block at head size d: Q, two K and two V tiles, unpadded,
        and 1 KB to align them to the 1024 bytes of the swizzle pattern."""
        return (self.block_q + 4 * self.block_k) * d * itemsize + 1024

    def __str__(self) -> str:
        return f"wg{self.warpgroups}k{self.block_k}"


WGMMA_HEAD_SIZES = (64, 128)  # flash_wgmma.cu's: the N of its P V products is D
WGMMA_CAPABILITY = (9, 0)  # wgmma is sm_90a's: Hopper only


def wgmma_applies(d: int, dv: int) -> bool:
    """Whether float16/bfloat16 at these head sizes run flash_wgmma.cu on this GPU."""
    if config.ENABLE_CUDASIM or d != dv or d not in WGMMA_HEAD_SIZES:
        return False
    return _capability(cuda.get_current_device().id) == WGMMA_CAPABILITY


@functools.cache
def _capability(device_id: int) -> tuple:
    return tuple(cuda.get_current_device().compute_capability)


def tensor_core_config(d: int, dtype: str) -> "MmaConfig | WgmmaConfig":
    """The default division of the dtype's tensor-core kernel at head size d."""
    return mma_config(d, dtype) if dtype == "float32" else half_config(d, dtype)


def half_config(d: int, dtype: str = "bfloat16") -> "MmaConfig | WgmmaConfig":
    """The float16/bfloat16 kernel's default division at head size d: flash_wgmma.cu's
    three warpgroups of 64 rows and 128-key tiles where it applies (Hopper, D = 64 or
    128), else flash_mma.cu's (mma_config). dev/gpu_flash_versions.py compares them."""
    return WgmmaConfig() if wgmma_applies(d, d) else mma_config(d, dtype)


def flash_mma_kernel(dtype: str, d: int, config: MmaConfig | WgmmaConfig | None = None):
    """cuda.flash's tensor-core kernel for float16, bfloat16 (flash_wgmma.cu for a
    WgmmaConfig, flash_mma.cu for an MmaConfig) or float32 (flash_tf32.cu, 3xTF32),
    head size d and a work division (default half_config(d, dtype), or mma_config(d,
    dtype) for float32): a numba-cuda kernel whose body calls the CUDA C++ device
    function of the source, compiled by numba-cuda (NVRTC, for the GPU's
    arch-specific target: sm_90a on Hopper) with the constants for this dtype, head
    size and division and linked into the kernel. The C++ holds the tensor-core
    (wgmma, mma.sync, ldmatrix) and asynchronous-copy instructions as inline PTX:
    Numba's Python kernels reach neither, while numba-cuda still
    compiles and caches the kernel. It is compiled here, for its one signature, and
    launched below the dispatcher (RawKernel, registered for launch()); shared
    memory above the 48 KB a kernel gets without asking is dynamic, the kernel's
    limit raised to it."""
    config = config or tensor_core_config(d, dtype)
    if isinstance(config, WgmmaConfig):
        config.check(d)
        return _linked_kernel("flash_wgmma.cu", f"attnkern_flash_wgmma_{dtype}_{d}_{config}",
                              (("D", d), ("BF16", int(dtype == "bfloat16")), ("BN", config.block_k),
                               ("NWG", config.warpgroups)),
                              ("u64",) * 5 + ("i32", "i32", "f32", "i32", "i32"), config.threads,
                              config.shared_bytes(d))
    division = (("BN", config.block_k), ("MT", config.mt), ("NW", config.warps), ("QSMEM", int(config.q_smem)))
    if dtype == "float32":
        source, defines, itemsize = "flash_tf32.cu", (("D", d), *division), 4
    else:
        source, defines, itemsize = "flash_mma.cu", (("D", d), ("BF16", int(dtype == "bfloat16")), *division), 2
    return _linked_kernel(source, f"attnkern_flash_mma_{dtype}_{d}_{config}", defines,
                          ("u64",) * 5 + ("i32", "i32", "f32", "i32", "i32"), config.threads,
                          config.shared_bytes(d, itemsize))


def mma_aligned(*ptrs) -> bool:
    """Whether the tensor-core kernel can take arrays at these addresses (q, k, v,
    out[, lse]): 16-byte aligned inputs, 4-byte aligned outputs."""
    return not any(p % 16 for p in ptrs[:3]) and not any(p % 4 for p in ptrs[3:])


def flash_mma_launch(q, k, v, out, causal: bool, scale: float, lse=None,
                     config: MmaConfig | WgmmaConfig | None = None):
    """(kernel, grid, block, args) of flash_mma(): launch() takes them, or Prepared.
    The grid is (query blocks, batch); config: the work division (default
    half_config(d), or mma_config(d) for float32)."""
    batch, nq, d = q.shape
    dtype = q.dtype.name
    config = config or tensor_core_config(d, dtype)
    return (flash_mma_kernel(dtype, d, config), (-(-nq // config.block_q), batch), config.threads,
            (Addr(q), Addr(k), Addr(v), Addr(out), Addr(out if lse is None else lse), np.int32(nq),
             np.int32(k.shape[1]), np.float32(scale * LOG2E), np.int32(bool(causal)), np.int32(lse is not None)))


def flash_mma(q, k, v, out, causal: bool, scale: float, lse=None) -> None:
    """out = softmax(q k^T * scale) v on float16 or bfloat16 GpuArrays (batch, n, d)
    on tensor cores; lse: None, or a GpuArray (batch, nq) of out's dtype to fill."""
    if not mma_aligned(*(a.ptr for a in ((q, k, v, out) if lse is None else (q, k, v, out, lse)))):
        raise ValueError("cuda.flash: float16/bfloat16 inputs must start at 16-byte aligned addresses "
                         "(pass a fresh contiguous tensor: .contiguous() or .clone())")
    kernel, grid, block, args = flash_mma_launch(q, k, v, out, causal, scale, lse)
    launch(kernel, grid, block, *args)


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
