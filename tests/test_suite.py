"""The asv suite as `make bench` runs it, and its numbers against `attnkern bench`'s.

1. Every benchmark of the suite runs once (`asv run --quick`: one sample each, setup
   caches included, each benchmark in a process forked from asv's server, as in
   `make bench`) and none fails. Three differences from `make bench`, for time: two asv
   processes at once, each running part of the suite's modules (SMOKE_PARTS); the
   suite's smoke setting (ATTNKERN_BENCH_SMOKE=1, benchmarks/common.py) keeps the first
   value of each size axis (every kernel, mask and dtype stays), and `--python=same`
   runs against this checkout's installed attnkern instead of a wheel built in asv's
   own virtualenv (tests/test_asv.py covers that build).
2. asv's timings agree with `attnkern bench`'s for the same kernel, shape and threads:
   within 15% (more where identical code measured noisier: AGREE_NOISY, short calls) for
   each kernel timed in `Forward`, `Throughput`, `BlockSweep`, `Tuned` and
   `ForwardHalf` (attnkern bench run once a kernel, each in its own process as in asv),
   the kernels in the same order, and every kernel ran on the suite's thread count
   (`ThreadsUsed`). Two of our own tools that disagree is a defect: a
   forked benchmark process on fewer threads than it claims, another runtime's threads
   slowing a kernel in one of them, or a setting one of them forgets.

Slow (minutes: Valgrind counts every CPU kernel, the suite times several hundred
configurations once, then a few dozen properly); run with `pytest -m slow`, and by
`make test`.
"""

import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
ASV = [sys.executable, "-m", "asv"]
MACHINE = "attnkern-selftest"
THREADS = 2
SHAPE = "1x8x1024x64"
KERNELS = ["native.flash", "native.tiled", "torch.sdpa", "numba.flash", "numpy.naive"]
HALF_KERNELS = ["native.flash", "native.tiled", "torch.sdpa"]
# Throughput is Forward's timing read as ps/FLOP in a class of its own: two kernels show
# that the class reads like bench (every kernel would double the test's asv time)
THROUGHPUT_KERNELS = ["native.flash", "torch.sdpa"]
# asv's number and attnkern bench's for the same kernel, shape and threads: at most this far apart,
AGREE = 0.15
# except where the measured noise of identical code is larger (2-core AMD EPYC, 2026-11-26):
# numpy.naive (memory-bound, 32 MiB of scores a call) moved 15-18% between runs of either tool
# (bench 29.9-34.4 ms, asv 25.4-31.3 ms at 1x8x1024x64), so it gets 30%; and asv read calls
# under 5 ms (the causal native kernels) 0.4-0.6 ms longer than bench in one fresh-clone run
# (3-11% in the others), though a forked child times them as its parent does (dev/fork_speed.py):
# cause not found, so short calls get 0.6 ms on top. The single-threaded forked benchmarks this
# test exists for read 2x.
# torch.sdpa (the peer) drifts more than our kernels on a Zen 4 EPYC VM (2026-11-27): its
# median of 10 calls at 1x8x1024x64 read 14.3-25.9 ms in one process over a minute, where
# native.flash read 10.7-11.8 outside the host's 2x bursts; asv read it 1.05-1.31x bench in 4
# of 4 runs in turns, 1.30-1.78x (causal 1.35-1.41x) in 3 runs of asv alone against bench's
# usual 14.2 / 10.9 ms (CI: causal 1.78x, 1.28x, 1.30x), and neither asv's setup before each
# sample, its warm-up, its fork nor GC off moved it in one process (medians 1.01x). Run one right
# after the other on a quiet machine (2026-11-27, a fresh clone's asv env and --python=same, 5
# adjacent pairs), asv read it 1.01-1.04x bench without causal masking, and causal 0.98-1.04x in 3
# pairs and 0.84-0.85x in 2 (one bench reading of 13.05 ms against its usual 11.4), while bench's
# own non-causal reading moved 13.4-15.5 ms over 15 minutes: torch's drift between the tools'
# turns, neither tool's bias. So 50%; the 2x this test exists for still fails it.
AGREE_NOISY = {"numpy.naive": 0.30, "torch.sdpa": 0.50}
SHORT_CALL_S, SHORT_CALL_EXTRA_S = 5e-3, 0.6e-3
# the share of the cores' time that other processes and the hypervisor (steal) may take
# during an attnkern bench process before its row is measured again (_bench_one)
BUSY_SHARE = 0.10
# a disagreement must show in each of up to this many measurements (test_asv_agrees_with_attnkern_bench);
# after the first, only the kernels that still disagree are measured again (seconds each)
MEASUREMENTS = 5

