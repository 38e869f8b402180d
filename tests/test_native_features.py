"""The features of native.flash's C kernels, through the Cython module directly
(attnkern.backends.native._attn; arrays (batch, n, d) C-contiguous, batch = B * H):
grouped-query attention (k and v with batch / G rows), causal alignment and sliding
windows, key padding by per-sequence lengths, rows that see no key, and the logit
softcap.

Each is checked against a float64 NumPy reference written here: attention with an
explicit boolean mask (query row b, query i, key j),

    P = softmax(S) over the visible keys, S = c tanh(R / c) (softcap c; else S = R),
    R = scale q k^T, O = P v,
    dv = P^T dO,  dP = dO v^T,  dS = P * (dP - rowsum(dO * O)),  dR = dS (1 - tanh^2(R / c)),
    dq = scale dR k,  dk = scale dR^T q,

with k and v repeated over each group of query rows, and dk and dv summed over it.
A row that sees no key has out 0, lse -inf and zero gradients. Tolerances as in
test_backward.py: tolerance(dtype) * factor * max(1, max|ref|) * kappa."""

import time

import numpy as np
import pytest

from attnkern.backends.native import _attn
from attnkern_bench.accuracy import conditioning, tolerance
from conftest import ISAS

ml_dtypes = pytest.importorskip("ml_dtypes")


