"""The attnkern command: measurements of attnkern's kernels on this machine.

    attnkern bench                      CPU kernels side by side with torch and NumPy
    attnkern bench --device cuda        GPU kernels side by side with torch and CuPy
    attnkern kernels                    every kernel, whether it runs here, its tunables
    attnkern tune                       search a kernel's block sizes and threads, cached for attention()
    attnkern roofline                   this machine's compute and memory ceilings, each kernel against them
    attnkern study                      forward and backward time and memory of attention training
    attnkern report                     a two-page PDF and an HTML page of the results above
    attnkern ring                       ring attention over W processes: memory, overlap, balance

`attnkern <command> --help` says what each measures and how.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys

import numpy as np

import attnkern

from . import harness
from .memory import measure_memory
from .ring import ring_parser
from .study import study_parser

CPU_KERNELS = ["native.flash", "torch.sdpa", "numpy.naive"]
CUDA_KERNELS = ["torch.sdpa", "cuda.flash", "triton.flash", "cuda.naive", "torch.naive", "cupy.naive"]

BENCH_HELP = """\
Checks every kernel against the float64 reference, then times it, side by side.

For each sequence length N and mask, on (B, H, N, D) inputs drawn from a seeded
normal distribution:
  check   each kernel's output on --check-rows sampled query rows (all heads, all
          keys, the first and last row included) against attnkern.reference in
          float64: error = max|out - ref| / (max(1, max|v|) * kappa), where kappa
          grows with |scale||q||k|; ok when within attnkern_bench.accuracy's bound
          for the dtype and kernel (2^7 unit roundoffs: 7.6e-6 float32, 1.4e-14
          float64; float16/bfloat16 2u, or 4u for kernels that round the
          probabilities to the dtype). The command exits 1 if any kernel fails.
  time    CPU: every kernel with the same thread count (BLAS threads pinned with
          threadpoolctl, torch's and ours through num_threads); kernels take
          turns, round-robin over --passes passes, each turn a --settle pause,
          an untimed call and --repeat timed calls (wall clock), so drift of a
          shared machine hits all alike.
          cuda: one kernel at a time on torch CUDA tensors (TF32 off: no
          one-pass TF32 anywhere; float32 products are exact or 3xTF32, which
          torch's SDPA and attnkern's default float32 kernels use on tensor
          cores), 3 untimed calls, then --repeat samples timed with
          CUDA events, each around --back-to-back calls (1: isolated calls,
          Python launch overhead in full; 5 or so: queued calls, as in a loop).
          attnkern's cuda.* run through attnkern.attention with check_finite=False.
Reported: median time per call; GFLOP/s counting 4*B*H*N^2*D per forward (half
for causal); the fraction of a float32 matmul measured in the same run (NumPy's
2048^3 on the CPU, timed as one more turn among each row's kernels; torch's
8192^3 on the GPU, before the rows); speed-up over torch.sdpa and
numpy.naive where they ran. Progress goes to stderr, the table to stdout.
"""


def _causal(value: str) -> tuple[bool, ...]:
    return {"both": (False, True), "yes": (True,), "no": (False,)}[value]


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="check, then time kernels side by side (CPU or GPU)", description=BENCH_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--sizes", type=int, nargs="+", help="sequence lengths N (cpu: 512 1024 2048 4096; "
                                                          "cuda: 1024 4096 16384)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, help="heads H (cpu: 8, cuda: 16)")
    p.add_argument("--dim", type=int, default=64, help="head size D")
    p.add_argument("--dtype", choices=["float32", "float64", "float16", "bfloat16"], default="float32",
                   help="cuda: float32, float16 or bfloat16 (inputs drawn in float32 and rounded to it); "
                        "cpu: any (float16/bfloat16: the kernels that take them beside torch's SDPA in that "
                        "dtype, %%matmul against torch's matmul in that dtype)")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--kernels", nargs="+", help=f"cpu: registry names (default {' '.join(CPU_KERNELS)}); "
                                                f"cuda: cuda.* and the peers {' '.join(CUDA_KERNELS)}")
    p.add_argument("--repeat", type=int, help="timed samples per kernel, configuration and pass (cpu 5, cuda 10)")
    p.add_argument("--check-rows", type=int, default=64, help="query rows per head checked against float64")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs and sampled rows")
    p.add_argument("--inputs", choices=["random", "minilm"], default="random",
                   help="random normal q, k, v; or minilm: those of all-MiniLM-L6-v2's 6 layers x 12 heads "
                        "(D = 32) on the Python docs' text, N tokens (at most 512; cached), which sets B, H, D")
    cpu = p.add_argument_group("cpu")
    cpu.add_argument("--threads", type=int, default=2, help="threads of every kernel")
    cpu.add_argument("--passes", type=int, default=2, help="round-robin passes over the kernels")
    cpu.add_argument("--settle", type=float, default=0.3, help="seconds of pause before each kernel's turn")
    cpu.add_argument("--memory", action="store_true", help="also measure native.flash's and native.tiled's peak "
                                                           "extra memory at (1, 1, --memory-n, D), in fresh processes")
    cpu.add_argument("--memory-n", type=int, default=65536)
    gpu = p.add_argument_group("cuda")
    gpu.add_argument("--back-to-back", type=int, default=1, help="calls per timed sample")
    gpu.add_argument("--sweep", action="store_true", help="also time every cuda.flash tile that fits")
    p.add_argument("--json", help="write the rows (and memory) to this JSON file")
    p.add_argument("--csv", help="write the rows to this CSV file")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    cuda = args.device == "cuda"
    if args.dtype == "float64" and cuda:
        raise SystemExit("--device cuda measures float32, float16 and bfloat16")
    names = args.kernels or (CUDA_KERNELS if cuda else CPU_KERNELS)
    target = harness.CudaTarget(args.dtype) if cuda else harness.CpuTarget(args.threads, args.dtype)
    if not cuda:
        for name in names:
            attnkern.kernel_info(name)  # an unknown name fails here, before any timing
        for name in [n for n in names if not attnkern.kernel_info(n)["available"]]:
            print(f"# skipping {name}: {attnkern.kernel_info(name)['reason']}")
            names = [n for n in names if n != name]
        for name in [n for n in names if n != "torch.sdpa" and args.dtype not in attnkern.kernel_info(n)["dtypes"]]:
            print(f"# skipping {name}: it does not take {args.dtype}")  # torch.sdpa: the harness runs it in any
            names = [n for n in names if n != name]
    elif any(not attnkern.kernel_info(n)["available"] for n in names if n.startswith("cuda.")):
        raise SystemExit(f"cuda.* kernels are not available: {attnkern.kernel_info('cuda.flash')['reason']}")
    else:
        for name in ([n for n in names if n.startswith("cuda.") and args.dtype not in attnkern.kernel_info(n)["dtypes"]]
                     + [n for n in names if n.startswith("triton.") and not attnkern.kernel_info(n)["available"]]):
            print(f"# skipping {name}: {attnkern.kernel_info(name)['reason'] or 'not for ' + args.dtype}")
            names = [n for n in names if n != name]
    cfg = harness.Settings(
        sizes=args.sizes or ([1024, 4096, 16384] if cuda else [512, 1024, 2048, 4096]),
        batch=args.batch, heads=args.heads or (16 if cuda else 8), dim=args.dim, dtype=args.dtype,
        causal=_causal(args.causal), repeat=args.repeat or (10 if cuda else 5),
        passes=1 if cuda else args.passes, warmup=3 if cuda else 1, settle=0.0 if cuda else args.settle,
        calls_per_sample=args.back_to_back if cuda else 1, check_rows=args.check_rows, seed=args.seed,
        inputs=args.inputs)
    if args.inputs == "minilm":
        if max(cfg.sizes) > 512:
            raise SystemExit("--inputs minilm: N is at most 512 tokens (the model's positions)")
        cfg.batch, cfg.heads, cfg.dim = 6, 12, 32
    candidates = target.candidates(names, cfg.dim, args.sweep and cuda)
    ceiling_name, ceiling = target.ceiling()
    peers = [p for p in harness.PEERS if p in [c.name for c in candidates]]
    print(f"# {target.describe()}")
    if args.inputs == "minilm":
        from .realistic import capture, softmax_entropy

        c = capture(max(cfg.sizes))
        print(f"# inputs: all-MiniLM-L6-v2 q, k, v (layers x heads = batch x heads) on Python's docs; softmax "
              f"entropy {softmax_entropy(c['q'], c['k']):.2f} nats a row at N={max(cfg.sizes)} (uniform: "
              f"{np.log(max(cfg.sizes)):.2f})")
    print(f"# ({cfg.batch}, {cfg.heads}, N, {cfg.dim}) {cfg.dtype}; median of {cfg.passes} x {cfg.repeat} samples "
          f"({target.clock.name}); error = max|out - ref| / (max(1, max|v|) kappa) on {cfg.check_rows} rows")
    if hasattr(target, "ceiling_turn"):
        print(f"# ceiling: {ceiling_name}, timed in turns with each row's kernels (%matmul); alone before the "
              f"rows: {ceiling:.1f} GFLOP/s")
    else:
        print(f"# ceiling: {ceiling_name}: {ceiling:.1f} GFLOP/s")
    width = max(14, *(len(c.name) for c in candidates))
    head = f"{'N':>6} {'causal':>6} {'kernel':<{width}} {'median ms':>10} {'GFLOP/s':>9} {'%matmul':>8}"
    print(head + "".join(f" {'vs ' + p:>15}" for p in peers) + f" {'error':>9}")

    def emit(row):
        line = f"{row['n']:>6} {str(row['causal']):>6} {row['kernel']:<{width}}"
        if "failed" in row:
            print(f"{line} failed: {row['failed']}", flush=True)
            return
        line += (f" {row['median_s'] * 1e3:>10.3f} {row['gflops']:>9.1f} {row['gflops'] / row['ceiling_gflops']:>8.1%}"
                 + "".join(f" {row.get(f'speedup_vs_{p}', float('nan')):>14.2f}x" for p in peers)
                 + f" {row['error']:>9.1e}" + ("" if row["ok"] else " FAIL"))
        print(line, flush=True)

    result = {"device": target.describe(), "ceiling": {"name": ceiling_name, "gflops": ceiling},
              "rows": harness.run(target, candidates, cfg, ceiling, emit)}
    if args.memory and not cuda:
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
    if args.csv:
        fields = sorted({key for row in result["rows"] for key in row})
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(result["rows"])
    bad = [r for r in result["rows"] if r.get("ok") is False]
    for r in bad:
        print(f"# FAIL: {r['kernel']} at N={r['n']} causal={r['causal']}: error {r['error']:.2e}", file=sys.stderr)
    return 1 if bad else 0


TUNE_HELP = """\
Searches a kernel's tunables for one problem on this machine and caches the result,
which attnkern.attention then uses for calls of that kernel, dtype, mask and shape
bucket (attnkern.kernel_info(kernel)["tuned"] lists them; ATTNKERN_NO_TUNED=1 ignores them).

The search (attnkern_bench.tuner) starts from the kernel's defaults and alternates
Optuna's TPE sampler with one-step moves from the best so far over a lattice of
powers of two (block_q, block_k, num_threads; cuda.flash: the tiles that fit).
Each configuration is timed with --repeats calls after an untimed one (wall clock;
CUDA events on the GPU) on seeded random inputs; one clearly slower after two calls
is stopped early. Configurations within the noise of the best are timed again in
turns, and a tie goes to the default (else the one nearest it). The budget counts
configurations (default: 15% of the lattice).

--record-grid FILE times every configuration instead (5 passes in a seeded random
order, 2 calls each); --replay FILE replays the tuner and a random search of the
same budget against such a file over --seeds seeds, without running the kernel.
"""


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is like 1x8x1024x64 (B x H x N x D), got {text!r}") from None
    if not 2 <= len(dims) <= 4 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"a shape has 2 to 4 positive sizes, ..., N, D; got {text!r}")
    return dims


def _tune_parser(sub) -> None:
    p = sub.add_parser("tune", help="search a kernel's block sizes and threads; cache the best for attention()",
                       description=TUNE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=_shape, default=(1, 8, 1024, 64), help="q's shape, B x H x N x D (1x8x1024x64)")
    p.add_argument("--k-shape", type=_shape, help="k's shape if not q's")
    p.add_argument("--kernel", default="native.flash")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--budget", type=int, help="configurations to time (default: 15%% of the lattice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=5, help="timed calls per configuration")
    p.add_argument("--no-cache", action="store_true", help="report only; do not store the result")
    p.add_argument("--record-grid", metavar="FILE", help="time the whole lattice into FILE (JSON)")
    p.add_argument("--replay", metavar="FILE", help="replay searches against a recorded grid")
    p.add_argument("--seeds", type=int, default=20, help="seeds of --replay")
    p.add_argument("--plots", metavar="DIR", help="write plots here (a heatmap of a grid, best so far of a replay)")
    p.add_argument("--json", help="write the result to this file")
    p.set_defaults(func=cmd_tune)


def cmd_tune(args) -> int:
    import os

    from . import tuner

    if args.plots:
        os.makedirs(args.plots, exist_ok=True)
    if args.replay:
        with open(args.replay) as f:
            recorded = json.load(f)
        ev = tuner.evaluate(recorded, seeds=range(args.seeds), budget=args.budget, repeats=args.repeats)
        p = recorded["problem"]
        name = f"{recorded['kernel']} {'x'.join(map(str, p['q_shape']))}{' causal' if p['causal'] else ''}"
        print(f"# {name} on {recorded['machine']['cpu']}: grid of {ev['grid_size']}, budget {ev['budget']} "
              f"({ev['budget'] / ev['grid_size']:.0%}), {ev['seeds']} seeds; the default is {ev['default_ratio']:.3f}x "
              "the grid's best")
        print(f"{'search':<14} {'within 3%':>10} {'median time / best':>19}")
        for label, key in (("tuner", "tuner"), ("random search", "random")):
            print(f"{label:<14} {ev[f'{key}_within']:>10.0%} {ev[f'{key}_median_ratio']:>19.3f}")
        if args.plots:
            path = os.path.join(args.plots, f"replay-{os.path.splitext(os.path.basename(args.replay))[0]}.png")
            tuner.plot_replay(ev, f"{name}: {ev['seeds']} seeds", path)
            print(f"# plot: {path}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(ev, f, indent=1)
        return 0
    if args.record_grid:
        recorded = tuner.record_grid(args.kernel, args.shape, args.k_shape, dtype=args.dtype, causal=args.causal,
                                     seed=args.seed, progress=tuner.stderr)
        with open(args.record_grid, "w") as f:
            json.dump(recorded, f, indent=1)
        best = min(recorded["records"], key=lambda r: sorted(r["samples"])[len(r["samples"]) // 2])
        print(f"# {len(recorded['records'])} configurations into {args.record_grid}; fastest {best['params']}")
        if args.plots:
            path = os.path.join(args.plots, f"grid-{os.path.splitext(os.path.basename(args.record_grid))[0]}.png")
            tuner.plot_grid(recorded, path)
            print(f"# heatmap: {path}")
        return 0
    result = tuner.tune(args.shape, args.k_shape, kernel=args.kernel, dtype=args.dtype, causal=args.causal,
                        budget=args.budget, seed=args.seed, repeats=args.repeats, cache=not args.no_cache,
                        progress=tuner.stderr)
    print(f"# {args.kernel} q {'x'.join(map(str, args.shape))} {args.dtype}{' causal' if args.causal else ''} on "
          f"{result.machine['cpu']} ({result.machine['isa']}, {result.machine['cpus']} CPUs)")
    print(f"# {result.trials} of {result.grid_size} configurations timed in {result.wall_seconds:.1f} s")
    print(f"{'':<9} {'params':<40} {'median ms':>10}")
    print(f"{'default':<9} {tuner.fmt(result.default):<40} {result.default_seconds * 1e3:>10.3f}")
    print(f"{'tuned':<9} {tuner.fmt(result.params):<40} {result.seconds * 1e3:>10.3f}   "
          f"({result.speedup:.2f}x the default)")
    print(f"# cached as {result.cache_key}" if result.cache_key else "# not cached (--no-cache)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_json(), f, indent=1)
    return 0


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


def _roofline_parser(sub) -> None:
    p = sub.add_parser("roofline", help="measure compute and memory ceilings; place each kernel on the roofline",
                       description=ROOFLINE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.set_defaults(func=cmd_roofline)


def cmd_roofline(args) -> int:
    from . import roofline

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
    ceilings = roofline.cuda_ceilings() if cuda else roofline.cpu_ceilings(args.threads, args.stream_mib)
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
                           heads=heads, dim=args.dim, causal=_causal(args.causal), repeat=args.repeat,
                           passes=1 if cuda else 2, warmup=3 if cuda else 1, settle=0.0 if cuda else 0.3)
    rows = harness.run(target, target.candidates(names, args.dim, False), cfg, ceilings.get("sgemm_gflops", 1.0))
    points = roofline.place(rows, ceilings, cfg.batch, heads, args.dim)
    print(f"{'N':>6} {'causal':>6} {'kernel':<14} {'GFLOP':>8} {'MB moved':>9} {'FLOP/B':>7} {'GFLOP/s':>9} "
          f"{'roof':>9} {'of roof':>8} bound")
    for p in points:
        print(f"{p['n']:>6} {str(p['causal']):>6} {p['kernel']:<14} {p['gflops'] * p['median_s']:>8.2f} "
              f"{p['bytes'] / 1e6:>9.1f} {p['intensity']:>7.1f} {p['gflops']:>9.1f} {p['attainable_gflops']:>9.1f} "
              f"{p['fraction']:>8.1%} {p['bound']}")
    if args.plot:
        roofline.plot(points, ceilings, f"{target.describe()}; (1, {heads}, N, {args.dim}) float32", args.plot)
        print(f"# plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceilings": ceilings, "points": points}, f, indent=1)
    return 1 if any(r.get("ok") is False for r in rows) else 0


def report_doc() -> str:
    from . import report

    return report.__doc__


def _report_parser(sub) -> None:
    p = sub.add_parser("report", help="a two-page PDF, an HTML page and a text summary of the other commands' results",
                       description=report_doc(),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="make short runs of bench, roofline, study and tune first")
    for name in ("bench", "bench-minilm", "roofline", "tune-grid", "tune-replay", "study"):
        p.add_argument(f"--{name}", metavar="JSON", help=f"the JSON file of `attnkern {name.split('-')[0]}`")
    p.add_argument("--out", default="bench-results/report", help="directory of report.pdf, .html and .txt")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_report)


def cmd_report(args) -> int:
    from pathlib import Path

    from . import report

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = {k.replace("-", "_"): getattr(args, k.replace("-", "_")) for k in
             ("bench", "bench-minilm", "roofline", "tune-grid", "tune-replay", "study")}
    if args.quick:
        files = {**report.quick_inputs(out, args.threads, args.seed), **{k: v for k, v in files.items() if v}}
    if not any(files.values()):
        raise SystemExit("attnkern report: give result files (--bench, --roofline, ...) or --quick")
    written = report.write(report.load_all(files), report.header(args.seed, args.threads), out)
    print(Path(written["txt"]).read_text())
    for kind, path in written.items():
        print(f"# {kind}: {path}")
    return 0


def _kernels_parser(sub) -> None:
    p = sub.add_parser("kernels", help="list every kernel, whether it runs here and its tunables",
                       description="Lists attnkern's kernels (attnkern.kernels()) with kernel_info(): whether each "
                                   "runs on this machine (and why not), and its tunables with defaults and ranges. "
                                   "Measures nothing.")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_kernels)


def cmd_kernels(args) -> int:
    infos = [attnkern.kernel_info(name) for name in attnkern.kernels()]
    if args.json:
        print(json.dumps(infos, indent=2))
        return 0
    print(f"# native ISA: {attnkern.active_isa()} (this CPU and build: {', '.join(attnkern.supported_isas())})")
    for info in infos:
        state = "available" if info["available"] else f"unavailable: {info['reason']}"
        extras = [x for x, on in (("lse", info["returns_lse"]), ("backward", info["backward"])) if on]
        print(f"{info['name']:<14} {info['device']:<5} {state}" + (f" [{', '.join(extras)}]" if extras else ""))
        print(f"{'':<14} {info['description']}")
        for pname, p in info["params"].items():
            allowed = ", ".join(map(str, p["choices"])) if "choices" in p else f"{p['min']}..{p['max']}"
            print(f"{'':<14}   {pname}={p['default']} ({allowed}): {p['doc']}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnkern", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"attnkern {attnkern.__version__}")
    sub = p.add_subparsers(dest="command", metavar="command", required=True)
    _bench_parser(sub)
    _kernels_parser(sub)
    _tune_parser(sub)
    _roofline_parser(sub)
    _report_parser(sub)
    study_parser(sub)
    ring_parser(sub)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `attnkern ... | head`: the reader has gone; say nothing more
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
