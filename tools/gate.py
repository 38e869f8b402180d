"""The regression gate: did HEAD make a CPU kernel slower than BASE?

    make gate BASE=main                      # or: .venv/bin/python tools/gate.py --base main
    .venv/bin/python tools/gate.py --base main -b native.flash --json gate.json

Both commits are built into wheels (meson-python, cached under .gate/builds by
commit) and compared with two signals, each immune to a different kind of noise:

counted   Instructions executed by one single-threaded call of each kernel
          (benchmarks/counting.py: callgrind, only the kernel call is counted).
          Deterministic: identical code gives identical counts, so a tight
          threshold (default 1%) has no false alarms. Valgrind runs the AVX2
          path (it does not emulate AVX-512), and instructions are not time:
          memory stalls and vector width changes show only in the second signal.

time      Wall time of both builds in paired, alternating turns on this machine:
          one worker process per build (benchmarks/turns.py), each with its own
          wheel, the same inputs and thread counts, idle OpenMP threads sleeping;
          per round and configuration both take a turn in a random order, a turn
          being an untimed call and one timed call, with a fresh pair of workers
          for each third of the rounds. The paired ratio per round (candidate /
          baseline) cancels the machine's drift; the estimate is the median over
          rounds, its 95% interval a bootstrap over worker pairs and rounds.

A configuration is `slower` when its counted ratio exceeds 1 + --count-threshold,
or when the whole time interval lies above 1 + --time-threshold; `faster`
likewise below; otherwise `same`. The exit status is 1 if anything is slower,
0 otherwise (2 for a usage or build error). The measured false-alarm and
detection rates of these thresholds, and the gate's cost, are in
docs/regression-gate.md.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import counting  # noqa: E402  (benchmarks/counting.py: the counted signal's harness)
import turns  # noqa: E402  (benchmarks/turns.py: paired timing in worker processes)
from attnkern_bench.machine import cpu_name  # noqa: E402  (the builds compared run in workers)

class GateError(Exception):
    """The gate could not compare (a bad revision, a failed build): exit status 2."""


KERNELS = ["native.flash", "native.tiled", "native.naive", "numba.flash", "numpy.naive"]
TIME_SHAPES = ["1x8x512x64", "1x8x1024x64"]
COUNT_SHAPES = ["1x2x256x64", "1x2x333x64"]


# ---------------------------------------------------------------- builds
def resolve(repo: Path, rev: str) -> str:
    proc = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=repo,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise GateError(f"{rev!r} is not a commit of {repo}")
    return proc.stdout.strip()


def build(repo: Path, sha: str, cache: Path, log) -> Path:
    """attnkern of commit `sha` installed (no dependencies) into its own
    directory, from a wheel built like asv builds it; cached by commit."""
    site = cache / sha / "site"
    if (site / "attnkern").is_dir():
        return site
    log(f"building {sha[:10]} ...")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="attnkern-gate-") as tmp:
        src, wheels = Path(tmp) / "src", Path(tmp) / "wheels"
        src.mkdir()
        archive = subprocess.run(["git", "archive", "--format=tar", sha], cwd=repo, capture_output=True,
                                 check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(src, filter="data")
        tmp_site = site.with_name("site.tmp")
        shutil.rmtree(tmp_site, ignore_errors=True)
        steps = [lambda: [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(wheels), str(src)],
                 lambda: [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(tmp_site),
                          *map(str, wheels.glob("*.whl"))]]
        for step in steps:
            proc = subprocess.run(step(), capture_output=True, text=True)
            if proc.returncode != 0:
                shutil.rmtree(tmp_site, ignore_errors=True)
                raise GateError(f"building {sha[:10]} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    site.with_name("site.tmp").rename(site)
    log(f"built {sha[:10]} in {time.perf_counter() - t0:.0f} s")
    return site


def interpreter(site: Path) -> tuple[list[str], dict]:
    """The command and environment that import attnkern from `site` and its
    dependencies from this virtualenv. `-S` skips site-packages' .pth files:
    the editable install of the working tree must not shadow the build."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site), sysconfig.get_paths()["purelib"],
                                         sysconfig.get_paths()["platlib"]])
    env.pop("ATTNKERN_ISA", None)
    return [sys.executable, "-S"], env


# ---------------------------------------------------------------- counted signal
def count_both(configs, sites, log) -> dict[str, dict[str, dict]]:
    """Both builds counted at once, one Valgrind process each. Valgrind runs a
    program on one core, and the counts are simulated (instructions and cache
    misses of the program alone), so running the two side by side leaves them
    unchanged and halves the wall time where there are two cores."""

    def count_side(side, site):
        log(f"counting instructions of {len(configs)} configurations under valgrind ({side}) ...")
        t0 = time.perf_counter()
        python, env = interpreter(site)
        counts = counting.count(configs, python=python, env=env)
        log(f"counted {side} in {time.perf_counter() - t0:.0f} s")
        return counts

    with ThreadPoolExecutor(max_workers=len(sites)) as pool:
        futures = {side: pool.submit(count_side, side, site) for side, site in sites.items()}
        return {side: future.result() for side, future in futures.items()}


