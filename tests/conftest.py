import contextlib
import os

# Before attnkern (and with it Numba) is imported:
# - CUDA kernels run in Numba's CUDA simulator unless ATTNKERN_TEST_GPU=1 asks for a real GPU;
# - Numba's thread pool gets 4 threads even on a 2-CPU machine, so determinism is tested
#   across more thread counts than the machine has cores (as for the native kernels).
if os.environ.get("ATTNKERN_TEST_GPU") != "1":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
os.environ.setdefault("NUMBA_NUM_THREADS", "4")

import numpy as np  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

import attnkern  # noqa: E402

settings.register_profile(
    "default", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# Accuracy against the float64 reference: max |out - ref| <= TOL * max|v| * kappa.
# Each output row is a convex combination of rows of v, so errors scale with
# max|v|. A score computed in the input dtype carries a rounding error that
# grows with |scale| * |q| * |k|; kappa = max(1, |scale| max|q_i| max|k_j| / sqrt(D))
# is 1 for unit-variance inputs at the default scale 1/sqrt(D) and grows as a
# larger scale or larger inputs make the softmax sharper and the problem worse
# conditioned, for every kernel alike.
TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}


def conditioning(q, k, scale=None):
    d = q.shape[-1]
    scale = 1 / np.sqrt(d) if scale is None else abs(scale)
    qn = np.linalg.norm(q.astype(np.float64), axis=-1).max(initial=0.0)
    kn = np.linalg.norm(k.astype(np.float64), axis=-1).max(initial=0.0)
    return max(1.0, scale * qn * kn / np.sqrt(d))

# CPU kernels; the CUDA ones (simulated on a machine without a GPU) are tested in test_cuda.py
AVAILABLE = [k for k in attnkern.kernels() if not k.startswith("cuda.") and attnkern.kernel_info(k)["available"]]
NATIVE = [k for k in AVAILABLE if k.startswith("native.")]
ISAS = attnkern.supported_isas()
# kernels with tunables (num_threads, and block sizes where they have them), paired with
# the instruction sets to force (None: Numba's kernels, compiled for this CPU)
TUNABLE = [(k, isa) for k in NATIVE for isa in ISAS] + [(k, None) for k in AVAILABLE if k.startswith("numba.")]
CPU_TUNABLE = [k for k in AVAILABLE if k.startswith(("native.", "numba."))]


def max_threads(kernel):
    return attnkern.kernel_info(kernel)["params"]["num_threads"]["max"]


@contextlib.contextmanager
def forced_isa(isa):
    """Runs the native kernels with instruction set `isa` (None: the best)."""
    old = os.environ.get("ATTNKERN_ISA")
    if isa is None:
        os.environ.pop("ATTNKERN_ISA", None)
    else:
        os.environ["ATTNKERN_ISA"] = isa
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("ATTNKERN_ISA", None)
        else:
            os.environ["ATTNKERN_ISA"] = old


def random_qkv(rng, lead, nq, nk, d, dv, dtype, magnitude=1.0):
    q = rng.standard_normal((*lead, nq, d)) * magnitude
    k = rng.standard_normal((*lead, nk, d)) * magnitude
    v = rng.standard_normal((*lead, nk, dv))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def assert_matches_reference(out, q, k, v, causal=False, scale=None):
    ref = attnkern.reference(q, k, v, causal=causal, scale=scale)
    assert out.shape == ref.shape
    assert out.dtype == q.dtype
    assert np.isfinite(out).all()
    err = np.abs(out.astype(np.float64) - ref).max(initial=0.0)
    bound = TOL[out.dtype] * max(1.0, np.abs(v).max(initial=0.0)) * conditioning(q, k, scale)
    assert err <= bound, f"max abs error {err:.3g} > {bound:.3g}"
