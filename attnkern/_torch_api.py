"""attention() on torch tensors: torch in, torch out, on the inputs' device, and
differentiable through the kernel's backward when an input requires grad."""

from __future__ import annotations

import numpy as np

from . import _api


def attention(q, k, v, *, causal, scale, kernel, check_finite, return_lse, **params):
    import torch

    tensors = (q, k, v)
    if not all(isinstance(x, torch.Tensor) for x in tensors):
        kinds = ", ".join(f"{n} {type(x).__name__}" for n, x in zip("qkv", tensors))
        raise TypeError(f"q, k, v must all be torch tensors or none of them, got {kinds}")
    devices = {x.device for x in tensors}
    if len(devices) > 1:
        raise TypeError(f"q, k, v must be on one device, got {', '.join(str(x.device) for x in tensors)}")
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in tensors)
    if not grad:
        return _forward(q, k, v, causal, scale, kernel, check_finite, return_lse, params, backward=False)[0]
    out, lse = _Attention.apply(q, k, v, causal, scale, kernel, check_finite, params)
    return (out, lse) if return_lse else out


def to_numpy(x):
    """A CPU tensor as a NumPy array sharing its memory; bfloat16, which NumPy lacks,
    as ml_dtypes.bfloat16 (the same bits)."""
    import torch

    if x.dtype != torch.bfloat16:
        return x.numpy()
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError("bfloat16 CPU tensors need ml_dtypes (pip install ml_dtypes) to reach attnkern's kernels; "
                        "or convert with .float()") from None
    return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)


def from_numpy(a):
    """to_numpy's inverse: a tensor sharing a NumPy array's memory."""
    import torch

    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _views(tensors):
    """Detached tensors as the arrays attnkern's kernels take: NumPy arrays sharing
    CPU tensors' memory, the CUDA tensors themselves (viewed through their interface)."""
    return [x.detach() if x.is_cuda else to_numpy(x.detach()) for x in tensors]


def _forward(q, k, v, causal, scale, kernel, check_finite, return_lse, params, backward):
    """(result, call, chosen, resolved): result is out or (out, lse) as torch tensors."""
    import torch

    for x, n in ((q, "q"), (k, "k"), (v, "v")):
        if x.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
            raise TypeError(f"{n} has dtype {x.dtype}; attnkern supports float32, float64, float16 and bfloat16 "
                            "(convert with .float())")
    call = _api.validate(*_views((q, k, v)), causal=causal, scale=scale, check_finite=False)  # run checks
    chosen, resolved = _api.choose(call, kernel, params, return_lse=return_lse or backward, backward=backward)
    result = _api.run(call, chosen, resolved, check_finite=check_finite, return_lse=return_lse or backward)
    as_torch = (lambda x: x) if call.device else from_numpy
    result = tuple(as_torch(x) for x in result) if isinstance(result, tuple) else as_torch(result)
    return result, call, chosen, resolved


def attention_backward(q, k, v, out, dout, lse, *, causal, scale, kernel, **params):
    """attnkern.attention_backward on torch tensors."""
    import torch

    tensors = (q, k, v, out, dout, lse)
    if not all(isinstance(x, torch.Tensor) for x in tensors):
        raise TypeError("q, k, v, out, dout, lse must all be torch tensors or none of them")
    call = _api.validate(*_views((q, k, v)), causal=causal, scale=scale, check_finite=False)
    chosen, resolved = _api.choose(call, kernel, params, return_lse=True, backward=True)
    for x, name, shape in ((out, "out", call.out_shape), (dout, "dout", call.out_shape),
                           (lse, "lse", call.out_shape[:-1])):
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {tuple(shape)} for these q, k, v")
        if x.dtype != q.dtype or x.device != q.device:
            raise TypeError(f"{name} is {x.dtype} on {x.device}; expected {q.dtype} on {q.device}, like q")
    with torch.no_grad():
        return backward(q.detach(), k.detach(), v.detach(), out.detach(), dout.detach(), lse.detach(), call=call,
                        chosen=chosen, resolved=resolved)


def backward(q, k, v, out, dout, lse, *, call, chosen, resolved):
    """(dq, dk, dv) as tensors like q, k, v, from the kernel's backward: out and lse
    are those of the forward (or, for a block of a longer sequence, those of the
    whole row: the gradient is then this block's share), call the validated forward
    call and chosen/resolved its kernel and tunables."""
    import torch

    batch, nq, nk = call.q.shape[0], call.q.shape[1], call.k.shape[1]
    d, dv = call.q.shape[2], call.v.shape[2]
    if dout is None or batch * nq * nk == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    arrays = _views((q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), dout.contiguous(),
                     lse.contiguous()))
    shapes = ((batch, nq, d), (batch, nk, d), (batch, nk, dv), (batch, nq, dv), (batch, nq, dv), (batch, nq))
    if call.device:
        from .backends.cuda import arrays as gpu

        views = [gpu.as_device_array(x, "grad", None).reshape(*s) for x, s in zip(arrays, shapes)]
        grads = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v)]
        gviews = [gpu.as_device_array(g, "grad", None).reshape(*s) for g, s in zip(grads, shapes[:3])]
        chosen.backward(*views, call.causal, call.scale, dq=gviews[0], dk=gviews[1], dv=gviews[2], **resolved)
        return tuple(grads)
    views = [np.ascontiguousarray(x).reshape(s) for x, s in zip(arrays, shapes)]
    dq, dk, dv_ = chosen.backward(*views, call.causal, call.scale, **resolved)
    return tuple(from_numpy(g).reshape(x.shape) for g, x in zip((dq, dk, dv_), (q, k, v)))


class _AttentionFunction:
    """Holder of the torch.autograd.Function, made on first use (torch is optional)."""

    cls = None


def _function():
    if _AttentionFunction.cls is not None:
        return _AttentionFunction.cls
    import torch

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal, scale, kernel, check_finite, params):
            (out, lse), call, chosen, resolved = _forward(q, k, v, causal, scale, kernel, check_finite, True, params,
                                                          backward=True)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.call, ctx.chosen, ctx.resolved = call, chosen, resolved
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, _dlse):
            q, k, v, out, lse = ctx.saved_tensors
            grads = backward(q, k, v, out, dout, lse, call=ctx.call, chosen=ctx.chosen, resolved=ctx.resolved)
            return (*grads, None, None, None, None, None)

    _AttentionFunction.cls = Attention
    return Attention


class _Attention:
    @staticmethod
    def apply(*args):
        return _function().apply(*args)
