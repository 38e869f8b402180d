"""History for the asv site: a short benchmark selection over the last N commits of main.

    make history N=10                        # then `make site` publishes
    .venv/bin/python tools/history.py --commits 3 [--dry-run]

`make bench` measures HEAD alone, so a fresh clone's site has one point per
graph: no trend, and an empty regressions page. This script measures the last
N commits of the branch (first parent: the commits main itself went through),
each in its own `asv run`, with a selection cheap enough for ten commits:

counted   bench_counted.* (all five kernel classes): instructions and a cycle
          estimate of one single-threaded call under Valgrind, 3 small shapes,
          causal and not. Identical code gives identical counts, so the
          regressions page (1% threshold for these) shows real steps, not noise;
          the cycle estimate's simulated cache misses follow memory layout, which
          a change to Python code alone can move by about 1%.
time      bench_forward.Forward.time_forward of native.flash, torch.sdpa and
          numpy.naive at 1x8x1024x64 and 1x4x1024x128, not causal: calls of
          10-100 ms, whose drift (10-30% between runs on a shared 2-core machine)
          stays under asv's 25% threshold for timing steps. (At 1x1x128x64 a call
          takes microseconds to a few ms and torch's doubles between runs.)

Each commit is built into a wheel in asv's virtualenv and kept in asv's build
cache (asv.conf.json's build_cache_size commits, most recently used first).
A commit with results for this machine is not run again (--skip-existing-commits),
so an interrupted or repeated `make history` picks up where it stopped.

Old commits: the suite is this checkout's benchmarks/, run against each
commit's attnkern through its public API; a kernel the commit lacks is skipped
(NotImplementedError in setup). A commit that fails to build is recorded by asv
as failed (no values) and the run goes on; the summary names every such commit.
The exit status is 0 when the run went through, failed commits or not; 2 when it
could not start (a shallow clone, an unknown branch, asv missing) or when no
commit could be run at all.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# asv -b regexes (any one matching selects a benchmark; parameterized ones are
# matched with their parameters, as "bench_forward.Forward.time_forward('native.flash', '1x8x1024x64', False)")
COUNTED = r"^bench_counted\.(NativeFlash|NativeTiled|NativeNaive|NumbaFlash|NumpyNaive)\."
TIMED = (r"^bench_forward\.Forward\.time_forward\('(native\.flash|torch\.sdpa|numpy\.naive)', "
         r"'(1x8x1024x64|1x4x1024x128)', False\)$")
BENCH = [COUNTED, TIMED]
# where asv's output starts a commit: "[ 0.00%] · For attnkern commit 1a2b3c4d <main>:"
COMMIT_LINE = re.compile(r"For \S+ commit ([0-9a-f]{8})\b")


class HistoryError(Exception):
    """The history cannot be run here (exit status 2)."""


def git(repo: Path, *args: str) -> str:
    proc = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)
    if proc.returncode != 0:
        raise HistoryError(f"git {' '.join(args)} failed in {repo}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def last_commits(repo: Path, branch: str, n: int) -> list[str]:
    """The last n commits of `branch` along its first parents, newest first.
    A shallow clone is refused: its history is cut, and asv builds each commit
    from this repository's objects."""
    if git(repo, "rev-parse", "--is-shallow-repository") == "true":
        have = git(repo, "rev-list", "--count", "HEAD")
        raise HistoryError(
            f"{repo} is a shallow clone (git clone --depth ...): it holds only the last {have} commit(s) "
            "of its history. Fetch the rest with `git fetch --unshallow` (or clone without --depth) "
            "and run this again.")
    try:
        git(repo, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}")
    except HistoryError:
        # asv too looks the branch up by its local name (asv.conf.json's "branches")
        remote = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"refs/remotes/origin/{branch}"],
                                cwd=repo, capture_output=True).returncode == 0
        hint = (f"; this clone has origin/{branch}: `git branch {branch} origin/{branch}` makes it" if remote
                else " (--branch names another)")
        raise HistoryError(f"no local branch {branch!r} in {repo}{hint}") from None
    return git(repo, "rev-list", "--first-parent", f"--max-count={n}", branch).split()


def load_config(path: Path):
    """asv's configuration, relative paths resolved against the config's folder
    (asv resolves them against its working directory, which is that folder here)."""
    from asv.config import Config

    conf = Config.load(str(path))
    for key in ("repo", "env_dir", "results_dir", "html_dir", "benchmark_dir"):
        value = getattr(conf, key, None)
        if value and not os.path.isabs(value) and not (key == "repo" and "://" in value):
            setattr(conf, key, str((path.parent / value).resolve()))
    return conf


