"""How close a kernel's output must be to the float64 reference: the one table of
error bounds that the tests, the harness (`attnkern bench`, `attnkern ring`) and
the tools use. It lives here, in the measuring package, because the library
itself needs no bounds and this module uses only attnkern's public API
(attnkern.reference, attnkern.active_isa): the tests, the harness and tools/
import it from one place, and nothing reaches into the library's private names.

The measure. Each output row is a convex combination of rows of v, so errors
scale with max|v|. A score computed in the input dtype carries a rounding error
that grows with |scale| * |q| * |k|; kappa = max(1, |scale| max|q_i| max|k_j| / sqrt(D))
is 1 for unit-variance inputs at the default scale 1/sqrt(D) and grows as a
larger scale or larger inputs make the softmax sharper and the problem worse
conditioned, for every kernel alike. The scaled error

    scaled_error = max |out - ref| / (max(1, max|v|) * kappa)

is at most tolerance(dtype, ...) for a correct kernel. The reference is computed
in float64 from the very inputs the kernel got (half-precision inputs already
rounded), so what is measured is the kernel's own rounding.

The bound, in units of the dtype's unit roundoff u (2^-53 float64, 2^-24
float32, 2^-11 float16, 2^-8 bfloat16):

float32 and float64, arithmetic in the input dtype: 2^7 u (float32 7.6e-6,
    float64 1.4e-14). Every kernel rounds the same steps to the working
    precision: a D-term dot product per score, the row max and one exponential
    per score, N-term sums (the row sum and P V), a division. The rounding
    errors of a sum of random-sign terms are independent and mean zero, so they
    grow like the square root of the number of terms (the probabilistic model of
    Higham and Mary, SIAM J. Sci. Comput. 2019), and a score's partial sums grow
    like sqrt(d): a score's error is about u sqrt(D/2) kappa, at most 12u kappa
    at D = 256, the largest head size tested. A score error moves the output by
    at most twice as much times max|v| (it enters a weight and the row sum):
    24u. The exponentials (a polynomial exp2 in the native kernels, libm
    elsewhere) add a few u per weight, twice: 8u. The row sum and P V are sums
    of nonnegative weights that add up to 1, in blocks of at least 64 keys (or
    pairwise in BLAS): about u sqrt(64) within a block and u sqrt(N/64) across
    blocks, at most 20u up to N = 16384. The division and the output's rounding:
    2u. Sum: 54u. The GPU's 3xTF32 products (cuda.flash, triton.flash) are good
    to 2^-22 = 4u each, 4u more per score, 8u on the output: 62u. The bound,
    128u, leaves a factor of 2 over that budget for tails beyond the model.
    Measured: at most 14u over the tests' random shapes and scales, on every CPU
    kernel and instruction set, float32 and float64 alike (the same operations,
    rounded to a different u); at most 11u for the GPU kernels in float32 on an
    H100 (docs/data/gpu-*.json).
    A wrong term is an error of order 1e-2 or more, 10^3 times the float32
    bound.

float16 and bfloat16, arithmetic in float32 (the float32 bound, 7.6e-6, is
    below 0.02u of either): the output is rounded once to the dtype, u; kernels
    that also round each probability to the dtype before P V (tensor-core and
    vdpbf16ps/AMX dot products take half-precision operands) move each weight by
    a relative u, 2u more on the output (the weight and the row sum). Bounds:
    2u without that rounding (u needed), 4u with it (3u needed). Measured on an
    H100 (N up to 16384): bfloat16 at most 0.51u, float16 0.55u.

Gradients (attention_backward), max |grad - ref| / (max(1, max|ref|) * kappa): the
same budget and bound as the output (P is recomputed from the saved lse, one more
rounding per score; dq, dk and dv are sums of N or D products); measured at most
10u on native.flash in float32 and float64.

The log-sum-exp, per row |lse - ref| / max(1, |ref|) (lse_error): a score error
shifts it by at most that error, and the half dtypes round it once (plus u from
the rounded row sum on the vdpbf16ps path): lse_tolerance is the float bound
above for float32/float64 and 2u for the half dtypes.
"""

from __future__ import annotations

import numpy as np

import attnkern

# the unit roundoff of each dtype (names as NumPy spells them; torch's dtypes too)
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
# the bound in units of u: (dtype, probabilities rounded to the dtype before P V) -> multiple
BOUND_IN_U = {
    ("float64", False): 2**7, ("float32", False): 2**7,
    ("float16", False): 2, ("float16", True): 4,
    ("bfloat16", False): 2, ("bfloat16", True): 4,
}
LSE_BOUND_IN_U = {"float64": 2**7, "float32": 2**7, "float16": 2, "bfloat16": 2}
HALF = ("float16", "bfloat16")
# attnkern's kernels whose half-precision path keeps the probabilities in float32
# (their products widen blocks to float32); native.flash's bfloat16 path on
# avx512bf16 and amx rounds them (vdpbf16ps, AMX tiles), as do the GPU kernels
# (tensor cores); peers whose insides are not ours are held to the rounding bound
_HALF_P_IN_FLOAT32 = ("native.tiled",)
_ROUNDING_ISAS = ("avx512bf16", "amx")


def dtype_name(dtype) -> str:
    """'float32', 'bfloat16', ... for a NumPy or ml_dtypes dtype, a torch dtype or a name."""
    if isinstance(dtype, str):
        return dtype.removeprefix("torch.")
    if type(dtype).__module__.startswith("torch"):
        return str(dtype).removeprefix("torch.")
    return np.dtype(dtype).name


