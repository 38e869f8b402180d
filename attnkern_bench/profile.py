"""attnkern profile --device cuda: each GPU kernel launch of one attention call,
with hardware counters read by Nsight Compute's command line (ncu)."""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile

HELP = "hardware counters of each GPU kernel launch (Nsight Compute's ncu), beside the byte model"
DESCRIPTION = """\
Runs one attention call per kernel (--kernels: cuda.naive, cuda.flash,
triton.flash, torch.sdpa) at --shape and --dtype on seeded torch CUDA inputs
under Nsight Compute's command line (ncu), and reads for every kernel the call
launches:

  inst       SASS instructions executed (smsp__sass_inst_executed.sum)
  occ%       achieved occupancy: active warps over the SM's maximum
             (sm__warps_active.avg.pct_of_peak_sustained_active)
  tc%        tensor pipe busy, % of peak: mma.sync (hmma) and, on Hopper, wgmma (gmma),
             whichever is higher (sm__pipe_tensor_op_{hmma,gmma}_cycles_active)
  dram       DRAM bytes read + written (dram__bytes_{read,write}.sum)
  l2         L2 bytes (lts__t_bytes.sum) and its sector hit rate (lts__t_sector_hit_rate.pct)
  bank       shared-memory bank conflicts, loads + stores
             (l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_{ld,st}.sum)
  local      local-memory (spill) bytes, loads + stores
             (l1tex__t_bytes_pipe_lsu_mem_local_op_{ld,st}.sum), and registers a thread
  time       the launch's duration (gpu__time_duration.sum)

ncu replays each kernel once per pass its metrics need, restoring the memory it
writes, with the caches flushed before each pass (--cache-control all: DRAM bytes
of a cold L2) and the clocks locked at base (--clock-control base: durations are
longer than at boost clocks; compare them with each other, not with
`attnkern bench`). Metrics this ncu or GPU lacks are left out (ncu --query-metrics
is asked first). Each call is made once untimed first (compilation, caches), then
profiled between a delimiter kernel (torch.cuda._sleep) and the next.

Per kernel name the table then shows the roofline point from the measured bytes:
FLOPs (counts.attention_flops, the two matmuls) over DRAM bytes, the achieved
GFLOP/s over the summed duration, and the byte model of `attnkern roofline`
(counts.attention_bytes) with the measured / model ratio (no model: "-").

--csv FILE keeps ncu's raw CSV; --from-csv FILE --status FILE re-reads a recorded
run (no GPU); --json FILE writes every figure."""

DELIMITER = "spin_kernel"  # the kernel of torch.cuda._sleep
# each figure: the ncu metrics it may come from, the first this ncu has is read
METRICS = {
    "inst": ["smsp__sass_inst_executed.sum"],
    "occupancy_pct": ["sm__warps_active.avg.pct_of_peak_sustained_active"],
    "tensor_hmma_pct": ["sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"],
    "tensor_gmma_pct": ["sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"],
    "dram_read": ["dram__bytes_read.sum"],
    "dram_write": ["dram__bytes_write.sum"],
    "l2_bytes": ["lts__t_bytes.sum"],
    "l2_hit_pct": ["lts__t_sector_hit_rate.pct"],
    "bank_ld": ["l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"],
    "bank_st": ["l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"],
    "local_ld": ["l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum"],
    "local_st": ["l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum"],
    "registers": ["launch__registers_per_thread"],
    "time_ns": ["gpu__time_duration.sum"],
}
KERNELS = ("cuda.naive", "cuda.flash", "triton.flash", "torch.sdpa")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["cuda"], default="cuda", help="the GPU (the only device this profiles)")
    p.add_argument("--kernels", type=lambda s: s.split(","), default=list(KERNELS),
                   help=f"comma-separated ({','.join(KERNELS)})")
    p.add_argument("--shape", type=lambda s: tuple(int(x) for x in s.split("x")), default=(1, 16, 4096, 64),
                   help="B x H x N x D (1x16x4096x64)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--csv", metavar="FILE", help="also write ncu's raw CSV here")
    p.add_argument("--from-csv", metavar="FILE", help="read a recorded ncu CSV instead of running ncu")
    p.add_argument("--status", metavar="FILE", help="with --from-csv: the run's status file (kernel, outcome)")
    p.add_argument("--json", metavar="FILE", help="write the results to FILE")


def ncu_path() -> str | None:
    return shutil.which("ncu") or next((p for p in ("/usr/local/cuda/bin/ncu",) if os.path.exists(p)), None)


def available_metrics(ncu: str) -> set[str] | None:
    """The metric base names this ncu reports on this GPU (ncu --query-metrics), or
    None where it cannot say (then every metric is asked for)."""
    proc = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        return None
    return {line.split()[0] for line in proc.stdout.splitlines() if line.strip() and "__" in line.split()[0]}


