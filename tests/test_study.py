"""`attnkern study`: the forward/backward time and memory study, end to end on a
tiny CPU grid (a smoke test, not a timing), its out-of-memory path under a cap,
and the memory account against hand arithmetic and torch's autograd."""

import csv
import json
import sys

import pytest
import torch

import attnkern
from attnkern_bench import cli
from attnkern_bench.study import measuring, model

needs_flash = pytest.mark.skipif(not attnkern.kernel_info("native.flash")["available"],
                                 reason="native.flash is not built")


def test_study_end_to_end_writes_csv_markdown_plots_and_json(tmp_path, capsys):
    table, md, plots, js = tmp_path / "s.csv", tmp_path / "s.md", tmp_path / "plots", tmp_path / "s.json"
    argv = ["study", "--batch", "2", "--seqs", "32", "--dims", "8", "16", "--iters", "2", "--warmup", "1",
            "--account", "--csv", str(table), "--markdown", str(md), "--plots", str(plots), "--json", str(js)]
    assert cli.main(argv) == 0
    kernels = ["torch.naive", "torch.sdpa", "native.flash"]  # the CPU defaults
    with open(table) as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames) == model.CSV_COLUMNS
        rows = list(reader)
    assert sorted((int(r["seq_len"]), int(r["d_model"]), r["kernel"]) for r in rows) == sorted(
        (n, d, k) for n in (32,) for d in (8, 16) for k in kernels)
    for r in rows:
        assert r["status"] == "ok" and r["error"] == "" and r["batch"] == "2" and r["causal"] == "False"
        assert float(r["forward_ms"]) > 0 and float(r["backward_ms"]) > 0
        assert float(r["predicted_peak_mib"]) > 0 and r["peak_memory_mib"] != ""
    text = md.read_text()
    assert "| N | d | kernel | status |" in text and "## Smallest configuration out of memory" in text
    assert "## Memory account" in text and "P = softmax" in text
    assert {p.name for p in plots.iterdir()} == {"study_d8.png", "study_d16.png"}
    assert all(p.stat().st_size > 1000 for p in plots.iterdir())
    result = json.loads(js.read_text())
    assert len(result["rows"]) == 6 and result["smallest_oom"] == {k: None for k in kernels}
    assert all(r["gflops"] > 0 and r["grad_fn"] for r in result["rows"])
    out, err = capsys.readouterr()
    assert "pred/meas" in out and "memory account: torch.naive at B=2 H=1 N=32 d=16" in out
    assert "predicted peak by N" in out
    assert "[3/6] N=32 d=8 native.flash" in err  # progress, on stderr


def test_study_records_oom_under_a_cap_and_goes_on(tmp_path, capsys):
    """A cap of 0.05 GiB (51 MiB): torch.naive at B=2, N=2048 needs 32 MiB per
    N^2 tensor, 65 MiB at its forward peak, so it runs out; N=1024 (25 MiB) fits;
    native.flash (a few MiB) runs everywhere; N=4096 is skipped for torch.naive."""
    js = tmp_path / "oom.json"
    argv = ["study", "--batch", "2", "--seqs", "1024", "2048", "4096", "--dims", "16", "--iters", "1",
            "--warmup", "0", "--kernels", "torch.naive", "native.flash", "--memory-cap", "0.05",
            "--json", str(js)]
    assert cli.main(argv) == 0
    result = json.loads(js.read_text())
    status = {(r["kernel"], r["seq_len"]): r["status"] for r in result["rows"]}
    assert status == {("torch.naive", 1024): "ok", ("torch.naive", 2048): "oom", ("torch.naive", 4096): "skipped",
                      ("native.flash", 1024): "ok", ("native.flash", 2048): "ok", ("native.flash", 4096): "ok"}
    oom = next(r for r in result["rows"] if r["status"] == "oom")
    assert "allocate" in oom["error"] or "memory" in oom["error"].lower()
    assert result["smallest_oom"]["torch.naive"]["seq_len"] == 2048
    assert result["smallest_oom"]["native.flash"] is None
    assert result["predicted_smallest_oom"]["torch.naive"] == {"seq_len": 2048, "d_model": 16}
    out = capsys.readouterr().out
    assert "torch.naive: N=2048 d=16 (batch 2)" in out and "native.flash: none out of memory" in out


