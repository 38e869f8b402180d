"""cuda.flash's log-sum-exp and backward against float64 gradients of naive
attention derived from the math (checked against torch autograd). Without a GPU
they run in Numba's CUDA simulator (see test_cuda.py): small, odd shapes and
tiles of 8 and 16, so several tiles, partial tiles and the causal diagonal are
all crossed.

Bounds: attnkern_bench.accuracy's, as for the CPU backward (tests/test_backward.py):
the output's scaled error and each of dq, dk, dv's, max |grad - ref| /
(max(1, max |ref|) kappa), within tolerance(dtype) (2^7 u: 7.6e-6 float32, 1.4e-14
float64); the log-sum-exp row by row within lse_tolerance(dtype). The reference is
computed from the same float32-rounded inputs, so the error is the kernel's
rounding alone (seen: a few 1e-7 in float32 in the simulator and on an H100); a
wrong term is an error of order 1e-2 or more.
"""

import os
import zlib

import ml_dtypes
import numpy as np
import pytest
import torch

import attnkern
from attnkern import _registry
from attnkern_bench.accuracy import (
    UNIT_ROUNDOFF,
    gradient_error,
    lse_error,
    lse_tolerance,
    reference_backward,
    reference_lse,
    scaled_error,
    tolerance,
)
from conftest import random_qkv, require_cuda_kernels

require_cuda_kernels()
FLASH = _registry.get("cuda.flash")

from attnkern.backends import cuda as cuda_backend  # noqa: E402  (numba-cuda is there)
from attnkern.backends.cuda import arrays  # noqa: E402

SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def _simulate_float32_once(first: bool, dtype) -> None:
    """In the simulator float32 runs on a case's first entry only: the same Numba code
    as float64's, typed float32, and each simulated case costs seconds."""
    if SIMULATED and dtype == np.float32 and not first:
        pytest.skip("the simulator runs float32 on the first case only")

# (batch, nq, nk, d, dv): sizes that do not divide the tiles, nq > nk and nq < nk
# (causal: keys no query sees get zero gradients), Dv != D, batch 2
SHAPES = [(1, 13, 11, 5, 3), (2, 9, 20, 17, 8), (2, 16, 7, 4, 4)]
TILES = {"block_q": 8, "block_k": 8}


def reference(q, k, v, dout, causal, scale):
    """out, lse, dq, dk, dv in float64: attnkern.reference and attnkern_bench.accuracy's
    reference_lse and reference_backward."""
    out = attnkern.reference(q, k, v, causal=causal, scale=scale)
    return out, reference_lse(q, k, causal=causal, scale=scale), *reference_backward(q, k, v, dout, causal=causal,
                                                                                      scale=scale)


def check(out, lse, grads, q, k, v, dout, causal, scale, where=""):
    """cuda.flash's out, lse and (dq, dk, dv) against the float64 values, within
    attnkern_bench.accuracy's bounds."""
    _, ref_lse, *ref_grads = reference(q, k, v, dout, causal, scale)
    dtype = q.dtype
    assert out.dtype == dtype and lse.dtype == dtype and lse.shape == ref_lse.shape
    err = scaled_error(out, q, k, v, causal=causal, scale=scale)
    assert err <= tolerance(dtype), f"out {where}: scaled error {err:.3g} > {tolerance(dtype):.3g}"
    err = lse_error(lse, ref_lse)
    assert err <= lse_tolerance(dtype), f"lse {where}: error {err:.3g} > {lse_tolerance(dtype):.3g}"
    for name, g, x, ref in zip(("dq", "dk", "dv"), grads, (q, k, v), ref_grads):
        assert isinstance(g, np.ndarray) and g.dtype == dtype and g.shape == x.shape
        err = gradient_error(g, ref, q, k, scale)
        assert err <= tolerance(dtype), f"{name} {where}: scaled error {err:.3g} > {tolerance(dtype):.3g}"


def forward_backward(q, k, v, dout, causal, scale, **tiles):
    """cuda.flash's out and lse, then its (dq, dk, dv), on NumPy arrays (copied there and back)."""
    lse = np.full(q.shape[:2], np.nan, q.dtype)
    out = FLASH.run(q, k, v, causal, scale, lse=lse, **tiles)
    grads = FLASH.backward(q, k, v, out, dout, lse, causal, scale, **tiles)
    return out, lse, grads


def inputs(seed, batch, nq, nk, d, dv, dtype):
    rng = np.random.default_rng(seed)
    q, k, v = random_qkv(rng, (batch,), nq, nk, d, dv, dtype)
    dout = rng.standard_normal((batch, nq, dv)).astype(dtype)
    return q, k, v, dout, rng.uniform(-1, 1)


def test_registered():
    info = attnkern.kernel_info("cuda.flash")
    assert info["returns_lse"] and info["backward"]
    assert FLASH.backward is cuda_backend._cuda_flash_backward


def test_reference_gradients_match_torch_autograd():
    """The float64 out, lse and gradients above (the ones every backward test compares
    with) are the true ones (torch autograd, CPU, float64)."""
    for causal in (False, True):
        q, k, v, dout, scale = inputs(0, 2, 7, 5, 3, 4, np.float64)
        tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
        s = scale * tq @ tk.transpose(-1, -2)
        if causal:
            s = s.masked_fill(torch.ones(7, 5, dtype=torch.bool).triu(1), -torch.inf)
        out = torch.softmax(s, dim=-1) @ tv
        out.backward(torch.tensor(dout))
        ref = reference(q, k, v, dout, causal, scale)
        for mine, theirs in zip(ref, (out, torch.logsumexp(s, dim=-1), tq.grad, tk.grad, tv.grad)):
            np.testing.assert_allclose(mine, theirs.detach().numpy(), rtol=0, atol=1e-13)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_lse_and_gradients_match_reference(dtype, causal):
    for shape in SHAPES:
        q, k, v, dout, scale = inputs(zlib.crc32(repr((shape, dtype, causal)).encode()), *shape, dtype)
        out, lse, grads = forward_backward(q, k, v, dout, causal, scale, **TILES)
        check(out, lse, grads, q, k, v, dout, causal, scale, shape)
        if causal and shape[1] < shape[2]:  # keys past the last query are seen by none
            assert not grads[1][:, shape[1]:].any() and not grads[2][:, shape[1]:].any()


def test_bitwise_deterministic_and_independent_of_tiles():
    """No atomics: two runs give the same bits, and so do other tiles, since
    every gradient row is summed by one thread in row or key order."""
    q, k, v, dout, scale = inputs(6, 2, 17, 15, 6, 3, np.float32)
    out, lse, first = forward_backward(q, k, v, dout, True, scale, **TILES)
    again = FLASH.backward(q, k, v, out, dout, lse, True, scale, **TILES)
    tiles = FLASH.backward(q, k, v, out, dout, lse, True, scale, block_q=16, block_k=8)
    for a, b, c in zip(first, again, tiles):
        assert a.tobytes() == b.tobytes() == c.tobytes()


def test_gpu_arrays_in_caller_arrays_filled():
    """On GPU arrays the caller allocates dq, dk, dv (and lse): they are filled and returned."""
    q, k, v, dout, scale = inputs(7, 1, 10, 9, 4, 5, np.float32)
    gq, gk, gv, gdout = (arrays.from_host(x) for x in (q, k, v, dout))
    out, lse = arrays.device_empty((1, 10, 5), q.dtype), arrays.device_empty((1, 10), q.dtype)
    assert FLASH.run(gq, gk, gv, False, scale, out=out, lse=lse, **TILES) is out
    grads = tuple(arrays.device_empty(x.shape, x.dtype) for x in (q, k, v))
    returned = FLASH.backward(gq, gk, gv, out, gdout, lse, False, scale, dq=grads[0], dk=grads[1], dv=grads[2],
                              **TILES)
    assert all(r is g for r, g in zip(returned, grads))
    check(arrays.to_host(out), arrays.to_host(lse), tuple(arrays.to_host(g) for g in grads), q, k, v, dout, False,
          scale)


def test_backward_tiles():
    """0 is 64; tiles too large for shared memory are halved (the results do not
    depend on them); a head size too large even for 8 x 8 is refused."""
    assert cuda_backend._flash_backward_tiles(0, 0, 64, 64, 4) == (64, 64)
    assert cuda_backend._flash_backward_tiles(8, 16, 5, 3, 4) == (8, 16)
    assert cuda_backend._flash_backward_tiles(128, 0, 128, 128, 4) == (32, 32)
    assert cuda_backend._flash_backward_tiles(0, 0, 256, 256, 8) == (8, 8)
    with pytest.raises(ValueError, match="needs .* bytes of shared memory with the smallest tiles"):
        cuda_backend._flash_backward_tiles(0, 0, 1024, 1024, 8)


