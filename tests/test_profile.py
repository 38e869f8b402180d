"""attnkern profile --device cuda (attnkern_bench/profile.py): the parsing of ncu's raw
CSV, the per-launch table and the roofline rows, on a CSV captured on the device
machine (an H200: `attnkern profile --device cuda --shape 1x16x4096x64 --csv ...`,
tests/data/ncu_profile_h200_1x16x4096x64_float32.*); the ncu run itself needs a GPU."""

import json
from pathlib import Path

import pytest

from attnkern_bench import cli, profile

DATA = Path(__file__).parent / "data"
CSV = DATA / "ncu_profile_h200_1x16x4096x64_float32.csv"
STATUS = DATA / "ncu_profile_h200_1x16x4096x64_float32.status"
SHAPE = (1, 16, 4096, 64)


def recorded():
    outcomes = profile._read_status(str(STATUS))
    return profile.summarise(CSV.read_text(), outcomes, profile.chosen_metrics(None), SHAPE, "float32", False)


def test_launches_are_grouped_by_delimiter():
    results = recorded()
    assert list(results) == ["cuda.naive", "cuda.flash", "triton.flash", "torch.sdpa"]
    counts = {k: len(r["launches"]) for k, r in results.items()}
    assert counts == {"cuda.naive": 3, "cuda.flash": 1, "triton.flash": 1, "torch.sdpa": 1}
    names = [x["name"] for x in results["cuda.naive"]["launches"]]
    assert [n.split("[")[0] for n in names] == ["attnkern::qk_scores", "attnkern::softmax_rows",
                                                "attnkern::pv_matmul"]
    assert results["torch.sdpa"]["launches"][0]["name"].startswith("fmha_cutlassF_f32")


def test_figures_are_read_and_plausible():
    results = recorded()
    flash = results["cuda.flash"]["launches"][0]
    # 255 registers: what ptxas -v reports for flash_tf32.cu's default division at D = 64
    assert flash["registers"] == 255
    assert flash["inst"] > 1e8 and 0 < flash["occupancy_pct"] < 100 and 0 < flash["tensor_hmma_pct"] < 100
    assert flash["local_ld"] == 0 and flash["local_st"] == 0  # no spills
    assert 0 <= flash["l2_hit_pct"] <= 100 and flash["time_ns"] > 0
    # q, k, v and the output are 4 x 16.8 MB: a flash kernel reads and writes about that once
    io = 4 * 16 * 4096 * 64 * 4
    dram = flash["dram_read"] + flash["dram_write"]
    assert 0.8 * io < dram < 1.2 * io
    # the wgmma pipe's counter is not on this ncu: absent, not zero
    assert flash["tensor_gmma_pct"] is None


def test_roofline_rows_put_measured_bytes_beside_the_model():
    results = recorded()
    naive = results["cuda.naive"]["roofline"]
    # cuda.naive's model (4 passes over the scores) matches the counters within a few percent
    assert 0.95 < naive["measured_over_model"] < 1.05
    flash = results["cuda.flash"]["roofline"]
    # the model re-reads K and V per query block from DRAM; the 50 MB L2 holds them
    assert flash["measured_over_model"] < 0.1
    assert flash["flops"] == 2.0 * 16 * 4096 * 4096 * 128
    assert flash["gflops"] == pytest.approx(flash["flops"] / flash["time_ns"])
    # triton.flash's model: its 128-row query blocks, as cuda.flash's (L2 holds K and V there too)
    triton = results["triton.flash"]["roofline"]
    assert triton["model_bytes"] > 0 and triton["measured_over_model"] < 0.1


def test_table_and_json_from_a_recorded_csv(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert cli.main(["profile", "--from-csv", str(CSV), "--status", str(STATUS), "--shape", "1x16x4096x64",
                     "--json", str(out)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0].startswith("# one call at 1x16x4096x64 float32")
    assert sum(line.startswith("cuda.naive ") for line in lines) == 3 + 1  # 3 launches, 1 roofline row
    assert "measured/model" in text and "triton.flash" in text
    row = next(line for line in lines if line.startswith("cuda.flash ") and "kernel" in line)
    assert " 255 " in row
    data = json.loads(out.read_text())
    assert data["shape"] == list(SHAPE) and set(data["kernels"]) == {"cuda.naive", "cuda.flash", "triton.flash",
                                                                     "torch.sdpa"}


def test_errors_are_reported():
    outcomes = [("cuda.flash", "ok"), ("cuda.naive", "ok")]
    with pytest.raises(RuntimeError, match="4 delimited calls for 2 profiled kernels"):
        profile.launches(CSV.read_text(), outcomes, profile.chosen_metrics(None))
    # a kernel that could not run keeps its reason, and the others their launches
    text = CSV.read_text()
    outcomes = profile._read_status(str(STATUS)) + [("cuda.other", "ValueError: no such thing")]
    results = profile.launches(text, outcomes, profile.chosen_metrics(None))
    assert results["cuda.other"] == {"error": "ValueError: no such thing"}
    assert profile.parse_csv("==PROF== nothing profiled\n") == []


def test_command_needs_ncu_or_a_recording(monkeypatch, capsys):
    monkeypatch.setattr(profile, "ncu_path", lambda: None)
    assert cli.main(["profile"]) == 2
    assert "ncu is not installed" in capsys.readouterr().err
    assert cli.main(["profile", "--from-csv", str(CSV)]) == 2
    assert "--from-csv needs --status" in capsys.readouterr().err


def test_metrics_missing_from_this_ncu_are_left_out():
    chosen = profile.chosen_metrics({"smsp__sass_inst_executed", "dram__bytes_read"})
    assert chosen["inst"] == "smsp__sass_inst_executed.sum" and chosen["dram_read"] == "dram__bytes_read.sum"
    assert "tensor_gmma_pct" not in chosen and "l2_bytes" not in chosen
    assert chosen["registers"] == "launch__registers_per_thread"  # launch figures are always there
