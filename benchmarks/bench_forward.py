"""Forward time of every kernel over shapes, dtypes and causal masking."""

import numpy as np

import attnkern

from .common import CPU_KERNELS, CUDA_KERNELS, THREADS, axis, kernel_call, random_qkv, setup_kernel, torch


class Forward:
    """float32 forward, (B, H, N, D) from small (call overhead) to large (compute bound)."""

    params = [
        CPU_KERNELS,
        axis(["1x1x128x64", "1x8x1024x64", "1x4x1024x128", "1x8x4096x64"]),
        [False, True],
    ]
    param_names = ["kernel", "shape", "causal"]
    # 2 rounds x 2..10 samples, at most ~2 s of samples per round: the naive
    # kernels at N=4096 take 1-3 s a call on 2 cores, flash ~20 ms at N=1024.
    rounds = 2
    repeat = (2, 10, 2.0)
    warmup_time = 0.2
    timeout = 180
    dtype = np.float32

    def setup(self, kernel, shape, causal):
        self.call = setup_kernel(kernel)
        self.q, self.k, self.v = random_qkv(shape, self.dtype)
        if kernel.startswith("numba."):  # compile (or load from Numba's cache) outside the samples
            self.call(self.q[..., :8, :], self.k[..., :8, :], self.v[..., :8, :], causal)

    def time_forward(self, kernel, shape, causal):
        self.call(self.q, self.k, self.v, causal)


class ForwardFloat64(Forward):
    """float64 forward at one mid-size shape."""

    params = [CPU_KERNELS, ["1x8x1024x64"], [False, True]]
    dtype = np.float64
    timeout = 120


class ForwardCuda:
    """GPU kernels on arrays already on the device (no host copies), float32.
    Kernel launches are asynchronous: each sample waits for the GPU to finish."""

    params = [CUDA_KERNELS, axis(["1x16x1024x64", "1x16x4096x64"]), [False, True]]
    param_names = ["kernel", "shape", "causal"]
    rounds = 2
    repeat = (3, 20, 2.0)
    warmup_time = 0.5  # the first call compiles the kernel
    timeout = 300

    def setup(self, kernel, shape, causal):
        self.call = kernel_call(kernel)  # NotImplementedError (skip) without a GPU
        from numba import cuda

        self.sync = cuda.synchronize
        self.q, self.k, self.v = (cuda.to_device(x) for x in random_qkv(shape))

    def time_forward(self, kernel, shape, causal):
        self.call(self.q, self.k, self.v, causal)
        self.sync()


class ForwardGpu:
    """cuda.flash, triton.flash and torch's SDPA side by side on torch CUDA tensors, float32 (TF32
    off) and half precision, from a small batch of short sequences (launch overhead) to long ones;
    attnkern's kernels with check_finite=False, as torch checks nothing. Skipped without a CUDA GPU,
    and for a kernel a commit lacks or that does not take the dtype."""

    params = [["cuda.flash", "triton.flash", "torch.sdpa"], axis(["4x8x256x64", "1x16x1024x64", "1x16x4096x64"]),
              ["float32", "bfloat16", "float16"], [False, True]]
    param_names = ["kernel", "shape", "dtype", "causal"]
    rounds = 2
    repeat = (3, 20, 2.0)
    warmup_time = 0.5  # the first call compiles the kernel (and autotunes triton.flash's with ATTNKERN_TRITON_AUTOTUNE=1)
    timeout = 300

    def setup(self, kernel, shape, dtype, causal):
        gpu_setup(self, kernel, shape, dtype, causal)

    def time_forward(self, kernel, shape, dtype, causal):
        self.call(self.q, self.k, self.v, causal)
        torch.cuda.synchronize()


class ForwardGpuHeads(ForwardGpu):
    """cuda.flash and torch's SDPA at head sizes 128 and 256 in bfloat16 (on Hopper flash_wgmma.cu's
    warp-specialized kernel, 64-key tiles at 256), as ForwardGpu times them."""

    params = [["cuda.flash", "torch.sdpa"], axis(["1x16x4096x128", "1x16x4096x256"]), ["bfloat16"], [False, True]]