def visible(batch, nq, nk, causal=False, align="top_left", window_left=-1, window_right=-1, seqlen_k=None):
    """The mask (batch, nq, nk): query i of row b sees key j iff
    i + off - window_left <= j <= i + off + window_right and j < len_b, with
    len_b = seqlen_k[b // (batch // len(seqlen_k))] (or nk) and off = 0 (top-left)
    or len_b - nq (bottom-right); causal is window_right 0; -1 is unbounded."""
    lens = np.full(batch, nk) if seqlen_k is None else np.repeat(seqlen_k, batch // max(1, len(seqlen_k)))
    right = 0 if causal else window_right
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    mask = np.empty((batch, nq, nk), bool)
    for b in range(batch):
        off = lens[b] - nq if align == "bottom_right" else 0
        m = j < lens[b]
        if window_left >= 0:
            m = m & (j >= i + off - window_left)
        if right >= 0:
            m = m & (j <= i + off + right)
        mask[b] = m
    return mask


def reference(q, k, v, dout, mask, scale, softcap=0.0):
    """out, lse, (dq, dk, dv) in float64, k and v shared by batch / len(k) query rows."""
    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    group = q.shape[0] // k.shape[0]
    kx, vx = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
    s = scale * q @ kx.swapaxes(-1, -2)
    slope = 1.0
    if softcap:
        t = np.tanh(s / softcap)
        s, slope = softcap * t, 1 - t * t
    s = np.where(mask, s, -np.inf)
    seen = mask.any(-1, keepdims=True)
    top = np.where(seen, s.max(-1, keepdims=True, initial=-np.inf), 0)
    e = np.exp(s - top)
    total = e.sum(-1, keepdims=True)
    p = e / np.where(seen, total, 1)
    out = p @ vx
    with np.errstate(divide="ignore"):
        lse = np.where(seen, np.log(total) + top, -np.inf)[..., 0]
    ds = p * (dout @ vx.swapaxes(-1, -2) - (dout * out).sum(-1, keepdims=True)) * slope
    dq = scale * ds @ kx
    dk = (scale * ds.swapaxes(-1, -2) @ q).reshape(k.shape[0], group, *k.shape[1:]).sum(1)
    dv = (p.swapaxes(-1, -2) @ dout).reshape(v.shape[0], group, *v.shape[1:]).sum(1)
    return out, lse, (dq, dk, dv)


def assert_close(got, ref, q, k, dtype, factor=1.0, what="", scale=None):
    bound = tolerance(dtype) * factor * max(1.0, np.abs(ref).max(initial=0)) * conditioning(q, k, scale)
    err = np.abs(np.asarray(got, np.float64) - ref).max(initial=0)
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


def features_of(case):
    return {name: case[name] for name in ("align", "window_left", "window_right", "seqlen_k", "softcap") if name in case}


def run(isa, q, k, v, case, threads=2, dout=None, blocks=None):
    """forward (out, lse) and, with dout, backward (dq, dk, dv) of the case."""
    bq, bk = blocks or case.get("blocks", (16, 24))
    causal, scale = case.get("causal", False), case.get("scale", q.shape[-1] ** -0.5)
    feats = features_of(case)
    out = np.empty((q.shape[0], q.shape[1], v.shape[2]), q.dtype)
    lse = np.empty(q.shape[:2], q.dtype)
    _attn.forward("flash", isa, q, k, v, out, causal, scale, bq, bk, threads, lse, **feats)
    if dout is None:
        return out, lse
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    _attn.backward(isa, q, k, v, out, dout, lse, dq, dk, dv, causal, scale, bq, bk, threads, **feats)
    return out, lse, (dq, dk, dv)


def inputs(case, dtype, seed=0):
    """q (B * H, nq, d), k and v (B * H / G, nk, d or dv), dout, and the mask."""
    rng = np.random.default_rng(seed)
    b, h, g = case.get("B", 2), case.get("H", 2), case.get("G", 1)
    nq, nk, d, dv = case["nq"], case["nk"], case.get("d", 16), case.get("dv", 12)
    q = rng.standard_normal((b * h, nq, d)).astype(dtype)
    k = rng.standard_normal((b * h // g, nk, d)).astype(dtype)
    v = rng.standard_normal((b * h // g, nk, dv)).astype(dtype)
    dout = rng.standard_normal((b * h, nq, dv)).astype(dtype)
    feats = features_of(case)
    mask = visible(b * h, nq, nk, case.get("causal", False), feats.get("align", "top_left"),
                   feats.get("window_left", -1), feats.get("window_right", -1), feats.get("seqlen_k"))
    return q, k, v, dout, mask


L = np.array  # key lengths, int64
CASES = {
    "gqa": dict(nq=37, nk=53, H=4, G=2),
    "gqa-causal": dict(nq=70, nk=70, H=4, G=4, causal=True),
    "mqa": dict(nq=33, nk=40, B=3, H=4, G=4),  # one k/v head per sequence
    "mqa-batch": dict(nq=20, nk=29, B=2, H=3, G=6),  # one k/v row for every query row
    "bottom-right-causal": dict(nq=21, nk=77, causal=True, align="bottom_right"),
    "bottom-right-causal-tall": dict(nq=77, nk=21, causal=True, align="bottom_right"),  # empty rows
    "bottom-right-window": dict(nq=50, nk=90, align="bottom_right", window_left=9, window_right=4),
    "sliding-causal": dict(nq=100, nk=100, causal=True, window_left=13, blocks=(16, 16)),
    "sliding-both": dict(nq=90, nk=120, window_left=7, window_right=20, blocks=(32, 8)),
    "left-only": dict(nq=64, nk=64, window_left=30, blocks=(8, 64)),
    "right-window": dict(nq=45, nk=45, window_right=3, window_left=0),
    "window-misses": dict(nq=40, nk=20, window_left=0, window_right=0),  # rows past nk see nothing
    "seqlen-per-sequence": dict(nq=30, nk=60, B=3, H=2, seqlen_k=L([60, 17, 33])),
    "seqlen-per-row": dict(nq=25, nk=50, B=2, H=2, seqlen_k=L([50, 1, 26, 49])),
    "seqlen-zero": dict(nq=19, nk=40, B=2, H=2, seqlen_k=L([0, 23])),
    "seqlen-causal": dict(nq=50, nk=50, seqlen_k=L([50, 20]), causal=True),
    "seqlen-bottom-right": dict(nq=8, nk=64, B=2, H=2, G=2, seqlen_k=L([40, 5]), causal=True,
                                align="bottom_right"),
    "everything": dict(nq=41, nk=97, B=2, H=4, G=2, seqlen_k=L([97, 61]), align="bottom_right",
                       window_left=25, window_right=2, blocks=(16, 16)),
    "big-blocks": dict(nq=300, nk=280, H=2, G=2, causal=True, window_left=40, blocks=(256, 256), d=8, dv=8),
    "softcap": dict(nq=50, nk=70, softcap=5.0, scale=1.0),  # scores up to ~15: saturated
    "softcap-causal": dict(nq=64, nk=64, causal=True, softcap=2.0, scale=0.7, blocks=(32, 32)),
    "softcap-nearly-linear": dict(nq=33, nk=47, softcap=50.0),
    "softcap-everything": dict(nq=41, nk=97, B=2, H=4, G=2, seqlen_k=L([97, 0]), align="bottom_right",
                               window_left=25, window_right=2, softcap=3.0, scale=0.5),
}


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", CASES)
def test_forward_and_backward_match_the_masked_reference(isa, dtype, name):
    case = CASES[name]
    q, k, v, dout, mask = inputs(case, dtype)
    scale = case.get("scale", q.shape[-1] ** -0.5)
    out, lse, grads = run(isa, q, k, v, case, dout=dout)
    ref_out, ref_lse, ref_grads = reference(q, k, v, dout, mask, scale, case.get("softcap", 0.0))
    empty = ~mask.any(-1)
    assert np.isfinite(out).all() and all(np.isfinite(g).all() for g in grads)
    assert np.array_equal(np.isneginf(lse), empty) and np.isfinite(lse[~empty]).all()
    assert (out[empty] == 0).all() and (grads[0][empty] == 0).all()
    assert_close(out, ref_out, q, k, dtype, 2, "out", scale)
    assert_close(lse[~empty], ref_lse[~empty], q, k, dtype, 10, "lse", scale)
    for got, ref, what in zip(grads, ref_grads, ("dq", "dk", "dv")):
        assert_close(got, ref, q, k, dtype, 10 if dtype == np.float32 else 2, what, scale)


@pytest.mark.parametrize("name", ["gqa", "mqa-batch", "sliding-both", "seqlen-per-row", "everything", "big-blocks",
                                  "softcap-everything"])
def test_bit_identical_for_every_thread_count(name):
    case = CASES[name]
    q, k, v, dout, _ = inputs(case, np.float32)
    for isa in ISAS:
        first = run(isa, q, k, v, case, threads=1, dout=dout)
        for threads in (2, 3, 4):
            again = run(isa, q, k, v, case, threads=threads, dout=dout)
            for a, b in zip((first[0], first[1], *first[2]), (again[0], again[1], *again[2])):
                assert np.array_equal(a, b), f"{isa}: {threads} threads differ from 1"


@pytest.mark.parametrize("isa", ISAS)
def test_forward_rows_do_not_depend_on_block_q(isa):
    """As without features: key blocks start at multiples of block_k whatever the
    query block, and the keys a panel skips are ones its queries do not see, so
    block_q only groups rows and changes no bit of out or lse."""
    for name in ("sliding-both", "everything", "softcap-everything", "bottom-right-causal-tall"):
        case = CASES[name]
        q, k, v, _, _ = inputs(case, np.float32)
        first = run(isa, q, k, v, case, blocks=(203, 32))
        for block_q in (1, 7, 33, 64):
            again = run(isa, q, k, v, case, blocks=(block_q, 32))
            assert all(np.array_equal(a, b) for a, b in zip(first, again)), f"{name}: block_q={block_q}"


@pytest.mark.parametrize("isa", ISAS)
def test_grouped_forward_equals_the_repeated_plain_one(isa):
    """A query row's arithmetic does not depend on sharing its k/v row: the grouped
    forward is the plain forward on k and v repeated, bit for bit."""
    for name in ("gqa", "gqa-causal", "mqa"):
        case = CASES[name]
        q, k, v, _, _ = inputs(case, np.float32)
        g = q.shape[0] // k.shape[0]
        grouped = run(isa, q, k, v, case)
        plain = run(isa, q, np.repeat(k, g, axis=0), np.repeat(v, g, axis=0), case)
        assert all(np.array_equal(a, b) for a, b in zip(grouped, plain))


@pytest.mark.parametrize("isa", ISAS)
def test_features_that_mask_nothing_change_no_bit(isa):
    """Windows wider than the problem, lengths of nk and bottom-right on a square
    problem see every key the plain problem sees, and compute the same bits."""
    q, k, v, dout, _ = inputs(dict(nq=70, nk=70), np.float32)
    for causal in (False, True):
        plain = run(isa, q, k, v, dict(causal=causal), dout=dout)
        for feats in (dict(window_left=10**12), dict(window_left=200, window_right=10**15),
                      dict(seqlen_k=L([70, 70])), dict(align="bottom_right"), dict(window_left=69)):
            if causal and "window_right" in feats:
                continue
            got = run(isa, q, k, v, dict(causal=causal, **feats), dout=dout)
            for a, b in zip((plain[0], plain[1], *plain[2]), (got[0], got[1], *got[2])):
                assert np.array_equal(a, b), f"causal={causal} {feats}"


@pytest.mark.parametrize("isa", ISAS)
def test_keys_past_the_lengths_are_never_read(isa):
    """NaN in the padding past each row's key length reaches no output or gradient."""
    case = dict(nq=33, nk=64, B=2, H=2, G=2, seqlen_k=L([64, 20]), causal=True, align="bottom_right")
    q, k, v, dout, mask = inputs(case, np.float64)
    ref_out, _, ref_grads = reference(q, k, v, dout, mask, q.shape[-1] ** -0.5)
    k[1, 20:], v[1, 20:] = np.nan, np.nan  # k/v row 1 serves query rows 2 and 3, of sequence 1
    out, lse, grads = run(isa, q, k, v, case, dout=dout)
    assert np.isfinite(out).all() and all(np.isfinite(g[:, :20]).all() for g in grads)
    assert_close(out, ref_out, q, k[:1], np.float64, 2, "out")
    for got, ref, what in zip(grads, ref_grads, ("dq", "dk", "dv")):
        assert_close(got, ref, q, k[:1], np.float64, 2, what)
    assert (grads[1][1, 20:] == 0).all() and (grads[2][1, 20:] == 0).all()
    bits = _attn.forward("flash", isa, q, k, v, np.empty_like(out), True, 0.25, 16, 16, 2, None, True,
                         align="bottom_right", seqlen_k=L([64, 20]))
    assert bits == (), "padding is not checked for NaN either"
    k[0, 5] = np.inf
    bits = _attn.forward("flash", isa, q, k, v, np.empty_like(out), True, 0.25, 16, 16, 2, None, True,
                         align="bottom_right", seqlen_k=L([64, 20]))
    assert bits[0] == "k" and "v" not in bits


@pytest.mark.parametrize("isa", ISAS)
def test_nonfinite_checks_cover_keys_outside_every_window(isa):
    """check_finite still sees every key within the lengths, also the keys a window
    makes no query read."""
    case = dict(nq=16, nk=128, H=2, G=2, window_left=3, window_right=3)  # top-left: keys past 19 unseen
    q, k, v, _, _ = inputs(case, np.float32)
    for where in (0, 60, 127):
        kk = k.copy()
        kk[0, where, 0] = np.nan
        out = np.empty((q.shape[0], q.shape[1], v.shape[2]), np.float32)
        bits = _attn.forward("flash", isa, q, kk, v, out, False, 0.25, 8, 16, 2, None, True, window_left=3,
                             window_right=3)
        assert "k" in bits, where


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["bfloat16", "float16"])
def test_half_precision_forward_has_the_features(isa, kind):
    """The converting flash of every unit (bfloat16 on avx512bf16 and amx included,
    whose own kernels lack the features) against the reference of the rounded inputs."""
    dtype = np.dtype(ml_dtypes.bfloat16) if kind == "bfloat16" else np.dtype(np.float16)
    for name in ("gqa-causal", "everything", "seqlen-zero", "bottom-right-causal-tall", "softcap-everything"):
        case = CASES[name]
        q, k, v, dout, mask = (x.astype(dtype) if x.dtype != bool else x for x in inputs(case, np.float32))
        out, lse = np.empty((q.shape[0], q.shape[1], v.shape[2]), dtype), np.empty(q.shape[:2], dtype)
        bq, bk = case.get("blocks", (16, 24))
        _attn.forward_half("flash", isa, kind, *(x.view(np.uint16) for x in (q, k, v, out)), case.get("causal", False),
                           case.get("scale", q.shape[-1] ** -0.5), bq, bk, 2, lse.view(np.uint16), **features_of(case))
        ref_out, ref_lse, _ = reference(q, k, v, dout, mask, case.get("scale", q.shape[-1] ** -0.5),
                                        case.get("softcap", 0.0))
        empty = ~mask.any(-1)
        assert np.abs(out.astype(np.float64) - ref_out).max() < 2e-2, name
        assert np.isneginf(lse.astype(np.float64)[empty]).all()
        assert np.abs(lse.astype(np.float64)[~empty] - ref_lse[~empty]).max() < 5e-2, name


def test_a_sliding_window_skips_the_keys_outside_it():
    """A window of W keys costs O(N * (W + blocks)), far less than causal over N keys
    (CPU time of one thread, so that other work on the machine counts little)."""
    n, w = 4096, 64
    q, k, v, dout, _ = inputs(dict(nq=n, nk=n, B=1, H=1, d=64, dv=64), np.float32)

    def seconds(case, with_backward):
        t0 = time.process_time()
        run(_attn.best_isa(), q, k, v, case, threads=1, dout=dout if with_backward else None, blocks=(64, 64))
        return time.process_time() - t0

    for with_backward in (False, True):
        full = min(seconds(dict(causal=True), with_backward) for _ in range(2))
        window = min(seconds(dict(causal=True, window_left=w), with_backward) for _ in range(2))
        assert window < 0.3 * full, f"backward={with_backward}: window {window:.3f} s, causal {full:.3f} s"


def test_arguments_are_checked_with_a_message_that_says_what_to_fix():
    q, k, v, dout, _ = inputs(dict(nq=8, nk=8, H=2), np.float32)
    out, lse = np.empty_like(q[..., :12]), np.empty(q.shape[:2], np.float32)

    def forward(algo="flash", kk=k, vv=v, causal=False, **feats):
        _attn.forward(algo, "generic", q, kk, vv, out, causal, 0.5, 16, 16, 1, lse, **feats)

    with pytest.raises(ValueError, match=r"window_left and window_right must be -1 \(unbounded\) or >= 0"):
        forward(window_left=-2)
    with pytest.raises(ValueError, match="causal means window_right 0"):
        forward(causal=True, window_right=3)
    with pytest.raises(ValueError, match=r"every length of seqlen_k must lie in \[0, nk\]"):
        forward(seqlen_k=L([3, 9]))
    with pytest.raises(ValueError, match=r"every length of seqlen_k must lie in \[0, nk\]"):
        forward(seqlen_k=L([-1, 2, 3, 4]))
    with pytest.raises(ValueError, match="seqlen_k has 3 lengths; it needs one per sequence"):
        forward(seqlen_k=L([1, 2, 3]))
    with pytest.raises(ValueError, match="align must be one of top_left, bottom_right"):
        forward(align="center")
    with pytest.raises(ValueError, match="k and v have 3 rows, which must divide q's 4"):
        forward(kk=np.zeros((3, 8, 16), np.float32), vv=np.zeros((3, 8, 12), np.float32))
    for algo in ("naive", "tiled"):
        with pytest.raises(ValueError, match=f"native.{algo}: only flash has kv groups.*use native.flash"):
            forward(algo, window_left=2)
        with pytest.raises(ValueError, match="only flash has"):
            forward(algo, kk=k[:2].copy(), vv=v[:2].copy())
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    with pytest.raises(ValueError, match="inconsistent shapes"):  # dk, dv must have k's rows
        _attn.backward("generic", q, k[:2].copy(), v[:2].copy(), out, dout, lse, dq, dk, dv, False, 0.5, 16, 16, 1)
    # the C checks alone, as the entry points run them
    assert _attn.check_problem("flash", "generic", 4, 8, 8, 16, 12, kv_group=3) == "invalid"
    assert _attn.check_problem("flash", "generic", 4, 8, 8, 16, 12, kv_group=0) == "invalid"
    assert _attn.check_problem("flash", "generic", 4, 8, 8, 16, 12, kv_group=4) == "ok"
    assert _attn.check_problem("tiled", "generic", 4, 8, 8, 16, 12, kv_group=2) == "feature"
    assert _attn.check_problem("flash", "generic", 4, 8, 8, 16, 12, window_right=-5) == "invalid"
    assert _attn.check_problem("flash", "generic", 4, 8, 8, 16, 12, window_left=2**62) == "ok"
    assert _attn.check_problem("flash", "generic", 4, 8, 8, 16, 12, seqlen_k=L([8, 0])) == "ok"
    assert _attn.check_problem("flash", "generic", 4, 8, 8, 16, 12, seqlen_k=L([8, 9])) == "invalid"
    assert _attn.check_problem("flash", "generic", 0, 8, 8, 16, 12, seqlen_k=L([], np.int64)) == "ok"
    assert "kv_group must be >= 1 and divide batch" in _attn.problem_error("flash", "generic", 4, 8, 8, 16, 12,
                                                                           kv_group=3)
    for cap in (-1.0, np.inf, np.nan):
        with pytest.raises(ValueError, match="softcap must be 0 .none. or a positive finite number"):
            forward(softcap=cap)
    with pytest.raises(ValueError, match="scale / softcap overflows"):
        forward(softcap=1e-310)
    with pytest.raises(ValueError, match="only flash has.*softcap"):
        forward("tiled", softcap=30.0)
    assert _attn.problem_error("flash", "generic", 4, 8, 8, 16, 12) == ""


@pytest.mark.parametrize("isa", ISAS)
def test_extreme_windows_and_sizes(isa):
    """Windows of 0 and of the largest int64, one query, one key."""
    for case in (dict(nq=1, nk=1, window_left=0, window_right=0), dict(nq=1, nk=9, align="bottom_right",
                 causal=True, window_left=2**63 - 1), dict(nq=9, nk=1, window_left=0, window_right=2**63 - 1),
                 dict(nq=5, nk=7, seqlen_k=L([0, 0]), causal=True)):
        q, k, v, dout, mask = inputs(case, np.float64)
        out, lse, grads = run(isa, q, k, v, case, dout=dout)
        ref_out, ref_lse, ref_grads = reference(q, k, v, dout, mask, q.shape[-1] ** -0.5)
        np.testing.assert_allclose(out, ref_out, atol=1e-12)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
        for got, ref in zip(grads, ref_grads):
            np.testing.assert_allclose(got, ref, atol=1e-11)