# ---------------------------------------------------------------- attention features
# (B, H, H_kv, nq, nk, d, dv), keywords: GQA and MQA, bottom-right with rows that see no
# key, windows, key lengths (0 included), softcap, all at once; tiles of 8 cross them all
FEATURE_CASES = {
    "gqa-causal": ((2, 4, 2, 13, 13, 5, 4), dict(causal=True)),
    "mqa-bottom-right-tall": ((1, 3, 1, 12, 6, 4, 4), dict(causal="bottom_right")),
    "window": ((1, 2, 2, 14, 17, 8, 8), dict(window=(3, 2))),
    "sliding-causal-softcap": ((1, 4, 2, 20, 20, 8, 8), dict(causal=True, window=(4, None), softcap=2.0)),
    "key-lengths": ((3, 2, 1, 9, 12, 8, 6), dict(key_lengths=[12, 5, 0])),
    "everything": ((2, 4, 2, 7, 19, 8, 6), dict(causal="bottom_right", window=(5, 0), key_lengths=[19, 3],
                                                softcap=3.0, scale=0.6)),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", FEATURE_CASES)
def test_feature_gradients_by_flash_attentions_rule(name, dtype):
    """cuda.flash's forward and backward with features against the float64 reference
    by FlashAttention's rule: each of out, dq, dk, dv within twice the error of torch
    computing the same in the same dtype, plus 4 ulp of the values; dk and dv have k's
    H_kv heads; rows and keys no query sees (padding included, NaN there) get 0;
    bit-identical across runs and tiles (dk, dv of a group summed in a fixed order)."""
    from test_features import err, inputs, torch_peer

    _simulate_float32_once(name == next(iter(FEATURE_CASES)), dtype)
    shape, kw = FEATURE_CASES[name]
    q, k, v, dout = inputs(shape, dtype, seed=zlib.crc32(name.encode()))
    ref = [attnkern.reference(q, k, v, **kw), *attnkern.reference_backward(q, k, v, dout, **kw)]
    peer = torch_peer(q, k, v, dout, kw)
    lengths = kw.get("key_lengths")
    for b, n in enumerate(lengths or []):
        k[b, :, n:] = v[b, :, n:] = np.nan  # never read
    out, lse = attnkern.attention(q, k, v, kernel="cuda.flash", return_lse=True, **TILES, **kw)
    grads = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="cuda.flash", **TILES, **kw)
    for what, r, p, a in zip(("out", "dq", "dk", "dv"), ref, peer, (out, *grads)):
        assert a.shape == r.shape and a.dtype == dtype, what
        limit = 2 * err(p, r) + 4 * np.finfo(dtype).eps * max(1.0, np.abs(r).max())
        assert err(a, r) <= limit, f"{what}: {err(a, r):.3g} > {limit:.3g}"
    empty = np.isneginf(lse)
    assert (grads[0][empty] == 0).all() and (out[empty] == 0).all()
    for b, n in enumerate(lengths or []):
        assert not grads[1][b, :, n:].any() and not grads[2][b, :, n:].any(), "padding gets no gradient"
    again = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="cuda.flash", **TILES, **kw)
    tiles = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="cuda.flash", block_q=16, block_k=8, **kw)
    for a, b, c in zip(grads, again, tiles):
        assert a.tobytes() == b.tobytes() == c.tobytes()


def test_feature_gradients_under_torch_autograd():
    """torch autograd through cuda.flash with features gives attention_backward's gradients."""
    shape, kw = FEATURE_CASES["everything"]
    from test_features import inputs

    q, k, v, dout = inputs(shape, np.float32, seed=5)
    out, lse = attnkern.attention(q, k, v, kernel="cuda.flash", return_lse=True, **TILES, **kw)
    want = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="cuda.flash", **TILES, **kw)
    tensors = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    tout = attnkern.attention(*tensors, kernel="cuda.flash", **TILES, **dict(kw, key_lengths=torch.tensor([19, 3])))
    tout.backward(torch.from_numpy(dout))
    np.testing.assert_array_equal(tout.detach().numpy(), out)
    for t, w in zip(tensors, want):
        np.testing.assert_array_equal(t.grad.numpy(), w)


# ---------------------------------------------------------------- attention masks
# (mask kind, mask shape) for (B, H) = (2, 4), H_kv = 2, nq = 7, nk = 19, with keywords
MASK_CASES = {
    "bool-full": ("bool", (2, 4, 7, 19), {}),
    "neginf-heads-causal": ("neginf", (4, 1, 19), dict(causal="bottom_right")),
    "float-2d-everything": ("float", (7, 19), dict(causal="bottom_right", window=(5, 0), key_lengths=[19, 3],
                                                   softcap=3.0, scale=0.6)),
    "bool-queries": ("bool", (2, 1, 7, 1), dict(key_lengths=[19, 5])),
    "alibi-float-everything": ("float", (7, 19), dict(causal="bottom_right", window=(5, 0), key_lengths=[19, 3],
                                                      softcap=3.0, alibi_slopes=[0.5, 0.25, 0.125, 0.0625])),
    "alibi-batch-bool": ("bool", (2, 4, 7, 19), dict(alibi_slopes=np.linspace(0.1, 0.8, 8).reshape(2, 4))),
}


def _mask_peer(q, k, v, dout, mask, kw):
    """out, dq, dk, dv of torch ops in q's dtype: the scores (softcapped) plus the
    additive mask and the features' visibility as -inf, rows that see no key zeroed."""
    from test_features import visible

    seen = torch.from_numpy(visible(q.shape, k.shape[-2], kw.get("causal", False), kw.get("window"),
                                    kw.get("key_lengths")))
    add = torch.from_numpy(np.where(mask, 0.0, -np.inf) if mask.dtype == bool else mask.astype(np.float64))
    # NumPy arrays, or torch tensors (CUDA ones: the peer runs there, in their dtype)
    qt, kt, vt = (torch.as_tensor(x).detach().clone().requires_grad_() for x in (q, k, v))
    seen, add = seen.to(qt.device), add.to(qt.device)
    group = q.shape[-3] // k.shape[-3]
    kr, vr = kt.repeat_interleave(group, -3), vt.repeat_interleave(group, -3)
    s = kw.get("scale", q.shape[-1] ** -0.5) * qt @ kr.transpose(-1, -2)
    if kw.get("softcap"):
        s = kw["softcap"] * torch.tanh(s / kw["softcap"])
    if kw.get("alibi_slopes") is not None:  # -slope |i + len - nq - j|, len the sequence's key length
        nq, nk = q.shape[-2], k.shape[-2]
        lengths = torch.tensor(kw.get("key_lengths") or [nk] * q.shape[0], dtype=torch.float64, device=qt.device)
        i, j = (torch.arange(n, dtype=torch.float64, device=qt.device) for n in (nq, nk))
        dist = (i[None, :, None] + lengths[:, None, None] - nq - j[None, None, :]).abs()[:, None]
        slopes = torch.as_tensor(np.broadcast_to(kw["alibi_slopes"], q.shape[:2]).copy(),
                                 device=qt.device)[..., None, None]
        s = s - (slopes * dist).to(s.dtype)
    s = (s + add.to(s.dtype)).masked_fill(~seen, -torch.inf)
    hidden = torch.isneginf(s).all(-1, keepdim=True)
    probs = torch.softmax(s.masked_fill(hidden, 0), -1).masked_fill(hidden, 0)
    if kw.get("dropout_p"):  # the same Philox mask's Z = keep / (1 - p), folded rows b H + h
        from attnkern import _philox

        (b, h), nq, nk = q.shape[:2], q.shape[-2], k.shape[-2]
        rows = np.arange(b * h).reshape(b, h, 1, 1)
        z = _philox.dropout_factor(kw["dropout_seed"], kw["dropout_p"], rows, np.arange(nq)[:, None],
                                   np.arange(nk), np.float64)
        probs = probs * torch.from_numpy(z).to(probs)  # 1 / (1 - p) rounded to the peer's dtype
    out = probs @ vr
    out.backward(torch.as_tensor(dout))
    return [x.detach().double().cpu().numpy() for x in (out, qt.grad, kt.grad, vt.grad)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", MASK_CASES)
def test_mask_gradients_by_flash_attentions_rule(name, dtype):
    """cuda.flash's forward and backward with an attention mask (alone and with the
    other features, ALiBi included) against the float64 reference by FlashAttention's rule; rows the
    mask hides entirely get 0 and no NaN; bit-identical across runs and tiles."""
    from test_features import err, inputs

    _simulate_float32_once(name == next(iter(MASK_CASES)), dtype)
    kind, mshape, kw = MASK_CASES[name]
    q, k, v, dout = inputs((2, 4, 2, 7, 19, 8, 6), dtype, seed=zlib.crc32(name.encode()))
    rng = np.random.default_rng(len(name))
    keep = rng.random(mshape) < 0.7
    if len(mshape) == 4 and mshape[2] > 1:
        keep[0, 0, 2] = False  # a row that sees no key
    mask = keep if kind == "bool" else (np.where(keep, rng.standard_normal(mshape), -np.inf) if kind == "neginf"
                                        else rng.standard_normal(mshape)).astype(dtype)
    kw = dict(kw, attn_mask=mask)
    ref = [attnkern.reference(q, k, v, **kw), *attnkern.reference_backward(q, k, v, dout, **kw)]
    peer = _mask_peer(q, k, v, dout, mask, kw)
    out, lse = attnkern.attention(q, k, v, kernel="cuda.flash", return_lse=True, **TILES, **kw)
    grads = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="cuda.flash", **TILES, **kw)
    for what, r, p, a in zip(("out", "dq", "dk", "dv"), ref, peer, (out, *grads)):
        assert a.shape == r.shape and a.dtype == dtype and np.isfinite(a).all(), what
        limit = 2 * err(p, r) + 4 * np.finfo(dtype).eps * max(1.0, np.abs(r).max())
        assert err(a, r) <= limit, f"{what}: {err(a, r):.3g} > {limit:.3g}"
    empty = np.isneginf(lse)
    assert (grads[0][empty] == 0).all() and (out[empty] == 0).all()
    again = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="cuda.flash", **TILES, **kw)
    tiles = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="cuda.flash", block_q=16, block_k=8, **kw)
    for a, b, c in zip(grads, again, tiles):
        assert a.tobytes() == b.tobytes() == c.tobytes()


