"""triton.flash, and cuda.flash's float16/bfloat16 tensor-core kernel, against
the float64 reference on a GPU (ATTNKERN_TEST_GPU=1 with Triton, torch and a
CUDA GPU; skipped elsewhere, where neither can run: the simulator runs no
Triton and no CUDA C++). What runs without a GPU is the registration, and the
refusal of a kernel that cannot run here.

Inputs are drawn in float32 and rounded to the dtype under test; the reference
is attnkern.reference in float64 on those rounded values (copied to the host),
so the error is the kernel's alone. The bounds are attnkern_bench.accuracy's,
shared with the CPU tests and the harness (its docstring derives them): the
scaled error max |out - ref| / (max(1, max|v|) kappa) within 2^7 u for float32
(3xTF32 products, or exact float32 ones with tensor_cores=0, and float32 sums),
and within 4u for float16 and bfloat16, whose tensor-core products round P to
the dtype before P V (u = 2^-11 and 2^-8: the output rounded once, each weight
once more); the log-sum-exp row by row within lse_tolerance (2u for the half
dtypes: rounded once, from a float32 row sum). A wrong term shows as an error of
order 0.1.
"""

import os
import re

import ml_dtypes
import numpy as np
import pytest

import attnkern
from attnkern_bench.accuracy import kernel_tolerance, lse_error, lse_tolerance, reference_lse, scaled_error

SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def test_registered_with_its_dtypes():
    info = attnkern.kernel_info("triton.flash")
    assert info["device"] == "cuda" and info["returns_lse"] and not info["backward"]
    assert info["dtypes"] == ["float32", "float16", "bfloat16"]
    assert set(attnkern.kernel_info("cuda.flash")["dtypes"]) >= {"float16", "bfloat16"}
    assert info["available"] == (info["reason"] is None)
    if not info["available"]:  # it says why, and a call says the same instead of running
        assert isinstance(info["reason"], str) and info["reason"]
        q = np.ones((2, 8, 16), np.float32)
        with pytest.raises(RuntimeError, match="kernel triton.flash is not available here: "
                                               + re.escape(info["reason"])):
            attnkern.attention(q, q, q, kernel="triton.flash")


gpu = pytest.mark.skipif(SIMULATED or not attnkern.kernel_info("triton.flash")["available"],
                         reason=f"needs a CUDA GPU, Triton and torch (ATTNKERN_TEST_GPU=1): "
                                f"{attnkern.kernel_info('triton.flash')['reason']}")


@pytest.fixture(autouse=True)
def one_triton_config():
    """One config for triton.flash: the autotuner would compile and time three per
    new key (head size, mask, dtype, size bucket), minutes over these shapes; the
    kernel's logic is the same for every config (the GPU benchmark autotunes)."""
    if SIMULATED or not attnkern.kernel_info("triton.flash")["available"]:
        yield
        return
    from attnkern.backends.triton import flash

    before = flash.flash_forward.configs
    flash.flash_forward.configs = [c for c in before if c.kwargs["BLOCK_M"] == 64 and c.kwargs["BLOCK_N"] == 32][:1]
    yield
    flash.flash_forward.configs = before


def _inputs(torch, dtype, lead, nq, nk, d, dv, seed):
    g = torch.Generator().manual_seed(seed)
    tdtype = getattr(torch, dtype)
    q, k, v = (torch.randn(*lead, n, e, generator=g).to(tdtype).cuda() for n, e in ((nq, d), (nk, d), (nk, dv)))
    return q, k, v


def _host(x):
    """A torch tensor as a float64 NumPy array (its values exactly)."""
    return x.detach().double().cpu().numpy()


def check(out, lse, q, k, v, causal, scale, kernel, where):
    """out (and lse) of `kernel` on torch tensors q, k, v against the float64 reference
    within attnkern_bench.accuracy's bounds."""
    q, k, v = (_host(x) for x in (q, k, v))
    err = scaled_error(_host(out), q, k, v, causal=causal, scale=scale)
    bound = kernel_tolerance(kernel, out.dtype)
    assert err <= bound, f"{kernel} {where}: scaled error {err:.3g} > {bound:.3g}"
    if lse is not None:
        err, bound = lse_error(_host(lse), reference_lse(q, k, causal=causal, scale=scale)), lse_tolerance(lse.dtype)
        assert err <= bound, f"{kernel} {where}: lse error {err:.3g} > {bound:.3g}"


# (lead, nq, nk, d, dv): partial blocks, nq != nk, D not a power of two, Dv != D, a long one
TRITON_SHAPES = [((2, 3), 77, 77, 64, 64), ((1,), 45, 130, 20, 12), ((4,), 200, 33, 128, 128),
                 ((1, 2), 1030, 1030, 64, 64)]
# the tensor-core kernel: D = Dv, multiples of 16 up to 128
MMA_SHAPES = [((2, 3), 77, 77, 64, 64), ((1,), 45, 130, 32, 32), ((4,), 200, 33, 128, 128),
              ((1, 2), 1030, 1030, 64, 64), ((), 1, 5, 16, 16), ((2,), 129, 129, 48, 48),
              ((1,), 300, 300, 80, 80), ((2,), 150, 97, 96, 96), ((1,), 257, 257, 112, 112),
              ((1,), 300, 300, 128, 128)]