def chosen_metrics(available: set[str] | None) -> dict[str, str]:
    """figure -> the ncu metric read for it: the first candidate whose base name
    (before the .sum/.avg/.pct suffix) this ncu has."""
    out = {}
    for figure, candidates in METRICS.items():
        for metric in candidates:
            # launch__ figures are not counters: ncu's raw page always has them
            if available is None or metric.startswith("launch__") or metric.split(".")[0] in available:
                out[figure] = metric
                break
    return out


def parse_csv(text: str) -> list[dict]:
    """ncu's `--csv --page raw` output: one dict per profiled kernel launch, in order
    (a header row, a units row, then a row per launch). Lines before the header
    (ncu's ==PROF== notes, the program's output) are skipped."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header = rows[0]
    return [dict(zip(header, r)) for r in rows[2:] if len(r) == len(header)]


def _number(text: str | None) -> float | None:
    if text is None or text.strip() in ("", "n/a"):
        return None
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def launches(text: str, outcomes: list[tuple[str, str]], metrics: dict[str, str]) -> dict[str, dict]:
    """kernel -> {"launches": [per launch: name and figures], or "error": why}: the
    launches between each "ok" kernel's delimiter and the next, in order."""
    groups, current = [], None
    for row in parse_csv(text):
        if DELIMITER in row.get("Kernel Name", ""):
            current = []
            groups.append(current)
        elif current is not None:
            current.append(row)
    ok = [name for name, outcome in outcomes if outcome == "ok"]
    if len(groups) != len(ok):
        raise RuntimeError(f"ncu reported {len(groups)} delimited calls for {len(ok)} profiled kernels")
    results = {name: {"error": outcome} for name, outcome in outcomes if outcome != "ok"}
    for name, group in zip(ok, groups):
        results[name] = {"launches": [
            {"name": row.get("Kernel Name", ""),
             **{figure: _number(row.get(metric)) for figure, metric in metrics.items()}} for row in group]}
    return results


def _total(launch_list: list[dict], figure: str) -> float | None:
    values = [x[figure] for x in launch_list if x.get(figure) is not None]
    return sum(values) if values else None


def roofline_point(kernel: str, shape: tuple, itemsize: int, causal: bool, launch_list: list[dict]) -> dict:
    """The call's FLOPs over its measured DRAM bytes, its GFLOP/s over the summed
    durations, and the byte model of attnkern roofline beside the measured bytes."""
    from .counts import attention_bytes, attention_flops

    b, h, n, d = shape
    flops = attention_flops(b, h, n, n, d, causal)
    read, write, ns = (_total(launch_list, f) for f in ("dram_read", "dram_write", "time_ns"))
    measured = None if read is None or write is None else read + write
    try:
        model = attention_bytes(kernel, b, h, n, n, d, itemsize, causal)
    except ValueError:  # no model of this kernel's traffic
        model = None
    return {"flops": flops, "dram_bytes": measured, "model_bytes": model,
            "measured_over_model": measured / model if measured and model else None,
            "intensity": flops / measured if measured else None,
            "gflops": flops / ns if ns else None, "time_ns": ns}


def _fmt(x, scale=1.0, digits=1, unit="") -> str:
    if x is None:
        return "-"
    x = x / scale
    return f"{x:.{digits}f}{unit}"


def table(results: dict, shape: tuple, dtype: str, causal: bool) -> str:
    """The readable table: a row per launch, then a roofline row per kernel."""
    lines = [f"# one call at {'x'.join(map(str, shape))} {dtype}{' causal' if causal else ''}; ncu at base clocks, "
             "cold caches",
             f"{'kernel':<13} {'launch':<34} {'inst':>9} {'occ%':>5} {'tc%':>5} {'dram MB':>8} {'l2 MB':>7} "
             f"{'l2 hit%':>7} {'bank':>9} {'local KB':>8} {'regs':>4} {'time us':>8}"]
    for kernel, r in results.items():
        if "error" in r:
            lines.append(f"{kernel:<13} {r['error']}")
            continue
        for x in r["launches"]:
            tc = max((v for v in (x.get("tensor_hmma_pct"), x.get("tensor_gmma_pct")) if v is not None), default=None)
            bank = None if x.get("bank_ld") is None else x["bank_ld"] + (x.get("bank_st") or 0)
            local = None if x.get("local_ld") is None else x["local_ld"] + (x.get("local_st") or 0)
            dram = None if x.get("dram_read") is None else x["dram_read"] + (x.get("dram_write") or 0)
            lines.append(f"{kernel:<13} {x['name'][:34]:<34} {_fmt(x.get('inst'), 1e6, 1, 'M'):>9} "
                         f"{_fmt(x.get('occupancy_pct')):>5} {_fmt(tc):>5} {_fmt(dram, 1e6):>8} "
                         f"{_fmt(x.get('l2_bytes'), 1e6):>7} {_fmt(x.get('l2_hit_pct')):>7} {_fmt(bank, 1, 0):>9} "
                         f"{_fmt(local, 1e3):>8} {_fmt(x.get('registers'), 1, 0):>4} "
                         f"{_fmt(x.get('time_ns'), 1e3):>8}")
    lines.append("# roofline point from measured DRAM bytes, beside attnkern roofline's byte model")
    lines.append(f"{'kernel':<13} {'GFLOP/s':>9} {'FLOP/byte':>9} {'dram MB':>8} {'model MB':>8} {'measured/model':>14}")
    for kernel, r in results.items():
        if "roofline" not in r:
            continue
        p = r["roofline"]
        ratio = "-" if p["measured_over_model"] is None else f"{p['measured_over_model']:.2f}"
        lines.append(f"{kernel:<13} {_fmt(p['gflops'], 1, 0):>9} {_fmt(p['intensity'], 1, 1):>9} "
                     f"{_fmt(p['dram_bytes'], 1e6):>8} {_fmt(p['model_bytes'], 1e6):>8} {ratio:>14}")
    return "\n".join(lines)


