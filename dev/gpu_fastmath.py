"""cuda.flash's and numba.flash's fastmath=0 and fastmath=1, side by side: speed and
error against float64.

    python3 dev/gpu_fastmath.py OUT.json [--n 4096] [--runs 15]

GPU (cuda.flash on torch CUDA tensors, (1, 16, N, D), not causal and causal): each
configuration of CUDA C++ kernel (float32 on tensor cores in 3xTF32, float32 FMAs,
float16/bfloat16 on wgmma at D = 64/128 and on mma.sync at D = 32) runs with
fastmath 0 and 1. Time: each sample is 5 back-to-back calls between two CUDA
events, fastmath 0 and 1 taking turns sample by sample, median of --runs samples
after a warm-up. Error: the largest absolute difference from the float64
reference on 256 sampled query rows of every head (attnkern.reference(rows=...)),
of the output and of the lse, beside torch's SDPA's in the same dtype (its
float32 with TF32 off). The inputs are seeded standard normal values (rounded to
the dtype), and 4x larger for a second error figure (sharper softmax, larger
exponents: where ex2's approximation error grows).

CPU (numba.flash, (1, 8, 1024, 64) float32, the machine's threads): the same
error, and the median wall time of --runs calls, fastmath 0 and 1 in turns."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


CONFIGS = ["float32:64:1", "float32:128:1", "float32:64:0", "float16:64:1", "bfloat16:128:1", "bfloat16:32:1"]


def gpu_part(n: int, runs: int, configs: list[str]) -> list[dict]:
    import torch

    import attnkern

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    configs = [(c.split(":")[0], int(c.split(":")[1]), int(c.split(":")[2])) for c in configs]
    out = []
    rows = np.linspace(0, n - 1, 256).astype(int)
    for dtype, d, tc in configs:
        for causal in (False, True):
            rng = np.random.default_rng(d)
            base = [rng.standard_normal((1, 16, n, d)).astype(np.float32) for _ in range(3)]
            tq, tk, tv = (torch.from_numpy(x).cuda().to(getattr(torch, dtype)) for x in base)
            kw = dict(kernel="cuda.flash", causal=causal, check_finite=False)
            if dtype == "float32":
                kw["tensor_cores"] = tc

            def call(fm):
                return attnkern.attention(tq, tk, tv, fastmath=fm, **kw)

            rec = {"dtype": dtype, "d": d, "tensor_cores": tc, "causal": causal, "n": n}
            for fm in (0, 1):
                call(fm)
            torch.cuda.synchronize()
            samples = {0: [], 1: []}
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(runs):
                for fm in (0, 1):
                    start.record()
                    for _ in range(5):
                        call(fm)
                    end.record()
                    end.synchronize()
                    samples[fm].append(start.elapsed_time(end) / 5e3)
            for fm in (0, 1):
                rec[f"ms_fastmath{fm}"] = statistics.median(samples[fm]) * 1e3
            rec["speedup"] = rec["ms_fastmath0"] / rec["ms_fastmath1"]
            for label, mult in (("", 1.0), ("_x4", 4.0)):
                xq, xk, xv = (t * mult for t in (tq, tk, tv)) if mult != 1 else (tq, tk, tv)
                host = [t.float().cpu().numpy() for t in (xq, xk, xv)]
                ref, ref_lse = attnkern.reference(*host, causal=causal, rows=rows, return_lse=True)
                for fm in (0, 1):
                    o, lse = attnkern.attention(xq, xk, xv, fastmath=fm, return_lse=True, **kw)
                    o = o.float().cpu().numpy()[:, :, rows]
                    lse = lse.float().cpu().numpy()[:, :, rows]
                    rec[f"err{label}_fastmath{fm}"] = float(np.abs(o - ref).max())
                    rec[f"lse_err{label}_fastmath{fm}"] = float(np.abs(lse - ref_lse).max())
                sd = torch.nn.functional.scaled_dot_product_attention(xq, xk, xv, is_causal=causal)
                rec[f"err{label}_torch"] = float(np.abs(sd.float().cpu().numpy()[:, :, rows] - ref).max())
            out.append(rec)
            print(json.dumps(rec), flush=True)
    return out


def cpu_part(runs: int) -> dict:
    import attnkern

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 8, 1024, 64)).astype(np.float32) for _ in range(3))
    ref = attnkern.reference(q, k, v)
    rec = {"kernel": "numba.flash", "shape": [1, 8, 1024, 64]}
    samples = {0: [], 1: []}
    for fm in (0, 1):
        o = attnkern.attention(q, k, v, kernel="numba.flash", fastmath=fm)
        rec[f"err_fastmath{fm}"] = float(np.abs(o - ref).max())
    for _ in range(runs):
        for fm in (0, 1):
            t0 = time.perf_counter()
            attnkern.attention(q, k, v, kernel="numba.flash", fastmath=fm)
            samples[fm].append(time.perf_counter() - t0)
    for fm in (0, 1):
        rec[f"ms_fastmath{fm}"] = statistics.median(samples[fm]) * 1e3
    print(json.dumps(rec), flush=True)
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--n", type=int, default=4096)
    p.add_argument("--runs", type=int, default=15)
    p.add_argument("--configs", type=lambda s: s.split(","), default=CONFIGS,
                   help="dtype:D:tensor_cores, comma-separated (default: " + ",".join(CONFIGS) + ")")
    p.add_argument("--no-cpu", action="store_true", help="skip numba.flash on the CPU")
    args = p.parse_args()
    result = {"gpu": gpu_part(args.n, args.runs, args.configs)}
    if not args.no_cpu:
        result["cpu"] = cpu_part(args.runs)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
