"""attention()'s features through the public API (docs/features.md): grouped k/v
heads, causal alignment, sliding windows, key lengths, the softcap, and rows that
see no key.

Every kernel that claims a feature (kernel_info(name)["features"]) is checked
against the float64 oracle with the same features (attnkern.reference and
reference_backward), the oracle against a mask written here from FlashAttention's
rule, and gradients (attention_backward and torch autograd) by FlashAttention's
rule: each error at most twice that of torch computing the same thing in the same
dtype (scaled_dot_product_attention with an explicit boolean mask and enable_gqa;
torch ops for the softcap, which SDPA lacks), plus a few ulp of the values."""

import dataclasses
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnkern
from attnkern_bench.accuracy import conditioning, tolerance
from conftest import AVAILABLE, forced_isa

torch = pytest.importorskip("torch")
F = torch.nn.functional

WORDS = {"gqa": "grouped-query attention", "bottom_right": "bottom-right causal alignment",
         "window": "a sliding window", "key_lengths": "key padding", "softcap": "a logit softcap"}
FEATURED = [k for k in AVAILABLE if attnkern.kernel_info(k)["features"]]
DIFFERENTIABLE = [k for k in AVAILABLE if attnkern.kernel_info(k)["backward_features"]]


def widest(kernel, *arrays):
    """arrays as float64 where kernel takes float64, else as float32 (triton.flash on a
    GPU), and that dtype: the float64 checks run every kernel in the widest dtype it takes."""
    dtype = np.float64 if "float64" in attnkern.kernel_info(kernel)["dtypes"] else np.float32
    return [x.astype(dtype) for x in arrays], dtype


def visible(q_shape, nk, causal=False, window=None, key_lengths=None):
    """The mask (B, 1, nq, nk) by FlashAttention's rule: query i sees key j < len iff
    diag - left <= j <= diag + right, diag = i (top-left) or i + len - nq
    (causal="bottom_right"); causal sets right to 0; None is unbounded."""
    nq, batch = q_shape[-2], q_shape[0] if len(q_shape) == 4 else 1
    lengths = [nk] * batch if key_lengths is None else list(key_lengths)
    left, right = window if window is not None else (None, None)
    right = 0 if causal else right
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    mask = np.zeros((batch, 1, nq, nk), bool)
    for b, n in enumerate(lengths):
        diag = i + (n - nq if causal == "bottom_right" else 0)
        mask[b, 0] = (j < n) & (left is None or j >= diag - left) & (right is None or j <= diag + right)
    return mask if len(q_shape) == 4 else mask[0]


def inputs(shape, dtype, seed=0):
    """q (B, H, nq, d), k and v (B, H_kv, nk, d or dv), dout; shape (B, H, H_kv, nq, nk, d, dv),
    B None for 3-D (H, N, D) inputs."""
    b, h, hkv, nq, nk, d, dv = shape
    lead, kv_lead = ((h,), (hkv,)) if b is None else ((b, h), (b, hkv))
    rng = np.random.default_rng(seed)
    draw = lambda *s: rng.standard_normal(s).astype(dtype)  # noqa: E731
    return draw(*lead, nq, d), draw(*kv_lead, nk, d), draw(*kv_lead, nk, dv), draw(*lead, nq, dv)