def stored_results(conf, machine: str, sha: str):
    """asv's results of `sha` on `machine` (one per environment)."""
    from asv.results import iter_results_for_machine_and_hash

    try:
        return list(iter_results_for_machine_and_hash(conf.results_dir, machine, sha))
    except OSError:
        return []


def tally(results, bench: list[str]) -> dict[str, list[str]]:
    """The selected benchmarks (parameter combinations matching a regex of `bench`,
    named as asv names them to match) of the results by outcome: 'measured' (a
    value), 'skipped' (NaN: NotImplementedError in setup, e.g. a kernel this commit
    lacks) and 'failed' (None: an error, a timeout, or a build that failed)."""
    out = {"measured": [], "skipped": [], "failed": []}
    for result in results:
        for key in result.get_all_result_keys():
            params = result.get_result_params(key)
            values = result.get_result_value(key, params)
            if not params:
                names, values = [key], [values]
            else:
                names = [f"{key}({', '.join(combo)})" for combo in itertools.product(*params)]
            for name, value in zip(names, values):
                if not any(re.search(regex, name) for regex in bench):
                    continue  # not selected: asv stores NaN for it too
                if value is None:
                    out["failed"].append(key)
                elif isinstance(value, float) and math.isnan(value):
                    out["skipped"].append(key)
                else:
                    out["measured"].append(key)
    return out


def wheel_cached(conf, sha: str) -> bool:
    """Whether asv's build cache holds a wheel of `sha` that it built and installed
    (asv marks a cached build valid only after a successful install)."""
    from asv.build_cache import BuildCache

    envs = Path(conf.env_dir)
    return envs.is_dir() and any(BuildCache(conf, str(env)).get_cache_dir(sha) for env in envs.iterdir()
                                 if env.is_dir())


def outcome(conf, machine: str, sha: str, bench: list[str]) -> tuple[str, dict]:
    """('measured' | 'build failed' | 'failed' | 'no results', tally) of a commit."""
    results = stored_results(conf, machine, sha)
    counts = tally(results, bench)
    if not results:
        return "no results", counts
    if counts["measured"] or counts["skipped"]:
        return ("failed" if counts["failed"] and not counts["measured"] else "measured"), counts
    if counts["failed"]:
        # every value None: asv records a commit whose build or install failed that way
        return ("failed" if wheel_cached(conf, sha) else "build failed"), counts
    return "measured", counts  # results of other benchmarks only (an earlier run with another selection)


