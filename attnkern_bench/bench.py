"""attnkern bench: every kernel checked against the float64 reference, then
timed side by side with torch and NumPy (CPU) or torch, CuPy and the cuda.*
kernels (GPU), with the matmul ceiling of the same run (harness.py measures)."""

from __future__ import annotations

import argparse
import csv
import json
import sys

import numpy as np

import attnkern

from . import harness
from .memory import measure_memory

CPU_KERNELS = ["native.flash", "torch.sdpa", "numpy.naive"]
CUDA_KERNELS = ["torch.sdpa", *harness.SDPA_BACKENDS, "cuda.flash", "triton.flash", "cuda.naive", "torch.naive",
                "cupy.naive"]

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
          Python launch overhead in full; 5 or so: queued calls, as in a loop),
          in --passes round-robin passes (1 by default; --backward: 3).
          attnkern's cuda.* run through attnkern.attention with check_finite=False.
Reported: median time per call; GFLOP/s counting 4*B*H*N^2*D per forward (half
for causal); the fraction of a float32 matmul measured in the same run (NumPy's
2048^3 on the CPU, timed as one more turn among each row's kernels; torch's
8192^3 on the GPU, before the rows); speed-up over torch.sdpa and
numpy.naive where they ran; on the GPU also over torch.fastest: the fastest of
torch.sdpa (torch's own choice) and torch.sdpa[cudnn], [flash] and [efficient]
(each backend forced with torch.nn.attention.sdpa_kernel; one that refuses the
dtype or shape shows as failed) in that row. Progress goes to stderr, the table
to stdout.
"""


HELP = "check, then time kernels side by side (CPU or GPU)"
DESCRIPTION = BENCH_HELP


def configure(p: argparse.ArgumentParser) -> None:
    """The arguments of `attnkern bench`."""
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
    p.add_argument("--passes", type=int, help="round-robin passes over the kernels (default: cpu 2, cuda 1, "
                                              "cuda --backward 3)")
    p.add_argument("--no-ceiling", action="store_true",
                   help="do not measure the matmul ceiling (no %%matmul column): its worker, its measurement "
                        "alone and its turns among each row's kernels are most of a short CPU run's time")
    # 1 s: on a 2-core AMD EPYC, numpy.naive timed 0.3 s after torch.sdpa's turn ran 1.5-2x slower
    # than alone (and than in asv), 1 s after it as fast; OMP_WAIT_POLICY=passive did not help
    cpu.add_argument("--settle", type=float, default=1.0, help="seconds of pause before each kernel's turn "
                                                               "(lets the previous kernel's runtime go quiet)")
    cpu.add_argument("--memory", action="store_true", help="also measure native.flash's and native.tiled's peak "
                                                           "extra memory at (1, 1, --memory-n, D), in fresh processes")
    cpu.add_argument("--memory-n", type=int, default=65536)
    gpu = p.add_argument_group("cuda")
    gpu.add_argument("--back-to-back", type=int, default=1, help="calls per timed sample")
    gpu.add_argument("--sweep", action="store_true", help="also time every cuda.flash tile that fits")
    gpu.add_argument("--backward", action="store_true",
                     help="time cuda.flash's forward+backward and backward alone against every torch SDPA backend "
                          "(cuDNN, flash, efficient, math), with ratios to the fastest and the backward's TFLOP/s")
    p.add_argument("--json", help="write the rows (and memory) to this JSON file")
    p.add_argument("--csv", help="write the rows to this CSV file")


def command(args) -> int:
    cuda = args.device == "cuda"
    for name in ("repeat", "passes", "back_to_back"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.dtype == "float64" and cuda:
        raise SystemExit("--device cuda measures float32, float16 and bfloat16")
    if args.backward:
        if not cuda:
            raise SystemExit("--backward times the GPU backward: pass --device cuda")
        from . import backward_gpu

        backward_gpu.run(args.sizes or [1024, 4096, 16384], args.batch, args.heads or 16, args.dim, args.dtype,
                         harness.causal_modes(args.causal), args.repeat or 10, args.back_to_back, args.json,
                         passes=args.passes or 3)
        return 0
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
        causal=harness.causal_modes(args.causal), repeat=args.repeat or (10 if cuda else 5),
        passes=args.passes or (1 if cuda else 2), warmup=3 if cuda else 1, settle=0.0 if cuda else args.settle,
        calls_per_sample=args.back_to_back if cuda else 1, check_rows=args.check_rows, seed=args.seed,
        inputs=args.inputs)
    if args.inputs == "minilm":
        if max(cfg.sizes) > 512:
            raise SystemExit("--inputs minilm: N is at most 512 tokens (the model's positions)")
        cfg.batch, cfg.heads, cfg.dim = 6, 12, 32
    candidates = target.candidates(names, cfg.dim, args.sweep and cuda)
    ceiling_name, ceiling = (None, None) if args.no_ceiling else target.ceiling()
    peers = [p for p in harness.PEERS if p in [c.name for c in candidates]]
    if any(c.name in harness.SDPA_BACKENDS for c in candidates):
        peers.append(harness.FASTEST)  # the fastest torch SDPA backend of the row
    print(f"# {target.describe()}")
    if args.inputs == "minilm":
        from .realistic import capture, softmax_entropy

        c = capture(max(cfg.sizes))
        print(f"# inputs: all-MiniLM-L6-v2 q, k, v (layers x heads = batch x heads) on Python's docs; softmax "
              f"entropy {softmax_entropy(c['q'], c['k']):.2f} nats a row at N={max(cfg.sizes)} (uniform: "
              f"{np.log(max(cfg.sizes)):.2f})")
    print(f"# ({cfg.batch}, {cfg.heads}, N, {cfg.dim}) {cfg.dtype}; median of {cfg.passes} x {cfg.repeat} samples "
          f"({target.clock.name}); error = max|out - ref| / (max(1, max|v|) kappa) on {cfg.check_rows} rows")
    if ceiling is None:
        print("# ceiling: not measured (--no-ceiling)")
    elif hasattr(target, "ceiling_turn"):
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
        matmul = f"{row['gflops'] / row['ceiling_gflops']:>8.1%}" if "ceiling_gflops" in row else f"{'-':>8}"
        line += (f" {row['median_s'] * 1e3:>10.3f} {row['gflops']:>9.1f} {matmul}"
                 + "".join(f" {row.get(f'speedup_vs_{p}', float('nan')):>14.2f}x" for p in peers)
                 + f" {row['error']:>9.1e}" + ("" if row["ok"] else " FAIL"))
        print(line, flush=True)

    result = {"device": target.describe(),
              "ceiling": None if ceiling is None else {"name": ceiling_name, "gflops": ceiling},
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