CASES = {  # (B, H, H_kv, nq, nk, d, dv), features
    "gqa": ((2, 4, 2, 9, 13, 8, 6), {}),
    "mqa-causal": ((2, 3, 1, 11, 11, 8, 8), dict(causal=True)),
    "gqa-3d": ((None, 6, 2, 7, 12, 8, 8), dict(causal="bottom_right")),
    "decode": ((2, 4, 2, 1, 16, 8, 8), dict(causal="bottom_right")),
    "chunked-prefill": ((2, 4, 2, 6, 16, 8, 8), dict(causal="bottom_right")),
    "bottom-right-tall": ((1, 2, 2, 12, 5, 8, 8), dict(causal="bottom_right")),  # first 7 rows see nothing
    "window": ((2, 2, 2, 14, 14, 8, 8), dict(window=(3, 2))),
    "sliding-causal": ((1, 4, 2, 20, 20, 8, 8), dict(causal=True, window=(4, None))),
    "window-left-only": ((1, 2, 1, 10, 15, 8, 8), dict(window=(2, None))),
    "window-bottom-right": ((2, 2, 1, 5, 17, 8, 8), dict(causal="bottom_right", window=(3, 0))),
    "window-misses": ((1, 2, 2, 9, 4, 8, 8), dict(window=(0, 0))),  # rows past nk see nothing
    "key-lengths": ((3, 2, 2, 8, 12, 8, 8), dict(key_lengths=[12, 5, 0])),
    "padded-decode": ((2, 4, 1, 1, 16, 8, 8), dict(causal="bottom_right", key_lengths=[9, 16])),
    "softcap": ((2, 2, 2, 9, 11, 8, 8), dict(softcap=2.0, scale=1.0)),
    "softcap-causal-gqa": ((1, 4, 2, 10, 10, 8, 8), dict(causal=True, softcap=5.0)),
    "everything": ((2, 4, 2, 7, 19, 8, 6), dict(causal="bottom_right", window=(5, 0), key_lengths=[19, 3],
                                                softcap=3.0, scale=0.6)),
}


def needs(shape, kw):
    """The features a case needs of a kernel (attention() counts bottom-right only where
    it differs from top-left)."""
    need = {n for n in ("window", "key_lengths", "softcap") if kw.get(n) is not None}
    if shape[1] != shape[2]:
        need.add("gqa")
    if kw.get("causal") == "bottom_right" and (shape[3] != shape[4] or kw.get("key_lengths") is not None):
        need.add("bottom_right")
    return need


def bound(ref, q, k, dtype, factor, scale=None):
    return tolerance(dtype) * factor * max(1.0, np.abs(ref).max(initial=0)) * conditioning(q, k, scale)


def err(got, ref):
    return np.abs(np.asarray(got, np.float64) - ref).max(initial=0)


def test_the_reference_is_flash_attentions_rule():
    """The oracle against a mask built here, softmax over each row's visible keys."""
    for name, (shape, kw) in CASES.items():
        q, k, v, _ = inputs(shape, np.float64)
        mask = visible(q.shape, k.shape[-2], kw.get("causal", False), kw.get("window"), kw.get("key_lengths"))
        group = q.shape[-3] // k.shape[-3]
        kr, vr = np.repeat(k, group, -3), np.repeat(v, group, -3)
        s = kw.get("scale", q.shape[-1] ** -0.5) * q @ kr.swapaxes(-1, -2)
        if kw.get("softcap"):
            s = kw["softcap"] * np.tanh(s / kw["softcap"])
        s = np.where(mask, s, -np.inf)
        seen = mask.any(-1, keepdims=True)
        e = np.exp(s - np.where(seen, s.max(-1, keepdims=True), 0))
        want = e / np.where(seen, e.sum(-1, keepdims=True), 1) @ vr
        out, lse = attnkern.reference(q, k, v, return_lse=True, **kw)
        np.testing.assert_allclose(out, want, atol=1e-13, err_msg=name)
        assert np.array_equal(np.isneginf(lse), ~seen[..., 0] & np.ones(lse.shape, bool)), name


