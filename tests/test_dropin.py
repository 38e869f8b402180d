"""attnkern.sdpa against torch's scaled_dot_product_attention, and flash_attn_func /
flash_attn_varlen_func against the float64 reference with FlashAttention's semantics
(bottom-right causal and windows, softcap), forward and gradients, on fresh random
inputs (the seed printed for a rerun). Tests that need attention masks or dropout
run once attnkern.attention takes attn_mask."""

import inspect

import numpy as np
import pytest

import attnkern

torch = pytest.importorskip("torch")
F = torch.nn.functional

MASKS = "attn_mask" in inspect.signature(attnkern.attention).parameters
needs_masks = pytest.mark.skipif(not MASKS, reason="attnkern.attention has no attn_mask / dropout_p yet")
ALIBI = "alibi_slopes" in inspect.signature(attnkern.attention).parameters


@pytest.fixture
def rng():
    seed = np.random.SeedSequence().entropy
    print(f"seed {seed}")
    torch.manual_seed(seed % 2**63)
    return np.random.default_rng(seed)


def tensors(rng, *shapes, dtype=torch.float32, grad=True):
    return [torch.tensor(rng.standard_normal(s), dtype=dtype, requires_grad=grad) for s in shapes]


def grads_of(fn, inputs, dout):
    for x in inputs:
        x.grad = None
    out = fn(*inputs)
    out.backward(dout)
    return out.detach(), [x.grad.clone() for x in inputs]


def assert_close(got, want, atol, rtol=1e-4):
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


# ---- sdpa -----------------------------------------------------------------------------------------

SDPA_CASES = [  # (B, H, H_kv, Nq, Nk, D, Dv, is_causal, scale)
    (2, 4, 4, 17, 17, 16, 16, False, None),
    (2, 4, 4, 17, 17, 16, 8, True, None),
    (1, 6, 2, 9, 23, 8, 8, True, 0.3),
    (3, 4, 1, 1, 30, 32, 32, False, 0.125),
    (2, 2, 2, 25, 11, 8, 8, True, None),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", SDPA_CASES, ids=str)
def test_sdpa_matches_torch(rng, case, dtype):
    b, h, hkv, nq, nk, d, dv, causal, scale = case
    q, k, v = tensors(rng, (b, h, nq, d), (b, hkv, nk, d), (b, hkv, nk, dv), dtype=dtype)
    dout = torch.tensor(rng.standard_normal((b, h, nq, dv)), dtype=dtype)
    kw = {"is_causal": causal, "scale": scale, "enable_gqa": hkv != h}
    got, ggot = grads_of(lambda q, k, v: attnkern.sdpa(q, k, v, **kw), (q, k, v), dout)
    want, gwant = grads_of(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw), (q, k, v), dout)
    assert got.dtype == dtype and got.shape == want.shape
    atol = 2e-5 if dtype == torch.float32 else 1e-12
    assert_close(got, want, atol)
    for a, b_ in zip(ggot, gwant):
        assert_close(a, b_, 4 * atol)


def test_sdpa_more_leading_dims_and_numpy(rng):
    q, k, v = tensors(rng, (2, 3, 2, 7, 8), (2, 3, 2, 9, 8), (2, 3, 2, 9, 8), grad=False)
    assert_close(attnkern.sdpa(q, k, v), F.scaled_dot_product_attention(q, k, v), 2e-5)
    qn, kn, vn = (x.numpy() for x in (q[0, 0], k[0, 0], v[0, 0]))
    out = attnkern.sdpa(qn, kn, vn, is_causal=True)
    assert isinstance(out, np.ndarray)
    np.testing.assert_allclose(out, attnkern.reference(qn, kn, vn, causal=True), atol=2e-5)


