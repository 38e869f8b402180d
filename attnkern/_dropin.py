"""Drop-in replacements for the attention functions models call: torch's
scaled_dot_product_attention (sdpa) and FlashAttention's flash_attn_func and
flash_attn_varlen_func, with their argument names, layouts and semantics, on
attnkern's kernels. Built on the core's public functions (attention) only."""

from __future__ import annotations

import inspect

import numpy as np

from ._api import attention

try:  # one call for all sequences, where the core has it (native.flash schedules them in one kernel call)
    from ._api import attention_varlen
except ImportError:
    attention_varlen = None

# The keywords of the attention masks and dropout (attn_mask, dropout_p, dropout_seed),
# which a core without them does not take: calls that need them are then refused.
_HAS_MASKS = "attn_mask" in inspect.signature(attention).parameters
_HAS_ALIBI = "alibi_slopes" in inspect.signature(attention).parameters  # FlashAttention's ALiBi


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "requires_grad")


def _masks(attn_mask, dropout_p, seed_like) -> dict:
    """attention()'s keywords for a mask and dropout, only those that are not neutral
    (None, 0.0), with a fresh dropout seed drawn from torch's generator for torch
    inputs (torch.manual_seed makes it repeatable; under torch.compile, a new seed
    every call), else from NumPy's global one."""
    kwargs = {}
    if attn_mask is not None:
        kwargs["attn_mask"] = attn_mask
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, (int, float, np.integer, np.floating)):
        raise TypeError(f"dropout_p must be a probability in [0, 1), got {dropout_p!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a probability in [0, 1), got {dropout_p!r}")
    if dropout_p:
        kwargs["dropout_p"] = float(dropout_p)
        if _is_torch(seed_like):
            import torch

            kwargs["dropout_seed"] = torch.randint(0, 2**62, (), dtype=torch.int64)
        else:
            kwargs["dropout_seed"] = int(np.random.randint(0, 2**62, dtype=np.int64))
    if kwargs and not _HAS_MASKS:
        raise NotImplementedError(f"this attnkern's attention() has no {' or '.join(kwargs)} (attention masks "
                                  "and dropout); a boolean mask that only pads keys on the right can be passed "
                                  "as key_lengths")
    return kwargs


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention on attnkern's kernels, with its
    semantics: query (..., L, E), key (..., S, E), value (..., S, Ev) -> (..., L, Ev) of
    query's type and dtype; attn_mask boolean (True: takes part) or additive float,
    broadcastable to (..., L, S); dropout_p applied to the attention weights (scaled by
    1 / (1 - p)); is_causal top-left aligned, and an error together with attn_mask;
    scale defaults to 1/sqrt(E); enable_gqa lets key/value have fewer heads than query
    (a divisor), an error without it, as in torch. torch tensors (differentiable, and
    traceable by torch.compile) or NumPy arrays."""
    if is_causal and attn_mask is not None:
        raise RuntimeError("sdpa: an explicit attn_mask must not be set when is_causal=True (as in torch's "
                           "scaled_dot_product_attention): fold the causal mask into attn_mask")
    if not enable_gqa and len(query.shape) >= 3 and len(key.shape) >= 3 and query.shape[-3] != key.shape[-3]:
        raise RuntimeError(f"sdpa: query has {query.shape[-3]} heads and key {key.shape[-3]}; pass enable_gqa=True "
                           "for grouped-query attention (as in torch's scaled_dot_product_attention)")
    kwargs = _masks(attn_mask, dropout_p, query)
    lead = tuple(query.shape[:-3])
    if len(lead) > 1:  # attention() takes at most (B, H, N, D): the leading dimensions become one
        query, key, value = (x.reshape(-1, *x.shape[-3:]) for x in (query, key, value))
        mask = kwargs.get("attn_mask")
        if mask is not None and len(mask.shape) > 4:
            kwargs["attn_mask"] = mask.reshape(-1, *mask.shape[-3:]) if mask.shape[:-3] == lead else \
                _broadcast(mask, (*lead, query.shape[-3], query.shape[-2], key.shape[-2])).reshape(
                    -1, query.shape[-3], query.shape[-2], key.shape[-2])
    # torch's SDPA takes any strides (a transposed (B, S, H, D) projection, as models pass); attention()
    # uses GPU tensors in place and takes only contiguous ones: copy those that are not (a no-op otherwise)
    query, key, value = (x.contiguous() if _is_torch(x) else x for x in (query, key, value))
    out = attention(query, key, value, causal=bool(is_causal), scale=scale, **kwargs)
    return out.reshape(*lead, *out.shape[-3:]) if len(lead) > 1 else out


def _broadcast(x, shape):
    return x.expand(*shape) if _is_torch(x) else np.broadcast_to(x, shape)


def _swap(x):
    """(B, S, H, D) <-> (B, H, S, D): a view (attention() copies what it must)."""
    return x.transpose(-3, -2) if _is_torch(x) else np.swapaxes(x, -3, -2)


def _contiguous(x):
    return x.contiguous() if _is_torch(x) else np.ascontiguousarray(x)


def _fa_options(q, k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                nq: int, nk: int) -> dict:
    """FlashAttention's options as attention()'s keywords, for one sequence of nq
    queries over nk keys: causal is bottom-right aligned (the last query sees the
    last key), as is the window: query i sees keys [i + nk - nq - left, i + nk - nq
    + right], -1 unbounded; with causal, right is 0; softcap 0 is none."""
    if alibi_slopes is not None and not _HAS_ALIBI:
        raise NotImplementedError("this attnkern has no ALiBi: alibi_slopes must be None (add the bias through "
                                  "attnkern.sdpa's attn_mask instead)")
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(window_size) != 2:
        raise TypeError(f"window_size must be a pair (left, right), -1 for unbounded, got {window_size!r}")
    left, right = (None if w is None or w < 0 else int(w) for w in window_size)
    if causal:
        right = None  # causal bounds the right side at the (bottom-right) diagonal
    window = None
    if left is not None or right is not None:
        shift = nk - nq  # attention()'s window without causal is top-left aligned: move it to the bottom right
        if not causal and shift:
            left, right = (None if left is None else left - shift), (None if right is None else right + shift)
            if (left is not None and left < 0) or (right is not None and right < 0):
                raise NotImplementedError(f"a window {tuple(window_size)} without causal over {nq} queries and {nk} "
                                          "keys leaves some queries' windows off the diagonal; attnkern takes "
                                          "windows that contain their query's diagonal")
        window = (left, right)
    if not isinstance(softcap, (int, float, np.integer, np.floating)) or softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0: no cap), got {softcap!r}")
    opts = {"causal": "bottom_right" if causal else False, "scale": softmax_scale, "window": window,
            "softcap": float(softcap) if softcap else None, "return_lse": bool(return_attn_probs)}
    if alibi_slopes is not None:  # (H,) or (B, H): a bias -slope * |i + nk - nq - j|, as FlashAttention's
        opts["alibi_slopes"] = alibi_slopes
    opts.update(_masks(None, dropout_p, q))
    return opts


def _with_probs(result, return_attn_probs: bool):
    """FlashAttention's return: out, or (out, lse as float32, None): attnkern never
    materialises the attention probabilities."""
    if not return_attn_probs:
        return result
    out, lse = result
    return out, (lse.float() if _is_torch(lse) else lse.astype(np.float32)), None


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """FlashAttention's flash_attn_func on attnkern's kernels: q (B, Sq, H, D), k and v
    (B, Sk, H_kv, D) with H_kv dividing H (MQA/GQA), out (B, Sq, H, D). causal is
    bottom-right aligned; window_size=(left, right), -1 unbounded; softcap 0 is none;
    deterministic is always so;
    return_attn_probs=True returns (out, softmax_lse (B, H, Sq) float32, None);
    alibi_slopes (H,) or (B, H) adds -slope * |i + Sk - Sq - j| to the scores where
    attention() takes alibi_slopes, else it is refused (NotImplementedError).
    torch tensors (differentiable) or NumPy arrays."""
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        if len(x.shape) != 4:
            raise ValueError(f"{name} must be (batch, seqlen, heads, head_dim), got shape {tuple(x.shape)}")
    opts = _fa_options(q, k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                       return_attn_probs, q.shape[1], k.shape[1])
    result = attention(*(_contiguous(_swap(x)) for x in (q, k, v)), **opts)
    out = result[0] if return_attn_probs else result
    out = _contiguous(_swap(out))
    return _with_probs((out, result[1]) if return_attn_probs else out, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False):
    """FlashAttention's flash_attn_varlen_func on attnkern's kernels: sequences packed
    without padding, q (total_q, H, D), k and v (total_k, H_kv, D), sequence b's
    queries q[cu_seqlens_q[b]:cu_seqlens_q[b+1]] over its keys k[cu_seqlens_k[b]:
    cu_seqlens_k[b+1]]; out (total_q, H, D). Options as flash_attn_func (causal and
    the window aligned bottom-right in each sequence); return_attn_probs=True returns
    (out, softmax_lse (H, total_q) float32, None). max_seqlen_q/k must bound the
    sequences' lengths. One attention_varlen() call where the core has it (and the
    window needs no per-sequence shift), else one attention() call per sequence."""
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        if len(x.shape) != 3:
            raise ValueError(f"{name} must be (total_seqlen, heads, head_dim), got shape {tuple(x.shape)}")
    bounds = []
    for cu, total, bound, name in ((cu_seqlens_q, q.shape[0], max_seqlen_q, "q"),
                                   (cu_seqlens_k, k.shape[0], max_seqlen_k, "k")):
        cu = np.asarray(cu.detach().cpu() if _is_torch(cu) else cu)
        if cu.ndim != 1 or cu.size < 1 or cu.dtype.kind not in "iu":
            raise TypeError(f"cu_seqlens_{name} must be a 1-D array of integers (batch + 1 offsets), got {cu!r}")
        lengths = np.diff(cu)
        if cu[0] != 0 or (lengths < 0).any() or cu[-1] != total:
            raise ValueError(f"cu_seqlens_{name} must rise from 0 to {total} ({name}'s total length), got {cu}")
        if lengths.size and lengths.max() > bound:
            raise ValueError(f"max_seqlen_{name}={bound} is below the longest sequence, {lengths.max()}")
        bounds.append(cu.tolist())
    if len(bounds[0]) != len(bounds[1]):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe as many sequences, got {len(bounds[0]) - 1} "
                         f"and {len(bounds[1]) - 1}")
    lengths = [np.diff(cu).tolist() for cu in bounds]
    if attention_varlen is not None and (causal or tuple(window_size) == (-1, -1) or lengths[0] == lengths[1]):
        # attention_varlen's window without causal is top-left aligned: the same as FlashAttention's where
        # every sequence has as many queries as keys
        opts = _fa_options(q, k, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                           return_attn_probs, 0, 0)
        if _is_torch(opts.get("dropout_seed")):
            opts["dropout_seed"] = int(opts["dropout_seed"])
        return _with_probs(attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **opts),
                           return_attn_probs)
    outs, lses = [], []
    for b, ((q0, q1), (k0, k1)) in enumerate(zip(zip(bounds[0], bounds[0][1:]), zip(bounds[1], bounds[1][1:]))):
        if q1 == q0:
            continue
        slopes = alibi_slopes[b] if alibi_slopes is not None and len(alibi_slopes.shape) == 2 else alibi_slopes
        opts = _fa_options(q, k, dropout_p, softmax_scale, causal, window_size, softcap, slopes,
                           return_attn_probs, q1 - q0, k1 - k0)
        if k1 == k0:
            raise ValueError(f"a sequence with {q1 - q0} queries has no keys (cu_seqlens_k)")
        result = attention(*(_contiguous(_swap(x[lo:hi])) for x, lo, hi in ((q, q0, q1), (k, k0, k1), (v, k0, k1))),
                           **opts)
        outs.append(_swap(result[0] if return_attn_probs else result))
        if return_attn_probs:
            lses.append(result[1])
    if _is_torch(q):
        import torch

        out = torch.cat(outs) if outs else q.new_empty((0, q.shape[1], v.shape[2]))
        lse = torch.cat(lses, dim=-1) if lses else q.new_empty((q.shape[1], 0))
    else:
        out = np.concatenate(outs) if outs else np.empty((0, q.shape[1], v.shape[2]), q.dtype)
        lse = np.concatenate(lses, axis=-1) if lses else np.empty((q.shape[1], 0), q.dtype)
    return _with_probs((out, lse) if return_attn_probs else _contiguous(out), return_attn_probs)