def test_the_reference_on_sampled_rows_2d_inputs_and_no_value_columns():
    """rows= computes those rows as in the full result (bottom-right counts all of Nq);
    2-D (N, D) inputs are one sequence of one head; Dv = 0 still has each row's lse."""
    q, k, v, _ = inputs((2, 4, 2, 7, 12, 8, 5), np.float64)
    kw = dict(causal="bottom_right", window=(3, 0), key_lengths=[12, 4], softcap=2.0)
    full, lse = attnkern.reference(q, k, v, return_lse=True, **kw)
    part, part_lse = attnkern.reference(q, k, v, rows=[0, 3, 6], return_lse=True, **kw)
    assert np.array_equal(part, full[..., [0, 3, 6], :]) and np.array_equal(part_lse, lse[..., [0, 3, 6]])
    for kernel in [n for n in FEATURED if set(WORDS) <= set(attnkern.kernel_info(n)["features"])]:
        (qx, kx, vx), dtype = widest(kernel, q, k, v)
        out, got = attnkern.attention(qx, kx, vx[..., :0], return_lse=True, kernel=kernel, **kw)
        limit = 1e-12 if dtype == np.float64 else bound(lse[~np.isneginf(lse)], qx, kx, dtype, 10, None)
        assert out.shape == (2, 4, 7, 0) and err(got[~np.isneginf(lse)], lse[~np.isneginf(lse)]) <= limit
        assert np.array_equal(np.isneginf(got), np.isneginf(lse))
        check_forward(kernel, qx[1, 0], kx[1, 0], vx[1, 0], dict(kw, key_lengths=[4]), dtype)
    assert np.array_equal(attnkern.reference(q[1, 0], k[1, 0], v[1, 0], **dict(kw, key_lengths=[4])), full[1, 0])


def check_forward(kernel, q, k, v, kw, dtype):
    """out and lse of kernel against the reference: within the accuracy bound; rows
    that see no key 0 and -inf."""
    out, lse = attnkern.attention(q, k, v, kernel=kernel, return_lse=True, **kw)
    ref, ref_lse = attnkern.reference(q, k, v, return_lse=True, **kw)
    empty = np.isneginf(ref_lse)
    assert out.shape == ref.shape and out.dtype == q.dtype and np.isfinite(out).all()
    assert np.array_equal(np.isneginf(lse), empty), "rows that see no key have lse -inf, only they"
    assert (out[empty] == 0).all()
    scale = kw.get("scale")
    assert err(out, ref) <= bound(v, q, k, dtype, 2, scale), f"out: {err(out, ref):.3g}"
    assert err(lse[~empty], ref_lse[~empty]) <= bound(ref_lse[~empty], q, k, dtype, 10, scale)
    return out, lse


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("kernel", FEATURED)
def test_forward_and_lse_match_the_reference(kernel, name, dtype):
    shape, kw = CASES[name]
    if not needs(shape, kw) <= set(attnkern.kernel_info(kernel)["features"]):
        pytest.skip(f"{kernel} does not claim {needs(shape, kw)} (test_kernel_info_tells_the_truth)")
    if np.dtype(dtype).name not in attnkern.kernel_info(kernel)["dtypes"]:
        pytest.skip(f"{kernel} does not take {np.dtype(dtype).name} (kernel_info's dtypes)")
    q, k, v, _ = inputs(shape, dtype)
    check_forward(kernel, q, k, v, kw, dtype)


def torch_peer(q, k, v, dout, kw):
    """out, dq, dk, dv of torch in q's dtype: SDPA with the boolean mask and enable_gqa,
    or with a softcap torch ops (rows that see no key zeroed, as attnkern gives them)."""
    mask = torch.from_numpy(visible(q.shape, k.shape[-2], kw.get("causal", False), kw.get("window"),
                                    kw.get("key_lengths")))
    qt, kt, vt = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    scale = kw.get("scale", q.shape[-1] ** -0.5)
    if kw.get("softcap") is None:
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    else:
        group = q.shape[-3] // k.shape[-3]
        kr, vr = kt.repeat_interleave(group, -3), vt.repeat_interleave(group, -3)
        s = kw["softcap"] * torch.tanh(scale * qt @ kr.transpose(-1, -2) / kw["softcap"])
        s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
        out = (torch.softmax(s, -1) @ vr) * mask.any(-1, keepdim=True)
    out.backward(torch.from_numpy(dout))
    return [x.detach().numpy() for x in (out, qt.grad, kt.grad, vt.grad)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][0][0] is not None])
