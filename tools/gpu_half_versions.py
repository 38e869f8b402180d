"""cuda.flash's float16/bfloat16 tensor-core kernel (flash_mma.cu) beside an
older version of it, each checked against float64 and timed against torch's
scaled_dot_product_attention on one GPU.

    python3 tools/gpu_half_versions.py OUT.json [--dims 64,128] [--sizes 4096,8192]
        [--dtypes bfloat16,float16] [--old OLD.cu] [--runs 20] [--library]

Kernels: "cuda.flash", the library's kernel launched directly (kernels.flash_mma_launch,
prepared once, below Numba's dispatcher); "old", with --old, a flash_mma.cu of the
earlier design (4 warps, 64 query rows a block, constants D, BF16 and NAME only), e.g.
`git show 1747707:attnkern/backends/cuda/flash_mma.cu > old.cu`; "attention", with
--library, attnkern.attention(..., kernel="cuda.flash", check_finite=False), the
library's whole call on torch tensors.

Checks, per kernel, head size and dtype: odd shapes (partial blocks, nq != nk, a
negative scale) causal and not, output and log-sum-exp against float64 with the
tolerances of tests/test_triton.py, and two runs bit-identical; at each timed size,
about 256 sampled query rows of every head against float64.

Timing: (1, 16, N, D), causal and not; each sample is a pair of CUDA events around
5 back-to-back calls, 3 warm-up samples, the median of --runs samples; torch's SDPA
on the same tensors. TFLOP/s count 4 B H N^2 D, half that with causal masking. TF32
plays no part (half-precision inputs).
"""

import argparse
import json
import math
import statistics
import sys

import numpy as np
import torch

from attnkern.backends.cuda import arrays, kernels
from attnkern_bench.timing import CudaEventClock

TOL = {"float16": 4e-3, "bfloat16": 3e-2}  # tests/test_triton.py's
ODD = [(6, 77, 77), (1, 45, 130), (4, 200, 33), (2, 1030, 1030), (1, 1, 5), (2, 129, 129)]
BACK_TO_BACK = 5


def flat3(x):
    """A torch tensor (..., n, d) as a GpuArray (batch, n, d)."""
    return arrays.from_torch(x, "x").reshape(math.prod(x.shape[:-2]), *x.shape[-2:])


_OLD = {}


def old_kernel(path, dtype, d):
    """The numba-cuda kernel around an older flash_mma.cu (constants D, BF16, NAME)."""
    key = (path, dtype, d)
    if key not in _OLD:
        from numba import cuda
        from numba.cuda import types as nbtypes

        name = f"attnkern_flash_mma_old_{dtype}_{d}"
        with open(path) as f:
            body = f.read()
        source = "".join(f"#define ATTNKERN_{key} {value}\n"
                         for key, value in {"D": d, "BF16": int(dtype == "bfloat16"), "NAME": name}.items())
        u64, i32 = nbtypes.uint64, nbtypes.int32
        sig = nbtypes.void(u64, u64, u64, u64, u64, i32, i32, nbtypes.float32, i32, i32)
        attend = cuda.declare_device(name, sig, link=[cuda.CUSource(source + body)], abi="c")

        @cuda.jit
        def flash_mma_old(q, k, v, out, lse, nq, nk, scale_log2, causal, with_lse):
            attend(q, k, v, out, lse, nq, nk, scale_log2, causal, with_lse)

        _OLD[key] = flash_mma_old
    return _OLD[key]


