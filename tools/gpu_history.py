"""GPU history for the asv site: the suite's GPU classes measured on the device
machine, merged into .asv/results beside the CPU machine's.

    make gpu-history COMMIT=<sha>            # prepare: a folder for the device
    .venv/bin/python tools/gpu_history.py prepare <sha> --out .gpu-history
    (on the device, in that folder)  sh run.sh              # asv's GPU run
    .venv/bin/python tools/gpu_history.py merge <folder brought back>/results
    make site                                               # publishes both machines

The device machine (docs/gpu-device.md) has Python 3.12 with torch, numba-cuda
and Triton but no meson, Cython, asv or network. `prepare` therefore brings
everything to one folder:

  whl/          the commit's cp312 wheel (built here with a Python 3.12 build
                environment, --python312, from `git archive` of the commit), the
                NumPy 2.4 wheel numba-cuda needs there (--numpy-wheel) and the
                wheels of asv and its dependencies (--asv-wheels: `pip download
                --only-binary=:all: --python-version 3.12 asv==0.6.6`)
  repo/         a one-commit shallow clone of the commit (asv reads the commit's
                date from it; --set-commit-hash names the results after it)
  benchmarks/   this checkout's suite (as tools/history.py runs it on old commits)
  asv.conf.json the device's asv configuration: the repository above, results in
                results/, no environments of its own (--python=same)
  run.sh        the device command (below)

run.sh installs the wheels into /tmp/asv-site-<sha> (put first on sys.path by a .pth
file while it runs: asv starts its benchmark processes without PYTHONPATH), registers the asv machine (--machine;
by default named after the GPU, e.g. nvidia-h200: one machine name per kind of
GPU, so graphs never mix them) and runs

    asv run --python=same --set-commit-hash <sha> --machine <it> -b '<GPU selection>'

(--bench, default the classes DecodeGpu, ForwardGpu, Float32GpuPaths and BackwardGpu, each in an asv run of
its own so that a run cut short keeps the classes it finished; --attributes
overrides asv's sampling, e.g. "rounds=1 repeat=5" for a short run). Its results
land in results/<machine>/: machine.json and one JSON per commit and environment.

`merge` checks those files (asv's result format version, the machine named in
both, a commit hash this repository knows) and copies them into
.asv/results/<machine>/; `asv publish` then shows the GPU machine beside the CPU
one (each graph per machine: timings of different machines never mix). The
benchmark metadata (.asv/results/benchmarks.json) is the CPU run's, which lists
the GPU classes too (they skip without a GPU); merge refuses results of a
benchmark that file does not know, so run `make bench` (or asv run) here first.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / ".asv" / "results"
DEFAULT_MACHINE = "auto"  # run.sh names the machine after its GPU: nvidia-h100-80gb-hbm3, nvidia-h200, ...
# one asv run a class, quickest first: asv writes a run's results when it ends, so a device call cut
# short keeps the classes that finished
DEFAULT_BENCH = [r"DecodeGpu\.", r"ForwardGpu\.", r"Float32GpuPaths\.", r"BackwardGpu\."]
RESULT_VERSION = 2  # asv 0.6's result file format


def git(*args, cwd=REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def asv_conf(machine: str) -> dict:
    """The device's asv.conf.json: this checkout's project settings, the folder's
    one-commit repository and suite, results and html within the folder."""
    return {"version": 1, "project": "attnkern", "project_url": "https://github.com/attnkern/attnkern",
            "repo": "repo", "dvcs": "git", "branches": ["HEAD"], "environment_type": "existing",
            "benchmark_dir": "benchmarks", "results_dir": "results", "html_dir": "html"}


def run_script(sha: str, machine: str, bench, attributes: list[str]) -> str:
    """The device command: install, register the machine, run asv's GPU classes: one
    `asv run` for each selection in bench (a regex, or a list of them), each adding its
    results to the commit's file, so that the classes measured before a cut survive it."""
    attrs = " ".join(f"-a {shlex.quote(a)}" for a in attributes)
    benches = [bench] if isinstance(bench, str) else list(bench)
    runs = "\n".join(f'python3 -m asv run --python=same --set-commit-hash {sha} --machine "$machine" '
                      f'-b {shlex.quote(b)} {attrs} --show-stderr || status=1' for b in benches)
    return f"""#!/bin/sh
# tools/gpu_history.py prepare wrote this: asv's GPU classes on commit {sha[:12]} on this machine
set -e
cd "$(dirname "$0")"
# a folder of this commit's own: pip --target leaves packages already in a folder as they are
site=/tmp/asv-site-{sha[:12]}
rm -rf "$site"
pip install -q --no-index --no-deps --target "$site" whl/*.whl
export PATH="$site/bin:$PATH"
# asv runs its benchmark processes without PYTHONPATH: a .pth file of the interpreter's own
# puts the folder first on sys.path (before its NumPy 2.5, which numba-cuda cannot import)
pth="$(python3 -c 'import site; print(site.getsitepackages()[0])')/attnkern-asv-site.pth"
echo "import sys; sys.path.insert(0, '$site')" > "$pth"
trap 'rm -f "$pth"' EXIT
machine={shlex.quote(machine)}
if [ "$machine" = auto ]; then
  machine=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1 | tr 'A-Z ' 'a-z-')
fi
python3 -m asv machine --yes --machine "$machine"
status=0
{runs}
exit $status
"""