@pytest.mark.parametrize("kernel", DIFFERENTIABLE)
def test_gradients_by_flash_attentions_rule(kernel, name, dtype):
    """attention_backward and torch autograd: each of out, dq, dk, dv within twice the
    error of torch's in the same dtype, plus 4 ulp of the values; dk and dv have k's
    H_kv heads; the gradients of rows and keys no query sees are 0."""
    shape, kw = CASES[name]
    if np.dtype(dtype).name not in attnkern.kernel_info(kernel)["backward_dtypes"]:
        pytest.skip(f"{kernel}'s backward does not take {np.dtype(dtype).name}")
    q, k, v, dout = inputs(shape, dtype)
    ref = [attnkern.reference(q, k, v, **kw), *attnkern.reference_backward(q, k, v, dout, **kw)]
    peer = torch_peer(q, k, v, dout, kw)
    out, lse = check_forward(kernel, q, k, v, kw, dtype)
    ours = [out, *attnkern.attention_backward(q, k, v, out, dout, lse, kernel=kernel, **kw)]
    tensors = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    lengths = kw.get("key_lengths")
    tkw = dict(kw, key_lengths=None if lengths is None else torch.tensor(lengths))
    tout = attnkern.attention(*tensors, kernel=kernel, **tkw)
    tout.backward(torch.from_numpy(dout))
    autograd = [tout.detach().numpy(), *(x.grad.numpy() for x in tensors)]
    for what, r, p, a, b in zip(("out", "dq", "dk", "dv"), ref, peer, ours, autograd):
        assert a.shape == b.shape == r.shape, what
        limit = 2 * err(p, r) + 4 * np.finfo(dtype).eps * max(1.0, np.abs(r).max())
        assert err(a, r) <= limit, f"{what} (attention_backward): {err(a, r):.3g} > {limit:.3g}"
        assert err(b, r) <= limit, f"{what} (autograd): {err(b, r):.3g} > {limit:.3g}"
        assert np.array_equal(a, b), f"{what}: autograd and attention_backward differ"
    dq, dk, _ = ours[1:]
    empty = np.isneginf(lse)
    assert (dq[empty] == 0).all() and (ours[0][empty] == 0).all()
    if lengths is not None:
        for b, n in enumerate(lengths):
            assert (dk[b, :, n:] == 0).all(), "keys past a length get no gradient"


def test_decode_and_chunked_prefill_are_rows_of_the_full_causal_attention():
    """A KV cache: the last query over all 16 keys (decode), and 6 queries over 16 keys
    (chunked prefill), with causal='bottom_right', are the last rows of causal attention
    of 16 queries over the same keys; with key_lengths, of each sequence's own length."""
    q, k, v, _ = inputs((2, 4, 2, 16, 16, 8, 8), np.float32, seed=3)
    full = attnkern.reference(q, k, v, causal=True)
    for rows in (1, 6):
        want = full[..., 16 - rows:, :]
        assert err(attnkern.reference(q[..., -rows:, :], k, v, causal="bottom_right"), want) < 1e-14
        for kernel in FEATURED:
            out = attnkern.attention(q[..., -rows:, :], k, v, causal="bottom_right", kernel=kernel)
            assert err(out, want) <= bound(v, q, k, np.float32, 2), (kernel, rows)
    # padded cache: sequence 1 holds 11 keys; its 6 newest queries are rows 5..10 of its own prefill
    own = attnkern.reference(q[1:, :, :11], k[1:, :, :11], v[1:, :, :11], causal=True)
    k[1, :, 11:], v[1, :, 11:] = np.nan, np.nan  # padding is never read
    chunk = np.concatenate([q[:1, :, 10:], q[1:, :, 5:11]])
    for kernel in FEATURED:
        out = attnkern.attention(chunk, k, v, causal="bottom_right", key_lengths=[16, 11], kernel=kernel)
        assert err(out[1], own[0, :, 5:11]) <= bound(v[0], q, k[0], np.float32, 2), kernel


