"""The regression gate and the asv suite end to end, in a temporary clone of
this repository's HEAD.

History built here, with the slowdowns of the gate's calibration
(tools/calibrate_gate.py, docs/regression-gate.md: native.flash computes the
score tiles of the first keys of every panel twice, a real, deterministic
slowdown): A (HEAD), B (its 2% level: about +2% of instructions), C (a README
edit on B: nothing measurable), and D (its 10% level, on a branch off A).
`tools/gate.py` (what `make gate` and the PR workflow run) must fail A -> B on
the counted signal, which is deterministic, pass B -> C, and time A -> D as
slower: 10% is the level at which the calibration's timed signal flagged every
trial of every configuration. `asv run` over A and B and `asv publish` must put
the step at B on the site's regressions page for the counted benchmark
(threshold 1%), and the site must render in headless Chromium.

Slow (several minutes: wheel builds, Valgrind, a virtualenv on first use); run
with `pytest -m slow`, and by `make test`. The site tests come first in this file:
the gate tests after them take A's and B's wheels from that `asv run` instead of
building them again (reuse_asv_builds); C, whose change is the README's alone, takes
B's build (the gate's source_key), and D is built by the gate.
"""

import contextlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import asv_test_config, git, run  # noqa: E402

# alone: the gate's timed signal must see a 10% slowdown (make test runs these with nothing beside them)
pytestmark = [pytest.mark.slow, pytest.mark.alone]

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
from calibrate_gate import INJECT_FILE, KEYS_FOR_LEVEL, inject_slowdown  # noqa: E402

ASV = [sys.executable, "-m", "asv"]
# the tests' asv environments (conftest.asv_test_config)
ASV_ENV_DIR = REPO / ".asv" / "env"
MACHINE = "attnkern-selftest"  # its own entry in ~/.asv-machine.json; other entries are left alone
# where the site test leaves its screenshot
SCREENSHOTS = Path(os.environ.get("ATTNKERN_SCREENSHOTS", REPO / "bench-results"))
FLASH_BENCH = "Forward.time_forward('native.flash', '1x8x1024x64', False)"
COUNTED_BENCH = "NativeFlash.track_instructions('1x2x256x64', False)"
ASV_REGEX = (r"(^|\.)Forward\.time_forward\('native\.flash', '1x8x1024x64', False\)$"
             r"|^bench_counted\.NativeFlash\.track_instructions")
# the gate on native.flash, one counted and one timed shape each (the full gate
# covers every CPU kernel at two shapes of each kind); the AVX-512 counted signal, which
# builds both sides' instrumented harness (a minute a gate), has its own tests
# (tests/test_avx512_count.py)
GATE_ARGS = ["-b", r"^native\.flash:", "--count-shapes", "1x2x256x64", "--time-shapes", "1x8x512x64",
             "--no-avx512-count"]

# asv comes from requirements-bench.txt, which `make setup` installs: without it the
# fixtures below fail on their imports of it (a broken setup), they are not skipped




@pytest.fixture(scope="module")
def history(tmp_path_factory):
    """A clone with commits A, B (the 2% level), C (a no-op) on main, D (the 10% level)
    off A, and an asv config writing results and html into the temp dir."""
    tmp = tmp_path_factory.mktemp("asv")
    clone = tmp / "attnkern"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    git(clone, "checkout", "-q", "-B", "main")
    a = git(clone, "rev-parse", "HEAD")

    path = clone / INJECT_FILE
    source = path.read_text()
    path.write_text(inject_slowdown(source, KEYS_FOR_LEVEL[2]))
    git(clone, "commit", "-q", "-am", "flash: recompute some score tiles, ~2% slower (test regression)")
    b = git(clone, "rev-parse", "HEAD")

    with (clone / "README.md").open("a") as f:  # C: nothing measurable
        f.write("\nA line of nothing measurable.\n")
    git(clone, "commit", "-q", "-am", "README: no-op change")
    c = git(clone, "rev-parse", "HEAD")

    git(clone, "checkout", "-q", "-b", "slow10", a)  # D: off A, for the gate alone
    path.write_text(inject_slowdown(source, KEYS_FOR_LEVEL[10]))
    git(clone, "commit", "-q", "-am", "flash: recompute more score tiles, ~10% slower (test regression)")
    d = git(clone, "rev-parse", "HEAD")
    git(clone, "checkout", "-q", "main")

    config = asv_test_config(REPO, repo=str(clone), benchmark_dir=str(clone / "benchmarks"),
                             results_dir=str(tmp / "results"), html_dir=str(tmp / "html"))
    conf = tmp / "asv.conf.json"
    conf.write_text(json.dumps(config, indent=2))

    def asv(*args, check=True):
        # the counted class on the one shape the site test reads (each shape is about 5 s a
        # commit under Valgrind)
        env = dict(os.environ, ATTNKERN_BENCH_COUNTED_SHAPES=COUNTED_BENCH.split("'")[1])
        return run([*ASV, *args, "--config", str(conf)], cwd=clone, check=check, env=env)

    def gate(base, head, *args):
        reuse_asv_builds(tmp / "gate-builds", (base, head))
        return run([sys.executable, str(REPO / "tools" / "gate.py"), "--repo", str(clone), "--base", base,
                    "--head", head, "--cache", str(tmp / "gate-builds"), "--json", str(tmp / f"gate-{head}.json"),
                    *GATE_ARGS, *args], cwd=REPO, check=False)

    return dict(tmp=tmp, clone=clone, asv=asv, gate=gate, commits=(a, b, c), slow10=d)


