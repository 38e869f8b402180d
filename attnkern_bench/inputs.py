"""Seeded random inputs: the same seed gives the same values in every dtype
(drawn in float64, then rounded)."""

from __future__ import annotations

import numpy as np


def random_qkv(rng, lead=(), nq=64, nk=None, d=64, dv=None, dtype=np.float32, magnitude: float = 1.0):
    """q (*lead, nq, d), k (*lead, nk, d), v (*lead, nk, dv), standard normal
    (q and k times `magnitude`). rng: a numpy Generator, or an int seed."""
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    nk = nq if nk is None else nk
    dv = d if dv is None else dv
    lead = tuple(lead)
    q = rng.standard_normal((*lead, nq, d)) * magnitude
    k = rng.standard_normal((*lead, nk, d)) * magnitude
    v = rng.standard_normal((*lead, nk, dv))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def sample_rows(rng, n: int, count: int) -> np.ndarray:
    """`count` query rows of n (all when count >= n), always with the first and the last."""
    if count >= n:
        return np.arange(n)
    return np.unique(np.concatenate([[0, n - 1], rng.choice(n, size=count, replace=False)]))
