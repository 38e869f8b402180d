"""The fuzz target runs, and every input of its committed corpus passes (among
them the inputs of past findings): a replay, not a fuzzing run (`make fuzz`).
And what the target counts as a finding: an undocumented exception, or a
documented one with another message or in the wrong circumstances."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import attnkern

FUZZ = Path(__file__).resolve().parent / "fuzz"
INPUTS = sorted((FUZZ / "corpus").iterdir())


def test_corpus_replays_clean(tmp_path):
    assert len(INPUTS) >= 2
    # libFuzzer given files instead of directories runs each once
    proc = subprocess.run([sys.executable, str(FUZZ / "fuzz_attention.py"), *map(str, INPUTS)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.count("Executed ") == len(INPUTS), proc.stderr[-3000:]


@pytest.fixture(scope="module")
def target():
    """tests/fuzz/fuzz_attention.py imported here (attnkern is already imported, so
    Atheris instruments nothing: this is about the checks, not coverage)."""
    spec = importlib.util.spec_from_file_location("fuzz_attention", FUZZ / "fuzz_attention.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_test_one_input_runs_every_corpus_file_in_process(target):
    for path in INPUTS:
        target.test_one_input(path.read_bytes())


@pytest.mark.parametrize("exc, check, expected", [
    (ValueError("q has dtype int32; attnkern supports float32"), True, False),  # a TypeError's message
    (TypeError("q has dtype int32; attnkern supports float32, ..."), True, True),
    (ValueError("k and v must have the same sequence length, got k (3, 4) and v (2, 4)"), False, True),
    (ValueError("cannot reshape array of size 12 into shape (5,)"), True, False),  # NumPy's, not ours
    (ValueError("native.flash: invalid arguments (error 2)"), True, False),  # validation missed it
    (ValueError("q contains NaN or infinity; pass finite values (or check_finite=False)"), True, True),
    (ValueError("q contains NaN or infinity; pass finite values (or check_finite=False)"), False, False),
    (FloatingPointError("native.flash produced non-finite values: q k^T * scale overflows float32; ..."),
     True, True),
    (FloatingPointError("native.flash produced non-finite values: q k^T * scale overflows float32; ..."),
     False, False),
    (RuntimeError("kernel native.flash is not available here: no reason"), True, False),  # it is available
    (RuntimeError("native.flash: instruction set 'avx512' is not supported on this CPU"), True, False),
    (MemoryError("native.naive: out of memory for its work buffers"), True, True),
    (KeyError("block_q"), True, False),
])
def test_only_documented_errors_with_their_messages_are_expected(target, exc, check, expected):
    assert bool(target.documented(exc, "native.flash", check)) is expected


def test_an_undocumented_error_is_a_finding(target, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("something inside went wrong")

    monkeypatch.setattr(attnkern, "attention", broken)
    with pytest.raises(RuntimeError, match="something inside went wrong"):
        for path in INPUTS:  # the inputs that reach attention() re-raise
            target.test_one_input(path.read_bytes())


def test_half_precision_results_are_checked(target):
    """A float16/bfloat16 result off the reference by 64 times the tests' bound (the fuzz
    target allows 4 kappa times it, kappa about 2 here) is a finding; until the target
    checked the half dtypes, any result passed."""
    rng = np.random.default_rng(0)
    for dtype in (np.float16, ml_dtypes.bfloat16):
        q, k, v = (rng.standard_normal((2, 9, 8)).astype(dtype) for _ in range(3))
        out = attnkern.attention(q, k, v, kernel="native.flash")
        bound = target.kernel_tolerance("native.flash", out.dtype)
        target.check_against_reference(out, q, k, v, False, None, bound)
        off = (out.astype(np.float64) + 64 * bound * np.abs(v.astype(np.float64)).max()).astype(dtype)
        with pytest.raises(AssertionError, match="error .* > bound"):
            target.check_against_reference(off, q, k, v, False, None, bound)
