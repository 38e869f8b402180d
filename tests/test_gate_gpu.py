"""The GPU regression gate (`tools/gate.py --device cuda`): its options, its
refusal without a GPU, its statistics over fake workers, the attribution of
ncu's counts to configurations, and the calibration's injected slowdown. With
ATTNKERN_TEST_GPU=1 on a GPU machine, the gate end to end on one build."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import calibrate_gate  # noqa: E402
import gate  # noqa: E402
import gpu_counting  # noqa: E402  (benchmarks/, put on the path by gate)

GPU = os.environ.get("ATTNKERN_TEST_GPU") == "1"


# ---------------------------------------------------------------- options
def test_cuda_defaults():
    args = gate.parse_args(["--device", "cuda", "--base-site", "/x", "--head-site", "/y"])
    assert args.kernels == gate.GPU_KERNELS and args.time_shapes == gate.GPU_SHAPES
    assert args.count_shapes == gate.GPU_SHAPES and args.rounds == 100 and args.calls == 5
    cpu = gate.parse_args(["--base", "main"])
    assert cpu.kernels == gate.KERNELS and cpu.rounds == 150 and cpu.calls == 1
    assert cpu.count_shapes == gate.COUNT_SHAPES


@pytest.mark.parametrize("argv, message", [
    ([], "the baseline is missing"),
    (["--base", "main", "--base-wheel", "a.whl", "--base-site", "s"], "at most one of --base-wheel"),
    (["--device", "cuda", "--base", "main", "--kernels", "cuda.flash"], "kernel:dtype pairs"),
    (["--base", "main", "--rounds", "2", "--processes", "3"], "at least --processes"),
    (["--build-wheels", "out"], "--build-wheels needs --base"),
])
def test_bad_options_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        gate.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(GPU, reason="this machine has a GPU")
def test_cuda_refused_without_a_gpu(tmp_path):
    """No GPU: exit status 2 and a message that says why, before any build."""
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "gate.py"), "--device", "cuda", "--base", "HEAD",
                           "--cache", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--device cuda needs" in proc.stderr
    assert not any(tmp_path.iterdir())  # nothing was built


def test_missing_site_is_refused(tmp_path):
    with pytest.raises(gate.GateError, match="holds no attnkern"):
        gate.main(["--base-site", str(tmp_path), "--head-site", str(tmp_path), "--no-count", "-b", "native.flash"])


def test_setup_of_keys():
    assert gate.setup_of("cuda.flash:bfloat16:1x16x1024x64:1") == dict(
        kernel="cuda.flash", dtype="bfloat16", shape="1x16x1024x64", causal=True, device="cuda")
    assert gate.setup_of("native.flash:1x8x512x64:0") == dict(kernel="native.flash", shape="1x8x512x64",
                                                              causal=False)


# ---------------------------------------------------------------- statistics over fake workers
class FakeWorker:
    """turns.Worker's interface; times drawn around a per-build mean with 2% noise."""
    means = {}
    started = []

    def __init__(self, python, env, threads):
        self.site = env["PYTHONPATH"].split(os.pathsep)[0]
        self.rng = random.Random(len(FakeWorker.started))
        FakeWorker.started.append(self.site)

    def setup(self, **kw):
        assert kw["device"] == "cuda" and kw["dtype"] in ("float32", "bfloat16")
        return {"seconds": 1e-3, "file": os.path.join(self.site, "attnkern", "__init__.py")}

    def turn(self, calls, key=""):
        return [self.means[self.site] * (1 + self.rng.gauss(0, 0.02)) for _ in range(calls)]

    def close(self):
        pass


@pytest.mark.parametrize("slowdown, expected", [(1.0, "same"), (1.10, "slower"), (0.90, "faster")])
def test_paired_statistics_with_fake_workers(tmp_path, monkeypatch, slowdown, expected):
    sites = {side: tmp_path / side for side in ("baseline", "candidate")}
    for s in sites.values():
        (s / "attnkern").mkdir(parents=True)
    FakeWorker.means = {str(sites["baseline"]): 1e-3, str(sites["candidate"]): 1e-3 * slowdown}
    FakeWorker.started = []
    monkeypatch.setattr(gate.turns, "Worker", FakeWorker)
    args = gate.parse_args(["--device", "cuda", "--base-site", "b", "--head-site", "c", "--rounds", "60"])
    keys = ["cuda.flash:float32:1x16x1024x64:0", "cuda.flash:bfloat16:1x16x1024x64:1"]
    timed = gate.time_both(keys, sites, args, lambda msg: None)
    assert len(FakeWorker.started) == 2 * args.processes  # a fresh pair per third of the rounds
    rows = gate.rows_of(None, timed, args)
    assert [r["benchmark"] for r in rows] == keys
    for r in rows:
        assert len(r["rounds"]) == 60 and r["interval"][0] <= r["ratio"] <= r["interval"][1]
        assert abs(r["ratio"] - slowdown) < 0.02
        assert r["verdict"] == expected