@pytest.fixture(scope="module")
def site(history):
    # A and B only: the step is between them, and C (a README edit) would cost a third
    # wheel build without adding to what the site must show
    hashfile = history["tmp"] / "commits.txt"
    hashfile.write_text("\n".join(history["commits"][:2]) + "\n")
    run([*ASV, "machine", "--yes", "--machine", MACHINE], cwd=history["clone"])
    history["asv"]("run", "--machine", MACHINE, "-b", ASV_REGEX, "--show-stderr", f"HASHFILE:{hashfile}")
    history["asv"]("publish")
    return history["tmp"] / "html"


def test_publish_marks_the_step(site, history):
    """The counted benchmark's step at B is on the site's regressions page."""
    b = history["commits"][1]
    index = json.loads((site / "index.json").read_text())
    hash_of = {int(rev): h for rev, h in index["revision_to_hash"].items()}
    # [benchmark, graph path, graph params, param index, last value, best value,
    #  jumps: [[revision before or null, revision after, value before, value after], ...]]
    regressions = json.loads((site / "regressions.json").read_text())["regressions"]
    counted = [r for r in regressions if COUNTED_BENCH in r[0]]
    assert counted, f"the site lists no regression of {COUNTED_BENCH}: {[r[0] for r in regressions]}"
    jumps = counted[0][6]
    assert [hash_of[jump[1]] for jump in jumps] == [b], jumps
    before, after = jumps[0][2], jumps[0][3]
    assert after / before > 1.01, jumps


@contextlib.contextmanager
def serve(directory):
    """The site over HTTP on a free loopback port (it loads its data with fetch,
    which file:// pages may not)."""

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(directory), **kwargs)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def chromium(*args, timeout=120):
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if exe is None:
        pytest.fail("chromium is not installed: run `make setup` (it installs Debian's chromium)")
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--no-first-run", "--virtual-time-budget=15000", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_site_renders_in_chromium(site):
    run([sys.executable, str(REPO / "tools" / "offline_site.py"), str(site)], cwd=REPO)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    # asv's graph state: p-<param>=<repr of the value>, URL-quoted
    graph = "#bench_forward.Forward.time_forward?p-kernel=%27native.flash%27&p-shape=%271x8x1024x64%27&p-causal=False"
    with serve(site) as url:
        index = chromium("--dump-dom", url)
        page = chromium("--dump-dom", url + graph)
        shot = chromium("--window-size=1400,1000", f"--screenshot={SCREENSHOTS / 'asv-site.png'}", url + graph)
    # the index: asv's app started (not its "JavaScript failed to load" page) and
    # lists the suite's benchmarks
    assert "continental origin of swallow" not in index.stdout, index.stdout
    for name in ("Forward.time_forward", "BlockSweep.time_forward", "PeakMemory.peakmem_forward",
                 "TimeVsTorch.track_time_ratio", "Accuracy.track_relative_error",
                 "NativeFlash.track_instructions", "NativeFlash.track_estimated_cycles"):
        assert name in index.stdout, f"{name} is not on the index page"
    # the graph page: flot drew its canvas, with native.flash's series in the legend
    assert 'class="flot-base"' in page.stdout, page.stdout[-3000:]
    assert '<td class="legendLabel">causal-False; kernel-native.flash; shape-1x8x1024x64<' in page.stdout, \
        page.stdout[-3000:]
    assert shot.returncode == 0 and (SCREENSHOTS / "asv-site.png").stat().st_size > 10_000, shot.stderr


# The build tools whose versions decide a wheel's machine code (with the C
# compiler, the same for both): the gate compares instruction counts exactly.
BUILD_TOOLS = ["numpy", "Cython", "meson", "meson-python", "ninja"]


def build_tools(python):
    code = "import importlib.metadata as m, sys; print([m.version(p) for p in sys.argv[1:]])"
    return run([str(python), "-c", code, *BUILD_TOOLS], cwd=REPO).stdout


