"""triton.flash on one GPU against torch's SDPA in the same process: per-call time at a tiny
shape, and forward+backward time at long sequences.

    python3 dev/triton_measure.py [--parts overhead,backward] [--quick]

overhead: attnkern.attention(kernel="triton.flash") on device-resident torch tensors at
    (1, 8, 16, 64), bfloat16 and float32, check_finite True (the default) and False, beside
    torch's SDPA: 30 warm-up calls each, then 20 samples of 5 back-to-back calls each (wall
    clock, one synchronize per sample), the kinds taking turns sample by sample; medians
    per call in microseconds. At N = 16 the GPU work is a few microseconds: this is the
    host's cost of a call.
backward: forward + backward at (B, 16, N, D) bfloat16, causal and not: triton.flash through
    torch autograd (attention with requires_grad, then .backward) against each of torch's SDPA
    backends (cuDNN, FLASH, EFFICIENT; the fastest is the baseline): 3 warm-up steps (the first
    autotunes), then 10 steps timed each between CUDA events, medians; TFLOP/s counting
    4 B H N^2 D for the forward and 2.5 times that for the backward (half with causal).
"""

import argparse
import json
import statistics
import time

import torch

import attnkern


def per_call(fns, warmup=30, samples=20, calls=5):
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = {name: [] for name in fns}
    for _ in range(samples):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / calls)
    return {name: round(statistics.median(t) * 1e6, 1) for name, t in times.items()}


def overhead():
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = (torch.randn(1, 8, 16, 64, device="cuda", dtype=dtype) for _ in range(3))
        fns = {"torch.sdpa": lambda: sdpa(q, k, v),
               "triton.flash": lambda: attnkern.attention(q, k, v, kernel="triton.flash"),
               "triton.flash check_finite=False": lambda: attnkern.attention(q, k, v, kernel="triton.flash",
                                                                             check_finite=False)}
        rows.append({"dtype": str(dtype), "us_per_call": per_call(fns)})
        print(rows[-1], flush=True)
    return rows


def events(fn, warmup=3, reps=10):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def backward(shapes):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = []
    for b, h, n, d in shapes:
        for causal in (False, True):
            q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            leaves = [x.requires_grad_() for x in (q, k, v)]

            def ours():
                attnkern.attention(*leaves, causal=causal, kernel="triton.flash", check_finite=False).backward(dout)

            def theirs(backend):
                def step():
                    with sdpa_kernel(backend):
                        sdpa(*leaves, is_causal=causal).backward(dout)
                return step

            flops = 4 * b * h * n * n * d * 3.5 * (0.5 if causal else 1)
            row = {"shape": [b, h, n, d], "causal": causal}
            for name, fn in [("triton.flash", ours)] + [(f"torch {be.name}", theirs(be)) for be in
                                                        (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                                         SDPBackend.EFFICIENT_ATTENTION)]:
                try:
                    row[name] = round(flops / events(fn) / 1e12, 1)
                except RuntimeError as exc:  # a backend that does not take this call
                    row[name] = str(exc).splitlines()[0][:80]
            best = max(x for key, x in row.items() if key.startswith("torch") and isinstance(x, float))
            row["x_fastest_torch"] = round(row["triton.flash"] / best, 2)
            rows.append(row)
            print(row, flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="overhead,backward")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    result = {"device": torch.cuda.get_device_name()}
    parts = args.parts.split(",")
    if "overhead" in parts:
        result["overhead"] = overhead()
    if "backward" in parts:
        shapes = ([(4, 16, 2048, 64), (1, 16, 8192, 64), (2, 16, 4096, 128)] if args.quick else
                  [(b, 16, n, d) for d in (64, 128) for n in (2048, 4096, 8192) for b in (1, 8) if b * n <= 16384])
        result["backward"] = backward(shapes)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
