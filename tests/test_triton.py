"""triton.flash, and cuda.flash's float16/bfloat16 tensor-core kernel, against
the float64 reference on a GPU (ATTNKERN_TEST_GPU=1 with Triton, torch and a
CUDA GPU; skipped elsewhere, where neither can run: the simulator runs no
Triton and no CUDA C++). What runs without a GPU is the registration.

Inputs are drawn in float32 and rounded to the dtype under test; the reference
is computed in float64 from those rounded values, so the error is the
kernel's alone. Tolerances, max |out - ref| / max(1, max |v|) (and the same for
the log-sum-exp, divided by max(1, max |lse|)), for unit-normal inputs at
scale 1/sqrt(D) and N up to a few hundred:
- float32, 2e-5: triton.flash multiplies in 3xTF32 (each operand split into
  two TF32 parts: products good to about 2^-22) or, with tensor_cores=0, in
  exact float32; the error is a few float32 roundings of sums over N and D
  terms (1e-6 typical; plain TF32 would be about 1e-3);
- float16, 4e-3: P is rounded to float16 (relative 2^-11) before P V and the
  output rounded once more; the float32 accumulation adds little;
- bfloat16, 3e-2: the same with bfloat16's 8-bit mantissa (relative 2^-8,
  about 4e-3 per rounding, a few of which add up in the worst row).
Each catches a wrong term, which shows as an error of order 0.1 or more.
"""

import os

import numpy as np
import pytest

import attnkern

TOL = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}
SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def test_registered_with_its_dtypes():
    info = attnkern.kernel_info("triton.flash")
    assert info["device"] == "cuda" and info["returns_lse"] and not info["backward"]
    assert info["dtypes"] == ["float32", "float16", "bfloat16"]
    assert info["available"] or info["reason"]
    assert set(attnkern.kernel_info("cuda.flash")["dtypes"]) >= {"float16", "bfloat16"}


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


def _reference(torch, q, k, v, causal, scale):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        nq, nk = s.shape[-2:]
        s = s.masked_fill(torch.ones(nq, nk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)


def _error(out, ref, scale_by):
    return float((out.double() - ref).abs().max() / max(1.0, float(scale_by)))


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
        ref, ref_lse = _reference(torch, q, k, v, causal, scale)
        assert _error(out, ref, v.abs().max()) <= TOL[dtype], (lead, nq, nk, d, dv)
        assert _error(lse, ref_lse, ref_lse.abs().max()) <= TOL[dtype], (lead, nq, nk, d, dv)


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
        ref, ref_lse = _reference(torch, q, k, v, causal, scale)
        assert _error(out, ref, v.abs().max()) <= TOL[dtype], (lead, nq, nk, d, dv)
        assert _error(lse, ref_lse, ref_lse.abs().max()) <= TOL[dtype], (lead, nq, nk, d, dv)
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
                ref, ref_lse = _reference(torch, q, k, v, causal, scale)
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
                    assert _error(out, ref, v.abs().max()) <= TOL[dtype], where
                    assert _error(lse, ref_lse, ref_lse.abs().max()) <= TOL[dtype], where
                    assert torch.equal(out, again) and torch.equal(lse, lse_again), where


@gpu
def test_half_precision_errors_and_checks():
    import torch

    q, k, v = _inputs(torch, "bfloat16", (2,), 64, 64, 40, 40, 7)
    with pytest.raises(ValueError, match="multiple of 16"):
        attnkern.attention(q, k, v, kernel="cuda.flash")
    out = attnkern.attention(q, k, v, kernel="triton.flash")  # any head size
    assert out.shape == (2, 64, 40)
    q, k, v = _inputs(torch, "float16", (2,), 64, 64, 64, 64, 8)
    q[1, 3, 5] = float("nan")
    for kernel in ("cuda.flash", "triton.flash"):
        with pytest.raises(ValueError, match="q contains NaN"):
            attnkern.attention(q, k, v, kernel=kernel)
    q[1, 3, 5] = 1e4  # finite, but the scores overflow nothing: float32 accumulation
    attnkern.attention(q, k, v, kernel="cuda.flash")


@gpu
def test_numpy_half_inputs_are_copied_there_and_back():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(3)
    for dtype in (np.float16, ml_dtypes.bfloat16):
        q, k, v = (rng.standard_normal((2, 50, 64)).astype(np.float32).astype(dtype) for _ in range(3))
        ref = attnkern.reference(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), causal=True)
        for kernel in ("triton.flash", "cuda.flash"):
            out = attnkern.attention(q, k, v, causal=True, kernel=kernel)
            assert isinstance(out, np.ndarray) and out.dtype == dtype
            assert np.abs(out.astype(np.float64) - ref).max() <= TOL[np.dtype(dtype).name]
