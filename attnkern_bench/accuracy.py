"""How close a kernel's output must be to the float64 reference.

Each output row is a convex combination of rows of v, so errors scale with
max|v|. A score computed in the input dtype carries a rounding error that grows
with |scale| * |q| * |k|; kappa = max(1, |scale| max|q_i| max|k_j| / sqrt(D)) is
1 for unit-variance inputs at the default scale 1/sqrt(D) and grows as a larger
scale or larger inputs make the softmax sharper and the problem worse
conditioned, for every kernel alike. The bound:

    max |out - ref| <= TOL[dtype] * max(1, max|v|) * kappa
"""

from __future__ import annotations

import numpy as np

import attnkern

TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}


def conditioning(q, k, scale=None) -> float:
    """kappa of the module docstring."""
    d = q.shape[-1]
    scale = 1 / np.sqrt(d) if scale is None else abs(scale)
    qn = np.linalg.norm(np.asarray(q, np.float64), axis=-1).max(initial=0.0)
    kn = np.linalg.norm(np.asarray(k, np.float64), axis=-1).max(initial=0.0)
    return max(1.0, scale * qn * kn / np.sqrt(d))


def scaled_error(out, q, k, v, *, causal=False, scale=None, rows=None) -> float:
    """max |out - ref| / (max(1, max|v|) * kappa): at most TOL[dtype] for a correct
    kernel. NumPy arrays; with rows, out holds only those query rows (or all rows,
    of which those are compared) and the reference computes only them."""
    ref = attnkern.reference(q, k, v, causal=causal, scale=scale, rows=rows)
    out = np.asarray(out, dtype=np.float64)
    if rows is not None and out.shape[-2] != len(rows):
        out = out[..., rows, :]
    if out.shape != ref.shape:
        raise ValueError(f"output shape {out.shape} is not the reference's {ref.shape}")
    if not np.isfinite(out).all():
        return float("inf")
    err = np.abs(out - ref).max(initial=0.0)
    return float(err / (max(1.0, np.abs(v).max(initial=0.0)) * conditioning(q, k, scale)))
