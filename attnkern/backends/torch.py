"""The torch backend: PyTorch's attention as peers (torch.sdpa, torch.naive),
available when torch is installed. torch is imported on first use (importing
it is slow). num_threads sets torch's process-wide intra-op thread count for the
call and restores it afterwards. torch.sdpa takes every feature but the softcap
and dropout (docs/features.md), through an explicit mask."""

from __future__ import annotations

import contextlib
import importlib.util
import threading

import numpy as np

from .._registry import Features, Kernel, num_threads_param, register
from .numpy import visible


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


def _sequences(q, k, v, causal, features: Features):
    """The 4-D calls of a call with features, one per sequence: (rows, q4, k4, v4,
    mask), rows a slice of q's batch, q4 (1, H_kv, group * nq, d), k4 and v4
    (1, H_kv, length, d) views of the sequence's first `length` keys (the padding
    past them is never read), mask its (1, 1 or H_kv, group * nq, length) boolean
    mask (with an additive attention mask: float, -inf hiding a key), or None where
    it masks nothing. The query heads that share a k/v head are laid
    end to end along the query axis: a view, not a copy of k and v."""
    nq = q.shape[1]
    masked = causal or bool(features.needs() - {"gqa"})
    for rows, kv_rows, length in features.sequences(q.shape[0], k.shape[0], k.shape[1]):
        mask = None
        if masked:
            mask = np.tile(visible(nq, length, causal, features), (features.kv_group, 1))[None, None]
        heads_kv = kv_rows.stop - kv_rows.start
        if features.mask is not None:
            user = features.mask_rows(rows, None, q.dtype)[..., :length]  # additive, -inf where a bool is False
            user = np.broadcast_to(user, (rows.stop - rows.start, nq, length)).reshape(
                1, heads_kv, features.kv_group * nq, length)
            if features.mask.dtype == np.bool_:
                mask = np.isfinite(user) if mask is None else mask & np.isfinite(user)
            else:
                mask = user if mask is None else np.where(mask, user, q.dtype.type(-np.inf))
        yield (rows, q[rows].reshape(1, heads_kv, features.kv_group * nq, q.shape[2]), k[kv_rows, :length][None],
               v[kv_rows, :length][None], mask)


def _sdpa(q, k, v, causal, scale, num_threads=1, lse=None, features=None):
    import torch

    if features is None:  # (1, batch, n, d): the fused CPU kernels take 4-D inputs; 3-D ones fall back to math
        with _threads(torch, num_threads), torch.no_grad():
            out, row_lse = _sdpa4(torch, q[None], k[None], v[None], causal, scale, None, lse is not None)
        if lse is not None:
            lse[...] = row_lse[0].numpy()
        return out[0].numpy()
    out = np.zeros((*q.shape[:2], v.shape[2]), q.dtype)
    with _threads(torch, num_threads), torch.no_grad():
        for rows, q4, k4, v4, mask in _sequences(q, k, v, causal, features):
            shape = out[rows].shape[:2]
            seen = None if mask is None else (mask if mask.dtype == np.bool_ else np.isfinite(mask))
            if k4.shape[2] == 0 or (seen is not None and not seen.any()):  # no row sees a key: out 0, lse -inf
                if lse is not None:
                    lse[rows] = -np.inf
                continue
            got = _sdpa4(torch, q4, k4, v4, False, scale, mask, lse is not None)  # the mask holds causal
            out[rows] = got[0].reshape(*shape, -1).numpy()
            if seen is not None:  # rows that see no key: 0 (torch's math kernel gives NaN)
                out[rows][~np.broadcast_to(seen.any(-1), got[0].shape[:-1]).reshape(shape)] = 0
            if lse is not None:
                lse[rows] = got[1].reshape(shape).numpy()
                if seen is not None:  # the fused kernel gives 0 where a row sees no key
                    lse[rows][~np.broadcast_to(seen.any(-1), got[1].shape).reshape(shape)] = -np.inf
    return out


def _sdpa4(torch, q, k, v, causal, scale, mask, with_lse):
    """(out, lse or None) of torch's fused attention on 4-D NumPy arrays, with a boolean
    or additive float mask (None: none)."""
    if (causal or mask is not None) and not q.dtype.type(scale) > 0:
        # torch's fused kernel masks with -inf before scaling: a scale that is negative, or
        # 0 in the dtype, turns the mask into +inf or NaN. The same scores, with the sign
        # (or the zero) moved into q:
        q, scale = (-q, -scale) if q.dtype.type(scale) < 0 else (np.zeros_like(q), 1.0)
    qt, kt, vt = (torch.from_numpy(x) for x in (q, k, v))  # strided views too (key_lengths)
    if with_lse:  # the fused kernel's own lse, through the op that returns it
        bias = None if mask is None else torch.from_numpy(
            np.where(mask, 0, -np.inf).astype(q.dtype) if mask.dtype == np.bool_ else np.ascontiguousarray(mask))
        return sdpa_with_lse(qt, kt, vt, causal, scale, bias)
    torch_mask = None if mask is None else torch.from_numpy(np.ascontiguousarray(mask))
    return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=torch_mask, is_causal=causal,
                                                            scale=scale), None


def sdpa_with_lse(q, k, v, causal: bool, scale: float, bias=None):
    """(out, lse) of torch's fused attention on torch tensors (..., n, d) of any device:
    the CPU's flash kernel, on CUDA the memory-efficient kernel (it takes float32 and
    returns the log-sum-exp). lse is float32 (float64 for float64 CPU inputs). bias:
    an additive mask of q's dtype (-inf hides a key) broadcast to the scores, or None."""
    import torch

    lead, dv = q.shape[:-2], v.shape[-1]
    q4, k4, v4 = (x.reshape(-1, 1, *x.shape[-2:]) if x.dim() != 4 else x for x in (q, k, v))
    width = max(q.shape[-1], dv)  # the fused kernels want one head size: zero columns change nothing
    q4, k4, v4 = (torch.nn.functional.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x
                  for x in (q4, k4, v4))
    with torch.no_grad():
        if q.is_cuda:
            out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
                q4, k4, v4, bias, True, 0.0, causal, scale=scale)[:2]
            lse = lse[..., :q.shape[-2]]  # padded to a multiple of the kernel's row block
        else:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q4, k4, v4, 0.0, causal,
                                                                                 attn_mask=bias, scale=scale)
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
        # dropout: torch's RNG is not attnkern's Philox, so its dropout could not be checked
        # against the reference or repeated by a seed: refused (native.flash, numpy.naive have it)
        features=frozenset({"gqa", "bottom_right", "window", "key_lengths", "mask"}),
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
