"""The fastmath tunable: cuda.flash's CUDA C++ kernels compiled with the hardware's
approximations (ATTNKERN_FAST), numba.flash with all of LLVM's fast-math flags;
off by default, validated as a switch, listed by kernel_info, and chosen by the
tuner only under an error bound the caller gives (attnkern.tuning)."""

import os

import numpy as np
import pytest

import attnkern
from attnkern import tuning
from conftest import assert_lse_matches_reference, assert_matches_reference, random_qkv

SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


@pytest.mark.parametrize("kernel", ["cuda.flash", "numba.flash"])
def test_kernel_info_lists_the_switch_off_by_default(kernel):
    p = attnkern.kernel_info(kernel)["params"]["fastmath"]
    assert p["default"] == 0 and p["choices"] == [0, 1] and p["switch"] is True
    assert "approximat" in p["doc"]


@pytest.mark.parametrize("kernel", ["numba.flash", "cuda.flash"])
def test_fastmath_takes_bools_and_0_1_only(kernel):
    q, k, v = random_qkv(np.random.default_rng(0), (1,), 9, 9, 8, 8, np.float32)
    for bad, error, words in ((2, ValueError, "fastmath=2 is not allowed; choose one of 0, 1"),
                              (-1, ValueError, "fastmath=-1 is not allowed"),
                              (1.0, TypeError, "fastmath must be True/False or 0/1, got 1.0 of type float"),
                              ("1", TypeError, "fastmath must be True/False or 0/1, got '1' of type str"),
                              (None, TypeError, "fastmath must be True/False or 0/1")):
        with pytest.raises(error, match=words):
            attnkern.attention(q, k, v, kernel=kernel, fastmath=bad)
    # a switch's bool and its integer are the same setting, bit for bit (each simulated
    # cuda.flash call costs seconds: three values a side there)
    offs, ons = ((0, False, np.bool_(False)), (1, True, np.int64(1)))
    if kernel == "cuda.flash":
        offs, ons = offs[1:], ons[1:]
    for values in (offs, ons):
        outs = [attnkern.attention(q, k, v, kernel=kernel, fastmath=value) for value in values]
        assert_matches_reference(outs[0], q, k, v)
        assert all(np.array_equal(outs[0], out) for out in outs[1:])


def test_other_tunables_still_refuse_bools():
    q = np.ones((1, 4, 4), np.float32)
    with pytest.raises(TypeError, match="block_q must be an integer"):
        attnkern.attention(q, q, q, kernel="numba.flash", block_q=True)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_numba_flash_both_variants_match_the_reference(dtype, causal):
    """Fresh random inputs, several blocks and partial ones; each variant deterministic
    for every thread count."""
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, (2,), 77, 93, 24, 16, dtype)
    for fastmath in (0, 1):
        out, lse = attnkern.attention(q, k, v, causal=causal, kernel="numba.flash", fastmath=fastmath,
                                      block_q=16, block_k=32, return_lse=True)
        assert_matches_reference(out, q, k, v, causal=causal)
        assert_lse_matches_reference(lse, q, k, causal=causal)
        again = attnkern.attention(q, k, v, causal=causal, kernel="numba.flash", fastmath=fastmath, block_q=16,
                                   block_k=32, num_threads=1)
        assert np.array_equal(out, again)


def test_numba_variants_are_two_cached_functions():
    """fastmath=1 runs its own compiled function, cached under its own name (Numba keys
    its disk cache by the function's qualified name)."""
    from attnkern.backends.numba import flash

    assert flash.flash_forward.py_func.__qualname__ == "flash_forward"
    assert flash.flash_forward_fast.py_func.__qualname__ == "flash_forward_fast"
    assert flash.flash_forward.targetoptions["fastmath"] == {"contract", "reassoc"}
    assert flash.flash_forward_fast.targetoptions["fastmath"] is True


# ---------------------------------------------------------------- the tuner


LATTICE_KERNEL = "numba.flash"


def landscape(params):
    """fastmath 20% faster; otherwise the default (256 x 512, 2 threads) is best."""
    base = 1e-3 * (1 + 0.1 * abs(np.log2(params["block_q"] / 256)) + 0.1 * abs(np.log2(params["block_k"] / 512)))
    return base * (0.8 if params.get("fastmath") else 1.0) * (1 if params["num_threads"] == 2 else 2)


def measure(params, n):
    measure.seen.append(dict(params))
    return [landscape(params)] * n


def counted_error(value):
    def error(params):
        assert params["fastmath"] == 1, "only fastmath configurations need their error measured"
        error.calls += 1
        return value

    error.calls = 0
    return error


def tune(**kw):
    measure.seen = []
    return tuning.tune((1, 2, 64, 16), kernel=LATTICE_KERNEL, budget=20, cache=False, measure=measure,
                       repeats=2, **kw)


def test_the_tuner_never_chooses_fastmath_without_a_bound():
    result = tune()
    assert "fastmath" not in result.params
    assert all("fastmath" not in p for p in measure.seen)
    assert "max_error" not in result.problem
    assert "fastmath" not in tuning.space(LATTICE_KERNEL, 64, 64, 16, 16, 4)


