"""The avx512-counted signal (tools/avx512_count.py): native.flash's AVX-512 code run
natively in a harness built with -fsanitize-coverage=trace-pc, its blocks weighted
by their instructions. Builds two harnesses (this tree's sources and a copy with the
calibration's AVX-512-only slowdown), in parallel: about 30 s."""

import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import avx512_count  # noqa: E402
import calibrate_gate  # noqa: E402
import gate  # noqa: E402

NATIVE = REPO / avx512_count.NATIVE
WHY = avx512_count.missing()
needs_avx512 = pytest.mark.skipif(WHY is not None, reason=WHY or "")
FORWARD = [("forward", "1x2x256x64", False), ("forward", "1x2x333x64", True)]
BACKWARD = [("backward", "1x2x256x64", False)]


def copy_with_slowdown(dest: Path, fmas: int | None) -> Path:
    """The native sources copied to dest, with `fmas` extra FMAs in attn_avx512.c's 2^x."""
    shutil.copytree(NATIVE, dest, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    if fmas is not None:
        path = dest / Path(calibrate_gate.AVX512_INJECT_FILE).name
        path.write_text(calibrate_gate.inject_avx512_slowdown(path.read_text(), fmas))
    return dest


@pytest.fixture(scope="module")
def harnesses(tmp_path_factory):
    """{"base": harness of this tree, "slow": harness with the 2% level injected}."""
    tmp = tmp_path_factory.mktemp("avx512count")
    trees = {"base": copy_with_slowdown(tmp / "base" / "src", None),
             "slow": copy_with_slowdown(tmp / "slow" / "src", calibrate_gate.AVX512_FMAS_FOR_LEVEL[2])}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(avx512_count.build, src, src.parent / "build") for name, src in trees.items()}
        return {name: f.result() for name, f in futures.items()}


@needs_avx512
def test_count_is_deterministic(harnesses):
    first = avx512_count.count(harnesses["base"], FORWARD + BACKWARD)
    again = avx512_count.count(harnesses["base"], FORWARD + BACKWARD)
    assert first == again
    for key, c in first.items():
        # the harness's hook was hit, and blocks weigh several instructions each
        assert c["blocks"] > 1000 and c["instructions"] > 5 * c["blocks"], (key, c)
    # more OpenMP threads: the same rows, a little more scheduling code per thread
    two = avx512_count.count(harnesses["base"], FORWARD, threads=2)
    for key in two:
        assert two[key]["instructions"] == pytest.approx(first[key]["instructions"], rel=1e-3)


@needs_avx512
def test_weights_cover_every_counted_block(harnesses):
    weights = avx512_count.block_weights(harnesses["base"])
    objdump = subprocess.run(["objdump", "-d", str(harnesses["base"])], capture_output=True, text=True,
                             check=True).stdout
    sites = sum(1 for line in objdump.splitlines() if "call" in line and f"<{avx512_count.HOOK}>" in line)
    # one weight per call site of the hook (plus weight 1 for returns after other calls)
    assert sites >= 1000 and len(weights) >= sites and all(w >= 0 for w in weights.values())
    hits = avx512_count.run_config(harnesses["base"], *FORWARD[0])
    low, high = min(weights), max(weights)
    assert all(a in weights or not low <= a <= high for a in hits)


@needs_avx512
def test_an_avx512_only_slowdown_raises_the_count(harnesses):
    base = avx512_count.count(harnesses["base"], FORWARD + BACKWARD)
    slow = avx512_count.count(harnesses["slow"], FORWARD + BACKWARD)
    rows = avx512_count.rows({"baseline": base, "candidate": slow}, 0.01)
    ratios = {r["benchmark"]: r["ratio"] for r in rows}
    # the 2% level: about +2% on the forward (its 2^x is a larger share there) ...
    for kind, shape, causal in FORWARD:
        key = avx512_count.config_key(kind, shape, causal)
        assert 1.015 < ratios[key] < 1.03, ratios
        assert next(r for r in rows if r["benchmark"] == key)["verdict"] == "slower"
    # ... and more instructions on the backward, fewer than on the forward (2^x is a smaller share
    # of it): about +1.2%, where the backward's 2^x runs in a rolled loop over the rows of Sᵀ's
    # register tile (its epilogue), around which the injected FMAs stay a loop of their own
    key = avx512_count.config_key(*BACKWARD[0])
    assert 1.0 < ratios[key] < 1.02, ratios


def test_the_avx2_path_does_not_see_it(tmp_path):
    """The Valgrind-counted AVX2 path compiles to the same code with and without the
    injection: attn_avx2.c, preprocessed, is identical (it never includes attn_avx512.c),
    while attn_avx512.c's differs."""
    if shutil.which("gcc") is None:
        pytest.skip("no gcc")
    trees = {name: copy_with_slowdown(tmp_path / name, fmas)
             for name, fmas in (("base", None), ("slow", calibrate_gate.AVX512_FMAS_FOR_LEVEL[2]))}

    def preprocessed(tree, unit, flags):
        return subprocess.run(["gcc", "-E", "-P", "-fopenmp", *flags, str(tree / unit)], capture_output=True,
                              text=True, check=True).stdout

    avx2 = ["-mavx2", "-mfma", "-mf16c"]
    assert preprocessed(trees["base"], "attn_avx2.c", avx2) == preprocessed(trees["slow"], "attn_avx2.c", avx2)
    assert (preprocessed(trees["base"], "attn_avx512.c", avx512_count.AVX512_FLAGS)
            != preprocessed(trees["slow"], "attn_avx512.c", avx512_count.AVX512_FLAGS))


def test_injection_refuses_moved_source():
    with pytest.raises(ValueError, match="moved"):
        calibrate_gate.inject_avx512_slowdown("no such line\n", 3)


def test_skipped_without_avx512(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(avx512_count, "missing", lambda: "this CPU has no AVX-512F")
    assert avx512_count.main(["--base", "HEAD", "--json", str(tmp_path / "out.json")]) == 0
    assert "skipped: this CPU has no AVX-512F" in capsys.readouterr().out
    assert "no AVX-512F" in (tmp_path / "out.json").read_text()
    # the gate's table: one skipped row saying why
    args = gate.parse_args(["--base", "HEAD", "-b", "native.flash"])
    rows = gate.count_avx512(REPO, {"baseline": "a", "candidate": "b"}, {"baseline": "a", "candidate": "b"},
                             None, args, print)
    assert [r["verdict"] for r in rows] == ["skipped"] and "AVX-512F" in rows[0]["note"]


def test_gate_needs_commits_for_it(monkeypatch):
    monkeypatch.setattr(avx512_count, "missing", lambda: None)
    args = gate.parse_args(["--base-site", "/x", "--head", "HEAD"])
    rows = gate.count_avx512(REPO, {"candidate": "b"}, {"baseline": "site /x", "candidate": "b"}, None, args, print)
    assert rows[0]["verdict"] == "skipped" and "commits" in rows[0]["note"]
    # no native.flash compared: no row at all
    args = gate.parse_args(["--base", "main", "--kernels", "numpy.naive"])
    assert gate.count_avx512(REPO, {}, {}, None, args, print) == []
