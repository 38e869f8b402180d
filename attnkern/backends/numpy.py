"""The numpy backend: numpy.naive, the baseline with materialised scores, in
the input dtype, with every feature (an explicit mask). attnkern.reference runs
the same code in float64."""

from __future__ import annotations

import numpy as np

from .._philox import dropout_factor
from .._registry import ALL_FEATURES, Features, Kernel, register


def softmax_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, scale: float,
                      positions: np.ndarray | None = None, lse: np.ndarray | None = None,
                      features: Features | None = None, nq: int | None = None) -> np.ndarray:
    """softmax(q k^T * scale) v on (batch, n, d) arrays, in their dtype, with the
    (batch, nq, nk) score matrix materialised; causal masks keys j > i, where i is
    query row i's position: its index, or positions[i] when q holds selected rows
    (of nq in all, for a bottom-right diagonal). lse, a (batch, nq) array, if given
    gets each row's log-sum-exp of the scores. features (grouped k/v, windows, key
    lengths, softcap): masked_attention."""
    if features is not None:
        return masked_attention(q, k, v, causal, scale, features, positions, nq, lse)
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


def visible(nq: int, length: int, causal: bool, features: Features, positions=None) -> np.ndarray:
    """The (rows, length) mask of one sequence whose keys are its first `length`:
    query i (positions[i] where given, of nq queries in all) sees key j iff
    diag - window_left <= j <= diag + window_right, diag = i (top-left) or
    i + length - nq (bottom-right); causal is window_right 0, -1 an unbounded side."""
    i = np.arange(nq) if positions is None else np.asarray(positions, np.int64)
    diag = (i + (length - nq if features.align == "bottom_right" else 0))[:, None]
    j = np.arange(length)[None, :]
    mask = np.ones((len(i), length), bool)
    if features.window_left >= 0:
        mask &= j >= diag - features.window_left
    right = 0 if causal else features.window_right
    if right >= 0:
        mask &= j <= diag + right
    return mask


def sequences(q, k, causal, scale, features: Features, positions=None, nq=None, slope=False):
    """The softmax of each sequence of a call with features, one at a time:
    (rows, kv_rows, length, p, lse, dcap, z) with rows and kv_rows slices of q's and
    k's batch, length the sequence's key length (keys past it are never read), p
    the probabilities (kv rows, group, queries, length), where the group of query
    rows sharing a k/v row is matched to it by a broadcast, not a copy, lse each
    row's log-sum-exp (kv rows, group, queries), and with slope and a softcap
    dcap = 1 - tanh^2 of the capped scores (the cap's derivative), else None, and
    with dropout z the factor keep / (1 - p) of each probability (attnkern._philox),
    p's shape, else None. ALiBi's -slope |i + length - nq - j| and the attention
    mask are added to the capped scores (a bool
    mask's False is -inf). p is the undropped softmax, lse its log-sum-exp. A row
    that sees no key has p 0 and lse -inf. In q's dtype."""
    nsel, d = q.shape[1:]
    nq = nsel if nq is None else nq
    for rows, kv_rows, length in features.sequences(q.shape[0], k.shape[0], k.shape[1]):
        qs = q[rows].reshape(kv_rows.stop - kv_rows.start, features.kv_group, nsel, d)
        kt = k[kv_rows, :length].swapaxes(-1, -2)[:, None]
        scores = np.matmul(qs, kt)
        scores *= scores.dtype.type(scale)
        dcap = None
        if features.softcap:
            cap = scores.dtype.type(features.softcap)
            np.tanh(scores / cap, out=scores)
            if slope:
                dcap = 1 - scores * scores
            scores *= cap
        if features.alibi is not None:  # -slope |i + length - nq - j|, FlashAttention's ALiBi
            i = np.arange(nsel) if positions is None else np.asarray(positions, np.int64)
            dist = np.abs(i[:, None] + length - nq - np.arange(length)[None, :])
            slopes = features.alibi[rows].reshape(*scores.shape[:2], 1, 1).astype(scores.dtype)
            scores -= slopes * dist.astype(scores.dtype)
        scores[..., ~visible(nq, length, causal, features, positions)] = -np.inf
        if features.mask is not None:
            add = features.mask_rows(rows, positions, scores.dtype)[..., :length]  # keys past length: unread
            scores += add.reshape(scores.shape[0], scores.shape[1], *add.shape[1:])
        top = scores.max(axis=-1, keepdims=True, initial=-np.inf)
        top[np.isneginf(top)] = 0  # a row that sees no key: exp(-inf - 0) = 0 everywhere
        scores -= top
        np.exp(scores, out=scores)
        total = scores.sum(axis=-1, keepdims=True)
        with np.errstate(divide="ignore"):
            lse = (np.log(total) + top)[..., 0]
        scores /= np.where(total > 0, total, 1)
        z = None
        if features.dropout_p > 0:
            i = (np.arange(nsel) if positions is None else np.asarray(positions, np.int64)) + features.dropout_offset[0]
            b = np.arange(rows.start, rows.stop).reshape(scores.shape[:2])
            z = dropout_factor(features.dropout_seed, features.dropout_p, b[:, :, None, None], i[None, None, :, None],
                               np.arange(length)[None, None, None, :] + features.dropout_offset[1], scores.dtype)
        yield rows, kv_rows, length, scores, lse, dcap, z


def masked_attention(q, k, v, causal, scale, features: Features, positions=None, nq=None, lse=None):
    """softmax_attention with features, sequence by sequence (sequences): k and v
    with batch / kv_group rows, the mask of the alignment, window and key lengths,
    the softcap, the attention mask, dropout. Rows that see no key get 0 and lse -inf."""
    out = np.zeros((q.shape[0], q.shape[1], v.shape[2]), q.dtype)
    for rows, kv_rows, length, p, row_lse, _, z in sequences(q, k, causal, scale, features, positions, nq):
        out[rows] = np.matmul(p if z is None else p * z, v[kv_rows, :length][:, None]).reshape(out[rows].shape)
        if lse is not None:
            lse[rows] = row_lse.reshape(-1, q.shape[1])
    return out


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
        features=ALL_FEATURES - {"varlen"},  # attention_varlen runs it one sequence at a time
    )
)
