"""attnkern roofline: the byte model by hand, the ceilings' C loops, the command end to end."""

import json
import os

import numpy as np
import pytest

from attnkern.backends.native import _attn
from attnkern_bench import cli, counts


def test_byte_model_by_hand():
    b, h, n, d, item = 1, 2, 1000, 64, 4
    io = b * h * 4 * n * d * item
    assert counts.io_bytes(b, h, n, n, d, item) == io
    assert counts.attention_bytes("native.naive", b, h, n, n, d, item) == io + 1 * b * h * n * n * item
    assert counts.attention_bytes("cuda.naive", b, h, n, n, d, item) == io + 4 * b * h * n * n * item
    assert counts.attention_bytes("numpy.naive", b, h, n, n, d, item, causal=True) == io + 6 * b * h * n * n * item
    assert counts.attention_bytes("torch.naive", b, h, n, n, d, item) == io + 6 * b * h * n * n * item
    # flash: K and V re-read by each query block after the first: ceil(1000 / 256) = 4 blocks
    assert counts.attention_bytes("native.flash", b, h, n, n, d, item) == io + 3 * b * h * n * 2 * d * item
    assert counts.attention_bytes("native.flash", b, h, n, n, d, item, block_q=1024) == io
    with pytest.raises(ValueError, match="no memory model"):
        counts.attention_bytes("no.such", b, h, n, n, d, item)


def test_fma_peak_and_stream_loops():
    seconds, flops = _attn.fma_peak("generic", 1000, 1)
    assert seconds > 0 and flops == 2 * 8 * 12 * 1000
    a, b, c = np.zeros(1000, np.float32), np.arange(1000, dtype=np.float32), np.ones(1000, np.float32)
    assert _attn.stream("triad", a, b, c, 2) >= 0
    np.testing.assert_array_equal(a, b + 3)
    _attn.stream("copy", a, b, c, 1)
    np.testing.assert_array_equal(a, b)
    # read: each thread's sum of its share of b in a[thread] (1001 elements: shares not multiples of 64)
    b = np.arange(1001, dtype=np.float32)
    a, c = np.zeros_like(b), np.zeros_like(b)
    for threads in (1, 2, 3):
        assert _attn.stream("read", a, b, c, threads) >= 0
        assert a[:threads].sum() == b.sum(), threads  # integers below 2^24: exact in float32
    with pytest.raises(ValueError, match="'copy', 'triad' or 'read'"):
        _attn.stream("write", a, b, c, 1)
    with pytest.raises(ValueError, match="one length"):
        _attn.stream("copy", a[:10], b, c, 1)
    with pytest.raises(ValueError, match="isa must be one of"):
        _attn.fma_peak("sse", 10, 1)


def test_roofline_command(tmp_path, capsys):
    out, png = tmp_path / "roof.json", tmp_path / "roof.png"
    argv = ["roofline", "--sizes", "64", "--heads", "1", "--repeat", "1", "--causal", "no",
            "--kernels", "native.flash", "numpy.naive", "--json", str(out), "--plot", str(png), "--stream-mib", "64"]
    assert cli.main(argv) == 0
    data = json.loads(out.read_text())
    c = data["ceilings"]
    assert c["fma_peak_gflops"] > 0 and c["triad_gbs"] > 0 and c["sgemm_gflops"] > 0
    assert {p["kernel"] for p in data["points"]} == {"native.flash", "numpy.naive"}
    for p in data["points"]:
        assert p["intensity"] == pytest.approx(p["gflops"] * 1e9 * p["median_s"] / p["bytes"])
        assert p["attainable_gflops"] == pytest.approx(min(c["peak_gflops"], p["intensity"] * c["bandwidth_gbs"]))
    assert png.stat().st_size > 10_000
    assert "ridge at" in capsys.readouterr().out


def test_roofline_refuses_absurd_sizes():
    with pytest.raises(SystemExit, match="at least 1"):
        cli.main(["roofline", "--stream-mib", "0"])
    with pytest.raises(SystemExit, match="at least 1"):
        cli.main(["roofline", "--device", "cuda", "--decode", "--decode-nk", "0"])
    for extra in (["--dtype", "bfloat16"], ["--decode"]):  # GPU options: refused on the CPU, not ignored
        with pytest.raises(SystemExit, match="are for --device cuda"):
            cli.main(["roofline", *extra])


