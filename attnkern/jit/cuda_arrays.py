"""GPU arrays in and out of attnkern.attention. Inputs with
__cuda_array_interface__ (Numba device arrays, PyTorch CUDA tensors, CuPy
arrays, ...) are viewed as Numba device arrays without a copy; the output is
handed back as the kind of array q was: a torch tensor on q's device for
torch, a CuPy array for CuPy, a Numba device array otherwise."""

from __future__ import annotations

import math

import numpy as np
from numba import config, cuda

_THREADS = 32 if config.ENABLE_CUDASIM else 256  # the simulator runs a Python thread per GPU thread


def as_device_array(x, name: str):
    if config.ENABLE_CUDASIM:  # the simulator's device arrays are the only GPU arrays there
        return x
    try:
        return cuda.as_cuda_array(x)
    except Exception as exc:  # e.g. a torch tensor that requires grad
        raise TypeError(f"{name} is a GPU array that Numba cannot view: {exc}") from None


def like(out, original):
    """The device array `out` as the same kind of array as `original` (no copy)."""
    package = type(original).__module__.partition(".")[0]
    if package == "torch":
        import torch

        return torch.as_tensor(out, device=original.device)
    if package == "cupy":
        import cupy

        return cupy.asarray(out)
    return out


def zeros(shape, dtype):
    return cuda.to_device(np.zeros(shape, dtype=dtype))


@cuda.jit
def _flag_nonfinite(x, flag):
    i = cuda.grid(1)
    if i < x.size and not math.isfinite(x[i]):
        flag[0] = 1


def all_finite(x) -> bool:
    """Whether a C-contiguous device array holds no NaN or infinity (one pass on the GPU)."""
    if x.size == 0:
        return True
    flat = x.reshape(x.size)
    flag = cuda.to_device(np.zeros(1, dtype=np.int32))
    _flag_nonfinite[-(-x.size // _THREADS), _THREADS](flat, flag)
    return not flag.copy_to_host()[0]
