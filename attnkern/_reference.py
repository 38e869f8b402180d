"""The float64 oracle every kernel is tested against."""

from __future__ import annotations

import numpy as np

from ._api import validate
from ._numpy_kernels import softmax_attention


def reference(q, k, v, *, causal=False, scale=None) -> np.ndarray:
    """softmax(q k^T * scale) v computed in float64 with NumPy; returns float64.
    Takes the same inputs as attnkern.attention."""
    call = validate(q, k, v, causal=causal, scale=scale, check_finite=True)
    if call.empty:
        return np.zeros(call.out_shape, dtype=np.float64)
    q3, k3, v3 = (x.astype(np.float64) for x in (call.q, call.k, call.v))
    return softmax_attention(q3, k3, v3, call.causal, call.scale).reshape(call.out_shape)
