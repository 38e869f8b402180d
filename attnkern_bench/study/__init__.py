"""The forward/backward study of attention training: time and memory of the
forward and of the backward over a grid of sequence lengths and head sizes, the
smallest configuration that runs out of memory, and a theoretical memory account
(the N x N scores that the naive graph saves for backward, the O(N) log-sum-exp
that FlashAttention-2 saves instead) to set beside the measured peaks.

    model.py       settings, the grid, account(kernel, ...): the memory model of one
                   kernel and configuration
    measuring.py   run_study(settings): every (N, d, kernel) measured, rows of plain
                   values; smallest_oom(rows): the smallest configuration out of memory
    output.py      the table, write_csv / write_markdown / write_plots
    configure, command  the `attnkern study` command (wired in cli.py)

On cuda every measurement runs in this process; on cpu each (kernel,
configuration) runs in a fresh Python process (as memory.py's probe does), so
that its resident set says what that configuration took. (Forking them from a
server that has imported torch would save the import, about 2.5 s a row, but
breaks the OpenMP thread pools of torch and of attnkern's native kernels in the
children: they run on one thread.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from .measuring import capacity_bytes, predicted_smallest_oom, run_study, smallest_oom
from .model import CSV_COLUMNS, MIB, Settings, default_kernels, has_backward, kernel_problem, settings_account
from .output import (
    account_focus,
    account_text,
    check_matplotlib,
    oom_lines,
    scaling_rows,
    scaling_text,
    table_header,
    table_line,
    write_csv,
    write_markdown,
    write_plots,
)

STUDY_HELP = """\
Times the forward and the backward of attention and measures their memory over a
grid of sequence lengths N (--seqs) and head sizes d (--dims): the study of
attention training that motivates FlashAttention-2's recomputation.

For each N, d and kernel (N ascending), on q, k, v of --dtype (float32) and shape
(--batch, --heads, N, d) that require grad, and an upstream gradient dout of the
output's shape made with them. --heads is 1 by default: one head, so d is the
model width d_model, as in the assignment this follows; with --heads H each of
the H heads has size d.
  memory  one forward and one out.backward(dout), after a small one (N <= 64)
          that loads code, starts threads and makes library handles: in use after
          the forward ("before backward") and the peak over forward + backward,
          both above what the process held before q, k, v and dout were made
          (so they include those inputs), in MiB.
          cuda: torch.cuda.memory_allocated() and max_memory_allocated() after
            reset_peak_memory_stats(): bytes of live tensors of torch's allocator
            (its cache and the CUDA context not counted).
          cpu (Linux): a fresh Python process per kernel and configuration; its
            resident set (VmRSS) and peak resident set (VmHWM, reset through
            /proc/self/clear_refs). For this its malloc gives every block of
            128 KiB or more a mapping of its own (mallopt M_MMAP_THRESHOLD), so
            that freed tensors leave the resident set as they leave
            memory_allocated on the GPU; smaller blocks and pages blur the
            smallest sizes.
  time    then --warmup untimed and --iters timed iterations, each a forward and
          out.backward(dout) timed separately (the gradients set to None between,
          outside the timings); the median of each.
          cuda: CUDA events around each region, which wait for its kernels; TF32
          off (no one-pass TF32; float32 forwards on tensor cores run 3xTF32).
          cpu: the wall clock, --threads threads for torch and attnkern alike;
          malloc's threshold set to 32 MiB first, where glibc's own goes once
          large blocks have been freed (as in a long training loop).
  out of memory  a configuration that runs out is recorded (status "oom" and the
          error) and the run goes on: cuda: torch.cuda.OutOfMemoryError (the cache
          emptied after); cpu: MemoryError or a failed allocation in the row's
          process, or the process killed. Once a kernel runs out at some N for a
          d, its larger N for that d are recorded as skipped, not tried
          (--no-skip-larger tries them). --memory-cap studies the boundary of a
          smaller device on a bigger one.
Kernels (--kernels; default torch.naive, torch.sdpa and attnkern's flash kernels
with a backward for the device: native.flash on cpu, cuda.flash and triton.flash
on cuda):
  torch.naive   softmax(q k^T * scale) v in torch ops under autograd, the N x N
                scores materialised (attnkern.backends.torch.naive_attention)
  torch.sdpa    torch.nn.functional.scaled_dot_product_attention (torch picks its
                fused backend; the JSON names the backward node, grad_fn)
  attnkern's    attnkern.attention(q, k, v, causal=, kernel=name,
                check_finite=False) on the torch tensors, differentiable through
                the kernel's backward (which recomputes the scores from the saved
                log-sum-exp). check_finite=False skips attnkern's scan of the
                inputs for NaN/inf, which the torch kernels do not make either.
