"""The float64 oracle every kernel is tested against: forward (reference) and
gradients (reference_backward), with every feature of attention() as an explicit
mask (backends.numpy.sequences)."""

from __future__ import annotations

import math

import numpy as np

from ._api import validate
from .backends.numpy import sequences, softmax_attention


def reference(q, k, v, *, causal=False, scale=None, rows=None, window=None, key_lengths=None, softcap=None,
              attn_mask=None, dropout_p=0.0, dropout_seed=None, alibi_slopes=None, return_lse=False,
              _dropout_offset=(0, 0)):
    """softmax(q k^T * scale) v computed in float64 with NumPy; returns float64.
    Takes the same inputs and features as attnkern.attention (grouped k/v heads,
    causal True/"top_left"/"bottom_right", window, key_lengths, softcap,
    attn_mask, dropout_p with dropout_seed, required: the same Philox mask as the
    kernels', alibi_slopes); a row that sees no key gets 0 (and lse -inf).

    rows: optional query row indices into Nq. Only those rows are computed, as
    they are in the full result (the causal mask uses their positions), giving
    shape (..., len(rows), Dv): a check of a kernel at sizes where the full
    N x N reference would not fit in memory.

    return_lse=True returns (out, lse), lse (..., Nq or len(rows)) each row's
    natural-log log-sum-exp of its scaled, capped, masked scores, in float64.
    _dropout_offset (private): the (query, key) offsets of dropout's Philox counters,
    as attention_varlen gives each sequence."""
    call = validate(q, k, v, causal=causal, scale=scale, check_finite=True, window=window, key_lengths=key_lengths,
                    softcap=softcap, attn_mask=attn_mask, dropout_p=dropout_p, dropout_seed=dropout_seed,
                    dropout_offset=_dropout_offset, alibi_slopes=alibi_slopes)
    q3, positions, out_shape = call.q, None, call.out_shape
    if rows is not None:
        positions = _row_indices(rows, call.q.shape[1])
        q3 = call.q[:, positions]
        out_shape = (*call.out_shape[:-2], len(positions), call.out_shape[-1])
    lse = np.full((q3.shape[0], q3.shape[1]), -np.inf)
    if math.prod(out_shape[:-1]) == 0:  # no rows (with Dv = 0 the rows' lse still exist)
        out = np.zeros(out_shape, dtype=np.float64)
    else:
        q3, k3, v3 = (x.astype(np.float64) for x in (q3, call.k, call.v))
        out = softmax_attention(q3, k3, v3, call.causal, call.scale, positions, lse=lse,
                                features=call.features if call.needs else None, nq=call.q.shape[1])
        out = out.reshape(out_shape)
    return (out, lse.reshape(out_shape[:-1])) if return_lse else out


def reference_backward(q, k, v, dout, *, causal=False, scale=None, window=None, key_lengths=None, softcap=None,
                       attn_mask=None, dropout_p=0.0, dropout_seed=None, alibi_slopes=None, _dropout_offset=(0, 0)):
    """(dq, dk, dv) of sum(reference(q, k, v, ...) * dout) in float64, with the same
    features: P = softmax(S) over the visible keys, S = c tanh(R / c) with a softcap
    c (else S = R), R = scale q k^T, and

        dv = P^T dO,  dS = P * (dO v^T - rowsum(dO * O)),  dR = dS (1 - tanh^2(R / c)),
        dq = scale dR k,  dk = scale dR^T q,

    with dropout (Z = keep / (1 - p), the forward's Philox mask) FlashAttention-2's
    rule: O = (P * Z) v, dv = (P * Z)^T dO, dS = P * ((dO v^T) * Z - rowsum(dO * O));
    an attention mask adds a constant to S (no gradient of its own);
    dk and dv summed over the query heads that share a k/v head (shapes of k and v).
    Keys no query sees, and rows that see no key, have zero gradients."""
    call = validate(q, k, v, causal=causal, scale=scale, check_finite=True, window=window, key_lengths=key_lengths,
                    softcap=softcap, attn_mask=attn_mask, dropout_p=dropout_p, dropout_seed=dropout_seed,
                    dropout_offset=_dropout_offset, alibi_slopes=alibi_slopes)
    dout = np.asarray(dout, dtype=np.float64)
    if dout.shape != call.out_shape:
        raise ValueError(f"dout has shape {dout.shape}; expected {call.out_shape}, the output's")
    q3, k3, v3 = (x.astype(np.float64) for x in (call.q, call.k, call.v))
    batch, nq, d = q3.shape
    dv_ = v3.shape[2]
    do3 = dout.reshape(batch, nq, dv_)
    dq, dk, dv = np.zeros_like(q3), np.zeros_like(k3), np.zeros_like(v3)
    if batch * nq:
        for rows, kv, length, p, _, dcap, z in sequences(q3, k3, call.causal, call.scale, call.features,
                                                         slope=True):
            qs, dos = (x[rows].reshape(*p.shape[:3], x.shape[2]) for x in (q3, do3))  # (k/v rows, group, nq, .)
            ks, vs = k3[kv, :length][:, None], v3[kv, :length][:, None]
            pz = p if z is None else p * z  # the dropped probabilities, those the output used
            out = pz @ vs
            dp = dos @ vs.swapaxes(-1, -2)
            ds = p * ((dp if z is None else dp * z) - (dos * out).sum(-1, keepdims=True))
            if dcap is not None:
                ds *= dcap
            dq[rows] = (call.scale * ds @ ks).reshape(-1, nq, d)
            dk[kv, :length] = call.scale * (ds.swapaxes(-1, -2) @ qs).sum(1)
            dv[kv, :length] = (pz.swapaxes(-1, -2) @ dos).sum(1)
    return (dq.reshape(*call.out_shape[:-2], nq, d), dk.reshape(call.kv_shape),
            dv.reshape(*call.kv_shape[:-1], dv_))


def _row_indices(rows, nq: int) -> np.ndarray:
    idx = np.asarray(rows)
    if idx.ndim != 1 or not (idx.size == 0 or np.issubdtype(idx.dtype, np.integer)):
        raise TypeError(f"rows must be a 1-D sequence of integer query indices, got {rows!r}")
    if idx.size and not (0 <= idx.min() and idx.max() < nq):
        raise ValueError(f"rows must lie in [0, {nq}) (the queries' sequence length), got {idx.min()}..{idx.max()}")
    return idx.astype(np.intp)