# The smoke run (test_every_benchmark_of_the_suite_runs) as two asv processes at once, the
# suite's modules split between them: one asv process kept 1.3 of the 2 cores busy (forks,
# imports and setups between short benchmarks), 126 s on a 2-core AMD EPYC. The second part
# is everything the first leaves, so the two cover the suite whatever modules it gains.
_FIRST = r"bench_tracks|bench_tuned|bench_memory|bench_half|bench_realistic"
SMOKE_PARTS = [rf"^({_FIRST})\.", rf"^(?!({_FIRST})\.)"]


def _env():
    # what asv.conf.json's env_nobuild gives the benchmarked environment; without the CUDA
    # simulator conftest.py turns on for the tests (a GPU benchmark skips where no GPU is)
    env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), OPENBLAS_NUM_THREADS=str(THREADS),
               MKL_NUM_THREADS=str(THREADS), ATTNKERN_BENCH_THREADS=str(THREADS))
    # nor conftest.py's NUMBA_NUM_THREADS=4: four Numba threads on two cores left torch.sdpa
    # 8x slower in attnkern bench's process, where the kernels share one process
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    env.pop("NUMBA_NUM_THREADS", None)
    return env


@pytest.fixture(scope="module")
def asv_run(tmp_path_factory):
    """run(*args) -> the results of `asv run --python=same ... args` of this checkout,
    with results in a temporary directory; the asv process's output on failure."""
    from asv.util import load_json

    tmp = tmp_path_factory.mktemp("suite")
    base = load_json(str(REPO / "asv.conf.json"), js_comments=True)
    confs = []
    for i in range(len(SMOKE_PARTS)):
        # one results directory a part, so that parts run at once do not share a results file
        config = dict(base, repo=str(REPO), benchmark_dir=str(REPO / "benchmarks"),
                      results_dir=str(tmp / f"results{i}"), html_dir=str(tmp / "html"), env_dir=str(tmp / "env"))
        confs.append(tmp / f"asv{i}.conf.json")
        confs[-1].write_text(json.dumps(config, indent=2))
    # a home a part: every `asv run` rewrites ~/.asv-machine.json as it starts, and a part that read the
    # file while another part wrote it failed ("Error parsing JSON"); attnkern's cache stays where it is
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    homes = [dict(HOME=str(tmp / f"home{i}"), XDG_CACHE_HOME=cache) for i in range(len(SMOKE_PARTS))]
    for i, home in enumerate(homes):
        Path(home["HOME"]).mkdir()
        subprocess.run([*ASV, "machine", "--yes", "--machine", MACHINE, "--config", str(confs[i])], cwd=REPO,
                       env=dict(os.environ, **home), check=True, capture_output=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, check=True, capture_output=True,
                          text=True).stdout.strip()

    def start(i, args, env):
        for old in (tmp / f"results{i}" / MACHINE).glob("*.json"):
            if old.name != "machine.json":
                old.unlink()
        # output to files, not pipes: a part whose pipe filled while the test waited on another
        # part would stop until then
        with open(tmp / f"out{i}.txt", "w") as out, open(tmp / f"err{i}.txt", "w") as err:
            return subprocess.Popen([*ASV, "run", "--python=same", "--machine", MACHINE, "--set-commit-hash", head,
                                     "--show-stderr", "--config", str(confs[i]), *args], cwd=REPO,
                                    env=dict(env or _env(), **homes[i]), stdout=out, stderr=err, text=True)

    def finish(i, proc):
        proc.wait()
        out, err = ((tmp / f"{name}{i}.txt").read_text() for name in ("out", "err"))
        results = [p for p in (tmp / f"results{i}" / MACHINE).glob("*.json") if p.name != "machine.json"]
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), \
            (_load(results[0]) if results else {})

    def run(*args, env=None, parts=None):
        """One asv run of args; with parts (regular expressions), one asv process a part,
        all at once, each given -b part, and their results together (the first failing
        process, or the last one, as the process)."""
        if parts is None:
            return finish(0, start(0, args, env))
        procs = [start(i, [*args, "-b", part], env) for i, part in enumerate(parts)]
        done = [finish(i, proc) for i, proc in enumerate(procs)]
        merged = {name: values for _, results in done for name, values in results.items()}
        return next((p for p, _ in done if p.returncode != 0), done[-1][0]), merged

    return run