def tolerance(dtype, *, rounds_p: bool = False) -> float:
    """The bound on scaled_error for an output of this dtype (module docstring);
    rounds_p: the kernel rounds the probabilities to the (half) dtype before P V."""
    name = dtype_name(dtype)
    if (name, bool(rounds_p)) not in BOUND_IN_U:
        raise ValueError(f"no error bound for {name} with rounds_p={rounds_p}")
    return BOUND_IN_U[name, bool(rounds_p)] * UNIT_ROUNDOFF[name]


def lse_tolerance(dtype) -> float:
    """The bound on lse_error for a log-sum-exp of this dtype (module docstring)."""
    name = dtype_name(dtype)
    return LSE_BOUND_IN_U[name] * UNIT_ROUNDOFF[name]


def rounds_probabilities(kernel: str, dtype, isa: str | None = None) -> bool:
    """Whether `kernel` rounds P to `dtype` before P V: never for float32/float64;
    for the half dtypes, native.flash's bfloat16 path on avx512bf16 and amx (isa:
    the instruction set it runs, by default the active one), not its float16 path
    or native.tiled's, and every other kernel (the GPU kernels do, and peers are
    held to the looser bound)."""
    name = dtype_name(dtype)
    if name not in HALF:
        return False
    if kernel in _HALF_P_IN_FLOAT32:
        return False
    if kernel == "native.flash":
        return name == "bfloat16" and (isa or attnkern.active_isa()) in _ROUNDING_ISAS
    return True


def kernel_tolerance(kernel: str, dtype, isa: str | None = None) -> float:
    """tolerance() for `kernel`'s output in `dtype` (on instruction set isa)."""
    return tolerance(dtype, rounds_p=rounds_probabilities(kernel, dtype, isa))


def conditioning(q, k, scale=None) -> float:
    """kappa of the module docstring."""
    d = q.shape[-1]
    scale = 1 / np.sqrt(d) if scale is None else abs(scale)
    qn = np.linalg.norm(np.asarray(q, np.float64), axis=-1).max(initial=0.0)
    kn = np.linalg.norm(np.asarray(k, np.float64), axis=-1).max(initial=0.0)
    return max(1.0, scale * qn * kn / np.sqrt(d))


def _max_error(x, ref, what: str, per: float) -> float:
    """max |x - ref| / per, in float64; inf where x is not finite."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    if x.shape != ref.shape:
        raise ValueError(f"{what} shape {x.shape} is not the reference's {ref.shape}")
    if not np.isfinite(x).all():
        return float("inf")
    return float(np.abs(x - ref).max(initial=0.0) / per)


def scaled_error(out, q, k, v, *, causal=False, scale=None, rows=None) -> float:
    """max |out - ref| / (max(1, max|v|) * kappa): at most tolerance(dtype) for a
    correct kernel. NumPy arrays (any float dtype: the reference is float64); with
    rows, out holds only those query rows (or all rows, of which those are
    compared) and the reference computes only them."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    ref = attnkern.reference(q, k, v, causal=causal, scale=scale, rows=rows)
    out = np.asarray(out)
    if rows is not None and out.shape[-2] != len(rows):
        out = out[..., rows, :]
    return _max_error(out, ref, "output", max(1.0, np.abs(v).max(initial=0.0)) * conditioning(q, k, scale))


def gradient_error(grad, ref, q, k, scale=None) -> float:
    """max |grad - ref| / (max(1, max|ref|) * kappa), for a gradient of attention
    against its float64 value: at most tolerance(dtype) (module docstring)."""
    per = max(1.0, np.abs(np.asarray(ref, np.float64)).max(initial=0.0)) * conditioning(q, k, scale)
    return _max_error(grad, ref, "gradient", per)


def _scores(q, k, causal, scale) -> np.ndarray:
    """scale q k^T in float64, -inf where the causal mask hides a key."""
    q, k = (np.asarray(x, np.float64) for x in (q, k))
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = scale * q @ k.swapaxes(-1, -2)
    return np.where(np.tri(*s.shape[-2:], dtype=bool), s, -np.inf) if causal else s


def reference_lse(q, k, *, causal=False, scale=None) -> np.ndarray:
    """Each query row's log-sum-exp of its scaled (causally masked) scores, in float64."""
    s = _scores(q, k, causal, scale)
    m = s.max(axis=-1, keepdims=True)
    return (m + np.log(np.exp(s - m).sum(axis=-1, keepdims=True)))[..., 0]


def reference_backward(q, k, v, dout, *, causal=False, scale=None):
    """The float64 gradients (dq, dk, dv) of sum(attention(q, k, v) * dout), from the math:
    S = scale q k^T (masked: -inf), P = softmax(S) row by row, O = P v; for an upstream dO,
    dv = P^T dO, dP = dO v^T, dS = P * (dP - rowsum(dO * O)), dq = scale dS k, dk = scale dS^T q.
    (tests/test_cuda_backward.py checks it against torch's autograd.)"""
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = _scores(q, k, causal, scale)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    ds = p * (dout @ v.swapaxes(-1, -2) - (dout * (p @ v)).sum(axis=-1, keepdims=True))
    return scale * ds @ k, scale * ds.swapaxes(-1, -2) @ q, p.swapaxes(-1, -2) @ dout


def lse_error(lse, ref) -> float:
    """max over rows of |lse - ref| / max(1, |ref|): at most lse_tolerance(dtype)."""
    lse, ref = np.asarray(lse, np.float64), np.asarray(ref, np.float64)
    if lse.shape != ref.shape:
        raise ValueError(f"lse shape {lse.shape} is not the reference's {ref.shape}")
    if not np.isfinite(lse).all():
        return float("inf")
    return float((np.abs(lse - ref) / np.maximum(1.0, np.abs(ref))).max(initial=0.0))
