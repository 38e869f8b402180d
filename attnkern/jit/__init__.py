"""Kernels compiled by Numba, registered here: numba.flash on the CPU
(cpu_flash.py) and cuda.naive / cuda.flash on an NVIDIA GPU through
numba-cuda (cuda_kernels.py). Both packages are optional and imported on first
use; importing attnkern does not import Numba."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import threading

import numpy as np

from .._registry import Kernel, Param, cpu_count, register


def _numba_unavailable():
    if importlib.util.find_spec("numba") is None:
        return "Numba is not installed (pip install 'attnkern[numba]')"
    return None


def _numba_max_threads() -> int:
    """Numba's thread pool size: NUMBA_NUM_THREADS, else the CPUs this process may use
    (read without importing Numba; set_num_threads refuses more)."""
    try:
        return max(1, int(os.environ["NUMBA_NUM_THREADS"]))
    except (KeyError, ValueError):
        return cpu_count()


# Numba's portable 'workqueue' threading layer aborts the process when two
# Python threads enter parallel code at once; the omp and tbb layers do not.
# Until the first parallel call Numba has not chosen its layer: lock then too.
_THREAD_SAFE_LAYERS = ("omp", "tbb")
_PARALLEL_LOCK = threading.Lock()


def _parallel_lock():
    import numba

    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel code has run yet
        layer = None
    return contextlib.nullcontext() if layer in _THREAD_SAFE_LAYERS else _PARALLEL_LOCK


# Numba's omp layer terminates a process forked after its OpenMP threads started
# the moment it runs parallel code there ("fork() called from a process already
# using GNU OpenMP"). Noted at fork time, so a call can raise instead.
_FORKED_AFTER_OMP = False


def _note_fork():
    global _FORKED_AFTER_OMP
    import sys

    numba = sys.modules.get("numba")
    if numba is not None:
        try:
            _FORKED_AFTER_OMP = _FORKED_AFTER_OMP or numba.threading_layer() == "omp"
        except ValueError:  # no parallel code has run: nothing started
            pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_note_fork)


def _numba_flash(q, k, v, causal, scale, block_q=128, block_k=256, num_threads=1):
    import numba

    from . import cpu_flash

    if _FORKED_AFTER_OMP:
        raise RuntimeError(
            "numba.flash: this process was forked after Numba's OpenMP threads started, and Numba "
            "terminates such a process when it runs parallel code; use multiprocessing's 'spawn' or "
            "'forkserver' start method, NUMBA_THREADING_LAYER=workqueue, or native.flash (fork-safe)")

    out = np.empty((q.shape[0], q.shape[1], v.shape[2]), dtype=q.dtype)
    before = numba.get_num_threads()  # per calling thread
    numba.set_num_threads(num_threads)
    try:
        # chunks of one task, handed out as threads free up: the causal blocks differ in cost
        with numba.parallel_chunksize(1), _parallel_lock():
            cpu_flash.flash_forward(q, k, v, out, causal, scale, block_q, block_k)
    finally:
        numba.set_num_threads(before)
    return out


register(
    Kernel(
        name="numba.flash",
        description="Numba (prange, cached): online softmax over streamed K/V blocks, no N x N buffer",
        run=_numba_flash,
        params=(
            Param("block_q", 128, 1, 1024, "query rows per task"),
            Param("block_k", 256, 1, 4096, "keys per streamed K/V block"),
            Param("num_threads", lambda: min(cpu_count(), _numba_max_threads()), 1, _numba_max_threads(),
                  "threads; default: the CPUs this process may use (at most NUMBA_NUM_THREADS)"),
        ),
        unavailable_reason=_numba_unavailable,
    )
)


# ------------------------------------------------------------------ CUDA

@functools.cache
def _cuda_unavailable():
    if importlib.util.find_spec("numba_cuda") is None:
        return "numba-cuda is not installed (pip install 'attnkern[cuda]')"
    from numba import cuda

    if cuda.is_available():
        return None
    try:
        cuda.current_context()
    except Exception as exc:  # the driver's own words: no driver, no device, ...
        detail = " ".join(str(exc).split())
        return f"no usable CUDA GPU: {detail}"
    return "no usable CUDA GPU"  # pragma: no cover - is_available() and a context disagree


def _to_device(q, k, v, out):
    """q, k, v as GpuArrays (copies of NumPy arrays), and an output there: `out`
    when the caller gave one (attention() does for GPU inputs), else a new one."""
    from . import cuda_arrays

    if isinstance(q, np.ndarray):
        q, k, v = (cuda_arrays.from_host(x) for x in (q, k, v))
    if out is None:
        out = cuda_arrays.device_empty((q.shape[0], q.shape[1], v.shape[2]), q.dtype)
    return q, k, v, out


def _from_device(out, host: bool):
    from . import cuda_arrays

    return cuda_arrays.to_host(out) if host else out


def _cuda_naive(q, k, v, causal, scale, tile=16, out=None):
    from . import cuda_kernels

    need = cuda_kernels.naive_workspace_bytes(q.shape[0], q.shape[1], k.shape[1], q.dtype.itemsize)
    free = _device_free_memory()
    if need > free:
        raise MemoryError(
            f"cuda.naive: out of GPU memory: its score matrix needs {need / 2**30:.1f} GiB and "
            f"{free / 2**30:.1f} GiB are free; use cuda.flash (no N x N buffer)"
        )
    host = isinstance(q, np.ndarray)
    dq, dk, dv, out = _to_device(q, k, v, out)
    cuda_kernels.naive(dq, dk, dv, out, causal, scale, tile)
    return _from_device(out, host)


def _device_free_memory() -> int:
    from numba import cuda

    try:
        return cuda.current_context().get_memory_info().free
    except Exception:  # the simulator has no memory to report
        return 1 << 62


def _flash_tiles(block_q: int, block_k: int, d: int, dv: int, itemsize: int) -> tuple[int, int]:
    """The tile to run: as given, or for 0 ('auto') the first of the preferred
    tiles that fits shared memory for this head size and dtype."""
    from . import cuda_kernels

    def fits(bq, bk):
        return cuda_kernels.flash_shared_bytes(bq, bk, d, dv, itemsize) <= cuda_kernels.SHARED_BYTES

    candidates = [(bq, bk) for bq, bk in _FLASH_TILES if block_q in (0, bq) and block_k in (0, bk)]
    for bq, bk in candidates:
        if fits(bq, bk):
            return bq, bk
    bq, bk = candidates[0] if block_q and block_k else (block_q or 8, block_k or 8)
    need = cuda_kernels.flash_shared_bytes(bq, bk, d, dv, itemsize)
    raise ValueError(
        f"cuda.flash: block_q={bq}, block_k={bk} with D={d}, Dv={dv} in {itemsize * 8}-bit floats needs "
        f"{need} bytes of shared memory, over the {cuda_kernels.SHARED_BYTES}-byte limit; use smaller "
        "blocks (0 picks the largest that fits), float32, or cuda.naive"
    )


def _cuda_flash(q, k, v, causal, scale, block_q=0, block_k=0, out=None):
    from . import cuda_kernels

    block_q, block_k = _flash_tiles(block_q, block_k, q.shape[2], v.shape[2], q.dtype.itemsize)
    host = isinstance(q, np.ndarray)
    dq, dk, dv, out = _to_device(q, k, v, out)
    cuda_kernels.flash(dq, dk, dv, out, causal, scale, block_q, block_k)
    return _from_device(out, host)


_TILE_SIZES = (8, 16, 32, 64, 128)
# cuda.flash's tiles in order of preference for block_q = block_k = 0: the first that
# fits shared memory is used. block_k >= 16 first (a narrower tile leaves each thread
# Dv/2 output columns, more than its registers hold), then larger tiles (fewer K/V
# reloads), then taller ones. On an H100 at D = 64 float32 that picks 128 x 16, the
# fastest we measured (python -m attnkern.bench_gpu --sweep); other head sizes and
# float64 follow the rule, unmeasured.
_FLASH_TILES = tuple(
    sorted(((bq, bk) for bq in _TILE_SIZES for bk in _TILE_SIZES), key=lambda t: (t[1] < 16, -t[0] * t[1], -t[0]))
)

register(
    Kernel(
        name="cuda.naive",
        description="numba-cuda: tiled Q K^T into an N x N score matrix, a shuffle-reduced row softmax, tiled P V",
        run=_cuda_naive,
        params=(Param("tile", 16, 8, 32, "square tile of the two matmuls", choices=(8, 16, 32)),),
        unavailable_reason=_cuda_unavailable,
        device="cuda",
    )
)
register(
    Kernel(
        name="cuda.flash",
        description="numba-cuda: FlashAttention-2 forward in one kernel, K/V tiles streamed through shared memory",
        run=_cuda_flash,
        params=(
            Param("block_q", 0, 0, 128, "queries per thread block; 0: the largest tile that fits",
                  choices=(0, *_TILE_SIZES)),
            Param("block_k", 0, 0, 128, "keys per streamed K/V tile; 0: the largest tile that fits",
                  choices=(0, *_TILE_SIZES)),
        ),
        unavailable_reason=_cuda_unavailable,
        device="cuda",
    )
)
