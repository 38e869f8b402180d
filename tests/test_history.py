"""`make history` (tools/history.py): the last N commits of main measured by asv.

Fast: the Makefile's wiring, the refusal of a shallow clone, the commits picked.
Slow (seconds when the tests' asv virtualenv, conftest.asv_test_config, and HEAD's
wheel are already there, as after tests/test_asv.py): in a temporary clone whose
main is HEAD plus a commit that does not build, the script over both with one small
timing; HEAD is measured, the broken commit is recorded as failed and named, the
exit status is 0, a second run skips both, and `asv publish` makes the site.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import asv_test_config, git, run  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HISTORY = [sys.executable, str(REPO / "tools" / "history.py")]
MACHINE = "attnkern-selftest"
# one quick timing (tens of microseconds a call); the counted benchmarks take minutes a commit
TINY = r"^bench_forward\.Forward\.time_forward\('native\.flash', '1x1x128x64', False\)$"

pytest.importorskip("asv")




def clone_of_head(tmp, *clone_args):
    clone = tmp / "attnkern"
    subprocess.run(["git", "clone", "-q", *clone_args, f"file://{REPO}", str(clone)], check=True)
    git(clone, "checkout", "-q", "-B", "main")
    return clone


def test_make_history_runs_the_script_then_publishes():
    """`make history N=3` measures 3 commits, then publishes (make site), in that order."""
    out = run(["make", "-n", "history", "N=3"], cwd=REPO).stdout
    script = out.index("tools/history.py --commits 3")
    publish = out.index("asv publish")
    assert script < publish, out


def test_a_shallow_clone_is_refused(tmp_path):
    clone = clone_of_head(tmp_path, "--depth", "2")
    proc = run([*HISTORY, "--config", str(clone / "asv.conf.json"), "--dry-run"], cwd=clone, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "shallow clone" in proc.stderr and "git fetch --unshallow" in proc.stderr, proc.stderr


def test_dry_run_lists_the_last_commits_of_main(tmp_path):
    clone = clone_of_head(tmp_path)
    proc = run([*HISTORY, "--config", str(clone / "asv.conf.json"), "--commits", "2", "--dry-run"], cwd=clone)
    would = [line.split()[2] for line in proc.stdout.splitlines() if line.strip().startswith("would run")]
    head, parent = git(clone, "rev-parse", "HEAD"), git(clone, "rev-parse", "HEAD~1")
    assert would == [head[:10], parent[:10]], proc.stdout


@pytest.mark.slow
def test_history_over_a_commit_that_does_not_build(tmp_path):
    clone = clone_of_head(tmp_path)
    good = git(clone, "rev-parse", "HEAD")
    with (clone / "meson.build").open("a") as f:  # meson stops at configure time: a fast, certain failure
        f.write("\nerror('a build broken on purpose (tests/test_history.py)')\n")
    git(clone, "commit", "-q", "-am", "meson.build: broken on purpose")
    broken = git(clone, "rev-parse", "HEAD")

    config = asv_test_config(REPO, repo=str(clone), benchmark_dir=str(clone / "benchmarks"),
                             results_dir=str(tmp_path / "results"), html_dir=str(tmp_path / "html"))
    conf = tmp_path / "asv.conf.json"
    conf.write_text(json.dumps(config, indent=2))
    history = [*HISTORY, "--config", str(conf), "--machine", MACHINE, "--commits", "2", "-b", TINY]

    first = run(history, cwd=clone)  # exit 0: a commit that fails to build does not fail the run
    out = first.stdout
    assert "2 to run" in out, out
    summary = out[out.index("history: the last 2 commit(s)"):]
    assert f"{good[:10]}" in summary and f"{broken[:10]}" in summary, summary
    assert "FAILED commits" in summary and f"{broken[:10]} build failed" in summary.split("FAILED commits")[1], summary
    assert f"{good[:10]}" not in summary.split("FAILED commits")[1], summary
    results = tmp_path / "results" / MACHINE
    for sha in (good, broken):
        assert list(results.glob(f"{sha[:8]}-*.json")), f"no results for {sha[:8]} in {sorted(results.iterdir())}"
    [good_result] = results.glob(f"{good[:8]}-*.json")
    values = json.loads(good_result.read_text())["results"]["bench_forward.Forward.time_forward"][0]
    assert [v for v in values if v is not None and v == v], values  # measured: a value, not None or NaN

    second = run(history, cwd=clone)  # both have results now: asv is not run again
    assert "0 to run" in second.stdout and "build failed (earlier run)" in second.stdout, second.stdout
    assert "Benchmarking" not in second.stdout, second.stdout

    run([sys.executable, "-m", "asv", "publish", "--config", str(conf)], cwd=clone)
    index = json.loads((tmp_path / "html" / "index.json").read_text())
    assert good in index["revision_to_hash"].values(), index["revision_to_hash"]
    assert (tmp_path / "html" / "graphs").is_dir()
