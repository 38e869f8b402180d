"""GpuArray: a GPU array as attnkern's GPU kernels take it (cuda.*, triton.*),
whatever made it (torch, CuPy, Numba). Backend-neutral: nothing here imports
Numba until a Numba view of the memory is asked for (GpuArray.flat), which only
a kernel launched through Numba's dispatcher needs; torch CUDA tensors reach
triton.flash and cuda.flash's CUDA C++ kernels without it."""

from __future__ import annotations

import math
import os
import sys

import numpy as np


def simulator() -> bool:
    """Whether Numba's CUDA simulator is on (NUMBA_ENABLE_CUDASIM), read from
    Numba's config where Numba is loaded, else from the environment it reads."""
    if "numba" in sys.modules:
        from numba import config

        return bool(config.ENABLE_CUDASIM)
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0").strip() not in ("", "0")


class GpuArray:
    """A GPU array as attnkern's kernels take it: shape, dtype, strides (None when
    C-contiguous), its device address and the object owning its memory. Kernels
    launched below Numba's dispatcher need only the address; `flat`, one flat
    Numba view of the memory, is made on first use (making a Numba device array
    is Python work that would add to every launch's overhead). bfloat16, which
    Numba lacks, is viewed as uint16. Reshaping changes only the shape."""

    __slots__ = ("shape", "dtype", "strides", "ptr", "owner", "contiguous", "_flat")

    def __init__(self, shape, dtype, strides, flat=None, *, ptr=None, owner=None, contiguous=None):
        self.shape, self.dtype, self.strides = tuple(shape), np.dtype(dtype), strides
        self.ptr, self.owner, self._flat = ptr, owner, flat
        self.contiguous = (flat is not None or ptr is not None) if contiguous is None else contiguous
        if ptr is None and flat is not None and not simulator():
            self.ptr = flat.device_ctypes_pointer.value or 0

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def flat(self):
        if self._flat is None and self.contiguous:
            self._flat = _numba_view(self.ptr, self.size, self.dtype, self.owner)
        return self._flat

    def is_c_contiguous(self) -> bool:
        return self.contiguous

    def reshape(self, *shape) -> "GpuArray":
        assert math.prod(shape) == self.size and self.contiguous
        return GpuArray(shape, self.dtype, None, self._flat, ptr=self.ptr, owner=self.owner, contiguous=True)

    def view(self):
        """A Numba device array of this shape."""
        return self.flat.reshape(*self.shape)


def numba_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype Numba holds `dtype` as: bfloat16, which it lacks, as uint16."""
    return np.dtype(np.uint16) if dtype.name == "bfloat16" else dtype


def _numba_view(ptr: int, size: int, dtype: np.dtype, owner):
    """A flat Numba device array over `size` elements at address ptr (no copy, no wait)."""
    from numba import cuda

    dtype = numba_dtype(dtype)
    if not size:
        return cuda.device_array(0, dtype=dtype)  # nothing to view; numba refuses a null pointer
    desc = {"shape": (size,), "strides": None, "typestr": dtype.str, "data": (ptr, False), "version": 3}
    return cuda.from_cuda_array_interface(desc, owner=owner, sync=False)


_RAW_STREAM = []  # torch's lookup of a device's current stream handle, found on first use


def raw_stream(device: int) -> int:
    """The handle of torch's current stream on a device (0: the legacy default
    stream), through torch's own cheap lookup where it has one (what its compiled
    kernels use) rather than building a torch.cuda.Stream object per call."""
    if not _RAW_STREAM:
        import torch

        lookup = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _RAW_STREAM.append(lookup or (lambda d: torch.cuda.current_stream(d).cuda_stream))
    return _RAW_STREAM[0](device)
