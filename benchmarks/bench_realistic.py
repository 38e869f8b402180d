"""Kernels on realistic inputs: q, k, v captured from all-MiniLM-L6-v2's 6 layers x
12 heads (D = 32) on Python's documentation text, N = 512 tokens
(attnkern_bench.realistic). Skipped on commits without it or where the packaged
model is not installed."""

import numpy as np

import attnkern

from .common import CPU_KERNELS, setup_kernel


def _captured(n: int = 512):
    try:
        from attnkern_bench.realistic import capture

        return capture(n)
    except (ImportError, RuntimeError) as exc:
        raise NotImplementedError(f"no realistic inputs here: {exc}") from None


class ForwardRealistic:
    params = [CPU_KERNELS, [False, True]]
    param_names = ["kernel", "causal"]
    rounds = 2
    repeat = (2, 10, 2.0)
    timeout = 180

    def setup(self, kernel, causal):
        captured = _captured()
        self.call = setup_kernel(kernel)
        self.q, self.k, self.v = (np.ascontiguousarray(captured[x]) for x in "qkv")

    def time_forward(self, kernel, causal):
        self.call(self.q, self.k, self.v, causal)


class AccuracyRealistic:
    """max |out - ref| / max |ref| against the float64 reference on the captured inputs."""

    params = [CPU_KERNELS, [False, True]]
    param_names = ["kernel", "causal"]
    rounds = 1
    timeout = 120

    def setup(self, kernel, causal):
        captured = _captured()
        self.call = setup_kernel(kernel)
        self.q, self.k, self.v = (np.ascontiguousarray(captured[x]) for x in "qkv")
        self.ref = attnkern.reference(self.q, self.k, self.v, causal=causal)

    def track_relative_error(self, kernel, causal):
        out = np.asarray(self.call(self.q, self.k, self.v, causal), dtype=np.float64)
        return float(np.max(np.abs(out - self.ref)) / np.max(np.abs(self.ref)))

    track_relative_error.unit = "max abs err / max |ref|"
