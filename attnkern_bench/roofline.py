"""The roofline: this machine's compute and memory ceilings, measured, and every
kernel placed against them.

Ceilings (CPU): the ISA's peak FMA rate (a register-only loop of the native
kernels' instruction set, attnkern.hardware.fma_peak), NumPy's
float32 matmul (sgemm, the practical compute ceiling), and STREAM-style copy and
triad bandwidth over arrays far beyond the last-level cache, all on the kernels'
thread count. GPU: torch's matmul in the kernels' dtype (float32 with TF32 off, or bfloat16/float16
on tensor cores) and device-to-device copy bandwidth, beside the datasheet figures; decode (--decode:
one query row against a long cache, grouped k/v heads) is placed by bandwidth.

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
from .counts import SCORE_PASSES, attention_bytes

# NVIDIA's datasheets (SXM, dense): float32 without tensor cores, float16/bfloat16 on tensor cores, HBM
# bandwidth; the H200 has the H100's chip with HBM3e
_HOPPER = {"float32_gflops": 67_000.0, "bfloat16_gflops": 989_400.0, "float16_gflops": 989_400.0}
DATASHEET = {"NVIDIA H100 80GB HBM3": {**_HOPPER, "bandwidth_gbs": 3_350.0},
             "NVIDIA H200": {**_HOPPER, "bandwidth_gbs": 4_800.0}}
GPU_DTYPES = ("float32", "bfloat16", "float16")


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


def cuda_ceilings(repeat: int = 10, dtype: str = "float32") -> dict:
    """The GPU's ceilings for kernels in dtype: torch's matmul at 8192^3 in it (float32 with TF32
    off), the datasheet's peak for it (the matmul where the GPU is not listed) and the measured
    device-to-device copy bandwidth."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    copy = cuda_copy_gbs(torch, repeat)
    name = torch.cuda.get_device_name()
    sheet = DATASHEET.get(name, {})
    matmul = cuda_sgemm_gflops(torch, dtype=getattr(torch, dtype))
    out = {"device": "cuda", "gpu": name, "dtype": dtype, "matmul_gflops": matmul, "copy_gbs": copy,
           "datasheet": sheet, "peak_gflops": sheet.get(f"{dtype}_gflops", matmul), "bandwidth_gbs": copy}
    if dtype == "float32":
        out["sgemm_gflops"] = matmul  # the name float32 rows have always had
    return out


