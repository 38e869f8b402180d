"""GPU memory that the cuda backend's Numba kernels make and read: copies to and
from the host, new device arrays, scratch memory. GpuArray itself, and reading
the caller's GPU arrays, are backend-neutral (attnkern/_gpuarray.py, _gpu.py).
Importing this module imports numba.cuda."""

from __future__ import annotations

import math

import numpy as np
from numba import config, cuda

from ..._gpuarray import GpuArray, numba_dtype, raw_stream


def from_host(x: np.ndarray) -> GpuArray:
    """A copy of a C-contiguous NumPy array on the GPU."""
    flat = x.reshape(x.size)
    return GpuArray(x.shape, x.dtype, None, cuda.to_device(flat.view(numba_dtype(x.dtype))))


def device_empty(shape, dtype) -> GpuArray:
    dtype = np.dtype(dtype)
    return GpuArray(shape, dtype, None, cuda.device_array(math.prod(shape), dtype=numba_dtype(dtype)))


def to_host(x: GpuArray) -> np.ndarray:
    return x.flat.copy_to_host().view(x.dtype).reshape(x.shape)


def workspace(size: int, dtype, like) -> GpuArray:
    """Scratch memory of `size` elements for kernels on the legacy default stream:
    from torch's caching allocator where `like` is a torch tensor and torch's
    current stream is that stream (torch orders a later reuse of the memory after
    the work queued there), else from Numba (cudaMalloc)."""
    dtype = np.dtype(dtype)
    if type(like).__module__.partition(".")[0] == "torch" and not config.ENABLE_CUDASIM:
        device = like.get_device()
        if not raw_stream(device):
            import torch

            out = torch.empty(size, dtype=getattr(torch, dtype.name), device=like.device)
            return GpuArray((size,), dtype, None, ptr=out.data_ptr(), owner=out)
    return device_empty((size,), dtype)