def smallest_call(feature):
    """q, k, v and the keywords of a call that needs exactly one feature."""
    q, k, v, _ = inputs((1, 2, 2 if feature != "gqa" else 1, 3, 5, 4, 4), np.float32)
    return q, k, v, {"gqa": {}, "bottom_right": dict(causal="bottom_right"), "window": dict(window=(1, 1)),
                     "key_lengths": dict(key_lengths=[3]), "softcap": dict(softcap=5.0)}[feature]


@pytest.mark.parametrize("feature", WORDS)
@pytest.mark.parametrize("kernel", attnkern.kernels())
def test_kernel_info_tells_the_truth(kernel, feature):
    """Each claimed feature works (forward, and backward where claimed there); each
    unclaimed one is refused, naming the feature."""
    info = attnkern.kernel_info(kernel)
    q, k, v, kw = smallest_call(feature)
    claimed = feature in info["features"]
    if claimed and info["available"]:
        check_forward(kernel, q, k, v, kw, np.float32)
    else:  # refused: for the feature, or for a kernel that claims it but cannot run here, why not
        with pytest.raises((ValueError, RuntimeError)) as refused:
            attnkern.attention(q, k, v, kernel=kernel, **kw)
        line = re.search(rf"^  {re.escape(kernel)}: (.*)$", str(refused.value), re.M).group(1)
        assert (info["reason"] if claimed else f"does not support {WORDS[feature]}") in line
    if not info["backward"] or not info["available"]:
        return
    out, lse = attnkern.attention(q, k, v, return_lse=True, **kw)
    dout = np.ones_like(out)
    if feature in info["backward_features"]:
        got = attnkern.attention_backward(q, k, v, out, dout, lse, kernel=kernel, **kw)
        for g, r in zip(got, attnkern.reference_backward(q, k, v, dout, **kw)):
            assert err(g, r) < 1e-5
    else:
        with pytest.raises(ValueError, match=f"{re.escape(kernel)} (its backward )?does not support {WORDS[feature]}"):
            attnkern.attention_backward(q, k, v, out, dout, lse, kernel=kernel, **kw)


def test_auto_picks_a_kernel_that_has_the_features(monkeypatch):
    """native.flash first; without its features, the next kernel that has them."""
    from attnkern import _api, _registry

    q, k, v, _ = inputs((2, 4, 2, 5, 9, 8, 8), np.float32)
    call = _api.validate(q, k, v, causal="bottom_right", scale=None, check_finite=False, softcap=2.0)
    assert _api.choose(call, "auto", {})[0].name == "native.flash"
    plain = dataclasses.replace(_registry.get("native.flash"), features=frozenset())
    monkeypatch.setitem(_registry._KERNELS, "native.flash", plain)
    for kw, name in ((dict(window=(2, 0)), "torch.sdpa"), (dict(softcap=2.0), "numpy.naive")):
        call = _api.validate(q, k, v, causal=False, scale=None, check_finite=False, **kw)
        assert _api.choose(call, "auto", {})[0].name == name
        check_forward("auto", q, k, v, kw, np.float32)


def test_grouped_heads_are_not_copied():
    """k and v reach the kernel as views of the caller's arrays, with B * H_kv rows."""
    from attnkern import _api

    q, k, v, _ = inputs((2, 6, 2, 5, 9, 8, 8), np.float32)
    call = _api.validate(q, k, v, causal=False, scale=None, check_finite=True)
    assert call.k.shape == (4, 9, 8) and np.shares_memory(call.k, k) and np.shares_memory(call.v, v)
    assert call.features.kv_group == 3 and call.needs == {"gqa"}


@pytest.mark.parametrize("kind", ["float16", "bfloat16"])
def test_half_precision_forward_has_the_features(kind):
    dtype = np.float16 if kind == "float16" else pytest.importorskip("ml_dtypes").bfloat16
    shape, kw = CASES["everything"]
    q, k, v, _ = (x.astype(dtype) for x in inputs(shape, np.float32))
    out, lse = attnkern.attention(q, k, v, return_lse=True, **kw)
    ref, ref_lse = attnkern.reference(q, k, v, return_lse=True, **kw)
    assert out.dtype == dtype and err(out, ref) < 2e-2
    assert np.array_equal(np.isneginf(lse.astype(np.float64)), np.isneginf(ref_lse))