def describe(state: str, counts: dict) -> str:
    if state.startswith("build failed"):
        return "no values (asv's output has the build's error)"
    parts = [f"{len(counts['measured'])} value(s)"]
    if counts["skipped"]:
        parts.append(f"{len(counts['skipped'])} n/a (skipped in setup: a kernel this commit lacks; "
                     "or not selected in the run that measured it)")
    if counts["failed"]:
        names = sorted(set(counts["failed"]))
        more = f", ... {len(names) - 3} more" if len(names) > 3 else ""
        parts.append(f"{len(counts['failed'])} failed ({', '.join(names[:3])}{more})")
    return ", ".join(parts)


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def run_asv(cmd: list[str], cwd: Path) -> dict[str, float]:
    """Run asv, passing its output through, and return the wall time of each commit
    it ran, by the first 8 digits of its hash: from the line where asv starts
    the commit ("For attnkern commit 1a2b3c4d <main>:") to the next such line or
    its exit (the first commit from asv's start: the environment's setup and the
    discovery, which builds that commit, count there)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    started, current, seconds = time.perf_counter(), None, {}
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        match = COMMIT_LINE.search(line)
        if match:
            now = time.perf_counter()
            if current is not None:
                seconds[current] = seconds.get(current, 0.0) + now - started
            current, started = match.group(1), (now if current is not None else started)
    proc.wait()
    if current is not None:
        seconds[current] = seconds.get(current, 0.0) + time.perf_counter() - started
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tools/history.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--commits", type=int, default=10, help="how many commits of the branch (default 10)")
    parser.add_argument("--branch", help="the branch whose history is measured (default: the first of the asv "
                                         "config's branches, main)")
    parser.add_argument("--config", default=str(REPO / "asv.conf.json"), help="asv's configuration file")
    parser.add_argument("--machine", help="asv machine name (default: this host's name, as asv picks it)")
    parser.add_argument("-b", "--bench", action="append",
                        help="asv benchmark regex, repeatable (default: the counted benchmarks and the "
                             "timings above)")
    parser.add_argument("--dry-run", action="store_true", help="list the commits and what would be run, run nothing")
    args = parser.parse_args(argv)
    if args.commits < 1:
        parser.error("--commits must be at least 1")

    try:
        import asv  # noqa: F401
    except ImportError:
        raise HistoryError("asv is not installed in this Python (make setup installs it into .venv)") from None
    config = Path(args.config).resolve()
    if not config.is_file():
        raise HistoryError(f"no asv configuration at {config}")
    conf = load_config(config)
    repo = Path(conf.repo)
    args.branch = args.branch or (getattr(conf, "branches", None) or ["main"])[0]
    commits = last_commits(repo, args.branch, args.commits)
    if len(commits) < args.commits:
        print(f"history: {args.branch} has {len(commits)} commit(s), not {args.commits}: measuring those")
    asv_cmd = [sys.executable, "-m", "asv"]
    machine_args = ["--machine", args.machine] if args.machine else []
    bench = args.bench or BENCH
    cache_size = getattr(conf, "build_cache_size", 2)
    if len(commits) > cache_size:
        print(f"history: asv keeps the wheels of {cache_size} commits (build_cache_size in {config.name}); "
              f"measuring {len(commits)} evicts the oldest, which costs a rebuild only if one is measured again")

    if not args.dry_run:
        # this machine's description (asv needs one before it runs; the same as `make bench`)
        proc = subprocess.run([*asv_cmd, "machine", "--yes", *machine_args, "--config", str(config)],
                              cwd=config.parent, capture_output=True, text=True)
        if proc.returncode != 0:
            raise HistoryError(f"asv machine --yes failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    from asv.machine import Machine

    machine = args.machine or Machine.get_unique_machine_name()

    rows = []  # (sha, state, seconds or None, counts)
    pending = []
    for sha in commits:
        if stored_results(conf, machine, sha):
            state, counts = outcome(conf, machine, sha, bench)
            rows.append((sha, "already measured" if state == "measured" else f"{state} (earlier run)", None, counts))
        else:
            pending.append(sha)
    print(f"history: {len(commits)} commit(s) of {args.branch} on machine {machine!r}: {len(pending)} to run, "
          f"{len(commits) - len(pending)} with results already")
    print("history: benchmarks: " + " | ".join(bench))
    if args.dry_run:
        for sha in pending:
            print(f"  would run {sha[:10]} {git(repo, 'log', '-1', '--format=%s', sha)[:70]}")
        return 0

    bench_args = [arg for regex in bench for arg in ("-b", regex)]
    took = {}
    with tempfile.TemporaryDirectory(prefix="attnkern-history-") as tmp:
        hashfile = Path(tmp) / "commits.txt"
        hashfile.write_text("".join(sha + "\n" for sha in pending))  # newest first: an interrupted run
        # leaves the recent history. One asv run for all of them: asv discovers the suite once, and
        # where the first commit does not build it discovers it with another (the branch's tip or
        # the next commit) instead of giving up.
        if pending:
            took = run_asv([*asv_cmd, "run", *machine_args, "--skip-existing-commits", "--show-stderr",
                            *bench_args, "--config", str(config), f"HASHFILE:{hashfile}"], config.parent)
    for sha in pending:
        state, counts = outcome(conf, machine, sha, bench)
        if state == "no results":
            state = "not run"
        rows.append((sha, state, took.get(sha[:8]), counts))

    order = {sha: i for i, sha in enumerate(commits)}
    rows.sort(key=lambda row: order[row[0]])
    print(f"\nhistory: the last {len(commits)} commit(s) of {args.branch}, newest first")
    for sha, state, seconds, counts in rows:
        spent = f"{minutes(seconds):>7}" if seconds is not None else " " * 7
        print(f"  {sha[:10]} {spent}  {state}: {describe(state, counts)}")
    ran = [row for row in rows if row[2] is not None]
    if ran:
        total = sum(row[2] for row in ran)
        print(f"history: {len(ran)} commit(s) run in {minutes(total)}, {minutes(total / len(ran))} per commit "
              "(the first one's time includes setting up asv's environment and discovering the suite)")
    bad = [row for row in rows if row[1] not in ("measured", "already measured")]
    if bad:
        print("history: FAILED commits (asv keeps them as failed, so the next run skips them; delete their "
              f"files under {conf.results_dir}/{machine}/ to try again):")
        for sha, state, _, _ in bad:
            print(f"  {sha[:10]} {state}: {git(repo, 'log', '-1', '--format=%s', sha)[:70]}")
    partial = [row for row in rows if row[1] in ("measured", "already measured") and row[3]["failed"]]
    if partial:
        print(f"history: {len(partial)} measured commit(s) with failed benchmarks (asv's output has their errors): "
              + ", ".join(row[0][:10] for row in partial))
    if pending and all(row[1] == "not run" for row in rows if row[0] in pending):
        print("history: asv ran none of the commits (see its output above)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except HistoryError as exc:
        print(f"history: {exc}", file=sys.stderr)
        raise SystemExit(2)