# ---------------------------------------------------------------- dropout
# (mask or None, keywords) for (B, H) = (2, 4), H_kv = 2, nq = 7, nk = 19
DROPOUT_CASES = {
    "plain": (None, dict(dropout_p=0.3, dropout_seed=99)),
    "everything": ("bool", dict(causal="bottom_right", window=(5, 0), key_lengths=[19, 3], softcap=3.0, scale=0.6,
                                alibi_slopes=[0.5, 0.25, 0.125, 0.0625], dropout_p=0.5, dropout_seed=2**64 - 7)),
}


def _dropout_case(name, shape, dtype):
    """q, k, v, dout and the keywords of DROPOUT_CASES[name] at shape (B, H, H_kv, nq, nk, D, Dv)."""
    from test_features import inputs

    kind, kw = DROPOUT_CASES[name]
    q, k, v, dout = inputs(shape, dtype, seed=zlib.crc32(name.encode()))
    nq, nk = shape[3:5]
    if kind is not None:
        kw = dict(kw, attn_mask=np.random.default_rng(1).random((nq, nk)) < 0.7)
    if "key_lengths" in kw:
        kw = dict(kw, key_lengths=[nk, nk // 6])
    return q, k, v, dout, kw


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", DROPOUT_CASES)
def test_dropout_gradients_by_flash_attentions_rule(name, dtype):
    """cuda.flash's backward with dropout (the forward's Philox mask regenerated: dV =
    (P Z)^T dO, dS = P (dO V^T Z - D)), alone and with every other feature, against the
    float64 reference with the same mask by FlashAttention's rule (torch's own error
    with that mask, in the dtype); bit-identical across runs and tiles; another seed
    gives other gradients. Small shapes on a GPU too, as the other feature tests: at 300
    keys the Numba backward's float32 sums exceed twice torch's error with or without
    dropout (test_dropout_gradients_at_gpu_sizes bounds those as test_backward.py does)."""
    from test_features import err

    _simulate_float32_once(name == next(iter(DROPOUT_CASES)), dtype)
    q, k, v, dout, kw = _dropout_case(name, (2, 4, 2, 7, 19, 8, 6), dtype)
    ref = [attnkern.reference(q, k, v, **kw), *attnkern.reference_backward(q, k, v, dout, **kw)]
    peer = _mask_peer(q, k, v, dout, kw.get("attn_mask", np.ones((q.shape[-2], k.shape[-2]), bool)), kw)
    out, lse = attnkern.attention(q, k, v, kernel="cuda.flash", return_lse=True, **TILES, **kw)
    grads = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="cuda.flash", **TILES, **kw)
    for what, r, p, a in zip(("out", "dq", "dk", "dv"), ref, peer, (out, *grads)):
        assert a.shape == r.shape and a.dtype == dtype and np.isfinite(a).all(), what
        limit = 2 * err(p, r) + 4 * np.finfo(dtype).eps * max(1.0, np.abs(r).max())
        assert err(a, r) <= limit, f"{what}: {err(a, r):.3g} > {limit:.3g}"
    again = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="cuda.flash", **TILES, **kw)
    tiles = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="cuda.flash", block_q=16, block_k=8, **kw)
    for a, b, c in zip(grads, again, tiles):
        assert a.tobytes() == b.tobytes() == c.tobytes()
    other = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="cuda.flash", **TILES,
                                        **dict(kw, dropout_seed=kw["dropout_seed"] - 1))
    assert not np.array_equal(other[2], grads[2])


@pytest.mark.skipif(SIMULATED, reason="GPU sizes")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", DROPOUT_CASES)
def test_dropout_gradients_at_gpu_sizes(name, dtype):
    """At 130 queries over 300 keys, D = 64 (default tiles): out, dq, dk and dv with
    dropout within attnkern_bench.accuracy's bounds (tests/test_backward.py's), widened
    by 1 / (1 - p), the size of Z; bit-identical repeats."""
    q, k, v, dout, kw = _dropout_case(name, (2, 4, 2, 130, 300, 64, 64), dtype)
    out, lse = attnkern.attention(q, k, v, kernel="cuda.flash", return_lse=True, **kw)
    grads = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="cuda.flash", **kw)
    bound = tolerance(dtype) / (1 - kw["dropout_p"])
    scale = kw.get("scale")
    for what, a, r in zip(("out", "dq", "dk", "dv"), (out, *grads),
                          (attnkern.reference(q, k, v, **kw), *attnkern.reference_backward(q, k, v, dout, **kw))):
        e = gradient_error(a, r, q, k, scale)
        assert e <= bound, f"{what}: scaled error {e:.3g} > {bound:.3g}"
    again = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="cuda.flash", **kw)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(grads, again))


def test_dropout_under_torch_autograd_keeps_the_forwards_seed():
    """torch autograd through cuda.flash with dropout: the backward regenerates the
    forward's mask (the seed travels with the op), giving attention_backward's
    gradients; dropout_seed=None draws from torch's generator (torch.manual_seed repeats it)."""
    kw = dict(causal=True, dropout_p=0.3, dropout_seed=31)
    shape = (1, 2, 2, 9, 11, 8, 8) if SIMULATED else (2, 4, 2, 200, 200, 64, 64)
    from test_features import inputs

    q, k, v, dout = inputs(shape, np.float32, seed=3)
    tiles = TILES if SIMULATED else {}
    out, lse = attnkern.attention(q, k, v, kernel="cuda.flash", return_lse=True, **tiles, **kw)
    want = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="cuda.flash", **tiles, **kw)
    device = "cpu" if SIMULATED else "cuda"  # the simulator runs host tensors through the copies
    tensors = [torch.tensor(x, device=device, requires_grad=True) for x in (q, k, v)]
    tout = attnkern.attention(*tensors, kernel="cuda.flash", **tiles, **kw)
    tout.backward(torch.from_numpy(dout).to(device))
    np.testing.assert_array_equal(tout.detach().cpu().numpy(), out)
    for t, w in zip(tensors, want):
        np.testing.assert_array_equal(t.grad.cpu().numpy(), w)
    drawn = []
    for _ in range(2):
        torch.manual_seed(5)
        drawn.append(attnkern.attention(*tensors, kernel="cuda.flash", dropout_p=0.3, **tiles).detach())
    assert torch.equal(drawn[0], drawn[1])


