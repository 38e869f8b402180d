import contextlib
import subprocess
import os
import tempfile

# Before attnkern (and with it Numba) is imported:
# - CUDA kernels run in Numba's CUDA simulator unless ATTNKERN_TEST_GPU=1 asks for a real GPU;
# - Numba's thread pool gets 4 threads even on a 2-CPU machine, so determinism is tested
#   across more thread counts than the machine has cores (as for the native kernels).
if os.environ.get("ATTNKERN_TEST_GPU") != "1":
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
os.environ.setdefault("NUMBA_NUM_THREADS", "4")
# The tests never read or write the user's cache of tuned parameters.
os.environ["ATTNKERN_CACHE_DIR"] = tempfile.mkdtemp(prefix="attnkern-test-cache-")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402


def _serialize_simulated_shared_arrays():
    """Numba's CUDA simulator gives each GPU thread a Python thread, and a block's
    threads share `cuda.shared.array` through one dict keyed by the calling line:
    look up, and if absent make and store. Two threads that both find it absent
    make two arrays and write to different ones (seen as a wrong cuda.flash result
    about once in a full test run, and in a third of runs with the interpreter's
    switch interval at 1 us). Here the look-up and the store are one step under a
    lock, with the simulator's own key (the caller's file and line)."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        return
    try:
        from numba.cuda.simulator import kernelapi
    except ImportError:  # numba-cuda not installed: no CUDA tests
        return
    import sys
    import threading

    lock = threading.Lock()
    unlocked = kernelapi.FakeCUDAShared.array

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory, or the simulator's own error
            return unlocked(self, shape, dtype, alignment)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                if isinstance(dtype, kernelapi.types.Type):  # a Numba type, as the simulator converts it
                    dtype = kernelapi.numpy_support.as_dtype(dtype)
                res = self._allocations[caller] = np.empty(shape, dtype)
        return res

    kernelapi.FakeCUDAShared.array = array


def _fast_simulated_blocks():
    """The simulator runs a block as one Python thread per GPU thread while the
    launching thread polls them in a loop (BlockManager.run); each barrier and each
    thread's end waits for the poller to get the GIL, which Python hands over every
    switch interval (5 ms by default). At 0.1 ms a cuda.naive call of the tests took
    1.3 s instead of 8.9 (cuda.flash 0.26 s instead of 2.1). Set only while a block
    runs, so no other test sees another interval."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
        return
    try:
        from numba.cuda.simulator import kernel
    except ImportError:
        return
    import sys

    plain = kernel.BlockManager.run

    def run(self, grid_point, *args):
        before = sys.getswitchinterval()
        sys.setswitchinterval(1e-4)
        try:
            return plain(self, grid_point, *args)
        finally:
            sys.setswitchinterval(before)

    kernel.BlockManager.run = run


_serialize_simulated_shared_arrays()
_fast_simulated_blocks()

import attnkern  # noqa: E402

