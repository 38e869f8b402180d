"""Calibrate the regression signals on this machine: false alarms over A/A
comparisons of identical library code, and detection of real slowdowns
injected into native.flash, for each method:

  asv       `asv continuous` on native.flash's Forward time benchmarks, verdicts
            at factors 1.1, 1.2 and 1.3 (`asv compare` over the same results)
  paired    tools/gate.py's paired, alternating timing (no counting)
  counted   tools/gate.py's instruction counts under Valgrind
  avx512    tools/gate.py's avx512-counted signal (tools/avx512_count.py): the
            AVX-512 code's instructions, counted natively; where the CPU has AVX-512

    .venv/bin/python tools/calibrate_gate.py --out docs/data/gate-calibration.json

The slowdown: native.flash's flash_panel computes the Sᵀ = K·Qᵀ tiles of the
first keys of every panel and K/V block a second time (the result overwrites
identical values, so outputs stay exact; tiles that cross the causal diagonal,
masked after their product, are left alone). The fraction of keys sets its size;
the counted ratio measures what each level really costs. Everything
runs in a temporary clone; the main repository is not touched. Takes about an
hour with the defaults; the raw data and a Markdown table are written.

The avx512 method has its own slowdown, confined to attn_avx512.c (which the AVX2
path Valgrind counts never runs): extra FMAs in its 2^x (inject_avx512_slowdown).
It is measured with both kinds of injected commits, A/A comparisons building both
sides afresh each time (about a minute each):

    .venv/bin/python tools/calibrate_gate.py --methods avx512
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gate  # noqa: E402

REPO = gate.REPO
INJECT_FILE = "attnkern/backends/native/attn_kernels.h"
# The comment that follows flash_panel's score tiles; the slowdown goes before it.
INJECT_LINE = "    /* rescale factors 2^(m_old - m_new): exactly 1 where the max stays, 0 for a query\n"
# Percent of each panel's keys (per K/V block) whose score tiles are computed twice,
# for each target slowdown (percent) of native.flash at 1x8x1024x64 non-causal on
# the AVX-512 path, where the score tiles take about 45% of the time (less with the
# causal mask, whose diagonal tiles are not repeated). The calibration reports what
# each level measured.
KEYS_FOR_LEVEL = {2: 5, 5: 12, 10: 24}
# The AVX-512-only slowdown (the avx512-counted signal's calibration): attn_avx512.c's
# 2^x, which the softmax of every score vector runs (forward and backward), does
# `fmas` more FMAs p * 1 + (-0) on its polynomial, the constants hidden from the
# compiler (an empty asm), so the work stays and the result is exactly p. No other
# translation unit includes attn_avx512.c except attn_avx512bf16.c (the AVX-512 path
# of float32 on CPUs with AVX512_BF16): Valgrind's AVX2 path is unchanged.
AVX512_INJECT_FILE = "attnkern/backends/native/attn_avx512.c"
AVX512_INJECT_LINE = "    return _mm512_maskz_scalef_ps(live, p, n);\n"
# FMAs per 2^x vector for each target slowdown (percent), set so that the counted
# instructions of native.flash's AVX-512 code grow by about that much at the gate's
# shapes (forward and backward, causal and not); the calibration reports what each
# level measured.
AVX512_FMAS_FOR_LEVEL = {2: 9, 3: 15}
ASV_REGEX = r"(^|\.)Forward\.time_forward\('native\.flash', '(1x8x1024x64|1x4x1024x128)'"
PAIRED_REGEX = r"^native\.flash:"
FACTORS = ("1.1", "1.2", "1.3")


def inject_slowdown(source: str, keys_percent: int) -> str:
    """attn_kernels.h with flash_panel computing the score tiles of the first
    `keys_percent`% of each panel's keys a second time (the same values, before the
    softmax reads them), so the extra work scales with the keys. Only tiles that need no
    mask and no softcap (the panel's own `edge` test, in its plain or featured form) are
    recomputed: the masked ones were changed after their products."""
    if source.count(INJECT_LINE) != 1:
        raise ValueError(f"the line the slowdown precedes moved: {INJECT_LINE!r}")
    extra = (f"    for (int64_t k0 = 0; k0 < (kv * {keys_percent} + 99) / 100; k0 += MR)"
             " if (cap2 == 0 && !(FEAT ? (j0 + k0 + MR - 1 - hi > q0 || j0 + k0 - lo < q0 + NR - 1)"
             " : (causal && j0 + k0 + MR - 1 > q0)))"
             " ST(call_qk)((int)(kv - k0 < MR ? kv - k0 : MR), d, kr + k0 * d, d, qt, st + k0 * NR, NR, NULL);"
             "  /* injected slowdown */\n")
    return source.replace(INJECT_LINE, extra + INJECT_LINE)


def inject_avx512_slowdown(source: str, fmas: int) -> str:
    """attn_avx512.c with `fmas` extra FMAs in its 2^x (see AVX512_INJECT_FILE)."""
    if source.count(AVX512_INJECT_LINE) != 1:
        raise ValueError(f"the line the AVX-512 slowdown precedes moved: {AVX512_INJECT_LINE!r}")
    extra = ("    {  /* injected slowdown */\n"
             "        __m512 one_ = _mm512_set1_ps(1.0f), nzero_ = _mm512_set1_ps(-0.0f);\n"
             '        __asm__("" : "+v"(one_), "+v"(nzero_));\n'
             f"        for (int r_ = 0; r_ < {int(fmas)}; r_++)\n"
             "            p = _mm512_fmadd_ps(p, one_, nzero_);\n"
             "    }\n")
    return source.replace(AVX512_INJECT_LINE, extra + AVX512_INJECT_LINE)


def git(repo, *args) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="calibration", GIT_AUTHOR_EMAIL="gate@attnkern",
               GIT_COMMITTER_NAME="calibration", GIT_COMMITTER_EMAIL="gate@attnkern")
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def make_history(clone: Path, levels, avx512_levels=()) -> dict[str, str]:
    """Commits off HEAD: a README no-op (identical library code), one
    injected slowdown per level, and one AVX-512-only slowdown per avx512 level
    (named avx512slowN). Returns {name: sha}."""
    base = git(clone, "rev-parse", "HEAD")
    shas = {"base": base}
    git(clone, "checkout", "-q", "-b", "noop", base)
    with (clone / "README.md").open("a") as f:
        f.write("\nA line of nothing measurable.\n")
    git(clone, "commit", "-q", "-am", "README: no-op")
    shas["noop"] = git(clone, "rev-parse", "HEAD")
    for level in levels:
        git(clone, "checkout", "-q", "-b", f"slow{level}", base)
        path = clone / INJECT_FILE
        path.write_text(inject_slowdown(path.read_text(), KEYS_FOR_LEVEL[level]))
        git(clone, "commit", "-q", "-am", f"flash: {KEYS_FOR_LEVEL[level]}% of score tiles twice (~{level}% slower)")
        shas[f"slow{level}"] = git(clone, "rev-parse", "HEAD")
    for level in avx512_levels:
        fmas = AVX512_FMAS_FOR_LEVEL[level]
        git(clone, "checkout", "-q", "-b", f"avx512slow{level}", base)
        path = clone / AVX512_INJECT_FILE
        path.write_text(inject_avx512_slowdown(path.read_text(), fmas))
        git(clone, "commit", "-q", "-am", f"avx512: {fmas} more FMAs in 2^x (~{level}% more instructions)")
        shas[f"avx512slow{level}"] = git(clone, "rev-parse", "HEAD")
    git(clone, "checkout", "-q", base)
    return shas


def asv_setup(tmp: Path, clone: Path):
    from asv.util import load_json

    config = load_json(str(REPO / "asv.conf.json"), js_comments=True)
    config.update(repo=str(clone), benchmark_dir=str(clone / "benchmarks"), env_dir=str(REPO / ".asv" / "env"),
                  results_dir=str(tmp / "results"), html_dir=str(tmp / "html"))
    conf = tmp / "asv.conf.json"
    conf.write_text(json.dumps(config, indent=2))
    machine = "attnkern-calibration"
    subprocess.run([sys.executable, "-m", "asv", "machine", "--yes", "--machine", machine], cwd=clone,
                   check=True, capture_output=True)

    def asv(*args):
        return subprocess.run([sys.executable, "-m", "asv", *args, "--config", str(conf), "--machine", machine],
                              cwd=clone, capture_output=True, text=True)

    return asv


def asv_trial(asv, base: str, head: str) -> dict:
    t0 = time.perf_counter()
    run = asv("continuous", "--factor", FACTORS[0], "-b", ASV_REGEX, base, head)
    seconds = time.perf_counter() - t0
    out = {"seconds": seconds, "returncode": run.returncode, "factors": {}}
    for factor in FACTORS:
        cmp = asv("compare", "--factor", factor, base, head)
        rows = []
        for line in cmp.stdout.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("|") and len(cells) == 5 and "native.flash" in cells[4]:
                rows.append({"change": cells[0], "before": cells[1], "after": cells[2], "ratio": cells[3],
                             "benchmark": cells[4]})
        out["factors"][factor] = {"rows": rows, "flagged": [r["benchmark"] for r in rows if r["change"] == "+"]}
    if not out["factors"][FACTORS[0]]["rows"]:
        out["error"] = (run.stdout + run.stderr)[-3000:]
    return out


def paired_trial(clone: Path, base: str, head: str, seed: int, tmp: Path) -> dict:
    path = tmp / f"paired-{head[:8]}-{seed}.json"
    t0 = time.perf_counter()
    code = gate.main(["--repo", str(clone), "--base", base, "--head", head, "--no-count", "-b", PAIRED_REGEX,
                      "--seed", str(seed), "--json", str(path)])
    data = json.loads(path.read_text())
    return {"seconds": time.perf_counter() - t0, "returncode": code,
            "rows": [{k: r.get(k) for k in ("benchmark", "ratio", "interval", "verdict", "rounds")}
                     for r in data["rows"]],
            "flagged": [r["benchmark"] for r in data["rows"] if r["verdict"] == "slower"]}


def counted_runs(clone: Path, shas: dict, cache: Path) -> dict:
    """Instruction counts of native.flash for every commit, the base three times
    (run-to-run identity)."""
    configs = [("native.flash", s, c) for s in gate.COUNT_SHAPES for c in (False, True)]
    out = {}
    for name in ["base", "base", "base", *[n for n in shas if n != "base"]]:
        site = gate.build(clone, shas[name], cache, print)
        python, env = gate.interpreter(site)
        t0 = time.perf_counter()
        counts = gate.counting.count(configs, python=python, env=env)
        out.setdefault(name, []).append({"seconds": time.perf_counter() - t0,
                                         "Ir": {k: v["Ir"] for k, v in counts.items()}})
    return out


def avx512_runs(clone: Path, shas: dict, aa: int) -> dict:
    """The avx512-counted signal's comparisons: `aa` A/A ones (base against the
    no-op commit, both built afresh each time) and one per injected commit (its
    counts are deterministic: one comparison decides). {name: [comparison]}, each
    with its seconds, ratios per configuration and the configurations flagged."""
    cfgs = gate.avx512_count.configs(gate.COUNT_SHAPES)
    out = {}
    for name in ["noop"] * aa + [n for n in shas if n not in ("base", "noop")]:
        print(f"== avx512-counted: base -> {name}", flush=True)
        t0 = time.perf_counter()
        counted = gate.avx512_count.count_commits(clone, {"baseline": shas["base"], "candidate": shas[name]}, cfgs)
        rows = gate.avx512_count.rows(counted, 0.01)
        out.setdefault(name, []).append({
            "seconds": time.perf_counter() - t0,
            "ratios": {r["benchmark"]: r["ratio"] for r in rows},
            "instructions": {r["benchmark"]: [r["baseline"], r["candidate"]] for r in rows},
            "flagged": [r["benchmark"] for r in rows if r["verdict"] == "slower"]})
    return out


def summarize_avx512(data) -> str:
    """The avx512-counted calibration table of docs/regression-gate.md: one row per
    kind of comparison (its trials together)."""
    runs, paired = data["avx512"], data.get("paired", {})
    timed = any(name in paired for name in runs if name.startswith("avx512"))
    lines = ["| comparison | flagged (a configuration above +1%) | forward ratios | backward ratios | "
             "minutes per comparison |" + (" paired timing: flagged, medians |" if timed else ""),
             "|---|---|---|---|---|" + ("---|" if timed else "")]
    for name in ["noop", *[n for n in runs if n != "noop"]]:
        trials = runs.get(name, [])
        if not trials:
            continue
        fwd = [r for t in trials for k, r in t["ratios"].items() if ".backward" not in k]
        bwd = [r for t in trials for k, r in t["ratios"].items() if ".backward" in k]
        label = "A/A (no-op commit)"
        if name.startswith("avx512slow"):
            lvl = int(name[len("avx512slow"):])
            label = f"AVX-512-only {lvl}% ({AVX512_FMAS_FOR_LEVEL[lvl]} FMAs in 2^x)"
        elif name.startswith("slow"):
            label = f"flash_panel {name[4:]}% (score tiles twice)"
        minutes = statistics.median(t["seconds"] for t in trials) / 60
        row = (f"| {label} | {sum(1 for t in trials if t['flagged'])}/{len(trials)} | "
               f"{min(fwd):.4f} to {max(fwd):.4f} | {min(bwd):.4f} to {max(bwd):.4f} | {minutes:.1f} |")
        if timed:
            times = paired.get(name, [])
            medians = [r["ratio"] for t in times for r in t["rows"] if r.get("ratio")]
            row += (f" {sum(1 for t in times if t['flagged'])}/{len(times)}, {min(medians):.3f} to "
                    f"{max(medians):.3f} |" if medians else " |")
        lines.append(row)
    return "\n".join(lines)


def summarize(data) -> str:
    """The Markdown table of docs/regression-gate.md from the raw data."""
    levels = data["levels"]
    lines = ["| method | verdict: slower when | false alarms (A/A) | " +
             " | ".join(f"{lvl}% slowdown flagged" for lvl in levels) + " | minutes per comparison |",
             "|---|---|---|" + "---|" * len(levels) + "---|"]

    def frac(trials, flagged):
        return f"{sum(1 for t in trials if flagged(t))}/{len(trials)}"

    def minutes(method):
        return statistics.median(t["seconds"] for ts in data[method].values() for t in ts) / 60

    for factor in FACTORS:
        cells = [frac(data["asv"][f"slow{lvl}"], lambda t: t["factors"][factor]["flagged"]) for lvl in levels]
        lines.append(f"| asv continuous | ratio > {factor} and significant | "
                     f"{frac(data['asv']['noop'], lambda t: t['factors'][factor]['flagged'])} | "
                     + " | ".join(cells) + f" | {minutes('asv'):.1f} |")
    cells = [frac(data["paired"][f"slow{lvl}"], lambda t: t["flagged"]) for lvl in levels]
    lines.append(f"| paired timing | 95% interval above +{data['time_threshold']:.0%} | "
                 f"{frac(data['paired']['noop'], lambda t: t['flagged'])} | " + " | ".join(cells)
                 + f" | {minutes('paired'):.1f} |")
    # counted: deterministic, one count per build decides every comparison with it
    base = data["counted"]["base"]
    identical = all(r["Ir"] == base[0]["Ir"] for runs in (base, data["counted"]["noop"]) for r in runs)

    def counted_ratios(name):
        return [data["counted"][name][0]["Ir"][k] / base[0]["Ir"][k] for k in base[0]["Ir"]]

    counted_flags = {lvl: max(counted_ratios(f"slow{lvl}")) > 1.01 for lvl in levels}
    cells = [f"{'yes' if counted_flags[lvl] else 'no'} (max +{max(counted_ratios(f'slow{lvl}')) - 1:.1%})"
             for lvl in levels]
    lines.append(f"| counted | instructions above +1% | {'0 (identical counts)' if identical else 'counts differ'} | "
                 + " | ".join(cells) + f" | {minutes('counted'):.1f} per build |")
    cells = [frac(data["paired"][f"slow{lvl}"], lambda t, lvl=lvl: t["flagged"] or counted_flags[lvl])
             for lvl in levels]
    noop_counted = not identical
    lines.append("| **gate** (counted or paired) | either signal | "
                 f"{frac(data['paired']['noop'], lambda t: t['flagged'] or noop_counted)} | " + " | ".join(cells)
                 + f" | {minutes('paired') + 2 * minutes('counted'):.1f} |")
    measured = []
    for lvl in levels:
        timed = [r["ratio"] for t in data["paired"][f"slow{lvl}"] for r in t["rows"]]
        measured.append(f"{lvl}%: time +{min(timed) - 1:.1%} to +{max(timed) - 1:.1%}, instructions "
                        f"+{min(counted_ratios(f'slow{lvl}')) - 1:.1%} to +{max(counted_ratios(f'slow{lvl}')) - 1:.1%}")
    lines.append("")
    lines.append("What each injected level measured (paired medians over its trials and configurations; "
                 "counted ratios): " + "; ".join(measured) + ".")
    return "\n".join(lines)


# ---------------------------------------------------------------- --device cuda
# The GPU's slowdown: flash_tf32.cu (cuda.flash float32) runs, per K/V tile and
# warp, a chain of dependent FMAs (x * 1 + 0, exact) on one score before the
# softmax reads it. The chain sits on the tile's critical path; its length sets
# the slowdown, which a short pilot measures (see gpu_fmas_for_levels).
GPU_INJECT_FILE = "attnkern/backends/cuda/flash_tf32.cu"
GPU_INJECT_LINE = "        // masks only where the tile crosses a row's length, window or diagonal; s becomes P\n"
GPU_REGEX = r"^cuda\.flash:float32:"
GPU_PILOT_FMAS = (256,)


def inject_gpu_slowdown(source: str, fmas: int) -> str:
    """flash_tf32.cu with `fmas` dependent FMAs per K/V tile on each warp's first
    score (multiplied by 1 and added 0: the same value, -0 aside, which the
    softmax treats alike). Inline PTX marked volatile, so NVRTC keeps the chain."""
    if source.count(GPU_INJECT_LINE) != 1:
        raise ValueError(f"the line the slowdown precedes moved: {GPU_INJECT_LINE!r}")
    extra = ("        {  // injected slowdown\n"
             "            float x_ = s[0][0][0];\n"
             "#pragma unroll 1\n"
             f"            for (int r_ = 0; r_ < {int(fmas)}; ++r_)\n"
             '                asm volatile("fma.rn.f32 %0, %0, 0f3F800000, 0f00000000;" : "+f"(x_));\n'
             "            s[0][0][0] = x_;\n"
             "        }\n")
    return source.replace(GPU_INJECT_LINE, extra + GPU_INJECT_LINE)


def gpu_variant(base_site: Path, dest: Path, fmas: int | None) -> Path:
    """A copy of the installed build `base_site` (identical when fmas is None,
    else with the slowdown injected): the head build of one comparison."""
    shutil.copytree(base_site, dest, symlinks=True)
    if fmas is not None:
        path = dest / GPU_INJECT_FILE
        path.write_text(inject_gpu_slowdown(path.read_text(), fmas))
    return dest


def gpu_paired(base: Path, head: Path, seed: int, tmp: Path, args, rounds=None, processes=None) -> dict:
    path = tmp / f"paired-{head.name}-{seed}.json"
    t0 = time.perf_counter()
    code = gate.main(["--device", "cuda", "--base-site", str(base), "--head-site", str(head), "--no-count",
                      "-b", args.gpu_regex, "--seed", str(seed), "--rounds", str(rounds or args.rounds),
                      "--processes", str(processes or args.processes), "--json", str(path)])
    data = json.loads(path.read_text())
    return {"seconds": time.perf_counter() - t0, "returncode": code,
            "rows": [{k: r.get(k) for k in ("benchmark", "ratio", "interval", "verdict", "rounds")}
                     for r in data["rows"]],
            "flagged": [r["benchmark"] for r in data["rows"] if r["verdict"] == "slower"]}


def gpu_counts(site: Path, keys) -> dict:
    python, env = gate.interpreter(site, isolated=False)
    t0 = time.perf_counter()
    counts = gate.gpu_counting.count(keys, python=python, env=env)
    return {"seconds": time.perf_counter() - t0, "counts": counts}


def gpu_fmas_for_levels(base: Path, tmp: Path, levels, args, data) -> dict[int, int]:
    """The chain length of each target level: a pilot comparison per length in
    GPU_PILOT_FMAS (30 rounds, one worker pair), the slowdown taken as linear in
    the length (median over configurations of (ratio - 1) / length)."""
    slopes = []
    for fmas in GPU_PILOT_FMAS:
        head = gpu_variant(base, tmp / f"pilot{fmas}", fmas)
        trial = gpu_paired(base, head, 100, tmp, args, rounds=30, processes=1)
        data.setdefault("pilot", {})[str(fmas)] = trial
        slopes += [(r["ratio"] - 1) / fmas for r in trial["rows"] if r.get("ratio")]
    slope = statistics.median(slopes)
    if slope <= 0:
        raise RuntimeError(f"the pilot measured no slowdown (slope {slope}): {data['pilot']}")
    return {lvl: max(1, round(lvl / 100 / slope)) for lvl in levels}


def calibrate_gpu(args) -> int:
    data = {"device": "cuda", "gpu": gate.gpu_name(), "levels": args.levels, "started": time.ctime(),
            "time_threshold": 0.02, "count_threshold": 0.01, "dram_threshold": 0.05, "regex": args.gpu_regex,
            "rounds": args.rounds, "processes": args.processes}
    if not args.wheel:
        raise SystemExit("--device cuda needs --wheel (a cp3X wheel of this tree: tools/gate.py --build-wheels)")
    with tempfile.TemporaryDirectory(prefix="attnkern-calibrate-gpu-") as tmp:
        tmp = Path(tmp)
        base = gate.site_of_wheel(Path(args.wheel), tmp / "cache", print)
        fmas = {int(k): v for k, v in (args.fmas or {}).items()} or gpu_fmas_for_levels(base, tmp, args.levels,
                                                                                         args, data)
        data["fmas"] = fmas
        sites = {"noop": gpu_variant(base, tmp / "noop", None),
                 **{f"slow{lvl}": gpu_variant(base, tmp / f"slow{lvl}", fmas[lvl]) for lvl in args.levels}}
        keys = [gate.gpu_counting.gpu_key("cuda.flash", "float32", s, c) for s in gate.GPU_SHAPES for c in (0, 1)]
        if "counted" in args.methods:
            # one count of each build: their run-to-run and build-to-build stability is the
            # A/A gate's (tools/gate.py --device cuda on two builds of identical code)
            data["counted"] = {name: [gpu_counts(site, keys)] for name, site in {"base": base, **sites}.items()
                               if name != "noop"}
            Path(args.out).write_text(json.dumps(data, indent=1))
        if "paired" in args.methods:
            # one trial of every level first, then the A/A comparisons, then the other trials:
            # a run cut short still has each kind of comparison
            comparisons = [(f"slow{lvl}", 0) for lvl in args.levels if args.trials > 0]
            comparisons += [("noop", seed) for seed in range(args.first_seed, args.first_seed + args.aa)]
            comparisons += [(f"slow{lvl}", seed) for seed in range(1, args.trials) for lvl in args.levels]
            data["paired"] = {}
            for i, (name, seed) in enumerate(comparisons):
                print(f"== comparison {i + 1}/{len(comparisons)}: base -> {name} (seed {seed})", flush=True)
                data["paired"].setdefault(name, []).append(gpu_paired(base, sites[name], seed, tmp, args))
                Path(args.out).write_text(json.dumps(data, indent=1))
    data["finished"] = time.ctime()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(data, indent=1))
    print(summarize_gpu(data))
    return 0


def summarize_gpu(data) -> str:
    """The GPU table of docs/regression-gate.md from the raw data of calibrate_gpu."""
    levels = data["levels"]
    lines = ["| method | verdict: slower when | false alarms (A/A) | "
             + " | ".join(f"{lvl}% slowdown flagged" for lvl in levels) + " | minutes per comparison |",
             "|---|---|---|" + "---|" * len(levels) + "---|"]

    def frac(trials, flagged):
        return f"{sum(1 for t in trials if flagged(t))}/{len(trials)}"

    paired, counted = data.get("paired"), data.get("counted")
    if paired:
        minutes = statistics.median(t["seconds"] for ts in paired.values() for t in ts) / 60
        cells = [frac(paired.get(f"slow{lvl}", []), lambda t: t["flagged"]) for lvl in levels]
        lines.append(f"| paired timing (CUDA events) | 95% interval above +{data['time_threshold']:.0%} | "
                     f"{frac(paired.get('noop', []), lambda t: t['flagged'])} | " + " | ".join(cells) + f" | {minutes:.1f} |")
    flags, aa_any = {}, False
    if counted:
        base = counted["base"]
        keys = [k for k in base[0]["counts"] if "error" not in base[0]["counts"][k]]

        def value(run, key, signal):
            c = run["counts"][key]
            return c["sass"] if signal == "sass" else c["dram_read"] + c["dram_write"]

        minutes = statistics.median(r["seconds"] for runs in counted.values() for r in runs) / 60
        for signal, threshold, what in (("sass", data["count_threshold"], "SASS instructions"),
                                        ("dram", data["dram_threshold"], "DRAM bytes")):
            ref = {k: value(base[0], k, signal) for k in keys}
            aa = [value(r, k, signal) / ref[k] for r in [*base[1:], *counted.get("noop", [])] for k in keys]
            spread = max((abs(x - 1) for x in aa), default=None)
            ratios = {lvl: [value(counted[f"slow{lvl}"][0], k, signal) / ref[k] for k in keys] for lvl in levels}
            flags[signal] = {lvl: max(r) > 1 + threshold for lvl, r in ratios.items()}
            aa_flags = sum(x > 1 + threshold for x in aa)
            aa_any = aa_any or aa_flags > 0
            aa_cell = f"{aa_flags} of {len(aa)} (max deviation {spread:.2%})" if aa else "see the A/A gate"
            cells = [f"{'yes' if flags[signal][lvl] else 'no'} (max {max(ratios[lvl]) - 1:+.1%})" for lvl in levels]
            lines.append(f"| counted: {what} (ncu) | above +{threshold:.0%} | {aa_cell} | "
                         + " | ".join(cells) + f" | {minutes:.1f} per build |")
    if paired and counted:
        cells = [frac(paired.get(f"slow{lvl}", []), lambda t, lvl=lvl: t["flagged"] or any(f[lvl] for f in flags.values()))
                 for lvl in levels]
        lines.append("| **gate** (any signal) | either signal | "
                     f"{frac(paired.get('noop', []), lambda t: t['flagged'] or aa_any)} | " + " | ".join(cells) + " | |")
    if paired:
        measured = []
        for lvl in levels:
            timed = [r["ratio"] for t in paired.get(f"slow{lvl}", []) for r in t["rows"] if r.get("ratio")]
            if not timed:
                continue
            measured.append(f"{lvl}% ({data['fmas'][str(lvl)] if str(lvl) in data['fmas'] else data['fmas'][lvl]} "
                            f"FMAs a tile): time {min(timed) - 1:+.1%} to {max(timed) - 1:+.1%}")
        aa = [x for t in paired.get("noop", []) for r in t["rows"] if r.get("interval") for x in r["interval"]] or [1.0]
        lines += ["", "What each injected level measured (paired medians over its trials and configurations): "
                  + "; ".join(measured) + f". A/A intervals within [{min(aa):.3f}, {max(aa):.3f}]."]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tools/calibrate_gate.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO / "docs" / "data" / "gate-calibration.json"))
    parser.add_argument("--aa", type=int, default=5, help="A/A comparisons per method (default 5)")
    parser.add_argument("--trials", type=int, default=3, help="comparisons per injected level (default 3)")
    parser.add_argument("--levels", type=int, nargs="+", default=sorted(KEYS_FOR_LEVEL), choices=sorted(KEYS_FOR_LEVEL))
    parser.add_argument("--methods", nargs="+", default=["counted", "paired", "asv", "avx512"],
                        choices=["counted", "paired", "asv", "avx512"],
                        help="avx512 needs an AVX-512 CPU and gcc; it is left out (with a note) elsewhere")
    parser.add_argument("--avx512-levels", type=int, nargs="+", default=sorted(AVX512_FMAS_FOR_LEVEL),
                        choices=sorted(AVX512_FMAS_FOR_LEVEL), help="the AVX-512-only slowdowns (percent)")
    parser.add_argument("--summarize", metavar="JSON", help="only print the table of an earlier run's data")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: calibrate the GPU gate on cuda.flash float32 (methods paired and counted)")
    parser.add_argument("--wheel", help="cuda: the wheel of this tree to calibrate with (the GPU machine has no "
                        "build tools: tools/gate.py --build-wheels)")
    parser.add_argument("--fmas", type=json.loads, help='cuda: FMAs per tile of each level as JSON, '
                        '{"2": 60, ...} (default: measured by a pilot)')
    parser.add_argument("--rounds", type=int, default=40, help="cuda: paired rounds per comparison (default 40)")
    parser.add_argument("--processes", type=int, default=2, help="cuda: worker pairs per comparison (default 2)")
    parser.add_argument("--first-seed", type=int, default=0, help="cuda: seed of the first A/A comparison "
                        "(more A/A comparisons added to an earlier run's)")
    parser.add_argument("--gpu-regex", default=GPU_REGEX, help=f"cuda: the configurations (default {GPU_REGEX})")
    args = parser.parse_args(argv)
    if args.summarize:
        data = json.loads(Path(args.summarize).read_text())
        if data.get("device") == "cuda":
            print(summarize_gpu(data))
        else:
            print("\n\n".join(([summarize(data)] if all(m in data for m in ("counted", "paired", "asv")) else [])
                              + ([summarize_avx512(data)] if "avx512" in data else [])))
        return 0
    if args.device == "cuda":
        if args.out == parser.get_default("out"):
            args.out = str(REPO / "docs" / "data" / "gate-calibration-gpu.json")
        args.methods = [m for m in args.methods if m != "asv"] or ["paired"]
        return calibrate_gpu(args)
    if "avx512" in args.methods and (why := gate.avx512_count.missing()):
        print(f"avx512: skipped: {why}")
        args.methods = [m for m in args.methods if m != "avx512"]
        if not args.methods:
            return 0
    cache = REPO / ".gate" / "builds"
    data = {"cpu": gate.cpu_name(), "levels": args.levels, "time_threshold": 0.02, "started": time.ctime(),
            "keys_for_level": KEYS_FOR_LEVEL, "asv_regex": ASV_REGEX, "paired_regex": PAIRED_REGEX}
    if Path(args.out).exists() and set(args.methods) < {"counted", "paired", "asv", "avx512"}:
        # re-measure some methods: the others' data stay
        old = json.loads(Path(args.out).read_text())
        data = {**old, **{k: v for k, v in data.items() if k not in ("levels",)},
                "started_" + "_".join(args.methods): time.ctime()}
        data["started"] = old.get("started")
    with tempfile.TemporaryDirectory(prefix="attnkern-calibrate-") as tmp:
        tmp = Path(tmp)
        clone = tmp / "attnkern"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        shas = make_history(clone, args.levels, args.avx512_levels if "avx512" in args.methods else ())
        data.setdefault("shas", shas)  # those of the first run; a re-measure's are under shas_<methods>
        comparisons = [("noop", seed) for seed in range(args.aa)]
        comparisons += [(f"slow{lvl}", seed) for seed in range(args.trials) for lvl in args.levels]
        # with avx512 and paired, the AVX-512-only commits are timed too (by paired alone:
        # what time they cost on this machine, whose native.flash runs the AVX-512 code)
        if "avx512" in args.methods and "paired" in args.methods:
            comparisons += [(f"avx512slow{lvl}", seed) for seed in range(args.trials) for lvl in args.avx512_levels]
        if not {"paired", "asv"} & set(args.methods):
            comparisons = []
        data["shas_" + "_".join(args.methods)] = shas
        if "counted" in args.methods:
            data["counted"] = counted_runs(clone, {k: v for k, v in shas.items() if not k.startswith("avx512")},
                                           cache)
        if "avx512" in args.methods:
            data["avx512"] = avx512_runs(clone, shas, args.aa)
            data["avx512_fmas_for_level"] = {lvl: AVX512_FMAS_FOR_LEVEL[lvl] for lvl in args.avx512_levels}
            Path(args.out).write_text(json.dumps(data, indent=1))
        asv = asv_setup(tmp, clone) if "asv" in args.methods else None
        for method in ("paired", "asv"):
            if method in args.methods:
                data[method] = {}
        for i, (name, seed) in enumerate(comparisons):
            print(f"== comparison {i + 1}/{len(comparisons)}: base -> {name} (seed {seed})", flush=True)
            if "paired" in args.methods:
                data["paired"].setdefault(name, []).append(paired_trial(clone, shas["base"], shas[name], seed, tmp))
            if asv is not None and not name.startswith("avx512"):
                data["asv"].setdefault(name, []).append(asv_trial(asv, shas["base"], shas[name]))
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(data, indent=1))
    data["finished_" + "_".join(args.methods)] = time.ctime()
    Path(args.out).write_text(json.dumps(data, indent=1))
    if all(m in data for m in ("counted", "paired", "asv")):
        print(summarize(data))
    if "avx512" in data:
        print(summarize_avx512(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