def test_dropout_in_varlen_sequences_uses_packed_counters():
    """attention_varlen on cuda.flash runs a call per sequence with dropout's counter
    offsets (packed query and key indices; a key offset of 6 splits a Philox group of
    4 keys across two calls' counters): forward, lse and backward against the float64
    reference of each sequence with the same offsets, in float64."""
    from test_varlen import per_sequence

    rng = np.random.default_rng(8)
    cu_q, cu_k = np.array([0, 5, 12]), np.array([0, 6, 15])
    q, k, v, dout = (rng.standard_normal((n, 2, 8)) for n in (12, 15, 15, 12))
    kw = dict(causal="bottom_right", dropout_p=0.35, dropout_seed=2**33 + 1)
    out, lse = attnkern.attention_varlen(q, k, v, cu_q, cu_k, kernel="cuda.flash", return_lse=True, **TILES, **kw)
    grads = attnkern.attention_varlen_backward(q, k, v, out, dout, lse, cu_q, cu_k, kernel="cuda.flash", **TILES,
                                               **kw)
    ref_out, ref_lse, ref_grads = per_sequence(q, k, v, cu_q, cu_k, dout, **kw)
    for got, want in zip((out, lse, *grads), (ref_out, ref_lse, *ref_grads)):
        np.testing.assert_allclose(got, want, atol=1e-12)


@pytest.mark.skipif(SIMULATED, reason="CUDA autocast needs a GPU")
def test_dropout_under_cuda_autocast_runs_in_float16():
    """In a CUDA autocast region (float16) attention with dropout computes in float16 (cuda.flash
    has half dropout: the float16 call on the inputs cast to float16), with and without grad."""
    from test_features import inputs

    q, k, v, dout = inputs((2, 4, 2, 70, 90, 64, 64), np.float32, seed=4)
    tensors = [torch.tensor(x, device="cuda", requires_grad=True) for x in (q, k, v)]
    kw = dict(causal=True, dropout_p=0.2, dropout_seed=3)
    want = attnkern.attention(*(t.detach().half() for t in tensors), **kw)
    with torch.autocast("cuda", dtype=torch.float16):
        got = attnkern.attention(*tensors, **kw)
        with torch.no_grad():
            plain = attnkern.attention(*tensors, **kw)
    assert got.dtype == plain.dtype == torch.float16
    assert torch.equal(got, want) and torch.equal(plain, want)
    got.float().backward(torch.from_numpy(dout).cuda())
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in tensors)
# ---------------------------------------------------------------- float16/bfloat16 on tensor cores (a GPU only)
# flash_bwd_mma.cu: the simulator runs no CUDA C++, so these run with ATTNKERN_TEST_GPU=1 on a GPU.
# Bounds: FlashAttention's rule (test_triton.check_gradients: at most twice the error of torch's
# own gradients in the same dtype against float64, plus two roundings of the largest gradient).
half_gpu = pytest.mark.skipif(SIMULATED, reason="the tensor-core backward is CUDA C++ (a GPU only)")
# the dtypes of the tensor-core backward (flash_bwd_mma.cu): float32 in 3xTF32 (tensor_cores=1, the default)
TC_DTYPES = ["float16", "bfloat16", "float32"]
# (lead, nq, nk, d): every head size the kernels take (multiples of 16 up to 128), partial
# blocks, nq > nk and nq < nk, a long one
HALF_SHAPES = [((2, 3), 77, 77, 64), ((1, 1), 45, 130, 32), ((4, 1), 200, 33, 128), ((1, 2), 1030, 1030, 64),
               ((1, 1), 1, 5, 16), ((2, 1), 129, 129, 48), ((1, 1), 300, 300, 80), ((2, 1), 150, 97, 96),
               ((1, 1), 257, 257, 112), ((1, 1), 300, 300, 128), ((1, 2), 1100, 1100, 128)]


def _half_case(torch, dtype, lead, nq, nk, d, seed, kv_heads=None):
    from test_triton import _inputs

    q = _inputs(torch, dtype, lead, nq, nk, d, d, seed)[0]
    kv_lead = lead if kv_heads is None else (*lead[:-1], kv_heads)
    _, k, v = _inputs(torch, dtype, kv_lead, nq, nk, d, d, seed + 1)
    dout = _inputs(torch, dtype, lead, nq, nk, d, d, seed + 2)[0]
    return q, k, v, dout


def _half_backward(q, k, v, dout, **kw):
    """cuda.flash's forward (lse) and attention_backward on CUDA tensors: (out, lse, grads)."""
    out, lse = attnkern.attention(q, k, v, kernel="cuda.flash", return_lse=True, **kw)
    return out, lse, attnkern.attention_backward(q, k, v, out, dout, lse, kernel="cuda.flash", **kw)


def test_half_backward_registered():
    """kernel_info lists the dtypes whose backward runs (float16/bfloat16 on tensor cores); the
    tensor-core backward's divisions are named and parsed one to one, each within the GPU's
    shared memory; the simulator, which runs no CUDA C++, refuses half precision clearly."""
    from attnkern.backends.cuda import cpp

    info = attnkern.kernel_info("cuda.flash")
    assert info["backward_dtypes"] == ["float32", "float64", "float16", "bfloat16"]
    doc = info["params"]["tensor_cores"]["doc"]
    assert "backward" in doc and "3xTF32" in doc
    for d in range(16, 257, 16):
        for dtype, itemsize in (("bfloat16", 2), ("float32", 4)):
            if dtype == "float32" and d > 128:
                continue  # float32 above 128 runs the Numba kernels
            config = cpp.bwd_config(d, dtype)
            assert cpp.BwdConfig.parse(str(config)) == config
            # above 128 within the A100's 163 KB too (the defaults there are not Hopper's)
            limit = 163 * 1024 if d > 128 else 227 * 1024
            assert max(config.shared_bytes(d, part, itemsize) for part in (1, 2)) <= limit, (d, dtype)
    assert str(cpp.BwdConfig(4, 32, 8, 64, 2, 1)) == "q4x32m2kv8x64"
    # above D = 128: dK and dV's columns in two slices (the c suffix), on mma.sync kernels only;
    # float32 above 128 (the Numba kernels) and slices on wgmma or float32 are refused before compiling
    big = cpp.bwd_config(256, "bfloat16")
    assert (str(big), big.split(1), big.split(2)) == ("q4x32kv4x32c2", 1, 2)
    assert cpp.BwdConfig.parse("q4x64c4kv4x32m2c2") == cpp.BwdConfig(4, 64, 4, 32, 1, 2, dq_split=4, kv_split=2)
    for name in ("qwg1x64c2kv4x64", "q4x64kvwg1x64c2", "q4x64kv4x64s2c2"):
        with pytest.raises(ValueError, match="not a flash_bwd_mma.cu division"):
            cpp.BwdConfig.parse(name)
    with pytest.raises(ValueError, match="float32 up to 128, not float32 at D = 256"):
        cpp.flash_bwd_kernels("float32", 256)
    with pytest.raises(ValueError, match="up to 256"):
        cpp.flash_bwd_kernels("bfloat16", 272, cpp.BwdConfig())
    for dtype, d, config in (("float32", 48, cpp.BwdConfig.parse("q4x64kv4x32c2")),
                             ("bfloat16", 128, cpp.BwdConfig.parse("q4x64kv4x64c9")),
                             ("bfloat16", 128, cpp.BwdConfig(kv_warps=4, kv_wg=1, kv_split=2))):
        with pytest.raises(ValueError, match="column slices"):
            cpp.flash_bwd_kernels(dtype, d, config)
    with pytest.raises(ValueError, match="not a flash_bwd_mma.cu division"):
        cpp.BwdConfig.parse("q4kv4")
    # the wgmma dK/dV kernel's divisions (Hopper): named and parsed one to one, within shared memory,
    # and refused before any compilation for what it lacks (float32, other head sizes, masks, ALiBi,
    # dropout, packed sequences)
    wg = cpp.BwdConfig.parse("q4x64kvwg2x64")
    assert (wg.kv_wg, wg.kv_warps, wg.kv_rows, str(wg)) == (2, 8, 64, "q4x64kvwg2x64")
    assert max(wg.shared_bytes(d, part) for d in (64, 128) for part in (1, 2)) <= 227 * 1024
    with pytest.raises(ValueError, match="not a flash_bwd_mma.cu division"):
        cpp.BwdConfig.parse("q4x64kvwg2x64m2")
    for dtype, d, variant in (("float32", 64, {}), ("bfloat16", 96, {}), ("bfloat16", 64, {"mask": 1}),
                              ("float16", 128, {"alibi": True}), ("bfloat16", 64, {"dropout": True}),
                              ("bfloat16", 128, {"varlen": True})):
        with pytest.raises(ValueError, match="wgmma dQ and dK/dV kernels"):
            cpp.flash_bwd_kernels(dtype, d, wg, featured=bool(variant), **variant)
    # rings of stages (the s suffix): named and parsed one to one, each kernel named by its own half (so
    # that divisions sharing a kernel compile it once), their shared memory counted with the stages;
    # stages on an mma.sync kernel, out of 2-4, or past a block's shared memory are refused
    ring = cpp.BwdConfig.parse("qwg2x128s2kvwg2x64s3")
    assert (ring.dq_stages, ring.kv_stages, ring.part_name(1), ring.part_name(2)) == (2, 3, "qwg2x128s2", "kvwg2x64s3")
    assert str(ring) == "qwg2x128s2kvwg2x64s3" and ring.shared_bytes(128, 1) == cpp.BwdConfig.parse(
        "qwg2x128kvwg2x64").shared_bytes(128, 1)
    assert ring.shared_bytes(128, 2) == (2 * 128 + 2 * 3 * 64) * 128 * 2 + 8 * 3 * 64 + 1024
    for name in ("q4x64s3kv4x64", "q4x64kv4x64s2", "qwg1x64m2s3kvwg1x64"):
        with pytest.raises(ValueError, match="not a flash_bwd_mma.cu division"):
            cpp.BwdConfig.parse(name)
    for name, why in (("qwg2x128s3kvwg2x64", "shared memory within"), ("qwg1x64s5kvwg1x64", "stages \\(2 to 4\\)")):
        with pytest.raises(ValueError, match=why):
            cpp.flash_bwd_kernels("bfloat16", 128, cpp.BwdConfig.parse(name))
    if SIMULATED:
        x = np.zeros((1, 2, 16), ml_dtypes.bfloat16)
        with pytest.raises(RuntimeError, match="simulator cannot run"):
            attnkern.attention_backward(x, x, x, x, x, x[..., 0], kernel="cuda.flash")


