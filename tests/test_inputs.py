"""Bad input gets a clear exception; unusual but valid input gets a correct result."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import attnkern
import isa_refusal
from attnkern.backends.native import _attn
from conftest import AVAILABLE, ISAS, NATIVE, assert_matches_reference, forced_isa, random_qkv

rng = np.random.default_rng(5)
Q, K, V = random_qkv(rng, (2,), 9, 11, 8, 4, np.float32)


def _with(**changes):
    args = {"q": Q, "k": K, "v": V}
    args.update(changes)
    return args


BAD_ARRAYS = [
    (_with(q=Q[0, 0]), ValueError, "q has 1 dimension"),
    (_with(q=Q[None, None], k=K[None, None], v=V[None, None]), ValueError, "expected 2 to 4"),
    (_with(k=K[..., :7]), ValueError, "same feature size D"),
    (_with(v=V[:, :10]), ValueError, "same sequence length"),
    (_with(q=np.concatenate([Q, Q[:1]])), ValueError, "multiple of the k/v heads"),  # 3 query heads, 2 k/v
    (_with(q=Q[None], k=np.stack([K, K]), v=np.stack([V, V])), ValueError, "same leading"),  # batch 1 and 2
    (_with(q=Q.astype(np.int64)), TypeError, "dtype int64"),
    (_with(q=Q.astype(np.float16), k=K.astype(np.float16), v=V.astype(np.float16)), TypeError, "float16"),
    (_with(k=K.astype(np.float64)), TypeError, "share one dtype"),
    (_with(k=K[:, :0], v=V[:, :0]), ValueError, "no keys"),
    (_with(q=Q[..., :0], k=K[..., :0]), ValueError, "feature size D of q and k is 0"),
    (_with(q=np.where(np.arange(8) == 3, np.nan, Q).astype(np.float32)), ValueError, "q contains NaN"),
    (_with(v=np.full_like(V, np.inf)), ValueError, "v contains NaN or infinity"),
    (_with(q=[[1.0, 2.0], [3.0]]), TypeError, "cannot be converted|ragged"),
    (_with(q="not an array"), TypeError, "dtype <U12"),
]


@pytest.mark.parametrize("kernel", AVAILABLE)
@pytest.mark.parametrize("args,exc,message", BAD_ARRAYS)
def test_bad_arrays(kernel, args, exc, message):
    if message == "float16" and "float16" in attnkern.kernel_info(kernel)["dtypes"]:
        # it takes float16: no error, and a result within its bound (tests/test_half.py
        # checks every path; this is the same call as the refusals of the others)
        out = attnkern.attention(**args, kernel=kernel)
        assert_matches_reference(out, args["q"], args["k"], args["v"], kernel=kernel)
        return
    with pytest.raises(exc, match=message):
        attnkern.attention(**args, kernel=kernel)


@pytest.mark.parametrize(
    "kwargs,exc,message",
    [
        ({"scale": float("nan")}, ValueError, "scale must be finite"),
        ({"scale": "big"}, TypeError, "scale must be a real number"),
        ({"causal": "yes"}, ValueError, "causal must be False, True .* or 'bottom_right'"),
        ({"causal": 1}, TypeError, "causal must be False, True, 'top_left' or 'bottom_right'"),
        ({"kernel": "cuda.warp9"}, ValueError, "unknown kernel 'cuda.warp9'; choose 'auto' or one of: native.naive"),
        ({"kernel": "native.flash", "block_q": 0}, ValueError, re.escape("1 <= block_q <= 1024")),
        ({"kernel": "native.flash", "block_q": 10**6}, ValueError, "block_q=1000000 is out of range"),
        ({"kernel": "native.tiled", "block_k": -1}, ValueError, re.escape("1 <= block_k <= 4096")),
        ({"kernel": "native.flash", "num_threads": 0}, ValueError, "num_threads=0 is out of range"),
        ({"kernel": "native.flash", "num_threads": 10**5}, ValueError, "num_threads=100000 is out of range"),
        ({"kernel": "native.flash", "block_q": 3.5}, TypeError, "block_q must be an integer"),
        ({"kernel": "native.flash", "block_q": True}, TypeError, "block_q must be an integer"),
        ({"kernel": "native.flash", "tile": 4}, TypeError, "does not take 'tile'; it takes block_q, block_k, num_threads"),
        ({"kernel": "native.naive", "block_q": 4}, TypeError, "does not take 'block_q'; it takes num_threads"),
        ({"kernel": "numpy.naive", "num_threads": 2}, TypeError, "it takes no tunable parameters"),
    ],
)
def test_bad_arguments(kwargs, exc, message):
    with pytest.raises(exc, match=message):
        attnkern.attention(Q, K, V, **kwargs)


def test_forced_isa_errors():
    with forced_isa("sse9"), pytest.raises(ValueError, match="ATTNKERN_ISA='sse9' is not one of"):
        attnkern.attention(Q, K, V, kernel="native.flash")


def test_isas_missing_here_are_refused():
    """Every ISA of the build this CPU cannot run (amx on the team's EPYC; none on its
    Xeon, which has all five: the Valgrind test below covers that machine) is refused
    by ATTNKERN_ISA and by the C entry point (tests/isa_refusal.py)."""
    refused = isa_refusal.check_refusals()
    assert refused == [i for i in _attn.ISAS if i not in attnkern.supported_isas()]


@pytest.mark.skipif("asan" in os.environ.get("LD_PRELOAD", ""),
                    reason="Valgrind cannot run a process with AddressSanitizer's runtime (make test-sanitize)")
def test_isas_the_cpu_lacks_are_refused_under_valgrind():
    """The refusal on a CPU that really lacks AVX-512: Valgrind's virtual CPU (it
    emulates x86 up to AVX2, and its CPUID says so), on every machine the team has.
    The CPU-feature checks run as they are, nothing is mocked; avx2 is chosen and
    correct there."""
    assert shutil.which("valgrind"), "valgrind is not installed: run `make setup` (it installs Debian's valgrind)"
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tests), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("ATTNKERN_ISA", None)
    proc = subprocess.run(["valgrind", "--tool=none", "-q", sys.executable, str(tests / "isa_refusal.py")],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = dict(line.split(":", 1) for line in proc.stdout.splitlines() if ":" in line)
    refused, supported = lines["refused"].split(), lines["supported"].split()
    assert {"avx512", "avx512bf16", "amx"} <= set(refused), proc.stdout
    assert supported and set(supported) <= {"generic", "avx2"}, proc.stdout


@pytest.mark.parametrize("kernel", NATIVE)
def test_overflowing_scores_raise(kernel):
    q = np.full((4, 8), 1e20, dtype=np.float32)
    with pytest.raises(FloatingPointError, match="overflows float32"):
        attnkern.attention(q, q, q, kernel=kernel)


def _native_dtypes(kernel):
    dtypes = [np.dtype(np.float32), np.dtype(np.float64)]
    if "float16" in attnkern.kernel_info(kernel)["dtypes"]:
        dtypes.append(np.dtype(np.float16))
        try:
            import ml_dtypes
        except ImportError:  # bfloat16 arrays need it
            pass
        else:
            dtypes.append(np.dtype(ml_dtypes.bfloat16))
    return dtypes


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kernel", NATIVE)
def test_every_non_finite_input_is_named(kernel, isa):
    # The native kernels check their own arrays (the flash kernels as they read them, the
    # dispatch for the others): one NaN or infinity anywhere, including keys that no causal
    # query reads (nk > nq) and the last query block's, must name its array. Several query
    # and key blocks, so that each block's checks are reached.
    b, nq, nk, d, dv = 2, 37, 53, 16, 8
    q0, k0, v0 = random_qkv(np.random.default_rng(9), (b,), nq, nk, d, dv, np.float32)
    where = {"q": [(0, 0, 0), (1, nq - 1, d - 1), (1, 20, 5)],
             "k": [(0, 0, 3), (1, nq - 1, 0), (1, nq + 3, 2), (0, nk - 1, d - 1)],
             "v": [(1, 0, 0), (0, 30, dv - 1), (1, nq, 4), (1, nk - 1, dv - 1)]}
    tunables = {} if kernel == "native.naive" else {"block_q": 16, "block_k": 16}
    params = dict(kernel=kernel, num_threads=2, **tunables)
    with forced_isa(isa):
        for dtype in _native_dtypes(kernel):
            arrays = {n: x.astype(dtype) for n, x in zip("qkv", (q0, k0, v0))}
            for causal in (False, True):
                attnkern.attention(**arrays, causal=causal, **params)  # finite: no error
                for name, spots in where.items():
                    for spot, bad in zip(spots, (np.nan, np.inf, -np.inf, np.nan)):
                        changed = dict(arrays)
                        changed[name] = arrays[name].copy()
                        changed[name][spot] = bad
                        with pytest.raises(ValueError, match=f"^{name} contains NaN or infinity"):
                            attnkern.attention(**changed, causal=causal, **params)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kernel", NATIVE)
def test_overflowing_scores_raise_on_every_isa(kernel, isa):
    # finite inputs whose scores overflow: the output check names the kernel, not an input
    q = np.full((2, 40, 8), 1e20, dtype=np.float32)
    tunables = {} if kernel == "native.naive" else {"block_q": 16, "block_k": 16}
    with forced_isa(isa), pytest.raises(FloatingPointError, match=f"{kernel} produced non-finite values"):
        attnkern.attention(q, q, q, kernel=kernel, num_threads=2, **tunables)


def test_out_of_memory_is_a_python_error():
    big = np.ones((200_000, 1), dtype=np.float32)  # a 200000^2 score matrix: 160 GB
    with pytest.raises(MemoryError, match="native.naive: out of memory"):
        attnkern.attention(big, big, big, kernel="native.naive")


def test_unavailable_kernel_raises(monkeypatch):
    from attnkern import _registry

    broken = _registry.Kernel("test.broken", "never runs", run=None, unavailable_reason=lambda: "no such device")
    monkeypatch.setitem(_registry._KERNELS, broken.name, broken)
    info = attnkern.kernel_info("test.broken")
    assert info["available"] is False and info["reason"] == "no such device"
    with pytest.raises(RuntimeError, match="test.broken is not available here: no such device"):
        attnkern.attention(Q, K, V, kernel="test.broken")


@pytest.mark.parametrize("kernel", AVAILABLE)
def test_valid_but_unusual_inputs(kernel):
    # non-contiguous views are copied, lists converted (float64), results correct
    qt = np.asfortranarray(Q)
    assert_matches_reference(attnkern.attention(qt, K, V, kernel=kernel), Q, K, V)
    kv = np.ascontiguousarray(K[:, ::-1])
    assert_matches_reference(attnkern.attention(Q, K[:, ::-1], V, kernel=kernel), Q, kv, V)
    ql, kl, vl = (x[0].astype(np.float64).tolist() for x in (Q, K, V))
    if "float64" in attnkern.kernel_info(kernel)["dtypes"]:
        out = attnkern.attention(ql, kl, vl, kernel=kernel)
        assert out.dtype == np.float64
        assert_matches_reference(out, np.array(ql), np.array(kl), np.array(vl))
    else:  # lists become float64 arrays, which this kernel refuses, saying which kernels take them
        with pytest.raises(TypeError, match=f"{kernel} does not take float64 .*kernels that take float64: "):
            attnkern.attention(ql, kl, vl, kernel=kernel)
    # empty outputs: no queries, zero value width, zero batch
    assert attnkern.attention(Q[:, :0], K, V, kernel=kernel).shape == (2, 0, 4)
    assert attnkern.attention(Q, K, V[..., :0], kernel=kernel).shape == (2, 9, 0)
    assert attnkern.attention(Q[:0], K[:0], V[:0], kernel=kernel).shape == (0, 9, 4)
    # one query, one key: the output is v (to 2 units of float32's rounding: the 3xTF32 products of
    # triton.flash's float32 split v in two parts of 11 bits, which need not add up to all of its 24)
    np.testing.assert_allclose(attnkern.attention(Q[:, :1], K[:, :1], V[:, :1], kernel=kernel), V[:, :1],
                               rtol=2 * np.finfo(np.float32).eps, atol=0)


def test_torch_cpu_tensors_give_torch_tensors():
    q, k, v = (torch.from_numpy(x) for x in (Q, K, V))
    out = attnkern.attention(q, k, v, kernel="native.flash")
    assert isinstance(out, torch.Tensor)
    assert_matches_reference(out.numpy(), Q, K, V)
    out = attnkern.attention(q.clone().requires_grad_(), k, v)  # differentiable (tests/test_backward.py)
    assert out.requires_grad


def test_check_finite_off_skips_the_input_scan():
    q = Q.copy()
    q[0, 0, 0] = np.nan
    out = attnkern.attention(q, K, V, kernel="native.flash", check_finite=False)
    assert np.isnan(out[0, 0]).all() and np.isfinite(out[1]).all()


def test_every_cpu_kernel_runs_here():
    """The CPU kernels' packages (torch, Numba, SciPy, threadpoolctl) are test extras that
    `make setup` installs: a kernel missing from AVAILABLE, and so from every test
    parametrized over it, is a broken setup, not a skip."""
    cpu = [k for k in attnkern.kernels() if attnkern.kernel_info(k)["device"] == "cpu"]
    assert {k: attnkern.kernel_info(k)["reason"] for k in cpu if k not in AVAILABLE} == {}


def test_kernel_registry():
    names = attnkern.kernels()
    for expected in ("numpy.naive", "native.naive", "native.tiled", "native.flash", "torch.sdpa", "torch.naive"):
        assert expected in names
    info = attnkern.kernel_info("native.flash")
    assert info["available"] and info["reason"] is None
    assert set(info["params"]) == {"block_q", "block_k", "num_threads"}
    for p in info["params"].values():
        assert p["min"] <= p["default"] <= p["max"]
    with pytest.raises(ValueError, match="unknown kernel"):
        attnkern.kernel_info("nope")


def test_reference_is_float64_and_exact_on_a_hand_case():
    q = np.array([[1.0, 0.0], [0.0, 1.0]], dtype=np.float32)
    k = np.array([[0.0, 0.0], [np.log(3.0) * np.sqrt(2.0), 0.0]], dtype=np.float32)
    v = np.array([[1.0], [5.0]], dtype=np.float32)
    ref = attnkern.reference(q, k, v)
    assert ref.dtype == np.float64
    # row 0: scores (0, ln 3) -> weights (1/4, 3/4) -> 4; row 1: uniform -> 3
    np.testing.assert_allclose(ref, [[4.0], [3.0]], rtol=1e-6)
    np.testing.assert_allclose(attnkern.reference(q, k, v, causal=True), [[1.0], [3.0]], rtol=1e-6)