def gpu_setup(bench, kernel, shape, dtype, causal, **params):
    """bench.call(q, k, v, causal) for `kernel` (attnkern's with check_finite=False, as
    torch checks nothing; params its tunables) and bench.q, k, v, torch CUDA tensors of
    `shape` in `dtype`, the kernel compiled by one call; NotImplementedError (asv's skip)
    without a CUDA GPU or where a commit lacks the kernel, the dtype or a tunable."""
    if torch is None or not torch.cuda.is_available():
        raise NotImplementedError("no CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    if kernel == "torch.sdpa":
        sdpa = torch.nn.functional.scaled_dot_product_attention
        bench.call = lambda q, k, v, c: sdpa(q, k, v, is_causal=c)
    else:
        kernel_call(kernel, **params)  # NotImplementedError (skip) where missing or unavailable
        if dtype not in attnkern.kernel_info(kernel).get("dtypes", ["float32", "float64"]):
            raise NotImplementedError(f"{kernel} does not take {dtype} in this commit")
        bench.call = lambda q, k, v, c: attnkern.attention(q, k, v, causal=c, kernel=kernel, check_finite=False,
                                                           **params)
    bench.q, bench.k, bench.v = (torch.from_numpy(x).cuda().to(getattr(torch, dtype)) for x in random_qkv(shape))
    bench.call(bench.q, bench.k, bench.v, causal)  # compile (and any autotuning) outside the samples
    torch.cuda.synchronize()


class ForwardGpuFp8:
    """cuda.flash's FP8 (e4m3) forward on Hopper at D = 128 beside its bfloat16 forward and torch's
    SDPA in bfloat16: q, k, v quantized once in setup (quantize_fp8, per-tensor descales kept on
    the GPU), then attention() on them each call (V's transpose included, as a user pays it).
    Skipped without a Hopper GPU, in commits without FP8, and for torch in FP8 (it has none)."""

    params = [["cuda.flash", "torch.sdpa"], axis(["1x16x4096x128", "1x16x16384x128"]),
              ["float8_e4m3fn", "bfloat16"], [False, True]]
    param_names = ["kernel", "shape", "dtype", "causal"]
    rounds = 2
    repeat = (3, 20, 2.0)
    warmup_time = 0.5
    timeout = 300

    def setup(self, kernel, shape, dtype, causal):
        if dtype == "bfloat16":
            gpu_setup(self, kernel, shape, dtype, causal)
            return
        if kernel != "cuda.flash":
            raise NotImplementedError(f"{kernel} takes no FP8")
        if torch is None or not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
            raise NotImplementedError("FP8 attention needs a Hopper GPU")
        if not hasattr(attnkern, "quantize_fp8"):
            raise NotImplementedError("this commit has no FP8 forward")
        q, k, v = (torch.from_numpy(x).cuda().to(torch.bfloat16) for x in random_qkv(shape))
        r = attnkern.quantize_fp8(q, k, v, device_scales=True)
        self.q, self.k, self.v = r[:3]
        kw = r.kwargs()
        self.call = lambda q, k, v, c: attnkern.attention(q, k, v, causal=c, kernel="cuda.flash",
                                                          check_finite=False, **kw)
        self.call(self.q, self.k, self.v, causal)
        torch.cuda.synchronize()

    def time_forward(self, kernel, shape, dtype, causal):
        self.call(self.q, self.k, self.v, causal)
        torch.cuda.synchronize()


class DecodeGpu:
    """Decode on the GPU, as ForwardGpu but with a KV cache's shapes, which its q = k = v
    shape axis cannot name: Nq query rows per head of H heads over H_kv k/v heads of Nk keys
    ("BxHxH_kvxNqxNkxD"), bfloat16, causal="bottom_right" (torch: enable_gqa=True; at Nq = 1
    bottom-right masks nothing); cuda.flash and triton.flash take their split-K decode paths.
    dev/gpu_decode_measure.py times more shapes and every SDPA backend. Skipped without a CUDA
    GPU, and for a kernel a commit lacks."""

    params = [["cuda.flash", "triton.flash", "torch.sdpa"], axis(["1x32x8x1x16384x128", "8x32x8x1x131072x128"])]
    param_names = ["kernel", "shape"]
    rounds = 2
    repeat = (3, 20, 2.0)
    warmup_time = 0.5
    timeout = 300

    def setup(self, kernel, shape):
        if torch is None or not torch.cuda.is_available():
            raise NotImplementedError("no CUDA GPU")
        b, h, h_kv, nq, nk, d = (int(x) for x in shape.split("x"))
        if kernel == "torch.sdpa":
            sdpa = torch.nn.functional.scaled_dot_product_attention
            self.call = lambda q, k, v: sdpa(q, k, v, is_causal=nq > 1, enable_gqa=True)
        else:
            kernel_call(kernel)  # NotImplementedError (skip) where missing or unavailable
            self.call = lambda q, k, v: attnkern.attention(q, k, v, causal="bottom_right", kernel=kernel,
                                                           check_finite=False)
        g = torch.Generator(device="cuda").manual_seed(0)
        self.q, self.k, self.v = (torch.randn(b, heads, n, d, device="cuda", generator=g, dtype=torch.bfloat16)
                                  for heads, n in ((h, nq), (h_kv, nk), (h_kv, nk)))
        self.call(self.q, self.k, self.v)
        torch.cuda.synchronize()

    def time_decode(self, kernel, shape):
        self.call(self.q, self.k, self.v)
        torch.cuda.synchronize()


class Float32GpuPaths:
    """float32 on the GPU with and without tensor cores: cuda.flash's 3xTF32 kernel
    (tensor_cores=1) against its float32 FMA kernel (0), triton.flash's 3xTF32 against its
    exact float32 products, torch's SDPA beside them (TF32 off). Skipped without a CUDA GPU
    and where a commit lacks the kernel or the tunable."""

    params = [["cuda.flash", "triton.flash", "torch.sdpa"], [1, 0], axis(["1x16x4096x64", "1x16x4096x128"]),
              [False, True]]
    param_names = ["kernel", "tensor_cores", "shape", "causal"]
    rounds = 2
    repeat = (3, 10, 2.0)
    warmup_time = 0.5
    timeout = 300

    def setup(self, kernel, tensor_cores, shape, causal):
        if kernel == "torch.sdpa" and not tensor_cores:
            raise NotImplementedError("torch's float32 SDPA has one path (3xTF32 on these GPUs)")
        gpu_setup(self, kernel, shape, "float32", causal,
                  **({} if kernel == "torch.sdpa" else {"tensor_cores": tensor_cores}))

    def time_forward(self, kernel, tensor_cores, shape, causal):
        self.call(self.q, self.k, self.v, causal)
        torch.cuda.synchronize()


class BlockSweep:
    """Tunables of the blocked kernels: block_q x block_k x num_threads."""

    params = [
        ["native.flash", "native.tiled"],
        axis(["1x8x1024x64", "1x2x2048x64"]),
        axis([32, 128, 256]),
        axis([64, 256, 1024]),
        axis(sorted({1, THREADS})),
    ]
    param_names = ["kernel", "shape", "block_q", "block_k", "num_threads"]
    # 72 combinations of 20-80 ms calls: ~1 s of samples per round each.
    rounds = 2
    repeat = (3, 10, 1.0)
    warmup_time = 0.1
    timeout = 120

    def setup(self, kernel, shape, block_q, block_k, num_threads):
        self.call = setup_kernel(kernel, num_threads, block_q=block_q, block_k=block_k)
        self.q, self.k, self.v = random_qkv(shape)

    def time_forward(self, kernel, shape, block_q, block_k, num_threads):
        self.call(self.q, self.k, self.v)
