"""The benchmark command runs end to end (tiny sizes: a smoke test, not a timing)."""

import json

import pytest

from attnkern import bench


def test_bench_table_and_memory(tmp_path, capsys):
    pytest.importorskip("threadpoolctl")
    out = tmp_path / "bench.json"
    argv = ["--sizes", "64", "--heads", "2", "--repeat", "1", "--passes", "1", "--settle", "0", "--memory", "--memory-n", "4096", "--json", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    kernels = {row["kernel"] for row in result["rows"]}
    assert "native.flash" in kernels and "numpy.naive" in kernels
    assert all(row["median_s"] > 0 and row["gflops"] > 0 for row in result["rows"])
    flash = next(m for m in result["memory"] if m["kernel"] == "native.flash")
    assert "error" not in flash and flash["extra_bytes"] < 64 * 2**20
    printed = capsys.readouterr().out
    assert "sgemm ceiling" in printed and "native.flash" in printed


def test_flops_count():
    assert bench.attention_flops(1, 8, 1024, 1024, 64, False) == 4 * 8 * 1024 * 1024 * 64
    assert bench.attention_flops(1, 8, 1024, 1024, 64, True) == 2 * 8 * 1024 * 1024 * 64
