"""The frontend for torch tensors: their checks, CPU tensors as NumPy arrays
sharing their memory and back, CUDA tensors as they are (the GPU-array frontend
reads them), and the backward's arrays. The core (_api) runs the calls and
holds the autograd function; torch is imported on first use."""

from __future__ import annotations

import numpy as np


def check_tensors(tensors, names: str) -> None:
    """TypeError unless all of tensors are torch tensors on one device."""
    import torch

    if not all(isinstance(x, torch.Tensor) for x in tensors):
        if len(tensors) == 3:
            kinds = ", ".join(f"{n} {type(x).__name__}" for n, x in zip("qkv", tensors))
            raise TypeError(f"q, k, v must all be torch tensors or none of them, got {kinds}")
        raise TypeError(f"{names} must all be torch tensors or none of them")
    devices = {x.device for x in tensors}
    if len(tensors) == 3 and len(devices) > 1:
        raise TypeError(f"q, k, v must be on one device, got {', '.join(str(x.device) for x in tensors)}")


def check_dtypes(tensors) -> None:
    """TypeError for a tensor whose dtype no kernel takes."""
    import torch

    for x, n in zip(tensors, "qkv"):
        if x.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            raise TypeError(f"{n} has dtype {x.dtype}; attnkern supports float32, float64, float16 and bfloat16 "
                            "(convert with .float())")


def check_like_q(q, others) -> None:
    """ValueError/TypeError for each (tensor, name, shape) of others not of that shape, or
    not of q's dtype and device."""
    for x, name, shape in others:
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {tuple(shape)} for these q, k, v")
        if x.dtype != q.dtype or x.device != q.device:
            raise TypeError(f"{name} is {x.dtype} on {x.device}; expected {q.dtype} on {q.device}, like q")


def to_numpy(x):
    """A CPU tensor as a NumPy array sharing its memory; bfloat16, which NumPy lacks,
    as ml_dtypes.bfloat16 (the same bits)."""
    import torch

    if x.dtype != torch.bfloat16:
        return x.numpy()
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError("bfloat16 CPU tensors need ml_dtypes (pip install 'attnkern[bfloat16]') to reach attnkern's "
                        "kernels; or convert with .float()") from None
    return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)


def from_numpy(a):
    """to_numpy's inverse: a tensor sharing a NumPy array's memory."""
    import torch

    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def views(tensors):
    """Detached tensors as the arrays attnkern's kernels take: NumPy arrays sharing
    CPU tensors' memory, the CUDA tensors themselves (viewed through their interface)."""
    return [x.detach() if x.is_cuda else to_numpy(x.detach()) for x in tensors]


def as_torch(result, device: bool):
    """A run's result (out, or (out, lse)) as torch tensors: host arrays wrapped,
    without a copy; GPU results are torch tensors already (device)."""
    convert = (lambda x: x) if device else from_numpy
    return tuple(convert(x) for x in result) if isinstance(result, tuple) else convert(result)


def backward(q, k, v, out, dout, lse, *, call, chosen, resolved):
    """(dq, dk, dv) as tensors like q, k, v, from the kernel's backward: out and lse
    are those of the forward (or, for a block of a longer sequence, those of the
    whole row: the gradient is then this block's share), call the validated forward
    call (with its features: k and v with H_kv heads give dk and dv with H_kv) and
    chosen/resolved its kernel and tunables."""
    import torch

    batch, nq, nk = call.q.shape[0], call.q.shape[1], call.k.shape[1]
    d, dv, batch_kv = call.q.shape[2], call.v.shape[2], call.k.shape[0]
    if dout is None or batch * nq * nk == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    arrays = views((q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), dout.contiguous(),
                    lse.contiguous()))
    shapes = ((batch, nq, d), (batch_kv, nk, d), (batch_kv, nk, dv), (batch, nq, dv), (batch, nq, dv), (batch, nq))
    if call.device:
        from . import _gpu

        # as_array: torch tensors read directly (bfloat16 too, which the array interface lacks)
        inputs = [_gpu.as_array(x, "grad").reshape(*s) for x, s in zip(arrays, shapes)]
        grads = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v)]
        gviews = [_gpu.as_array(g, "grad").reshape(*s) for g, s in zip(grads, shapes[:3])]
        chosen.backward(*inputs, call.causal, call.scale, dq=gviews[0], dk=gviews[1], dv=gviews[2],
                        **call.feature_args(), **resolved)
        return tuple(grads)
    inputs = [np.ascontiguousarray(x).reshape(s) for x, s in zip(arrays, shapes)]
    dq, dk, dv_ = chosen.backward(*inputs, call.causal, call.scale, **call.feature_args(), **resolved)
    return tuple(from_numpy(g).reshape(x.shape) for g, x in zip((dq, dk, dv_), (q, k, v)))