@pytest.mark.parametrize("skip", [True, False])
def test_larger_than_an_oom_configuration_is_skipped_unless_asked(monkeypatch, skip):
    tried = []

    def fake(spec, cap):
        tried.append((spec["kernel"], spec["seq"], spec["dim"]))
        if spec["kernel"] == "torch.naive" and spec["seq"] * spec["dim"] >= 2048 * 16:
            return {"status": "oom", "error": "MemoryError: fake"}
        return {"status": "ok", "error": "", "forward_ms": 1.0, "backward_ms": 2.0,
                "memory_before_backward_mib": 1.0, "peak_memory_mib": 2.0}

    monkeypatch.setattr(measuring, "measure_in_fresh_process", fake)
    cfg = model.Settings(batch=1, dims=[16, 32], seqs=[4096, 1024, 2048], kernels=["torch.naive", "native.flash"],
                         skip_larger=skip)
    rows = measuring.run_study(cfg)
    status = {(r["kernel"], r["seq_len"], r["d_model"]): r["status"] for r in rows}
    assert [(r["seq_len"], r["d_model"]) for r in rows][:4] == [(1024, 16), (1024, 16), (1024, 32), (1024, 32)]
    assert status[("torch.naive", 1024, 32)] == "oom" and status[("torch.naive", 2048, 16)] == "oom"
    assert status[("torch.naive", 2048, 32)] == status[("torch.naive", 4096, 32)] == ("skipped" if skip else "oom")
    assert status[("torch.naive", 4096, 16)] == ("skipped" if skip else "oom")
    assert all(s == "ok" for (k, _, _), s in status.items() if k == "native.flash")
    assert len(tried) == (12 - 3 if skip else 12)
    found = measuring.smallest_oom(rows)["torch.naive"]
    assert (found["seq_len"], found["d_model"]) == (1024, 32)
    skipped = [r for r in rows if r["status"] == "skipped"]
    assert all("larger than an OOM configuration" in r["error"] for r in skipped)


def test_account_bytes_by_hand():
    """B=2, H=1, N=64, d=16, float32: B*H*N*d*4 = 8192 bytes, B*H*N^2*4 = 32768."""
    nd, n2 = 2 * 64 * 16 * 4, 2 * 64 * 64 * 4
    acc = model.account("torch.naive", 2, 1, 64, 16)
    # after the forward: q, k, v, dout, out and P
    assert acc.before_backward == 5 * nd + n2 == 73728
    # forward peak: the scaled scores (naive_attention's local) beside P and out
    assert acc.peak("forward") == 5 * nd + 2 * n2 == 106496
    # backward peak: P, dP and dS beside q, k, v, dout, out and dv
    assert acc.peak("backward") == acc.peak() == 6 * nd + 3 * n2 == 147456
    assert acc.peak_stage().step.startswith("dS = P")
    assert acc.by_order(acc.peak_stage().live) == {1: 6 * nd, 2: 3 * n2}
    # on the GPU torch's softmax backward forms dP * P in a new tensor: one N^2 more
    gpu = model.account("torch.naive", 2, 1, 64, 16, device="cuda")
    assert gpu.before_backward == acc.before_backward and gpu.peak() == 6 * nd + 4 * n2 == 180224
    causal = model.account("torch.naive", 2, 1, 64, 16, causal=True)
    mask = 64 * 64  # bool, one for all batch entries and heads
    assert causal.before_backward == 5 * nd + n2 + mask
    assert causal.peak() == 6 * nd + 3 * n2 + mask
    assert causal.saved == ("mask", "P = softmax")
    # fused: out and the lse (B*H*N*4 = 512 bytes) saved, then dq, dk, dv and delta
    sdpa = model.account("torch.sdpa", 2, 1, 64, 16)
    assert sdpa.before_backward == 5 * nd + 512 and sdpa.peak() == 8 * nd + 2 * 512 == 66560
    assert model.account("torch.sdpa", 2, 1, 64, 16, device="cuda").terms["lse"].nbytes == 2 * 64 * 4
    assert model.account("torch.sdpa", 2, 1, 65, 16, device="cuda").terms["lse"].nbytes == 2 * 96 * 4
    # native.flash, one thread, 256 x 256 blocks: forward work 4 blocks of 256 x 16, the 256 x 256 scores, 3 x 256
    # rows; backward work 2 of 256 x 16, 2 of 256 x 256 (S, dP), 2 accumulators of 256 x 16, 3 x 256
    flash = model.account("native.flash", 2, 1, 64, 16, threads=1)
    # the forward computes scores a strip of 64 rows at a time (8 MR, MR = 8 on AVX-512)
    assert flash.terms["work buffers (forward)"].nbytes == (4 * 256 * 16 + 64 * 256 + 3 * 256) * 4 == 134144
    assert flash.terms["work buffers (backward)"].nbytes == (4 * 256 * 16 + 2 * 256 * 256 + 3 * 256) * 4 == 592896
    assert flash.peak() == 5 * nd + 512 + 2 * 512 + 592896 + 3 * nd == 659968
    # the scores grow as N^2, everything else as N
    big = model.account("torch.naive", 8, 1, 16384, 64)
    assert big.peak() == 3 * 8 * 16384**2 * 4 + 6 * 8 * 16384 * 64 * 4


