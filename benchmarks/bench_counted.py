"""Counted cost: instructions executed (and a cycle estimate from simulated
cache misses) by one single-threaded call of each CPU kernel, under Valgrind's
callgrind (see counting.py). Identical code gives identical counts run after
run, so the site's regressions page can flag 1% steps here, where the timings'
drift on a shared 2-core machine hides 10-30% ones.

All configurations are counted in one Valgrind run in `setup_cache` (asv runs it
once per environment and hands its result to every benchmark): importing NumPy
and Numba under Valgrind takes most of a minute, a kernel call seconds. Counted
on Valgrind's view of the CPU: AVX2, not AVX-512 (counting.py says why)."""

from .common import CPU_KERNELS
from .counting import count, config_key, estimated_cycles, valgrind_missing

# torch's kernels are PyTorch's code, not ours: timed elsewhere, not counted.
KERNELS = [k for k in CPU_KERNELS if not k.startswith("torch.")]
# Small shapes (Valgrind runs 50-100x slower than the CPU); 333 is odd on purpose:
# no block or vector width divides it, so the remainder paths are counted too.
SHAPES = ["1x2x256x64", "1x2x333x64", "1x4x512x64"]


class Counted:
    params = [KERNELS, SHAPES, [False, True]]
    param_names = ["kernel", "shape", "causal"]
    timeout = 1800  # setup_cache: every configuration under Valgrind

    def setup_cache(self):
        if valgrind_missing():
            return {}
        return count([(k, s, c) for k in KERNELS for s in SHAPES for c in (False, True)])

    setup_cache.timeout = 1800

    def setup(self, counts, kernel, shape, causal):
        why = valgrind_missing()
        if why:
            raise NotImplementedError(why)
        self.counts = counts[config_key(kernel, shape, causal)]
        if "error" in self.counts:
            raise NotImplementedError(self.counts["error"])

    def track_instructions(self, counts, kernel, shape, causal):
        return self.counts["Ir"]

    track_instructions.unit = "instructions"

    def track_estimated_cycles(self, counts, kernel, shape, causal):
        return estimated_cycles(self.counts)

    track_estimated_cycles.unit = "cycles (Ir + 10 L1 + 100 LL misses)"
