"""The frontend for GPU arrays: attention()'s inputs and outputs on the GPU.
torch CUDA tensors are read directly (address, shape, dtype: from_torch);
other inputs with __cuda_array_interface__ (Numba device arrays, CuPy arrays,
...) through the interface; neither is copied. The output is allocated as the
kind of array q was: a torch tensor on q's device for torch, a CuPy array for
CuPy, a Numba device array otherwise. Their caching allocators are also cheaper
per call than Numba's cuda.device_array, which allocates with cudaMalloc every
time. Numba is imported only for arrays that only Numba can read or make, and
for the NaN scan where numba-cuda is installed (torch's own otherwise)."""

from __future__ import annotations

import math

import numpy as np

from ._gpuarray import GpuArray, raw_stream, simulator

_LEGACY_DEFAULT_STREAM = 1  # how __cuda_array_interface__ v3 names it
_NEEDS_CUDA = "pip install 'attnkern[cuda]'"


def _numba_cuda(what: str):
    """numba.cuda, or a TypeError saying which extra brings it."""
    try:
        from numba import cuda
    except ImportError as exc:
        raise TypeError(f"{what} need numba-cuda, which failed to import ({exc}): {_NEEDS_CUDA}, or copy the "
                        "arrays to the host") from None
    return cuda


def as_array(x, name: str):
    """A GpuArray view of a GPU array x, or None where x is not one."""
    if type(x).__module__.startswith("numba.cuda.simulator"):  # the tests' GPU: no interface
        return as_device_array(x, name, None)
    if type(x).__module__.startswith("torch") and getattr(x, "is_cuda", False):  # read directly: cheaper
        return from_torch(x, name)
    try:  # read once: torch computes the interface on every access
        desc = x.__cuda_array_interface__
    except AttributeError:  # a host object (CPU torch tensors raise this too)
        return None
    except Exception as exc:  # e.g. a CUDA tensor that requires grad
        raise TypeError(f"{name} is a GPU array whose __cuda_array_interface__ failed: {exc}") from None
    return as_device_array(x, name, desc)


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
                            "(pip install 'attnkern[bfloat16]'), or convert with .float()")
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


def mask_view(x, name: str) -> GpuArray | None:
    """A GpuArray over a GPU attention mask's memory as it lies (no copy), or None
    where x is not a GPU array: bool masks included, strides (in bytes) always
    set and kept as given (broadcast views with 0 strides take no memory), ptr the
    address of its first element. The simulator takes contiguous masks only."""
    if type(x).__module__.startswith("numba.cuda.simulator"):
        if not x.is_c_contiguous():
            raise ValueError(f"{name} must be C-contiguous under Numba's CUDA simulator")
        dtype = np.dtype(x.dtype)
        return GpuArray(x.shape, dtype, _c_strides(x.shape, dtype.itemsize), x.reshape(x.size), contiguous=True)
    if type(x).__module__.startswith("torch") and getattr(x, "is_cuda", False):
        import torch

        dtype = np.dtype(np.bool_) if x.dtype == torch.bool else _torch_dtype_map(torch).get(x.dtype)
        if dtype is None:
            raise TypeError(f"{name} has dtype {x.dtype}; it must be bool or a float mask of q's dtype")
        x = x.detach()
        device = x.get_device()
        if raw_stream(device):
            torch.cuda.current_stream(device).synchronize()
        return GpuArray(tuple(x.shape), dtype, tuple(s * dtype.itemsize for s in x.stride()), ptr=x.data_ptr(),
                        owner=x, contiguous=False)
    try:
        desc = x.__cuda_array_interface__
    except AttributeError:
        return None
    shape, dtype = tuple(desc["shape"]), np.dtype(desc["typestr"])
    strides = desc.get("strides") or _c_strides(shape, dtype.itemsize)
    stream = desc.get("stream")
    if stream not in (None, _LEGACY_DEFAULT_STREAM):
        _numba_cuda("GPU masks").external_stream(stream).synchronize()
    return GpuArray(shape, dtype, tuple(strides), ptr=desc["data"][0] or 0, owner=x, contiguous=False)


def _c_strides(shape, itemsize):
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def as_device_array(x, name: str, desc) -> GpuArray:
    """A GpuArray over x's memory (no copy); desc: x's __cuda_array_interface__,
    or None to read it here."""
    cuda = _numba_cuda("GPU arrays other than torch tensors")
    if simulator():  # the simulator's device arrays are the only GPU arrays there
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


def empty_like_kind(shape, dtype, like):
    """An uninitialised output of the kind of array `like` is, on its device:
    (a GpuArray over it, the array itself)."""
    size = math.prod(shape)
    dtype = np.dtype(dtype)
    package = type(like).__module__.partition(".")[0]
    if package == "torch" and not simulator():
        import torch

        out = torch.empty(shape, dtype=getattr(torch, dtype.name), device=like.device)
        # new memory: nothing to wait for
        return GpuArray(shape, dtype, None, ptr=out.data_ptr(), owner=out), out
    if package == "cupy" and not simulator():
        import cupy

        with like.device:
            out = cupy.empty(size, dtype=dtype)
        return GpuArray(shape, dtype, None, ptr=out.data.ptr, owner=out), out.reshape(shape)
    from .backends.cuda import arrays

    out = arrays.device_empty((size,), dtype)
    return out.reshape(*shape), out.flat.reshape(shape)


def all_finite(*arrays: GpuArray) -> bool:
    """Whether GPU arrays hold no NaN or infinity: one pass over each on the
    GPU, one flag, one wait for the answer."""
    return not any(nonfinite(*arrays))


def nonfinite(*arrays: GpuArray) -> list[bool]:
    """For each GPU array, whether it holds a NaN or an infinity: the cuda
    backend's scan (one launch over up to four arrays, one wait), or where
    numba-cuda is missing and the arrays are torch tensors, torch's isfinite."""
    try:
        from .backends.cuda import launch
    except ImportError:
        if not all(type(x.owner).__module__.startswith("torch") for x in arrays):
            raise
        return [bool(x.size) and not bool(x.owner.isfinite().all()) for x in arrays]
    return launch.nonfinite(list(arrays))


def nonfinite_before(x: GpuArray, sequences) -> bool:
    """Whether a (rows, n, d) GPU array holds a NaN or an infinity in the first
    `length` entries of each row of each sequence ((query rows, rows, length) as
    _registry.Features.sequences gives them); the rest (padding) is not read."""
    if simulator():  # its arrays have no addresses to offset
        host = to_host(x)
        return any(not np.isfinite(host[rows, :length]).all() for _, rows, length in sequences)
    n, per = x.shape[1], math.prod(x.shape[2:]) * x.dtype.itemsize
    pieces = [GpuArray((length * per // x.dtype.itemsize,), x.dtype, None, ptr=x.ptr + (r * n) * per, owner=x.owner)
              for _, rows, length in sequences if length for r in range(rows.start, rows.stop)]
    return any(any(nonfinite(*pieces[i:i + 4])) for i in range(0, len(pieces), 4))


def to_host(x: GpuArray) -> np.ndarray:
    """A copy of a GPU array on the host."""
    from .backends.cuda import arrays

    return arrays.to_host(x)
