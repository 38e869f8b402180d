"""The dropout RNG, in NumPy: Philox4x32-10 (Salmon et al., Random123), counter
based, so any element of the dropout mask is computed alone, in any order, by any
thread, and the C kernels (attn_common.h's attn_philox) give the same bits.

The keep decision of query i, key j in folded batch row b (of B * H) under seed s:
    words = Philox4x32-10(counter = (j // 4, i, b, 0), key = (s mod 2^32, s // 2^32))
    u = words[j % 4];  keep iff u >= round(p * 2^32)
(each word an unsigned 32-bit integer; counter words are taken mod 2^32). Kept
probabilities are scaled by 1 / (1 - p)."""

from __future__ import annotations

import numpy as np

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_LOW = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)


def philox4x32_10(c0, c1, c2, c3, seed: int):
    """The four output words (uint64 arrays holding uint32 values) of Philox4x32-10
    for counters c0..c3 (integer arrays, broadcast together) and a 64-bit seed."""
    c0, c1, c2, c3 = (np.asarray(c, np.uint64) & _LOW for c in (c0, c1, c2, c3))
    k0, k1 = int(seed) & 0xFFFFFFFF, (int(seed) >> 32) & 0xFFFFFFFF
    for r in range(10):
        if r:
            k0, k1 = (k0 + _W0) & 0xFFFFFFFF, (k1 + _W1) & 0xFFFFFFFF
        p0, p1 = _M0 * c0, _M1 * c2
        hi0, lo0, hi1, lo1 = p0 >> _SHIFT, p0 & _LOW, p1 >> _SHIFT, p1 & _LOW
        c0, c1, c2, c3 = hi1 ^ c1 ^ np.uint64(k0), lo1, hi0 ^ c3 ^ np.uint64(k1), lo0
    return c0, c1, c2, c3


def threshold(p: float) -> int:
    """The keep threshold of dropout probability p: round(p * 2^32)."""
    return int(round(p * 2.0**32))


def keep(seed: int, p: float, rows, i, j) -> np.ndarray:
    """The boolean keep mask of the elements (rows, i, j) (integer arrays that
    broadcast together: folded batch rows, query and key indices)."""
    rows, i, j = np.broadcast_arrays(*(np.asarray(x, np.int64) for x in (rows, i, j)))
    words = philox4x32_10(j >> 2, i, rows, 0, seed)
    pick = j & 3
    u = np.choose(pick, words)
    return u >= np.uint64(threshold(p))


def dropout_factor(seed: int, p: float, rows, i, j, dtype) -> np.ndarray:
    """keep / (1 - p) as dtype (the factor Z the probabilities are multiplied by)."""
    dtype = np.dtype(dtype)
    return np.where(keep(seed, p, rows, i, j), dtype.type(1.0 / (1.0 - p)), dtype.type(0)).astype(dtype)
