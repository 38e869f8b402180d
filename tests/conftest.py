import contextlib
import os

import numpy as np
from hypothesis import HealthCheck, settings

import attnkern

settings.register_profile(
    "default", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# Accuracy against the float64 reference: max |out - ref| <= TOL * max |v|
# (each output row is a convex combination of rows of v).
TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float64): 1e-12}

AVAILABLE = [k for k in attnkern.kernels() if attnkern.kernel_info(k)["available"]]
NATIVE = [k for k in AVAILABLE if k.startswith("native.")]
ISAS = attnkern.supported_isas()


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
    bound = TOL[out.dtype] * max(1.0, np.abs(v).max(initial=0.0))
    assert err <= bound, f"max abs error {err:.3g} > {bound:.3g}"
