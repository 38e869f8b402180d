"""cuda.flash, triton.flash and torch's SDPA on one GPU: per-call overhead, the small grid, the large rows
(docs/results.md quotes them).

    python3 dev/gpu_half_measure.py OUT.json [--parts overhead,small,large] [--quick]
        [--kernels cuda.flash,triton.flash,torch.sdpa] [--dtypes float32,bfloat16,float16]
        [--dims 64,128] [--batches 1,2,4,8] [--large-dtypes float32]

--kernels, --dtypes: what each part times (torch.sdpa is every row's baseline); a kernel
    named NAME/general runs NAME through attention()'s general path, with the fast path for
    torch tensors (attnkern.backends.cuda.FAST_PATH) off, and NAME[BQxBK] runs it with
    block_q=BQ, block_k=BK. --dims: large's head sizes;
    --batches: small's (default 1, 2, 4, 8; --quick: 1 and 8); --large-dtypes: large's
    dtypes (default --dtypes).

overhead: per-call time through attnkern.attention at (1, 8, 16, 64) on device-resident
    torch tensors: wall clock over 300 back-to-back calls after 30 warm-up calls, then
    one synchronize (the GPU work of a call at N = 16 is a few microseconds, so this is
    the host's time per call), for check_finite False and True; torch's SDPA beside it.
    With a cProfile of cuda.flash's calls (the 12 largest cumulative entries).
small: the grid N 64-512, batch 1-8, 8 heads, D 64, float32/bfloat16/float16, causal and
    not: 5 warm-up calls, then 50 calls of each kernel timed each alone between two CUDA
    events, the kernels in turns (one call of each, then the next round), medians;
    memory: peak torch allocation during one call beyond the inputs; correctness: max
    |out - ref| / max(1, max|v|) against float64 on the same (rounded) inputs.
large: (1, 16, N, D) N 4096 and 8192, D 64 and 128, the same dtypes, causal and not:
    3 warm-up calls, 10 calls timed each between CUDA events, medians, TFLOP/s counting
    4 B H N^2 D (half with causal).
TF32 is off for torch. attnkern's kernels run with check_finite=False except where noted.
"""

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import torch

import attnkern

KERNELS = ("cuda.flash", "triton.flash", "torch.sdpa")
DTYPES = ("float32", "bfloat16", "float16")


def caller(kernel, causal, check_finite=False):
    if kernel == "torch.sdpa":
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return lambda q, k, v: sdpa(q, k, v, is_causal=causal)
    if kernel.endswith("/general"):  # the fast path for torch tensors off
        from attnkern.backends import cuda as backend

        name = kernel.partition("/")[0]

        def general(q, k, v):
            backend.FAST_PATH = False
            try:
                return attnkern.attention(q, k, v, causal=causal, kernel=name, check_finite=check_finite)
            finally:
                backend.FAST_PATH = True

        return general
    if kernel.endswith("]"):  # NAME[BQxBK]: cuda.flash with block_q=BQ, block_k=BK
        name, _, tile = kernel[:-1].partition("[")
        bq, bk = (int(x) for x in tile.split("x"))
        return lambda q, k, v: attnkern.attention(q, k, v, causal=causal, kernel=name, check_finite=check_finite,
                                                  block_q=bq, block_k=bk)
    return lambda q, k, v: attnkern.attention(q, k, v, causal=causal, kernel=kernel, check_finite=check_finite)


def inputs(b, h, n, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g).to(getattr(torch, dtype)).cuda() for _ in range(3))


