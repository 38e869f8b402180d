"""attnkern report: the results of bench, roofline, tune and study as a two-page
PDF, an HTML page and a plain-text summary.

Inputs are the JSON files those commands write (--bench, --roofline, --tune-grid,
--tune-replay, --study; --bench-minilm for `attnkern bench --inputs minilm`), or with
--quick short runs of each made here. Figures: GFLOP/s against N per kernel with the
matmul ceiling, speed-up over torch and NumPy, the roofline; a block-size heatmap
and the tuner's search curve, memory against N, accuracy on realistic against
random inputs. A header makes it reproducible (machine, ISA, threads, versions,
commit, seed), and two paragraphs generated from the numbers state the findings.
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import attnkern

from .accuracy import tolerance


def header(seed: int, threads: int) -> dict:
    info = {"machine": attnkern.machine(), "threads": threads, "seed": seed, "python": platform.python_version(),
            "numpy": np.__version__, "date": time.strftime("%Y-%m-%d %H:%M")}
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:
        pass
    try:
        root = Path(__file__).resolve().parents[1]
        info["commit"] = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        info["commit"] = "unknown"
    return info


def run_command(argv: list[str]) -> int:
    """One measuring command (bench, roofline, study or tune) with its argument list,
    read by the module's own configure(), as `attnkern <argv>` runs it."""
    from . import bench, roofline, study, tuner

    module = {"bench": bench, "roofline": roofline, "study": study, "tune": tuner}[argv[0]]
    parser = argparse.ArgumentParser(prog=f"attnkern {argv[0]}")
    module.configure(parser)
    return module.command(parser.parse_args(argv[1:]))


def quick_inputs(out: Path, threads: int, seed: int) -> dict:
    """Short runs of the other commands (about two minutes on 2 cores), each through
    run_command."""

    def run(name, argv):
        print(f"# report --quick: attnkern {' '.join(argv)}", file=sys.stderr, flush=True)
        run_command(argv)
        return str(out / name)

    kernels = ["native.flash", "native.tiled", "numba.flash", "torch.sdpa", "numpy.naive"]
    kernels = [k for k in kernels if attnkern.kernel_info(k)["available"]]
    files = {
        "bench": run("bench.json", ["bench", "--sizes", "256", "512", "1024", "--heads", "4", "--repeat", "3",
                                    "--passes", "1", "--settle", "0.1", "--threads", str(threads), "--seed", str(seed),
                                    "--kernels", *kernels, "--json", str(out / "bench.json")]),
        "roofline": run("roofline.json", ["roofline", "--sizes", "512", "1024", "--heads", "4", "--repeat", "3",
                                          "--threads", str(threads), "--kernels", *kernels,
                                          "--json", str(out / "roofline.json")]),
        "study": run("study.json", ["study", "--seqs", "256", "512", "1024", "--dims", "32", "--iters", "3",
                                    "--warmup", "1", "--batch", "2", "--json", str(out / "study.json")]),
    }
    try:
        files["bench_minilm"] = run("bench-minilm.json", ["bench", "--inputs", "minilm", "--sizes", "256",
                                                          "--repeat", "1", "--passes", "1", "--settle", "0",
                                                          "--kernels", *kernels, "--json",
                                                          str(out / "bench-minilm.json")])
    except (RuntimeError, SystemExit) as exc:
        print(f"# report --quick: no realistic inputs ({exc})", file=sys.stderr)
    grid = out / "tune-grid.json"
    run("tune-grid.json", ["tune", "--shape", "1x4x512x64", "--record-grid", str(grid), "--seed", str(seed)])
    files["tune_grid"] = str(grid)
    files["tune_replay"] = run("tune-replay.json", ["tune", "--replay", str(grid), "--seeds", "10", "--json",
                                                    str(out / "tune-replay.json")])
    return files


def _load(path):
    if not path:
        return None
    with open(path) as f:
        return json.load(f)


