"""The float64 oracle every kernel is tested against."""

from __future__ import annotations

import math

import numpy as np

from ._api import validate
from .backends.numpy import softmax_attention


def reference(q, k, v, *, causal=False, scale=None, rows=None) -> np.ndarray:
    """softmax(q k^T * scale) v computed in float64 with NumPy; returns float64.
    Takes the same inputs as attnkern.attention.

    rows: optional query row indices into Nq. Only those rows are computed, as
    they are in the full result (the causal mask uses their positions), giving
    shape (..., len(rows), Dv): a check of a kernel at sizes where the full
    N x N reference would not fit in memory."""
    call = validate(q, k, v, causal=causal, scale=scale, check_finite=True)
    q3, positions, out_shape = call.q, None, call.out_shape
    if rows is not None:
        positions = _row_indices(rows, call.q.shape[1])
        q3 = call.q[:, positions]
        out_shape = (*call.out_shape[:-2], len(positions), call.out_shape[-1])
    if math.prod(out_shape) == 0:
        return np.zeros(out_shape, dtype=np.float64)
    q3, k3, v3 = (x.astype(np.float64) for x in (q3, call.k, call.v))
    return softmax_attention(q3, k3, v3, call.causal, call.scale, positions).reshape(out_shape)


def _row_indices(rows, nq: int) -> np.ndarray:
    idx = np.asarray(rows)
    if idx.ndim != 1 or not (idx.size == 0 or np.issubdtype(idx.dtype, np.integer)):
        raise TypeError(f"rows must be a 1-D sequence of integer query indices, got {rows!r}")
    if idx.size and not (0 <= idx.min() and idx.max() < nq):
        raise ValueError(f"rows must lie in [0, {nq}) (the queries' sequence length), got {idx.min()}..{idx.max()}")
    return idx.astype(np.intp)
