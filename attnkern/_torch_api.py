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


def _views(tensors):
    """Detached tensors as the arrays attnkern's kernels take: NumPy arrays sharing
    CPU tensors' memory, the CUDA tensors themselves (viewed through their interface)."""
    return [x.detach() if x.is_cuda else x.detach().numpy() for x in tensors]


def _forward(q, k, v, causal, scale, kernel, check_finite, return_lse, params, backward):
    """(result, call, chosen, resolved): result is out or (out, lse) as torch tensors."""
    import torch

    for x, n in ((q, "q"), (k, "k"), (v, "v")):
        if x.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{n} has dtype {x.dtype}; attnkern supports float32 and float64 (convert with .float())")
    call = _api.validate(*_views((q, k, v)), causal=causal, scale=scale, check_finite=check_finite)
    chosen, resolved = _api.choose(call, kernel, params, return_lse=return_lse or backward, backward=backward)
    result = _api.run(call, chosen, resolved, check_finite=check_finite, return_lse=return_lse or backward)
    as_torch = (lambda x: x) if call.device else torch.from_numpy
    result = tuple(as_torch(x) for x in result) if isinstance(result, tuple) else as_torch(result)
    return result, call, chosen, resolved


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
            call, chosen = ctx.call, ctx.chosen
            batch, nq, nk = call.q.shape[0], call.q.shape[1], call.k.shape[1]
            d, dv = call.q.shape[2], call.v.shape[2]
            if dout is None or batch * nq * nk == 0:
                return (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None, None, None, None)
            dout = dout.contiguous()
            arrays = _views((q.contiguous(), k.contiguous(), v.contiguous(), out, dout, lse))
            shapes = ((batch, nq, d), (batch, nk, d), (batch, nk, dv), (batch, nq, dv), (batch, nq, dv), (batch, nq))
            if call.device:
                from .backends.cuda import arrays as gpu

                views = [gpu.as_device_array(x, "grad", None).reshape(*s) for x, s in zip(arrays, shapes)]
                grads = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v)]
                gviews = [gpu.as_device_array(g, "grad", None).reshape(*s) for g, s in zip(grads, shapes[:3])]
                chosen.backward(*views, call.causal, call.scale, dq=gviews[0], dk=gviews[1], dv=gviews[2],
                                **ctx.resolved)
            else:
                views = [np.ascontiguousarray(x).reshape(s) for x, s in zip(arrays, shapes)]
                dq, dk, dv_ = chosen.backward(*views, call.causal, call.scale, **ctx.resolved)
                grads = [torch.from_numpy(g).reshape(x.shape) for g, x in zip((dq, dk, dv_), (q, k, v))]
            return (*grads, None, None, None, None, None)

    _AttentionFunction.cls = Attention
    return Attention


class _Attention:
    @staticmethod
    def apply(*args):
        return _function().apply(*args)
