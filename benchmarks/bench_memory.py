"""Peak memory at growing N: the N x N score matrix of the naive kernels against
the O(N) working set of flash attention.

asv's peakmem is the benchmark process's maximum resident set, inputs included:
(1, 1, N, 64) float32 inputs and output take 1 MiB at N=1024, 16 MiB at 16384,
while a float32 N x N score matrix takes 4 MiB and 1 GiB."""

from .common import CPU_KERNELS, axis, random_qkv, setup_kernel


class PeakMemory:
    params = [CPU_KERNELS, axis([1024, 4096, 16384])]
    param_names = ["kernel", "n"]
    timeout = 180

    def setup(self, kernel, n):
        self.call = setup_kernel(kernel)
        self.q, self.k, self.v = random_qkv(f"1x1x{n}x64")

    def peakmem_forward(self, kernel, n):
        self.call(self.q, self.k, self.v)
