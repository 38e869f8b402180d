"""The torch backend: PyTorch's attention as peers (torch.sdpa, torch.naive),
available when torch is installed. torch is imported on first use (importing
it is slow). num_threads sets torch's process-wide intra-op thread count for the
call and restores it afterwards."""

from __future__ import annotations

import contextlib
import importlib.util

import numpy as np

from .._registry import Kernel, num_threads_param, register


def _unavailable():
    if importlib.util.find_spec("torch") is None:
        return "PyTorch is not installed (pip install 'attnkern[torch]')"
    return None


@contextlib.contextmanager
def _threads(torch, n: int):
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != before:
            torch.set_num_threads(before)


def _sdpa(q, k, v, causal, scale, num_threads=1):
    import torch

    if causal and not q.dtype.type(scale) > 0:
        # torch's fused kernel masks with -inf before scaling: a scale that is negative, or
        # 0 in the dtype, turns the mask into +inf or NaN. The same scores, with the sign
        # (or the zero) moved into q:
        q, scale = (-q, -scale) if q.dtype.type(scale) < 0 else (np.zeros_like(q), 1.0)
    # (1, batch, n, d): torch's fused CPU kernels take 4-D inputs; 3-D ones fall back to plain math
    qt, kt, vt = (torch.from_numpy(x)[None] for x in (q, k, v))
    with _threads(torch, num_threads), torch.no_grad():
        out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)
    return out[0].numpy()


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
    )
)
register(
    Kernel(
        name="torch.naive",
        description="PyTorch ops: q @ k^T, masked softmax, @ v (materialised scores)",
        run=_naive,
        params=(_THREADS,),
        unavailable_reason=_unavailable,
    )
)