def build_wheel(sha: str, python312: str, out: Path) -> Path:
    """The commit's cp312 wheel, built from `git archive` of it (no isolation: the
    build tools come from the Python 3.12 environment)."""
    with tempfile.TemporaryDirectory(prefix="attnkern-gpuhist-") as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        archive = subprocess.run(["git", "archive", sha], cwd=REPO, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
        subprocess.run([python312, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                        str(src)], check=True)
    wheels = sorted(out.glob("attnkern-*cp312*.whl"))
    if not wheels:
        raise RuntimeError(f"no cp312 wheel of attnkern in {out}")
    return wheels[-1]


def shallow_clone(sha: str, dest: Path) -> None:
    """A repository holding the commit alone (its tree, no history)."""
    git("init", "-q", str(dest))
    git("fetch", "-q", "--depth", "1", str(REPO), sha, cwd=dest)
    git("checkout", "-q", sha, cwd=dest)


def prepare(args) -> int:
    sha = git("rev-parse", "--verify", f"{args.commit}^{{commit}}")
    out = Path(args.out).resolve()
    for pattern, where, what in (("numpy-2.4.*-cp312-*.whl", args.numpy_wheel, "--numpy-wheel"),
                                 ("asv-*.whl", args.asv_wheels, "--asv-wheels")):
        found = sorted(Path(where).glob(pattern)) if where else []
        if not found and where:
            # Not there yet: fetch the cp312 wheels once into that folder (this machine has the network,
            # the device has none).
            spec = "numpy==2.4.*" if what == "--numpy-wheel" else "asv==0.6.6"
            print(f"[gpu-history] downloading {spec} (cp312 wheels) into {where}", file=sys.stderr, flush=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
                            "--python-version", "3.12", "--implementation", "cp",
                            "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                            "--platform", "manylinux2014_x86_64", "-d", str(where), spec]
                           + (["--no-deps"] if what == "--numpy-wheel" else []), check=False)
            found = sorted(Path(where).glob(pattern))
        if not found:
            print(f"gpu_history.py: no {pattern} in {where!r} and none could be downloaded: pass {what} "
                  f"(a folder of cp312 wheels)", file=sys.stderr)
            return 2
    if out.exists():
        shutil.rmtree(out)
    (out / "whl").mkdir(parents=True)
    print(f"[gpu-history] building the cp312 wheel of {sha[:12]} ...", file=sys.stderr, flush=True)
    build_wheel(sha, args.python312, out / "whl")
    shutil.copy(sorted(Path(args.numpy_wheel).glob("numpy-2.4.*-cp312-*.whl"))[-1], out / "whl")
    for wheel in Path(args.asv_wheels).glob("*.whl"):
        shutil.copy(wheel, out / "whl")
    shallow_clone(sha, out / "repo")
    shutil.copytree(REPO / "benchmarks", out / "benchmarks", ignore=shutil.ignore_patterns("__pycache__"))
    (out / "asv.conf.json").write_text(json.dumps(asv_conf(args.machine), indent=1) + "\n")
    script = out / "run.sh"
    script.write_text(run_script(sha, args.machine, args.bench, args.attributes or []))
    script.chmod(0o755)
    print(f"[gpu-history] {out}: run `sh run.sh` there on the device machine, bring back results/, then "
          f"`tools/gpu_history.py merge <it>/results`", file=sys.stderr)
    return 0


def check_result(path: Path, machine: str, known: set[str]) -> dict:
    """A result file's JSON, after the checks merge makes (ValueError says what is wrong)."""
    data = json.loads(path.read_text())
    if data.get("version") != RESULT_VERSION:
        raise ValueError(f"{path.name}: asv result format {data.get('version')!r}, expected {RESULT_VERSION}")
    if data.get("params", {}).get("machine") != machine:
        raise ValueError(f"{path.name}: machine {data.get('params', {}).get('machine')!r}, expected {machine!r}")
    sha = data.get("commit_hash", "")
    if subprocess.run(["git", "cat-file", "-e", f"{sha}^{{commit}}"], cwd=REPO, capture_output=True).returncode:
        raise ValueError(f"{path.name}: commit {sha!r} is not in this repository")
    unknown = sorted(set(data.get("results", {})) - known)
    if unknown:
        raise ValueError(f"{path.name}: benchmarks unknown to {RESULTS / 'benchmarks.json'}: {', '.join(unknown)}")
    return data


def merge(args) -> int:
    src = Path(args.results)
    results = Path(args.into)
    machines = [d for d in src.iterdir() if d.is_dir() and (d / "machine.json").exists()] if src.is_dir() else []
    if not machines:
        print(f"gpu_history.py: no <machine>/machine.json under {src} (the results/ folder of the device run)",
              file=sys.stderr)
        return 2
    bench_file = results / "benchmarks.json"
    if not bench_file.exists():
        print(f"gpu_history.py: {bench_file} is missing: run `make bench` here first (it writes the suite's "
              "benchmark list, GPU classes included)", file=sys.stderr)
        return 2
    known = set(json.loads(bench_file.read_text())) - {"version"}
    merged = 0
    for mdir in machines:
        machine = json.loads((mdir / "machine.json").read_text()).get("machine")
        if machine != mdir.name:
            print(f"gpu_history.py: {mdir}/machine.json names {machine!r}", file=sys.stderr)
            return 2
        files = [p for p in sorted(mdir.glob("*.json")) if p.name != "machine.json"]
        try:
            for p in files:
                check_result(p, machine, known)
        except ValueError as exc:
            print(f"gpu_history.py: {exc}", file=sys.stderr)
            return 2
        dest = results / machine
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copy(mdir / "machine.json", dest / "machine.json")
        for p in files:
            shutil.copy(p, dest / p.name)
            merged += 1
        print(f"[gpu-history] {len(files)} result file(s) of {machine} into {dest}", file=sys.stderr)
    print(f"[gpu-history] merged {merged} file(s); `make site` (asv publish) shows them", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="step", required=True)
    pp = sub.add_parser("prepare", help="build the commit's wheel and a folder for the device machine")
    pp.add_argument("commit")
    pp.add_argument("--out", default=".gpu-history")
    pp.add_argument("--machine", default=DEFAULT_MACHINE)
    pp.add_argument("--bench", nargs="+", default=DEFAULT_BENCH,
                    help="asv's -b selections, one asv run each (default: the four GPU classes, one a run)")
    pp.add_argument("--attributes", nargs="*", help="asv -a overrides, e.g. rounds=1 repeat=5")
    pp.add_argument("--python312", default="/tmp/py312/bin/python", help="a Python 3.12 with meson-python, "
                    "meson, ninja, Cython and NumPy (docs/gpu-device.md)")
    pp.add_argument("--numpy-wheel", default=str(REPO / ".whl"), help="a folder with a NumPy 2.4 cp312 wheel")
    pp.add_argument("--asv-wheels", default=str(REPO / ".whl" / "asv"),
                    help="a folder with asv's cp312 wheel and its dependencies'")
    pp.set_defaults(func=prepare)
    pm = sub.add_parser("merge", help="merge a device run's results/ into .asv/results")
    pm.add_argument("results", help="the results/ folder brought back from the device")
    pm.add_argument("--into", default=str(RESULTS), help="asv's results folder (.asv/results)")
    pm.set_defaults(func=merge)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
