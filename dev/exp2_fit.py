"""The float32 2^f polynomial of the CPU kernels (native/attn_common.h's attn_exp2_f32,
numba/flash.py's EXP2_F32): degree 5 on |f| <= 1/2 with the constant term fixed at 1, the
other coefficients fitted by iteratively reweighted least squares towards the least largest
relative error. Prints the fit and, for it and the polynomial it replaced, the largest and
mean relative error of a float32 FMA (Horner) evaluation over 2 million points, and 2^0.

    python3 dev/exp2_fit.py
"""

import numpy as np

OLD = [1.0000000754548972, 0.6931471880262294, 0.24022107485309188, 0.055503571142190296,
       0.009676031918298474, 0.0013390863364698205]


def fit(iterations: int = 200) -> list[float]:
    f = np.linspace(-0.5, 0.5, 200001)
    y = np.exp2(f)
    a = np.stack([f ** k for k in range(1, 6)], 1) / y[:, None]
    b = (y - 1) / y
    w = np.ones_like(f)
    for _ in range(iterations):
        c = np.linalg.lstsq(a * w[:, None], b * w, rcond=None)[0]
        e = np.abs(a @ c - b)
        w = w * (1 + 50 * e / e.max())
        w /= w.max()
    return [1.0, *map(float, c)]


def errors(coefs: list[float]) -> tuple[float, float, float]:
    """(largest, mean relative error, value at 0) of Horner's rule in float32 with FMAs
    (each step exact in float64, then rounded to float32, as an FMA rounds once)."""
    x = np.linspace(-0.5, 0.5, 2000001).astype(np.float32).astype(np.float64)
    p = np.full_like(x, np.float32(coefs[-1]))
    for c in coefs[-2::-1]:
        p = (p * x + np.float64(np.float32(c))).astype(np.float32).astype(np.float64)
    rel = np.abs(p - np.exp2(x)) / np.exp2(x)
    return float(rel.max()), float(rel.mean()), float(p[np.argmin(np.abs(x))])


if __name__ == "__main__":
    new = fit()
    print("fitted:", ", ".join(repr(c) for c in new))
    for name, coefs in (("fitted", new), ("before", OLD)):
        big, mean, at0 = errors(coefs)
        print(f"{name}: largest relative error {big:.3g}, mean {mean:.3g}, 2^0 = {at0!r}")
