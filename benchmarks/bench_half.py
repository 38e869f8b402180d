"""Half-precision forward on the CPU: the kernels that take bfloat16 and float16
beside torch's SDPA in the same dtype, at the Forward suite's mid and large shapes.

attnkern's kernels get NumPy arrays (bfloat16 as ml_dtypes.bfloat16); torch's SDPA
gets (1, B*H, N, D) tensors viewing the same memory (its fused CPU kernels take 4-D
inputs), in torch.no_grad() as attnkern's kernels do. Skipped (NotImplementedError)
for a kernel a commit lacks or that does not take the dtype, and for bfloat16 without
ml_dtypes."""

import numpy as np

import attnkern

from .common import THREADS, axis, host_dtype, random_qkv, setup_kernel, torch


class ForwardHalf:
    """bfloat16 and float16 forward, with the instruction set each commit picks on this CPU."""

    params = [
        ["native.flash", "native.tiled", "torch.sdpa"],
        axis(["1x8x1024x64", "1x8x4096x64"]),
        ["bfloat16", "float16"],
        [False, True],
    ]
    param_names = ["kernel", "shape", "dtype", "causal"]
    rounds = 2
    repeat = (2, 10, 2.0)
    warmup_time = 0.2
    timeout = 180

    def setup(self, kernel, shape, dtype, causal):
        q, k, v = random_qkv(shape, np.float32)
        host = host_dtype(dtype)
        q, k, v = (x.astype(host) for x in (q, k, v))
        if kernel == "torch.sdpa":
            if torch is None:
                raise NotImplementedError("torch is not installed")
            setup_kernel("torch.sdpa")  # pins BLAS and torch threads; NotImplementedError where unavailable
            tdtype = getattr(torch, dtype)

            def as_torch(x):
                t = torch.from_numpy(x.view(np.int16)).view(tdtype) if dtype == "bfloat16" else torch.from_numpy(x)
                return t.reshape(1, -1, *x.shape[-2:])

            sdpa = torch.nn.functional.scaled_dot_product_attention
            self.args = tuple(as_torch(x) for x in (q, k, v))

            def call(q, k, v, c):
                with torch.no_grad():
                    return sdpa(q, k, v, is_causal=c)

            self.call = call
        else:
            self.call = setup_kernel(kernel)
            if dtype not in attnkern.kernel_info(kernel).get("dtypes", ["float32", "float64"]):
                raise NotImplementedError(f"{kernel} does not take {dtype} in this commit")
            self.args = (q, k, v)

    def time_forward(self, kernel, shape, dtype, causal):
        self.call(*self.args, causal)


class ForwardHalfIsa:
    """native.flash in bfloat16 and float16 on each instruction set this CPU has
    (ATTNKERN_ISA): the vdpbf16ps path against the converting ones."""

    params = [["generic", "avx2", "avx512", "avx512bf16"], ["bfloat16", "float16"], [False, True]]
    param_names = ["isa", "dtype", "causal"]
    rounds = 2
    repeat = (2, 10, 2.0)
    warmup_time = 0.2
    timeout = 180
    shape = "1x8x1024x64"

    def setup(self, isa, dtype, causal):
        import os

        if isa not in getattr(attnkern, "supported_isas", lambda: ())():
            raise NotImplementedError(f"{isa} is not supported by this commit or CPU")
        os.environ["ATTNKERN_ISA"] = isa  # asv runs each benchmark in its own process
        self.call = setup_kernel("native.flash", THREADS)
        if dtype not in attnkern.kernel_info("native.flash").get("dtypes", ["float32", "float64"]):
            raise NotImplementedError(f"native.flash does not take {dtype} in this commit")
        host = host_dtype(dtype)
        self.q, self.k, self.v = (x.astype(host) for x in random_qkv(self.shape, np.float32))

    def teardown(self, isa, dtype, causal):
        import os

        os.environ.pop("ATTNKERN_ISA", None)

    def time_forward(self, isa, dtype, causal):
        self.call(self.q, self.k, self.v, causal)