@gpu
@pytest.mark.parametrize("dtype, tensor_cores", [("float32", 1), ("float32", 0), ("float16", 1), ("bfloat16", 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_triton_matches_reference(dtype, tensor_cores, causal):
    import torch

    for i, (lead, nq, nk, d, dv) in enumerate(TRITON_SHAPES):
        q, k, v = _inputs(torch, dtype, lead, nq, nk, d, dv, i)
        scale = 0.8 / d ** 0.5
        out, lse = attnkern.attention(q, k, v, causal=causal, scale=scale, kernel="triton.flash", return_lse=True,
                                      tensor_cores=tensor_cores)
        assert out.dtype == q.dtype and out.is_cuda and out.shape == (*lead, nq, dv)
        check(out, lse, q, k, v, causal, scale, "triton.flash", (lead, nq, nk, d, dv))


@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_flash_half_matches_reference(dtype, causal):
    import torch

    for i, (lead, nq, nk, d, dv) in enumerate(MMA_SHAPES):
        q, k, v = _inputs(torch, dtype, lead, nq, nk, d, dv, 100 + i)
        scale = -0.7 / d ** 0.5 if i == 1 else 1 / d ** 0.5  # a negative scale too
        out, lse = attnkern.attention(q, k, v, causal=causal, scale=scale, kernel="cuda.flash", return_lse=True)
        assert out.dtype == q.dtype and out.shape == (*lead, nq, dv)
        check(out, lse, q, k, v, causal, scale, "cuda.flash", (lead, nq, nk, d, dv))
        # auto sends half-precision GPU arrays to cuda.flash too
        assert torch.equal(attnkern.attention(q, k, v, causal=causal, scale=scale, check_finite=False), out)


@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_flash_half_every_division(dtype):
    """Both half-precision kernels launched directly in each of their divisions:
    flash_wgmma.cu (Hopper only: 1-3 warpgroups x 64 or 128 keys, D = 64 and 128)
    and flash_mma.cu's default division; causal and not, with lse, partial blocks,
    nq != nk, a negative scale, against float64 and bit-identical run to run. On
    Hopper the library's default is the wgmma kernel."""
    import torch

    from attnkern import _gpu
    from attnkern.backends.cuda import cpp, launch

    def flat(x):
        return _gpu.from_torch(x, "x")

    for d in (64, 128):
        divisions = [cpp.mma_config(d, dtype)]
        if cpp.wgmma_applies(d, d):
            assert isinstance(cpp.half_config(d, dtype), cpp.WgmmaConfig)
            divisions += [cpp.WgmmaConfig(w, bk) for w in (1, 2, 3) for bk in (64, 128)]
        for i, (batch, nq, nk) in enumerate([(2, 77, 77), (1, 45, 300), (3, 200, 33), (1, 1, 5), (1, 257, 257)]):
            q, k, v = _inputs(torch, dtype, (batch,), nq, nk, d, d, 200 + i)
            scale = -0.6 / d ** 0.5 if i == 1 else 1 / d ** 0.5
            for causal in (False, True):
                for config in divisions:
                    outs = []
                    for _ in range(2):
                        out = torch.full_like(q, float("nan"))
                        lse = torch.full((batch, nq), float("nan"), dtype=q.dtype, device=q.device)
                        kernel, grid, block, args = cpp.flash_mma_launch(
                            flat(q), flat(k), flat(v), flat(out), causal, scale, flat(lse), config)
                        launch.launch(kernel, grid, block, *args)
                        outs.append((out, lse))
                    (out, lse), (again, lse_again) = outs
                    where = (str(config), d, batch, nq, nk, causal)
                    check(out, lse, q, k, v, causal, scale, "cuda.flash", where)
                    assert torch.equal(out, again) and torch.equal(lse, lse_again), where


@gpu
def test_half_precision_errors_and_checks():
    import torch

    q, k, v = _inputs(torch, "bfloat16", (2,), 64, 64, 40, 40, 7)
    with pytest.raises(ValueError, match="multiple of 16"):
        attnkern.attention(q, k, v, kernel="cuda.flash")
    out = attnkern.attention(q, k, v, kernel="triton.flash")  # any head size
    assert out.shape == (2, 64, 40)
    check(out, None, q, k, v, False, None, "triton.flash", "D = 40")
    q, k, v = _inputs(torch, "float16", (2,), 64, 64, 64, 64, 8)
    q[1, 3, 5] = float("nan")
    for kernel in ("cuda.flash", "triton.flash"):
        with pytest.raises(ValueError, match="q contains NaN"):
            attnkern.attention(q, k, v, kernel=kernel)
    # finite but large: one query row with scores of order 1e3, far beyond float16's range
    # once exponentiated, yet nothing overflows (float32 scores and accumulation). That row's
    # kappa is about 1e3, which makes its bound vacuous: it must be finite; every other row
    # (rows are independent without the mask) is held to the bound with its own kappa
    q[1, 3, 5] = 1e4
    others = torch.arange(64, device=q.device) != 3
    for kernel in ("cuda.flash", "triton.flash"):
        out = attnkern.attention(q, k, v, kernel=kernel)
        assert torch.isfinite(out).all()
        check(out[0], None, q[0], k[0], v[0], False, None, kernel, "head 0")
        check(out[1][others], None, q[1][others], k[1], v[1], False, None, kernel, "head 1 but its large row")


@gpu
def test_numpy_half_inputs_are_copied_there_and_back():
    rng = np.random.default_rng(3)
    for dtype in (np.float16, ml_dtypes.bfloat16):
        q, k, v = (rng.standard_normal((2, 50, 64)).astype(np.float32).astype(dtype) for _ in range(3))
        for kernel in ("triton.flash", "cuda.flash"):
            out = attnkern.attention(q, k, v, causal=True, kernel=kernel)
            assert isinstance(out, np.ndarray) and out.dtype == dtype
            err = scaled_error(out, q, k, v, causal=True)
            assert err <= kernel_tolerance(kernel, dtype), (kernel, np.dtype(dtype).name, err)
