"""Shared helpers of the asv suite.

The suite talks to attnkern only through its public API (attention, reference,
kernels, kernel_info), so the same benchmarks run against old commits too:
a kernel a commit does not have is skipped, not an error. For the same reason
it keeps its own small copies of attnkern_bench's FLOP count, seeded inputs and
timer (flops, random_qkv here; median_seconds in bench_tracks.py): asv installs
the commit under test, and commits before attnkern_bench have none.
"""

import os

import numpy as np

# The suite measures kernels with their built-in defaults (or the parameters a
# benchmark names), never a result of attnkern.tune cached on this machine: a
# number must mean the same thing on every commit. (bench_tuned compares the two.)
os.environ["ATTNKERN_NO_TUNED"] = "1"

import attnkern

# Imported here, once, rather than in each benchmark's setup: asv forks every
# benchmark from a server process that has imported the suite, and importing
# torch takes seconds (minutes over a few hundred parameter combinations).
try:
    import torch
except ImportError:
    torch = None
try:
    from threadpoolctl import threadpool_limits
except ImportError:  # asv.conf.json installs it
    threadpool_limits = None

# One thread count for every kernel and every commit, so a number means the same
# thing over the project's history. Override for a bigger machine; results from
# different settings should then go under a different asv machine name.
THREADS = int(os.environ.get("ATTNKERN_BENCH_THREADS", "2"))

# ATTNKERN_BENCH_SMOKE=1: every benchmark and setup_cache of the suite, run as asv runs them,
# on the first value of each size axis (shapes, N, block sizes, turns), every kernel and
# mask kept, and no counting under Valgrind (minutes; tests/test_asv.py counts through make bench's
# path): tests/test_suite.py runs the whole suite this way in minutes, not the half hour
# of the full parameter grid. The numbers mean nothing; that no benchmark fails does.
SMOKE = os.environ.get("ATTNKERN_BENCH_SMOKE") == "1"


def axis(values: list) -> list:
    """A size axis of a benchmark's params: all of it, or its first value in a smoke run."""
    return values[:1] if SMOKE else values

# Kernels that run on the CPU, in the order the site lists them; numba.flash is
# skipped on commits before it existed.
CPU_KERNELS = ["numpy.naive", "native.naive", "native.tiled", "native.flash", "torch.sdpa", "torch.naive",
               "numba.flash"]
# GPU kernels: skipped where no CUDA GPU is present (bench_forward.ForwardCuda).
CUDA_KERNELS = ["cuda.naive", "cuda.flash"]


def parse_shape(shape: str) -> tuple[int, int, int, int]:
    """'1x8x1024x64' -> (B, H, N, D)."""
    b, h, n, d = (int(x) for x in shape.split("x"))
    return b, h, n, d


def flops(shape: str, causal: bool) -> float:
    """Floating-point operations of one forward: 4*B*H*N*N*D, half with a causal mask
    (attnkern_bench.counts.attention_flops; repeated, see the module docstring)."""
    b, h, n, d = parse_shape(shape)
    f = 4.0 * b * h * n * n * d
    return f / 2 if causal else f


def host_dtype(dtype: str):
    """The NumPy dtype attnkern takes for a half-precision name on the host (bfloat16 is
    ml_dtypes.bfloat16, in asv.conf.json's matrix); NotImplementedError skips where it is missing."""
    if dtype == "float16":
        return np.float16
    try:
        import ml_dtypes
    except ImportError:
        raise NotImplementedError("bfloat16 on the host needs ml_dtypes") from None
    return ml_dtypes.bfloat16


def random_qkv(shape: str, dtype=np.float32, seed: int = 0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(parse_shape(shape)).astype(dtype) for _ in range(3))


def pin_threads(threads: int = THREADS) -> None:
    """Limit BLAS/OpenMP pools (NumPy's OpenBLAS, torch) for the rest of this
    benchmark process; asv runs each benchmark in its own process."""
    if threadpool_limits is None:
        raise NotImplementedError("threadpoolctl is not installed: thread counts cannot be pinned")
    threadpool_limits(limits=threads)
    if torch is not None:
        torch.set_num_threads(threads)


def kernel_call(kernel: str, threads: int = THREADS, **params):
    """A function (q, k, v, causal) -> out for `kernel` with `threads` threads, or
    NotImplementedError (asv's skip) where the kernel is missing or unavailable."""
    if kernel not in attnkern.kernels():
        raise NotImplementedError(f"{kernel} does not exist in this commit")
    info = attnkern.kernel_info(kernel)
    if not info["available"]:
        raise NotImplementedError(f"{kernel} is not available here: {info['reason']}")
    if info.get("device") == "cuda" and os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        # Numba's simulator runs GPU kernels on Python threads: correct, and no timing of a GPU
        raise NotImplementedError(f"{kernel}: Numba's CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1)")
    if "num_threads" in info["params"]:
        params.setdefault("num_threads", threads)
    for name, value in params.items():
        spec = info["params"].get(name)
        if spec is None or not spec["min"] <= value <= spec["max"]:
            raise NotImplementedError(f"{kernel} does not take {name}={value} in this commit")

    def call(q, k, v, causal=False):
        return attnkern.attention(q, k, v, causal=causal, kernel=kernel, **params)

    return call


def setup_kernel(kernel: str, threads: int = THREADS, **params):
    """pin_threads + kernel_call: what every benchmark's setup starts with."""
    pin_threads(threads)
    return kernel_call(kernel, threads, **params)
