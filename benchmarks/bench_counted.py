"""Counted cost: instructions executed (and a cycle estimate from simulated
cache misses) by one single-threaded call of each CPU kernel, under Valgrind's
callgrind (see counting.py). Identical code gives identical counts run after
run, so the site's regressions page can flag 1% steps here, where the timings'
drift on a shared 2-core machine hides 10-30% ones.

A kernel's configurations are counted in one Valgrind run, in its class's
`setup_cache` (importing NumPy and Numba under Valgrind takes most of a minute,
a kernel call seconds). asv keys a setup_cache by its source location and hands
the result to every class whose setup_cache has that location: a setup_cache
inherited from one base class would be run once, for the first class, and its
counts handed to the other four. So each class defines its own, one line that
calls the shared counting, and `asv run -b NativeFlash` counts that kernel alone.
Counted on Valgrind's view of the CPU: AVX2, not AVX-512 (counting.py says why)."""

import os

from .common import SMOKE, axis
from .counting import config_key, count, estimated_cycles, valgrind_missing

# torch's kernels are PyTorch's code, not ours: timed elsewhere, not counted.
# Small shapes (Valgrind runs 50-100x slower than the CPU); 333 is odd on purpose:
# no block or vector width divides it, so the remainder paths are counted too.
# ATTNKERN_BENCH_COUNTED_SHAPES=1x2x256x64[,...] counts those shapes only: tests/test_asv.py's
# site needs one, and each shape costs about 5 s a commit under Valgrind
SHAPES = (os.environ["ATTNKERN_BENCH_COUNTED_SHAPES"].split(",") if os.environ.get("ATTNKERN_BENCH_COUNTED_SHAPES")
          else axis(["1x2x256x64", "1x2x333x64", "1x4x512x64"]))


class _Counted:
    """One kernel's counts; each subclass names the kernel and defines its own
    setup_cache (see the module docstring) as `return self.count_kernel()`."""

    kernel = None
    params = [SHAPES, [False, True]]
    param_names = ["shape", "causal"]
    timeout = 900

    def count_kernel(self):
        if valgrind_missing() or SMOKE:
            return {}
        return count([(self.kernel, s, c) for s in SHAPES for c in (False, True)])

    def setup(self, counts, shape, causal):
        why = valgrind_missing() or (SMOKE and "a smoke run: no counting (Valgrind takes minutes)")
        if why:
            raise NotImplementedError(why)
        key = config_key(self.kernel, shape, causal)
        if key not in counts:  # a setup_cache that counted another kernel: a defect, not a skip
            raise KeyError(f"{key} was not counted; this class's setup_cache counted {sorted(counts)}")
        self.counts = counts[key]
        if "error" in self.counts:
            raise NotImplementedError(self.counts["error"])

    def track_instructions(self, counts, shape, causal):
        return self.counts["Ir"]

    track_instructions.unit = "instructions"

    def track_estimated_cycles(self, counts, shape, causal):
        return estimated_cycles(self.counts)

    track_estimated_cycles.unit = "cycles (Ir + 10 L1 + 100 LL misses)"


class NativeFlash(_Counted):
    kernel = "native.flash"

    def setup_cache(self):
        return self.count_kernel()

    setup_cache.timeout = 900


class NativeTiled(_Counted):
    kernel = "native.tiled"

    def setup_cache(self):
        return self.count_kernel()

    setup_cache.timeout = 900


class NativeNaive(_Counted):
    kernel = "native.naive"

    def setup_cache(self):
        return self.count_kernel()

    setup_cache.timeout = 900


class NumbaFlash(_Counted):
    kernel = "numba.flash"

    def setup_cache(self):
        return self.count_kernel()

    setup_cache.timeout = 900


class NumpyNaive(_Counted):
    kernel = "numpy.naive"

    def setup_cache(self):
        return self.count_kernel()

    setup_cache.timeout = 900
