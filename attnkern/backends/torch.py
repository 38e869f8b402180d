"""The torch backend: PyTorch's attention as peers (torch.sdpa, torch.naive),
available when torch is installed. torch is imported on first use (importing
it is slow). num_threads sets torch's process-wide intra-op thread count for the
call and restores it afterwards."""

from __future__ import annotations

import contextlib
import importlib.util
import threading

import numpy as np

from .._registry import Kernel, num_threads_param, register


def _unavailable():
    if importlib.util.find_spec("torch") is None:
        return "PyTorch is not installed (pip install 'attnkern[torch]')"
    return None


# torch's intra-op thread count during each thread's last call (threads_used)
_USED = threading.local()


@contextlib.contextmanager
def _threads(torch, n: int):
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    _USED.n = torch.get_num_threads()  # what torch's runtime took, not what was asked
    try:
        yield
    finally:
        if n != before:
            torch.set_num_threads(before)


def _sdpa(q, k, v, causal, scale, num_threads=1, lse=None):
    import torch

    if causal and not q.dtype.type(scale) > 0:
        # torch's fused kernel masks with -inf before scaling: a scale that is negative, or
        # 0 in the dtype, turns the mask into +inf or NaN. The same scores, with the sign
        # (or the zero) moved into q:
        q, scale = (-q, -scale) if q.dtype.type(scale) < 0 else (np.zeros_like(q), 1.0)
    # (1, batch, n, d): torch's fused CPU kernels take 4-D inputs; 3-D ones fall back to plain math
    qt, kt, vt = (torch.from_numpy(x)[None] for x in (q, k, v))
    with _threads(torch, num_threads), torch.no_grad():
        if lse is not None:  # the fused kernel's own lse, through the op that returns it
            out, row_lse = sdpa_with_lse(qt, kt, vt, causal, scale)
            lse[...] = row_lse[0].numpy()
        else:
            out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)
    return out[0].numpy()


def sdpa_with_lse(q, k, v, causal: bool, scale: float):
    """(out, lse) of torch's fused attention on torch tensors (..., n, d) of any device:
    the CPU's flash kernel, on CUDA the memory-efficient kernel (it takes float32 and
    returns the log-sum-exp). lse is float32 (float64 for float64 CPU inputs)."""
    import torch

    lead, dv = q.shape[:-2], v.shape[-1]
    q4, k4, v4 = (x.reshape(-1, 1, *x.shape[-2:]) if x.dim() != 4 else x for x in (q, k, v))
    width = max(q.shape[-1], dv)  # the fused kernels want one head size: zero columns change nothing
    q4, k4, v4 = (torch.nn.functional.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x
                  for x in (q4, k4, v4))
    with torch.no_grad():
        if q.is_cuda:
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                q4, k4, v4, None, True, 0.0, causal, scale=scale)[:2]
            lse = lse[..., :q.shape[-2]]  # padded to a multiple of the kernel's row block
        else:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q4, k4, v4, 0.0, causal,
                                                                                 scale=scale)
    return out[..., :dv].reshape(*lead, q.shape[-2], dv), lse.reshape(*lead, q.shape[-2])


def naive_attention(q, k, v, causal: bool, scale: float):
    """softmax(q k^T * scale) v with torch ops on torch tensors of any device,
    the (..., nq, nk) scores materialised: torch.naive, and the GPU harness's peer."""
    import torch

    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        nq, nk = scores.shape[-2:]
        mask = torch.ones(nq, nk, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _naive(q, k, v, causal, scale, num_threads=1):
    import torch

    with _threads(torch, num_threads), torch.no_grad():
        out = naive_attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), causal, scale)
    return out.numpy()


_THREADS = num_threads_param(1024)

register(
    Kernel(
        name="torch.sdpa",
        description="torch.nn.functional.scaled_dot_product_attention on the CPU",
        run=_sdpa,
        params=(_THREADS,),
        unavailable_reason=_unavailable,
        returns_lse=True,
        threads_used=lambda: getattr(_USED, "n", None),
    )
)
register(
    Kernel(
        name="torch.naive",
        description="PyTorch ops: q @ k^T, masked softmax, @ v (materialised scores)",
        run=_naive,
        params=(_THREADS,),
        unavailable_reason=_unavailable,
        threads_used=lambda: getattr(_USED, "n", None),
    )
)
