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
import subprocess
import sys
from pathlib import Path

import importlib.util

import ml_dtypes
import numpy as np
import pytest

import attnkern
from attnkern_bench.accuracy import (UNIT_ROUNDOFF, conditioning, dtype_name, gradient_error, kernel_tolerance,
                                     lse_error, lse_tolerance, reference_lse, scaled_error, tolerance)

SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def test_registered_with_its_dtypes():
    info = attnkern.kernel_info("triton.flash")
    assert info["device"] == "cuda" and info["returns_lse"] and info["backward"]
    assert info["dtypes"] == info["backward_dtypes"] == ["float32", "float16", "bfloat16"]
    every = ["gqa", "bottom_right", "window", "key_lengths", "softcap"]
    assert info["features"] == info["backward_features"] == every
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
    flash_wgmma.cu (Hopper only: 1-3 warpgroups x 64 or 128 keys, D = 64 and 128, and
    its warp-specialized variant in four divisions, and five with its TMA producer, 64-192-key tiles)
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
            # the warp-specialized variant: two or three consumers, 3-6 K/V stages, K freed early or not
            divisions += [cpp.WgmmaConfig(w, bk, st, early_k=e) for w, bk, st, e in
                          ((2, 128, 3, False), (2, 128, 3, True), (2, 64, 6, True), (3, 64, 4, True))]
            # and its TMA producer (K/V tiles copied by the tensor memory accelerator), with ping-pong too
            divisions += [cpp.WgmmaConfig(w, bk, st, pp, True, True) for w, bk, st, pp in
                          ((2, 128, 3, False), (2, 128, 2, True), (3, 64, 4, False), (2, 176, 2, True),
                           (2, 192, 3, True))]
            divisions.append(cpp.WgmmaConfig(2, 160, 2, early_k=True))  # a wider tile with cp.async copies
            divisions = [c for c in divisions if not isinstance(c, cpp.WgmmaConfig)
                         or c.shared_bytes(d) <= cpp.WGMMA_SHARED_LIMIT]  # 192-key tiles in 3 stages: D = 64 only
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


_PROBE = """
import numpy as np, torch, triton, triton.language as tl

@triton.jit
def k(n_ptr, out_ptr):
    acc = 0
    for i in range(tl.load(n_ptr), 4):  # a loop bound loaded from memory, as the kernels' key ranges are
        acc += i
    tl.store(out_ptr, acc)

n, out = torch.tensor([1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
k[(1,)](n, out)
assert out.item() == 6, out
"""


def _interpreter_defect() -> str | None:
    """Why Triton's interpreter here cannot run any kernel of ours, or None: Triton's
    interpreter up to 3.6 converts a loop bound it loaded into an int with int() on a
    1-element array, which NumPy 2.4 refuses (triton-lang/triton#9171, fixed upstream by
    #9172). A ten-line kernel shows it apart from our code."""
    run = subprocess.run([sys.executable, "-c", _PROBE], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=300)
    if run.returncode == 0:
        return None
    if "only 0-dimensional arrays can be converted" in run.stderr:
        return ("this Triton's interpreter fails on a loop bound with this NumPy (triton-lang/triton#9171: "
                "Triton <= 3.6 with NumPy >= 2.4); the compiled kernels are tested on a GPU")
    raise AssertionError("a ten-line kernel failed in Triton's interpreter:\n" + run.stderr[-3000:])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
                    reason="needs Triton and torch (Triton's interpreter runs the kernels on the CPU)")
@pytest.mark.skipif(os.environ.get("ATTNKERN_TEST_GPU") == "1",
                    reason="with a GPU the compiled kernels are tested; Triton 3.6's interpreter (the device's) "
                           "fails this script where 3.9's passes")
