"""native.flash from this build against another build's compiled extension, in turns in one
process: for each (D, dtype, causal) at (B, H, N, D), the forward or the backward of this build
and of the other alternate --reps times (which goes first alternates too, so neither always
follows the other), after one untimed call of each; prints both medians, other / this (above 1:
this build faster) and whether the two builds' results are bit-identical.

The other build is any `attnkern/backends/native/_attn*.so` (e.g. a copy of main's, taken from
build-editable/ before a change is rebuilt). Run it twice with this build's own extension as
--base-so to see the noise of identical code on this machine (the A/A spread).

Usage: dev/cpu_build_ab.py --base-so PATH [--pass forward|backward] [--n 1024] [--dims 16 48 64]
       [--dtypes float32 bfloat16] [--causal 0 1] [--batch 1] [--heads 8] [--threads 2] [--reps 9]"""

import argparse
import statistics
import time

import numpy as np

import attnkern
from attnkern.backends.native import other_build

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--base-so", required=True, help="the other build's _attn extension")
ap.add_argument("--pass", dest="which", choices=["forward", "backward"], default="backward")
ap.add_argument("--n", type=int, default=1024)
ap.add_argument("--dims", type=int, nargs="+", default=[16, 48, 64])
ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
ap.add_argument("--batch", type=int, default=1)
ap.add_argument("--heads", type=int, default=8)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--reps", type=int, default=9)
args = ap.parse_args()


def as_dtype(x, name):
    if name == "bfloat16":
        import ml_dtypes

        return x.astype(ml_dtypes.bfloat16)
    return x.astype(name)


def bits(arrays):
    return [np.ascontiguousarray(a).view(np.uint8) for a in arrays]


rng = np.random.default_rng(0)
print(f"native.flash {args.which}, ISA {attnkern.active_isa()}, {args.threads} threads, this build / {args.base_so}")
for dtype in args.dtypes:
    for d in args.dims:
        for causal in map(bool, args.causal):
            shape = (args.batch, args.heads, args.n, d)
            q, k, v, dout = (as_dtype(rng.standard_normal(shape, dtype=np.float32), dtype) for _ in range(4))
            out, lse = attnkern.attention(q, k, v, causal=causal, kernel="native.flash", return_lse=True,
                                          num_threads=args.threads)
            if args.which == "forward":
                def call():
                    return (attnkern.attention(q, k, v, causal=causal, kernel="native.flash", num_threads=args.threads),)
            else:
                def call():
                    return attnkern.attention_backward(q, k, v, out, dout, lse, causal=causal, kernel="native.flash",
                                                       num_threads=args.threads)
            mine = call()
            with other_build(args.base_so):
                theirs = call()
            same = all(np.array_equal(a, b) for a, b in zip(bits(mine), bits(theirs)))
            times = {"this": [], "other": []}
            for rep in range(args.reps):
                for who in (("this", "other") if rep % 2 == 0 else ("other", "this")):
                    if who == "other":
                        with other_build(args.base_so):
                            t0 = time.perf_counter()
                            call()
                            times[who].append(time.perf_counter() - t0)
                    else:
                        t0 = time.perf_counter()
                        call()
                        times[who].append(time.perf_counter() - t0)
            this, other = (statistics.median(times[w]) for w in ("this", "other"))
            print(f"{str(shape):22s} {dtype:8s} causal={causal:d}  this {this * 1e3:8.2f} ms  other {other * 1e3:8.2f} ms"
                  f"  other/this {other / this:.2f}  bit-identical {same}")