@half_gpu
@pytest.mark.parametrize("dtype", TC_DTYPES)
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_half_backward_by_flash_attentions_rule(dtype, causal):
    """Every head size, causal both alignments: within FlashAttention's rule; bit-identical
    run to run; torch autograd through attention gives the same gradients."""
    from test_triton import check_gradients

    for i, (lead, nq, nk, d) in enumerate(HALF_SHAPES):
        q, k, v, dout = _half_case(torch, dtype, lead, nq, nk, d, 10 * i)
        scale = 0.8 / d ** 0.5
        _, _, grads = _half_backward(q, k, v, dout, causal=causal, scale=scale)
        check_gradients(grads, q, k, v, dout, causal, scale, {}, (dtype, lead, nq, nk, d))
        again = _half_backward(q, k, v, dout, causal=causal, scale=scale)[2]
        leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        attnkern.attention(*leaves, kernel="cuda.flash", causal=causal, scale=scale).backward(dout)
        for g, a, leaf in zip(grads, again, leaves):
            assert torch.equal(g, a) and torch.equal(g, leaf.grad)


@half_gpu
@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_half_backward_features(dtype):
    """GQA and MQA (dk, dv summed over the group in order), bottom-right, windows, key lengths
    (a sequence with none: rows that see no key get 0), softcap, a negative scale: FlashAttention's rule."""
    from test_triton import FEATURE_CASES, check_gradients

    cases = [*FEATURE_CASES, ((1, 4), 1, 90, 90, 32, True, {"scale": -0.3})]
    for i, (lead, h_kv, nq, nk, d, causal, feats) in enumerate(cases):
        q, k, v, dout = _half_case(torch, dtype, lead, nq, nk, d, 100 + 10 * i, kv_heads=h_kv)
        feats = dict(feats)
        scale = feats.pop("scale", 1 / d ** 0.5)
        _, lse, grads = _half_backward(q, k, v, dout, causal=causal, scale=scale, **feats)
        check_gradients(grads, q, k, v, dout, causal, scale, feats, (dtype, i))
        assert (grads[0][torch.isneginf(lse)] == 0).all()
        for b, n in enumerate(feats.get("key_lengths", [])):
            assert not grads[1][b, :, n:].any() and not grads[2][b, :, n:].any(), "padding gets no gradient"
        assert all(torch.equal(g, a) for g, a in zip(grads, _half_backward(q, k, v, dout, causal=causal,
                                                                            scale=scale, **feats)[2]))


@half_gpu
@pytest.mark.parametrize("dtype", TC_DTYPES)
@pytest.mark.parametrize("name", MASK_CASES)
def test_half_backward_masks(dtype, name):
    """Attention masks (bool, additive with -inf, with the features and ALiBi) on CUDA tensors:
    each gradient within twice the error of torch ops in the same dtype plus 2u of the largest."""
    from test_features import err

    kind, mshape, kw = MASK_CASES[name]
    q, k, v, dout = _half_case(torch, dtype, (2, 4), 70, 190, 64, zlib.crc32(name.encode()) % 1000, kv_heads=2)
    rng = np.random.default_rng(len(name))
    keep = rng.random(tuple({7: 70, 19: 190}.get(n, n) for n in mshape)) < 0.7  # MASK_CASES' nq, nk scaled
    if keep.ndim == 4 and keep.shape[2] > 1:
        keep[0, 0, 2] = False  # a row that sees no key
    mask = keep if kind == "bool" else (np.where(keep, rng.standard_normal(keep.shape), -np.inf) if kind == "neginf"
                                        else rng.standard_normal(keep.shape)).astype(np.float32)
    kw = dict(kw, attn_mask=mask)
    if kw.get("key_lengths"):
        kw["key_lengths"] = [10 * n for n in kw["key_lengths"]]
    host = [x.double().cpu().numpy() for x in (q, k, v, dout)]
    refs = attnkern.reference_backward(*host, **dict(kw, attn_mask=mask if kind == "bool" else mask.astype(np.float64)))
    peer = _mask_peer(q, k, v, dout, mask, kw)[1:]
    _, lse, grads = _half_backward(q, k, v, dout, **dict(kw, attn_mask=torch.from_numpy(mask).cuda()))
    # float32: the one table's bound as the margin, as check_gradients (torch's float32 error may be far below it)
    u = tolerance(np.float32) / 2 if dtype == "float32" else UNIT_ROUNDOFF[dtype]
    for what, r, p, a in zip(("dq", "dk", "dv"), refs, peer, grads):
        a = a.double().cpu().numpy()
        assert np.isfinite(a).all(), what
        limit = 2 * err(p, r) + 2 * u * max(1.0, np.abs(r).max())
        assert err(a, r) <= limit, f"{what}: {err(a, r):.3g} > {limit:.3g}"
    assert (grads[0][torch.isneginf(lse)] == 0).all()


@half_gpu
@pytest.mark.parametrize("dtype", TC_DTYPES)
def test_half_backward_block_shares(dtype):
    """out and lse of whole rows with k, v holding one block of keys (ring attention): dk and dv
    of each block are the whole call's, dq the sum of the blocks' (the lse is corrected only within
    its dtype's rounding, never rescaled to the block: a block holding half the weight stays half)."""
    q, k, v, dout = _half_case(torch, dtype, (1, 2), 300, 256, 64, 7)
    out, lse, whole = _half_backward(q, k, v, dout)
    blocks = [attnkern.attention_backward(q, k[..., s, :].contiguous(), v[..., s, :].contiguous(), out, dout, lse,
                                          kernel="cuda.flash") for s in (slice(0, 128), slice(128, 256))]
    pieces = (blocks[0][0].float() + blocks[1][0].float(), torch.cat([b[1] for b in blocks], -2),
              torch.cat([b[2] for b in blocks], -2))
    for name, piece, w in zip(("dq", "dk", "dv"), pieces, whole):
        # the lse's rounding moves each P by up to a relative u |lse| (|lse| < 8 here); float32's
        # lse is used as it is, and the blocks' dq differ by their sums' order: the one table's bound
        limit = (tolerance(np.float32) if dtype == "float32" else 16 * UNIT_ROUNDOFF[dtype]) * float(w.abs().max())
        assert float((piece.float() - w.float()).abs().max()) <= limit, name