def test_the_tuner_chooses_fastmath_within_the_bound():
    error = counted_error(3e-7)
    result = tune(max_error=1e-6, error=error)
    assert result.params["fastmath"] == 1
    assert result.default["fastmath"] == 0
    assert error.calls >= 1
    assert result.problem["max_error"] == 1e-6
    assert all(e["error"] == 3e-7 and e["params"]["fastmath"] == 1 for e in result.problem["fastmath_errors"])


def test_the_tuner_refuses_fastmath_over_the_bound():
    error = counted_error(3e-6)
    result = tune(max_error=1e-6, error=error)
    assert result.params["fastmath"] == 0
    assert error.calls >= 1
    # fastmath configurations over the bound are never timed
    assert all(p["fastmath"] == 0 for p in measure.seen)


@pytest.mark.parametrize("bad", [0, -1e-6, float("inf"), float("nan"), "1e-6", True])
def test_max_error_is_validated(bad):
    with pytest.raises(ValueError, match="max_error must be a positive finite number"):
        tune(max_error=bad, error=counted_error(0.0))


def test_live_error_measures_against_float64():
    error = tuning.live_error("numba.flash", (1, 2, 40, 8), seed=3)
    value = error({"fastmath": 1})
    assert 0 < value < 1e-5
    assert error({"fastmath": 0}) < 1e-5


def test_tune_command_takes_max_error(capsys, tmp_path):
    from attnkern_bench import cli

    out = tmp_path / "r.json"
    assert cli.main(["tune", "--kernel", "numba.flash", "--shape", "1x1x32x8", "--budget", "6", "--repeats", "2",
                     "--no-cache", "--max-error", "1e-3", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    import json

    result = json.loads(out.read_text())
    assert result["problem"]["max_error"] == 1e-3
    if result["problem"]["fastmath_errors"]:
        assert "# fastmath error" in text


# ---------------------------------------------------------------- cuda.flash's CUDA C++ variants (a GPU)


def _compiled_names(monkeypatch):
    from attnkern.backends.cuda import cpp

    names = []
    real = cpp._linked_kernel.__wrapped__

    def noting(source, name, *args):
        names.append(name)
        return real(source, name, *args)

    cached = __import__("functools").cache(noting)
    monkeypatch.setattr(cpp, "_linked_kernel", cached)
    return names


@pytest.mark.skipif(SIMULATED, reason="the CUDA C++ kernels need a GPU")
@pytest.mark.parametrize("dtype,d,tensor_cores", [("float32", 64, 1), ("float32", 36, 1), ("float16", 64, 1),
                                                  ("bfloat16", 32, 1)])
def test_cuda_flash_variants_on_the_gpu(dtype, d, tensor_cores, monkeypatch):
    """Each CUDA C++ kernel (3xTF32 at D = 64, FMAs at D = 36, wgmma at D = 64 on
    Hopper, mma.sync at D = 32) in both variants: the variant compiled is the one asked for (its name
    ends in _fm), against float64 with lse, causal and not, with a softcap (the
    featured variant), bit-identical run to run, and the torch fast path gives the
    general path's bits."""
    import torch

    from attnkern.backends import cuda as cuda_backend

    names = _compiled_names(monkeypatch)
    rng = np.random.default_rng(d)
    q, k, v = random_qkv(rng, (2, 3), 150, 131, d, d, np.float32)
    tq, tk, tv = (torch.from_numpy(x).cuda().to(getattr(torch, dtype)) for x in (q, k, v))
    host = [t.float().cpu().numpy() for t in (tq, tk, tv)]  # the inputs as rounded to dtype
    for fastmath in (0, 1):
        names.clear()  # the kernels this variant's calls compile (causal is an argument: compiled once)
        for causal in (False, True):
            # the featured variant (a softcap) once, in the fastmath variant: each compile costs seconds
            for extra in ({}, {"softcap": 20.0}) if fastmath else ({},):
                kw = dict(causal=causal, kernel="cuda.flash", fastmath=fastmath, return_lse=True, **extra)
                if dtype == "float32":
                    kw["tensor_cores"] = tensor_cores
                out, lse = attnkern.attention(tq, tk, tv, **kw)
                assert names and all(n.endswith("_fm") == bool(fastmath) for n in names), names
                again, lse_again = attnkern.attention(tq, tk, tv, **kw)
                assert torch.equal(out, again) and torch.equal(lse, lse_again)
                got = out.float().cpu().numpy()
                ref = attnkern.reference(*host, causal=causal, **extra)
                err = np.abs(got - ref).max()
                tol = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}[dtype]
                assert err <= tol, (fastmath, causal, extra, err)
                if not extra:
                    cuda_backend.FAST_PATH = False
                    try:
                        general = attnkern.attention(tq, tk, tv, **kw)
                    finally:
                        cuda_backend.FAST_PATH = True
                    assert torch.equal(out, general[0])


@pytest.mark.skipif(SIMULATED, reason="the CUDA C++ kernels need a GPU")
def test_cuda_flash_fastmath_on_numpy_inputs():
    q, k, v = random_qkv(np.random.default_rng(3), (4,), 200, 200, 64, 64, np.float32)
    for fastmath in (0, 1):
        out, lse = attnkern.attention(q, k, v, kernel="cuda.flash", fastmath=fastmath, return_lse=True)
        assert_matches_reference(out, q, k, v)
        assert_lse_matches_reference(lse, q, k)
