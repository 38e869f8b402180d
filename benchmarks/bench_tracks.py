"""Derived figures tracked over history, with units: cost per FLOP (throughput),
time relative to torch.sdpa measured side by side (paired turns of two worker
processes), and accuracy against the float64 reference.

asv 0.6 reads every number as lower-is-better: `asv continuous`, `asv compare` and
the site's regressions page flag an increase. So throughput is tracked as
picoseconds per FLOP (1000 / GFLOP/s) and the comparison with torch as a time
ratio (kernel / torch): a GFLOP/s or speedup track would flag every improvement
as a regression and pass every slowdown."""

import statistics
import time

import numpy as np

import attnkern

from .common import (CPU_KERNELS, CUDA_KERNELS, SMOKE, THREADS, axis, flops, host_dtype, kernel_call, random_qkv,
                     setup_kernel)
from .turns import Worker, paired_turns

SHAPES = axis(["1x8x1024x64", "1x8x2048x64"])


def median_seconds(call, args, calls: int, warmup: float = 0.5) -> float:
    """Median of `calls` back-to-back timed calls after untimed ones for `warmup` seconds (at
    least one; 0.5 s, as asv's own timings warm up 0.2 s and numpy.naive needed more): in a freshly forked benchmark process the first calls start thread pools and
    fault in pages, and five calls after one untimed one read 1.3-3.5x the settled time
    (attnkern_bench.timing's turn with one kernel; repeated here, see common.py's docstring)."""
    end = time.perf_counter() + warmup
    call(*args)
    while time.perf_counter() < end:
        call(*args)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Throughput:
    """Time per floating-point operation: 10 ps/FLOP is 100 GFLOP/s."""

    params = [["native.flash", "native.tiled", "torch.sdpa", "numpy.naive", "numba.flash"], SHAPES,
              [False, True]]
    param_names = ["kernel", "shape", "causal"]
    rounds = 2
    timeout = 180

    def setup(self, kernel, shape, causal):
        self.call = setup_kernel(kernel)
        self.q, self.k, self.v = random_qkv(shape)

    def track_ps_per_flop(self, kernel, shape, causal):
        seconds = median_seconds(self.call, (self.q, self.k, self.v, causal), calls=15)
        return seconds / flops(shape, causal) * 1e12

    track_ps_per_flop.unit = "ps/FLOP (= 1000 / GFLOP/s)"


class DecodeBandwidth:
    """native.flash's CPU decode path (flash-decoding, docs/kernels.md) reading a KV cache:
    one decode step of a GQA model (32 query heads over 8 k/v heads, D = 128, B sequences,
    one query, causal="bottom_right") over nk cached keys, float32 or bfloat16, on the
    suite's threads. time_decode: one call; track_ps_per_byte: that time over the bytes
    of K and V (the cache, read once), in picoseconds a byte (1000 / GB/s: asv reads every
    number as lower-is-better). dev/cpu_decode_bandwidth.py sets it beside STREAM."""

    params = [axis([4096, 65536]), [1, 4], ["float32", "bfloat16"]]
    param_names = ["nk", "batch", "dtype"]
    timeout = 180

    def setup(self, nk, batch, dtype):
        kernel_call("native.flash")  # NotImplementedError (skip) where missing or unavailable
        if dtype not in attnkern.kernel_info("native.flash").get("dtypes", ["float32"]):
            raise NotImplementedError(f"native.flash has no {dtype} on this commit")
        rng = np.random.default_rng(0)
        host = np.float32 if dtype == "float32" else host_dtype(dtype)
        self.q = rng.standard_normal((batch, 32, 1, 128), dtype=np.float32).astype(host)
        self.k, self.v = (rng.standard_normal((batch, 8, nk, 128), dtype=np.float32).astype(host) for _ in "kv")
        self.nbytes = self.k.nbytes + self.v.nbytes

    def call(self):
        attnkern.attention(self.q, self.k, self.v, kernel="native.flash", causal="bottom_right",
                           num_threads=THREADS, check_finite=False)

    def time_decode(self, nk, batch, dtype):
        self.call()

    def track_ps_per_byte(self, nk, batch, dtype):
        seconds = median_seconds(lambda: self.call(), (), calls=3 if SMOKE else 15)
        return seconds / self.nbytes * 1e12

    track_ps_per_byte.unit = "ps/byte (= 1000 / GB/s)"


