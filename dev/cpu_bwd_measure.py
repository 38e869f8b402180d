"""native.flash forward+backward against torch SDPA's on the CPU, in turns in one process:
for each (D, dtype, causal) at (B, H, N, D), ours and torch's forward+backward alternate
--reps times (an untimed call of each first); prints the medians, backward alone, and
torch's time / ours (above 1: ours faster). --base-so PATH runs ours from another build
of attnkern/backends/native/_attn (e.g. a copy of main's), to compare before and after in
the same way. --cpu-time (with --threads 1) times the calling thread's CPU time instead
of wall time: on a shared, loaded machine it counts only this thread's work (the kernels
then run on the calling thread, torch's too), where wall time counts the waits for the
other jobs. ATTNKERN_BENCH_SMOKE=1: one tiny shape, two turns.

Usage: dev/cpu_bwd_measure.py [--n 2048] [--dims 64 128] [--dtypes float32 bfloat16]
       [--causal 0 1] [--batch 1] [--heads 8] [--threads 2] [--reps 7] [--base-so PATH] [--cpu-time]"""

import argparse
import importlib.util
import os
import statistics
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--n", type=int, default=2048)
ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--heads", type=int, default=8)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--reps", type=int, default=7)
ap.add_argument("--base-so", default=None)
ap.add_argument("--cpu-time", action="store_true")
args = ap.parse_args()
if args.cpu_time and args.threads != 1:
    ap.error("--cpu-time counts the calling thread's time: it needs --threads 1")
clock = time.thread_time if args.cpu_time else time.perf_counter
if os.environ.get("ATTNKERN_BENCH_SMOKE"):
    args.n, args.dims, args.reps = 64, args.dims[:1], 2

if args.base_so:  # ours from that module: in sys.modules before attnkern imports its own
    name = "attnkern.backends.native._attn"
    spec = importlib.util.spec_from_file_location(name, args.base_so)
    sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[name])

import torch  # noqa: E402

import attnkern  # noqa: E402

torch.set_num_threads(args.threads)
sdpa = torch.nn.functional.scaled_dot_product_attention


def step(f, xs, dout):
    """Seconds of f's forward+backward, and of its backward alone."""
    xs = [x.detach().requires_grad_() for x in xs]
    t0 = clock()
    out = f(*xs)
    t1 = clock()
    out.backward(dout)
    t2 = clock()
    return t2 - t0, t2 - t1


print(f"CPU {attnkern.active_isa()}, {args.threads} threads, {'thread CPU' if args.cpu_time else 'wall'} time, "
      f"torch {torch.__version__}, base {args.base_so}")
for d in args.dims:
    for dtype in args.dtypes:
        for causal in map(bool, args.causal):
            gen = torch.Generator().manual_seed(0)
            shape = (args.batch, args.heads, args.n, d)
            q, k, v, dout = (torch.randn(shape, generator=gen).to(getattr(torch, dtype)) for _ in range(4))
            ours = lambda a, b, c: attnkern.attention(a, b, c, causal=causal, kernel="native.flash",  # noqa: E731
                                                      num_threads=args.threads)
            theirs = lambda a, b, c: sdpa(a, b, c, is_causal=causal)  # noqa: E731
            step(ours, (q, k, v), dout), step(theirs, (q, k, v), dout)
            t = {"ours": [], "torch": []}
            for _ in range(args.reps):
                t["ours"].append(step(ours, (q, k, v), dout))
                t["torch"].append(step(theirs, (q, k, v), dout))
            med = {kk: [statistics.median(x[i] for x in vv) * 1e3 for i in (0, 1)] for kk, vv in t.items()}
            print(f"{shape} {dtype:8s} causal={int(causal)}  ours fwd+bwd {med['ours'][0]:8.1f} ms "
                  f"(bwd {med['ours'][1]:7.1f})  torch {med['torch'][0]:8.1f} ms (bwd {med['torch'][1]:7.1f})  "
                  f"torch/ours fwd+bwd {med['torch'][0] / med['ours'][0]:.2f}x, bwd {med['torch'][1] / med['ours'][1]:.2f}x",
                  flush=True)
