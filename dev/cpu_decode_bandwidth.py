"""Times native.flash's CPU decode path (flash-decoding, docs/kernels.md) against torch's
SDPA with enable_gqa, at decode shapes: H = 32 query heads over H_kv = 8, D = 128 (--heads,
--d), B in --batches, Nq in --nq, Nk in --nk, float32 and bfloat16 (float16 on request); and
the bandwidth it reaches.

    .venv/bin/python dev/cpu_decode_bandwidth.py [--batches 1 4 8] [--nq 1 16]
        [--nk 1024 4096 16384 65536 131072] [--dtypes float32 bfloat16] [--threads 2]
        [--runs 7] [--heads 32 8] [--d 128] [--base-so OTHER/_attn.so] [--json OUT.json]
    ATTNKERN_BENCH_SMOKE=1 .venv/bin/python dev/cpu_decode_bandwidth.py   # small, 2 runs

attnkern runs attention(q, k, v, kernel="native.flash", causal="bottom_right",
num_threads=--threads, check_finite=False) on NumPy arrays (bfloat16: ml_dtypes');
torch runs scaled_dot_product_attention(q, k, v, enable_gqa=True) (is_causal only for
Nq > 1 with an explicit bottom-right mask: torch's is_causal is top-left) with
torch.set_num_threads(--threads). Each time is the median of --runs samples taken in
turns (one sample of each contender, then the next round); a sample is the mean of as
many calls as fill about 20 ms (at least one).

GB/s: bytes of K and V (B H_kv Nk D 2 itemsize: the cache, read once) over the time,
next to STREAM copy (read + write counted) measured in the same run by attnkern's own
STREAM loop (attnkern.hardware.stream, as `attnkern roofline` runs it) on --threads
threads, with its read loop (a float32 array far beyond the caches summed, 4 bytes an element:
the read-only stream a decode makes; "% read") and a NumPy read (np.sum, one thread). The
per-call overhead is the time of the smallest call (Nk = 1 key, B = 1, Nq = 1): no cache
to read, only the wrapper, the checks and the thread team.

--base-so PATH adds a third contender, native.flash run by another build of the C
module (the _attn extension of a checkout or wheel built before a change, e.g.
build-editable/attnkern/backends/native/_attn*.so there): its time and the ratio base /
ours, sampled in the same turns, so that the load of a busy machine falls on both."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

import attnkern
from attnkern import hardware
from attnkern_bench.harness import host_dtype

H, H_KV, D = 32, 8, 128
SMOKE = bool(os.environ.get("ATTNKERN_BENCH_SMOKE"))


def sample(fn, target: float = 0.02) -> float:
    """Seconds per call of fn, the mean of as many calls as fill about `target` seconds."""
    t0 = time.perf_counter()
    fn()
    one = time.perf_counter() - t0
    reps = max(1, int(target / max(one, 1e-7)))
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def in_turns(fns: dict, runs: int) -> dict:
    """The median seconds per call of each of fns, sampled in turns."""
    for fn in fns.values():
        fn()  # warm-up: the thread pools, the caches of small shapes
    times = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            times[name].append(sample(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def stream_gbs(threads: int, mib: int, repeat: int) -> dict:
    """STREAM copy and triad, and a read (b summed: the read-only stream a decode makes), all
    attnkern's loops on `threads` threads, and a NumPy read (one thread), GB/s, best of `repeat`."""
    n = mib * 2**20 // 4
    a, b, c = np.empty(n, np.float32), np.ones(n, np.float32), np.full(n, 2.0, np.float32)
    hardware.stream("copy", a, b, c, threads)
    copy = 2 * 4 * n / min(hardware.stream("copy", a, b, c, threads) for _ in range(repeat)) / 1e9
    triad = 3 * 4 * n / min(hardware.stream("triad", a, b, c, threads) for _ in range(repeat)) / 1e9
    read = 4 * n / min(hardware.stream("read", a, b, c, threads) for _ in range(repeat)) / 1e9
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        b.sum()
        best = min(best, time.perf_counter() - t0)
    return {"copy_gbs": copy, "triad_gbs": triad, "read_gbs": read, "numpy_read_gbs": 4 * n / best / 1e9}