class TimeVsTorch:
    """kernel time / torch.sdpa time, paired: the kernel and torch each run in a
    worker process of their own (turns.py) and take alternating turns, one call
    each, so machine drift hits both alike and neither runtime's thread pools
    can slow the other (in one process, a numba.flash call left torch 4-7x
    slower). The median of the per-round ratios. Below 1: faster than PyTorch's
    CPU attention."""

    params = [["native.flash", "native.tiled", "numpy.naive", "numba.flash"], SHAPES, [False, True]]
    param_names = ["kernel", "shape", "causal"]
    rounds = 1
    timeout = 300
    turns = 3 if SMOKE else 25

    def setup(self, kernel, shape, causal):
        kernel_call(kernel)  # NotImplementedError (skip) where missing or unavailable
        kernel_call("torch.sdpa")
        self.workers = {"kernel": Worker(threads=THREADS), "torch": Worker(threads=THREADS)}
        for name, k in (("kernel", kernel), ("torch", "torch.sdpa")):
            reply = self.workers[name].setup(k, shape, causal)
            if "skip" in reply:
                self.teardown(kernel, shape, causal)
                raise NotImplementedError(reply["skip"])

    def teardown(self, kernel, shape, causal):
        for w in self.workers.values():
            w.close()

    def track_time_ratio(self, kernel, shape, causal):
        meds = paired_turns(self.workers, self.turns)
        return statistics.median(a / b for a, b in zip(meds["kernel"], meds["torch"]))

    track_time_ratio.unit = "x torch.sdpa time"


class ThreadsUsed:
    """The threads each CPU kernel's call ran on, read back from the kernel or its
    runtime (attnkern.threads_used: the native kernels' OpenMP teams, torch's and
    Numba's thread counts, the BLAS pool), in a benchmark process made as every
    other's (asv forks it from its server): the suite's thread count on every line,
    or the timings beside it were not measured on the threads they claim. asv flags
    increases, so the shortfall (asked for minus ran on) is tracked too."""

    params = [CPU_KERNELS]
    param_names = ["kernel"]
    rounds = 1
    timeout = 120

    def setup(self, kernel):
        if not hasattr(attnkern, "threads_used"):
            raise NotImplementedError("this commit cannot report the threads its kernels ran on")
        self.call = setup_kernel(kernel)
        self.call(*random_qkv("1x8x256x64"))
        self.used = attnkern.threads_used(kernel)
        if self.used is None:
            raise NotImplementedError(f"{kernel} cannot report the threads it ran on")

    def track_threads(self, kernel):
        return self.used

    track_threads.unit = "threads"

    def track_threads_short(self, kernel):
        return THREADS - self.used

    track_threads_short.unit = "threads asked for but not used"


class Accuracy:
    """max |out - ref| / max |ref| against attnkern.reference (float64), on fixed
    random inputs with an odd N that no block size divides."""

    params = [CPU_KERNELS + CUDA_KERNELS, ["float32", "float64"], [False, True]]
    param_names = ["kernel", "dtype", "causal"]
    rounds = 1
    timeout = 120

    def setup(self, kernel, dtype, causal):
        self.call = setup_kernel(kernel)
        self.q, self.k, self.v = random_qkv("2x4x333x64", np.dtype(dtype), seed=1)
        self.ref = attnkern.reference(self.q, self.k, self.v, causal=causal)

    def track_relative_error(self, kernel, dtype, causal):
        out = np.asarray(self.call(self.q, self.k, self.v, causal), dtype=np.float64)
        return float(np.max(np.abs(out - self.ref)) / np.max(np.abs(self.ref)))

    track_relative_error.unit = "max abs err / max |ref|"