def summarise(text: str, outcomes, metrics, shape, dtype, causal) -> dict:
    results = launches(text, outcomes, metrics)
    itemsize = 4 if dtype == "float32" else 2
    for kernel, r in results.items():
        if "launches" in r:
            r["roofline"] = roofline_point(kernel, shape, itemsize, causal, r["launches"])
    return results


def _read_status(path: str) -> list[tuple[str, str]]:
    with open(path) as f:
        return [tuple(line.rstrip("\n").split("\t", 1)) for line in f if line.strip()]


def command(args) -> int:
    if args.from_csv:
        if not args.status:
            print("attnkern profile: --from-csv needs --status (the run's status file)", file=sys.stderr)
            return 2
        with open(args.from_csv) as f:
            text = f.read()
        outcomes, metrics = _read_status(args.status), chosen_metrics(None)
    else:
        ncu = ncu_path()
        if ncu is None:
            print("attnkern profile: Nsight Compute's ncu is not installed (it comes with the CUDA toolkit)",
                  file=sys.stderr)
            return 2
        metrics = chosen_metrics(available_metrics(ncu))
        print(f"# profiling {len(args.kernels)} kernels under ncu: {len(metrics)} metrics, each launch replayed per "
              "pass (about a minute)", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="attnkern-profile-") as tmp:
            status = os.path.join(tmp, "status.txt")
            cmd = [ncu, "--profile-from-start", "off", "--csv", "--page", "raw", "--cache-control", "all",
                   "--clock-control", "base", "--metrics",
                   ",".join(m for m in metrics.values() if not m.startswith("launch__")), sys.executable, "-m",
                   "attnkern_bench.profile", status, "x".join(map(str, args.shape)), args.dtype,
                   str(int(args.causal)), *args.kernels]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                                  env={**os.environ, "ATTNKERN_NO_TUNED": "1"})
            text = proc.stdout
            if "ERR_NVGPUCTRPERM" in proc.stdout + proc.stderr:
                print("attnkern profile: the GPU's counters are restricted to administrators (ERR_NVGPUCTRPERM)",
                      file=sys.stderr)
                return 2
            if proc.returncode != 0 or not os.path.exists(status):
                print(f"attnkern profile: ncu failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}",
                      file=sys.stderr)
                return 1
            outcomes = _read_status(status)
        if args.csv:
            with open(args.csv, "w") as f:
                f.write(text)
            with open(args.csv + ".status", "w") as f:
                f.writelines(f"{name}\t{outcome}\n" for name, outcome in outcomes)
    results = summarise(text, outcomes, metrics, args.shape, args.dtype, args.causal)
    print(table(results, args.shape, args.dtype, args.causal))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": list(args.shape), "dtype": args.dtype, "causal": args.causal, "metrics": metrics,
                       "kernels": results}, f, indent=1)
    return 0


# ---------------------------------------------------------------- the program ncu runs
def _child(status_path: str, shape: str, dtype: str, causal: str, kernels: list[str]) -> None:
    """One untimed call per kernel, then one between profiler start and stop after
    the delimiter; "ok" or why not per kernel in the status file."""
    import numpy as np
    import torch

    import attnkern

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dims = tuple(int(x) for x in shape.split("x"))
    rng = np.random.default_rng(0)
    q, k, v = (torch.from_numpy(rng.standard_normal(dims).astype("float32")).to("cuda", getattr(torch, dtype))
               for _ in range(3))
    is_causal = bool(int(causal))
    with open(status_path, "w") as status:
        for kernel in kernels:
            if kernel == "torch.sdpa":
                def call():
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
            elif kernel not in attnkern.kernels():
                status.write(f"{kernel}\tno such kernel\n")
                continue
            else:
                def call(kernel=kernel):
                    return attnkern.attention(q, k, v, causal=is_causal, kernel=kernel, check_finite=False)
            try:
                call()
            except (ValueError, TypeError, RuntimeError, MemoryError) as exc:
                status.write(f"{kernel}\t{type(exc).__name__}: {' '.join(str(exc).split())[:200]}\n")
                continue
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            torch.cuda._sleep(1)
            call()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            status.write(f"{kernel}\tok\n")
            status.flush()


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