def _load(path) -> dict:
    """{benchmark name: {params tuple: value}} from an asv 0.6 results file; a failed
    benchmark's value is None, a skipped one's NaN."""
    import itertools

    data = json.loads(Path(path).read_text())
    columns = data["result_columns"]
    out = {}
    for name, row in data["results"].items():
        fields = dict(zip(columns, row))
        values, params = fields["result"], fields.get("params") or []
        combos = list(itertools.product(*params)) if params else [()]
        if values is None:
            values = [None] * len(combos)
        out[name] = dict(zip(combos, values))
    return out


def _p(value) -> str:
    """A parameter value as asv stores it (the repr)."""
    return repr(value)


def test_every_benchmark_of_the_suite_runs(asv_run):
    proc, results = asv_run("--quick", env=dict(_env(), ATTNKERN_BENCH_SMOKE="1"), parts=SMOKE_PARTS)
    failed = sorted(f"{name}{list(params)}" for name, values in results.items()
                    for params, value in values.items() if value is None)
    assert proc.returncode == 0 and not failed, (
        f"asv run exited {proc.returncode}; failed: {failed}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    # the parts together ran every benchmark module of the suite
    modules = {p.stem for p in (REPO / "benchmarks").glob("bench_*.py")}
    assert modules == {name.split(".")[0] for name in results}, sorted(results)
    threads = results["bench_tracks.ThreadsUsed.track_threads"]
    assert all(v == THREADS for v in threads.values()), threads


def test_each_counted_class_has_its_own_setup_cache():
    """asv runs one setup_cache per key (its source location, asv_runner's own
    get_setup_cache_key) and hands the result to every class with that key: five
    counted classes sharing one got native.flash's counts and failed. (The smoke run
    above skips the counting itself, minutes under Valgrind; tests/test_asv.py counts
    through `make bench`'s path.)"""
    from asv_runner.benchmarks._base import get_setup_cache_key

    sys.path.insert(0, str(REPO))
    try:
        from benchmarks import bench_counted
    finally:
        sys.path.remove(str(REPO))
    classes = [c for c in vars(bench_counted).values()
               if isinstance(c, type) and issubclass(c, bench_counted._Counted) and c is not bench_counted._Counted]
    keys = {c.__name__: get_setup_cache_key(c.setup_cache) for c in classes}
    assert len(classes) == 5 and len(set(keys.values())) == 5, keys


def _bench(tmp_path, kernels, *args) -> dict:
    """{(kernel, causal): median seconds} from `attnkern bench` at SHAPE, one run (one
    process) a kernel, as asv times each in a process of its own. In one process the
    kernels disturb each other: after torch.sdpa's turns, numpy.naive and native.tiled's
    bfloat16 read 20-40% slower than alone even 1 s later (measured on a 2-core AMD EPYC),
    which is attnkern bench's to fix (a worker process a kernel, as TimeVsTorch does), not
    a disagreement about the kernels."""
    times = {}
    for kernel in kernels:
        times.update(_bench_one(tmp_path, "--kernels", kernel, *args))
    return times


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, steal) jiffies of the whole machine so far, from /proc/stat's first line
    (busy: user, nice, system, irq, softirq; steal: time the hypervisor gave to others)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return user + nice + system + irq + softirq, steal


