"""Forward + backward (one training step of attention) and its peak memory: the
flash kernels with a backward against torch's SDPA and torch's naive attention
(autograd through materialised scores). Commits before the backward, or kernels
without one, are skipped."""

import attnkern

from .common import THREADS, axis, pin_threads, random_qkv, torch

TORCH_PEERS = ("torch.sdpa", "torch.naive")


def _step(kernel: str, causal: bool, device: str):
    """A function (q, k, v, grad) -> None running forward and backward once."""
    if torch is None:
        raise NotImplementedError("torch is not installed")
    if kernel in TORCH_PEERS:
        def forward(q, k, v):
            if kernel == "torch.sdpa":
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
            if causal:
                n = s.shape[-1]
                s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
            return torch.softmax(s, dim=-1) @ v
    else:
        if kernel not in attnkern.kernels() or not attnkern.kernel_info(kernel).get("backward"):
            raise NotImplementedError(f"{kernel} has no backward in this commit")
        info = attnkern.kernel_info(kernel)
        if not info["available"]:
            raise NotImplementedError(f"{kernel} is not available here: {info['reason']}")
        params = {"num_threads": THREADS} if "num_threads" in info["params"] else {}

        def forward(q, k, v):
            return attnkern.attention(q, k, v, causal=causal, kernel=kernel, check_finite=False, **params)

    def step(q, k, v, grad):
        forward(q, k, v).backward(grad)

    return step


class TrainingStep:
    """float32 forward + backward on the CPU, inputs requiring grad."""

    params = [["native.flash", "torch.sdpa", "torch.naive"], axis(["1x8x512x64", "1x8x1024x64"]), [False, True]]
    param_names = ["kernel", "shape", "causal"]
    rounds = 2
    repeat = (2, 10, 2.0)
    timeout = 180

    def setup(self, kernel, shape, causal):
        self.step = _step(kernel, causal, "cpu")
        pin_threads()
        self.q, self.k, self.v = (torch.from_numpy(x).requires_grad_() for x in random_qkv(shape))
        self.grad = torch.from_numpy(random_qkv(shape, seed=1)[0])

    def time_forward_backward(self, kernel, shape, causal):
        self.step(self.q, self.k, self.v, self.grad)

    def peakmem_forward_backward(self, kernel, shape, causal):
        self.step(self.q, self.k, self.v, self.grad)


class TrainingStepCuda:
    """The same on the GPU (skipped without one), float32, TF32 off."""

    params = [["cuda.flash", "torch.sdpa", "torch.naive"], axis(["1x16x1024x64", "1x16x4096x64"]), [False, True]]
    param_names = ["kernel", "shape", "causal"]
    rounds = 2
    repeat = (3, 20, 2.0)
    warmup_time = 0.5
    timeout = 300

    def setup(self, kernel, shape, causal):
        if torch is None or not torch.cuda.is_available():
            raise NotImplementedError("no CUDA GPU")
        self.step = _step(kernel, causal, "cuda")
        torch.backends.cuda.matmul.allow_tf32 = False
        self.q, self.k, self.v = (torch.from_numpy(x).cuda().requires_grad_() for x in random_qkv(shape))
        self.grad = torch.from_numpy(random_qkv(shape, seed=1)[0]).cuda()

    def time_forward_backward(self, kernel, shape, causal):
        self.step(self.q, self.k, self.v, self.grad)
        torch.cuda.synchronize()

    def track_peak_gpu_mib(self, kernel, shape, causal):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        self.step(self.q, self.k, self.v, self.grad)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    track_peak_gpu_mib.unit = "MiB beyond the inputs"




class BackwardGpu:
    """Forward + backward per dtype on the GPU at (1, 16, 4096, D): cuda.flash (float16/bfloat16
    on tensor cores, flash_bwd_mma.cu; float32 Numba), triton.flash and torch's SDPA (its default
    backend). Skipped without a CUDA GPU, and for a kernel whose backward a commit lacks in the dtype."""

    params = [["cuda.flash", "triton.flash", "torch.sdpa"], axis(["1x16x4096x64", "1x16x4096x128"]),
              ["bfloat16", "float16", "float32"], [False, True]]
    param_names = ["kernel", "shape", "dtype", "causal"]
    rounds = 2
    repeat = (3, 20, 2.0)
    warmup_time = 0.5
    timeout = 300

    def setup(self, kernel, shape, dtype, causal):
        if torch is None or not torch.cuda.is_available():
            raise NotImplementedError("no CUDA GPU")
        if kernel not in TORCH_PEERS:
            info = attnkern.kernel_info(kernel) if kernel in attnkern.kernels() else {}
            if dtype not in info.get("backward_dtypes", []):
                raise NotImplementedError(f"{kernel}'s backward does not take {dtype} in this commit")
        self.step = _step(kernel, causal, "cuda")
        torch.backends.cuda.matmul.allow_tf32 = False
        tdtype = getattr(torch, dtype)
        self.q, self.k, self.v = (torch.from_numpy(x).cuda().to(tdtype).requires_grad_() for x in random_qkv(shape))
        self.grad = torch.from_numpy(random_qkv(shape, seed=1)[0]).cuda().to(tdtype)
        self.step(self.q, self.k, self.v, self.grad)  # compile outside the samples

    def time_forward_backward(self, kernel, shape, dtype, causal):
        self.step(self.q, self.k, self.v, self.grad)
        torch.cuda.synchronize()
