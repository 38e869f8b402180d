"""The regression gate: did HEAD make a CPU kernel (or, with --device cuda, a
GPU kernel) slower than BASE?

    make gate BASE=main                      # or: .venv/bin/python tools/gate.py --base main
    .venv/bin/python tools/gate.py --base main -b native.flash --json gate.json
    make gate DEVICE=cuda BASE=main          # the GPU kernels (docs/regression-gate.md#the-gpu-gate)

Both commits are built into wheels (meson-python, cached under .gate/builds by
commit) and compared with two signals, each immune to a different kind of noise:

counted   Instructions executed by one single-threaded call of each kernel
          (benchmarks/counting.py: callgrind, only the kernel call is counted).
          Deterministic: identical code gives identical counts, so a tight
          threshold (default 1%) has no false alarms. Valgrind runs the AVX2
          path (it does not emulate AVX-512), and instructions are not time:
          memory stalls and vector width changes show only in the second signal.

avx512-counted  Where this CPU has AVX-512 and gcc is here (tools/avx512_count.py):
          the instructions native.flash's AVX-512 code (attn_avx512.c) executes
          in one single-threaded forward and backward, run natively in a harness
          built by gcc with -fsanitize-coverage=trace-pc from each commit's
          sources, its blocks' hits weighted by their instructions. Deterministic
          like `counted`, same threshold; it sees what Valgrind's AVX2 path cannot.

time      Wall time of both builds in paired, alternating turns on this machine:
          one worker process per build (benchmarks/turns.py), each with its own
          wheel, the same inputs and thread counts, idle OpenMP threads sleeping;
          per round and configuration both take a turn in a random order, a turn
          being an untimed call and one timed call, with a fresh pair of workers
          for each third of the rounds. The paired ratio per round (candidate /
          baseline) cancels the machine's drift; the estimate is the median over
          rounds, its 95% interval a bootstrap over worker pairs and rounds.

--device cuda: cuda.flash, triton.flash and cuda.naive on torch CUDA tensors; the
timed signal's turns are queued calls between CUDA events, the counted signals
SASS instructions and DRAM bytes read from the GPU's counters by ncu
(benchmarks/gpu_counting.py). Builds can be prebuilt wheels or installed
directories (--base-wheel, --head-site, ...), and --build-wheels makes the wheels
for a GPU machine that has no build tools.

A configuration is `slower` when its counted ratio exceeds 1 + --count-threshold,
or when the whole time interval lies above 1 + --time-threshold; `faster`
likewise below; otherwise `same`. The exit status is 1 if anything is slower,
0 otherwise (2 for a usage or build error). The measured false-alarm and
detection rates of these thresholds, and the gate's cost, are in
docs/regression-gate.md.
"""

from __future__ import annotations

import argparse
import hashlib
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
sys.path.append(str(REPO))  # attnkern_bench from the source tree where no attnkern is installed (a GPU runner's Python)
import counting  # noqa: E402  (benchmarks/counting.py: the counted signal's harness)
sys.path.insert(0, str(REPO / "tools"))
import avx512_count  # noqa: E402  (tools/avx512_count.py: the AVX-512 path's counted signal)
from gate_table import GateError, print_table, resolve  # noqa: E402,F401  (shared with avx512_count.py)
import gpu_counting  # noqa: E402  (benchmarks/gpu_counting.py: the GPU's counted signal, through ncu)
import turns  # noqa: E402  (benchmarks/turns.py: paired timing in worker processes)
from attnkern_bench.machine import cpu_name  # noqa: E402  (the builds compared run in workers)

KERNELS = ["native.flash", "native.tiled", "native.naive", "numba.flash", "numpy.naive"]
TIME_SHAPES = ["1x8x512x64", "1x8x1024x64"]
COUNT_SHAPES = ["1x2x256x64", "1x2x333x64"]
# --device cuda: (kernel, dtype) pairs, all forward, at GPU_SHAPES (timed and counted alike)
GPU_KERNELS = ["cuda.flash:float32", "cuda.flash:bfloat16", "triton.flash:bfloat16", "cuda.naive:float32"]
GPU_SHAPES = ["1x16x1024x64", "1x16x4096x64", "4x16x2048x128"]
# Kernels whose counts are not (yet) compared: triton.flash's autotuner used to pick its
# configuration by timing it in each process, and two runs of one build counted 0.81-1.20x each
# other's SASS instructions. Its configs now come from a fixed table (one compiled kernel per call
# shape and build), but equal counts run to run were not checked on a GPU yet. Timed only.
GPU_NOT_COUNTED = {"triton.flash": "not counted: run-to-run equality of its counts (fixed config table) not yet "
                                   "checked on a GPU: timed only"}


