"""The numpy backend: numpy.naive, the baseline with materialised scores, in
the input dtype. attnkern.reference runs the same code in float64."""

from __future__ import annotations

import numpy as np

from .._registry import Kernel, register


def softmax_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, scale: float,
                      positions: np.ndarray | None = None, lse: np.ndarray | None = None) -> np.ndarray:
    """softmax(q k^T * scale) v on (batch, n, d) arrays, in their dtype, with the
    (batch, nq, nk) score matrix materialised; causal masks keys j > i, where i is
    query row i's position: its index, or positions[i] when q holds selected rows.
    lse, a (batch, nq) array, if given gets each row's log-sum-exp of the scores."""
    scores = np.matmul(q, k.swapaxes(-1, -2))
    scores *= scores.dtype.type(scale)
    if causal:
        nq, nk = scores.shape[-2:]
        where = np.arange(nq) if positions is None else positions
        scores[..., np.arange(nk)[None, :] > where[:, None]] = -np.inf
    top = scores.max(axis=-1, keepdims=True)
    scores -= top
    np.exp(scores, out=scores)
    total = scores.sum(axis=-1, keepdims=True)
    if lse is not None:
        lse[...] = (np.log(total) + top)[..., 0]
    scores /= total
    return np.matmul(scores, v)


def _blas_threads() -> int | None:
    """The thread count of NumPy's BLAS pool now (threadpoolctl reads it from the
    library), or None without threadpoolctl."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    blas = [lib for lib in threadpool_info() if lib.get("user_api") == "blas"]
    return blas[0]["num_threads"] if blas else None


register(
    Kernel(
        name="numpy.naive",
        description="NumPy: materialise q k^T, softmax, matmul with v (threads: the BLAS's own)",
        run=softmax_attention,
        returns_lse=True,
        threads_used=_blas_threads,
    )
)