class Kernel:
    """The library's tensor-core kernel ("cuda.flash") or an old one ("old")."""

    def __init__(self, name, d, dtype, old_path):
        self.name = name
        if name == "old":
            self.kernel, self.block_q, self.threads = old_kernel(old_path, dtype, d), 64, 128
        else:
            self.kernel = kernels.flash_mma_kernel(dtype, d)
            self.block_q, self.threads = kernels.MMA_BLOCK_Q, kernels.MMA_THREADS

    def launch_args(self, q, k, v, out, lse, causal, scale):
        batch, nq, _ = q.shape
        grid = (-(-nq // self.block_q), batch)
        args = (kernels.Addr(q), kernels.Addr(k), kernels.Addr(v), kernels.Addr(out),
                kernels.Addr(out if lse is None else lse), np.int32(nq), np.int32(k.shape[1]),
                np.float32(scale * kernels.LOG2E), np.int32(bool(causal)), np.int32(lse is not None))
        return grid, args

    def __call__(self, q, k, v, causal, scale, with_lse=True):
        """out (and lse) for torch tensors (..., n, d), through kernels.launch."""
        lead = q.shape[:-2]
        out = torch.empty(*lead, q.shape[-2], v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.empty(*lead, q.shape[-2], dtype=q.dtype, device=q.device) if with_lse else None
        g = [flat3(x) for x in (q, k, v, out)]
        gl = arrays.from_torch(lse, "lse").reshape(g[0].shape[0], q.shape[-2]) if with_lse else None
        grid, args = self.launch_args(*g, gl, causal, scale)
        kernels.launch(self.kernel, grid, self.threads, *args)
        return out, lse

    def prepared(self, q, k, v, out, causal, scale):
        """A launch prepared once (after a first launch compiled the kernel)."""
        self(q, k, v, causal, scale, with_lse=False)
        g = [flat3(x) for x in (q, k, v, out)]
        grid, args = self.launch_args(*g, None, causal, scale)
        return kernels.Prepared(kernels.raw_kernel(self.kernel), grid, self.threads, args)

    def resources(self):
        k = self.kernel
        return {"registers": k.get_regs_per_thread(), "local_bytes": k.get_local_mem_per_thread(),
                "shared_bytes": k.get_shared_mem_per_block()}


def reference(q, k, v, causal, scale, rows=None):
    """out and lse in float64; rows: only these query rows (of every head)."""
    qd = q.double() if rows is None else q.double()[..., rows, :]
    s = (qd @ k.double().transpose(-1, -2)) * scale
    if causal:
        r = torch.arange(q.shape[-2], device=q.device) if rows is None else rows
        s = s.masked_fill(torch.arange(k.shape[-2], device=q.device)[None, :] > r[:, None], float("-inf"))
    return torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)


def err(x, ref, scale_by):
    return float((x.double() - ref).abs().max() / max(1.0, float(scale_by)))


def inputs(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g).to(getattr(torch, dtype)).cuda() for _ in range(3))


def check_odd(kern, d, dtype):
    worst = 0.0
    identical = True
    for i, (bh, nq, nk) in enumerate(ODD):
        g = torch.Generator().manual_seed(100 + i)
        q, k, v = (torch.randn(bh, n, d, generator=g).to(getattr(torch, dtype)).cuda() for n in (nq, nk, nk))
        scale = -0.7 / d**0.5 if i == 1 else 1 / d**0.5
        for causal in (False, True):
            out, lse = kern(q, k, v, causal, scale)
            out2, lse2 = kern(q, k, v, causal, scale)
            identical &= bool(torch.equal(out, out2) and torch.equal(lse, lse2))
            ref, ref_lse = reference(q, k, v, causal, scale)
            worst = max(worst, err(out, ref, v.abs().max()), err(lse, ref_lse, ref_lse.abs().max()))
    return {"odd_error": worst, "odd_ok": worst <= TOL[dtype], "bit_identical": identical}


def event_time(fn, runs):
    """Median seconds per call: 3 warm-up calls, then `runs` samples of BACK_TO_BACK calls
    between CUDA events (attnkern_bench.timing.CudaEventClock)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    clock = CudaEventClock(torch)
    return statistics.median(clock.seconds(fn, BACK_TO_BACK) for _ in range(runs))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--sizes", default="4096,8192")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--old", default=None)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--library", action="store_true")
    a = ap.parse_args()
    import attnkern

    torch.backends.cuda.matmul.allow_tf32 = False
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": a.runs,
              "back_to_back": BACK_TO_BACK, "checks": [], "timings": []}
    sdpa = torch.nn.functional.scaled_dot_product_attention
    names = ["cuda.flash"] + (["old"] if a.old else [])
    for dtype in a.dtypes.split(","):
        for d in (int(x) for x in a.dims.split(",")):
            timed_kernels = []
            for name in names:
                try:
                    kern = Kernel(name, d, dtype, a.old)
                    row = {"kernel": name, "dtype": dtype, "d": d, **check_odd(kern, d, dtype), **kern.resources()}
                except Exception as e:  # a kernel that fails to build or run is reported, not fatal
                    row = {"kernel": name, "dtype": dtype, "d": d, "failed": repr(e)[:500]}
                    kern = None
                print(json.dumps(row), flush=True)
                result["checks"].append(row)
                if kern is not None and row["odd_ok"]:
                    timed_kernels.append(kern)
            for n in (int(x) for x in a.sizes.split(",")):
                q, k, v = inputs((1, 16, n, d), dtype, n + d)
                out = torch.empty_like(q)
                rows = torch.unique(torch.cat([torch.randint(0, n, (250,), generator=torch.Generator().manual_seed(n)),
                                               torch.tensor([0, 1, 2, n - 3, n - 2, n - 1])])).cuda()
                for causal in (False, True):
                    flops = 4 * 16 * n * n * d / (2 if causal else 1)
                    ref, _ = reference(q, k, v, causal, 1 / d**0.5, rows)
                    t = event_time(lambda: sdpa(q, k, v, is_causal=causal), a.runs)
                    base = {"dtype": dtype, "d": d, "n": n, "causal": causal}
                    rows_out = [{**base, "kernel": "torch.sdpa", "seconds": t, "tflops": flops / t / 1e12}]
                    timed = [(kern.name, kern.prepared(q, k, v, out, causal, 1 / d**0.5)) for kern in timed_kernels]
                    if a.library:
                        timed.append(("attention", lambda: attnkern.attention(q, k, v, causal=causal,
                                                                              kernel="cuda.flash",
                                                                              check_finite=False)))
                    for name, fn in timed:
                        out.zero_()
                        fn()
                        torch.cuda.synchronize()
                        got = out if name != "attention" else fn()
                        e = err(got[..., rows, :], ref, v.abs().max())
                        t = event_time(fn, a.runs)
                        rows_out.append({**base, "kernel": name, "seconds": t, "tflops": flops / t / 1e12,
                                         "error": e, "ok": e <= TOL[dtype]})
                    for r in rows_out:
                        r["x_torch"] = rows_out[0]["seconds"] / r["seconds"]
                        print(json.dumps(r), flush=True)
                    result["timings"] += rows_out
            with open(a.out, "w") as f:  # after each head size: a run cut short keeps what it measured
                json.dump(result, f, indent=1)
    print(f"{'dtype':9} {'D':>4} {'N':>6} {'causal':6} {'kernel':14} {'TFLOP/s':>8} {'x torch':>8} {'error':>9}")
    for r in result["timings"]:
        print(f"{r['dtype']:9} {r['d']:4} {r['n']:6} {str(r['causal']):6} {r['kernel']:14} {r['tflops']:8.1f} "
              f"{r['x_torch']:8.2f} {r.get('error', math.nan):9.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