def reuse_asv_builds(cache, shas):
    """Commits that the site fixture's `asv run` built (it runs before the gate
    tests) installed into the gate's build cache (`cache/<sha>/site`) the way the
    gate installs its own builds, so that the gate does not build them again: asv
    builds them with the same command (`pip wheel --no-deps --no-build-isolation`),
    in a virtualenv with the build tools of this interpreter, which the gate builds
    with (checked: a wheel from other versions is not reused, as its instruction
    counts could differ from the gate's own build of the next commit). A commit
    asv did not build (D, or every commit when the gate tests run alone) is built
    by the gate itself, which keeps its build step under test; C takes B's build."""
    for sha in shas:
        site = cache / sha / "site"
        if site.is_dir():
            continue
        # asv's build cache: <env>/asv-build-cache/<sha>/<wheel>, complete once <sha>.timestamp exists
        for wheel in sorted(ASV_ENV_DIR.glob(f"*/asv-build-cache/{sha}/*.whl")):
            env = wheel.parents[2]
            if not (wheel.parent.with_name(f"{sha}.timestamp")).is_file():
                continue
            if build_tools(env / "bin" / "python") != build_tools(sys.executable):
                continue
            tmp_site = site.with_name("site.tmp")
            shutil.rmtree(tmp_site, ignore_errors=True)
            run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(tmp_site), str(wheel)],
                cwd=REPO)
            tmp_site.rename(site)
            break


def gate_rows(history, head):
    return json.loads((history["tmp"] / f"gate-{head}.json").read_text())["rows"]


def test_gate_fails_on_a_two_percent_slowdown(history):
    a, b, _ = history["commits"]
    proc = history["gate"](a, b)
    out = proc.stdout + proc.stderr
    print(proc.stdout)
    assert proc.returncode == 1, out
    assert "PERFORMANCE DECREASED" in out, out
    rows = {(r["benchmark"], r["signal"]): r for r in gate_rows(history, b)}
    counted = rows[("native.flash:1x2x256x64:0", "counted")]
    # deterministic: +2.2% of instructions at this level, measured on the team's EPYC (the
    # same build gives the same count on every run), twice the 1% threshold
    assert counted["verdict"] == "slower" and counted["ratio"] > 1.01, counted
    # The timed signal at 2%: the calibration flagged 0 of 3 trials (intervals starting at
    # +1.0-1.8%, short of the +2% margin that keeps identical builds from false alarms), so
    # "same" is what it supports, "slower" when the slowdown costs more here; never "faster"
    # (an improvement would mean the pairing is broken). Timing's own requirement is
    # test_gate_times_a_ten_percent_slowdown_as_slower.
    timed = rows[("native.flash:1x8x512x64:0", "time")]
    assert timed["verdict"] in ("same", "slower"), timed


# the width of a paired 95% interval beyond which the machine is too busy to time a 10% slowdown:
# twice the injected slowdown (the calibration's intervals on a quiet machine: a few %)
NOISY_INTERVAL = 0.2


def test_gate_times_a_ten_percent_slowdown_as_slower(history):
    """The level at which the calibration's timed signal flagged every trial of every
    configuration (at 1x8x512x64 intervals from +8.9% without the mask and +4.9% with it;
    this injection adds 9.3% and 8.3% of instructions): the paired timing alone
    (--no-count) must call both configurations slower and fail the gate."""
    a, d = history["commits"][0], history["slow10"]
    proc = history["gate"](a, d, "--no-count")
    out = proc.stdout + proc.stderr
    print(proc.stdout)
    timed = {r["benchmark"]: r for r in gate_rows(history, d)}
    assert set(timed) == {"native.flash:1x8x512x64:0", "native.flash:1x8x512x64:1"}, timed
    # On a machine busy with other work the paired intervals widen far beyond the calibration's
    # (a few % on a quiet 2-core machine; +-30% seen while wheels were built beside the suite):
    # no timing can resolve 10% there, and the test says so rather than pass or fail on noise.
    # Intervals as narrow as a quiet machine's must find the slowdown.
    noisy = [r for r in timed.values() if r["interval"][1] - r["interval"][0] > NOISY_INTERVAL]
    if proc.returncode != 1 and noisy:
        pytest.skip(f"the machine was too busy to time a 10% slowdown (95% intervals "
                    f"{[r['interval'] for r in noisy]} wider than {NOISY_INTERVAL}); rerun on a quiet machine")
    assert proc.returncode == 1, out
    for row in timed.values():
        assert row["signal"] == "time" and row["verdict"] == "slower" and row["ratio"] > 1.02, row


def test_gate_passes_a_no_op_commit(history):
    _, b, c = history["commits"]
    proc = history["gate"](b, c)
    out = proc.stdout + proc.stderr
    print(proc.stdout)
    assert proc.returncode == 0, out
    # C changes no build input: the gate takes B's build instead of building C
    assert f"{c[:10]} builds what {b[:10]} built" in out, out
    rows = gate_rows(history, c)
    assert rows and all(r["verdict"] == "same" for r in rows), rows
    assert all(r["ratio"] == 1.0 for r in rows if r["signal"] == "counted"), rows