def _bench_one(tmp_path, *args, tries: int = 3) -> dict:
    """One `attnkern bench` process, measured again (up to `tries` times) while the
    machine was busy with something else during it: CPU time that neither that process
    nor the idle loop had (other processes, or the hypervisor's steal) above BUSY_SHARE
    of the cores' time. A bench row is 10 calls of a few ms: a neighbour's burst of a
    tenth of a second halves its median (native.flash read 9.71 ms against asv's 5.19
    once in a fresh-clone run, and 5.0 alone a minute later), where asv's many samples
    over seconds barely move. The tries and what disturbed them are printed."""
    out = tmp_path / "bench.json"
    b, h, n, d = (int(x) for x in SHAPE.split("x"))
    # --settle: bench's pause before each turn lets the last kernel's threads go quiet; with one
    # kernel a process there is none, and the default's 1 s a turn was 4 s of each process's 10.
    # --no-ceiling: the matmul ceiling (a worker process, its timing alone, its turns between the
    # kernel's) was 3.5 s of each 4.8 s process and is not what asv measures; the kernel's turns,
    # each an untimed call then the timed ones, are the same without it
    cmd = [sys.executable, "-m", "attnkern", "bench", "--sizes", str(n), "--batch", str(b), "--heads", str(h),
           "--dim", str(d), "--threads", str(THREADS), "--settle", "0.2", "--no-ceiling", "--json", str(out), *args]
    for attempt in range(1, tries + 1):
        busy0, steal0 = _cpu_jiffies()
        own0 = os.times()
        wall0 = time.monotonic()
        proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True)
        wall = time.monotonic() - wall0
        own1 = os.times()
        busy1, steal1 = _cpu_jiffies()
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        tick = os.sysconf("SC_CLK_TCK")
        own = (own1.children_user - own0.children_user) + (own1.children_system - own0.children_system)
        others = max(0.0, (busy1 - busy0) / tick - own)
        steal = (steal1 - steal0) / tick
        share = (others + steal) / (wall * (os.cpu_count() or 1))
        rows = json.loads(out.read_text())["rows"]
        times = {(r["kernel"], r["causal"]): r["median_s"] for r in rows if "median_s" in r}
        print(f"attnkern bench {' '.join(args)} (try {attempt}): {wall:.1f} s, other processes "
              f"{others:.2f} s, steal {steal:.2f} s ({share:.0%} of the cores); medians "
              + ", ".join(f"{k} causal={c}: {t * 1e3:.2f} ms" for (k, c), t in times.items()))
        if share <= BUSY_SHARE:
            break
    return times


def _agree(asv_times: dict, bench_times: dict, what: str) -> dict[str, str]:
    """Disagreements between asv's {(kernel, causal): seconds} and attnkern bench's: a
    time more than AGREE apart, or two kernels in the other order where bench puts them
    more than AGREE apart (closer pairs have no order to keep). Keyed by what disagreed
    and which way (without the numbers), so that two measurements can be matched."""
    problems = {}
    for key, a in asv_times.items():
        b = bench_times[key]
        allowed = AGREE_NOISY.get(key[0], AGREE) + (SHORT_CALL_EXTRA_S / b if b < SHORT_CALL_S else 0.0)
        if abs(a / b - 1) > allowed:
            way = "slower" if a > b else "faster"
            problems[f"{what} {key}: asv {way}"] = \
                f"{what} {key}: asv {a * 1e3:.2f} ms, attnkern bench {b * 1e3:.2f} ms ({a / b:.2f}x)"
    for (k1, c1), a1 in asv_times.items():
        for (k2, c2), a2 in asv_times.items():
            b1, b2 = bench_times[(k1, c1)], bench_times[(k2, c2)]
            if c1 == c2 and b1 * (1 + AGREE) < b2 and not a1 < a2:
                message = f"{what} causal={c1}: attnkern bench has {k1} faster than {k2}, asv the opposite"
                problems[message] = message
    return problems


def _suspects(problems: dict) -> set[str]:
    """The kernels that problems (keys of _agree's answers) name."""
    names = set(KERNELS) | set(HALF_KERNELS)
    return {k for k in names for key in problems if re.search(rf"(?<![\w.]){re.escape(k)}(?![\w.])", key)}