def problem(b: int, nq: int, nk: int, dtype: str, seed: int = 0):
    """(ours, theirs): attnkern's arrays and torch's tensors of one decode step."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, H, nq, D), dtype=np.float32)
    k = rng.standard_normal((b, H_KV, nk, D), dtype=np.float32)
    v = rng.standard_normal((b, H_KV, nk, D), dtype=np.float32)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    if dtype in ("bfloat16", "float16"):
        q, k, v = (x.astype(host_dtype(dtype)) for x in (q, k, v))
        tq, tk, tv = (x.to(getattr(torch, dtype)) for x in (tq, tk, tv))
    return (q, k, v), (tq, tk, tv)


def measure(b, nq, nk, dtype, threads, runs, base=None) -> dict:
    (q, k, v), (tq, tk, tv) = problem(b, nq, nk, dtype)
    mask = None
    if nq > 1:  # bottom-right causal: query i sees keys j <= i + nk - nq
        i, j = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
        mask = j <= i + nk - nq

    def ours():
        attnkern.attention(q, k, v, kernel="native.flash", causal="bottom_right", num_threads=threads,
                           check_finite=False)

    def theirs():
        F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, enable_gqa=True)

    fns = {"native.flash": ours, "torch.sdpa": theirs}
    if base is not None:
        from attnkern.backends.native import other_build

        def base_build():
            with other_build(base):
                ours()

        fns["base"] = base_build
    t = in_turns(fns, runs)
    nbytes = 2 * b * H_KV * nk * D * k.dtype.itemsize
    row = {"B": b, "nq": nq, "nk": nk, "dtype": dtype, "kv_bytes": nbytes,
           "ours_s": t["native.flash"], "torch_s": t["torch.sdpa"],
           "ours_gbs": nbytes / t["native.flash"] / 1e9, "torch_gbs": nbytes / t["torch.sdpa"] / 1e9}
    if base is not None:
        row["base_s"] = t["base"]
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1] if SMOKE else [1, 4, 8])
    p.add_argument("--nq", type=int, nargs="+", default=[1] if SMOKE else [1, 16])
    p.add_argument("--nk", type=int, nargs="+",
                   default=[1024, 4096] if SMOKE else [1024, 4096, 16384, 65536, 131072])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                   choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=2 if SMOKE else 7)
    p.add_argument("--stream-mib", type=int, default=64 if SMOKE else 512)
    p.add_argument("--max-gib", type=float, default=8.0, help="skip shapes whose K+V (float32) exceed this")
    p.add_argument("--json", help="write the rows and STREAM here")
    p.add_argument("--heads", type=int, nargs=2, default=[32, 8], metavar=("H", "H_KV"),
                   help="query and k/v heads (32 32: no GQA)")
    p.add_argument("--d", type=int, default=128, help="head size")
    p.add_argument("--base-so", help="another build's _attn extension, timed in the same turns")
    args = p.parse_args()
    globals().update(H=args.heads[0], H_KV=args.heads[1], D=args.d)
    base = args.base_so
    torch.set_num_threads(args.threads)
    s = stream_gbs(args.threads, args.stream_mib, 3)
    print(f"STREAM ({args.threads} threads, {args.stream_mib} MiB arrays): copy {s['copy_gbs']:.1f} GB/s, "
          f"triad {s['triad_gbs']:.1f} GB/s, read {s['read_gbs']:.1f} GB/s; NumPy read (one thread) "
          f"{s['numpy_read_gbs']:.1f} GB/s; isa {attnkern.active_isa()}")
    over = measure(1, 1, 1, "float32", args.threads, args.runs, base)
    print(f"per-call overhead (B 1, Nq 1, Nk 1, float32): native.flash {over['ours_s'] * 1e6:.1f} us, "
          f"torch.sdpa {over['torch_s'] * 1e6:.1f} us"
          + (f", base build {over['base_s'] * 1e6:.1f} us" if base else ""))
    print(f"{'dtype':9} {'B':>2} {'Nq':>3} {'Nk':>7} {'ours us':>10} {'torch us':>10} {'ours GB/s':>10} "
          f"{'torch GB/s':>10} {'% copy':>7} {'% read':>7} {'vs torch':>8}" + (f" {'base us':>10} {'vs base':>8}" if base else ""))
    rows = []
    for dtype in args.dtypes:
        for b in args.batches:
            for nq in args.nq:
                for nk in args.nk:
                    if 2 * b * H_KV * nk * D * 4 > args.max_gib * 2**30:
                        continue
                    r = measure(b, nq, nk, dtype, args.threads, args.runs, base)
                    rows.append(r)
                    vs_base = f" {r['base_s'] * 1e6:10.1f} {r['base_s'] / r['ours_s']:7.2f}x" if base else ""
                    print(f"{dtype:9} {b:2d} {nq:3d} {nk:7d} {r['ours_s'] * 1e6:10.1f} {r['torch_s'] * 1e6:10.1f} "
                          f"{r['ours_gbs']:10.1f} {r['torch_gbs']:10.1f} {100 * r['ours_gbs'] / s['copy_gbs']:6.0f}% "
                          f"{100 * r['ours_gbs'] / s['read_gbs']:6.0f}% "
                          f"{r['torch_s'] / r['ours_s']:7.2f}x" + vs_base, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"stream": s, "overhead": over, "threads": args.threads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
