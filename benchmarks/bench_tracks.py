"""Derived figures tracked over history, with units: throughput, speed relative to
torch.sdpa measured side by side in the same process, and accuracy against the
float64 reference (an accuracy regression shows on the site like a slowdown)."""

import statistics
import time

import numpy as np

import attnkern

from .common import CPU_KERNELS, OPTIONAL_KERNELS, flops, kernel_call, random_qkv, setup_kernel

SHAPES = ["1x8x1024x64", "1x8x2048x64"]


def median_seconds(call, args, calls: int) -> float:
    """Median of `calls` back-to-back timed calls after one untimed call."""
    call(*args)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Throughput:
    params = [["native.flash", "native.tiled", "torch.sdpa", "numpy.naive"] + OPTIONAL_KERNELS, SHAPES,
              [False, True]]
    param_names = ["kernel", "shape", "causal"]
    rounds = 2
    timeout = 180

    def setup(self, kernel, shape, causal):
        self.call = setup_kernel(kernel)
        self.q, self.k, self.v = random_qkv(shape)

    def track_gflops(self, kernel, shape, causal):
        seconds = median_seconds(self.call, (self.q, self.k, self.v, causal), calls=5)
        return flops(shape, causal) / seconds / 1e9

    track_gflops.unit = "GFLOP/s"


class SpeedupOverTorch:
    """torch.sdpa time / kernel time, both timed in this process in alternating
    turns (kernel, torch, kernel, torch, ...), so machine drift hits both alike.
    Above 1: faster than PyTorch's CPU attention."""

    params = [["native.flash", "native.tiled", "numpy.naive"] + OPTIONAL_KERNELS, SHAPES, [False, True]]
    param_names = ["kernel", "shape", "causal"]
    rounds = 2
    timeout = 240

    def setup(self, kernel, shape, causal):
        self.call = setup_kernel(kernel)
        self.torch = kernel_call("torch.sdpa")
        self.q, self.k, self.v = random_qkv(shape)

    def track_speedup(self, kernel, shape, causal):
        args = (self.q, self.k, self.v, causal)
        ours, theirs = [], []
        for _ in range(3):
            ours.append(median_seconds(self.call, args, calls=3))
            theirs.append(median_seconds(self.torch, args, calls=3))
        return statistics.median(theirs) / statistics.median(ours)

    track_speedup.unit = "x torch.sdpa"


class Accuracy:
    """max |out - ref| / max |ref| against attnkern.reference (float64), on fixed
    random inputs with an odd N that no block size divides."""

    params = [CPU_KERNELS + OPTIONAL_KERNELS, ["float32", "float64"], [False, True]]
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
