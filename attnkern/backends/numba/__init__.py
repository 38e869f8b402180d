"""The numba backend: numba.flash (flash.py), compiled by Numba on the CPU.
Numba is optional and imported on first use; importing attnkern does not
import it. This module owns the kernel's registration, its thread count and
the two hazards of Numba's threading layers (concurrent calls, fork)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading

import numpy as np

from ..._registry import Kernel, Param, cpu_count, register


def _numba_unavailable():
    for module, what in (("numba", "Numba"), ("scipy", "SciPy (Numba's np.dot calls its BLAS)"),
                         ("threadpoolctl", "threadpoolctl")):
        if importlib.util.find_spec(module) is None:
            return f"{what} is not installed (pip install 'attnkern[numba]')"
    return None


class _OneBlasThread:
    """A context in which the BLAS libraries run one thread: numba.flash calls gemm
    from each of its own threads, and a BLAS that started threads of its own there
    would oversubscribe the CPUs. Calls that overlap (Numba's omp and tbb layers let
    two Python threads in at once) share one limit: the first in sets it, the last
    out restores what was there."""

    def __init__(self):
        self._lock = threading.Lock()
        self._inside = 0
        self._controller = self._limit = None

    def __enter__(self):
        with self._lock:
            if self._inside == 0:
                if self._controller is None:
                    # the BLAS Numba's np.dot calls, loaded before the controller looks for libraries
                    import scipy.linalg.cython_blas  # noqa: F401
                    from threadpoolctl import ThreadpoolController

                    self._controller = ThreadpoolController()
                self._limit = self._controller.limit(limits=1, user_api="blas")
            self._inside += 1

    def __exit__(self, *exc):
        with self._lock:
            self._inside -= 1
            if self._inside == 0:
                self._limit.restore_original_limits()
                self._limit = None


_ONE_BLAS_THREAD = _OneBlasThread()


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
# Numba's thread count during each thread's last numba.flash call (threads_used)
_USED = threading.local()


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


def _numba_flash(q, k, v, causal, scale, block_q=256, block_k=512, num_threads=1, fastmath=0, lse=None):
    import numba

    from . import flash

    if _FORKED_AFTER_OMP:
        raise RuntimeError(
            "numba.flash: this process was forked after Numba's OpenMP threads started, and Numba "
            "terminates such a process when it runs parallel code; use multiprocessing's 'spawn' or "
            "'forkserver' start method, NUMBA_THREADING_LAYER=workqueue, or native.flash (fork-safe)")

    out = np.empty((q.shape[0], q.shape[1], v.shape[2]), dtype=q.dtype)
    before = numba.get_num_threads()  # per calling thread
    numba.set_num_threads(num_threads)
    _USED.n = numba.get_num_threads()  # what Numba's runtime took, not what was asked
    try:
        # chunks of one task, handed out as threads free up: the causal blocks differ in cost
        with numba.parallel_chunksize(1), _parallel_lock(), _ONE_BLAS_THREAD:
            forward = flash.flash_forward_fast if fastmath else flash.flash_forward
            forward(q, k, v, out, causal, scale, block_q, block_k,
                                lse if lse is not None else np.empty((0, 0), q.dtype), lse is not None)
    finally:
        numba.set_num_threads(before)
    return out


register(
    Kernel(
        name="numba.flash",
        description="Numba (prange, cached): online softmax over streamed K/V blocks, no N x N buffer; "
                    "the two products per block are BLAS gemm calls (np.dot)",
        run=_numba_flash,
        params=(
            Param("block_q", 256, 1, 1024, "query rows per task"),
            Param("block_k", 512, 1, 4096, "keys per streamed K/V block"),
            Param("num_threads", lambda: min(cpu_count(), _numba_max_threads()), 1, _numba_max_threads(),
                  "threads; default: the CPUs this process may use (at most NUMBA_NUM_THREADS)"),
            Param("fastmath", 0, 0, 1, "1 compiles the kernel with all of LLVM's fast-math flags (approximate "
                  "functions and reciprocals: the normalisation multiplies by 1 / sum); 0 only reorders sums "
                  "(vectorised) and fuses multiply-adds", choices=(0, 1), switch=True),
        ),
        unavailable_reason=_numba_unavailable,
        returns_lse=True,
        threads_used=lambda: getattr(_USED, "n", None),
    )
)