Reported per row: status (ok, oom, error, skipped), forward and backward median
ms, GFLOP/s of forward + backward counting 4*B*H*N^2*d for the forward (half with
--causal; attnkern_bench.counts) and 2.5 times that for the backward
(FlashAttention-2's convention: five N^2*d matmuls, the recomputed scores
counted), MiB before backward and peak, and with --account the predicted peak
and predicted / measured. Then the smallest configuration out of memory per
kernel (smallest N, then d). Progress goes to stderr, the table to stdout.
--account also prints the memory model: every tensor of the forward and the
backward (which ones autograd saves), the peak over the steps of each, and how
the peak splits into N^2 and N terms as N grows.
"""


# ---------------------------------------------------------------- the command


HELP = ("forward/backward time and memory of attention training over N and d, the smallest out-of-memory "
        "configuration, a memory account")
DESCRIPTION = STUDY_HELP


def configure(p: argparse.ArgumentParser) -> None:
    """The arguments of `attnkern study`."""
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--batch", type=int, default=8, help="batch size B (default 8)")
    p.add_argument("--dims", type=int, nargs="+", default=[16, 32, 64, 128],
                   help="head sizes d; with one head (the default) d is d_model (default 16 32 64 128)")
    p.add_argument("--seqs", type=int, nargs="+", default=[256, 1024, 4096, 8192, 16384],
                   help="sequence lengths N (default 256 1024 4096 8192 16384: the GPU grid; on a small CPU try "
                        "--seqs 256 512 1024 --dims 16 64 --iters 5 --warmup 1)")
    p.add_argument("--heads", type=int, default=1, help="heads H, each of size d (default 1)")
    p.add_argument("--causal", action="store_true", help="causal mask (default none)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="q, k, v, dout and the gradients' dtype (default float32); a kernel without a backward "
                        "in it (kernel_info's backward_dtypes) is measured forward only, its backward columns "
                        "empty and the reason in the error column")
    p.add_argument("--kernels", nargs="+", help="torch.naive, torch.sdpa and attnkern kernels with a backward "
                                                "(default torch.naive torch.sdpa, then native.flash on cpu, "
                                                "cuda.flash and triton.flash on cuda)")
    p.add_argument("--warmup", type=int, default=10, help="untimed iterations before the timed ones (default 10)")
    p.add_argument("--iters", type=int, default=100, help="timed iterations (default 100)")
    p.add_argument("--threads", type=int, help="cpu: threads of torch and of attnkern's kernels (default: the CPUs "
                                               "this process may use)")
    p.add_argument("--memory-cap", type=float, metavar="GIB",
                   help="memory a configuration may take, in GiB (2^30 bytes). cuda: "
                        "torch.cuda.set_per_process_memory_fraction(cap / total), which bounds what torch's "
                        "allocator may reserve. cpu: each row's process gets RLIMIT_AS = its address space after "
                        "the warm-up + cap, and its malloc maps every block of 128 KiB or more on its own, also for "
                        "the timings; RLIMIT_AS counts virtual memory (address space reserved, touched or not: "
                        "malloc arenas, thread stacks), not the resident set, so the boundary is approximate")
    p.add_argument("--no-skip-larger", dest="skip_larger", action="store_false",
                   help="also try the N larger than one out of memory (for the same kernel and d)")
    p.add_argument("--account", action="store_true",
                   help="print the memory model: tensors of forward and backward, which are saved, the predicted "
                        "peak beside the measured, and its N^2 and N terms as N grows")
    p.add_argument("--json", help="write settings, rows, smallest OOMs and account to this JSON file")
    p.add_argument("--csv", help="write the rows to this CSV file (" + ", ".join(CSV_COLUMNS) + ")")
    p.add_argument("--markdown", help="write a Markdown report: the table, the smallest OOM per kernel, the account")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots (matplotlib) of forward, backward time and peak "
                                                  "memory against N, one file per d")


def command(args) -> int:
    """`attnkern study`: measures, prints, writes the files asked for; 1 if a row failed."""
    try:
        import torch
    except ImportError:
        raise SystemExit("attnkern study needs PyTorch: pip install 'attnkern[torch]'") from None
    if args.plots:
        check_matplotlib()  # fail before the measurements, not after
    if args.device == "cpu" and not os.path.exists("/proc/self/clear_refs"):
        raise SystemExit("attnkern study --device cpu measures memory through /proc/self (Linux)")
    if min(args.seqs + args.dims + [args.batch, args.heads]) < 1 or args.iters < 0 or args.warmup < 0:
        raise SystemExit("--seqs, --dims, --batch and --heads must be positive, --iters and --warmup not negative")
    from attnkern.hardware import cpu_count

    names = args.kernels or default_kernels(args.device)
    kernels = []
    for name in names:
        why = kernel_problem(name, args.device, args.dtype)
        if why is None:
            kernels.append(name)
            if not has_backward(name, args.dtype):
                print(f"# {name}: forward only (no {args.dtype} backward)")
        else:
            print(f"# skipping {name}: {why}")
    if not kernels:
        raise SystemExit("no kernel to study")
    cfg = Settings(batch=args.batch, heads=args.heads, dims=list(args.dims), seqs=sorted(args.seqs),
                   causal=args.causal, kernels=kernels, device=args.device, warmup=args.warmup, iters=args.iters,
                   threads=args.threads or cpu_count(), memory_cap_gib=args.memory_cap, skip_larger=args.skip_larger,
                   dtype=args.dtype)
    if cfg.device == "cuda":
        from ..harness import CudaTarget

        device = CudaTarget().describe()
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        device += f", {total / 2**30:.1f} GiB"
        how = "CUDA events; memory: torch.cuda.memory_allocated above the baseline"
    else:
        from ..harness import CpuTarget

        device = f"{CpuTarget(cfg.threads).describe()}, torch {torch.__version__}"
        how = "wall clock; memory: resident set above the baseline, a fresh process per row"
    setup = (f"batch {cfg.batch}, heads {cfg.heads}, {cfg.dtype}, causal {cfg.causal}; median of {cfg.iters} timed "
             f"iterations after {cfg.warmup} warm-up ({how})"
             + (f"; memory cap {cfg.memory_cap_gib:g} GiB" if cfg.memory_cap_gib is not None else ""))
    print(f"# {device}")
    print(f"# {setup}")
    width = max(12, *(len(k) for k in kernels))
    print(table_header(args.account, width), flush=True)
    rows = run_study(cfg, lambda row: print(table_line(row, args.account, width), flush=True))
    capacity = capacity_bytes(cfg)
    predicted = predicted_smallest_oom(cfg, capacity) if capacity is not None else None
    result = {"device": device, "setup": setup, "settings": asdict(cfg), "rows": rows,
              "smallest_oom": {k: (None if r is None else {"seq_len": r["seq_len"], "d_model": r["d_model"],
                                                            "error": r["error"]})
                               for k, r in smallest_oom(rows).items()},
              "predicted_smallest_oom": (None if predicted is None else
                                         {k: (None if p is None else {"seq_len": p[0], "d_model": p[1]})
                                          for k, p in predicted.items()}),
              "capacity_bytes": capacity}
    result["oom_lines"] = oom_lines(rows, cfg, predicted)
    print("# smallest configuration out of memory, per kernel"
          + (f" (capacity {capacity / MIB:.0f} MiB)" if capacity is not None else "") + ":")
    for line in result["oom_lines"]:
        print(f"#   {line}")
    n, d = account_focus(cfg, rows)
    accounts = [settings_account(cfg, k, n, d) for k in kernels]
    scaling = scaling_rows(cfg, max(cfg.dims))
    result["account"] = {"breakdown": [a.as_dict() for a in accounts], "scaling": scaling}
    if args.account:
        for acc in accounts:
            print()
            print("\n".join(account_text(acc)))
        print()
        print(f"## predicted peak by N (d={max(cfg.dims)}): the N^2 terms (scores) against the N terms")
        print("\n".join(scaling_text(scaling)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.csv:
        write_csv(args.csv, rows)
    if args.markdown:
        write_markdown(args.markdown, result, cfg)
    if args.plots:
        for path in write_plots(args.plots, rows, cfg, args.account):
            print(f"# plot: {path}", file=sys.stderr)
    errors = [r for r in rows if r["status"] == "error"]
    for r in errors:
        print(f"# ERROR: {r['kernel']} at N={r['seq_len']} d={r['d_model']}: {r['error']}", file=sys.stderr)
    return 1 if errors else 0
