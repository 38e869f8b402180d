"""attnkern ring: ring attention on W processes, checked and measured.

For each world size W (local processes on gloo, pinned to equal shares of this
machine's CPUs; or the ranks of a torchrun job), each layout and mask, every rank
builds its shards of a (B, H, N, D) problem (the same values for every W: each
chunk of the sequence is drawn from its own seed), then:

  warm-up  one untimed call (forward, or forward and backward with --backward);
  time     --repeat calls, each started together (a barrier): the wall time per
           call on each rank, and inside it the time in the local kernels and
           merges (compute) and the time left waiting for transfers after the
           local work was done (exposed communication); overlap efficiency is
           compute / (compute + exposed);
  memory   the rank's peak memory during the timed calls above what it held
           before them (after the warm-up, heap trimmed), plus its shards of
           q, k, v (and dout)
           (Linux: VmHWM reset through /proc/self/clear_refs after malloc_trim; on
           a GPU torch's peak allocation): the ring's buffers, outputs, the
           kernel's work; reported with the shards' bytes added;
  bytes    payload sent per ring step, against the model 2 (N/W) B H D itemsize;
  check    sampled rows of each rank's output against attnkern.reference on the
           whole sequence in float64 (rows as the kernel's accuracy bound
           scales them: attnkern_bench.accuracy).

Reported per (W, layout, mask): the median step time (the slowest rank's),
compute and exposed communication (the mean over ranks), overlap efficiency,
each rank's busy (compute) time and the imbalance max/mean, bytes per step and
the model, peak memory per rank (the largest), and the check's error.

On a machine with fewer cores than ranks the ranks share cores: times then
measure the sharing as much as the ring, while memory, bytes and the causal
balance of the layouts do not depend on it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from .accuracy import tolerance

FIELDS = ["world_size", "kernel", "seq", "dim", "layout", "causal", "backward", "time_s", "compute_s", "exposed_s", "overlap",
          "busy_s", "imbalance", "bytes_per_step", "bytes_model", "peak_bytes", "shard_bytes", "max_error",
          "ranks_per_core"]


ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def chunk_inputs(seed: int, lead, chunk: int, d: int, dtype: str, chunks) -> list:
    """q, k, v and dout rows of the given chunks of the sequence, concatenated, as torch
    CPU tensors of dtype (a name: bfloat16 and float16 are the float32 draws rounded);
    chunk c is drawn from seed (seed, c) alone, so every layout and W sees the same problem."""
    import torch

    parts = []
    for c in chunks:
        rng = np.random.default_rng([seed, c])
        parts.append([rng.standard_normal((*lead, chunk, d)).astype(np.float64 if dtype == "float64" else np.float32)
                      for _ in range(4)])
    return [torch.from_numpy(np.ascontiguousarray(np.concatenate([p[i] for p in parts], axis=-2))).to(
        getattr(torch, dtype)) for i in range(4)]


def ring_tolerance(dtype: str) -> float:
    """The check's bound: the kernels' for float32/float64; for the half dtypes the bound
    of a kernel that rounds the probabilities (cuda.flash's tensor cores; the CPU blocks
    run on float32 copies and meet the tighter one)."""
    return tolerance(dtype, rounds_p=dtype in ("bfloat16", "float16"))


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


class _Peak:
    """The peak memory of a block above the memory at its start: torch's allocator on a
    GPU (its cache emptied first), the resident set on the CPU (Linux; freed heap
    returned to the system first, so that memory an earlier problem left cached in
    the allocator cannot hide this one's)."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        import gc

        gc.collect()
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.before = torch.cuda.memory_allocated(self.device)
        else:
            _trim_heap()
            self.before = _status("VmRSS")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM := VmRSS
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self.before
        else:
            self.bytes = _status("VmHWM") - self.before


def _trim_heap() -> None:
    """glibc's malloc_trim(0): gives freed heap pages back to the system."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the peak may then read low
        pass


def measure_rank(config: dict) -> list[dict]:
    """Runs on every rank of an initialized group: the measurements above for each
    (layout, causal) of config, as this rank saw them."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = config["dtype"]
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if config["device"] == "cuda" else "cpu")
    params = {"num_threads": config["threads"]} if config.get("threads") else {}
    rows = []
    for kernel in config["kernels"]:
        for n in config["seqs"]:
            for d in config["dims"]:
                problem = {**config, "seq": n, "dim": d, "kernel": kernel}
                for layout in config["layouts"]:
                    rows += _measure_layout(problem, layout, rank, world, dtype, device, params)
    return rows