def test_wgmma_backward_routing(monkeypatch):
    """A wgmma division (Hopper) runs calls with GQA, causal alignments, windows, key lengths and
    the softcap; one with a mask, ALiBi, dropout or packed sequences runs the mma.sync kernels
    (cpp.flash_bwd_launches swaps the division before compiling anything)."""
    from types import SimpleNamespace

    from attnkern.backends.cuda import cpp
    from attnkern.backends.cuda.arrays import GpuArray

    class Compiled(Exception):
        pass

    seen = []

    def record(dtype, d, config, *args, **kw):
        seen.append(config)
        raise Compiled  # stop before the launches' arguments: only the division matters here

    monkeypatch.setattr(cpp, "flash_bwd_kernels", record)
    x = GpuArray((2, 64, 64), np.dtype(ml_dtypes.bfloat16), None, ptr=0)
    lse, scratch = GpuArray((2, 64), x.dtype, None, ptr=0), GpuArray((128,), np.float32, None, ptr=0)
    base = dict(mask_kind=0, alibi=None, dropout_p=0.0, cu_q=None)
    wg = cpp.BwdConfig.parse("qwg2x64kvwg2x64")
    for change, wgmma in (({}, True), ({"mask_kind": 1}, False), ({"alibi": object()}, False),
                          ({"dropout_p": 0.1}, False), ({"cu_q": object()}, False)):
        for feat in ((None, SimpleNamespace(**base)) if not change else (SimpleNamespace(**dict(base, **change)),)):
            seen.clear()
            with pytest.raises(Compiled):
                cpp.flash_bwd_launches(x, x, x, x, x, lse, x, x, x, scratch, scratch, False, 0.1, feat, wg)
            assert seen == [wg if wgmma else cpp.bwd_config(64, "bfloat16", wgmma=False)], (change, seen)


# the wgmma divisions (Hopper) the tests run, the defaults (cpp.BWD_WGMMA_DIVISIONS) among them: one
# and two warpgroups a block, 64- and 128-row/key tiles (a 128-row Q/dO tile only at D = 64: it spills above),
# double-buffered and in rings of 2-4 stages of whole-tile copies (the s suffix)
WGMMA_DIVISIONS = {64: ["qwg2x64kvwg2x64", "qwg1x64kvwg1x64", "qwg1x128kvwg1x128", "qwg2x128kvwg2x64",
                        "qwg1x128s2kvwg1x128s2", "qwg1x128s3kvwg1x128s3", "qwg1x64s3kvwg1x64s3", "qwg1x64s4kvwg1x64s4",
                        "qwg2x128s3kvwg2x128s3", "qwg1x128s2kvwg1x64s4"],
                   128: ["qwg2x64kvwg2x64", "qwg1x64kvwg1x64", "qwg1x128kvwg1x64", "qwg2x128kvwg2x64",
                         "qwg2x128s2kvwg2x64s2", "qwg2x64s3kvwg2x64s3", "qwg2x128s2kvwg2x64s3", "qwg2x64s4kvwg2x64s4",
                         "qwg2x128s2kvwg2x64s4", "qwg2x128s2kvwg1x64s2"]}


@half_gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_backward_wgmma_divisions(dtype, d):
    """On Hopper both kernels run on wgmma by default (cpp.BWD_WGMMA_DIVISIONS) at D = 64 and 128. Each wgmma
    division and the mma.sync one (cpp.flash_bwd_mma with the division) on the same arrays, with
    GQA, both causal alignments, key lengths, a window, the softcap and a negative scale: within
    FlashAttention's rule and bit-identical run to run."""
    from attnkern.backends.cuda import cpp
    from test_triton import check_gradients

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma is Hopper's (sm_90a)")
    default = cpp.bwd_config(d, dtype)
    assert default.kv_wg > 0 and default.dq_wg > 0 and str(default) in WGMMA_DIVISIONS[d]
    assert cpp.bwd_config(96, dtype).kv_wg == 0 and cpp.bwd_config(64, "float32").kv_wg == 0
    cases = [((1, 2), 2, 700, 700, 64, False, {}), ((1, 2), 2, 333, 500, 128, True, {}),
             ((2, 4), 2, 300, 300, 64, "bottom_right", {"key_lengths": [300, 129]}),
             ((1, 4), 1, 260, 200, 128, False, {"window": (70, 20), "softcap": 8.0}),
             ((1, 2), 2, 1024, 1024, 64, True, {}), ((1, 2), 2, 1024, 1024, 128, False, {})]
    for i, (lead, h_kv, nq, nk, case_d, causal, feats) in enumerate(cases):
        if case_d != d:
            continue
        q, k, v, dout = _half_case(torch, dtype, lead, nq, nk, d, 300 + 10 * i, kv_heads=h_kv)
        scale = -0.9 / d ** 0.5 if i == 3 else 1 / d ** 0.5
        out, lse = attnkern.attention(q, k, v, kernel="cuda.flash", causal=causal, scale=scale, return_lse=True,
                                      **feats)
        for name in [str(cpp.bwd_config(d, dtype, wgmma=False)), *WGMMA_DIVISIONS[d]]:
            config = cpp.BwdConfig.parse(name)
            runs = [_flash_bwd_with(cpp, config, q, k, v, out, dout, lse, causal, scale, feats) for _ in range(2)]
            check_gradients(runs[0], q, k, v, dout, causal, scale, feats, (dtype, i, name))
            assert all(torch.equal(g, a) for g, a in zip(*runs)), name


