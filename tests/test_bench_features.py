"""`attnkern features` (the feature cases against torch, the window study) and the asv
classes of benchmarks/bench_features.py, on tiny sizes: they run, their output is
complete and sane, their checks catch a wrong answer. Speed is not asserted."""

import csv
import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import attnkern
from attnkern_bench import cli, features

pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
TINY = ["--n", "64", "--heads", "4", "--kv-heads", "2", "--dim", "16", "--window", "16", "--chunk", "8",
        "--cache", "48", "--repeat", "1", "--passes", "1", "--settle", "0", "--threads", "1"]


def _supported(case: str, backward: bool) -> bool:
    return features.missing(features.NEEDS[case], backward) is None


def test_every_case_in_both_directions(tmp_path, capsys):
    out, table = tmp_path / "f.json", tmp_path / "f.csv"
    assert cli.main(["features", *TINY, "--json", str(out), "--csv", str(table)]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["case"], r["direction"]) for r in rows] == [(c, d) for c in features.CASES
                                                          for d in features.DIRECTIONS]
    for r in rows:
        backward = r["direction"] != "forward"
        if not _supported(r["case"], backward):  # a feature this attnkern lacks: said, not timed
            assert "skipped" in r and "ours_s" not in r, r
            continue
        assert "failed" not in r and "skipped" not in r, r
        assert r["ours_s"] > 0 and r["torch_s"] > 0, r
        assert math.isfinite(r["ratio"]) and r["ratio"] == pytest.approx(r["torch_s"] / r["ours_s"]), r
        assert r["torch_path"] and r["shape"]
        if not backward:
            assert r["ok"] is True, r
            assert r["ours_error"] <= 7.6e-6 or r["case"] == "dropout", r
            if r["case"] != "dropout":  # torch's random numbers are not ours: not compared
                assert r["torch_error"] <= 7.6e-6, r
    # what runs today on native.flash is measured, not skipped
    measured = {r["case"] for r in rows if "ours_s" in r}
    assert {"gqa", "mqa", "key-lengths", "window", "decode", "decode-gqa", "chunked-prefill", "softcap"} <= measured
    with open(table) as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    printed = capsys.readouterr()
    assert "torch/ours" in printed.out and "[12/12] dropout" in printed.err


def test_a_wrong_answer_fails_the_check(monkeypatch, capsys):
    real = attnkern.attention

    def off(q, k, v, **kw):
        out = real(q, k, v, **kw)
        return out + 1e-3 if kw.get("window") is not None else out

    monkeypatch.setattr(attnkern, "attention", off)
    assert cli.main(["features", *TINY, "--cases", "window", "--directions", "forward"]) == 1
    assert "FAIL: window forward" in capsys.readouterr().err


def test_torchs_side_is_checked_too(monkeypatch, capsys):
    """torch's mask must express the feature: a band one key too wide is caught."""
    real = features._torch_masked

    def wider(mask, scale):
        return real(mask | np.eye(*mask.shape[-2:], k=-mask.sum(-1).max(), dtype=bool), scale)

    monkeypatch.setattr(features, "_torch_masked", wider)
    assert cli.main(["features", *TINY, "--cases", "window", "--directions", "forward"]) == 1
    row_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("window"))
    assert "FAIL" in row_line


def test_a_case_that_breaks_is_a_failure_not_a_skip(monkeypatch, capsys):
    def broken(name, a, rng):
        raise ValueError("axes don't match array")

    monkeypatch.setattr(features, "build", broken)
    assert cli.main(["features", *TINY, "--cases", "softcap", "--json", "/dev/null"]) == 1
    assert "FAIL: softcap forward: ValueError: axes don't match array" in capsys.readouterr().err