def _measure_layout(config, layout, rank, world, dtype, device, params) -> list[dict]:
    import torch
    import torch.distributed as dist

    import attnkern
    from attnkern.distributed import RingStats, chunks_of, ring_attention
    from attnkern.distributed.layout import check_length

    from .accuracy import scaled_error
    from .inputs import sample_rows

    lead, n, d, kernel = (config["batch"], config["heads"]), config["seq"], config["dim"], config["kernel"]
    chunk = check_length(n, layout, world)
    mine = chunks_of(layout, rank, world)
    rows = []
    for causal in config["causal"]:
        q, k, v, dout = (x.to(device) for x in chunk_inputs(config["seed"], lead, chunk, d, dtype, mine))
        def call(stats=None):
            if config["backward"]:
                tensors = [x.detach().requires_grad_() for x in (q, k, v)]
                out = ring_attention(*tensors, causal=causal, layout=layout, kernel=kernel, stats=stats, **params)
                out.backward(dout)
                return out.detach()
            with torch.no_grad():
                return ring_attention(q, k, v, causal=causal, layout=layout, kernel=kernel, stats=stats, **params)

        call()  # warm-up: code paged in, threads and connections made, outside the memory window
        peak = _Peak(device).__enter__()  # the timed calls: what the ring needs beside the shards
        times, stats_list = [], []
        for _ in range(config["repeat"]):
            stats = RingStats()
            dist.barrier()
            start = time.perf_counter()
            out = call(stats)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
            stats_list.append(stats)
        peak.__exit__(None, None, None)
        steps = _profile_steps(call, stats_list, config.get("profile_steps", False), world)
        error = _check(out, config, layout, causal, rank, world, chunk, attnkern, scaled_error, sample_rows)
        first = stats_list[0].per_step
        rows.append({
            "rank": rank, "kernel": kernel, "seq": n, "dim": d, "layout": layout, "causal": causal,
            "time_s": statistics.median(times),
            "compute_s": statistics.median(s.compute_s for s in stats_list),
            "exposed_s": statistics.median(s.wait_s for s in stats_list),
            "bytes_per_step": first[0][2] if world > 1 else 0,
            "bytes_sent": stats_list[0].bytes_sent,
            "peak_bytes": peak.bytes,
            "shard_bytes": sum(x.numel() * x.element_size() for x in (q, k, v, dout)),
            "max_error": error,
            **steps,
        })
        del q, k, v, dout, out
    return rows


def _profile_steps(call, stats_list, enabled: bool, world: int) -> dict:
    """With --profile-steps: each ring step's (compute, exposed communication) in the timed
    calls (medians over them; the forward's steps, then the backward's), and the same
    steps of one more call that waits for each step's transfer before computing
    (RingStats.serial): (compute, transfer), the communication's whole time."""
    if not enabled:
        return {}
    from attnkern.distributed import RingStats

    overlapped = [[statistics.median(s.per_step[i][j] for s in stats_list) for j in (0, 1)]
                  for i in range(len(stats_list[0].per_step))]
    serial = RingStats(serial=True)
    call(serial)
    return {"steps": overlapped, "steps_serial": [[c, w] for c, w, _ in serial.per_step]}


def steps_table(rows: list[dict]) -> str:
    """Per ring step and rank, in ms: compute and exposed communication as the ring ran
    (overlapped), and compute and transfer with each transfer waited for first (serial)."""
    lines = ["# per step (ms): overlapped compute/exposed | serial compute/transfer; forward steps, then backward"]
    for r in rows:
        if "steps" not in r:
            continue
        head = (f"W{r['world_size']} {r['kernel']} N={r['seq']} D={r['dim']} {r['layout']} "
                f"{'causal' if r['causal'] else 'full'}")
        for rank, (over, serial) in enumerate(zip(r["steps"], r["steps_serial"])):
            cells = [f"{a * 1e3:.2f}/{b * 1e3:.2f}|{c * 1e3:.2f}/{d * 1e3:.2f}" for (a, b), (c, d) in zip(over, serial)]
            lines.append(f"{head} rank {rank}: " + "  ".join(cells))
    return "\n".join(lines)