def test_gpu_count_rows_and_thresholds():
    args = gate.parse_args(["--device", "cuda", "--base-site", "b", "--head-site", "c"])
    base = {"sass": 1e6, "dram_read": 4e6, "dram_write": 1e6, "gpu_ns": 1e5, "kernels": 1}
    counted = {"baseline": {"a": base, "b": base, "c": {"error": "no such kernel"}},
               "candidate": {"a": dict(base, sass=1.02e6), "b": dict(base, dram_read=4.2e6), "c": base}}
    rows = {(r["benchmark"], r["signal"]): r for r in gate.rows_of(None, None, args, counted)}
    assert rows["a", "sass"]["verdict"] == "slower" and rows["a", "dram"]["verdict"] == "same"
    assert rows["b", "sass"]["verdict"] == "same" and rows["b", "dram"]["ratio"] == pytest.approx(1.04)
    assert rows["b", "dram"]["verdict"] == "same"  # +4% of bytes is inside the default 5%
    assert rows["c", "sass"]["verdict"] == "skipped" and "no such kernel" in rows["c", "sass"]["note"]
    restricted = gate.rows_of(None, None, args, "the GPU's counters are restricted to administrators: ...")
    assert restricted[0]["verdict"] == "skipped" and "restricted" in restricted[0]["note"]


# ---------------------------------------------------------------- ncu's output
def _ncu_csv(kernels):
    header = ["ID", "Process ID", "Kernel Name", *gpu_counting.METRICS.values()]
    units = ["", "", "", "inst", "byte", "byte", "ns"]
    lines = ["==PROF== Connected to process 1", ",".join(f'"{h}"' for h in header),
             ",".join(f'"{u}"' for u in units)]
    for i, (name, sass) in enumerate(kernels):
        lines.append(",".join(f'"{x}"' for x in (i, 1, name, f"{sass:,}", "2,048", "1,024", "5,000")))
    return "\n".join(lines) + "\n==PROF== Disconnected\n"


def test_ncu_counts_are_attributed_between_delimiters():
    out = _ncu_csv([("at::cuda::spin_kernel(long)", 7), ("flash", 1000), ("at::cuda::spin_kernel(long)", 7),
                    ("naive_scores", 100), ("naive_softmax", 20), ("naive_pv", 300)])
    res = gpu_counting.attribute(out, [["cuda.flash:float32:s:0", "ok"], ["x:float32:s:0", "x is missing"],
                                       ["cuda.naive:float32:s:0", "ok"]])
    assert res["cuda.flash:float32:s:0"]["sass"] == 1000 and res["cuda.flash:float32:s:0"]["kernels"] == 1
    assert res["cuda.naive:float32:s:0"]["sass"] == 420 and res["cuda.naive:float32:s:0"]["kernels"] == 3
    assert res["cuda.naive:float32:s:0"]["dram_read"] == 3 * 2048
    assert res["x:float32:s:0"] == {"error": "x is missing"}
    with pytest.raises(RuntimeError, match="2 delimited calls for 1"):
        gpu_counting.attribute(out, [["a", "ok"]])


# ---------------------------------------------------------------- the calibration's slowdown
def test_gpu_slowdown_is_injected_once_into_the_current_kernel():
    path = REPO / calibrate_gate.GPU_INJECT_FILE
    if not path.exists():  # tests run from a copy beside an installed wheel
        import attnkern

        path = Path(attnkern.__file__).parents[1] / calibrate_gate.GPU_INJECT_FILE
    source = path.read_text()
    slow = calibrate_gate.inject_gpu_slowdown(source, 123)
    assert slow.count("injected slowdown") == 1 and "r_ < 123" in slow
    assert slow.replace(slow[slow.index("        {  // injected"):slow.index(calibrate_gate.GPU_INJECT_LINE)],
                        "") == source
    with pytest.raises(ValueError, match="moved"):
        calibrate_gate.inject_gpu_slowdown("nothing here", 1)


