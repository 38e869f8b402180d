"""The triton backend: triton.flash, a FlashAttention-2 forward written in
Triton (flash.py), float16, bfloat16 and float32, causal or not, with its
log-sum-exp. It runs on an NVIDIA GPU where Triton and torch (whose CUDA
context and streams Triton uses) are installed: `pip install 'attnkern[triton]'`.
Triton is imported on first use.

It takes GPU arrays as attention() hands them to cuda.* kernels (GpuArrays over
torch CUDA tensors, CuPy arrays, ...; see backends/cuda/arrays.py), and NumPy
arrays, which are copied to the GPU through torch and back. Triton launches on
torch's current stream."""

from __future__ import annotations

import functools
import importlib.util

import numpy as np

from ..._registry import Kernel, Param, register


@functools.cache
def _unavailable():
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install 'attnkern[triton]')"
    if importlib.util.find_spec("torch") is None:
        return "Triton's launcher needs torch, which is not installed (pip install 'attnkern[triton]')"
    import torch

    if not torch.cuda.is_available():
        return "no usable CUDA GPU (torch.cuda.is_available() is False)"
    return None


class _Pointer:
    """A GPU buffer as Triton takes a tensor argument: its address and dtype."""

    __slots__ = ("ptr", "dtype", "itemsize")

    def __init__(self, ptr: int, dtype_name: str, itemsize: int):
        self.ptr, self.dtype, self.itemsize = ptr, dtype_name, itemsize

    def data_ptr(self) -> int:
        return self.ptr

    def element_size(self) -> int:
        return self.itemsize


def _arg(x):
    """A GpuArray as a Triton argument: the torch tensor it views, else its address."""
    owner = getattr(x, "owner", None)
    if owner is not None and type(owner).__module__.startswith("torch"):
        return owner
    return _Pointer(x.ptr, x.dtype.name, x.dtype.itemsize)


def _torch_dtype(torch, dtype):
    return getattr(torch, np.dtype(dtype).name)


def _run(q, k, v, causal, scale, tensor_cores=1, out=None, lse=None):
    """out (batch, nq, dv) = attention of (batch, n, d) arrays: GpuArrays (out, and
    lse (batch, nq) when given, are GpuArrays to fill) or NumPy arrays (copied
    to the GPU; the result is returned as a NumPy array, lse filled in place).
    float32 products: 3xTF32 on tensor cores with tensor_cores, else exact float32."""
    from . import flash

    batch, nq, d = q.shape
    nk, dv = k.shape[1], v.shape[2]
    if isinstance(q, np.ndarray):
        import torch

        tq, tk, tv = (_host_to_torch(torch, x) for x in (q, k, v))
        tout = torch.empty((batch, nq, dv), dtype=tq.dtype, device=tq.device)
        tlse = torch.empty((batch, nq), dtype=tq.dtype, device=tq.device) if lse is not None else None
        flash.launch(tq, tk, tv, tout, tlse, batch, nq, nk, d, dv, causal, scale, q.dtype.name, tensor_cores)
        if tlse is not None:
            lse[...] = _torch_to_host(tlse, lse.dtype)
        return _torch_to_host(tout, q.dtype)
    flash.launch(_arg(q), _arg(k), _arg(v), _arg(out), None if lse is None else _arg(lse), batch, nq, nk, d, dv,
                 causal, scale, q.dtype.name, tensor_cores)
    return out


def _host_to_torch(torch, x: np.ndarray):
    if x.dtype.name == "bfloat16":  # ml_dtypes.bfloat16: the same bits as torch.bfloat16
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x)).cuda()


def _torch_to_host(t, dtype) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).cpu().numpy().view(dtype)
    return t.cpu().numpy()


register(
    Kernel(
        name="triton.flash",
        description="Triton: FlashAttention-2 forward, Q K^T and P V on tensor cores (float32: 3xTF32, or exact "
                    "float32 products), online softmax in float32, autotuned block sizes",
        run=_run,
        params=(Param("tensor_cores", 1, 0, 1, "float32: 1 computes the products on tensor cores in 3xTF32 "
                      "(Triton's input_precision 'tf32x3': about float32 FMAs' accuracy); 0 in exact float32 "
                      "('ieee')", choices=(0, 1)),),
        unavailable_reason=_unavailable,
        device="cuda",
        returns_lse=True,
        dtypes=("float32", "float16", "bfloat16"),
    )
)
