"""Side-by-side benchmark of attention kernels on this machine.

    python -m attnkern.bench                 # the standard table
    python -m attnkern.bench --sizes 1024 --kernels native.flash native.tiled torch.sdpa
    python -m attnkern.bench --memory        # peak extra memory of native.flash at N = 65536

Every kernel runs with the same thread count (BLAS threads pinned with
threadpoolctl, torch's through its num_threads). Kernels take turns (a pause,
an untimed call, then timed calls back to back) round-robin over two passes,
so slow drifts of a shared machine hit all alike; medians are reported.
GFLOP/s counts 4*B*H*Nq*Nk*D per forward (two matmuls), half for causal.
The ceiling is NumPy's float32 matmul at 2048^3 measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

import attnkern


def attention_flops(b: int, h: int, nq: int, nk: int, d: int, causal: bool) -> float:
    flops = 4.0 * b * h * nq * nk * d
    return flops / 2 if causal else flops


def _blas_limits(threads: int):
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        sys.exit("attnkern.bench needs threadpoolctl to pin BLAS threads: pip install 'attnkern[bench]'")
    return threadpool_limits(limits=threads)


def sgemm_gflops(threads: int, n: int = 2048, repeat: int = 5) -> float:
    """Median GFLOP/s of NumPy's float32 matmul at n^3: the compute ceiling."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    with _blas_limits(threads):
        a @ a
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            a @ a
            times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / statistics.median(times) / 1e9


def _thread_params(kernel: str, threads: int) -> dict:
    return {"num_threads": threads} if "num_threads" in attnkern.kernel_info(kernel)["params"] else {}


def time_kernels(kernels, q, k, v, causal: bool, threads: int, repeat: int, settle: float = 0.3,
                 passes: int = 2) -> dict[str, float]:
    """Median seconds per call of each kernel.

    Each kernel gets a turn of one untimed and `repeat` timed calls; turns go
    round-robin `passes` times. BLAS and OpenMP worker threads spin-wait for a
    while after a call and would steal the next kernel's cores on a small
    machine, so each turn starts after `settle` seconds of pause; within a turn
    calls are back to back, as a user's loop would make them."""
    params = {name: _thread_params(name, threads) for name in kernels}
    times: dict[str, list[float]] = {name: [] for name in kernels}
    with _blas_limits(threads):
        for _ in range(passes):
            for name in kernels:
                time.sleep(settle)
                attnkern.attention(q, k, v, causal=causal, kernel=name, **params[name])
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    attnkern.attention(q, k, v, causal=causal, kernel=name, **params[name])
                    times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def run_table(args) -> list[dict]:
    kernels = [k for k in args.kernels if attnkern.kernel_info(k)["available"]]
    for k in set(args.kernels) - set(kernels):
        print(f"# skipping {k}: {attnkern.kernel_info(k)['reason']}")
    ceiling = sgemm_gflops(args.threads)
    print(f"# {_cpu_name()} ({platform.machine()}), native ISA {attnkern.active_isa()}")
    print(f"# threads {args.threads} for every kernel; dtype {args.dtype}; median of {args.passes} x {args.repeat} calls")
    print(f"# sgemm ceiling (NumPy float32 matmul 2048^3): {ceiling:.1f} GFLOP/s")
    peers = [p for p in ("torch.sdpa", "numpy.naive") if p in kernels]
    head = f"{'N':>6} {'causal':>6} {'kernel':<14} {'median ms':>10} {'GFLOP/s':>8} {'%sgemm':>7}"
    head += "".join(f" {'vs ' + p:>15}" for p in peers)
    print(head)
    rows = []
    rng = np.random.default_rng(0)
    b, h, d = args.batch, args.heads, args.dim
    for n in args.sizes:
        q, k, v = (rng.standard_normal((b, h, n, d), dtype=args.dtype) for _ in range(3))
        for causal in args.causal:
            med = time_kernels(kernels, q, k, v, causal, args.threads, args.repeat, args.settle, args.passes)
            flops = attention_flops(b, h, n, n, d, causal)
            for name in kernels:
                gf = flops / med[name] / 1e9
                row = {"n": n, "causal": causal, "kernel": name, "median_s": med[name], "gflops": gf,
                       "sgemm_gflops": ceiling, **{f"speedup_vs_{p}": med[p] / med[name] for p in peers}}
                rows.append(row)
                line = f"{n:>6} {str(causal):>6} {name:<14} {med[name] * 1e3:>10.2f} {gf:>8.1f} {gf / ceiling:>7.1%}"
                line += "".join(f" {row[f'speedup_vs_{p}']:>14.2f}x" for p in peers)
                print(line, flush=True)
    return rows


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


_PROBE = """
import json, sys, numpy as np, attnkern, attnkern.bench
kernel, n, d, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def status(key):
    with open('/proc/self/status') as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ':'))
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 1, n, d), dtype=np.float32) for _ in range(3))
attnkern.attention(q[..., :64, :], k[..., :64, :], v[..., :64, :], kernel=kernel)  # load code, start threads
params = attnkern.bench._thread_params(kernel, threads)
before = status('VmRSS')
with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')  # reset the peak (VmHWM) to the current RSS
out = attnkern.attention(q, k, v, kernel=kernel, **params)
print(json.dumps({'extra_bytes': status('VmHWM') - before - out.nbytes, 'io_bytes': 4 * q.nbytes}))
"""


def measure_memory(kernel: str, n: int, d: int, threads: int) -> dict:
    """Peak memory a forward takes beyond its inputs and output, in a fresh process."""
    proc = subprocess.run([sys.executable, "-c", _PROBE, kernel, str(n), str(d), str(threads)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {"kernel": kernel, "error": proc.stderr.strip().splitlines()[-1]}
    return {"kernel": kernel, "n": n, "d": d, **json.loads(proc.stdout)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnkern.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[512, 1024, 2048, 4096], help="sequence lengths N")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5, help="timed calls per kernel, configuration and pass")
    parser.add_argument("--settle", type=float, default=0.3, help="seconds of pause before each kernel's turn")
    parser.add_argument("--passes", type=int, default=2, help="round-robin passes over the kernels")
    parser.add_argument("--kernels", nargs="+", default=["native.flash", "torch.sdpa", "numpy.naive"])
    parser.add_argument("--memory", action="store_true", help="also measure peak extra memory at N = 65536")
    parser.add_argument("--memory-n", type=int, default=65536)
    parser.add_argument("--json", help="write the measurements to this file")
    args = parser.parse_args(argv)
    args.causal = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    for name in args.kernels:
        attnkern.kernel_info(name)  # unknown names fail here, before any timing
    result = {"rows": run_table(args)}
    if args.memory:
        result["memory"] = []
        print(f"# peak memory beyond inputs and output, (1, 1, {args.memory_n}, {args.dim}) float32:")
        for name in ("native.flash", "native.tiled"):
            m = measure_memory(name, args.memory_n, args.dim, args.threads)
            result["memory"].append(m)
            if "error" in m:
                print(f"#   {name}: failed: {m['error']}")
            else:
                print(f"#   {name}: {m['extra_bytes'] / 2**20:.1f} MiB extra "
                      f"(inputs + output {m['io_bytes'] / 2**20:.0f} MiB)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