def test_padding_is_never_read_nor_checked():
    q, k, v, _ = inputs((2, 2, 1, 4, 10, 8, 8), np.float32)
    want = attnkern.reference(q, k, v, key_lengths=[10, 6])
    k[1, :, 6:], v[1, :, 6:] = np.nan, np.inf
    for kernel in FEATURED:
        out = attnkern.attention(q, k, v, key_lengths=[10, 6], kernel=kernel)
        assert err(out, want) <= bound(v[0], q, k[0], np.float32, 2), kernel
    with pytest.raises(ValueError, match="k contains NaN"):
        attnkern.attention(q, k, v, key_lengths=[10, 7])


Q, K, V, _ = inputs((2, 4, 2, 5, 9, 8, 8), np.float32)
REFUSALS = [
    (dict(k=K[:, :1].repeat(3, 1), v=V[:, :1].repeat(3, 1)), ValueError,
     "q has 4 heads and k, v have 3: .* H must be a multiple of the k/v heads H_kv"),
    (dict(k=K[:1], v=V[:1]), ValueError, "same leading .* dimensions"),
    (dict(k=K[:, :1]), ValueError, "k and v must have the same leading"),
    (dict(causal="center"), ValueError, "causal must be False, True .* or 'bottom_right'"),
    (dict(causal=1), TypeError, "causal must be False, True, 'top_left' or 'bottom_right', got 1"),
    (dict(window=4), TypeError, r"window must be a pair \(left, right\)"),
    (dict(window=(1, 2, 3)), TypeError, r"window must be a pair"),
    (dict(window=(-1, 0)), ValueError, r"window's left side must be >= 0 keys, or None for unbounded"),
    (dict(window=(2, -3)), ValueError, r"window's right side must be >= 0"),
    (dict(window=(2.0, 0)), TypeError, "window's left side must be a whole number of keys or None"),
    (dict(window=(True, 0)), TypeError, "window's left side must be a whole number"),
    (dict(causal=True, window=(4, 2)), ValueError, r"a causal mask already sets the window's right side to 0"),
    (dict(causal="bottom_right", window=(None, 1)), ValueError, r"causal mask already sets .* \(left, 0\)"),
    (dict(key_lengths=[9, 9, 9]), ValueError, r"one length per sequence: shape \(2,\) .* got shape \(3,\)"),
    (dict(key_lengths=[[9, 9]]), ValueError, r"one length per sequence"),
    (dict(key_lengths=[9.0, 3.0]), TypeError, "key_lengths must hold integers"),
    (dict(key_lengths=[True, False]), TypeError, "key_lengths must hold integers"),
    (dict(key_lengths=[10, 3]), ValueError, r"key_lengths must lie in \[0, 9\]"),
    (dict(key_lengths=[-1, 3]), ValueError, r"key_lengths must lie in \[0, 9\]"),
    (dict(softcap=0.0), ValueError, "softcap must be a positive finite number .None for no cap"),
    (dict(softcap=-3.0), ValueError, "softcap must be a positive finite number"),
    (dict(softcap=float("inf")), ValueError, "softcap must be a positive finite number"),
    (dict(softcap=float("nan")), ValueError, "softcap must be a positive finite number"),
    (dict(softcap="30"), TypeError, "softcap must be a positive real number or None"),
    (dict(softcap=1e-310), ValueError, "scale / softcap overflows"),
    (dict(causal="bottom_right", kernel="torch.naive"), ValueError,
     "torch.naive does not support grouped-query attention .*, bottom-right causal alignment"),
    (dict(k=K.repeat(2, 1), v=V.repeat(2, 1), causal="bottom_right", kernel="native.tiled"), ValueError,
     r"native.tiled does not support bottom-right causal alignment .*; kernels that support this call's "
     r"features: native.flash, numpy.naive, torch.sdpa"),
    (dict(k=K.repeat(2, 1), v=V.repeat(2, 1), window=(2, 2), kernel="numba.flash"), ValueError,
     r"numba.flash does not support a sliding window \(window=\)"),
    (dict(k=K.repeat(2, 1), v=V.repeat(2, 1), softcap=30.0, kernel="torch.sdpa"), ValueError,
     r"torch.sdpa does not support a logit softcap .*kernels that support this call's features: native.flash, "
     "numpy.naive"),
]


