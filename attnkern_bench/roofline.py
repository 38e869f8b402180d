"""The roofline: this machine's compute and memory ceilings, measured, and every
kernel placed against them.

Ceilings (CPU): the ISA's peak FMA rate (a register-only loop of the native
kernels' instruction set, attnkern.hardware.fma_peak), NumPy's
float32 matmul (sgemm, the practical compute ceiling), and STREAM-style copy and
triad bandwidth over arrays far beyond the last-level cache, all on the kernels'
thread count. GPU: torch's float32 matmul (TF32 off) and device-to-device copy
bandwidth, beside the datasheet figures.

A kernel's point: FLOPs (counts.attention_flops) over bytes moved (the model of
counts.attention_bytes) is its arithmetic intensity; its measured GFLOP/s (the
harness: checked against float64, then timed) over the attainable bound
min(compute peak, intensity x bandwidth) is the fraction it reaches. A kernel
left of the ridge point (peak / bandwidth) is memory-bound by the model, right
of it compute-bound.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np

import attnkern

from . import harness
from .ceilings import cuda_sgemm_gflops, sgemm_gflops
from .counts import attention_bytes

# H100 SXM5 80 GB (NVIDIA's datasheet): float32 without tensor cores, HBM3 bandwidth
DATASHEET = {"NVIDIA H100 80GB HBM3": {"fp32_gflops": 67_000.0, "bandwidth_gbs": 3_350.0}}


def cpu_ceilings(threads: int, stream_mib: int = 512, repeat: int = 5) -> dict:
    """Measured ceilings of this CPU on `threads` threads."""
    import attnkern
    from attnkern import hardware

    isa = attnkern.active_isa()
    hardware.fma_peak(isa, 1000, threads)  # start the thread pool
    fma = max(f / s for s, f in (hardware.fma_peak(isa, 50_000_000, threads) for _ in range(repeat))) / 1e9
    n = stream_mib * 2**20 // 4
    a, b, c = np.empty(n, np.float32), np.ones(n, np.float32), np.full(n, 2.0, np.float32)
    hardware.stream("triad", a, b, c, threads)
    copy = 2 * 4 * n / min(hardware.stream("copy", a, b, c, threads) for _ in range(repeat)) / 1e9
    triad = 3 * 4 * n / min(hardware.stream("triad", a, b, c, threads) for _ in range(repeat)) / 1e9
    return {"device": "cpu", "isa": isa, "threads": threads, "fma_peak_gflops": fma,
            "sgemm_gflops": sgemm_gflops(threads), "copy_gbs": copy, "triad_gbs": triad,
            "peak_gflops": fma, "bandwidth_gbs": triad, "stream_mib": stream_mib}


def cuda_copy_gbs(torch, repeat: int = 10) -> float:
    """GB/s of a device-to-device copy of 1 GiB (bytes read and written), the median of
    `repeat` copies between CUDA events."""
    n = 256 * 2**20  # 1 GiB of float32
    src, dst = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
    dst.copy_(src)
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * 4 * n / statistics.median(times) / 1e9


def cuda_ceilings(repeat: int = 10) -> dict:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    copy = cuda_copy_gbs(torch, repeat)
    name = torch.cuda.get_device_name()
    sheet = DATASHEET.get(name, {})
    sgemm = cuda_sgemm_gflops(torch)
    return {"device": "cuda", "gpu": name, "sgemm_gflops": sgemm, "copy_gbs": copy, "datasheet": sheet,
            "peak_gflops": sheet.get("fp32_gflops", sgemm), "bandwidth_gbs": copy}


def place(rows: list[dict], ceilings: dict, b: int, h: int, d: int, itemsize: int = 4) -> list[dict]:
    """Adds bytes, intensity, attainable and fraction to harness rows (they have n,
    causal, kernel and gflops)."""
    out = []
    for r in rows:
        if "gflops" not in r:
            continue
        name = r["kernel"].split("[")[0]
        try:
            moved = attention_bytes(name, b, h, r["n"], r["n"], d, itemsize, r["causal"])
        except ValueError:
            continue
        flops = r["gflops"] * 1e9 * r["median_s"]
        ai = flops / moved
        attainable = min(ceilings["peak_gflops"], ai * ceilings["bandwidth_gbs"])
        out.append({**r, "bytes": moved, "intensity": ai, "attainable_gflops": attainable,
                    "fraction": r["gflops"] / attainable,
                    "bound": "memory" if ai * ceilings["bandwidth_gbs"] < ceilings["peak_gflops"] else "compute"})
    return out


def draw(ax, points: list[dict], ceilings: dict, title: str, annotate: bool = True) -> None:
    """The roof, the matmul ceiling and the kernels' points on a matplotlib axis."""
    ai = np.logspace(-1, 3, 200)
    bw, peak = ceilings["bandwidth_gbs"], ceilings["peak_gflops"]
    ax.plot(ai, np.minimum(peak, ai * bw), "k-", lw=1.5, label=f"roof: {peak:,.0f} GFLOP/s peak, {bw:,.0f} GB/s")
    if "sgemm_gflops" in ceilings:
        ax.axhline(ceilings["sgemm_gflops"], color="gray", ls="--", lw=1,
                   label=f"float32 matmul {ceilings['sgemm_gflops']:,.0f} GFLOP/s")
    markers = "osD^v<>ph*"
    for i, k in enumerate(sorted({p["kernel"] for p in points})):
        for causal in (False, True):
            sel = [p for p in points if p["kernel"] == k and p["causal"] == causal]
            if not sel:
                continue
            ax.scatter([p["intensity"] for p in sel], [p["gflops"] for p in sel], marker=markers[i % len(markers)],
                       s=40, color=f"C{i}", facecolors="none" if causal else f"C{i}",
                       label=f"{k}{' causal' if causal else ''}")
            for p in sel if annotate else ():
                ax.annotate(f"{p['n']}", (p["intensity"], p["gflops"]), fontsize=6, xytext=(3, 2),
                            textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte, model of counts.attention_bytes)")
    ax.set_ylabel("throughput (GFLOP/s)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", lw=0.3)
    ax.legend(fontsize=6, loc="lower right")