def figures(data: dict):
    """(page-1 figure, page-2 figure) with matplotlib, from the loaded results."""
    from . import roofline as rl
    from .plotting import pyplot

    plt = pyplot()
    from . import tuner

    page1, ax1 = plt.subplots(2, 2, figsize=(8.27, 11.69 * 0.72))
    bench = data.get("bench")
    if bench:
        rows = [r for r in bench["rows"] if "gflops" in r]
        for causal, ax in ((False, ax1[0, 0]), (True, ax1[0, 1])):
            for i, k in enumerate(sorted({r["kernel"] for r in rows})):
                sel = sorted((r for r in rows if r["kernel"] == k and r["causal"] == causal), key=lambda r: r["n"])
                ax.plot([r["n"] for r in sel], [r["gflops"] for r in sel], marker="o", color=f"C{i}", label=k)
            ax.axhline(bench["ceiling"]["gflops"], color="k", ls="--", lw=1, label="float32 matmul")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequence length N")
            ax.set_ylabel("GFLOP/s")
            ax.set_title(f"forward throughput, {'causal' if causal else 'no mask'}", fontsize=9)
            ax.legend(fontsize=6)
        ax = ax1[1, 0]
        ks = sorted({r["kernel"] for r in rows if "speedup_vs_torch.sdpa" in r})
        ns = sorted({r["n"] for r in rows})
        width = 0.8 / max(1, len(ks))
        for i, k in enumerate(ks):
            vals = [statistics.median([r["speedup_vs_torch.sdpa"] for r in rows if r["kernel"] == k and r["n"] == n
                                       and "speedup_vs_torch.sdpa" in r] or [np.nan]) for n in ns]
            ax.bar(np.arange(len(ns)) + i * width, vals, width, label=k, color=f"C{i}")
        ax.axhline(1, color="k", lw=0.8)
        ax.set_xticks(np.arange(len(ns)) + 0.4 - width / 2, [str(n) for n in ns])
        ax.set_xlabel("sequence length N (median over masks)")
        ax.set_ylabel("speed-up over torch.sdpa (x)")
        ax.set_title("speed-up over torch (above 1: faster)", fontsize=9)
        ax.legend(fontsize=6)
    roof = data.get("roofline")
    if roof:
        c = roof["ceilings"]
        rl.draw(ax1[1, 1], roof["points"], c, f"roofline: {c['peak_gflops']:.0f} GFLOP/s, "
                f"{c['bandwidth_gbs']:.0f} GB/s", annotate=False)
        ax1[1, 1].set_xlabel("arithmetic intensity (FLOP/byte, modelled)")
    page1.tight_layout()

    page2, ax2 = plt.subplots(2, 2, figsize=(8.27, 11.69 * 0.72))
    if data.get("tune_grid"):
        page2.colorbar(tuner.draw_grid(ax2[0, 0], data["tune_grid"]), ax=ax2[0, 0], fraction=0.046)
    replay = data.get("tune_replay")
    if replay:
        tuner.draw_replay(ax2[0, 1], replay, f"tuner's search, median of {replay['seeds']} seeds")
    study = data.get("study")
    if study:
        ax = ax2[1, 0]
        rows = [r for r in study["rows"] if r.get("status") == "ok"]
        top = max((r["d_model"] for r in rows), default=0)
        rows = [r for r in rows if r["d_model"] == top]  # one head size: lines over N only
        for i, k in enumerate(sorted({r["kernel"] for r in rows})):
            sel = sorted((r for r in rows if r["kernel"] == k), key=lambda r: r["seq_len"])
            ax.plot([r["seq_len"] for r in sel], [r["peak_memory_mib"] for r in sel], marker="o", color=f"C{i}",
                    label=k)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length N")
        ax.set_ylabel("peak memory, forward + backward (MiB)")
        ax.set_title(f"training-step memory (d = {top})", fontsize=9)
        ax.legend(fontsize=7)
    ax = ax2[1, 1]
    acc = accuracy_pairs(data)
    if acc:
        ks = list(acc)
        ax.bar(np.arange(len(ks)) - 0.2, [acc[k][0] for k in ks], 0.4, label="random inputs")
        ax.bar(np.arange(len(ks)) + 0.2, [acc[k][1] for k in ks], 0.4, label="MiniLM inputs")
        ax.set_xticks(range(len(ks)), ks, rotation=30, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel(f"scaled error vs float64 (bound {tolerance('float32'):.1e})")
        ax.set_title("accuracy: random against realistic inputs", fontsize=9)
        ax.legend(fontsize=7)
    page2.tight_layout()
    return page1, page2


def accuracy_pairs(data: dict) -> dict:
    """kernel -> (max error on random inputs, max error on MiniLM inputs)."""
    bench, real = data.get("bench"), data.get("bench_minilm")
    if not bench or not real:
        return {}
    out = {}
    for k in sorted({r["kernel"] for r in real["rows"] if "error" in r}):
        a = [r["error"] for r in bench["rows"] if r["kernel"] == k and "error" in r]
        b = [r["error"] for r in real["rows"] if r["kernel"] == k and "error" in r]
        if a and b:
            out[k] = (max(a), max(b))
    return out


def findings(data: dict) -> list[str]:
    """Two paragraphs stating what the numbers say."""
    out = []
    bench = data.get("bench")
    if bench:
        rows = [r for r in bench["rows"] if "median_s" in r]
        wins = {}
        for n in sorted({r["n"] for r in rows}):
            for causal in (False, True):
                sel = [r for r in rows if r["n"] == n and r["causal"] == causal]
                if sel:
                    wins.setdefault(min(sel, key=lambda r: r["median_s"])["kernel"], []).append(
                        f"N={n}{' causal' if causal else ''}")
        parts = [f"{k} at {', '.join(v)}" for k, v in sorted(wins.items(), key=lambda kv: -len(kv[1]))]
        best = max(rows, key=lambda r: r["gflops"])
        ceiling = best.get("ceiling_gflops", bench["ceiling"]["gflops"])
        text = (f"Fastest kernel per configuration: {'; '.join(parts)}. The highest throughput was {best['kernel']} "
                f"at N={best['n']}{' causal' if best['causal'] else ''}: {best['gflops']:.0f} GFLOP/s, "
                f"{best['gflops'] / ceiling:.0%} of the float32 matmul measured in the same run "
                f"({ceiling:.0f} GFLOP/s).")
        flash = [r["speedup_vs_torch.sdpa"] for r in rows if r["kernel"] == "native.flash" and
                 "speedup_vs_torch.sdpa" in r]
        if flash:
            text += (f" native.flash ran at {min(flash):.2f}-{max(flash):.2f}x torch.sdpa's speed "
                     "(above 1: faster).")
        out.append(text)
    roof = data.get("roofline")
    if roof:
        pts = roof["points"]
        by = {}
        for p in pts:
            by.setdefault(p["kernel"], []).append(p)
        parts = []
        for k, ps in sorted(by.items()):
            frac = statistics.median(p["fraction"] for p in ps)
            bound = max({p["bound"] for p in ps}, key=lambda b: sum(p["bound"] == b for p in ps))
            parts.append(f"{k} {frac:.0%} ({bound}-bound by the model)")
        c = roof["ceilings"]
        text = (f"Against the roofline ({c['peak_gflops']:.0f} GFLOP/s peak FMA rate, {c['bandwidth_gbs']:.0f} GB/s "
                f"triad; ridge at {c['peak_gflops'] / c['bandwidth_gbs']:.1f} FLOP/byte), the median fraction of the "
                f"attainable bound each kernel reached: {'; '.join(parts)}.")
        acc = accuracy_pairs(data)
        if acc:
            worst = max(acc.items(), key=lambda kv: kv[1][1])
            text += (f" On realistic (MiniLM) inputs the largest scaled error was {worst[1][1]:.1e} ({worst[0]}), "
                     f"against {worst[1][0]:.1e} on random inputs; the bound is {tolerance('float32'):.1e}.")
        out.append(text)
    return out


def write(data: dict, info: dict, out: Path) -> dict:
    """report.pdf (two pages), report.html and report.txt in out."""
    from .plotting import pyplot

    plt = pyplot()
    from matplotlib.backends.backend_pdf import PdfPages

    out.mkdir(parents=True, exist_ok=True)
    page1, page2 = figures(data)
    paragraphs = findings(data)
    m = info["machine"]
    head = (f"attnkern report - {m['cpu']} ({m['isa']}, {m['cpus']} CPUs), {info['threads']} threads, attnkern "
            f"{m['version']} at commit {info['commit']}, numpy {info['numpy']}, torch {info.get('torch', '-')}, "
            f"seed {info['seed']}, {info['date']}")
    import textwrap

    for fig, top in ((page1, [head, *paragraphs[:1]]), (page2, paragraphs[1:])):
        fig.subplots_adjust(top=0.80)
        fig.text(0.05, 0.985, "\n\n".join(textwrap.fill(t, 120) for t in top), va="top", fontsize=6.5,
                 family="sans-serif")
    with PdfPages(out / "report.pdf") as pdf:
        for fig in (page1, page2):
            pdf.savefig(fig)
    images = []
    for fig in (page1, page2):
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110)
        images.append(base64.b64encode(buf.getvalue()).decode())
    plt.close(page1)
    plt.close(page2)
    body = "".join(f"<p>{html.escape(p)}</p>" for p in paragraphs)
    imgs = "".join(f'<img alt="attnkern report page {i + 1}" src="data:image/png;base64,{b}" style="max-width:100%">'
                   for i, b in enumerate(images))
    (out / "report.html").write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>attnkern report</title></head>"
        f"<body style='font-family:sans-serif;max-width:1000px;margin:auto'><h1>attnkern report</h1>"
        f"<p><small>{html.escape(head)}</small></p>{body}{imgs}</body></html>")
    (out / "report.txt").write_text(head + "\n\n" + "\n\n".join(paragraphs) + "\n")
    return {"pdf": str(out / "report.pdf"), "html": str(out / "report.html"), "txt": str(out / "report.txt")}


