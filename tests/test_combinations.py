"""Every combination kernel_info() claims, run and checked; every one it does not
claim, refused. For each kernel available here (the cuda.* ones in Numba's CUDA
simulator without a GPU), each dtype attnkern knows and each of: the output
alone, the output with its log-sum-exp (return_lse), and the gradients
(attention_backward, which takes the forward's out and lse: a backward always
comes with return_lse). A claimed combination is compared with the float64
reference on fresh random inputs, within the bounds of attnkern_bench.accuracy;
an unclaimed one must raise a ValueError or TypeError that names the kernel and
what it lacks, before running anything."""

import os

import ml_dtypes
import numpy as np
import pytest

import attnkern
from attnkern_bench.accuracy import gradient_error, reference_backward, tolerance
from conftest import assert_lse_matches_reference, assert_matches_reference, random_qkv

DTYPES = {"float32": np.float32, "float64": np.float64, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
MODES = ("out", "lse", "backward")
KERNELS = [k for k in attnkern.kernels() if attnkern.kernel_info(k)["available"]]
# tiles small enough for the simulator (a Python thread per GPU thread)
SMALL = {"cuda.flash": {"block_q": 8, "block_k": 8}, "cuda.naive": {"tile": 8}}
SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def refusal(info, dtype, mode):
    """None if kernel_info claims (dtype, mode), else (exception, message pattern) of the
    first thing missing, in the order attention() checks them."""
    name = info["name"]
    if dtype not in info["dtypes"]:
        return TypeError, rf"{name} does not take {dtype} inputs \(it takes "
    if mode != "out" and not info["returns_lse"]:
        return ValueError, rf"{name} cannot return the log-sum-exp; kernels that can: "
    if mode == "backward" and not info["backward"]:
        return ValueError, rf"{name} has no backward pass"
    if mode == "backward" and dtype not in info["backward_dtypes"]:
        return TypeError, rf"{name}'s backward takes {' and '.join(info['backward_dtypes'])}, not {dtype}"
    return None


CASES = [pytest.param(k, d, m, id=f"{k}-{d}-{m}") for k in KERNELS for d in DTYPES for m in MODES]


def test_every_kernel_is_in_the_cases():
    """Only kernels that cannot run here are left out (triton.flash without a GPU: its
    refusal is tests/test_triton.py's), and every CPU kernel runs here."""
    missing = {k: attnkern.kernel_info(k)["reason"] for k in attnkern.kernels() if k not in KERNELS}
    assert all(attnkern.kernel_info(k)["device"] == "cuda" for k in missing), missing


@pytest.mark.parametrize("kernel, dtype, mode", CASES)
def test_claimed_combinations_run_and_the_rest_are_refused(kernel, dtype, mode):
    info = attnkern.kernel_info(kernel)
    seed = np.random.SeedSequence().entropy  # fresh inputs every run, the seed printed for a rerun
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    # D != Dv in float32/float64; in half precision D = Dv = 16, the smallest head size every
    # kernel takes there (cuda.flash's tensor-core kernels need D = Dv, a multiple of 16)
    d, dv = (16, 16) if dtype in ("float16", "bfloat16") else (8, 4)
    q, k, v = random_qkv(rng, (2,), 9, 11, d, dv, DTYPES[dtype])
    dout = rng.standard_normal(q.shape[:-1] + v.shape[-1:]).astype(DTYPES[dtype])
    params = SMALL.get(kernel, {})
    refused = refusal(info, dtype, mode)
    if refused is not None:
        exc, pattern = refused
        with pytest.raises(exc, match=pattern):
            if mode == "backward":  # the forward's out and lse, as another kernel would give them
                out, lse = np.zeros(dout.shape, dout.dtype), np.zeros(q.shape[:-1], q.dtype)
                attnkern.attention_backward(q, k, v, out, dout, lse, causal=True, kernel=kernel, **params)
            else:
                attnkern.attention(q, k, v, causal=True, kernel=kernel, return_lse=mode == "lse", **params)
        return
    if SIMULATED and kernel.startswith("cuda.") and dtype in ("float16", "bfloat16"):
        pytest.skip("cuda.flash's float16/bfloat16 kernels are CUDA C++, which the simulator cannot run: "
                    "needs a GPU (ATTNKERN_TEST_GPU=1)")
    result = attnkern.attention(q, k, v, causal=True, kernel=kernel, return_lse=mode != "out", **params)
    out, lse = result if mode != "out" else (result, None)
    assert_matches_reference(out, q, k, v, causal=True, kernel=kernel)
    if lse is not None:
        assert_lse_matches_reference(lse, q, k, causal=True)
    if mode == "backward":
        grads = attnkern.attention_backward(q, k, v, out, dout, lse, causal=True, kernel=kernel, **params)
        for name, g, x, ref in zip(("dq", "dk", "dv"), grads, (q, k, v),
                                   reference_backward(q, k, v, dout, causal=True)):
            assert g.shape == x.shape and g.dtype == x.dtype
            err = gradient_error(g, ref, q, k)
            assert err <= tolerance(g.dtype), f"{name}: scaled error {err:.3g} > {tolerance(g.dtype):.3g}"