def plot(points: list[dict], ceilings: dict, title: str, path) -> None:
    from .plotting import pyplot

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7.5, 5))
    draw(ax, points, ceilings, title)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ---------------------------------------------------------------- the command

ROOFLINE_HELP = """\
Measures this machine's ceilings and places every kernel against them.

Ceilings, on the kernels' thread count: the peak FMA rate of the native kernels'
instruction set (a register-only loop of 12 vector FMAs chains), NumPy's float32
matmul at 2048^3, and STREAM copy and triad bandwidth over 512 MiB arrays (far
beyond the last-level cache); on a GPU (--device cuda) torch's float32 matmul at
8192^3 (TF32 off) and device-to-device copy bandwidth, beside the datasheet.
The roof is min(peak FMA rate, intensity x triad bandwidth) (GPU: datasheet float32
peak, measured copy bandwidth).

Kernels are checked against float64 and timed as `attnkern bench` does (same
options). Each point: FLOPs (4 B H N^2 D, half causal) over the bytes its
algorithm moves by the model of attnkern_bench.counts.attention_bytes (q, k, v,
out once; materialised scores: a pass over B H N^2 elements per operation;
flash/tiled: K and V once per query block) gives its intensity; measured GFLOP/s
over the roof at that intensity is the fraction of the attainable bound.
"""


HELP = "measure compute and memory ceilings; place each kernel on the roofline"
DESCRIPTION = ROOFLINE_HELP


def configure(p: argparse.ArgumentParser) -> None:
    """The arguments of `attnkern roofline`."""
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--sizes", type=int, nargs="+", help="N (cpu: 512 1024 2048 4096; cuda: 1024 4096 16384)")
    p.add_argument("--heads", type=int, help="H (cpu 8, cuda 16)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--kernels", nargs="+")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--stream-mib", type=int, default=512, help="size of each STREAM array (cpu), far beyond the LLC")
    p.add_argument("--plot", metavar="PNG", help="write the log-log roofline plot here")
    p.add_argument("--json", help="write ceilings and points to this file")


def command(args) -> int:
    cuda = args.device == "cuda"
    if args.stream_mib < 1 or args.repeat < 1 or args.threads < 1:
        raise SystemExit("attnkern roofline: --stream-mib, --repeat and --threads must be at least 1")
    names = args.kernels or (["cuda.flash", "cuda.naive", "torch.sdpa", "torch.naive"] if cuda else
                             ["native.flash", "native.tiled", "native.naive", "numba.flash", "torch.sdpa",
                              "numpy.naive"])
    target = harness.CudaTarget() if cuda else harness.CpuTarget(args.threads)
    if not cuda:
        names = [n for n in names if attnkern.kernel_info(n)["available"]]
    print("# measuring ceilings ...", file=sys.stderr, flush=True)
    ceilings = cuda_ceilings() if cuda else cpu_ceilings(args.threads, args.stream_mib)
    print(f"# {target.describe()}")
    for key in ("fma_peak_gflops", "sgemm_gflops", "copy_gbs", "triad_gbs"):
        if key in ceilings:
            unit = "GB/s" if key.endswith("gbs") else "GFLOP/s"
            print(f"# {key.rsplit('_', 1)[0]:<10} {ceilings[key]:>10.1f} {unit}")
    if ceilings.get("datasheet"):
        print(f"# datasheet: {ceilings['datasheet']}")
    ridge = ceilings["peak_gflops"] / ceilings["bandwidth_gbs"]
    print(f"# roof: {ceilings['peak_gflops']:.0f} GFLOP/s, {ceilings['bandwidth_gbs']:.0f} GB/s; ridge at "
          f"{ridge:.1f} FLOP/byte")
    heads = args.heads or (16 if cuda else 8)
    cfg = harness.Settings(sizes=args.sizes or ([1024, 4096, 16384] if cuda else [512, 1024, 2048, 4096]),
                           heads=heads, dim=args.dim, causal=harness.causal_modes(args.causal), repeat=args.repeat,
                           passes=1 if cuda else 2, warmup=3 if cuda else 1, settle=0.0 if cuda else 0.3)
    rows = harness.run(target, target.candidates(names, args.dim, False), cfg, ceilings.get("sgemm_gflops", 1.0))
    points = place(rows, ceilings, cfg.batch, heads, args.dim)
    print(f"{'N':>6} {'causal':>6} {'kernel':<14} {'GFLOP':>8} {'MB moved':>9} {'FLOP/B':>7} {'GFLOP/s':>9} "
          f"{'roof':>9} {'of roof':>8} bound")
    for p in points:
        print(f"{p['n']:>6} {str(p['causal']):>6} {p['kernel']:<14} {p['gflops'] * p['median_s']:>8.2f} "
              f"{p['bytes'] / 1e6:>9.1f} {p['intensity']:>7.1f} {p['gflops']:>9.1f} {p['attainable_gflops']:>9.1f} "
              f"{p['fraction']:>8.1%} {p['bound']}")
    if args.plot:
        plot(points, ceilings, f"{target.describe()}; (1, {heads}, N, {args.dim}) float32", args.plot)
        print(f"# plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceilings": ceilings, "points": points}, f, indent=1)
    return 1 if any(r.get("ok") is False for r in rows) else 0