def test_window_study(tmp_path, capsys):
    out = tmp_path / "study.json"
    argv = ["features", "--window-study", "--study-sizes", "64", "128", "--study-window", "16", "--study-heads",
            "2", "--dim", "16", "--repeat", "1", "--passes", "1", "--settle", "0", "--threads", "1",
            "--json", str(out)]
    assert cli.main(argv) == 0
    rows = json.loads(out.read_text())["study"]
    assert [r["n"] for r in rows] == [64, 128]
    for r in rows:
        assert r["ok"] and r["window_s"] > 0 and r["causal_s"] > 0
        assert r["window_ns_per_nw"] == pytest.approx(r["window_s"] / (2 * r["n"] * 16) * 1e9)
        assert r["causal_ns_per_n2"] == pytest.approx(r["causal_s"] / (2 * r["n"] * r["n"] / 2) * 1e9)
        assert math.isfinite(r["speedup"]) and r["speedup"] > 0
    assert "ns/(B H N W)" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--kv-heads", "3"], "must divide --heads"),
    (["--n", "4"], "at least 8"),
    (["--repeat", "0"], "must be positive"),
])
def test_bad_arguments_say_what_to_fix(argv, message):
    with pytest.raises(SystemExit, match=message):
        cli.main(["features", *TINY, *argv])


def test_a_missing_feature_is_skipped_with_its_reason(monkeypatch):
    real = attnkern.kernel_info

    def without_softcap(name):
        info = dict(real(name))
        info["features"] = [f for f in info["features"] if f != "softcap"]
        return info

    monkeypatch.setattr(attnkern, "kernel_info", without_softcap)
    assert "softcap" in features.missing(("softcap",), backward=False)
    assert features.missing(("window",), backward=False) is None
    if "attn_mask" not in inspect.signature(attnkern.attention).parameters:
        assert "attn_mask" in features.missing(("mask",), backward=False)


def test_asv_feature_classes_run_in_the_smoke_setting():
    """Every combination of bench_features' classes sets up and runs once at the smoke sizes
    (N <= 256), as tests/test_suite.py's asv run does; skips are NotImplementedError only."""
    script = r"""
import itertools, sys, time
sys.path.insert(0, sys.argv[1])
from benchmarks import bench_features as bf
ran = skipped = 0
t0 = time.perf_counter()
classes = [c for c in vars(bf).values() if isinstance(c, type) and issubclass(c, bf._Feature)]
for cls in (c for c in classes if c is not bf._Feature):
    assert getattr(cls, "nk", 0) <= 256 and all("4096" not in str(a) and "1024" not in str(a) for a in cls.params)
    for args in itertools.product(*cls.params):
        bench = cls()
        try:
            bench.setup(*args)
        except NotImplementedError:
            skipped += 1
            continue
        bench.time_features(*args)
        ran += 1
print(ran, skipped, time.perf_counter() - t0)
"""
    env = dict(os.environ, ATTNKERN_BENCH_SMOKE="1")
    proc = subprocess.run([sys.executable, "-c", script, str(REPO)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran, skipped, seconds = proc.stdout.split()
    # what native.flash has today: GroupedHeads 2 x 5 (native.flash and torch both directions, numpy.naive
    # forward), KeyLengths 5, SlidingWindow 5, KvCache 3 x 5, Softcap 5; masks, varlen and dropout add more
    assert int(ran) >= 40, proc.stdout


def test_asv_feature_classes_are_small_in_smoke_and_full_outside():
    sys.path.insert(0, str(REPO))
    try:
        from benchmarks import bench_features as bf
    finally:
        sys.path.remove(str(REPO))
    classes = [c for c in vars(bf).values() if isinstance(c, type) and issubclass(c, bf._Feature)
               and c is not bf._Feature]
    assert len(classes) == 9
    assert bf.SlidingWindow.params[2] == (["256:64"] if bf.SMOKE else ["4096:256"])
    for cls in classes:
        assert cls.params[:2] == [bf.KERNELS, bf.DIRECTIONS] and len(cls.params) == len(cls.param_names)