def load_all(files: dict) -> dict:
    return {k: _load(v) for k, v in files.items() if v}


# ---------------------------------------------------------------- the command

HELP = "a two-page PDF, an HTML page and a text summary of the other commands' results"
DESCRIPTION = __doc__


def configure(p: argparse.ArgumentParser) -> None:
    """The arguments of `attnkern report`."""
    p.add_argument("--quick", action="store_true", help="make short runs of bench, roofline, study and tune first")
    for name in ("bench", "bench-minilm", "roofline", "tune-grid", "tune-replay", "study"):
        p.add_argument(f"--{name}", metavar="JSON", help=f"the JSON file of `attnkern {name.split('-')[0]}`")
    p.add_argument("--out", default="bench-results/report", help="directory of report.pdf, .html and .txt")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)


def command(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = {k.replace("-", "_"): getattr(args, k.replace("-", "_")) for k in
             ("bench", "bench-minilm", "roofline", "tune-grid", "tune-replay", "study")}
    if args.quick:
        files = {**quick_inputs(out, args.threads, args.seed), **{k: v for k, v in files.items() if v}}
    if not any(files.values()):
        raise SystemExit("attnkern report: give result files (--bench, --roofline, ...) or --quick")
    written = write(load_all(files), header(args.seed, args.threads), out)
    print(Path(written["txt"]).read_text())
    for kind, path in written.items():
        print(f"# {kind}: {path}")
    return 0
