"""Decode on the CPU against the memory's read bandwidth and torch SDPA.

    .venv/bin/python tools/decode_bandwidth.py                   # all cores, Nk 4096..131072
    .venv/bin/python tools/decode_bandwidth.py --threads 2 --sizes 4096 32768 --json decode.json
    ATTNKERN_BENCH_SMOKE=1 .venv/bin/python tools/decode_bandwidth.py   # a quick check of the script

One decode step of a GQA model: q (1, 32, 1, 128) against a KV cache k, v
(1, 8, Nk, 128), no mask (the one query sees every key: causal bottom-right is the
same problem), float32 and bfloat16. native.flash takes its decode path there
(flash-decoding, docs/kernels.md); torch is scaled_dot_product_attention with
enable_gqa=True, in the same dtype, on the same threads, taking turns with ours.

Reported per (dtype, Nk): the median time per call of each, the bytes of k + v one
call reads, ours as GB/s and as a fraction of the machine's bandwidth (STREAM's
copy and triad as attnkern roofline measures them, attnkern_bench.roofline.cpu_ceilings, and
a NumPy sum over 256 MiB: the largest of the three is the ceiling), and torch / ours (above 1: ours
is faster). Each side's output is first checked against the float64 reference.
Timings mean something only on a quiet machine: the script prints the load average
and refuses (exit 2) above --max-load unless --force.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import attnkern
from attnkern_bench.machine import blas_threads, cpu_name
from attnkern_bench.roofline import cpu_ceilings
from attnkern_bench.timing import medians, take_turns

SMOKE = os.environ.get("ATTNKERN_BENCH_SMOKE") == "1"
B, H, H_KV, D = 1, 32, 8, 128


def problem(nk: int, dtype: str, seed: int = 0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((B, H, 1, D), (B, H_KV, nk, D), (B, H_KV, nk, D)))
    if dtype == "bfloat16":
        import ml_dtypes

        q, k, v = (x.astype(ml_dtypes.bfloat16) for x in (q, k, v))
    return q, k, v


def reference(q, k, v) -> np.ndarray:
    """float64 softmax(q k^T / sqrt(D)) v with each k/v head serving its H / H_KV query heads,
    without repeating k and v (the cache at Nk = 131072 is 1 GiB in float32)."""
    g = H // H_KV
    q64 = np.asarray(q, np.float64).reshape(B, H_KV, g, D)
    out = np.empty((B, H_KV, g, D))
    for h in range(H_KV):  # one k/v head at a time: float64 copies of 1/8 of the cache
        k64, v64 = np.asarray(k[:, h], np.float64), np.asarray(v[:, h], np.float64)
        s = np.einsum("bgd,bnd->bgn", q64[:, h], k64) / np.sqrt(D)
        p = np.exp(s - s.max(-1, keepdims=True))
        out[:, h] = np.einsum("bgn,bnd->bgd", p / p.sum(-1, keepdims=True), v64)
    return out.reshape(B, H, 1, D)


def numpy_sum_gbs(mib: int, repeat: int = 5) -> float:
    """Read bandwidth as the team measured it: NumPy's sum over `mib` MiB of float32."""
    import time

    x = np.ones(mib * 2**20 // 4, np.float32)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.nbytes / best / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of both sides (default all)")
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384, 32768, 65536, 131072], help="cached keys Nk")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--repeat", type=int, default=10, help="timed calls per turn")
    p.add_argument("--passes", type=int, default=3, help="round-robin passes")
    p.add_argument("--max-load", type=float, default=2.5, help="refuse above this 1-minute load average")
    p.add_argument("--force", action="store_true", help="time even on a busy machine")
    p.add_argument("--json", help="write the rows and the machine's ceilings here")
    a = p.parse_args(argv)
    import torch

    load = os.getloadavg()[0]
    print(f"{cpu_name()}, {a.threads} threads, load average {load:.2f}")
    if load > a.max_load and not (a.force or SMOKE):
        print(f"the machine is busy (load {load:.2f} > {a.max_load}): timings would mean nothing; --force to run")
        return 2
    sizes, repeat, passes = ([1024, 2048], 2, 1) if SMOKE else (a.sizes, a.repeat, a.passes)
    ceil = cpu_ceilings(a.threads, stream_mib=64 if SMOKE else 512, repeat=2 if SMOKE else 5)
    ceil["numpy_sum_gbs"] = numpy_sum_gbs(64 if SMOKE else 256)
    bw = max(ceil["copy_gbs"], ceil["triad_gbs"], ceil["numpy_sum_gbs"])
    print(f"STREAM copy {ceil['copy_gbs']:.1f} GB/s, triad {ceil['triad_gbs']:.1f} GB/s, NumPy sum "
          f"{ceil['numpy_sum_gbs']:.1f} GB/s (one thread): ceiling {bw:.1f} GB/s, the largest")
    torch.set_num_threads(a.threads)
    rows, failed = [], False
    head = f"{'dtype':9} {'Nk':>7} {'k+v MiB':>8} {'ours ms':>8} {'torch ms':>9} {'ours GB/s':>9} {'of bw':>6} " \
           f"{'torch/ours':>10}"
    print(head)
    for dtype in a.dtypes:
        tdtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        for nk in sizes:
            q, k, v = problem(nk, dtype)
            tq, tk, tv = (torch.from_numpy(x.astype(np.float32)).to(tdtype) for x in (q, k, v))
            ours = lambda: attnkern.attention(q, k, v, kernel="native.flash", num_threads=a.threads,  # noqa: E731
                                              check_finite=False)
            theirs = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)  # noqa: E731
            ref = reference(q, k, v)
            tol = 2e-2 if dtype == "bfloat16" else 1e-4
            with torch.no_grad(), blas_threads(a.threads):
                got = ours()
                errs = (np.abs(np.asarray(got, np.float64) - ref).max(),
                        np.abs(theirs().float().numpy().astype(np.float64) - ref).max())
                t = medians(take_turns({"ours": ours, "torch": theirs}, repeat=repeat, passes=passes))
            bytes_kv = k.nbytes + v.nbytes
            row = {"dtype": dtype, "nk": nk, "bytes_kv": bytes_kv, "ours_s": t["ours"], "torch_s": t["torch"],
                   "ours_gbs": bytes_kv / t["ours"] / 1e9, "torch_gbs": bytes_kv / t["torch"] / 1e9,
                   "of_bandwidth": bytes_kv / t["ours"] / 1e9 / bw, "torch_over_ours": t["torch"] / t["ours"],
                   "ours_err": float(errs[0]), "torch_err": float(errs[1])}
            rows.append(row)
            failed |= errs[0] > tol
            print(f"{dtype:9} {nk:7d} {bytes_kv / 2**20:8.1f} {t['ours'] * 1e3:8.3f} {t['torch'] * 1e3:9.3f} "
                  f"{row['ours_gbs']:9.1f} {row['of_bandwidth']:6.0%} {row['torch_over_ours']:10.2f}"
                  + ("  ERROR vs reference %.3g" % errs[0] if errs[0] > tol else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu_name(), "threads": a.threads, "load": load, "ceilings": ceil, "rows": rows}, f,
                      indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