# ---------------------------------------------------------------- paired timing
def time_both(configs, sites, args, log) -> dict[str, dict]:
    """Paired, alternating timing of every configuration on both builds: one
    worker process per build at a time (benchmarks/turns.py), replaced by a
    fresh pair --processes times over the rounds. A process's memory layout
    (where its buffers land relative to each other) can make one kernel 30%
    faster or slower for that process's whole life; fresh pairs sample it, and
    the interval resamples processes as well as rounds."""
    rng = random.Random(args.seed)
    plan, keys = {}, None
    per_process = [args.rounds // args.processes + (i < args.rounds % args.processes) for i in range(args.processes)]
    t0, done = time.perf_counter(), 0
    for proc_index, rounds in enumerate(per_process):
        workers = {}
        try:
            for side, site in sites.items():
                python, env = interpreter(site)
                workers[side] = turns.Worker(python, env, args.threads)
            for key in (configs if keys is None else keys):
                kernel, shape, causal = key.split(":")
                replies = {side: w.setup(kernel, shape, bool(int(causal)), key=key) for side, w in workers.items()}
                skip = [r["skip"] for r in replies.values() if "skip" in r]
                if skip:
                    plan[key] = {"skip": skip[0]}
                    continue
                for side, r in replies.items():
                    if not os.path.realpath(r["file"]).startswith(os.path.realpath(sites[side])):
                        raise GateError(f"the {side} worker imported {r['file']}, not its build")
                plan.setdefault(key, {"calls": args.calls, "processes": [], "baseline": [], "candidate": []})
                plan[key]["processes"].append([])
            keys = [k for k in configs if "skip" not in plan[k]]
            for _ in range(rounds):
                rng.shuffle(keys)
                for key in keys:
                    med = turns.paired_turns(workers, 1, plan[key]["calls"], args.settle, rng, key)
                    plan[key]["baseline"] += med["baseline"]
                    plan[key]["candidate"] += med["candidate"]
                    plan[key]["processes"][-1].append(med["candidate"][0] / med["baseline"][0])
                done += 1
                elapsed = time.perf_counter() - t0
                if done % max(1, args.rounds // 10) == 0 or done == args.rounds:
                    log(f"timing: round {done}/{args.rounds}, worker pair {proc_index + 1}/{args.processes} "
                        f"({elapsed:.0f} s, ~{elapsed / done * (args.rounds - done):.0f} s left)")
        finally:
            for w in workers.values():
                w.close()
    for key in keys or []:
        p = plan[key]
        p["rounds"] = [r for group in p["processes"] for r in group]
        p["ratio"] = statistics.median(p["rounds"])
        p["interval"] = turns.bootstrap_median_ci(p["processes"], seed=args.seed)
    return plan


# ---------------------------------------------------------------- verdicts and table
def verdict(lo: float, hi: float, threshold: float) -> str:
    if lo > 1 + threshold:
        return "slower"
    if hi < 1 - threshold:
        return "faster"
    return "same"


def rows_of(counted, timed, args) -> list[dict]:
    rows = []
    for key, base in (counted or {}).get("baseline", {}).items():
        cand = counted["candidate"][key]
        if "error" in base or "error" in cand:
            rows.append({"benchmark": key, "signal": "counted", "verdict": "skipped",
                         "note": base.get("error") or cand.get("error")})
            continue
        ratio = cand["Ir"] / base["Ir"]
        rows.append({"benchmark": key, "signal": "counted", "unit": "instructions", "baseline": base["Ir"],
                     "candidate": cand["Ir"], "ratio": ratio, "interval": [ratio, ratio],
                     "verdict": verdict(ratio, ratio, args.count_threshold),
                     "baseline_counts": base, "candidate_counts": cand,
                     "estimated_cycles_ratio": counting.estimated_cycles(cand) / counting.estimated_cycles(base)})
    for key, p in (timed or {}).items():
        if "skip" in p:
            rows.append({"benchmark": key, "signal": "time", "verdict": "skipped", "note": p["skip"]})
            continue
        lo, hi = p["interval"]
        rows.append({"benchmark": key, "signal": "time", "unit": "s", "baseline": statistics.median(p["baseline"]),
                     "candidate": statistics.median(p["candidate"]), "ratio": p["ratio"], "interval": [lo, hi],
                     "verdict": verdict(lo, hi, args.time_threshold), "rounds": p["rounds"],
                     "calls_per_turn": p["calls"]})
    return rows


def print_table(rows) -> None:
    head = f"{'benchmark':<34} {'signal':<8} {'baseline':>12} {'candidate':>12} {'ratio':>7} {'95% interval':>17}  verdict"
    print(head)
    print("-" * len(head))
    for r in rows:
        if r["verdict"] == "skipped":
            print(f"{r['benchmark']:<34} {r['signal']:<8} {'':>12} {'':>12} {'':>7} {'':>17}  skipped: {r['note']}")
            continue
        if r["signal"] == "counted":
            b, c, iv = f"{r['baseline'] / 1e6:.3f}M", f"{r['candidate'] / 1e6:.3f}M", "exact"
        else:
            b, c = f"{r['baseline'] * 1e3:.3f} ms", f"{r['candidate'] * 1e3:.3f} ms"
            iv = f"[{r['interval'][0]:.3f}, {r['interval'][1]:.3f}]"
        mark = {"slower": "SLOWER", "faster": "faster", "same": "same"}[r["verdict"]]
        print(f"{r['benchmark']:<34} {r['signal']:<8} {b:>12} {c:>12} {r['ratio']:>7.3f} {iv:>17}  {mark}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tools/gate.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="baseline commit (a branch, tag or sha)")
    parser.add_argument("--repo", default=str(REPO), help="the git repository (default: this one)")
    parser.add_argument("--head", default="HEAD", help="candidate commit (default HEAD; uncommitted edits are not seen)")
    parser.add_argument("--kernels", nargs="+", default=KERNELS)
    parser.add_argument("-b", "--bench", help="only configurations matching this regex (kernel:shape:causal)")
    parser.add_argument("--time-shapes", nargs="+", default=TIME_SHAPES, help="BxHxNxD shapes timed")
    parser.add_argument("--count-shapes", nargs="+", default=COUNT_SHAPES, help="BxHxNxD shapes counted")
    parser.add_argument("--no-count", action="store_true", help="skip the counted signal")
    parser.add_argument("--no-time", action="store_true", help="skip the timed signal")
    parser.add_argument("--count-threshold", type=float, default=0.01, help="relative change of instructions (default 0.01)")
    parser.add_argument("--time-threshold", type=float, default=0.02,
                        help="the time interval must lie beyond 1 +/- this (default 0.02)")
    parser.add_argument("--rounds", type=int, default=150, help="paired rounds per configuration (default 150)")
    parser.add_argument("--processes", type=int, default=3,
                        help="fresh worker pairs the rounds are spread over (default 3)")
    parser.add_argument("--calls", type=int, default=1, help="timed calls per turn (default 1); a turn's median counts")
    parser.add_argument("--settle", type=float, default=0.0, help="pause before each turn, seconds (default 0)")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("ATTNKERN_BENCH_THREADS", "2")),
                        help="threads of every kernel and BLAS when timing (default 2); counting uses 1")
    parser.add_argument("--seed", type=int, default=0, help="seed of the turn order and the bootstrap")
    parser.add_argument("--cache", default=str(REPO / ".gate" / "builds"), help="where built commits are kept")
    parser.add_argument("--json", help="write every measurement (per-round ratios, counts) to this file")
    args = parser.parse_args(argv)

    def log(msg):
        print(f"[gate {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    repo = Path(args.repo)
    shas = {"baseline": resolve(repo, args.base), "candidate": resolve(repo, args.head)}
    keep = re.compile(args.bench) if args.bench else None

    def configs(shapes):
        keys = [(k, s, c) for k in args.kernels for s in shapes for c in (False, True)]
        return [c for c in keys if keep is None or keep.search(counting.config_key(*c))]

    count_cfg, time_cfg = configs(args.count_shapes), configs(args.time_shapes)
    if not count_cfg and not time_cfg:
        raise GateError("no configuration matches")
    if not args.no_count and (why := counting.valgrind_missing()):
        raise GateError(f"{why}")
    cache = Path(args.cache)
    sites = {side: build(repo, sha, cache, log) for side, sha in shas.items()}
    counted = None if args.no_count or not count_cfg else count_both(count_cfg, sites, log)
    timed = None
    if not args.no_time and time_cfg:
        timed = time_both([counting.config_key(*c) for c in time_cfg], sites, args, log)
    rows = rows_of(counted, timed, args)
    minutes = (time.perf_counter() - started) / 60
    print(f"# {shas['baseline'][:10]} (baseline) -> {shas['candidate'][:10]} (candidate) on {cpu_name()}")
    print(f"# counted: instructions of one call, 1 thread, under valgrind; slower above {args.count_threshold:+.1%}")
    print(f"# time: {args.rounds} paired rounds, {args.threads} threads, median ratio and 95% bootstrap interval; "
          f"slower when the interval lies above {args.time_threshold:+.1%}")
    print_table(rows)
    slower = [r for r in rows if r["verdict"] == "slower"]
    print(f"# {len(slower)} slower, {sum(r['verdict'] == 'faster' for r in rows)} faster, "
          f"{sum(r['verdict'] == 'same' for r in rows)} unchanged; {minutes:.1f} min")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"baseline": shas["baseline"], "candidate": shas["candidate"], "cpu": cpu_name(),
                       "threads": args.threads, "rounds": args.rounds, "count_threshold": args.count_threshold,
                       "time_threshold": args.time_threshold, "minutes": minutes, "rows": rows}, f, indent=1)
    if slower:
        print("# PERFORMANCE DECREASED: " + ", ".join(f"{r['benchmark']} ({r['signal']})" for r in slower))
        return 1
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except (GateError, RuntimeError, OSError) as exc:
        print(f"gate: {exc}", file=sys.stderr)
        raise SystemExit(2)
