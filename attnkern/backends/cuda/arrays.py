"""GPU arrays in and out of attnkern.attention. torch CUDA tensors are read
directly (address, shape, dtype: from_torch); other inputs with
__cuda_array_interface__ (Numba device arrays, CuPy arrays, ...) through the
interface; neither is copied, and a Numba view is made only where a kernel
launched through Numba's dispatcher needs one (GpuArray.flat). The output is
allocated as the kind of array q was: a torch tensor on q's device for torch,
a CuPy array for CuPy, a Numba device array otherwise. Their caching
allocators are also cheaper per call than Numba's cuda.device_array, which
allocates with cudaMalloc every time."""

from __future__ import annotations

import math

import numpy as np
from numba import config, cuda

_THREADS = 32 if config.ENABLE_CUDASIM else 256  # the simulator runs a Python thread per GPU thread
_LEGACY_DEFAULT_STREAM = 1  # how __cuda_array_interface__ v3 names it


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
        if ptr is None and flat is not None and not config.ENABLE_CUDASIM:
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


def _numba_dtype(dtype: np.dtype) -> np.dtype:
    return np.dtype(np.uint16) if dtype.name == "bfloat16" else dtype


def _numba_view(ptr: int, size: int, dtype: np.dtype, owner):
    """A flat Numba device array over `size` elements at address ptr (no copy, no wait)."""
    dtype = _numba_dtype(dtype)
    if not size:
        return cuda.device_array(0, dtype=dtype)  # nothing to view; numba refuses a null pointer
    desc = {"shape": (size,), "strides": None, "typestr": dtype.str, "data": (ptr, False), "version": 3}
    return cuda.from_cuda_array_interface(desc, owner=owner, sync=False)


_TORCH_DTYPES = {}  # torch dtype -> NumPy dtype (bfloat16: ml_dtypes.bfloat16), filled on first use


def _torch_dtype_map(torch) -> dict:
    if not _TORCH_DTYPES:
        _TORCH_DTYPES.update({torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
                              torch.float16: np.dtype(np.float16)})
        try:
            import ml_dtypes

            _TORCH_DTYPES[torch.bfloat16] = np.dtype(ml_dtypes.bfloat16)
        except ImportError:
            pass
    return _TORCH_DTYPES


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


def from_torch(x, name: str) -> GpuArray:
    """A GpuArray over a torch CUDA tensor's memory, read from the tensor itself
    rather than through __cuda_array_interface__ (which torch builds on every access,
    and which has no bfloat16). Like the interface path, it waits for torch's current
    stream when that is not the legacy default stream our kernels run on."""
    import torch

    dtype = _torch_dtype_map(torch).get(x.dtype)
    if dtype is None:
        if x.dtype == torch.bfloat16:
            raise TypeError(f"{name} is a bfloat16 tensor: attnkern names bfloat16 through ml_dtypes "
                            "(pip install ml_dtypes), or convert with .float()")
        raise TypeError(f"{name} has dtype {x.dtype}; attnkern supports float32, float64, float16 and bfloat16")
    if x.requires_grad:
        raise TypeError(f"{name} is a GPU array that Numba cannot view: it requires grad (detach it first)")
    shape = tuple(x.shape)
    contiguous = x.is_contiguous()
    strides = None if contiguous else tuple(s * dtype.itemsize for s in x.stride())
    device = x.get_device()
    if raw_stream(device):  # not the legacy default stream: its queued work must come first
        torch.cuda.current_stream(device).synchronize()
    return GpuArray(shape, dtype, strides, ptr=x.data_ptr() if contiguous else None, owner=x, contiguous=contiguous)


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
        return GpuArray(x.shape, np.dtype(x.dtype), tuple(x.strides), x.reshape(x.size) if contiguous else None,
                        contiguous=contiguous)
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
        return GpuArray(shape, dtype, tuple(strides) if strides else None, flat, owner=x, contiguous=flat is not None)
    except Exception as exc:  # e.g. a torch tensor that requires grad
        raise TypeError(f"{name} is a GPU array that Numba cannot view: {exc}") from None


def from_host(x: np.ndarray) -> GpuArray:
    """A copy of a C-contiguous NumPy array on the GPU."""
    flat = x.reshape(x.size)
    return GpuArray(x.shape, x.dtype, None, cuda.to_device(flat.view(_numba_dtype(x.dtype))))


def device_empty(shape, dtype) -> GpuArray:
    dtype = np.dtype(dtype)
    return GpuArray(shape, dtype, None, cuda.device_array(math.prod(shape), dtype=_numba_dtype(dtype)))


def to_host(x: GpuArray) -> np.ndarray:
    return x.flat.copy_to_host().view(x.dtype).reshape(x.shape)


def empty_like_kind(shape, dtype, like):
    """An uninitialised output of the kind of array `like` is, on its device:
    (a GpuArray over it, the array itself)."""
    size = math.prod(shape)
    dtype = np.dtype(dtype)
    package = type(like).__module__.partition(".")[0]
    if package == "torch" and not config.ENABLE_CUDASIM:
        import torch

        out = torch.empty(shape, dtype=getattr(torch, dtype.name), device=like.device)
        # new memory: nothing to wait for
        return GpuArray(shape, dtype, None, ptr=out.data_ptr(), owner=out), out
    if package == "cupy" and not config.ENABLE_CUDASIM:
        import cupy

        with like.device:
            out = cupy.empty(size, dtype=dtype)
        return GpuArray(shape, dtype, None, ptr=out.data.ptr, owner=out), out.reshape(shape)
    out = cuda.device_array(size, dtype=_numba_dtype(dtype))
    return GpuArray(shape, dtype, None, out), out.reshape(shape)


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


def all_finite(*arrays: GpuArray) -> bool:
    """Whether GPU arrays hold no NaN or infinity: one pass over each on the
    GPU, one flag, one wait for the answer."""
    return not any(nonfinite(*arrays))


def nonfinite(*arrays: GpuArray) -> list[bool]:
    """For each GPU array, whether it holds a NaN or an infinity: one launch of
    the scan over all of them (up to four), flags in mapped host memory that
    the scan writes and the host reads after one wait: no copies, no allocation."""
    from . import kernels

    arrays = list(arrays)
    if config.ENABLE_CUDASIM or len(arrays) > 4:
        return [_nonfinite_slow(x) for x in arrays]
    return kernels.nonfinite(arrays)


@cuda.jit
def _flag_nonfinite(x, flag):
    i = cuda.grid(1)
    if i < x.size and not math.isfinite(x[i]):
        flag[0] = 1


def _nonfinite_slow(x: GpuArray) -> bool:
    if not x.size:
        return False
    flag = cuda.to_device(np.zeros(1, dtype=np.int32))
    _flag_nonfinite[-(-x.size // _THREADS), _THREADS](x.flat, flag)
    return bool(flag.copy_to_host()[0])
