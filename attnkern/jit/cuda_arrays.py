"""GPU arrays in and out of attnkern.attention. Inputs with
__cuda_array_interface__ (Numba device arrays, PyTorch CUDA tensors, CuPy
arrays, ...) are viewed as Numba device arrays without a copy; the output is
allocated as the kind of array q was: a torch tensor on q's device for torch,
a CuPy array for CuPy, a Numba device array otherwise. Allocating through
torch's or CuPy's caching allocator also matters for speed: a plain
cudaMalloc/cudaFree per call cost about 300 us and stalled the pipeline
(H100, N = 1024, where the kernel takes about as long)."""

from __future__ import annotations

import math

import numpy as np
from numba import config, cuda

_THREADS = 32 if config.ENABLE_CUDASIM else 256  # the simulator runs a Python thread per GPU thread
_LEGACY_DEFAULT_STREAM = 1  # how __cuda_array_interface__ v3 names it


def as_device_array(x, name: str):
    if config.ENABLE_CUDASIM:  # the simulator's device arrays are the only GPU arrays there
        return x
    try:
        # Our kernels run on the legacy default stream (CUDA array interface stream 1).
        # Work the producer queued there is ordered before them; for any other stream
        # wait for it here. (Waiting always made every call synchronous.)
        stream = x.__cuda_array_interface__.get("stream")
        return cuda.as_cuda_array(x, sync=stream not in (None, _LEGACY_DEFAULT_STREAM))
    except Exception as exc:  # e.g. a torch tensor that requires grad
        raise TypeError(f"{name} is a GPU array that Numba cannot view: {exc}") from None


def empty_like_kind(shape, dtype, like):
    """An uninitialised output of the kind of array `like` is, on its device:
    (a Numba view of it, the array itself)."""
    if config.ENABLE_CUDASIM:
        out = cuda.device_array(shape, dtype=dtype)
        return out, out
    package = type(like).__module__.partition(".")[0]
    if package == "torch":
        import torch

        out = torch.empty(shape, dtype=getattr(torch, np.dtype(dtype).name), device=like.device)
    elif package == "cupy":
        import cupy

        with like.device:
            out = cupy.empty(shape, dtype=dtype)
    else:
        out = cuda.device_array(shape, dtype=dtype)
        return out, out
    return cuda.as_cuda_array(out, sync=False), out  # new memory: nothing to wait for


@cuda.jit
def _flag_nonfinite(x, flag):
    i = cuda.grid(1)
    if i < x.size and not math.isfinite(x[i]):
        flag[0] = 1


def all_finite(*arrays) -> bool:
    """Whether C-contiguous device arrays hold no NaN or infinity: one pass over
    each on the GPU, one flag, one wait for the answer."""
    flag = cuda.to_device(np.zeros(1, dtype=np.int32))
    for x in arrays:
        if x.size:
            _flag_nonfinite[-(-x.size // _THREADS), _THREADS](x.reshape(x.size), flag)
    return not flag.copy_to_host()[0]