@pytest.mark.parametrize("kw,exc,message", REFUSALS)
def test_refusals_say_what_to_fix(kw, exc, message):
    args = dict(q=Q, k=K, v=V) | kw
    kernel = args.pop("kernel", "auto")
    if kernel != "auto" and not attnkern.kernel_info(kernel)["available"]:
        pytest.skip(attnkern.kernel_info(kernel)["reason"])
    with pytest.raises(exc, match=message):
        attnkern.attention(**args, kernel=kernel)
    if kernel == "auto":  # the oracle and the torch frontend check the same
        with pytest.raises(exc, match=message):
            attnkern.reference(**args)
        targs = {n: torch.from_numpy(x) for n, x in args.items() if n in "qkv"}
        with pytest.raises(exc, match=message):
            attnkern.attention(**targs, **{n: x for n, x in args.items() if n not in "qkv"})


def test_backward_refusals():
    out, lse = attnkern.attention(Q, K, V, return_lse=True, window=(2, 0))
    with pytest.raises(ValueError, match="numpy.naive has no backward pass"):
        attnkern.attention_backward(Q, K, V, out, out, lse, window=(2, 0), kernel="numpy.naive")
    grad = [torch.tensor(x, requires_grad=True) for x in (Q, K, V)]
    with pytest.raises(ValueError, match="torch.sdpa has no backward pass.* differentiable kernels: native.flash"):
        attnkern.attention(*grad, window=(2, 0), kernel="torch.sdpa")
    with pytest.raises(ValueError, match="key_lengths must lie in"):
        attnkern.attention_backward(Q, K, V, out, out, lse, key_lengths=[1, 10])


@given(data=st.data())
def test_any_shape_lengths_and_window_match_the_reference(data):
    """native.flash forward, lse and backward, and every kernel claiming the call's
    features forward, against the oracle: float64, or float32 for a kernel without it."""
    group, hkv = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 2))
    b, nq, nk = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 20)), data.draw(st.integers(1, 24))
    side = st.none() | st.integers(0, 30)
    causal = data.draw(st.sampled_from([False, True, "bottom_right"]))
    window = data.draw(st.none() | st.tuples(side, st.just(None) if causal else side))
    lengths = data.draw(st.none() | st.lists(st.integers(0, nk), min_size=b, max_size=b))
    softcap = data.draw(st.none() | st.floats(0.5, 30.0))
    kw = dict(causal=causal, window=window, key_lengths=lengths, softcap=softcap)
    q, k, v, dout = inputs((b, hkv * group, hkv, nq, nk, 8, 4), np.float64, seed=data.draw(st.integers(0, 99)))
    for kernel in FEATURED:
        call_needs = needs((b, hkv * group, hkv, nq, nk), kw)
        if call_needs <= set(attnkern.kernel_info(kernel)["features"]):
            (qx, kx, vx), dtype = widest(kernel, q, k, v)
            check_forward(kernel, qx, kx, vx, kw, dtype)
    with forced_isa(data.draw(st.sampled_from(attnkern.supported_isas()))):
        out, lse = attnkern.attention(q, k, v, return_lse=True, kernel="native.flash", **kw,
                                      block_q=data.draw(st.integers(1, 16)), block_k=data.draw(st.integers(1, 16)))
        grads = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="native.flash", **kw)
    for got, ref in zip(grads, attnkern.reference_backward(q, k, v, dout, **kw)):
        assert got.shape == ref.shape and err(got, ref) <= bound(ref, q, k, np.float64, 10)
