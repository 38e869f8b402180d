"""Counted cost: instructions executed (and a cycle estimate from simulated
cache misses) by one single-threaded call of each CPU kernel, under Valgrind's
callgrind (see counting.py). Identical code gives identical counts run after
run, so the site's regressions page can flag 1% steps here, where the timings'
drift on a shared 2-core machine hides 10-30% ones.

Every configuration of every kernel is counted in one Valgrind run, in the one
`setup_cache` the classes share: asv keys a setup_cache by its source location,
so the five classes, which inherit `_Counted.setup_cache`, get one cache between
them, computed once per environment. It therefore holds every kernel's counts,
and each class reads its own. One run, not one per kernel, because importing
NumPy and Numba under Valgrind takes most of a minute and a kernel call seconds.
Counted on Valgrind's view of the CPU: AVX2, not AVX-512 (counting.py says why)."""

from .counting import config_key, count, estimated_cycles, valgrind_missing

# torch's kernels are PyTorch's code, not ours: timed elsewhere, not counted.
# Small shapes (Valgrind runs 50-100x slower than the CPU); 333 is odd on purpose:
# no block or vector width divides it, so the remainder paths are counted too.
SHAPES = ["1x2x256x64", "1x2x333x64", "1x4x512x64"]
KERNELS = ["native.flash", "native.tiled", "native.naive", "numba.flash", "numpy.naive"]


class _Counted:
    """One kernel's counts; subclasses name the kernel (one class per kernel, so the
    site groups a kernel's graphs and `asv run -b NativeFlash` shows one kernel's;
    the shared setup_cache counts all of them either way)."""

    kernel = None
    params = [SHAPES, [False, True]]
    param_names = ["shape", "causal"]
    timeout = 900

    def setup_cache(self):
        if valgrind_missing():
            return {}
        return count([(k, s, c) for k in KERNELS for s in SHAPES for c in (False, True)])

    setup_cache.timeout = 1800

    def setup(self, counts, shape, causal):
        why = valgrind_missing()
        if why:
            raise NotImplementedError(why)
        key = config_key(self.kernel, shape, causal)
        if key not in counts:  # a setup_cache that counted other kernels: a defect, not a skip
            raise KeyError(f"{key} was not counted; the shared setup_cache counted {sorted(counts)}")
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


class NativeTiled(_Counted):
    kernel = "native.tiled"


class NativeNaive(_Counted):
    kernel = "native.naive"


class NumbaFlash(_Counted):
    kernel = "numba.flash"


class NumpyNaive(_Counted):
    kernel = "numpy.naive"