@pytest.mark.parametrize("causal", [False, True])
def test_account_saves_what_autograd_saves(causal):
    """The account's saved terms are the bytes torch's autograd keeps for the
    backward beyond the inputs (saved_tensors_hooks, storages counted once)."""
    kernels = ["torch.naive", "torch.sdpa"] + (["native.flash"] if attnkern.kernel_info("native.flash")["available"]
                                               else [])
    for kernel in kernels:
        q, k, v = (torch.randn(2, 1, 64, 16, requires_grad=True) for _ in range(3))
        inputs = {x.untyped_storage().data_ptr() for x in (q, k, v)}
        storages = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in inputs:
                storages[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            measuring.attention_fn(kernel, "cpu", 1)(q, k, v, causal)
        acc = model.account(kernel, 2, 1, 64, 16, causal)
        assert sum(storages.values()) == acc.live_bytes(acc.saved), kernel


def test_backward_flops_convention():
    assert model.backward_flops(1, 8, 1024, 1024, 64) == 2.5 * 4 * 8 * 1024 * 1024 * 64
    assert model.backward_flops(1, 8, 1024, 1024, 64, causal=True) == 2.5 * 2 * 8 * 1024 * 1024 * 64


def test_smallest_oom_is_smallest_n_then_d():
    rows = [{"kernel": "a", "seq_len": n, "d_model": d, "status": s} for n, d, s in
            [(1024, 64, "ok"), (4096, 16, "oom"), (2048, 128, "oom"), (2048, 64, "oom"), (8192, 16, "skipped")]]
    rows.append({"kernel": "b", "seq_len": 1024, "d_model": 64, "status": "ok"})
    found = measuring.smallest_oom(rows)
    assert (found["a"]["seq_len"], found["a"]["d_model"]) == (2048, 64) and found["b"] is None


def test_is_oom_knows_the_allocators_words():
    assert measuring.is_oom(MemoryError())
    assert measuring.is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes"))
    assert measuring.is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not measuring.is_oom(ValueError("D=512 needs too much shared memory"))


def test_study_help_says_what_it_measures(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["study", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for words in ("forward", "out.backward(dout)", "before backward", "peak", "memory_allocated", "VmHWM",
                  "clear_refs", "median", "CUDA events", "wall clock", "d_model", "RLIMIT_AS counts virtual memory",
                  "check_finite=False", "2.5 times", "--no-skip-larger", "--account"):
        assert words in out, words


def test_study_refuses_unknown_and_skips_unfit_kernels(capsys, monkeypatch):
    with pytest.raises(SystemExit, match="unknown kernel"):
        cli.main(["study", "--kernels", "no.such"])
    # numpy.naive has no backward, cuda.flash runs on the GPU: both skipped, and then nothing is left
    with pytest.raises(SystemExit, match="no kernel to study"):
        cli.main(["study", "--kernels", "numpy.naive", "cuda.flash"])
    out = capsys.readouterr().out
    assert "skipping numpy.naive: has no backward pass" in out and "skipping cuda.flash: runs on cuda" in out
    for name in [m for m in sys.modules if m.startswith("matplotlib.")] + [
            "matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    with pytest.raises(SystemExit, match="--plots needs matplotlib"):
        cli.main(["study", "--plots", "somewhere", "--seqs", "32"])


@needs_flash
def test_study_runs_in_bfloat16_and_a_kernel_without_its_backward_forward_only(tmp_path, monkeypatch, capsys):
    """--dtype bfloat16 end to end on the CPU (the rows' processes make bfloat16 inputs);
    a kernel with no backward in the dtype (stood in for by native.flash with has_backward
    answering no) is measured forward only."""
    from attnkern_bench import study

    real = model.has_backward
    fake = lambda name, dtype: name != "native.flash" and real(name, dtype)  # noqa: E731
    monkeypatch.setattr(measuring, "has_backward", fake)
    monkeypatch.setattr(study, "has_backward", fake)
    js = tmp_path / "s.json"
    argv = ["study", "--dtype", "bfloat16", "--batch", "2", "--seqs", "32", "--dims", "16", "--iters", "1",
            "--warmup", "0", "--kernels", "torch.sdpa", "native.flash", "--json", str(js)]
    assert cli.main(argv) == 0
    result = json.loads(js.read_text())
    sdpa, flash = result["rows"]
    assert sdpa["dtype"] == flash["dtype"] == "bfloat16" and "bfloat16" in result["setup"]
    assert sdpa["status"] == "ok" and sdpa["backward_ms"] > 0 and sdpa["gflops"] > 0
    assert flash["status"] == "ok" and flash["forward_ms"] > 0 and flash["backward_ms"] is None
    assert flash["error"] == "forward only: no bfloat16 backward" and "gflops" not in flash
    assert "native.flash: forward only (no bfloat16 backward)" in capsys.readouterr().out
    # the account sizes half tensors at 2 bytes, torch.sdpa's lse and row sums at 4
    acc = model.account("torch.sdpa", 2, 1, 64, 16, dtype="bfloat16")
    assert acc.terms["q, k, v"].nbytes == 3 * 2 * 64 * 16 * 2 and acc.terms["lse"].nbytes == 2 * 64 * 4
    assert model.account("native.flash", 2, 1, 64, 16, dtype="float16").terms["lse"].nbytes == 2 * 64 * 2
