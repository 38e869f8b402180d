"""The study's output: the table as it runs, the memory account and scaling as
text, the CSV, Markdown and plot files."""

from __future__ import annotations

import csv
import math
import os

from .measuring import smallest_oom
from .model import CSV_COLUMNS, MIB, Account, Settings, settings_account

# ---------------------------------------------------------------- output


def _f(value, fmt: str, width: int) -> str:
    return f"{value:>{width}{fmt}}" if isinstance(value, (int, float)) and not math.isnan(value) else f"{'-':>{width}}"


def table_header(with_account: bool, width: int) -> str:
    head = (f"{'N':>6} {'d':>4} {'kernel':<{width}} {'status':<7} {'fwd ms':>9} {'bwd ms':>9} {'GFLOP/s':>8} "
            f"{'MiB pre-bwd':>11} {'peak MiB':>9}")
    return head + (f" {'pred MiB':>9} {'pred/meas':>9}" if with_account else "")


def table_line(row: dict, with_account: bool, width: int) -> str:
    line = (f"{row['seq_len']:>6} {row['d_model']:>4} {row['kernel']:<{width}} {row['status']:<7} "
            f"{_f(row.get('forward_ms'), '.3f', 9)} {_f(row.get('backward_ms'), '.3f', 9)} "
            f"{_f(row.get('gflops'), '.1f', 8)} {_f(row.get('memory_before_backward_mib'), '.1f', 11)} "
            f"{_f(row.get('peak_memory_mib'), '.1f', 9)}")
    if with_account:
        line += f" {_f(row.get('predicted_peak_mib'), '.1f', 9)} {_f(row.get('predicted_over_measured'), '.2f', 9)}"
    return line


def account_text(acc: Account, markdown: bool = False) -> list[str]:
    """The breakdown of one account: every term with its bytes and whether it is
    saved for backward, then the peak step of forward and backward."""
    peak = acc.peak_stage()
    split = acc.by_order(peak.live)
    title = (f"{acc.kernel} at B={acc.batch} H={acc.heads} N={acc.seq} d={acc.dim}"
             f"{' causal' if acc.causal else ''}, {acc.dtype}")
    saved = set(acc.saved)
    rows = [(t.name, t.formula, f"{t.nbytes / MIB:.3f}", f"N^{t.order}" if t.order == 2 else "N",
             ", ".join(r for r, on in (("saved", t.name in saved), ("at peak", t.name in peak.live)) if on), t.note)
            for t in acc.terms.values()]
    heads = ("tensor", "elements", "MiB", "grows as", "", "note")
    summary = [f"before backward (after forward): {acc.before_backward / MIB:.3f} MiB",
               f"forward peak: {acc.peak('forward') / MIB:.3f} MiB at {acc.peak_stage('forward').step}",
               f"backward peak: {acc.peak('backward') / MIB:.3f} MiB at {acc.peak_stage('backward').step}",
               f"predicted peak: {acc.peak() / MIB:.3f} MiB ({acc.peak()} bytes): "
               f"N^2 terms {split[2] / MIB:.3f} MiB, N terms {split[1] / MIB:.3f} MiB",
               *acc.notes]
    if markdown:
        out = [f"### {title}", "", "| " + " | ".join(h or "role" for h in heads) + " |",
               "|" + "---|" * len(heads)]
        out += ["| " + " | ".join(r) + " |" for r in rows]
        return out + [""] + [f"- {s}" for s in summary] + [""]
    w = max(len(r[0]) for r in rows)
    fw = max(len(r[1]) for r in rows)
    out = [f"## memory account: {title}"]
    out += [f"{r[0]:<{w}}  {r[1]:<{fw}}  {r[2]:>10}  {r[3]:<4}  {r[4]:<14}  {r[5]}".rstrip() for r in rows]
    return out + [f"# {s}" for s in summary]


def scaling_rows(cfg: Settings, dim: int) -> list[dict]:
    """The predicted peak of every kernel at every N of the grid (head size dim),
    split into its N^2 and N terms."""
    out = []
    for kernel in cfg.kernels:
        for n in sorted(cfg.seqs):
            acc = settings_account(cfg, kernel, n, dim)
            stage = acc.peak_stage()
            split = acc.by_order(stage.live)
            out.append({"kernel": kernel, "seq_len": n, "d_model": dim, "peak_mib": acc.peak() / MIB,
                        "n2_mib": split[2] / MIB, "n_mib": split[1] / MIB, "peak_step": f"{stage.phase}: {stage.step}"})
    return out


def scaling_text(rows: list[dict], markdown: bool = False) -> list[str]:
    if markdown:
        out = ["| kernel | N | N^2 terms MiB | N terms MiB | peak MiB | peak at |", "|---|---|---|---|---|---|"]
        return out + [f"| {r['kernel']} | {r['seq_len']} | {r['n2_mib']:.2f} | {r['n_mib']:.2f} | "
                      f"{r['peak_mib']:.2f} | {r['peak_step']} |" for r in rows] + [""]
    w = max(len(r["kernel"]) for r in rows)
    out = [f"{'kernel':<{w}} {'N':>6} {'N^2 MiB':>10} {'N MiB':>9} {'peak MiB':>10}  peak at"]
    return out + [f"{r['kernel']:<{w}} {r['seq_len']:>6} {r['n2_mib']:>10.2f} {r['n_mib']:>9.2f} "
                  f"{r['peak_mib']:>10.2f}  {r['peak_step']}" for r in rows]