def test_sdpa_refuses_as_torch_does(rng):
    q, k, v = tensors(rng, (1, 4, 5, 8), (1, 2, 6, 8), (1, 2, 6, 8), grad=False)
    mask = torch.ones(5, 6, dtype=torch.bool)
    for fn in (F.scaled_dot_product_attention, attnkern.sdpa):
        with pytest.raises(RuntimeError):  # a mask with is_causal
            fn(q, k, k.repeat(1, 2, 1, 1)[:, :4], attn_mask=mask, is_causal=True)
        with pytest.raises(RuntimeError):  # fewer k/v heads without enable_gqa
            fn(q, k, v)
    with pytest.raises(RuntimeError, match="enable_gqa=True"):
        attnkern.sdpa(q, k, v)
    with pytest.raises(ValueError, match="dropout_p"):
        attnkern.sdpa(q, k, v, dropout_p=1.5, enable_gqa=True)


@pytest.mark.skipif(MASKS, reason="attnkern.attention takes attn_mask")
def test_sdpa_refuses_a_mask_clearly_without_mask_support(rng):
    q, k, v = tensors(rng, (1, 2, 5, 8), (1, 2, 6, 8), (1, 2, 6, 8), grad=False)
    with pytest.raises(NotImplementedError, match="attn_mask"):
        attnkern.sdpa(q, k, v, attn_mask=torch.ones(5, 6, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="dropout_p"):
        attnkern.sdpa(q, k, v, dropout_p=0.1)


MASK_SHAPES = [(5, 6), (2, 1, 5, 6), (1, 3, 1, 6), (2, 3, 5, 6)]


@needs_masks
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("shape", MASK_SHAPES, ids=str)
@pytest.mark.parametrize("gqa", [False, True])
def test_sdpa_masks_match_torch(rng, kind, shape, gqa):
    hkv = 1 if gqa else 3
    q, k, v = tensors(rng, (2, 3, 5, 8), (2, hkv, 6, 8), (2, hkv, 6, 8))
    if kind == "bool":
        mask = torch.tensor(rng.random(shape) < 0.7)
    else:
        mask = torch.tensor(rng.standard_normal(shape), dtype=torch.float32)
    dout = torch.randn(2, 3, 5, 8)
    kw = {"attn_mask": mask, "enable_gqa": gqa, "scale": 0.4}
    got, ggot = grads_of(lambda q, k, v: attnkern.sdpa(q, k, v, **kw), (q, k, v), dout)
    want, gwant = grads_of(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw), (q, k, v), dout)
    assert_close(got, want, 2e-5)
    for a, b in zip(ggot, gwant):
        assert_close(a, b, 1e-4)


@needs_masks
def test_sdpa_dropout_statistics(rng):
    """Dropout keeps each weight with probability 1 - p and scales it by 1 / (1 - p): the
    mean over many draws is the output without dropout; one seed gives one result."""
    q, k, v = tensors(rng, (1, 2, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16), grad=False)
    plain = attnkern.sdpa(q, k, v)
    torch.manual_seed(1)
    a = attnkern.sdpa(q, k, v, dropout_p=0.3)
    torch.manual_seed(1)
    assert torch.equal(a, attnkern.sdpa(q, k, v, dropout_p=0.3))
    draws = torch.stack([attnkern.sdpa(q, k, v, dropout_p=0.3) for _ in range(400)])
    assert not torch.equal(draws[0], draws[1])
    spread = draws.std(0) / 400 ** 0.5
    assert ((draws.mean(0) - plain).abs() <= 5 * spread + 1e-6).float().mean() > 0.99


# ---- flash_attn_func / flash_attn_varlen_func ------------------------------------------------------