def test_gpu_variant_copies_the_build(tmp_path):
    base = tmp_path / "base"
    (base / Path(calibrate_gate.GPU_INJECT_FILE).parent).mkdir(parents=True)
    (base / calibrate_gate.GPU_INJECT_FILE).write_text("x\n" + calibrate_gate.GPU_INJECT_LINE)
    same = calibrate_gate.gpu_variant(base, tmp_path / "noop", None)
    slow = calibrate_gate.gpu_variant(base, tmp_path / "slow", 10)
    assert (same / calibrate_gate.GPU_INJECT_FILE).read_text() == (base / calibrate_gate.GPU_INJECT_FILE).read_text()
    assert "r_ < 10" in (slow / calibrate_gate.GPU_INJECT_FILE).read_text()
    assert "injected" not in (base / calibrate_gate.GPU_INJECT_FILE).read_text()


# ---------------------------------------------------------------- on a GPU
@pytest.mark.skipif(not GPU, reason="needs ATTNKERN_TEST_GPU=1 and a GPU")
def test_gpu_gate_end_to_end_on_one_build(tmp_path):
    """The installed build against itself: every signal runs, nothing is slower."""
    import attnkern

    if gate.gpu_missing():
        pytest.skip(gate.gpu_missing())
    site = Path(attnkern.__file__).resolve().parents[1]
    out = tmp_path / "gate.json"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "gate.py"), "--device", "cuda", "--base-site",
                           str(site), "--head-site", str(site), "-b", r"^cuda\.flash:float32:1x16x1024x64:",
                           "--rounds", "8", "--processes", "2", "--json", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    signals = {r["signal"] for r in rows}
    assert signals == {"sass", "dram", "time"}, rows
    assert all(r["verdict"] == "same" for r in rows if r["signal"] == "sass"), rows


def test_triton_is_timed_but_not_counted(tmp_path, monkeypatch, capsys):
    """The GPU path of main() with the GPU parts replaced: triton.flash's
    configurations never reach ncu and get a skipped row saying why."""
    site = tmp_path / "site"
    (site / "attnkern").mkdir(parents=True)
    asked = []

    def fake_count(keys, sites, log):
        asked.extend(keys)
        return {side: {k: {"sass": 1e6, "dram_read": 1e6, "dram_write": 0.0} for k in keys} for side in sites}

    monkeypatch.setattr(gate, "gpu_missing", lambda: None)
    monkeypatch.setattr(gate.gpu_counting, "ncu_missing", lambda: None)
    monkeypatch.setattr(gate, "count_gpu", fake_count)
    monkeypatch.setattr(gate, "gpu_name", lambda: "a fake GPU")
    out = tmp_path / "gate.json"
    code = gate.main(["--device", "cuda", "--base-site", str(site), "--head-site", str(site), "--no-time",
                      "--kernels", "cuda.flash:bfloat16", "triton.flash:bfloat16", "--time-shapes", "1x2x64x64",
                      "--json", str(out)])
    assert code == 0
    assert asked == ["cuda.flash:bfloat16:1x2x64x64:0", "cuda.flash:bfloat16:1x2x64x64:1"]
    rows = json.loads(out.read_text())["rows"]
    skipped = [r for r in rows if r["verdict"] == "skipped"]
    assert {r["benchmark"] for r in skipped} == {"triton.flash:bfloat16:1x2x64x64:0", "triton.flash:bfloat16:1x2x64x64:1"}
    assert all("fixed config table" in r["note"] and "timed only" in r["note"] for r in skipped)
    assert "on a fake GPU" in capsys.readouterr().out


def test_the_json_records_an_unknown_cpu_where_the_extension_does_not_import(monkeypatch):
    """A GPU machine gating installed wheels from a source checkout cannot import the checkout's
    compiled extension: the JSON's informational "cpu" then says why instead of failing the run
    after its verdicts (seen on the device machine: exit 2, an empty JSON)."""
    def broken():
        raise RuntimeError("the compiled extension failed to import: no _attn here")

    monkeypatch.setattr(gate, "cpu_name", broken)
    assert gate.cpu_label() == "unknown (the compiled extension failed to import: no _attn here)"
    monkeypatch.setattr(gate, "cpu_name", lambda: "AMD EPYC")
    assert gate.cpu_label() == "AMD EPYC"