def test_fused_backward_routing(monkeypatch):
    """cpp.BWD_DETERMINISTIC False takes the fused backward only where it has the call (Hopper's wgmma,
    float16/bfloat16 at D = 64, no mask, ALiBi, dropout or packed sequences); its three launches
    (first kernel, dK/dV/dQ, dQ's conversion) and the scratch they share; a division it lacks is a
    ValueError before anything compiles."""
    from types import SimpleNamespace

    from attnkern.backends.cuda import cpp
    from attnkern.backends.cuda.arrays import GpuArray

    monkeypatch.setattr(cpp, "wgmma_applies", lambda d, dv: d == dv and d in (64, 128))
    monkeypatch.setattr(cpp, "BWD_DETERMINISTIC", True)
    assert cpp.bwd_fused_config(64, "bfloat16") is None
    for text, value in (("", True), ("1", True), (" 0 ", False)):  # ATTNKERN_BWD_DETERMINISTIC, read at import
        monkeypatch.setenv("ATTNKERN_BWD_DETERMINISTIC", text)
        assert cpp._deterministic_from_env() is value
    monkeypatch.delenv("ATTNKERN_BWD_DETERMINISTIC")
    assert cpp._deterministic_from_env() is True  # the default
    for text in ("no", "false", "2"):
        monkeypatch.setenv("ATTNKERN_BWD_DETERMINISTIC", text)
        with pytest.raises(ValueError, match="ATTNKERN_BWD_DETERMINISTIC must be 0"):
            cpp._deterministic_from_env()
    monkeypatch.setattr(cpp, "BWD_DETERMINISTIC", False)
    fused = cpp.BwdConfig.parse(cpp.BWD_FUSED_DIVISIONS[64])
    base = dict(mask_kind=0, alibi=None, dropout_p=0.0, cu_q=None)
    assert cpp.bwd_fused_config(64, "bfloat16") == fused == cpp.bwd_fused_config(64, "float16",
                                                                                  SimpleNamespace(**base))
    assert cpp.bwd_fused_config(128, "bfloat16") is None and cpp.bwd_fused_config(64, "float32") is None
    for change in ({"mask_kind": 1}, {"alibi": object()}, {"dropout_p": 0.1}, {"cu_q": object()}):
        assert cpp.bwd_fused_config(64, "bfloat16", SimpleNamespace(**dict(base, **change))) is None, change
    monkeypatch.setattr(cpp, "BWD_WGMMA", False)
    assert cpp.bwd_fused_config(64, "bfloat16") is None
    for bad, d in (("qwg1x128s2kvwg2x64s2", 64), ("qwg1x128s2kvwg1x64s2", 128)):
        with pytest.raises(ValueError, match="fused backward takes"):
            cpp.flash_bwd_fused_kernels("bfloat16", d, cpp.BwdConfig.parse(bad))
    for bad in ((("FUSEDQ_SKIP",),), (("FUSEDQ SKIP", 1),), (("FUSEDQ_SKIP", "1; bad"),)):
        monkeypatch.setattr(cpp, "BWD_FUSED_STUDY", bad)
        with pytest.raises(ValueError, match="BWD_FUSED_STUDY must be"):
            cpp.flash_bwd_fused_kernels("bfloat16", 64, fused)
    monkeypatch.setattr(cpp, "BWD_FUSED_STUDY", ())
    # scratch: lse and delta, then dQ's float32 accumulator from a 16-byte boundary (whole tiles of 64
    # rows a query head: batch ceil(nq / 64) 64 d floats at most), within the elements asked for
    for batch, nq in ((1, 1), (3, 1), (1, 64), (2, 65), (4, 300)):
        rows = batch * nq
        lse32, delta, dq32 = cpp.bwd_scratch_views(1024, rows, None, 64, batch)
        assert delta.ptr == 1024 + 4 * rows and dq32.ptr % 16 == 0 and dq32.ptr >= delta.ptr + 4 * rows
        assert dq32.shape[0] >= batch * -(-nq // 64) * 64 * 64
        assert (dq32.ptr - 1024) // 4 + dq32.shape[0] == cpp.bwd_scratch_elems(rows, 64, True, batch)
        assert cpp.bwd_scratch_views(1024, rows)[2] is None and cpp.bwd_scratch_elems(rows, 64, False) == 2 * rows
    monkeypatch.setattr(cpp, "flash_bwd_fused_kernels", lambda dtype, d, config, featured: ("first", "fused", "conv"))
    x = GpuArray((2, 300, 64), np.dtype(ml_dtypes.bfloat16), None, ptr=0)
    lse, small = GpuArray((2, 300), x.dtype, None, ptr=0), GpuArray((600,), np.float32, None, ptr=0)
    dq32 = GpuArray(((600 + 63 * 2) * 64,), np.float32, None, ptr=4800)
    launches = cpp.flash_bwd_launches(x, x, x, x, x, lse, x, x, x, small, small, True, 0.125, None, fused, dq32)
    pairs = 2 * 5 * 64 * 32  # two heads' 5 tiles of 64 rows, 64 x 64 / 2 pairs each
    assert [(kernel, grid, block) for kernel, grid, block, _ in launches] == [
        ("first", (5, 2), 128), ("fused", (5, 2), 128), ("conv", (-(-pairs // cpp.CONVERT_THREADS),), 256)]
    assert launches[0][3] == launches[1][3] and launches[0][3][6].array is dq32  # dQ's rows: the float32 scratch
    assert [a.array for a in launches[2][3][:2]] == [dq32, x]
    assert launches[2][3][2:] == (pairs, np.float32(0.125), np.int32(300))


@half_gpu
def test_half_backward_fused(monkeypatch):
    """cpp.BWD_DETERMINISTIC False on Hopper: the fused backward (dQ added in float32 by bulk reductions) at D = 64,
    both dtypes, with GQA, both causal alignments, key lengths, a window, the softcap and a negative
    scale: within FlashAttention's rule; dK and dV bit-identical run to run (dQ need not be); and through
    torch autograd (the prepared plans, made again after the switch)."""
    import attnkern.backends.cuda as cuda_backend
    from attnkern.backends.cuda import cpp
    from test_triton import check_gradients

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("wgmma is Hopper's (sm_90a)")
    monkeypatch.setattr(cpp, "BWD_DETERMINISTIC", False)
    taken = []
    real = cpp._fused_launches
    monkeypatch.setattr(cpp, "_fused_launches", lambda *a: taken.append(1) or real(*a))
    cuda_backend.forget_plans()
    cases = [((1, 2), 2, 700, 700, False, {}), ((2, 4), 2, 300, 300, "bottom_right", {"key_lengths": [300, 129]}),
             ((1, 4), 1, 260, 200, False, {"window": (70, 20), "softcap": 8.0}), ((1, 2), 2, 1024, 1024, True, {}),
             ((2, 2), 2, 333, 500, True, {})]
    try:
        for dtype in ("bfloat16", "float16"):
            for i, (lead, h_kv, nq, nk, causal, feats) in enumerate(cases):
                q, k, v, dout = _half_case(torch, dtype, lead, nq, nk, 64, 700 + 10 * i, kv_heads=h_kv)
                scale = -0.9 / 8 if i == 2 else 1 / 8
                out, lse = attnkern.attention(q, k, v, kernel="cuda.flash", causal=causal, scale=scale,
                                              return_lse=True, **feats)
                taken.clear()
                runs = [_flash_bwd_with(cpp, None, q, k, v, out, dout, lse, causal, scale, feats) for _ in range(2)]
                assert len(taken) == 2, "the fused backward did not run"
                check_gradients(runs[0], q, k, v, dout, causal, scale, feats, (dtype, i, "fused"))
                assert torch.equal(runs[0][1], runs[1][1]) and torch.equal(runs[0][2], runs[1][2]), (dtype, i)
            # torch autograd: the custom op's backward through a plan made with the switch off
            q, k, v, dout = _half_case(torch, dtype, (1, 4), 1000, 1000, 64, 900, kv_heads=2)
            leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
            taken.clear()
            attnkern.attention(*leaves, kernel="cuda.flash", causal=True).backward(dout)
            assert taken, "the fused backward did not run through autograd"
            check_gradients([x.grad for x in leaves], q, k, v, dout, True, 1 / 8, {}, (dtype, "autograd"))
    finally:
        cuda_backend.forget_plans()  # later tests' plans: the deterministic kernels again


def _flash_bwd_with(cpp, config, q, k, v, out, dout, lse, causal, scale, feats):
    """cpp.flash_bwd_mma with this division on torch CUDA tensors (batch, heads, n, d) and the
    features feats (window, key_lengths, softcap; GQA from the shapes): (dq, dk, dv)."""
    import ml_dtypes

    from attnkern import _registry
    from attnkern.backends.cuda import launch
    from attnkern.backends.cuda.arrays import GpuArray

    dtypes = {torch.bfloat16: np.dtype(ml_dtypes.bfloat16), torch.float16: np.dtype(np.float16),
              torch.float32: np.dtype(np.float32)}

    def flat(x):  # a GpuArray over the tensor's memory, heads folded into the batch
        shape = (-1, *x.shape[-2:]) if x.dim() == 4 else (-1, x.shape[-1])
        y = x.reshape(shape)
        return GpuArray(tuple(y.shape), dtypes[x.dtype], None, ptr=y.data_ptr(), owner=y)

    rows, group = q.shape[0] * q.shape[1], q.shape[1] // k.shape[1]
    left, right = feats.get("window", (None, None))
    lengths = feats.get("key_lengths")
    features = _registry.Features(
        kv_group=group, align="bottom_right" if causal == "bottom_right" else "top_left",
        window_left=-1 if left is None else left, window_right=-1 if right is None or causal else right,
        key_lengths=None if lengths is None else np.asarray(lengths, np.int64), softcap=feats.get("softcap", 0.0))
    feat = launch.KernelFeatures.of(features, rows, dtypes[q.dtype]) if features.needs() else None
    grads = [torch.empty_like(x) for x in (q, k, v)]
    cpp.flash_bwd_mma(*(flat(x) for x in (q, k, v, out, dout, lse)), *(flat(g) for g in grads), bool(causal),
                      scale, feat, config)
    torch.cuda.synchronize()
    return grads


# float32 (3xTF32) divisions the tests run, the defaults first: at D = 128 the 8-row Q/dO tiles of the
# default before, 16-row ones in 8 warps, and dK and dV's columns in slices (c2, 32-row tiles); at D = 64
# the same tiles whole and sliced (the same bits), and in 4 slices
F32_DIVISIONS = {64: ["q4x64kv4x32", "q4x64kv4x32c2", "q8x32kv8x16c4"],
                 128: ["q8x32kv4x16", "q8x32kv8x8", "q8x32kv8x16", "q8x32kv8x32c2"]}


@half_gpu
@pytest.mark.parametrize("d", [64, 128])
def test_float32_backward_divisions(d):
    """Each float32 division (3xTF32) on the same arrays, with GQA, both causal alignments, key
    lengths, a window and the softcap: within FlashAttention's rule and bit-identical run to run;
    a division and its column slices (the same tiles) give the same bits."""
    from attnkern.backends.cuda import cpp
    from test_triton import check_gradients

    assert str(cpp.bwd_config(d, "float32")) in F32_DIVISIONS[d]
    cases = [((1, 2), 2, 700, 700, False, {}), ((1, 2), 1, 333, 500, True, {}),
             ((2, 4), 2, 300, 300, "bottom_right", {"key_lengths": [300, 129]}),
             ((1, 4), 1, 260, 200, False, {"window": (70, 20), "softcap": 8.0})]
    for i, (lead, h_kv, nq, nk, causal, feats) in enumerate(cases):
        q, k, v, dout = _half_case(torch, "float32", lead, nq, nk, d, 500 + 10 * i, kv_heads=h_kv)
        scale = 1 / d ** 0.5
        out, lse = attnkern.attention(q, k, v, kernel="cuda.flash", causal=causal, scale=scale, return_lse=True,
                                      **feats)
        bits = {}
        for name in F32_DIVISIONS[d]:
            config = cpp.BwdConfig.parse(name)
            runs = [_flash_bwd_with(cpp, config, q, k, v, out, dout, lse, causal, scale, feats) for _ in range(2)]
            check_gradients(runs[0], q, k, v, dout, causal, scale, feats, ("float32", i, name))
            assert all(torch.equal(g, a) for g, a in zip(*runs)), name
            bits[name] = runs[0]
        if d == 64:
            assert all(torch.equal(g, a) for g, a in zip(bits["q4x64kv4x32"], bits["q4x64kv4x32c2"]))


@half_gpu
def test_half_backward_refusals():
    """Head sizes the tensor-core backward lacks are refused with what to use instead."""
    for d in (40, 272):
        q = torch.randn(1, 2, 8, d, device="cuda", dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="multiple of 16 up to 256.*triton.flash"):
            attnkern.attention_backward(q, q, q, q, q, q[..., 0], kernel="cuda.flash")


# (lead, H_kv, nq, nk, d, keywords): head sizes above 128 (flash_mma.cu's 64-row blocks, flash_bwd_mma.cu's
# dK/dV column slices; 208 = 13 x 16: the second slice's last 16 columns lie past D), partial blocks,
# nq != nk, GQA, both causal alignments, a window, key lengths, a mask, softcap, a negative scale, dropout
LARGE_HEAD_CASES = [
    ((1, 2), 2, 200, 200, 160, {"causal": True}),
    ((2, 2), 1, 130, 97, 192, {"causal": "bottom_right", "key_lengths": [97, 40]}),
    ((1, 4), 2, 300, 300, 256, {}),
    ((1, 2), 2, 257, 333, 256, {"causal": True, "window": (100, 0)}),
    ((2, 2), 2, 90, 150, 256, {"mask": True, "key_lengths": [150, 77]}),
    ((1, 2), 2, 140, 140, 256, {"causal": True, "dropout_p": 0.3, "dropout_seed": 5}),
    ((1, 2), 1, 100, 120, 208, {"softcap": 5.0, "scale": -0.1, "dropout_p": 0.2, "dropout_seed": 3}),
]


@half_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", range(len(LARGE_HEAD_CASES)))
def test_half_large_head_sizes(dtype, case):
    """float16/bfloat16 at D 160 to 256, forward and backward: out, dq, dk and dv within
    FlashAttention's rule (twice torch's error in the same dtype against float64, plus two
    roundings of the largest), with every feature the smaller head sizes have; bit-identical
    run to run; dK/dV on two column slices."""
    from test_features import err

    from attnkern.backends.cuda import cpp

    lead, h_kv, nq, nk, d, kw = LARGE_HEAD_CASES[case]
    q, k, v, dout = _half_case(torch, dtype, lead, nq, nk, d, 500 + 10 * case, kv_heads=h_kv)
    kw = dict(kw)
    mask = np.random.default_rng(case).random((nq, nk)) < 0.7 if kw.pop("mask", False) else None
    host = [x.double().cpu().numpy() for x in (q, k, v, dout)]
    ref_kw = kw if mask is None else dict(kw, attn_mask=mask)
    refs = [attnkern.reference(*host[:3], **ref_kw), *attnkern.reference_backward(*host, **ref_kw)]
    peer = _mask_peer(q, k, v, dout, np.ones((nq, nk), bool) if mask is None else mask, kw)
    call = kw if mask is None else dict(kw, attn_mask=torch.from_numpy(mask).cuda())
    out, lse, grads = _half_backward(q, k, v, dout, **call)
    u = UNIT_ROUNDOFF[dtype]
    for what, r, p, a in zip(("out", "dq", "dk", "dv"), refs, peer, (out, *grads)):
        a = a.double().cpu().numpy()
        assert np.isfinite(a).all(), what
        limit = 2 * err(p, r) + 2 * u * max(1.0, np.abs(r).max())
        assert err(a, r) <= limit, f"{what} D={d}: {err(a, r):.3g} > {limit:.3g}"
    again = _half_backward(q, k, v, dout, **call)
    assert all(torch.equal(x, y) for x, y in zip((out, lse, *grads), (again[0], again[1], *again[2])))
    assert cpp.bwd_config(d, dtype).kv_split == 2


@half_gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_large_head_varlen(dtype):
    """Packed sequences (host arrays, one launch each way) at D = 256, causal, GQA, an empty
    sequence: out and the gradients of each sequence within FlashAttention's rule against
    float64 and torch."""
    from test_features import err
    from test_varlen import per_sequence

    lens_q, lens_k, heads, heads_kv, d = [70, 0, 130], [90, 40, 130], 4, 2, 256
    rng = np.random.default_rng(7)
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    half = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    q, k, v, dout = (rng.standard_normal(s).astype(half) for s in ((cu_q[-1], heads, d), (cu_k[-1], heads_kv, d),
                                                                   (cu_k[-1], heads_kv, d), (cu_q[-1], heads, d)))
    out, lse = attnkern.attention_varlen(q, k, v, cu_q, cu_k, kernel="cuda.flash", return_lse=True, causal=True)
    grads = attnkern.attention_varlen_backward(q, k, v, out, dout, lse, cu_q, cu_k, kernel="cuda.flash", causal=True)
    tq, tk, tv, tdo = (torch.from_numpy(x.astype(np.float32)).cuda().to(getattr(torch, dtype)) for x in (q, k, v, dout))
    host = [x.astype(np.float64) for x in (q, k, v, dout)]
    ref, _, ref_grads = per_sequence(*host[:3], cu_q, cu_k, host[3], causal=True)
    ours, theirs = np.zeros(4), np.zeros(4)
    for s in range(len(lens_q)):
        if lens_q[s] == 0:
            continue
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        part = [x[sl].transpose(0, 1)[None] for x, sl in ((tq, rows), (tk, keys), (tv, keys), (tdo, rows))]
        peer = _mask_peer(*part, np.ones((lens_q[s], lens_k[s]), bool), {"causal": True})
        for i, (a, r, sl) in enumerate(zip((out, *grads), (ref, *ref_grads), (rows, rows, keys, keys))):
            r = r[sl].transpose(1, 0, 2)[None]
            ours[i] = max(ours[i], err(np.asarray(a[sl], np.float64).transpose(1, 0, 2)[None], r))
            theirs[i] = max(theirs[i], err(peer[i], r))
    top = max(1.0, np.abs(ref).max(), *(np.abs(g).max() for g in ref_grads))
    for what, e, t in zip(("out", "dq", "dk", "dv"), ours, theirs):
        assert e <= 2 * t + 2 * UNIT_ROUNDOFF[dtype] * top, f"{what}: {e:.3g} > 2 x {t:.3g} + margin"


@half_gpu
@pytest.mark.parametrize("causal", [False, True])
def test_float32_backward_paths(monkeypatch, causal):
    """float32 runs the tensor-core backward (3xTF32) with tensor_cores=1, the default, where it
    takes the call, and the Numba kernels with tensor_cores=0, with dropout and for addresses it
    cannot read 16 bytes at a time: each within FlashAttention's rule and the table's bound; the
    tensor-core gradients within a few times the exact float32 FMAs' error."""
    from attnkern.backends.cuda import cpp
    from test_triton import _host, check_gradients

    calls = []
    real = cpp.flash_bwd_mma
    monkeypatch.setattr(cpp, "flash_bwd_mma", lambda *a, **kw: calls.append(a[0].dtype) or real(*a, **kw))
    q, k, v, dout = _half_case(torch, "float32", (2, 2), 333, 290, 64, 5)
    scale = 0.7 / 8
    refs = attnkern.reference_backward(*(_host(x) for x in (q, k, v, dout)), causal=causal, scale=scale)
    errors = {}
    for tc in (1, 0):
        calls.clear()
        _, _, grads = _half_backward(q, k, v, dout, causal=causal, scale=scale, tensor_cores=tc)
        assert calls == ([np.float32] if tc else []), tc
        check_gradients(grads, q, k, v, dout, causal, scale, {}, ("float32", tc))
        errors[tc] = [float(np.abs(_host(g) - r).max() / np.abs(r).max()) for g, r in zip(grads, refs)]
    for name, e1, e0 in zip(("dq", "dk", "dv"), errors[1], errors[0]):
        assert e1 <= 4 * e0 + 1e-6, f"{name}: 3xTF32 {e1:.3g} vs float32 FMAs {e0:.3g}"
    # an offset view (not 16-byte aligned) and dropout: the Numba kernels, still right
    calls.clear()
    qo = torch.empty(q.numel() + 1, device="cuda")[1:].view_as(q).copy_(q)
    _, _, grads = _half_backward(qo, k, v, dout, causal=causal, scale=scale)
    assert calls == []
    check_gradients(grads, qo, k, v, dout, causal, scale, {}, ("float32", "offset"))
    out, lse = attnkern.attention(q, k, v, kernel="cuda.flash", causal=causal, scale=scale, return_lse=True,
                                  dropout_p=0.1, dropout_seed=3)
    attnkern.attention_backward(q, k, v, out, dout, lse, kernel="cuda.flash", causal=causal, scale=scale,
                                dropout_p=0.1, dropout_seed=3)
    assert calls == []