settings.register_profile(
    "default", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# Accuracy against the float64 reference: the bounds of attnkern_bench.accuracy
# (its docstring derives them), shared with the benchmark command and the tools.
from attnkern_bench.accuracy import (  # noqa: E402
    kernel_tolerance,
    lse_error,
    lse_tolerance,
    reference_lse,  # noqa: F401  (the tests' log-sum-exp reference)
    scaled_error,
    tolerance,
)
from attnkern_bench.inputs import random_qkv  # noqa: E402, F401  (the tests' inputs)

# CPU kernels; the CUDA ones (simulated on a machine without a GPU) are tested in test_cuda.py
AVAILABLE = [k for k in attnkern.kernels() if not k.startswith("cuda.") and attnkern.kernel_info(k)["available"]]
NATIVE = [k for k in AVAILABLE if k.startswith("native.")]
ISAS = attnkern.supported_isas()
# kernels with tunables (num_threads, and block sizes where they have them), paired with
# the instruction sets to force (None: Numba's kernels, compiled for this CPU)
TUNABLE = [(k, isa) for k in NATIVE for isa in ISAS] + [(k, None) for k in AVAILABLE if k.startswith("numba.")]
CPU_TUNABLE = [k for k in AVAILABLE if k.startswith(("native.", "numba."))]


def require_cuda_kernels():
    """At a test module's top: the cuda.* kernels must run here. Without
    ATTNKERN_TEST_GPU=1 they run in Numba's CUDA simulator, which numba-cuda (a
    test extra, installed by `make setup`) provides, so unavailable means a broken
    setup: fail. With ATTNKERN_TEST_GPU=1 on a machine without a usable GPU, skip."""
    reason = attnkern.kernel_info("cuda.flash")["reason"]
    if reason is None:
        return
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        pytest.fail(f"the cuda.* kernels cannot run in the simulator: {reason}; run `make setup`", pytrace=False)
    pytest.skip(f"no GPU for the cuda.* kernels (ATTNKERN_TEST_GPU=1): {reason}", allow_module_level=True)


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


def assert_matches_reference(out, q, k, v, causal=False, scale=None, kernel=None, isa=None):
    """out against the float64 reference within the bound of attnkern_bench.accuracy for its
    dtype (for float16/bfloat16, that of `kernel` on instruction set `isa`)."""
    assert out.shape[:-2] == q.shape[:-2] and out.shape[-2:] == (q.shape[-2], v.shape[-1])
    assert out.dtype == q.dtype
    assert np.isfinite(np.asarray(out, np.float64)).all()
    assert kernel is not None or out.dtype.name in ("float32", "float64"), "half precision: name the kernel"
    bound = tolerance(out.dtype) if kernel is None else kernel_tolerance(kernel, out.dtype, isa)
    err = scaled_error(out, q, k, v, causal=causal, scale=scale)
    assert err <= bound, f"max abs error {err:.3g} x (max(1, max|v|) kappa) > {bound:.3g}"


def assert_lse_matches_reference(lse, q, k, causal=False, scale=None):
    """lse against the float64 log-sum-exp, row by row, within attnkern_bench.accuracy's bound."""
    assert lse.shape == q.shape[:-1] and lse.dtype == q.dtype
    err = lse_error(lse, reference_lse(q, k, causal=causal, scale=scale))
    assert err <= lse_tolerance(lse.dtype), f"lse error {err:.3g} > {lse_tolerance(lse.dtype):.3g}"


# The asv environment of the end-to-end tests (test_asv, test_history) holds what their
# benchmarks need (NumPy; threadpoolctl, with which the suite pins BLAS threads) and the
# build tools, not the whole suite's matrix: the suite's environment (torch, Numba,
# numba-cuda, optuna, sentence-transformers: 1.8 GB) took 50 s to create on a fresh machine
# where this one takes 13 s. `make bench` and tests/test_suite.py run the whole suite in the
# whole matrix. The environments live beside the repository's (.asv/env), a cache.
ASV_TEST_REQS = ("numpy", "threadpoolctl", "meson-python", "meson", "ninja", "Cython")


def asv_test_config(repo_root, **updates) -> dict:
    """The repository's asv.conf.json with the tests' smaller matrix and `updates`."""
    from asv.util import load_json

    config = load_json(str(repo_root / "asv.conf.json"), js_comments=True)
    reqs = config["matrix"]["req"]
    assert set(ASV_TEST_REQS) <= set(reqs), "asv.conf.json's matrix lost a package the tests' environment takes"
    config["matrix"]["req"] = {name: reqs[name] for name in ASV_TEST_REQS}
    config.update(env_dir=str(repo_root / ".asv" / "env"), **updates)
    return config


def run(cmd, cwd, check=True, env=None):
    """subprocess.run with output captured; a failure (with check) raises with the output."""
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def git(clone, *args):
    """git in a test's clone, committing as a test author; its stdout."""
    env = dict(os.environ, GIT_AUTHOR_NAME="attnkern test", GIT_AUTHOR_EMAIL="test@attnkern",
               GIT_COMMITTER_NAME="attnkern test", GIT_COMMITTER_EMAIL="test@attnkern")
    return subprocess.run(["git", *args], cwd=clone, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()