def _check(out, config, layout, causal, rank, world, chunk, attnkern, scaled_error, sample_rows):
    """The scaled error of sampled rows of this rank's output against the float64
    reference on the whole sequence."""
    from attnkern.distributed import chunk_count, chunks_of

    lead, d, dtype = (config["batch"], config["heads"]), config["dim"], config["dtype"]
    q, k, v = (x.double().numpy() for x in chunk_inputs(config["seed"], lead, chunk, d, dtype,
                                                         range(chunk_count(layout, world)))[:3])
    local = sample_rows(np.random.default_rng(rank), out.shape[-2], config["check_rows"])
    starts = [c * chunk for c in chunks_of(layout, rank, world)]
    positions = np.array([starts[i // chunk] + i % chunk for i in local])
    got = out.float().cpu().numpy()[..., local, :]
    return scaled_error(got, q, k, v, causal=causal, rows=positions)


def collect(world_size: int, per_rank: list[list[dict]], config: dict) -> list[dict]:
    """The table's rows for one world size from every rank's measurements."""
    itemsize = ITEMSIZE[config["dtype"]]
    cores = len(os.sched_getaffinity(0))
    table = []
    for i, first in enumerate(per_rank[0]):
        ranks = [r[i] for r in per_rank]
        busy = [r["compute_s"] for r in ranks]
        compute, exposed = statistics.fmean(busy), statistics.fmean(r["exposed_s"] for r in ranks)
        model = 2 * (first["seq"] // world_size) * config["batch"] * config["heads"] * first["dim"] * itemsize
        table.append({
            "world_size": world_size, "kernel": first["kernel"], "seq": first["seq"], "dim": first["dim"],
            "layout": first["layout"], "causal": first["causal"],
            "backward": config["backward"],
            "time_s": max(r["time_s"] for r in ranks),
            "compute_s": compute, "exposed_s": exposed,
            "overlap": compute / (compute + exposed) if compute + exposed > 0 else 1.0,
            "busy_s": busy, "imbalance": max(busy) / compute if compute > 0 else 1.0,
            "bytes_per_step": max(r["bytes_per_step"] for r in ranks), "bytes_model": model,
            "peak_bytes": max(r["peak_bytes"] + r["shard_bytes"] for r in ranks),
            "shard_bytes": max(r["shard_bytes"] for r in ranks),
            "max_error": max(r["max_error"] for r in ranks),
            "ranks_per_core": world_size / cores if config["device"] == "cpu" else 1.0,
            **({"steps": [r["steps"] for r in ranks], "steps_serial": [r["steps_serial"] for r in ranks]}
               if "steps" in first else {}),
        })
    return table


def run(config: dict, progress=None) -> tuple[list[dict], list[str]]:
    """Every world size of config in local processes: the rows of all, and a line for
    each world size that failed (the others still run)."""
    from attnkern.distributed import RankFailed, launch

    backend = "nccl" if config["device"] == "cuda" else "gloo"
    rows, failures = [], []
    for world in config["world_sizes"]:
        if progress:
            progress(f"# W={world}: {world} process(es) on {backend} ...")
        try:
            per_rank = launch(measure_rank, world, config, backend=backend, timeout=config["timeout"],
                              deadline=config["deadline"])
        except (RankFailed, TimeoutError) as exc:
            failures.append(f"W={world}: {exc}")
            if progress:
                progress(f"# W={world} failed: {exc}")
            continue
        rows += collect(world, per_rank, config)
    return rows, failures


def _problem(r: dict) -> tuple:
    return r["kernel"], r["seq"], r["dim"], r["layout"], r["causal"], r.get("backward")


def table(rows: list[dict]) -> str:
    """The rows, with each problem's speed-up and error against its smallest W's row."""
    base: dict = {}
    for r in sorted(rows, key=lambda r: r["world_size"]):
        base.setdefault(_problem(r), r)
    lines = [f"{'W':>2} {'kernel':<12} {'N':>6} {'D':>4} {'layout':<10} {'mask':<7} {'time ms':>9} {'compute':>9} {'exposed':>8} {'overlap':>8} "
             f"{'imbal.':>6} {'busy per rank (ms)':<24} {'KiB/step':>9} {'model':>9} {'peak MiB':>9} {'error':>8} "
             f"{'speed-up':>8} {'err/Wmin':>8}"]
    for r in rows:
        b = base[_problem(r)]
        speedup = b["time_s"] / r["time_s"] if r["time_s"] > 0 else float("nan")
        error_ratio = r["max_error"] / b["max_error"] if b["max_error"] > 0 else float("nan")
        busy = " ".join(f"{b * 1e3:.0f}" for b in r["busy_s"])
        lines.append(
            f"{r['world_size']:>2} {r['kernel']:<12} {r['seq']:>6} {r['dim']:>4} {r['layout']:<10} {'causal' if r['causal'] else 'full':<7} "
            f"{r['time_s'] * 1e3:>9.1f} {r['compute_s'] * 1e3:>9.1f} {r['exposed_s'] * 1e3:>8.1f} "
            f"{r['overlap']:>8.1%} {r['imbalance']:>6.2f} {busy:<24} {r['bytes_per_step'] / 1024:>9.0f} "
            f"{(r['bytes_model'] if r['world_size'] > 1 else 0) / 1024:>9.0f} {r['peak_bytes'] / 2**20:>9.1f} "
            f"{r['max_error']:>8.1e} {speedup:>8.2f} {error_ratio:>8.2f}")
    return "\n".join(lines)


def plot(rows: list[dict], title: str, path: str) -> None:
    """Three panels: peak memory per rank against W (with the 1/W line), the step time
    split into compute and exposed communication, and each rank's busy time for the
    causal layouts."""
    from .plotting import pyplot

    plt = pyplot()

    everything = rows
    group = (rows[0]["kernel"], rows[0]["seq"], rows[0]["dim"])
    rows = [r for r in rows if (r["kernel"], r["seq"], r["dim"]) == group]
    title += f"; first three panels: {group[0]}, N={group[1]}, D={group[2]}"
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    worlds = sorted({r["world_size"] for r in rows})
    ax = axes[0]
    for layout in sorted({r["layout"] for r in rows}):
        sel = [r for r in rows if r["layout"] == layout and r["causal"]] or [r for r in rows if r["layout"] == layout]
        ws = [r["world_size"] for r in sel]
        ax.plot(ws, [r["peak_bytes"] / 2**20 for r in sel], "o-", label=f"peak, shards included ({layout})")
        ax.plot(ws, [r["shard_bytes"] / 2**20 for r in sel], "s--", label=f"q, k, v, dout shards ({layout})")
    base = next((r for r in rows if r["world_size"] == worlds[0]), None)
    if base:
        ax.plot(worlds, [base["peak_bytes"] * worlds[0] / w / 2**20 for w in worlds], ":", color="gray",
                label="1/W from the smallest W")
    ax.set(xlabel="ranks W", ylabel="MiB per rank", title="memory per rank", xticks=worlds)
    ax.legend(fontsize=7)
    ax = axes[1]
    labels = [f"W{r['world_size']} {r['layout'][:3]} {'c' if r['causal'] else 'f'}" for r in rows]
    x = np.arange(len(rows))
    ax.bar(x, [r["compute_s"] * 1e3 for r in rows], label="compute")
    ax.bar(x, [r["exposed_s"] * 1e3 for r in rows], bottom=[r["compute_s"] * 1e3 for r in rows],
           label="exposed communication")
    ax.set_xticks(x, labels, rotation=70, fontsize=7)
    ax.set(ylabel="ms per call (mean over ranks)", title="compute and exposed communication")
    ax.legend(fontsize=7)
    ax = axes[2]
    causal = [r for r in rows if r["causal"] and r["world_size"] > 1]
    width = 0.8 / max(1, max((r["world_size"] for r in causal), default=1))
    for i, r in enumerate(causal):
        for rank, busy in enumerate(r["busy_s"]):
            ax.bar(i + (rank - (r["world_size"] - 1) / 2) * width, busy * 1e3, width,
                   color=f"C{rank}", label=f"rank {rank}" if i == 0 or rank >= causal[0]["world_size"] else None)
    ax.set_xticks(range(len(causal)), [f"W{r['world_size']} {r['layout']}" for r in causal], rotation=30,
                  fontsize=7)
    ax.set(ylabel="busy ms per call", title="causal: busy time per rank")
    handles, names = ax.get_legend_handles_labels()
    unique = dict(zip(names, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=7)
    _scaling_panel(axes[3], everything)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _scaling_panel(ax, rows: list[dict]) -> None:
    """Strong scaling: for each problem (kernel, N, D, layout, mask), its time at the
    smallest W over its time at each W, against the ideal W / W_min."""
    problems: dict = {}
    for r in rows:
        problems.setdefault((r["kernel"], r["seq"], r["dim"], r["layout"], r["causal"]), []).append(r)
    worlds = sorted({r["world_size"] for r in rows})
    for i, (key, sel) in enumerate(sorted(problems.items())):
        sel = sorted(sel, key=lambda r: r["world_size"])
        if len(sel) < 2:
            continue
        base = sel[0]
        ax.plot([r["world_size"] for r in sel], [base["time_s"] / r["time_s"] for r in sel], marker="o",
                color=f"C{i % 10}", linestyle="-" if key[4] else "--", alpha=0.8,
                label=f"{key[0]} N={key[1]} D={key[2]} {'causal' if key[4] else 'full'}")
    ax.plot(worlds, [w / worlds[0] for w in worlds], ":", color="gray", label="ideal")
    ax.set(xlabel="ranks W", ylabel="speed-up over the smallest W", title="strong scaling (same N)",
           xticks=worlds)
    ax.legend(fontsize=6)


def replot(paths: list[str], plot_path: str | None) -> int:
    """The table (and the plot) of rows saved by earlier runs' --json, together:
    runs of different W on one kind of machine, for instance."""
    rows, titles = [], []
    for path in paths:
        try:
            with open(path) as f:
                saved = json.load(f)
            rows += saved["rows"]
            titles.append(saved["title"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"attnkern ring --replot: {path} is not a file written by attnkern ring --json "
                             f"({type(exc).__name__}: {exc})") from None
    rows.sort(key=lambda r: (r["kernel"], r["seq"], r["dim"], r["layout"], r["causal"], r["world_size"]))
    title = titles[0] if len(set(titles)) == 1 else " | ".join(dict.fromkeys(titles))
    print(f"# {title}")
    print(table(rows))
    if plot_path and rows:
        plot(rows, title, plot_path)
        print(f"# plot: {plot_path}")
    return 0


HELP = "ring attention on W local processes (or under torchrun): checked and measured"
DESCRIPTION = __doc__


def configure(p: argparse.ArgumentParser) -> None:
    """The arguments of `attnkern ring`."""
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 3, 4], metavar="W",
                   help="numbers of local processes (ignored under torchrun, whose world is used)")
    p.add_argument("--seq", type=int, nargs="+", default=[3072],
                   help="total sequence lengths N, split over the ranks: multiples of W (contiguous) or 2W (zigzag)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, nargs="+", default=[64])
    p.add_argument("--dtype", choices=list(ITEMSIZE), default="float32",
                   help="bfloat16, float16: every block's out and lse merged in float32, rounded once at the end")
    p.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    p.add_argument("--layout", choices=["both", "contiguous", "zigzag"], default="both")
    p.add_argument("--backward", action="store_true", help="time forward and backward (torch autograd)")
    p.add_argument("--profile-steps", action="store_true",
                   help="also report each ring step's compute and exposed communication per rank, and the same "
                        "from one more call that waits for each transfer before computing (the transfer's whole "
                        "time): compute against communication per step")
    p.add_argument("--kernel", nargs="+", default=["auto"],
                   help="local kernels (each must return the lse, and have a backward for --backward; torch.sdpa "
                        "runs torch's fused kernel on CPU or CUDA tensors)")
    p.add_argument("--threads", type=int, help="the local kernel's num_threads (default: the rank's CPUs)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one GPU per rank, NCCL")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--check-rows", type=int, default=64, help="output rows per rank checked against float64")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300, help="seconds any one transfer may wait for a peer")
    p.add_argument("--deadline", type=float, help="seconds the whole run of one W may take")
    p.add_argument("--json", help="write the rows and settings to this file")
    p.add_argument("--csv", help="write the rows to this CSV file")
    p.add_argument("--plot", metavar="PNG", help="write the memory / overlap / balance / scaling plot here")
    p.add_argument("--replot", nargs="+", metavar="JSON",
                   help="measure nothing: print the table (and --plot) of the rows saved by earlier --json runs")


def command(args) -> int:
    from attnkern.distributed.layout import check_length

    from .machine import cpu_name

    if args.replot:
        return replot(args.replot, args.plot)
    if args.repeat < 1 or min(args.seq) < 1 or min(args.dim) < 1 or min(args.world_sizes) < 1 \
            or args.check_rows < 1:
        raise SystemExit("attnkern ring: --repeat, --seq, --dim, --check-rows and every W must be at least 1")
    config = {
        "seqs": args.seq, "batch": args.batch, "heads": args.heads, "dims": args.dim, "dtype": args.dtype,
        "causal": {"both": [False, True], "yes": [True], "no": [False]}[args.causal],
        "layouts": ["contiguous", "zigzag"] if args.layout == "both" else [args.layout],
        "backward": args.backward, "kernels": args.kernel, "threads": args.threads, "device": args.device,
        "repeat": args.repeat, "check_rows": args.check_rows, "seed": args.seed, "timeout": args.timeout,
        "deadline": args.deadline, "world_sizes": args.world_sizes, "profile_steps": args.profile_steps,
    }
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    worlds = [int(os.environ["WORLD_SIZE"])] if under_torchrun else args.world_sizes
    for world, n, layout in [(w, n, lay) for w in worlds for n in args.seq for lay in config["layouts"]]:
        try:
            check_length(n, layout, world)
        except ValueError as exc:
            raise SystemExit(f"attnkern ring: W={world}: {exc}") from None
    # glibc keeps freed blocks above its (growing) mmap threshold in the heap, where the
    # resident set would count them as in use; a fixed threshold returns them at once
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    failures = []
    if under_torchrun:
        rows = _under_torchrun(config, args.timeout)
        if rows is None:  # not rank 0: rank 0 reports
            return 0
    else:
        rows, failures = run(config, progress=lambda line: print(line, file=sys.stderr, flush=True))
    where = "GPU per rank, NCCL" if args.device == "cuda" else \
        f"{cpu_name()}, {len(os.sched_getaffinity(0))} CPUs shared by the ranks, gloo"
    title = (f"ring attention, ({args.batch}, {args.heads}, N, D) {args.dtype}, "
             f"{'forward+backward' if args.backward else 'forward'}, {where}")
    print(f"# {title}")
    print(table(rows))
    if args.profile_steps:
        print(steps_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"title": title, "settings": config, "rows": rows, "failures": failures}, f, indent=1)
    if args.csv:
        import csv

        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
            writer.writeheader()
            writer.writerows({**r, "busy_s": " ".join(f"{b:.6f}" for b in r["busy_s"])} for r in rows)
    if args.plot and rows:
        plot(rows, title, args.plot)
        print(f"# plot: {args.plot}")
    bad = [r for r in rows if not r["max_error"] <= ring_tolerance(args.dtype)]
    if bad:
        print(f"# {len(bad)} configuration(s) failed the check against float64", file=sys.stderr)
    for line in failures:
        print(f"# failed: {line.splitlines()[0]}", file=sys.stderr)
    return 1 if bad or failures else 0


def _under_torchrun(config: dict, timeout: float):
    """This process as one rank of a torchrun job: measures, and rank 0 gathers the rows."""
    import torch.distributed as dist

    from attnkern.distributed import init_from_env

    rank, world = init_from_env("nccl" if config["device"] == "cuda" else "gloo", timeout)
    mine = measure_rank(config)
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    dist.destroy_process_group()
    return collect(world, gathered, config) if rank == 0 else None