def _compare(asv_run, tmp_path, *asv_args, only: set[str] | None = None) -> tuple[dict[str, str], dict]:
    """asv's timings of every timed class at SHAPE beside attnkern bench's: the
    disagreements, and Forward's asv/bench ratios; asv_args go to asv run. only: the
    kernels to measure (None: all), for measuring again what disagreed."""
    pick = lambda names: [k for k in names if only is None or k in only]  # noqa: E731
    forward_k, half_k, throughput_k = pick(KERNELS), pick(HALF_KERNELS), pick(THROUGHPUT_KERNELS)
    alt = lambda names: "|".join(k.replace(".", r"\.") for k in names) or "(?!)"  # noqa: E731
    kernels, half, throughput_kernels = alt(forward_k), alt(half_k), alt(throughput_k)
    flash = "native.flash" in forward_k
    shape = SHAPE
    regex = "|".join([
        rf"^bench_forward\.Forward\.time_forward\('({kernels})', '{shape}', (False|True)\)$",
        rf"^bench_tracks\.Throughput\.track_ps_per_flop\('({throughput_kernels})', '{shape}', (False|True)\)$",
        *([rf"^bench_forward\.BlockSweep\.time_forward\('native\.flash', '{shape}', 256, 256, {THREADS}\)$",
           rf"^bench_tuned\.Tuned\.time_forward\('default', '{shape}', (False|True)\)$"] if flash else []),
        rf"^bench_half\.ForwardHalf\.time_forward\('({half})', '{shape}', 'bfloat16', (False|True)\)$",
        r"^bench_tracks\.ThreadsUsed\.",
    ])
    proc, results = asv_run("-b", regex, *asv_args)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    bench = _bench(tmp_path, forward_k, "--passes", "1", "--repeat", "10") if forward_k else {}
    bench_half = _bench(tmp_path, half_k, "--dtype", "bfloat16", "--passes", "1", "--repeat", "10") if half_k else {}

    def picked(name, fmt, kernels, to_seconds=lambda v, causal: v):
        if not kernels:  # a measurement of other kernels only: asv ran none of this class
            return {}
        values = results[name]
        return {(k, c): to_seconds(values[fmt(k, c)], c) for k in kernels for c in (False, True)}

    b, h, n, d = (int(x) for x in SHAPE.split("x"))
    flops = lambda causal: 4.0 * b * h * n * n * d / (2 if causal else 1)  # noqa: E731
    forward = picked("bench_forward.Forward.time_forward", lambda k, c: (_p(k), _p(SHAPE), _p(c)), forward_k)
    throughput = picked("bench_tracks.Throughput.track_ps_per_flop", lambda k, c: (_p(k), _p(SHAPE), _p(c)),
                        throughput_k, lambda v, c: v * flops(c) * 1e-12)
    half = picked("bench_half.ForwardHalf.time_forward", lambda k, c: (_p(k), _p(SHAPE), _p("bfloat16"), _p(c)),
                  half_k)
    sweep = {("native.flash", False): results["bench_forward.BlockSweep.time_forward"][
        (_p("native.flash"), _p(SHAPE), _p(256), _p(256), _p(THREADS))]} if flash else {}
    tuned = {("native.flash", c): results["bench_tuned.Tuned.time_forward"][(_p("default"), _p(SHAPE), _p(c))]
             for c in (False, True)} if flash else {}
    problems = {**_agree(forward, bench, "Forward"), **_agree(throughput, bench, "Throughput"),
                **_agree(sweep, bench, "BlockSweep"), **_agree(tuned, bench, "Tuned"),
                **_agree(half, bench_half, "ForwardHalf")}
    threads = results["bench_tracks.ThreadsUsed.track_threads"]
    problems.update({f"ThreadsUsed {k}": f"ThreadsUsed {k}: {v} threads, not {THREADS}" for k, v in threads.items()
                     if v == v and v != THREADS})  # NaN: a kernel not available here
    return problems, {key: forward[key] / bench[key] for key in forward}


@pytest.mark.alone  # two tools' times compared: make test runs it with nothing beside it
def test_asv_agrees_with_attnkern_bench(asv_run, tmp_path):
    """A disagreement fails only if every measurement shows it (the same timing off the
    same way, or the same pair in the other order), up to MEASUREMENTS of them, each
    taken only while the ones before still share a disagreement. Why: this VM's host
    slows both cores 1.7x for about a second now and then, unseen by the steal counter
    (native.flash at 1x8x1024x64 read 12.1-12.6 ms a second, and once 21.3, in one
    process of a loop on a 2-core AMD EPYC); a burst that lands on one tool's samples
    of one kernel reads as a 1.7x disagreement (CI: asv's numpy.naive 1.67x bench's in
    one measurement, the causal one 1.72x in the next, the other kernels within 17%).
    A real disagreement (the single-threaded forked benchmarks read 2x) is systematic
    and shows in each. The first measurement takes one asv round (one forked process a
    benchmark, half the time of the classes' two) of every kernel; the later ones, one
    round of the kernels that the disagreements still shared name, and nothing else."""
    shared, ratios = _compare(asv_run, tmp_path, "-a", "rounds=1")
    seen = [shared]
    while shared and len(seen) < MEASUREMENTS:
        problems, _ = _compare(asv_run, tmp_path, "-a", "rounds=1", only=_suspects(shared))
        seen.append(problems)
        shared = {key: problems[key] for key in shared if key in problems}
    for i, problems in enumerate(seen, 1):
        print(f"measurement {i}:\n" + "\n".join(problems.values()))
    assert not shared, "in every measurement:\n" + "\n".join(shared.values()) + \
        f"\nForward/bench ratios of the first: {ratios}; median {statistics.median(ratios.values()):.2f}"
