"""The fuzz target runs, and every input of its committed corpus passes (among
them the inputs of past findings): a replay, not a fuzzing run (`make fuzz`)."""

import subprocess
import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).resolve().parent / "fuzz"


def test_corpus_replays_clean(tmp_path):
    pytest.importorskip("atheris")
    inputs = sorted((FUZZ / "corpus").iterdir())
    assert len(inputs) >= 2
    # libFuzzer given files instead of directories runs each once
    proc = subprocess.run([sys.executable, str(FUZZ / "fuzz_attention.py"), *map(str, inputs)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.count("Executed ") == len(inputs), proc.stderr[-3000:]