def test_kernels_in_triton_interpreter():
    """Forward and backward with every feature, run by Triton's interpreter on the CPU
    (tests/triton_interpreted.py): float32 within 2^7 u, float16 within 4u, of float64."""
    why = _interpreter_defect()
    if why:
        pytest.skip(why)
    script = Path(__file__).with_name("triton_interpreted.py")
    run = subprocess.run([sys.executable, str(script)], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr


def _torch_in_dtype(q, k, v, dout, causal, scale, feats):
    """The gradients of a plain torch attention computed in the inputs' dtype (FlashAttention's
    yardstick: its error against float64 sets the bound), with the features as an explicit mask."""
    import torch

    qd, kd, vd = (x.detach().clone().requires_grad_() for x in (q, k, v))
    group = q.shape[-3] // k.shape[-3]
    kk, vv = (x.repeat_interleave(group, dim=-3) for x in (kd, vd))
    s = (qd @ kk.transpose(-1, -2)) * scale
    if feats.get("softcap"):
        s = feats["softcap"] * torch.tanh(s / feats["softcap"])
    mask = torch.from_numpy(_mask(q.shape, k.shape[-2], causal, feats)).to(q.device)
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
    (p @ vv).backward(dout)
    return qd.grad, kd.grad, vd.grad


def _mask(q_shape, nk, causal, feats) -> np.ndarray:
    """(B, 1, nq, nk): query i sees key j (FlashAttention's rule: j < len, and with the diagonal
    at i + off, off = len - nq bottom-right else 0, j <= i + off + right, j >= i + off - left)."""
    b, nq = q_shape[0], q_shape[-2]
    lengths = np.asarray(feats.get("key_lengths", [nk] * b))
    left, right = feats.get("window", (None, None))
    right = 0 if causal else right
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    masks = []
    for n in lengths:
        off = n - nq if causal == "bottom_right" else 0
        seen = np.broadcast_to(j < n, (nq, nk))
        if right is not None:
            seen = seen & (j <= i + off + right)
        if left is not None:
            seen = seen & (j >= i + off - left)
        masks.append(seen)
    return np.stack(masks)[:, None]


def check_gradients(grads, q, k, v, dout, causal, scale, feats, where):
    """triton.flash's (dq, dk, dv) against float64: within FlashAttention's rule (at most twice the
    error of torch in the same dtype, plus two roundings of the largest gradient) and, for
    float32, within the one table's bound (gradient_error, tolerance)."""
    host = [_host(x) for x in (q, k, v, dout)]
    refs = attnkern.reference_backward(*host, causal=causal, scale=scale, **feats)
    theirs = _torch_in_dtype(q, k, v, dout, causal, scale, feats)
    u = UNIT_ROUNDOFF[dtype_name(q.dtype)]
    for name, grad, torch_grad, ref in zip(("dq", "dk", "dv"), grads, theirs, refs):
        assert grad.shape == torch_grad.shape and grad.dtype == q.dtype, (name, where)
        err = np.abs(_host(grad) - ref).max()
        torch_err = np.abs(_host(torch_grad) - ref).max()
        # float32: the table's bound as the margin (torch's float32 error may be far below it)
        atol = (tolerance(np.float32) if q.dtype.itemsize == 4 else 2 * u) * max(1.0, np.abs(ref).max())
        assert err <= 2 * torch_err + atol, \
            f"{name} {where}: error {err:.3g} > 2 x torch's {torch_err:.3g} + {atol:.3g}"
        if q.dtype.itemsize == 4:
            err = gradient_error(_host(grad), ref, host[0], host[1], scale)
            assert err <= tolerance(np.float32), f"{name} {where}: scaled error {err:.3g}"


# (lead, H_kv, nq, nk, d, dv): a long one, partial blocks, nq != nk, D not a power of two, Dv != D, D = 128
BACKWARD_SHAPES = [((1, 2), 2, 1030, 1030, 64, 64), ((1, 2), 2, 45, 130, 20, 12), ((2, 2), 2, 200, 33, 128, 128)]


@gpu
@pytest.mark.parametrize("dtype, tensor_cores", [("float32", 1), ("float16", 1), ("bfloat16", 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_triton_backward_matches_reference(dtype, tensor_cores, causal):
    """attention_backward on torch CUDA tensors, and torch autograd through attention: the same
    gradients (bit for bit: deterministic, no atomics), within FlashAttention's rule."""
    import torch

    for i, (lead, _, nq, nk, d, dv) in enumerate(BACKWARD_SHAPES):
        q, k, v = _inputs(torch, dtype, lead, nq, nk, d, dv, 300 + i)
        dout = _inputs(torch, dtype, lead, nq, nk, dv, dv, 400 + i)[0]
        scale = 0.8 / d ** 0.5
        out, lse = attnkern.attention(q, k, v, causal=causal, scale=scale, kernel="triton.flash", return_lse=True,
                                      tensor_cores=tensor_cores)
        grads = attnkern.attention_backward(q, k, v, out, dout, lse, causal=causal, scale=scale,
                                            kernel="triton.flash", tensor_cores=tensor_cores)
        check_gradients(grads, q, k, v, dout, causal, scale, {}, (dtype, lead, nq, nk, d, dv))
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        attnkern.attention(*leaves, causal=causal, scale=scale, kernel="triton.flash",
                           tensor_cores=tensor_cores).backward(dout)
        for leaf, grad in zip(leaves, grads):
            assert torch.equal(leaf.grad, grad)


# (lead of q, H_kv, nq, nk, d, causal, features)
FEATURE_CASES = [((2, 4), 2, 100, 100, 64, False, {}),
                 ((2, 4), 1, 70, 150, 64, "bottom_right", {}),
                 ((2, 2), 2, 150, 150, 64, False, {"window": (40, 10)}),
                 ((2, 2), 2, 130, 130, 64, True, {"window": (33, None), "key_lengths": [0, 97]}),
                 ((2, 4), 2, 90, 120, 128, "bottom_right", {"key_lengths": [120, 61], "softcap": 10.0}),
                 ((1, 2), 2, 80, 80, 64, False, {"softcap": 3.0})]


@gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_features_match_reference(dtype):
    """GQA (k/v with fewer heads), bottom-right causal, windows, key lengths (one sequence with
    none: rows that see no key give 0 and lse -inf), softcap: forward against float64 within the
    table's bound, backward within FlashAttention's rule."""
    import torch

    for i, (lead, h_kv, nq, nk, d, causal, feats) in enumerate(FEATURE_CASES):
        q = _inputs(torch, dtype, lead, nq, nq, d, d, 500 + i)[0]
        _, k, v = _inputs(torch, dtype, (lead[0], h_kv), nq, nk, d, d, 600 + i)
        dout = _inputs(torch, dtype, lead, nq, nq, d, d, 700 + i)[0]
        scale = 1 / d ** 0.5
        out, lse = attnkern.attention(q, k, v, causal=causal, kernel="triton.flash", return_lse=True, **feats)
        host = [_host(x) for x in (q, k, v)]
        ref, ref_lse = attnkern.reference(*host, causal=causal, return_lse=True, **feats)
        err = np.abs(_host(out) - ref).max() / (max(1.0, np.abs(host[2]).max()) * conditioning(host[0], host[1]))
        assert err <= kernel_tolerance("triton.flash", q.dtype), (i, err)
        seen = np.isfinite(ref_lse)
        assert np.isneginf(_host(lse)[~seen]).all() and lse_error(_host(lse)[seen], ref_lse[seen]) <= \
            lse_tolerance(dtype), i
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        attnkern.attention(*leaves, causal=causal, kernel="triton.flash", **feats).backward(dout)
        check_gradients([x.grad for x in leaves], q, k, v, dout, causal, scale, feats, (dtype, i))


# the Hopper variant's cases: (lead, k/v heads, nq, nk, d, dv, causal, features): long enough for
# unmasked middle blocks (TMA loads) beside the masked ones, GQA, D not a power of two (72: the
# descriptor's zero columns), Dv != D, key lengths below nk, bottom-right, window, softcap
HOPPER_CASES = [((1, 4), 2, 700, 700, 64, 64, False, {}),
                ((1, 4), 1, 600, 900, 72, 72, "bottom_right", {"key_lengths": [700]}),
                ((2, 2), 2, 650, 650, 128, 128, True, {"window": (200, None)}),
                ((1, 2), 2, 520, 520, 40, 24, False, {"softcap": 5.0, "window": (300, 100)})]


@gpu
def test_triton_hopper_variant_matches_reference(monkeypatch):
    """The forward's Hopper variant (TMA loads of K and V; ATTNKERN_TRITON_HOPPER=all forces it on
    every call that can take it) with GQA, key lengths, bottom-right causal, windows and softcap
    against float64 within the table's bound, the same bits on a second call, and the variant
    chosen exactly where the GPU and the call allow it (else the pointer-load kernel)."""
    import torch

    from attnkern.backends.triton import flash

    monkeypatch.setenv("ATTNKERN_TRITON_HOPPER", "all")
    capable = torch.cuda.get_device_capability()[0] >= 9 and hasattr(flash.tl, "make_tensor_descriptor")
    for i, (lead, h_kv, nq, nk, d, dv, causal, feats) in enumerate(HOPPER_CASES):
        q = _inputs(torch, "bfloat16", lead, nq, nq, d, dv, 1500 + i)[0]
        _, k, v = _inputs(torch, "bfloat16", (lead[0], h_kv), nq, nk, d, dv, 1600 + i)
        assert flash.hopper_ready((q, k, v), d, dv, 2) == capable
        out, lse = attnkern.attention(q, k, v, causal=causal, kernel="triton.flash", return_lse=True, **feats)
        host = [_host(x) for x in (q, k, v)]
        ref, ref_lse = attnkern.reference(*host, causal=causal, return_lse=True, **feats)
        err = np.abs(_host(out) - ref).max() / (max(1.0, np.abs(host[2]).max()) * conditioning(host[0], host[1]))
        assert err <= kernel_tolerance("triton.flash", q.dtype), (i, err)
        seen = np.isfinite(ref_lse)
        assert np.isneginf(_host(lse)[~seen]).all() and lse_error(_host(lse)[seen], ref_lse[seen]) <= \
            lse_tolerance("bfloat16"), i
        again = attnkern.attention(q, k, v, causal=causal, kernel="triton.flash", return_lse=True, **feats)
        assert torch.equal(out, again[0]) and torch.equal(lse, again[1]), i
    # what launch chose: TMA on a capable GPU for 16-bit rows of a multiple of 8, never else
    for dtype, d, want in (("bfloat16", 64, capable), ("float16", 72, capable), ("bfloat16", 36, False),
                           ("float32", 64, False)):
        q, k, v = _inputs(torch, dtype, (2,), 600, 600, d, d, 1700)
        out = torch.empty_like(q)
        _, args, _ = flash.launch(q, k, v, out, None, None, 2, 2, 600, 600, d, d, True, d ** -0.5, dtype)
        named = dict(zip(flash.flash_forward.arg_names, args))
        # where the toolchain failed to compile the variant for this call, the failure is on record
        assert named["TMA"] == want or (want and flash.HOPPER_FAILED), (dtype, d)
        check(out, None, q, k, v, True, d ** -0.5, "triton.flash", (dtype, d))
    monkeypatch.setenv("ATTNKERN_TRITON_HOPPER", "0")
    assert flash.hopper_config(2, 64, 16384, False) is None


def test_hopper_variant_falls_back_where_it_does_not_compile(monkeypatch):
    """A call whose Hopper variant fails to compile (Triton 3.6's ptxas crashed on some) runs the
    pointer-load kernel at TABLE's config instead, and the failure is remembered: the next call
    of that specialization does not try again."""
    pytest.importorskip("triton")
    from attnkern.backends.triton import flash

    class Ptr:  # what launch needs of an array: its address
        def __init__(self, at):
            self.at = at

        def data_ptr(self):
            return self.at

    tried = []

    def fake_launch(jit, kernel, chosen, key, grid, args, switches):
        tried.append((chosen, switches["TMA"], switches["WARP_SPECIALIZE"]))
        if switches["TMA"]:
            raise RuntimeError("PTXAS error: `ptxas` failed with error code -11")
        return "compiled", chosen[:2]

    monkeypatch.setattr(flash, "_launch", fake_launch)
    monkeypatch.setattr(flash, "hopper_ready", lambda *a: True)
    monkeypatch.setattr(flash, "ensure_allocator", lambda: None)
    monkeypatch.setattr(flash, "HOPPER_FAILED", set())
    monkeypatch.setitem(flash.OVERRIDE, "forward_hopper", (128, 64, 8, 3, 1))
    q, k, v, out, lse = (Ptr(4096 * i) for i in range(1, 6))
    for call in range(2):
        kernel, args, grid = flash.launch(q, k, v, out, lse, None, 8, 2, 1030, 1030, 64, 64, True, 0.125,
                                          "bfloat16")
        named = dict(zip(flash.flash_forward.arg_names, args))
        table = flash.config("forward", 2, 64, flash._bucket(1030), True)
        assert kernel == "compiled" and not named["TMA"] and not named["WARP_SPECIALIZE"]
        assert (named["BLOCK_M"], named["BLOCK_N"]) == table[:2] and grid == (-(-1030 // table[0]), 8)
    assert tried == [((128, 64, 8, 3), True, True), (table, False, False), (table, False, False)]
    assert len(flash.HOPPER_FAILED) == 1


def test_hopper_table_is_data():
    """The Hopper variant's configs come from HOPPER_TABLE (keys of the forward's TABLE keys),
    off with ATTNKERN_TRITON_HOPPER=0, forced (HOPPER_DEFAULT) with "all", and the override
    (measurements; None: off) replaces them."""
    pytest.importorskip("triton")
    from attnkern.backends.triton import flash

    env = os.environ.pop("ATTNKERN_TRITON_HOPPER", None)
    try:
        for (itemsize, head, size, masked), cfg in flash.HOPPER_TABLE.items():
            assert ("forward", itemsize, head, size, masked) in flash.TABLE
            assert flash.hopper_config(itemsize, head, 16384 if size == "large" else 256, masked) == cfg
            bm, bn, warps, stages, ws = cfg
            assert all(x & (x - 1) == 0 for x in (bm, bn, warps)) and 1 <= stages <= 5 and ws in (0, 1)
        assert flash.hopper_config(2, 64, 256, False) is None  # no entry: the pointer-load kernel
        os.environ["ATTNKERN_TRITON_HOPPER"] = "all"
        assert flash.hopper_config(2, 64, 256, False) == flash.HOPPER_DEFAULT
        os.environ["ATTNKERN_TRITON_HOPPER"] = "0"
        assert flash.hopper_config(2, 64, 16384, False) is None
        flash.OVERRIDE["forward_hopper"] = (64, 32, 4, 2, 0)
        assert flash.hopper_config(2, 128, 256, True) == (64, 32, 4, 2, 0)
        flash.OVERRIDE["forward_hopper"] = None
        assert flash.hopper_config(2, 128, 16384, True) is None
    finally:
        flash.OVERRIDE.clear()
        os.environ.pop("ATTNKERN_TRITON_HOPPER", None)
        if env is not None:
            os.environ["ATTNKERN_TRITON_HOPPER"] = env


@gpu
def test_triton_fast_path_matches_general_path():
    """Repeated calls on torch CUDA tensors take the prepared launch (_torch_cuda) and give what
    the general path gives, bit for bit, with and without the lse and the NaN check."""
    import torch

    from attnkern import _torch_cuda

    for dtype in ("bfloat16", "float32"):
        q, k, v = _inputs(torch, dtype, (1, 8), 16, 16, 64, 64, 800)
        for return_lse, check_finite in ((False, True), (True, False)):
            _torch_cuda.FAST_PATH = False
            try:
                want = attnkern.attention(q, k, v, causal=True, kernel="triton.flash", return_lse=return_lse,
                                          check_finite=check_finite)
            finally:
                _torch_cuda.FAST_PATH = True
            for _ in range(3):  # the first call plans, the next ones launch the plan
                got = attnkern.attention(q, k, v, causal=True, kernel="triton.flash", return_lse=return_lse,
                                         check_finite=check_finite)
                for a, b in zip(*(x if return_lse else (x,) for x in (want, got))):
                    assert torch.equal(a, b)
        # this test's plans (earlier tests leave plans of featured calls, which have no launch)
        plans = [p for key, p in _torch_cuda._plans().items() if key[9] == "triton.flash" and key[0] == q.shape]
        assert plans and all(p.launch is not None for p in plans)


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("causal", [False, True])
def test_triton_table_configs_match_reference(dtype, causal):
    """The fixed table's configs of long sequences (flash.TABLE: tall query blocks, wide key
    blocks in dK/dV), at D = 64 and 128 with a partial last block: forward within the table's
    bound, gradients within FlashAttention's rule, and the same bits on a second call."""
    import torch

    from attnkern.backends.triton import flash

    for i, d in enumerate((64, 128)):
        q, k, v = _inputs(torch, dtype, (1, 2), 1100, 1100, d, d, 900 + i)
        dout = _inputs(torch, dtype, (1, 2), 1100, 1100, d, d, 950 + i)[0]
        assert flash.config("forward", 2, d, flash._bucket(1100), causal) in flash.TABLE.values()
        scale = 1 / d ** 0.5
        out, lse = attnkern.attention(q, k, v, causal=causal, kernel="triton.flash", return_lse=True)
        check(out, lse, q, k, v, causal, scale, "triton.flash", (dtype, d))
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        attnkern.attention(*leaves, causal=causal, kernel="triton.flash").backward(dout)
        check_gradients([x.grad for x in leaves], q, k, v, dout, causal, scale, {}, (dtype, d))
        again = attnkern.attention_backward(q, k, v, out, dout, lse, causal=causal, kernel="triton.flash")
        assert all(torch.equal(a, x.grad) for a, x in zip(again, leaves))


@gpu
def test_triton_autotuning_is_opt_in(monkeypatch):
    """ATTNKERN_TRITON_AUTOTUNE=1 hands the choice to triton.autotune (here between the table's
    config and one other), whose pick still matches the reference; without it every kernel
    runs the table's config."""
    import torch

    from attnkern.backends.triton import flash

    q, k, v = _inputs(torch, "bfloat16", (1, 2), 1030, 1030, 64, 64, 990)
    dout = _inputs(torch, "bfloat16", (1, 2), 1030, 1030, 64, 64, 991)[0]
    table = [flash.config(kernel, 2, 64, flash._bucket(1030), True) for kernel in ("forward", "dq", "dkdv")]
    others = {"forward": [(64, 32, 4, 3)], "dq": [(64, 32, 4, 3)], "dkdv": [(32, 64, 4, 3)]}
    assert all(others[kernel][0] != cfg for kernel, cfg in zip(others, table))  # two configs to choose from
    monkeypatch.setattr(flash, "CANDIDATES", others)
    monkeypatch.setattr(flash, "_TUNED", {})
    monkeypatch.setenv("ATTNKERN_TRITON_AUTOTUNE", "1")
    out, lse = attnkern.attention(q, k, v, causal=True, kernel="triton.flash", return_lse=True)
    check(out, lse, q, k, v, True, 1 / 8, "triton.flash", "autotuned")
    grads = attnkern.attention_backward(q, k, v, out, dout, lse, causal=True, kernel="triton.flash")
    check_gradients(grads, q, k, v, dout, True, 1 / 8, {}, "autotuned")
    assert len(flash._TUNED) == 3 and all(len(t.configs) == 2 for t in flash._TUNED.values())


def test_config_table_is_fixed():
    """Every call shape gets its config from data (flash.config), the same every time; the
    override (tests, measurements) replaces it."""
    pytest.importorskip("triton")
    from attnkern.backends.triton import flash

    for (kernel, itemsize, head, size, masked), cfg in flash.TABLE.items():
        assert flash.config(kernel, itemsize, head, 16384 if size == "large" else 256, masked) == cfg
        bm, bn, warps, stages = cfg
        assert all(x & (x - 1) == 0 for x in (bm, bn, warps)) and 1 <= stages <= 5
    assert flash.config("forward", 4, 64, 16384, False) == flash.DEFAULT["forward"]["other"]
    assert flash.config("forward", 2, 128, 256, True) == flash.DEFAULT["forward"]["short"]
    assert flash.config("dq", 2, 64, 256, True) == flash.DEFAULT["dq"]["half64"]
    assert flash.config("dkdv", 4, 64, 256, True) == flash.DEFAULT["dkdv"]["other"]
    assert flash.config("dkdv", 2, 128, 256, False) == flash.DEFAULT["dkdv"]["other"]
    flash.OVERRIDE["dkdv"] = (16, 16, 4, 1)
    try:
        assert flash.config("dkdv", 2, 128, 16384, True) == (16, 16, 4, 1)
    finally:
        flash.OVERRIDE.clear()


def _triton_step(q, k, v, dout, causal, check_finite=False):
    """Forward and backward of triton.flash through torch autograd: out and (dq, dk, dv)."""
    for x in (q, k, v):
        x.grad = None
    out = attnkern.attention(q, k, v, causal=causal, kernel="triton.flash", check_finite=check_finite)
    out.backward(dout)
    return out.detach(), (q.grad, k.grad, v.grad)


def _leaves(torch, dtype, shape, kv_heads, seed):
    """q, k, v leaves that require grad (k and v with kv_heads heads) and dout, on the GPU."""
    g = torch.Generator().manual_seed(seed)
    b, h, n, d = shape
    make = lambda heads: torch.randn(b, heads, n, d, generator=g).to(getattr(torch, dtype)).cuda()  # noqa: E731
    return make(h).requires_grad_(), make(kv_heads).requires_grad_(), make(kv_heads).requires_grad_(), make(h)


def _general(torch, fn):
    """fn() with the frontend's fast path off (every call validated and dispatched by Triton)."""
    from attnkern import _torch_cuda

    _torch_cuda.FAST_PATH = False
    try:
        return fn()
    finally:
        _torch_cuda.FAST_PATH = True


@pytest.fixture(params=["eager", "op"])
def triton_autograd(request):
    """Both ways autograd reaches triton.flash: the eager autograd Function and the custom op;
    skipped where the frontend's fast path cannot run (no numba-cuda GPU)."""
    from attnkern import _torch_cuda
    from attnkern.backends import cuda as cuda_backend

    if not _torch_cuda.usable():
        pytest.skip("the fast path needs numba-cuda's GPU (attnkern.backends.cuda)")
    was = cuda_backend.EAGER_AUTOGRAD
    cuda_backend.EAGER_AUTOGRAD = request.param == "eager"
    yield request.param
    cuda_backend.EAGER_AUTOGRAD = was


# (dtype, (batch, heads, n, d), k/v heads, causal): plain, causal, GQA bottom-right, float32, D = 128
PREPARED_CASES = [("bfloat16", (2, 4, 200, 64), 4, False), ("float16", (2, 4, 257, 128), 4, True),
                  ("bfloat16", (2, 8, 333, 64), 2, "bottom_right"), ("float32", (2, 8, 100, 64), 2, True),
                  ("bfloat16", (1, 8, 16, 64), 8, False)]


@gpu
def test_triton_prepared_autograd_matches_general_path(triton_autograd, monkeypatch):
    """Forward and backward under autograd with the prepared launches (the forward's and the
    backward's plans) against the general path: the same output and gradients bit for bit,
    within the reference's bounds; attention_backward takes the same plan and agrees."""
    import torch

    from attnkern import _api, _torch_api

    # the general path's forward and backward, counted on any thread (autograd runs the backward
    # on its own, whose plans, thread-local, the test cannot read)
    general_runs = {"forward": 0, "backward": 0}

    def counted(name, fn):
        def run(*args, **kwargs):
            general_runs[name] += 1
            return fn(*args, **kwargs)

        return run

    monkeypatch.setattr(_api, "_torch_forward", counted("forward", _api._torch_forward))
    monkeypatch.setattr(_torch_api, "backward", counted("backward", _torch_api.backward))
    for i, (dtype, shape, kv_heads, causal) in enumerate(PREPARED_CASES):
        q, k, v, dout = _leaves(torch, dtype, shape, kv_heads, seed=40 + i)
        where = (dtype, shape, kv_heads, causal)
        _triton_step(q, k, v, dout, causal)  # plans (through the general path's steps)
        general_runs.update(forward=0, backward=0)
        fast = [_triton_step(q, k, v, dout, causal) for _ in range(2)][-1]
        assert general_runs == {"forward": 0, "backward": 0}, f"the general path ran: {where}: {general_runs}"
        general = _general(torch, lambda: _triton_step(q, k, v, dout, causal))
        assert general_runs["forward"] == 1 and general_runs["backward"] == 1, general_runs
        assert torch.equal(fast[0], general[0]), where
        assert all(torch.equal(a, b) for a, b in zip(fast[1], general[1])), where
        scale = shape[3] ** -0.5
        check(fast[0], None, q.detach(), k.detach(), v.detach(), causal, scale, "triton.flash", where)
        check_gradients(fast[1], q.detach(), k.detach(), v.detach(), dout, causal, scale, {}, where)
        out, lse = attnkern.attention(q.detach(), k.detach(), v.detach(), causal=causal, kernel="triton.flash",
                                      return_lse=True)
        for _ in range(2):
            grads = attnkern.attention_backward(q.detach(), k.detach(), v.detach(), out, dout, lse, causal=causal,
                                                kernel="triton.flash")
            assert all(torch.equal(a, b) for a, b in zip(grads, general[1])), where


@gpu
def test_triton_prepared_plans_are_not_reused_across_calls(triton_autograd):
    """After a shape is planned, a call of another length, dtype, k/v head count or causal
    setting, and one whose q is not 16-byte aligned (the plan's kernels were compiled for
    aligned addresses), each gets the general path's bits and the reference's accuracy; q
    of other strides (a transposed layout) is refused as the general path refuses it."""
    import torch

    q, k, v, dout = _leaves(torch, "bfloat16", (2, 8, 160, 64), 2, seed=60)
    for _ in range(3):
        _triton_step(q, k, v, dout, True)
    others = [("bfloat16", (2, 8, 161, 64), 2, True), ("float16", (2, 8, 160, 64), 2, True),
              ("bfloat16", (2, 8, 160, 64), 4, True), ("bfloat16", (2, 8, 160, 64), 2, False)]
    for i, (dtype, shape, kv_heads, causal) in enumerate(others):
        q2, k2, v2, dout2 = _leaves(torch, dtype, shape, kv_heads, seed=61 + i)
        for _ in range(2):
            got = _triton_step(q2, k2, v2, dout2, causal)
            want = _general(torch, lambda: _triton_step(q2, k2, v2, dout2, causal))
            assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1])), i
        check_gradients(got[1], q2.detach(), k2.detach(), v2.detach(), dout2, causal, 1 / 8, {}, i)
    # the planned shape, q one element past an aligned address
    buf = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)
    shifted = buf[1:].view(q.shape)
    shifted.copy_(q.detach())
    shifted.requires_grad_()
    for _ in range(2):
        got = _triton_step(shifted, k, v, dout, True)
        want = _general(torch, lambda: _triton_step(shifted, k, v, dout, True))
        assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    check_gradients(got[1], q.detach(), k.detach(), v.detach(), dout, True, 1 / 8, {}, "shifted")
    # the planned shape on (batch, n, heads, d) memory seen as (batch, heads, n, d)
    t = q.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    assert not t.is_contiguous()
    with pytest.raises(ValueError, match="not C-contiguous"):
        _triton_step(t, k, v, dout, True)


@gpu
def test_triton_autograd_calls_do_not_wait_for_the_gpu(triton_autograd):
    """A planned forward + backward queued behind a long GPU busy-wait returns while the GPU is
    still busy (no synchronisation, no blocking allocation), with the same bits as before."""
    import torch

    for dtype, shape, kv_heads, causal in (("bfloat16", (8, 8, 1024, 64), 2, "bottom_right"),
                                           ("bfloat16", (1, 8, 16, 64), 8, False),
                                           ("float32", (2, 4, 200, 64), 4, True)):
        q, k, v, dout = _leaves(torch, dtype, shape, kv_heads, seed=shape[2])
        for _ in range(3):
            want = _triton_step(q, k, v, dout, causal)
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU clock cycles
        got = _triton_step(q, k, v, dout, causal)
        busy = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        assert busy, f"forward or backward waited for the GPU: {dtype, shape}"
        assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


@gpu
def test_triton_prepared_path_under_torch_compile():
    """torch.compile(fullgraph=True) traces triton.flash as the custom op (no graph break), whose
    implementation takes the prepared launches: the eager path's output and gradients bit for bit."""
    import torch
    import torch._dynamo

    q, k, v, dout = _leaves(torch, "bfloat16", (2, 8, 128, 64), 2, seed=70)

    def fn(q, k, v):
        return attnkern.attention(q, k, v, causal="bottom_right", kernel="triton.flash", check_finite=False)

    explained = torch._dynamo.explain(fn)(q, k, v)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    want = [_triton_step(q, k, v, dout, "bottom_right") for _ in range(3)][-1]
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for _ in range(3):
        for x in (q, k, v):
            x.grad = None
        out = compiled(q, k, v)
        out.backward(dout)
        assert torch.equal(out.detach(), want[0])
        assert all(torch.equal(x.grad, g) for x, g in zip((q, k, v), want[1]))