def decode_points(kernels: list, nks: list, batches: list, heads: int, kv_heads: int, d: int, dtype: str,
                  ceilings: dict, repeat: int = 5, calls: int = 5) -> list[dict]:
    """KV-cache decode placed on the roofline: one query row a head against nk keys of kv_heads grouped
    k/v heads, (B, heads, 1, d) x (B, kv_heads, nk, d), each of `kernels` (attnkern's through
    attnkern.attention; torch's SDPA backends, harness.SDPA_BACKENDS, forced with enable_gqa) checked
    against float64 on the host, then timed in turns (CUDA events around `calls` back-to-back calls,
    the median of `repeat` samples). Its bytes: K and V read once, q and out once; at heads / kv_heads
    FLOPs a K/V element it sits far left of the ridge, so its fraction is of the copy bandwidth."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .accuracy import kernel_tolerance, scaled_error
    from .timing import CudaEventClock, medians, take_turns

    tdtype = getattr(torch, dtype)
    itemsize = torch.finfo(tdtype).bits // 8
    rng = np.random.default_rng(0)
    group = heads // kv_heads
    points = []
    for b in batches:
        for nk in nks:
            host = [rng.standard_normal(shape).astype(np.float32)
                    for shape in ((b, heads, 1, d), (b, kv_heads, nk, d), (b, kv_heads, nk, d))]
            q, k, v = (torch.from_numpy(x).cuda().to(tdtype) for x in host)
            # the float64 reference: a k/v head's `group` query heads (consecutive) as its query rows
            rq, rk, rv = (x.float().cpu().numpy() for x in (q, k, v))
            rq = rq.reshape(b, kv_heads, group, d)
            fns = {}
            for name in kernels:
                if name in harness.SDPA_BACKENDS:
                    def call(backend=getattr(SDPBackend, harness.SDPA_BACKENDS[name])):
                        with sdpa_kernel(backend):
                            return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                else:
                    def call(name=name):
                        return attnkern.attention(q, k, v, kernel=name, check_finite=False)
                try:
                    out = call()
                except (RuntimeError, ValueError) as e:  # a backend that refuses the shape
                    print(f"# decode: {name} at B={b} Nk={nk} refused: {str(e).splitlines()[0][:100]}",
                          file=sys.stderr)
                    continue
                err = scaled_error(out.float().cpu().numpy().reshape(b, kv_heads, group, d), rq, rk, rv)
                fns[name] = (call, err)
            seconds = medians(take_turns({n: f for n, (f, _) in fns.items()}, repeat=repeat, warmup=3,
                                         calls_per_sample=calls, clock=CudaEventClock(torch)))
            moved = (2 * b * kv_heads * nk * d + 2 * b * heads * d) * itemsize
            flops = 4.0 * b * heads * nk * d
            for name, (_, err) in fns.items():
                gbs = moved / seconds[name] / 1e9
                points.append({"batch": b, "heads": heads, "kv_heads": kv_heads, "nq": 1, "nk": nk, "d": d,
                               "kernel": name, "dtype": dtype, "median_s": seconds[name], "bytes": moved,
                               "gbs": gbs, "gflops": flops / seconds[name] / 1e9, "intensity": flops / moved,
                               "fraction": gbs / ceilings["bandwidth_gbs"], "error": err,
                               "ok": err <= kernel_tolerance(name.partition("[")[0], dtype)})
            del q, k, v
            torch.cuda.empty_cache()
    return points


def place(rows: list[dict], ceilings: dict, b: int, h: int, d: int, itemsize: int = 4) -> list[dict]:
    """Adds bytes, intensity, attainable and fraction to harness rows (they have n,
    causal, kernel and gflops). On a GPU the streaming kernels' K and V are read from
    DRAM once (the 50 MB L2 serves the other query blocks: ncu counted 0.05 of the
    per-block model for cuda.flash and torch's SDPA, docs/roofline.md), so their
    bytes are q, k, v and out once; the naive kernels' score passes stay."""
    out = []
    for r in rows:
        if "gflops" not in r:
            continue
        name = r["kernel"].split("[")[0]
        whole = r["n"] if ceilings.get("device") == "cuda" and name not in SCORE_PASSES else None
        try:
            moved = attention_bytes(name, b, h, r["n"], r["n"], d, itemsize, r["causal"], block_q=whole)
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
beyond the last-level cache); on a GPU (--device cuda) torch's matmul at 8192^3 in
--dtype (float32 with TF32 off; bfloat16, float16 on tensor cores) and device-to-device
copy bandwidth, beside the datasheet. The roof is min(peak FMA rate, intensity x triad
bandwidth) (GPU: the datasheet's peak for the dtype, measured copy bandwidth).

--decode (GPU): KV-cache decode, one query row a head against --decode-nk keys of 8
grouped k/v heads (B --decode-batches, 32 heads, D 128), each kernel checked against
float64 and timed in turns (CUDA events around 5 back-to-back calls, the median of
--repeat samples); its bytes are K and V read once, so it sits far left of the ridge
and its fraction is of the measured copy bandwidth.

Kernels are checked against float64 and timed as `attnkern bench` does (same
options). Each point: FLOPs (4 B H N^2 D, half causal) over the bytes its
algorithm moves by the model of attnkern_bench.counts.attention_bytes (q, k, v,
out once; materialised scores: a pass over B H N^2 elements per operation;
flash/tiled: K and V once per query block on the CPU, once on a GPU, whose L2
holds them for the other blocks) gives its intensity; measured GFLOP/s
over the roof at that intensity is the fraction of the attainable bound.
"""


HELP = "measure compute and memory ceilings; place each kernel on the roofline"
DESCRIPTION = ROOFLINE_HELP


def configure(p: argparse.ArgumentParser) -> None:
    """The arguments of `attnkern roofline`."""
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=GPU_DTYPES, default="float32", help="the kernels' dtype (cuda; cpu: float32)")
    p.add_argument("--decode", action="store_true", help="(cuda) also place KV-cache decode: (B, 32, 1, 128) "
                   "against (B, 8, Nk, 128), in --dtype (bfloat16 where that is float32)")
    p.add_argument("--decode-nk", type=int, nargs="+", default=[4096, 16384, 65536, 131072], metavar="NK")
    p.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8], metavar="B")
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
    if not cuda and (args.dtype != "float32" or args.decode):
        raise SystemExit("attnkern roofline: --dtype other than float32 and --decode are for --device cuda")
    if min(args.decode_nk) < 1 or min(args.decode_batches) < 1:
        raise SystemExit("attnkern roofline: --decode-nk and --decode-batches must be at least 1")
    half = args.dtype != "float32"
    names = args.kernels or (["cuda.flash", "triton.flash", *harness.SDPA_BACKENDS, "torch.naive"] if half else
                             ["cuda.flash", "cuda.naive", "torch.sdpa", "torch.naive"] if cuda else
                             ["native.flash", "native.tiled", "native.naive", "numba.flash", "torch.sdpa",
                              "numpy.naive"])
    target = harness.CudaTarget(args.dtype) if cuda else harness.CpuTarget(args.threads)
    if not cuda:
        names = [n for n in names if attnkern.kernel_info(n)["available"]]
    print("# measuring ceilings ...", file=sys.stderr, flush=True)
    ceilings = cuda_ceilings(dtype=args.dtype) if cuda else cpu_ceilings(args.threads, args.stream_mib)
    print(f"# {target.describe()}")
    for key in ("fma_peak_gflops", "matmul_gflops" if cuda else "sgemm_gflops", "copy_gbs", "triad_gbs"):
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
                           heads=heads, dim=args.dim, dtype=args.dtype, causal=harness.causal_modes(args.causal),
                           repeat=args.repeat, passes=1 if cuda else 2, warmup=3 if cuda else 1,
                           settle=0.0 if cuda else 0.3)
    rows = harness.run(target, target.candidates(names, args.dim, False), cfg,
                       ceilings.get("matmul_gflops", ceilings.get("sgemm_gflops", 1.0)))
    points = place(rows, ceilings, cfg.batch, heads, args.dim, 2 if half else 4)
    print(f"{'N':>6} {'causal':>6} {'kernel':<14} {'GFLOP':>8} {'MB moved':>9} {'FLOP/B':>7} {'GFLOP/s':>9} "
          f"{'roof':>9} {'of roof':>8} bound")
    for p in points:
        print(f"{p['n']:>6} {str(p['causal']):>6} {p['kernel']:<14} {p['gflops'] * p['median_s']:>8.2f} "
              f"{p['bytes'] / 1e6:>9.1f} {p['intensity']:>7.1f} {p['gflops']:>9.1f} {p['attainable_gflops']:>9.1f} "
              f"{p['fraction']:>8.1%} {p['bound']}")
    decode = []
    if args.decode:
        chosen = args.kernels or ["cuda.flash", "triton.flash", *harness.SDPA_BACKENDS]
        decode = decode_points([k for k in chosen if k.startswith(("cuda.", "triton.")) or k in harness.SDPA_BACKENDS],
                               args.decode_nk, args.decode_batches, 32, 8, 128, args.dtype if half else "bfloat16",
                               ceilings, repeat=args.repeat)
        print(f"{'B':>3} {'Nk':>7} {'decode kernel':<22} {'MB moved':>9} {'us':>8} {'GB/s':>8} {'of copy':>8} ok")
        for p in decode:
            print(f"{p['batch']:>3} {p['nk']:>7} {p['kernel']:<22} {p['bytes'] / 1e6:>9.1f} "
                  f"{p['median_s'] * 1e6:>8.1f} {p['gbs']:>8.0f} {p['fraction']:>8.1%} {p['ok']}")
    if args.plot:
        shown = points + [{**p, "n": p["nk"], "causal": False, "kernel": p["kernel"] + " decode"} for p in decode]
        plot(shown, ceilings, f"{target.describe()}; (1, {heads}, N, {args.dim}) {args.dtype}", args.plot)
        print(f"# plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceilings": ceilings, "points": points, "decode": decode}, f, indent=1)
    return 1 if any(r.get("ok") is False for r in rows + decode) else 0
