"""Forcing an instruction set that this CPU (or this build) lacks is refused,
both where Python chooses the ISA (ATTNKERN_ISA) and in the C entry point,
which runs nothing. Not a test module: tests/test_inputs.py runs
check_refusals() in its own process, where every ISA may be present (the
team's Xeon has all five), and `python isa_refusal.py` under Valgrind, whose
virtual CPU has no AVX-512, so avx512, avx512bf16 and amx are missing there on
every x86 machine."""

import os

import numpy as np

import attnkern
from attnkern.backends.native import _attn
from attnkern_bench.accuracy import scaled_error, tolerance


def check_refusals() -> list[str]:
    """Checks the refusal of every ISA of the build that cannot run here, and that
    the best one that can runs correctly; returns the ISAs refused."""
    q, k, v = (np.random.default_rng(i).standard_normal((2, 9, 8)).astype(np.float32) for i in range(3))
    refused = []
    for isa in _attn.ISAS:
        if _attn.isa_supported(isa):
            continue
        reason = _attn.isa_reason(isa)
        assert reason, f"{isa} is not supported here and has no reason"
        assert isa not in attnkern.supported_isas() and attnkern.active_isa() != isa
        os.environ["ATTNKERN_ISA"] = isa
        try:
            attnkern.attention(q, k, v, kernel="native.flash")
        except RuntimeError as exc:
            expected = f"ATTNKERN_ISA={isa!r}: not supported by this build or CPU: {reason}"
            assert str(exc) == expected, f"{exc!s} is not {expected!r}"
        else:
            raise AssertionError(f"ATTNKERN_ISA={isa} ran on a CPU without it")
        finally:
            del os.environ["ATTNKERN_ISA"]
        # the C entry point, asked directly, refuses before touching the output
        out = np.full((2, 9, 8), np.nan, np.float32)
        try:
            _attn.forward("flash", isa, q, k, v, out, False, 0.5, 8, 8, 1)
        except RuntimeError as exc:
            expected = f"native.flash: instruction set {isa!r} is not supported on this CPU"
            assert str(exc) == expected, f"{exc!s} is not {expected!r}"
        else:
            raise AssertionError(f"_attn.forward ran {isa} on a CPU without it")
        assert np.isnan(out).all(), f"_attn.forward wrote its output on {isa} while refusing it"
        assert _attn.check_problem("flash", isa, 2, 9, 9, 8, 8) == "isa"
        refused.append(isa)
    out = attnkern.attention(q, k, v, kernel="native.flash")  # the best ISA here
    assert scaled_error(out, q, k, v) <= tolerance(out.dtype), f"native.flash on {attnkern.active_isa()}"
    return refused


if __name__ == "__main__":
    refused = check_refusals()
    print("refused:", *refused)
    print("supported:", *attnkern.supported_isas())