@pytest.mark.skipif(not os.environ.get("ATTNKERN_TEST_GPU"), reason="needs a CUDA GPU (ATTNKERN_TEST_GPU=1)")
def test_roofline_on_the_gpu_in_bfloat16_with_decode(tmp_path):
    """--device cuda --dtype bfloat16: the ceilings of the dtype (torch's bfloat16 matmul, the
    datasheet's tensor-core peak where the GPU is listed), the half kernels placed against them, and
    --decode's points by bandwidth, each checked against float64."""
    from attnkern_bench import roofline

    out = tmp_path / "roof.json"
    argv = ["roofline", "--device", "cuda", "--dtype", "bfloat16", "--sizes", "1024", "--causal", "no",
            "--repeat", "2", "--kernels", "cuda.flash", "torch.sdpa[cudnn]", "--decode", "--decode-nk", "4096",
            "--decode-batches", "1", "--json", str(out)]
    assert cli.main(argv) == 0
    data = json.loads(out.read_text())
    c = data["ceilings"]
    assert c["dtype"] == "bfloat16" and c["matmul_gflops"] > 10 * 67_000 / 2
    if c["gpu"] in roofline.DATASHEET:
        assert c["peak_gflops"] == roofline.DATASHEET[c["gpu"]]["bfloat16_gflops"]
    assert {p["kernel"] for p in data["points"]} == {"cuda.flash", "torch.sdpa[cudnn]"}
    assert {p["kernel"] for p in data["decode"]} == {"cuda.flash", "torch.sdpa[cudnn]"}
    for p in data["decode"]:
        assert p["ok"] and p["bytes"] == (2 * 8 * 4096 * 128 + 2 * 32 * 128) * 2
        assert 0 < p["fraction"] == pytest.approx(p["gbs"] / c["bandwidth_gbs"])


def test_the_matmul_ceiling_runs_openblas_strongest_kernel(monkeypatch):
    """Where NumPy's OpenBLAS chose a kernel without AVX-512 on a CPU that has it, the
    ceiling's matmul runs in a worker with OpenBLAS's AVX-512 kernel; the worker reports
    the kernel that ran."""
    import attnkern
    from attnkern_bench import ceilings

    if not ceilings.blas_kernel().startswith("OpenBLAS"):
        pytest.skip("NumPy's BLAS here is not OpenBLAS")
    monkeypatch.delenv("ATTNKERN_SGEMM_CORETYPE", raising=False)
    monkeypatch.setattr(ceilings, "blas_kernel", lambda: "OpenBLAS 0.3.31 Haswell")
    monkeypatch.setattr(attnkern, "supported_isas", lambda: ("generic", "avx2", "avx512"))
    assert ceilings.openblas_override() == "SkylakeX"
    monkeypatch.setattr(attnkern, "supported_isas", lambda: ("generic", "avx2"))
    assert ceilings.openblas_override() is None
    monkeypatch.setattr(ceilings, "blas_kernel", lambda: "OpenBLAS 0.3.31 SkylakeX")
    monkeypatch.setattr(attnkern, "supported_isas", lambda: ("generic", "avx2", "avx512"))
    assert ceilings.openblas_override() is None
    monkeypatch.undo()

    # a kernel every x86-64 CPU with AVX2 runs, forced: the worker runs it and says so
    monkeypatch.setenv("ATTNKERN_SGEMM_CORETYPE", "Haswell")
    flops, call, label = ceilings.sgemm_turn(64, 1)
    assert isinstance(call, ceilings.SgemmWorker) and flops == 2.0 * 64**3
    assert call.architecture == "Haswell" and "OpenBLAS Haswell in a worker process" in label
    call()
    call()
    assert "this process's OpenBLAS chose" in label
    monkeypatch.setenv("ATTNKERN_SGEMM_CORETYPE", "")  # OpenBLAS's own choice, in the worker too
    flops, call, label = ceilings.sgemm_turn(64, 1)
    assert isinstance(call, ceilings.SgemmWorker) and call.architecture and "chose" not in label