def account_focus(cfg: Settings, rows: list[dict]) -> tuple[int, int]:
    """The configuration the breakdown is printed for: the smallest one out of
    memory (what it explains), else the largest of the grid."""
    ooms = [r for r in smallest_oom(rows).values() if r is not None]
    if ooms:
        r = min(ooms, key=lambda r: (r["seq_len"], r["d_model"]))
        return r["seq_len"], r["d_model"]
    return max(cfg.seqs), max(cfg.dims)


def oom_lines(rows: list[dict], cfg: Settings, predicted: dict | None) -> list[str]:
    out = []
    for kernel, row in smallest_oom(rows).items():
        if row is None:
            line = f"{kernel}: none out of memory (up to N={max(cfg.seqs)}, d={max(cfg.dims)})"
        else:
            line = (f"{kernel}: N={row['seq_len']} d={row['d_model']} (batch {row['batch']}), predicted "
                    f"{row['predicted_forward_peak_mib']:.1f} MiB at the forward's peak, "
                    f"{row['predicted_peak_mib']:.1f} MiB at the backward's: {row['error']}")
        if predicted is not None:
            p = predicted.get(kernel)
            line += f"; the account predicts {'N=%d d=%d' % p if p else 'none'}"
        out.append(line)
    return out


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row.get(c, "") for c in CSV_COLUMNS})


def write_markdown(path: str, result: dict, cfg: Settings) -> None:
    rows = result["rows"]
    lines = ["# attnkern study: forward and backward of attention", "", f"- device: {result['device']}",
             f"- {result['setup']}", "",
             "| N | d | kernel | status | fwd ms | bwd ms | GFLOP/s | MiB before bwd | peak MiB | predicted MiB "
             "| predicted / measured | error |", "|" + "---|" * 12]

    def cell(row, key, fmt):
        value = row.get(key)
        return format(value, fmt) if isinstance(value, (int, float)) and not math.isnan(value) else ""

    for r in rows:
        lines.append(f"| {r['seq_len']} | {r['d_model']} | {r['kernel']} | {r['status']} | "
                     f"{cell(r, 'forward_ms', '.3f')} | {cell(r, 'backward_ms', '.3f')} | {cell(r, 'gflops', '.1f')} | "
                     f"{cell(r, 'memory_before_backward_mib', '.1f')} | {cell(r, 'peak_memory_mib', '.1f')} | "
                     f"{cell(r, 'predicted_peak_mib', '.1f')} | {cell(r, 'predicted_over_measured', '.2f')} | "
                     f"{r['error'].replace('|', '/')} |")
    lines += ["", "## Smallest configuration out of memory, per kernel", ""]
    lines += [f"- {s}" for s in result["oom_lines"]] + [""]
    lines += ["## Memory account", ""]
    n, d = account_focus(cfg, rows)
    for kernel in cfg.kernels:
        lines += account_text(settings_account(cfg, kernel, n, d),
                              markdown=True)
    lines += [f"### Scaling with N (d={max(cfg.dims)})", ""]
    lines += scaling_text(scaling_rows(cfg, max(cfg.dims)), markdown=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_plots(directory: str, rows: list[dict], cfg: Settings, with_account: bool) -> list[str]:
    """One PNG per d: forward ms, backward ms and peak MiB against N, log-log, a
    line per kernel (dashed: the predicted peak; x: where it ran out of memory)."""
    Figure, FigureCanvasAgg = check_matplotlib()
    os.makedirs(directory, exist_ok=True)
    paths = []
    colors = {k: f"C{i}" for i, k in enumerate(cfg.kernels)}
    for d in cfg.dims:
        fig = Figure(figsize=(15, 4.5), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, 3)
        panels = (("forward_ms", "forward (ms)"), ("backward_ms", "backward (ms)"),
                  ("peak_memory_mib", "peak memory (MiB)"))
        for ax, (key, label) in zip(axes, panels):
            for kernel in cfg.kernels:
                mine = [r for r in rows if r["kernel"] == kernel and r["d_model"] == d]
                ok = [r for r in mine if r["status"] == "ok" and r.get(key) and r[key] > 0]
                if ok:
                    ax.plot([r["seq_len"] for r in ok], [r[key] for r in ok], "o-", color=colors[kernel], label=kernel)
                if key == "peak_memory_mib" and with_account:
                    ax.plot([r["seq_len"] for r in mine], [r["predicted_peak_mib"] for r in mine], "--",
                            color=colors[kernel], alpha=0.6, label=f"{kernel} predicted")
                for r in mine:
                    if r["status"] == "oom":
                        ax.axvline(r["seq_len"], color=colors[kernel], linestyle=":", alpha=0.8)
                        ax.annotate(f"{kernel} OOM", (r["seq_len"], 0.95), xycoords=("data", "axes fraction"),
                                    rotation=90, ha="right", va="top", fontsize=7, color=colors[kernel])
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(cfg.seqs), [str(n) for n in sorted(cfg.seqs)])
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.set_xlabel("sequence length N")
            ax.set_ylabel(label)
            ax.grid(True, which="both", alpha=0.3)
            if ax.has_data():
                ax.legend(fontsize=7)
        fig.suptitle(f"attention forward/backward, B={cfg.batch} H={cfg.heads} d={d}"
                     f"{' causal' if cfg.causal else ''}, {cfg.dtype}, {cfg.device}")
        path = os.path.join(directory, f"study_d{d}.png")
        fig.savefig(path, dpi=100)
        paths.append(path)
    return paths


def check_matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise SystemExit("--plots needs matplotlib: pip install 'attnkern[bench]'") from None
    return Figure, FigureCanvasAgg