def fa_reference(q, k, v, dout, *, causal, window, softcap, scale, alibi_slopes=None):
    """FlashAttention's semantics through the float64 reference: (B, S, H, D) swapped to
    (B, H, S, D); causal and the window aligned bottom-right."""
    nq, nk = q.shape[1], k.shape[1]
    left, right = (None if w < 0 else w for w in window)
    if causal:
        right = None
    kw = {"causal": "bottom_right" if causal else False, "scale": scale, "softcap": softcap or None}
    if alibi_slopes is not None:
        kw["alibi_slopes"] = alibi_slopes
    if left is not None or right is not None:
        if not causal:  # the reference's window without causal is top-left aligned
            left = None if left is None else left - (nk - nq)
            right = None if right is None else right + (nk - nq)
        kw["window"] = (left, right)
    sw = [np.swapaxes(x.detach().double().numpy(), 1, 2) for x in (q, k, v)]
    out, lse = attnkern.reference(*sw, return_lse=True, **kw)
    grads = attnkern.reference_backward(*sw, np.swapaxes(dout.double().numpy(), 1, 2), **kw)
    return np.swapaxes(out, 1, 2), lse, [np.swapaxes(g, 1, 2) for g in grads]


FA_CASES = [  # (B, Nq, Nk, H, H_kv, D, causal, window, softcap, scale)
    (2, 13, 13, 4, 4, 16, False, (-1, -1), 0.0, None),
    (2, 7, 19, 4, 2, 16, True, (-1, -1), 0.0, None),
    (1, 1, 24, 4, 1, 8, True, (-1, -1), 0.0, 0.5),
    (2, 16, 16, 2, 2, 8, True, (4, -1), 0.0, None),
    (2, 16, 16, 2, 2, 8, False, (3, 2), 5.0, None),
    (1, 6, 20, 2, 2, 8, True, (5, 7), 0.0, None),
    (1, 9, 12, 2, 2, 8, False, (6, 2), 0.0, None),
]


@pytest.mark.parametrize("case", FA_CASES, ids=str)
def test_flash_attn_func_matches_reference(rng, case):
    b, nq, nk, h, hkv, d, causal, window, softcap, scale = case
    q, k, v = tensors(rng, (b, nq, h, d), (b, nk, hkv, d), (b, nk, hkv, d))
    dout = torch.tensor(rng.standard_normal((b, nq, h, d)), dtype=torch.float32)
    out, lse, probs = attnkern.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, window_size=window,
                                               softcap=softcap, return_attn_probs=True)
    assert out.shape == (b, nq, h, d) and out.is_contiguous() and probs is None
    assert lse.shape == (b, h, nq) and lse.dtype == torch.float32
    out.backward(dout)
    want, want_lse, want_grads = fa_reference(q, k, v, dout, causal=causal, window=window, softcap=softcap,
                                              scale=scale)
    np.testing.assert_allclose(out.detach().numpy(), want, atol=3e-5)
    np.testing.assert_allclose(lse.numpy(), want_lse, atol=3e-5)
    for x, g in zip((q, k, v), want_grads):
        np.testing.assert_allclose(x.grad.numpy(), g, atol=2e-4)


