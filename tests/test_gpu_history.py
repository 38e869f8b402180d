"""tools/gpu_history.py: the device folder's asv configuration and command, and the
merge of a run's results into .asv/results, which `asv publish` then shows.

The results fixture (tests/data/asv_cpu_check_results/) is a real `asv run` of a
folder `prepare` made (commit a57857d, ForwardGpu on cuda.flash and torch.sdpa at
1x16x4096x64 float32), run on the CPU machine under the machine name cpu-check:
there the GPU benchmarks skip (no values). The device run of the same folder did
not record results (asv started its benchmark processes without PYTHONPATH; run.sh
now puts the folder on sys.path with a .pth file), and no device time was left to
run it again: a GPU machine's results are the same files with values."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gpu_history  # noqa: E402

FIXTURE = Path(__file__).parent / "data" / "asv_cpu_check_results"
MACHINE = "cpu-check"
SHA = "a57857d7802181305a5d6ef938fa0e2484fe46b9"


def gpu_result_file():
    return next(p for p in (FIXTURE / MACHINE).glob("*.json") if p.name != "machine.json")


def test_run_script_quotes_the_selection_and_names_the_machine_after_the_gpu(tmp_path):
    script = gpu_history.run_script(SHA, "auto", r"ForwardGpu.time_forward\('cuda\.flash'", ["repeat=(1,5,1.0)"])
    path = tmp_path / "run.sh"
    path.write_text(script)
    assert subprocess.run(["sh", "-n", str(path)]).returncode == 0
    assert f"--set-commit-hash {SHA}" in script and "--python=same" in script
    assert "nvidia-smi --query-gpu=name" in script and "-a 'repeat=(1,5,1.0)'" in script
    # the selection reaches asv as one argument, its quotes intact
    line = next(x for x in script.splitlines() if x.startswith("python3 -m asv run"))
    words = subprocess.run(["sh", "-c", f"printf '%s\\n' {line.split(' -b ', 1)[1].split(' -a ')[0]}"],
                           capture_output=True, text=True).stdout.splitlines()
    assert words == [r"ForwardGpu.time_forward\('cuda\.flash'"]
    # the default: one asv run a GPU class, a failed one not stopping the next, the status kept
    script = gpu_history.run_script(SHA, "auto", gpu_history.DEFAULT_BENCH, [])
    runs = [x for x in script.splitlines() if x.startswith("python3 -m asv run")]
    assert len(runs) == 4 and all(x.endswith("|| status=1") for x in runs), runs
    assert "DecodeGpu" in runs[0] and script.rstrip().endswith("exit $status")
    conf = gpu_history.asv_conf("auto")
    assert conf["repo"] == "repo" and conf["results_dir"] == "results" and conf["environment_type"] == "existing"


def test_shallow_clone_holds_the_commit(tmp_path):
    gpu_history.shallow_clone(SHA, tmp_path / "repo")
    log = subprocess.run(["git", "log", "--format=%H"], cwd=tmp_path / "repo", capture_output=True, text=True)
    assert log.stdout.split() == [SHA]


def results_dir(tmp_path):
    """An .asv/results with the suite's benchmark list (the device run's copy)."""
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(FIXTURE / "benchmarks.json", results / "benchmarks.json")
    return results


def test_the_recorded_run_is_asvs():
    data = json.loads(gpu_result_file().read_text())
    assert data["version"] == gpu_history.RESULT_VERSION
    assert data["commit_hash"] == SHA and data["params"]["machine"] == MACHINE
    assert set(data["results"]) == {"bench_forward.ForwardGpu.time_forward"}


def test_merge_copies_checked_results(tmp_path):
    results = results_dir(tmp_path)
    assert gpu_history.main(["merge", str(FIXTURE), "--into", str(results)]) == 0
    assert (results / MACHINE / "machine.json").exists()
    assert (results / MACHINE / gpu_result_file().name).read_bytes() == gpu_result_file().read_bytes()


def corrupted(tmp_path, change):
    src = tmp_path / "brought"
    shutil.copytree(FIXTURE, src)
    path = next(p for p in (src / MACHINE).glob("*.json") if p.name != "machine.json")
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return src


@pytest.mark.parametrize("change,words", [
    (lambda d: d.update(version=1), "asv result format 1, expected 2"),
    (lambda d: d["params"].update(machine="other"), "machine 'other', expected 'cpu-check'"),
    (lambda d: d.update(commit_hash="0" * 40), "is not in this repository"),
    (lambda d: d["results"].update({"bench_x.Nope.time_nope": []}), "benchmarks unknown to"),
])
def test_merge_refuses_bad_results(tmp_path, capsys, change, words):
    results = results_dir(tmp_path)
    assert gpu_history.main(["merge", str(corrupted(tmp_path, change)), "--into", str(results)]) == 2
    assert words in capsys.readouterr().err
    assert not (results / MACHINE).exists()


def test_merge_needs_results_and_a_benchmark_list(tmp_path, capsys):
    assert gpu_history.main(["merge", str(tmp_path), "--into", str(tmp_path)]) == 2
    assert "no <machine>/machine.json" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert gpu_history.main(["merge", str(FIXTURE), "--into", str(empty)]) == 2
    assert "benchmarks.json is missing" in capsys.readouterr().err


@pytest.mark.slow
def test_asv_publish_shows_the_merged_machine(tmp_path):
    """The merged results published with this checkout's repository: the machine
    and its ForwardGpu graphs are in the site."""
    results = results_dir(tmp_path)
    assert gpu_history.main(["merge", str(FIXTURE), "--into", str(results)]) == 0
    json5 = pytest.importorskip("json5")  # asv's own dependency: it reads asv.conf.json's comments
    conf = json5.loads((ROOT / "asv.conf.json").read_text())
    conf.update(repo=str(ROOT), results_dir=str(results), html_dir=str(tmp_path / "html"))
    (tmp_path / "asv.conf.json").write_text(json.dumps(conf))
    asv = Path(sys.executable).parent / "asv"
    proc = subprocess.run([str(asv), "publish", "--config", str(tmp_path / "asv.conf.json")], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    index = json.loads((tmp_path / "html" / "index.json").read_text())
    assert MACHINE in index["params"]["machine"]
    graphs = list((tmp_path / "html" / "graphs").rglob("*ForwardGpu*"))
    assert any(f"machine-{MACHINE}" in str(g) for g in graphs)