# ---------------------------------------------------------------- builds
def build_wheel(repo: Path, sha: str, wheels: Path, python: str = sys.executable) -> Path:
    """The wheel of commit `sha`, built like asv builds it (`pip wheel
    --no-build-isolation` with the build tools of `python`), written into `wheels`."""
    with tempfile.TemporaryDirectory(prefix="attnkern-gate-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        archive = subprocess.run(["git", "archive", "--format=tar", sha], cwd=repo, capture_output=True,
                                 check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(src, filter="data")
        wheels.mkdir(parents=True, exist_ok=True)
        before = set(wheels.glob("*.whl"))
        proc = subprocess.run([python, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                               str(wheels), str(src)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise GateError(f"building {sha[:10]} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        made = sorted(set(wheels.glob("*.whl")) - before) or sorted(wheels.glob("attnkern-*.whl"))
        if not made:
            raise GateError(f"building {sha[:10]} wrote no wheel into {wheels}")
        return made[-1]


def install_wheel(wheel: Path, site: Path) -> Path:
    """`wheel` installed without dependencies into the directory `site` (made
    whole or not at all)."""
    tmp_site = site.with_name(site.name + ".tmp")
    shutil.rmtree(tmp_site, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                           str(tmp_site), str(wheel)], capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp_site, ignore_errors=True)
        raise GateError(f"installing {wheel} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    tmp_site.rename(site)
    return site


# What a build is made from: commits that agree on these (a change to docs, tests or
# tools only) build the same package, so one build serves them all.
BUILD_INPUTS = ("attnkern", "meson.build", "pyproject.toml")


def source_key(repo: Path, sha: str) -> str | None:
    """The git object ids of commit `sha`'s BUILD_INPUTS, or None where git cannot say."""
    proc = subprocess.run(["git", "rev-parse", *(f"{sha}:{path}" for path in BUILD_INPUTS)], cwd=repo,
                          capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def build(repo: Path, sha: str, cache: Path, log) -> Path:
    """attnkern of commit `sha` installed (no dependencies) into its own
    directory, from a wheel built like asv builds it; cached by commit, and a
    commit whose BUILD_INPUTS equal a cached commit's takes that build."""
    site = cache / sha / "site"
    if (site / "attnkern").is_dir():
        return site
    key = source_key(repo, sha)
    if key is not None and cache.is_dir():
        for other in sorted(cache.iterdir()):
            if (other.name != sha and len(other.name) == 40 and (other / "site" / "attnkern").is_dir()
                    and source_key(repo, other.name) == key):
                log(f"{sha[:10]} builds what {other.name[:10]} built (same {', '.join(BUILD_INPUTS)}): "
                    "taking that build")
                return other / "site"
    log(f"building {sha[:10]} ...")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="attnkern-gate-wheel-") as tmp:
        install_wheel(build_wheel(repo, sha, Path(tmp)), site)
    log(f"built {sha[:10]} in {time.perf_counter() - t0:.0f} s")
    return site


def site_of_wheel(wheel: Path, cache: Path, log) -> Path:
    """A prebuilt wheel (one built elsewhere with --build-wheels, say) installed
    into a directory of its own under the cache, keyed by the wheel's contents."""
    if not wheel.is_file():
        raise GateError(f"no wheel at {wheel}")
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()[:16]
    site = cache / f"wheel-{digest}" / "site"
    if not (site / "attnkern").is_dir():
        log(f"installing {wheel.name} ({digest}) ...")
        site.parent.mkdir(parents=True, exist_ok=True)
        install_wheel(wheel, site)
    return site


def interpreter(site: Path, isolated: bool = True) -> tuple[list[str], dict]:
    """The command and environment that import attnkern from `site` and its
    dependencies from this virtualenv. `-S` skips site-packages' .pth files:
    the editable install of the working tree must not shadow the build. The GPU
    gate needs them (numba-cuda's `numba.cuda` comes through one: without it,
    numba's own obsolete CUDA target is imported), so it runs with
    isolated=False; its workers report the attnkern they imported, which must be
    the build's."""
    env = dict(os.environ)
    # the caller's PYTHONPATH stays after the build and before this virtualenv's
    # packages: where packages were installed with --target (the GPU machine's
    # NumPy), they are found first, as in the caller
    caller = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([str(site), *caller, sysconfig.get_paths()["purelib"],
                                         sysconfig.get_paths()["platlib"]])
    env.pop("ATTNKERN_ISA", None)
    env["ATTNKERN_GATE_SITE"] = str(site)
    return [sys.executable, *(["-S"] if isolated else [])], env


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


def count_avx512(repo: Path, shas: dict, names: dict, keep, args, log) -> list[dict]:
    """The avx512-counted rows of native.flash (tools/avx512_count.py), or one
    skipped row saying why the signal cannot run: the CPU has no AVX-512, gcc or
    objdump is missing, a side is a wheel or an installed site (the harness is
    built from a commit's sources), or native.flash is not compared."""
    if "native.flash" not in args.kernels:
        return []
    cfgs = [c for c in avx512_count.configs(args.count_shapes)
            if keep is None or keep.search(avx512_count.config_key(*c))]
    if not cfgs:
        return []
    why = avx512_count.missing()
    if why is None and set(shas) != set(names):
        why = "needs both sides as commits (it builds their sources), not a wheel or an installed site"
    if why:
        return [{"benchmark": "native.flash", "signal": "avx512-counted", "verdict": "skipped", "note": why}]
    log(f"counting native.flash's AVX-512 code natively (trace-pc) in {len(cfgs)} configurations ...")
    try:
        counted = avx512_count.count_commits(repo, shas, cfgs, log)
    except avx512_count.CountError as exc:
        raise GateError(f"avx512-counted: {exc}") from exc
    return avx512_count.rows(counted, args.count_threshold)


def count_gpu(keys, sites, log) -> dict[str, dict[str, dict]] | str:
    """Both builds' GPU counts (benchmarks/gpu_counting.py), one ncu run each,
    one after the other (the GPU's counters serve one profiler at a time).
    Returns {side: {key: counts}}, or a string saying why the counters could
    not be read (then the gate times only)."""
    counted = {side: {} for side in sites}
    for side, site in sites.items() if keys else ():
        log(f"counting SASS instructions and DRAM bytes of {len(keys)} configurations under ncu ({side}) ...")
        t0 = time.perf_counter()
        python, env = interpreter(site, isolated=False)
        try:
            counted[side] = gpu_counting.count(keys, python=python, env=env)
        except gpu_counting.CountersRestricted as exc:
            log(f"{exc}: timing only")
            return str(exc)
        log(f"counted {side} in {time.perf_counter() - t0:.0f} s")
    return counted


# ---------------------------------------------------------------- paired timing
def setup_of(key: str) -> dict:
    """A configuration key as the worker's setup takes it: kernel:shape:causal
    (a CPU kernel, float32 NumPy inputs) or kernel:dtype:shape:causal (torch CUDA
    inputs, timed with CUDA events)."""
    parts = key.split(":")
    if len(parts) == 4:
        kernel, dtype, shape, causal = parts
        return dict(kernel=kernel, dtype=dtype, shape=shape, causal=bool(int(causal)), device="cuda")
    kernel, shape, causal = parts
    return dict(kernel=kernel, shape=shape, causal=bool(int(causal)))


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
                python, env = interpreter(site, isolated=args.device != "cuda")
                workers[side] = turns.Worker(python, env, args.threads)
            for key in (configs if keys is None else keys):
                replies = {side: w.setup(**setup_of(key), key=key) for side, w in workers.items()}
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


def rows_of(counted, timed, args, gpu_counted=None) -> list[dict]:
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
    if isinstance(gpu_counted, str):
        rows.append({"benchmark": "*", "signal": "counted", "verdict": "skipped", "note": gpu_counted})
        gpu_counted = None
    for key, base in (gpu_counted or {}).get("baseline", {}).items():
        cand = gpu_counted["candidate"][key]
        if "error" in base or "error" in cand:
            rows.append({"benchmark": key, "signal": "sass", "verdict": "skipped",
                         "note": base.get("error") or cand.get("error")})
            continue
        for signal, unit, b, c, threshold in (
                ("sass", "instructions", base["sass"], cand["sass"], args.count_threshold),
                ("dram", "bytes", base["dram_read"] + base["dram_write"], cand["dram_read"] + cand["dram_write"],
                 args.dram_threshold)):
            ratio = c / b if b else 1.0
            rows.append({"benchmark": key, "signal": signal, "unit": unit, "baseline": b, "candidate": c,
                         "ratio": ratio, "interval": [ratio, ratio], "verdict": verdict(ratio, ratio, threshold),
                         "baseline_counts": base, "candidate_counts": cand})
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


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="tools/gate.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="baseline commit (a branch, tag or sha); or --base-wheel/--base-site")
    parser.add_argument("--repo", default=str(REPO), help="the git repository (default: this one)")
    parser.add_argument("--head", default="HEAD", help="candidate commit (default HEAD; uncommitted edits are not seen)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu (default): the CPU kernels; cuda: the GPU kernels on torch CUDA tensors")
    parser.add_argument("--base-wheel", help="a prebuilt wheel as the baseline, instead of building --base")
    parser.add_argument("--head-wheel", help="a prebuilt wheel as the candidate, instead of building --head")
    parser.add_argument("--base-site", help="a directory attnkern is installed in, as the baseline")
    parser.add_argument("--head-site", help="a directory attnkern is installed in, as the candidate")
    parser.add_argument("--build-wheels", metavar="DIR",
                        help="only build --base and --head into DIR/base and DIR/head (to carry to a GPU machine "
                             "without build tools) and exit")
    parser.add_argument("--build-python", default=sys.executable,
                        help="the interpreter whose build tools build the wheels (--build-wheels: the GPU "
                             "machine's Python version)")
    parser.add_argument("--kernels", nargs="+", help=f"default {' '.join(KERNELS)}; with --device cuda, "
                        f"kernel:dtype pairs, default {' '.join(GPU_KERNELS)}")
    parser.add_argument("-b", "--bench", help="only configurations matching this regex (kernel:shape:causal; "
                        "kernel:dtype:shape:causal with --device cuda)")
    parser.add_argument("--time-shapes", nargs="+", help=f"BxHxNxD shapes timed (default {' '.join(TIME_SHAPES)}; "
                        f"cuda: {' '.join(GPU_SHAPES)})")
    parser.add_argument("--count-shapes", nargs="+", help=f"BxHxNxD shapes counted (default "
                        f"{' '.join(COUNT_SHAPES)}; cuda: the timed shapes)")
    parser.add_argument("--no-count", action="store_true",
                        help="skip the counted signals (Valgrind's and, with AVX-512, avx512-counted)")
    parser.add_argument("--no-time", action="store_true", help="skip the timed signal")
    parser.add_argument("--no-avx512-count", action="store_true",
                        help="skip the avx512-counted signal (native.flash's AVX-512 code, where the CPU has it)")
    parser.add_argument("--count-threshold", type=float, default=0.01,
                        help="relative change of instructions (CPU: Valgrind's, cuda: SASS) (default 0.01)")
    parser.add_argument("--dram-threshold", type=float, default=0.05,
                        help="cuda: relative change of the DRAM bytes of a call (default 0.05)")
    parser.add_argument("--time-threshold", type=float, default=0.02,
                        help="the time interval must lie beyond 1 +/- this (default 0.02)")
    parser.add_argument("--rounds", type=int, help="paired rounds per configuration (default 150; cuda 100)")
    parser.add_argument("--processes", type=int, default=3,
                        help="fresh worker pairs the rounds are spread over (default 3)")
    parser.add_argument("--calls", type=int, help="timed calls per turn (default 1; cuda 5, queued back to back); "
                        "a turn's median counts")
    parser.add_argument("--settle", type=float, default=0.0, help="pause before each turn, seconds (default 0)")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("ATTNKERN_BENCH_THREADS", "2")),
                        help="threads of every kernel and BLAS when timing (default 2); counting uses 1")
    parser.add_argument("--seed", type=int, default=0, help="seed of the turn order and the bootstrap")
    parser.add_argument("--cache", default=str(REPO / ".gate" / "builds"), help="where built commits are kept")
    parser.add_argument("--json", help="write every measurement (per-round ratios, counts) to this file")
    args = parser.parse_args(argv)
    gpu = args.device == "cuda"
    args.kernels = args.kernels or (GPU_KERNELS if gpu else KERNELS)
    args.time_shapes = args.time_shapes or (GPU_SHAPES if gpu else TIME_SHAPES)
    args.count_shapes = args.count_shapes or (args.time_shapes if gpu else COUNT_SHAPES)
    args.rounds = args.rounds or (100 if gpu else 150)
    args.calls = args.calls or (5 if gpu else 1)
    for side in ("base", "head"):
        given = [o for o in (f"--{side}-wheel", f"--{side}-site") if getattr(args, o[2:].replace("-", "_"))]
        if len(given) > 1:
            parser.error(f"give at most one of --{side}-wheel and --{side}-site")
    if args.build_wheels:
        if args.base is None:
            parser.error("--build-wheels needs --base (and builds --head too)")
    elif args.base is None and not (args.base_wheel or args.base_site):
        parser.error("the baseline is missing: give --base, --base-wheel or --base-site")
    if gpu:
        bad = [k for k in args.kernels if len(k.split(":")) != 2]
        if bad:
            parser.error(f"with --device cuda, --kernels takes kernel:dtype pairs (cuda.flash:bfloat16), not {bad}")
    if args.rounds < args.processes:
        parser.error(f"--rounds ({args.rounds}) must be at least --processes ({args.processes})")
    return args


def gpu_missing() -> str | None:
    """None if a CUDA GPU can be used through torch here, else why not."""
    try:
        import torch
    except ImportError:
        return "--device cuda needs torch with CUDA: torch is not installed"
    if not torch.cuda.is_available():
        return (f"--device cuda needs a CUDA GPU: torch {torch.__version__} sees none here "
                f"(torch.cuda.is_available() is False; CUDA build: {torch.version.cuda or 'no'})")
    return None


def main(argv=None) -> int:
    args = parse_args(argv)

    def log(msg):
        print(f"[gate {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    repo, cache = Path(args.repo), Path(args.cache)
    gpu = args.device == "cuda"
    if args.build_wheels:
        out = Path(args.build_wheels)
        for side, rev in (("base", args.base), ("head", args.head)):
            sha = resolve(repo, rev)
            shutil.rmtree(out / side, ignore_errors=True)
            log(f"building {side} {sha[:10]} with {args.build_python} ...")
            wheel = build_wheel(repo, sha, out / side, args.build_python)
            (out / side / "COMMIT").write_text(sha + "\n")
            print(f"{side}: {wheel}")
        return 0
    if gpu and (why := gpu_missing()):
        raise GateError(why)
    keep = re.compile(args.bench) if args.bench else None

    def configs(shapes):
        if gpu:
            keys = [gpu_counting.gpu_key(*kd.split(":"), s, c) for kd in args.kernels for s in shapes
                    for c in (False, True)]
        else:
            keys = [counting.config_key(k, s, c) for k in args.kernels for s in shapes for c in (False, True)]
        return [k for k in keys if keep is None or keep.search(k)]

    count_cfg, time_cfg = configs(args.count_shapes), configs(args.time_shapes)
    if not count_cfg and not time_cfg:
        raise GateError("no configuration matches")
    if not args.no_count and (why := (gpu_counting.ncu_missing() if gpu else counting.valgrind_missing())):
        raise GateError(f"{why}")
    sides = {"baseline": "base", "candidate": "head"}
    # commits resolved before anything is built: a bad revision fails at once, and both are read at one time
    shas = {side: resolve(repo, getattr(args, short)) for side, short in sides.items()
            if not (getattr(args, f"{short}_wheel") or getattr(args, f"{short}_site"))}
    sites, names = {}, {}
    for side, short in sides.items():
        wheel, site = getattr(args, f"{short}_wheel"), getattr(args, f"{short}_site")
        if site:
            if not (Path(site) / "attnkern").is_dir():
                raise GateError(f"--{short}-site {site} holds no attnkern package")
            sites[side], names[side] = Path(site), f"site {site}"
        elif wheel:
            sites[side], names[side] = site_of_wheel(Path(wheel), cache, log), f"wheel {Path(wheel).name}"
        else:
            sites[side], names[side] = build(repo, shas[side], cache, log), shas[side]
    counted = gpu_counted = None
    if not args.no_count and count_cfg:
        if gpu:
            gpu_counted = count_gpu([k for k in count_cfg if k.split(":")[0] not in GPU_NOT_COUNTED], sites, log)
            if not isinstance(gpu_counted, str):
                for side in gpu_counted:
                    gpu_counted[side].update({k: {"error": GPU_NOT_COUNTED[k.split(":")[0]]} for k in count_cfg
                                              if k.split(":")[0] in GPU_NOT_COUNTED})
        else:
            counted = count_both([(k, s, bool(int(c))) for k, s, c in (x.split(":") for x in count_cfg)], sites, log)
    avx512_rows = []
    if not gpu and not args.no_count and not args.no_avx512_count:
        avx512_rows = count_avx512(repo, shas, names, keep, args, log)
    timed = None
    if not args.no_time and time_cfg:
        timed = time_both(time_cfg, sites, args, log)
    rows = rows_of(counted, timed, args, gpu_counted)
    # the counted signals first, then the timed one
    rows = [r for r in rows if r["signal"] != "time"] + avx512_rows + [r for r in rows if r["signal"] == "time"]
    minutes = (time.perf_counter() - started) / 60
    where = gpu_name() if gpu else cpu_name()
    short = {side: n[:10] if re.fullmatch("[0-9a-f]{40}", n) else n for side, n in names.items()}
    print(f"# {short['baseline']} (baseline) -> {short['candidate']} (candidate) on {where}")
    if gpu:
        print(f"# sass, dram: SASS instructions and DRAM bytes of one call, ncu (CUPTI); slower above "
              f"{args.count_threshold:+.1%} / {args.dram_threshold:+.1%}")
        print(f"# time: {args.rounds} paired rounds, turns of {args.calls} queued calls between CUDA events, "
              f"median ratio and 95% bootstrap interval; slower when the interval lies above {args.time_threshold:+.1%}")
    else:
        print(f"# counted: instructions of one call, 1 thread, under valgrind; slower above {args.count_threshold:+.1%}")
        if avx512_rows:
            print(f"# avx512-counted: instructions of native.flash's AVX-512 code in one call, 1 thread, run "
                  f"natively (trace-pc instrumentation, tools/avx512_count.py); slower above {args.count_threshold:+.1%}")
        print(f"# time: {args.rounds} paired rounds, {args.threads} threads, median ratio and 95% bootstrap interval; "
              f"slower when the interval lies above {args.time_threshold:+.1%}")
    print_table(rows)
    slower = [r for r in rows if r["verdict"] == "slower"]
    print(f"# {len(slower)} slower, {sum(r['verdict'] == 'faster' for r in rows)} faster, "
          f"{sum(r['verdict'] == 'same' for r in rows)} unchanged; {minutes:.1f} min")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"baseline": names["baseline"], "candidate": names["candidate"], "device": args.device,
                       "machine": where, "cpu": cpu_label(), "threads": args.threads, "rounds": args.rounds,
                       "calls": args.calls, "count_threshold": args.count_threshold,
                       "dram_threshold": args.dram_threshold, "time_threshold": args.time_threshold,
                       "minutes": minutes, "rows": rows}, f, indent=1)
    if slower:
        print("# PERFORMANCE DECREASED: " + ", ".join(f"{r['benchmark']} ({r['signal']})" for r in slower))
        return 1
    return 0


def cpu_label() -> str:
    """cpu_name(), or where this process cannot import attnkern's compiled extension (a GPU machine
    gating installed wheels from a source checkout) what it could not do: the JSON's "cpu" is
    informational, and the comparison has been made by then."""
    try:
        return cpu_name()
    except RuntimeError as exc:
        return f"unknown ({exc})"


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except (GateError, RuntimeError, OSError) as exc:
        print(f"gate: {exc}", file=sys.stderr)
        raise SystemExit(2)