def test_flash_attn_func_numpy_and_refusals(rng):
    q, k, v = (rng.standard_normal((1, 5, 2, 8)).astype(np.float32) for _ in range(3))
    out = attnkern.flash_attn_func(q, k, v, causal=True)
    assert isinstance(out, np.ndarray) and out.shape == (1, 5, 2, 8)
    want = np.swapaxes(attnkern.reference(*(np.swapaxes(x, 1, 2) for x in (q, k, v)), causal=True), 1, 2)
    np.testing.assert_allclose(out, want, atol=2e-5)
    packed = attnkern.flash_attn_varlen_func(q[0], k[0], v[0], np.array([0, 2, 5]), np.array([0, 3, 5]), 3, 3,
                                             causal=True)
    assert isinstance(packed, np.ndarray) and packed.shape == (5, 2, 8)
    want = attnkern.reference(*(np.swapaxes(x[None, a:b], 1, 2) for x, a, b in ((q[0], 2, 5), (k[0], 3, 5),
                                                                              (v[0], 3, 5))), causal="bottom_right")
    np.testing.assert_allclose(packed[2:], np.swapaxes(want, 1, 2)[0], atol=2e-5)
    if not ALIBI:
        with pytest.raises(NotImplementedError, match="ALiBi"):
            attnkern.flash_attn_func(q, k, v, alibi_slopes=np.ones(2, np.float32))
    with pytest.raises(ValueError, match="batch, seqlen, heads, head_dim"):
        attnkern.flash_attn_func(q[0], k[0], v[0])
    with pytest.raises(NotImplementedError, match="window"):  # a band that misses some queries' diagonal
        attnkern.flash_attn_func(q[:, :2], k, v, window_size=(1, 0))


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (True, (3, 0)), (False, (8, 1))])
def test_flash_attn_varlen_func_matches_each_sequence(rng, causal, window):
    lq, lk = [3, 1, 6, 0], [3, 7, 9, 2]
    h, hkv, d = 4, 2, 8
    cu_q, cu_k = (torch.tensor(np.cumsum([0, *n]), dtype=torch.int32) for n in (lq, lk))
    q, k, v = tensors(rng, (sum(lq), h, d), (sum(lk), hkv, d), (sum(lk), hkv, d))
    dout = torch.tensor(rng.standard_normal((sum(lq), h, d)), dtype=torch.float32)
    out, lse, _ = attnkern.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal,
                                                  window_size=window, return_attn_probs=True)
    assert out.shape == (sum(lq), h, d) and lse.shape == (h, sum(lq))
    out.backward(dout)
    for b in range(len(lq)):
        if lq[b] == 0:
            continue
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        want, want_lse, grads = fa_reference(q[None, sq], k[None, sk], v[None, sk], dout[None, sq], causal=causal,
                                             window=window, softcap=0.0, scale=None)
        np.testing.assert_allclose(out[sq].detach().numpy(), want[0], atol=3e-5)
        np.testing.assert_allclose(lse[:, sq].numpy(), want_lse[0], atol=3e-5)
        np.testing.assert_allclose(q.grad[sq].numpy(), grads[0][0], atol=2e-4)
        np.testing.assert_allclose(k.grad[sk].numpy(), grads[1][0], atol=2e-4)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        attnkern.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lq), 3)
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        attnkern.flash_attn_varlen_func(q, k, v, cu_q[:-1], cu_k, max(lq), max(lk))


@needs_masks
def test_flash_attn_func_dropout_is_seeded_by_torch(rng):
    q, k, v = tensors(rng, (1, 8, 2, 16), (1, 8, 2, 16), (1, 8, 2, 16), grad=False)
    torch.manual_seed(3)
    a = attnkern.flash_attn_func(q, k, v, dropout_p=0.2)
    torch.manual_seed(3)
    assert torch.equal(a, attnkern.flash_attn_func(q, k, v, dropout_p=0.2))
    assert not torch.equal(a, attnkern.flash_attn_func(q, k, v))


@pytest.mark.skipif(not ALIBI, reason="attnkern.attention has no alibi_slopes yet")
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_alibi_matches_reference(rng, causal):
    q, k, v = tensors(rng, (2, 6, 4, 8), (2, 10, 2, 8), (2, 10, 2, 8))
    dout = torch.tensor(rng.standard_normal((2, 6, 4, 8)), dtype=torch.float32)
    slopes = torch.tensor(rng.random((2, 4)), dtype=torch.float32)
    out = attnkern.flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes)
    out.backward(dout)
    want, _, grads = fa_reference(q, k, v, dout, causal=causal, window=(-1, -1), softcap=0.0, scale=None,
                                  alibi_slopes=slopes.numpy())
    np.testing.assert_allclose(out.detach().numpy(), want, atol=3e-5)
    for x, g in zip((q, k, v), grads):
        np.testing.assert_allclose(x.grad.numpy(), g, atol=2e-4)
    packed = attnkern.flash_attn_varlen_func(q.detach().reshape(12, 4, 8), k.detach().reshape(20, 2, 8),
                                             v.detach().reshape(20, 2, 8), torch.tensor([0, 6, 12]),
                                             torch.tensor([0, 10, 20]), 6, 10, causal=causal, alibi_slopes=slopes)
    np.testing.assert_allclose(packed.numpy(), want.reshape(12, 4, 8), atol=3e-5)