def error(out, q, k, v, causal):
    s = (q.double() @ k.double().transpose(-1, -2)) / q.shape[-1] ** 0.5
    if causal:
        nq, nk = s.shape[-2:]
        s = s.masked_fill(torch.ones(nq, nk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    ref = torch.softmax(s, -1) @ v.double()
    return float((out.double() - ref).abs().max() / max(1.0, float(v.abs().max())))


def event_sample(fn):
    """Seconds of one call between two CUDA events, waited for."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1e-3


def event_times(fn, warmup, runs):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return statistics.median(event_sample(fn) for _ in range(runs))


def overhead(result, kernels, dtypes):
    rows = []
    for dtype in dtypes:
        q, k, v = inputs(1, 8, 16, 64, dtype)
        for kernel in kernels:
            for check in ((False, True) if kernel != "torch.sdpa" else (False,)):
                f = caller(kernel, False, check)
                try:
                    for _ in range(30):
                        f(q, k, v)
                    torch.cuda.synchronize()
                    samples = []
                    for _ in range(5):
                        t0 = time.perf_counter()
                        for _ in range(300):
                            f(q, k, v)
                        torch.cuda.synchronize()
                        samples.append((time.perf_counter() - t0) / 300)
                    row = {"kernel": kernel, "dtype": dtype, "check_finite": check,
                           "us_per_call": statistics.median(samples) * 1e6,
                           "event_us_isolated": event_times(lambda: f(q, k, v), 5, 50) * 1e6}
                except Exception as exc:
                    row = {"kernel": kernel, "dtype": dtype, "check_finite": check, "failed": repr(exc)[:300]}
                print(row, flush=True)
                rows.append(row)
    result["overhead"] = rows
    q, k, v = inputs(1, 8, 16, 64, "float32")
    f = caller("cuda.flash", False)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        f(q, k, v)
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(14)
    result["profile_cuda_flash_float32"] = text.getvalue()[-6000:]
    print(text.getvalue()[-3000:], flush=True)


def small(result, quick, kernels, dtypes, batches):
    rows = []
    for dtype in dtypes:
        for causal in (False, True):
            for n in (64, 128, 256, 512):
                for b in batches or ((1, 8) if quick else (1, 2, 4, 8)):
                    q, k, v = inputs(b, 8, n, 64, dtype, seed=n + b)
                    base, timed = {}, {}
                    for kernel in kernels:
                        f = caller(kernel, causal)
                        row = {"kernel": kernel, "dtype": dtype, "causal": causal, "b": b, "h": 8, "n": n, "d": 64}
                        try:
                            out = f(q, k, v)
                            row["error"] = error(out, q, k, v, causal)
                            del out
                            torch.cuda.synchronize()
                            torch.cuda.reset_peak_memory_stats()
                            before = torch.cuda.memory_allocated()
                            f(q, k, v)
                            torch.cuda.synchronize()
                            row["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - before
                            for _ in range(5):
                                f(q, k, v)
                            timed[kernel] = (row, lambda f=f: f(q, k, v), [])
                        except Exception as exc:
                            row["failed"] = repr(exc)[:300]
                        rows.append(row)
                    # isolated calls, one of each kernel in turns (host and GPU states drift over
                    # seconds on a shared machine: in turns each ratio compares like with like)
                    for _ in range(50):
                        for _, call, samples in timed.values():
                            samples.append(event_sample(call))
                    for kernel, (row, _, samples) in timed.items():
                        row["median_s"] = base[kernel] = statistics.median(samples)
                    for row in rows[-len(kernels):]:
                        if "median_s" in row and "torch.sdpa" in base:
                            row["speedup_vs_torch"] = base["torch.sdpa"] / row["median_s"]
                    print([(r["kernel"], r.get("median_s"), r.get("speedup_vs_torch"), r.get("error"),
                            r.get("failed")) for r in rows[-len(kernels):]], dtype, causal, n, b, flush=True)
    result["small"] = rows


def large(result, quick, kernels, dtypes, dims):
    rows = []
    for dtype in dtypes:
        for d in dims:
            for n in ((4096,) if quick else (4096, 8192)):
                for causal in (False, True):
                    q, k, v = inputs(1, 16, n, d, dtype, seed=n + d)
                    flops = 4 * 16 * n * n * d / (2 if causal else 1)
                    base = {}
                    for kernel in kernels:
                        f = caller(kernel, causal)
                        row = {"kernel": kernel, "dtype": dtype, "causal": causal, "b": 1, "h": 16, "n": n, "d": d}
                        try:
                            out = f(q[:, :, :1024].contiguous(), k, v)  # a sample of rows against float64
                            row["error"] = error(out[:, :2, :256], q[:, :2, :256], k[:, :2], v[:, :2], causal)
                            del out
                            row["median_s"] = event_times(lambda: f(q, k, v), 3, 10)
                            row["tflops"] = flops / row["median_s"] / 1e12
                            base[kernel] = row["median_s"]
                        except Exception as exc:
                            row["failed"] = repr(exc)[:300]
                        rows.append(row)
                    for row in rows[-len(kernels):]:
                        if "median_s" in row and "torch.sdpa" in base:
                            row["speedup_vs_torch"] = base["torch.sdpa"] / row["median_s"]
                    print([(r["kernel"], round(r.get("tflops", 0), 1), r.get("speedup_vs_torch"), r.get("failed"))
                           for r in rows[-len(kernels):]], dtype, d, n, causal, flush=True)
                    torch.cuda.empty_cache()
    result["large"] = rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--parts", default="overhead,small,large")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--kernels", default=",".join(KERNELS))
    p.add_argument("--dtypes", default=",".join(DTYPES))
    p.add_argument("--dims", default="64,128")
    p.add_argument("--batches", default="")
    p.add_argument("--large-dtypes", default="")
    args = p.parse_args()
    kernels, dtypes = args.kernels.split(","), args.dtypes.split(",")
    dims, batches = [int(x) for x in args.dims.split(",")], [int(x) for x in args.batches.split(",") if x]
    large_dtypes = args.large_dtypes.split(",") if args.large_dtypes else dtypes
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv)}
    parts = args.parts.split(",")
    for part in parts:
        t0 = time.time()
        {"overhead": lambda: overhead(result, kernels, dtypes),
         "small": lambda: small(result, args.quick, kernels, dtypes, batches),
         "large": lambda: large(result, args.quick, kernels, large_dtypes, dims)}[part]()
        result[f"{part}_wall_s"] = time.time() - t0
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
