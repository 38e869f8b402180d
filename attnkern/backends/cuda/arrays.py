"""GPU arrays in and out of attnkern.attention. Inputs with
__cuda_array_interface__ (Numba device arrays, PyTorch CUDA tensors, CuPy
arrays, ...) are viewed as Numba device arrays without a copy; the output is
allocated as the kind of array q was: a torch tensor on q's device for torch,
a CuPy array for CuPy, a Numba device array otherwise. Their caching
allocators are also cheaper per call than Numba's cuda.device_array, which
allocates with cudaMalloc every time."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import config, cuda

_THREADS = 32 if config.ENABLE_CUDASIM else 256  # the simulator runs a Python thread per GPU thread
_LEGACY_DEFAULT_STREAM = 1  # how __cuda_array_interface__ v3 names it


@dataclass(frozen=True)
class GpuArray:
    """A GPU array as attnkern's kernels take it: shape, dtype and strides read
    from its interface, and one flat Numba view of its memory (None when it is
    not C-contiguous). Reshaping changes only the shape: making a Numba
    device array is Python work that would add to every launch's overhead."""

    shape: tuple
    dtype: np.dtype
    strides: tuple | None
    flat: object

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def is_c_contiguous(self) -> bool:
        return self.flat is not None

    def reshape(self, *shape) -> "GpuArray":
        assert math.prod(shape) == self.size and self.flat is not None
        return GpuArray(tuple(shape), self.dtype, None, self.flat)

    def view(self):
        """A Numba device array of this shape."""
        return self.flat.reshape(*self.shape)


def _c_strides(shape, itemsize):
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def as_device_array(x, name: str, desc) -> GpuArray:
    """A GpuArray over x's memory (no copy); desc: x's __cuda_array_interface__,
    or None to read it here."""
    if config.ENABLE_CUDASIM:  # the simulator's device arrays are the only GPU arrays there
        contiguous = x.is_c_contiguous()
        return GpuArray(tuple(x.shape), np.dtype(x.dtype), tuple(x.strides), x.reshape(x.size) if contiguous else None)
    try:
        if desc is None:
            desc = x.__cuda_array_interface__
        shape, dtype, strides = tuple(desc["shape"]), np.dtype(desc["typestr"]), desc.get("strides")
        contiguous = strides is None or not math.prod(shape) or tuple(strides) == _c_strides(shape, dtype.itemsize)
        flat = None
        if contiguous and not math.prod(shape):
            flat = cuda.device_array(0, dtype=dtype)  # nothing to view; numba refuses a null pointer
        elif contiguous:
            # Our kernels run on the legacy default stream (interface stream 1): work the
            # producer queued there comes first anyway; for any other stream wait here
            # (Numba's default waits whenever a stream is named, i.e. on every torch call).
            stream = desc.get("stream")
            flat_desc = {**desc, "shape": (math.prod(shape),), "strides": None}
            flat = cuda.from_cuda_array_interface(flat_desc, owner=x,
                                                  sync=stream not in (None, _LEGACY_DEFAULT_STREAM))
        return GpuArray(shape, dtype, tuple(strides) if strides else None, flat)
    except Exception as exc:  # e.g. a torch tensor that requires grad
        raise TypeError(f"{name} is a GPU array that Numba cannot view: {exc}") from None


def from_host(x: np.ndarray) -> GpuArray:
    """A copy of a C-contiguous NumPy array on the GPU."""
    return GpuArray(x.shape, x.dtype, None, cuda.to_device(x.reshape(x.size)))


def device_empty(shape, dtype) -> GpuArray:
    return GpuArray(tuple(shape), np.dtype(dtype), None, cuda.device_array(math.prod(shape), dtype=dtype))


def to_host(x: GpuArray) -> np.ndarray:
    return x.flat.copy_to_host().reshape(x.shape)


def empty_like_kind(shape, dtype, like):
    """An uninitialised output of the kind of array `like` is, on its device:
    (a GpuArray over it, the array itself)."""
    size = math.prod(shape)
    package = type(like).__module__.partition(".")[0]
    if package == "torch" and not config.ENABLE_CUDASIM:
        import torch

        out = torch.empty(size, dtype=getattr(torch, np.dtype(dtype).name), device=like.device)
        returned = out.view(shape)
    elif package == "cupy" and not config.ENABLE_CUDASIM:
        import cupy

        with like.device:
            out = cupy.empty(size, dtype=dtype)
        returned = out.reshape(shape)
    else:
        out = cuda.device_array(size, dtype=dtype)
        return GpuArray(tuple(shape), np.dtype(dtype), None, out), out.reshape(shape)
    # new memory: nothing to wait for
    return GpuArray(tuple(shape), np.dtype(dtype), None, cuda.as_cuda_array(out, sync=False)), returned


@cuda.jit
def _flag_nonfinite(x, flag):
    i = cuda.grid(1)
    if i < x.size and not math.isfinite(x[i]):
        flag[0] = 1


def all_finite(*arrays: GpuArray) -> bool:
    """Whether GPU arrays hold no NaN or infinity: one pass over each on the
    GPU, one flag, one wait for the answer."""
    flag = cuda.to_device(np.zeros(1, dtype=np.int32))
    for x in arrays:
        if x.size:
            _flag_nonfinite[-(-x.size // _THREADS), _THREADS](x.flat, flag)
    return not flag.copy_to_host()[0]
