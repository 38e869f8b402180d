"""Checks attnkern_bench.counts.attention_bytes against Valgrind's cache simulation.

    .venv/bin/python dev/check_byte_model.py [--shape 1x8x2048x64] [--kernels native.flash native.naive]

For each kernel, one single-threaded forward runs under cachegrind (the avx2 path:
Valgrind has no AVX-512), with only that call simulated (--toggle-collect on
operator.call, as benchmarks/counting.py does). Last-level misses times the line
size (reads that reach memory, and write-backs) is the simulated memory traffic;
printed beside the model's bytes. The simulated last-level cache is the host's,
or --ll SIZE,ASSOC,LINE.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

SCRIPT = r"""
import operator, sys, numpy as np, attnkern
from attnkern_bench.inputs import random_qkv
kernel, b, h, n, d = sys.argv[1], *map(int, sys.argv[2:6])
q, k, v = random_qkv(0, (b, h), n, n, d)
params = {"num_threads": 1} if "num_threads" in attnkern.kernel_info(kernel)["params"] else {}
attnkern.attention(q[..., :64, :], k[..., :64, :], v[..., :64, :], kernel=kernel, **params)  # warm: code, pools
operator.call(attnkern.attention, q, k, v, kernel=kernel, check_finite=False, **params)
"""


def simulate(kernel, shape, ll):
    b, h, n, d = shape
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cg.out")
        cmd = ["valgrind", "--tool=callgrind", "--cache-sim=yes", f"--callgrind-out-file={out}",
               "--collect-atstart=no", "--toggle-collect=_operator_call", "--compress-strings=no"]
        if ll:
            cmd.append(f"--LL={ll}")
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", ATTNKERN_ISA="avx2",
                   ATTNKERN_NO_TUNED="1", PYTHONHASHSEED="0")
        proc = subprocess.run([*cmd, sys.executable, "-c", SCRIPT, kernel, *map(str, shape)], env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-2000:])
        text = open(out).read()
    events = re.search(r"^events: (.*)$", text, re.M).group(1).split()
    totals = [int(x) for x in re.search(r"^(?:summary|totals): (.*)$", text, re.M).group(1).split()]
    got = dict(zip(events, totals))
    line = int(re.search(r"LL cache:\s+(\d+) B, (\d+) B", proc.stderr + text).group(2)) if \
        re.search(r"LL cache:\s+(\d+) B, (\d+) B", proc.stderr + text) else 64
    return got, line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="1x8x2048x64")
    p.add_argument("--kernels", nargs="+", default=["native.flash", "native.tiled", "native.naive"])
    p.add_argument("--ll", help="simulated last-level cache, SIZE,ASSOC,LINE (default: the host's)")
    args = p.parse_args(argv)
    from attnkern_bench.counts import attention_bytes

    shape = tuple(int(x) for x in args.shape.split("x"))
    b, h, n, d = shape
    print(f"# {args.shape} float32, one thread, avx2 path under callgrind's cache simulation; LL {args.ll or 'host'}")
    print(f"{'kernel':<14} {'model MB':>9} {'LL read misses':>15} {'LL write misses':>16} {'simulated MB':>13} "
          f"{'model / sim':>11}")
    for kernel in args.kernels:
        got, line = simulate(kernel, shape, args.ll)
        misses = got.get("DLmr", 0) + got.get("DLmw", 0) + got.get("ILmr", 0)
        sim = misses * line
        model = attention_bytes(kernel, b, h, n, n, d, 4, block_q=None)
        print(f"{kernel:<14} {model / 1e6:>9.1f} {got.get('DLmr', 0):>15,} {got.get('DLmw', 0):>16,} "
              f"{sim / 1e6:>13.1f} {model / sim:>11.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
