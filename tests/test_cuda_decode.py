"""The split-K decode paths of cuda.flash (flash_mma.cu's decode variant and
flash_combine.cu) and triton.flash (flash_decode_partial, flash_decode_combine):
a few query rows a head (nq <= 16, kv_group nq <= 128) over a long cache run one block
per (key chunk, k/v head) with the group's query heads packed into its rows, then a
log-sum-exp combine of the chunks in key order (attnkern/backends/_split.py).

Without a GPU (CI, the simulator): the split's choice (a function of the shape), the
tunable split_k's checks and refusals. With ATTNKERN_TEST_GPU=1 on a GPU: every case
against the float64 reference on fresh random inputs (out and lse, tolerances of
attnkern_bench.accuracy: the kernels round P to the input dtype), that the path ran
(last_split()), GQA, bottom-right and top-left causal, key lengths (0 and lengths that
are not a multiple of the chunk), windows, softcap, Nk up to 128k, forced splits
(2, odd, more than the keys allow) against the regular kernel (split_k=1), and
bit-identical repeats."""

import importlib
import os

import numpy as np
import pytest

import attnkern
from attnkern.backends import _split
from attnkern_bench.accuracy import conditioning, lse_tolerance, tolerance
from conftest import require_cuda_kernels

require_cuda_kernels()

SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def test_split_depends_on_the_shape_only():
    """About 264 blocks (k/v rows x chunks), chunks of at least 256 keys, whole 64-key
    tiles; short caches and many query rows keep the regular kernels; split_k forces."""
    cases = [((8, 1, 65536, 0), 33), ((32, 1, 131072, 0), 9), ((64, 1, 4096, 0), 5), ((8, 1, 4096, 0), 16),
             ((512, 1, 8192, 0), 1), ((8, 1, 1000, 0), 0), ((8, 17, 65536, 0), 0), ((8, 16, 65536, 1), 0),
             ((8, 1, 1000, 7), 7), ((8, 1, 100, 1000), 2), ((8, 40, 100, 3), 2)]
    for (batch_kv, nq, nk, split_k), want in cases:
        assert _split.decode_splits(batch_kv, nq, nk, split_k) == want, (batch_kv, nq, nk, split_k)
    # cuda.flash's: chunks of about 1280 keys where that gives more (never below 256 keys)
    for (batch_kv, nk), want in (((64, 131072), 103), ((8, 131072), 103), ((8, 16384), 33), ((64, 16384), 13),
                                 ((8, 4096), 16), ((512, 4096), 4)):
        assert _split.decode_splits(batch_kv, 1, nk, 0, max_chunk=1280) == want, (batch_kv, nk)
    # the whole-waves rule (cuda.flash's, with 528 blocks at once): chunks of about 1280 keys, their
    # blocks rounded to whole waves, never a block more than the waves hold; chunks of >= 128 keys
    for (batch_kv, nk), want in (((8, 131072), 132), ((64, 131072), 99), ((8, 16384), 66), ((8, 4096), 32),
                                 ((32, 4096), 16), ((64, 16384), 16), ((1024, 4096), 3), ((600, 2048), 1)):
        got = _split.decode_splits(batch_kv, 1, nk, 0, min_chunk=128, max_chunk=1280, slots=528)
        assert got == want, (batch_kv, nk, got)
        blocks = batch_kv * _split.decode_chunk(nk, got)[1]
        assert blocks <= max(1, round(batch_kv * nk / (528 * 1280))) * 528 or got == 1, (batch_kv, nk)
    for nk, splits in ((4096, 16), (5000, 7), (65, 2), (131072, 33), (1000, 7)):
        chunk, got = _split.decode_chunk(nk, splits)
        assert chunk % _split.DECODE_BLOCK_K == 0 and (got - 1) * chunk < nk <= got * chunk and got <= splits


def test_split_rules():
    """cuda.flash's automatic split under each cpp.DECODE_SPLIT_RULE: "long" is triton.flash's
    rule (fewer, longer chunks), "blocks" caps chunks at about DECODE_CHUNK_KEYS keys, "waves"
    fills whole waves, "long_waves" takes "long" where its blocks are at most 264 (two an SM),
    else "waves"; another name is a ValueError that lists the rules."""
    from attnkern.backends.cuda import cpp

    saved = cpp.DECODE_SPLIT_RULE, cpp.DECODE_TILE, cpp.DECODE_STAGES, cpp.DECODE_KEY_WARPS
    try:
        # the chunks run at the shapes of docs/gpu-decode.md (H_kv 8, Nq 1, D 128; 64x2x4 tiles)
        cpp.DECODE_TILE, cpp.DECODE_STAGES, cpp.DECODE_KEY_WARPS = 64, 2, 4
        want = {"long": {1: [16, 32, 32, 33], 4: [8, 9, 9, 9], 8: [5, 5, 5, 5]},
                "waves": {1: [32, 43, 49, 98], 4: [11, 12, 49, 98], 8: [6, 12, 49, 103]},
                "long_waves": {1: [16, 32, 32, 33], 4: [8, 12, 49, 98], 8: [6, 12, 49, 103]}}
        for rule, by_batch in want.items():
            cpp.DECODE_SPLIT_RULE = rule
            for batch, chunks in by_batch.items():
                got = [_split.decode_chunk(nk, cpp.decode_auto_splits(8 * batch, 1, nk, 128, 0, 4))[1]
                       for nk in (4096, 16384, 65536, 131072)]
                assert got == chunks, (rule, batch, got)
        # the long chunks' shortest (cpp.DECODE_LONG_MIN_CHUNK): 128 splits B = 1 at 4k keys in 32, not 16
        saved_min = cpp.DECODE_LONG_MIN_CHUNK
        try:
            cpp.DECODE_LONG_MIN_CHUNK = 128
            for rule in ("long", "long_waves"):
                cpp.DECODE_SPLIT_RULE = rule
                got = [_split.decode_chunk(nk, cpp.decode_auto_splits(8, 1, nk, 128, 0, 4))[1]
                       for nk in (4096, 16384, 65536, 131072)]
                assert got == [32, 32, 32, 33], (rule, got)
        finally:
            cpp.DECODE_LONG_MIN_CHUNK = saved_min
        cpp.DECODE_SPLIT_RULE = "long_waves"
        assert cpp.decode_auto_splits(8, 1, 1000, 128, 0, 4) == 0 and cpp.decode_auto_splits(8, 1, 4096, 128, 5, 4) == 5
        for batch_kv, nk in ((8, 131072), (8, 16384), (8, 4096), (32, 65536), (64, 131072), (512, 8192)):
            cpp.DECODE_SPLIT_RULE = "long"
            assert cpp.decode_auto_splits(batch_kv, 1, nk, 128, 0, 4) == _split.decode_splits(batch_kv, 1, nk, 0)
            cpp.DECODE_SPLIT_RULE = "blocks"
            assert cpp.decode_auto_splits(batch_kv, 1, nk, 128, 0, 4) == _split.decode_splits(
                batch_kv, 1, nk, 0, max_chunk=cpp.DECODE_CHUNK_KEYS)
        cpp.DECODE_SPLIT_RULE = "long"
        assert cpp.decode_auto_splits(8, 1, 131072, 128, 0, 4) == 33  # chunks of 4k keys at B = 1, H_kv = 8
        assert cpp.decode_auto_splits(8, 1, 131072, 128, 1, 4) == 0
        assert cpp.decode_auto_splits(8, 1, 131072, 128, 7, 4) == 7
        cpp.DECODE_SPLIT_RULE = "fastest"
        with pytest.raises(ValueError, match="DECODE_SPLIT_RULE must be one of"):
            cpp.decode_auto_splits(8, 1, 131072, 128, 0, 4)
    finally:
        cpp.DECODE_SPLIT_RULE, cpp.DECODE_TILE, cpp.DECODE_STAGES, cpp.DECODE_KEY_WARPS = saved


def test_key_warps_fit_the_tile_and_the_block():
    """cuda.flash's decode blocks share each K/V tile among DECODE_KEY_WARPS warps only where
    each warp gets a multiple of 16 keys and the block stays within 4 warps; the kernel
    refuses a tile it cannot share."""
    from attnkern.backends.cuda import cpp

    saved = cpp.DECODE_TILE, cpp.DECODE_KEY_WARPS
    try:
        for tile, kw, warps, want in ((32, 2, 1, 2), (32, 4, 1, 2), (16, 2, 1, 1), (64, 4, 1, 4), (64, 4, 2, 2),
                                      (64, 4, 4, 1), (32, 2, 8, 1), (32, 1, 1, 1)):
            cpp.DECODE_TILE, cpp.DECODE_KEY_WARPS = tile, kw
            assert cpp.decode_key_warps(warps) == want, (tile, kw, warps)
            # the blocks an SM holds count all their warps
            shared = 2 * cpp.DECODE_STAGES * tile * 136 * 2
            assert cpp.decode_slots(128, warps) == cpp.DECODE_SMS * max(1, min(
                32, cpp.DECODE_SM_SHARED // (shared + 1024),
                cpp.DECODE_SM_REGISTERS // (cpp.DECODE_REGISTERS * 32 * warps * want), 64 // (warps * want)))
    finally:
        cpp.DECODE_TILE, cpp.DECODE_KEY_WARPS = saved
    with pytest.raises(ValueError, match="cannot be shared by 4 warps"):
        cpp.flash_decode_kernel("bfloat16", 128, 1, 32, key_warps=4)
    with pytest.raises(ValueError, match=r"DECODE_PREFETCH must be one of \(0, 64, 128, 256\)"):
        cpp.flash_decode_kernel("bfloat16", 128, 1, 64, key_warps=4, prefetch=100)


def test_decode_prefetch_from_the_environment(monkeypatch):
    """ATTNKERN_DECODE_PREFETCH sets cpp.DECODE_PREFETCH at import: unset or empty is the default
    (128 bytes), a size of DECODE_PREFETCHES is taken (0: no hint), anything else is a ValueError
    naming the sizes."""
    require_cuda_kernels()
    from attnkern.backends.cuda import cpp

    assert cpp.DECODE_PREFETCH_DEFAULT == 128
    for text, size in (("", 128), (" 64 ", 64), ("256", 256), ("0", 0)):
        monkeypatch.setenv("ATTNKERN_DECODE_PREFETCH", text)
        assert cpp._prefetch_from_env() == size
    monkeypatch.delenv("ATTNKERN_DECODE_PREFETCH")
    assert cpp._prefetch_from_env() == 128
    for text in ("100", "L2", "64B"):
        monkeypatch.setenv("ATTNKERN_DECODE_PREFETCH", text)
        with pytest.raises(ValueError, match=r"ATTNKERN_DECODE_PREFETCH must be one of \(0, 64, 128, 256\)"):
            cpp._prefetch_from_env()


def test_fused_decode_counters():
    """The fused decode's counters (cpp.decode_counters): int32 zeros on the current device, at
    least as many as asked for, made once (the same array while it is large enough), grown when
    too small with the smaller one kept (a prepared launch may hold its address)."""
    from attnkern.backends.cuda import arrays, cpp

    first = cpp.decode_counters(8)
    assert first.dtype == np.int32 and first.shape[0] >= 8
    assert cpp.decode_counters(first.shape[0]) is first
    grown = cpp.decode_counters(first.shape[0] + 1)
    assert grown.shape[0] > first.shape[0] and cpp.decode_counters(5) is grown
    assert first in cpp._COUNTERS[next(k for k, v in cpp._COUNTERS.items() if grown in v)]
    assert not arrays.to_host(grown).any() and not arrays.to_host(first).any()


@pytest.mark.parametrize("kernel", ["cuda.flash", "triton.flash"])
def test_split_k_is_checked(kernel):
    info = attnkern.kernel_info(kernel)
    assert info["params"]["split_k"]["min"] == 0 and info["params"]["split_k"]["max"] == _split.DECODE_MAX_SPLITS
    if not info["available"]:
        pytest.skip(f"{kernel}: {info['reason']}")
    q = np.zeros((1, 4, 1, 16), np.float32)
    k = np.zeros((1, 2, 2048, 16), np.float32)
    for bad in (-1, 5000):
        with pytest.raises(ValueError, match="split_k"):
            attnkern.attention(q, k, k, kernel=kernel, split_k=bad)
    with pytest.raises(TypeError, match="split_k"):
        attnkern.attention(q, k, k, kernel=kernel, split_k=2.0)


def test_split_k_forced_where_the_decode_path_cannot_run():
    """cuda.flash's decode path is float16/bfloat16 only, with at most 16 query rows a head
    and 128 a group: split_k >= 2 elsewhere is a ValueError that says so; 0 and 1 run the
    regular kernels (float32 in the simulator too)."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 4, 1, 16)).astype(np.float32)
    k = rng.standard_normal((1, 2, 100, 16)).astype(np.float32)  # small: the simulator runs the regular kernel
    with pytest.raises(ValueError, match="split_k=4 asks for the split-K decode path.*float16 and bfloat16"):
        attnkern.attention(q, k, k, kernel="cuda.flash", split_k=4)
    for split_k in (0, 1):
        out = attnkern.attention(q, k, k, kernel="cuda.flash", split_k=split_k, block_q=8, block_k=32)
        assert attnkern.backends.cuda.last_split() == 0
        ref = attnkern.reference(q.astype(np.float64), k.astype(np.float64), k.astype(np.float64))
        assert np.abs(out - ref).max() < 1e-5
    wide = np.zeros((1, 4, 17, 16), np.float16)
    with pytest.raises(ValueError, match="up to 16 query rows a head"):
        attnkern.attention(wide, k.astype(np.float16), k.astype(np.float16), kernel="cuda.flash", split_k=2)


# ------------------------------------------------------------------ on a GPU

gpu = pytest.mark.skipif(SIMULATED, reason="the decode paths are CUDA C++ and Triton: they need a GPU "
                                           "(ATTNKERN_TEST_GPU=1)")

# (B, H, H_kv, Nq, Nk, D) and attention()'s keywords
CASES = {
    "mha-nq1": ((1, 8, 8, 1, 4096, 128), {}),
    "gqa4-nq1-br": ((2, 32, 8, 1, 16384, 128), dict(causal="bottom_right")),
    "gqa4-nq4-odd": ((1, 8, 2, 4, 5000, 128), dict(causal="bottom_right")),
    "gqa8-nq16": ((1, 16, 2, 16, 20000, 64), dict(causal="bottom_right")),
    "lengths": ((3, 8, 2, 3, 9000, 128), dict(causal="bottom_right", key_lengths=[9000, 0, 1234])),
    "window": ((1, 8, 2, 5, 8192, 128), dict(causal="bottom_right", window=(700, 0))),
    "softcap-scale": ((1, 4, 2, 2, 4096, 128), dict(softcap=3.0, scale=0.4)),
    "top-left": ((1, 4, 1, 8, 2048, 128), dict(causal=True)),
    "d64-mqa": ((2, 8, 1, 2, 3000, 64), dict(causal="bottom_right", key_lengths=[3000, 1700])),
}
KERNELS = ["cuda.flash", "triton.flash"]


def _torch():
    return pytest.importorskip("torch")


def _inputs(shape, dtype, seed):
    torch = _torch()
    b, h, hkv, nq, nk, d = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    tdtype = getattr(torch, dtype)
    return tuple(torch.randn(b, heads, n, d, generator=g, device="cuda").to(tdtype)
                 for heads, n in ((h, nq), (hkv, nk), (hkv, nk)))


def _last_split(kernel):
    if kernel == "cuda.flash":
        return attnkern.backends.cuda.last_split()
    import attnkern.backends.triton as tr

    return tr.last_split()


def _auto_splits(kernel, batch_kv, nq, nk, d, kv_group):
    """The chunks the automatic split runs (each backend's own rule)."""
    if kernel == "cuda.flash":
        from attnkern.backends.cuda import cpp

        asked = cpp.decode_auto_splits(batch_kv, nq, nk, d, 0, kv_group)
    else:
        asked = _split.decode_splits(batch_kv, nq, nk, 0)
    return _split.decode_chunk(nk, asked)[1]


def _host(x):
    return x.double().cpu().numpy()


def _check(out, lse, q, k, v, feats):
    """out and lse of a half-precision call against the float64 reference."""
    qh, kh, vh = (_host(x) for x in (q, k, v))
    ref, ref_lse = attnkern.reference(qh, kh, vh, return_lse=True, **feats)
    per = max(1.0, np.abs(vh).max()) * conditioning(qh, kh, feats.get("scale"))
    err = np.abs(_host(out) - ref).max() / per
    bound = tolerance(str(q.dtype).removeprefix("torch."), rounds_p=True)
    assert err <= bound, f"out: scaled error {err:.3g} > {bound:.3g}"
    lse = _host(lse)
    empty = np.isneginf(ref_lse)
    assert np.array_equal(np.isneginf(lse), empty)
    assert (_host(out)[np.broadcast_to(empty[..., None], ref.shape)] == 0).all()
    lerr = (np.abs(lse - ref_lse) / np.maximum(1.0, np.abs(ref_lse)))[~empty].max(initial=0.0)
    assert lerr <= lse_tolerance(str(q.dtype).removeprefix("torch.")), f"lse: {lerr:.3g}"
    return err


def _run(kernel, q, k, v, feats, **params):
    out, lse = attnkern.attention(q, k, v, kernel=kernel, return_lse=True, **feats, **params)
    return out, lse, _last_split(kernel)


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_decode_matches_the_reference_and_takes_the_split_path(kernel, name, dtype):
    shape, feats = CASES[name]
    q, k, v = _inputs(shape, dtype, seed=len(name))
    out, lse, splits = _run(kernel, q, k, v, feats)
    assert splits == _auto_splits(kernel, shape[0] * shape[2], shape[3], shape[4], shape[5],
                                 shape[1] // shape[2]) >= 1, "not the decode path"
    _check(out, lse, q, k, v, feats)
    again = _run(kernel, q, k, v, feats)
    assert again[2] == splits
    torch = _torch()
    assert torch.equal(out, again[0]) and torch.equal(lse, again[1]), "not bit-identical run to run"


@gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_forced_splits_agree_with_the_regular_kernel(kernel):
    """split_k = 1 (the regular kernel), 2, an odd count, and more chunks than 64-key
    tiles (clamped): all within the bound of the reference, and of each other."""
    shape, feats = CASES["lengths"]
    q, k, v = _inputs(shape, "bfloat16", seed=7)
    results = {}
    for split_k in (1, 2, 13, 1024):
        out, lse, splits = _run(kernel, q, k, v, feats, split_k=split_k)
        want = 0 if split_k == 1 else min(split_k, -(-shape[4] // 64))
        assert splits == _split.decode_chunk(shape[4], want)[1] if want else splits == 0, (split_k, splits)
        _check(out, lse, q, k, v, feats)
        results[split_k] = out.double()
    per = 2 * tolerance("bfloat16", rounds_p=True) * max(1.0, float(v.abs().max()))
    for split_k, out in results.items():
        assert float((out - results[1]).abs().max()) <= per, split_k


@gpu
@pytest.mark.parametrize("kernel", KERNELS)
def test_long_cache(kernel):
    """Nk = 128k, H = 32 over H_kv = 8, Nq = 1 and 4, bf16: the case the path is for."""
    torch = _torch()
    for nq in (1, 4):
        shape = (1, 32, 8, nq, 131072, 128)
        q, k, v = _inputs(shape, "bfloat16", seed=nq)
        feats = dict(causal="bottom_right")
        out, lse, splits = _run(kernel, q, k, v, feats)
        assert splits == _auto_splits(kernel, 8, nq, 131072, 128, 4) >= 32
        _check(out, lse, q, k, v, feats)
        off, _, _ = _run(kernel, q, k, v, feats, split_k=1)
        assert float((out.double() - off.double()).abs().max()) <= 2 * tolerance("bfloat16", rounds_p=True) * float(
            v.abs().max())
        del q, k, v, out, off
        torch.cuda.empty_cache()


@gpu
def test_masks_and_float32_keep_the_regular_kernels():
    """cuda.flash: an attention mask, ALiBi or dropout, and float32, run the regular
    kernels by default (last_split() 0) and forcing the split there is a ValueError."""
    torch = _torch()
    q, k, v = _inputs((1, 4, 4, 1, 4096, 64), "bfloat16", seed=3)
    mask = torch.ones(1, 1, 1, 4096, dtype=torch.bool, device="cuda")
    attnkern.attention(q, k, v, kernel="cuda.flash", attn_mask=mask)
    assert attnkern.backends.cuda.last_split() == 0
    with pytest.raises(ValueError, match="no attention mask, ALiBi or dropout"):
        attnkern.attention(q, k, v, kernel="cuda.flash", attn_mask=mask, split_k=4)
    attnkern.attention(q.float(), k.float(), v.float(), kernel="cuda.flash")
    assert attnkern.backends.cuda.last_split() == 0


def _general(fn):
    """fn() with every call on the general path (no prepared launch of _torch_cuda)."""
    from attnkern import _torch_cuda

    _torch_cuda.FAST_PATH = False
    try:
        return fn()
    finally:
        _torch_cuda.FAST_PATH = True


@gpu
@pytest.mark.parametrize("nq", [1, 4])
@pytest.mark.parametrize("kernel", KERNELS)
def test_prepared_decode_matches_the_general_path(kernel, nq):
    """Torch CUDA tensors with grouped k/v heads and bottom-right causal masking (a decode
    step): the first call of a shape leaves a prepared plan with scratch memory, later calls
    (new tensors, lse or not) take it, run the decode path (last_split) and give the general
    path's bits; a call on another stream, and a call with a feature the plan lacks (a
    window), take the general path."""
    torch = _torch()
    from attnkern import _torch_cuda

    shape = (2, 32, 8, nq, 16384, 128)
    feats = dict(causal="bottom_right")

    def call(q, k, v, **kw):
        return attnkern.attention(q, k, v, kernel=kernel, **feats, **kw)

    module = importlib.import_module("attnkern.backends." + kernel.split(".")[0])  # its _LAST: last_split()
    for with_lse in (False, True):
        for seed in range(3):  # the first call plans; the others take the plan, on new tensors
            q, k, v = _inputs(shape, "bfloat16", seed=10 + seed)
            module._LAST.splits = 0
            got = call(q, k, v, return_lse=with_lse, check_finite=seed == 2)
            assert _last_split(kernel) == _auto_splits(kernel, 16, nq, 16384, 128, 4)
            want = _general(lambda: call(q, k, v, return_lse=with_lse, check_finite=seed == 2))
            for a, b in zip(got if with_lse else (got,), want if with_lse else (want,)):
                assert torch.equal(a, b), "the prepared launch differs from the general path"
    # this test's call shape (other tests' plans, e.g. of split_k=1 on the regular kernel, have none)
    plans = [p for key, p in _torch_cuda._plans().items()
             if key[0] == q.shape and key[3] == q.dtype and key[9] == kernel and key[7] == "bottom_right"
             and not key[12]]
    assert plans and all(p.launch is not None and p.scratch > 0 for p in plans), "no prepared decode plan"
    out, lse = call(q, k, v, return_lse=True)
    _check(out, lse, q, k, v, feats)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        on_side = call(q, k, v)
    side.synchronize()
    assert torch.equal(on_side, out)
    windowed = call(q, k, v, window=(1000, 0))
    assert torch.equal(windowed, _general(lambda: call(q, k, v, window=(1000, 0))))


@gpu
@pytest.mark.parametrize("rule", ["waves", "blocks", "long", "long_waves"])
def test_split_rules_and_tiles_match_the_reference(rule):
    """Each split rule (cpp.DECODE_SPLIT_RULE) with the K/V tiles x buffers x key warps of the
    default before the long chunks (32x3x1) and of today's (64x2x4), at a decode step's shape
    (GQA 4, Nq = 1 and 4, bottom-right): the automatic split's chunks run, within the bound of
    the float64 reference, bit-identical run to run."""
    torch = _torch()
    from attnkern.backends.cuda import cpp

    saved = cpp.DECODE_SPLIT_RULE, cpp.DECODE_TILE, cpp.DECODE_STAGES, cpp.DECODE_KEY_WARPS
    feats = dict(causal="bottom_right")
    try:
        cpp.DECODE_SPLIT_RULE = rule
        for nq in (1, 4):
            shape = (2, 32, 8, nq, 16384, 128)
            q, k, v = _inputs(shape, "bfloat16", seed=nq + len(rule))
            for cpp.DECODE_TILE, cpp.DECODE_STAGES, cpp.DECODE_KEY_WARPS in ((32, 3, 1), (64, 2, 4)):
                out, lse, splits = _general(lambda: _run("cuda.flash", q, k, v, feats))
                assert splits == _auto_splits("cuda.flash", 16, nq, 16384, 128, 4) >= 2
                _check(out, lse, q, k, v, feats)
                again = _general(lambda: _run("cuda.flash", q, k, v, feats))
                assert torch.equal(out, again[0]) and torch.equal(lse, again[1]), "not bit-identical run to run"
    finally:
        cpp.DECODE_SPLIT_RULE, cpp.DECODE_TILE, cpp.DECODE_STAGES, cpp.DECODE_KEY_WARPS = saved


@gpu
@pytest.mark.parametrize("tile, key_warps", [(16, 1), (32, 1), (32, 2), (64, 2), (64, 4)])
def test_decode_pipeline_depth_changes_no_bits(tile, key_warps):
    """The decode kernel's K/V buffers (cpp.DECODE_STAGES 2, 3, 4) and the combine's reads in
    flight (DECODE_COMBINE_UNROLL 1, 8) change no arithmetic: the same bits at one tile, one
    count of key warps (cpp.DECODE_KEY_WARPS: warps sharing each tile's keys, merged at the
    end) and one split (forced: the automatic one counts the blocks a config fits on the GPU),
    within the bound of the reference at each, and bit-identical run to run."""
    torch = _torch()
    from attnkern.backends.cuda import cpp

    shape, feats = CASES["lengths"]
    q, k, v = _inputs(shape, "bfloat16", seed=tile)
    saved = cpp.DECODE_TILE, cpp.DECODE_STAGES, cpp.DECODE_COMBINE_UNROLL, cpp.DECODE_KEY_WARPS
    results = {}
    try:
        cpp.DECODE_TILE, cpp.DECODE_KEY_WARPS = tile, key_warps
        assert cpp.decode_key_warps(1) == key_warps
        for stages, unroll in ((2, 1), (2, 8), (3, 8), (4, 8), (4, 1)):
            cpp.DECODE_STAGES, cpp.DECODE_COMBINE_UNROLL = stages, unroll
            out, lse, splits = _general(lambda: _run("cuda.flash", q, k, v, feats, split_k=13))
            assert splits >= 2
            again = _general(lambda: _run("cuda.flash", q, k, v, feats, split_k=13))
            assert torch.equal(out, again[0]) and torch.equal(lse, again[1])
            results[stages, unroll] = out, lse
    finally:
        cpp.DECODE_TILE, cpp.DECODE_STAGES, cpp.DECODE_COMBINE_UNROLL, cpp.DECODE_KEY_WARPS = saved
    first_out, first_lse = results[2, 1]
    _check(first_out, first_lse, q, k, v, feats)
    for key, (out, lse) in results.items():
        assert torch.equal(out, first_out) and torch.equal(lse, first_lse), key


def _counters_are_zero():
    """Every fused-decode counter of every device is back at zero (each launch's last blocks reset them)."""
    from attnkern.backends.cuda import arrays, cpp

    return all(not arrays.to_host(c).any() for have in cpp._COUNTERS.values() for c in have)


@gpu
@pytest.mark.parametrize("name", ["mha-nq1", "gqa4-nq1-br", "gqa4-nq4-odd", "gqa8-nq16", "lengths", "window",
                                  "softcap-scale", "d64-mqa"])
def test_fused_decode_gives_the_bits_of_two_launches(name):
    """cpp.DECODE_FUSED (one launch: the last block of each k/v row to finish merges the row's
    chunks, in chunk order) against the two launches (the partials, then flash_combine.cu): the
    same bits, out and lse, at the automatic split and forced splits (2, 13, 1024: more chunks
    than tiles, clamped), with today's tiles (64x2x4) and those before (32x3x1); within the bound
    of the float64 reference; bit-identical run to run; the counters back at zero after the calls."""
    torch = _torch()
    from attnkern.backends.cuda import cpp

    shape, feats = CASES[name]
    q, k, v = _inputs(shape, "bfloat16", seed=20 + len(name))
    saved = cpp.DECODE_FUSED, cpp.DECODE_TILE, cpp.DECODE_STAGES, cpp.DECODE_KEY_WARPS
    try:
        for cpp.DECODE_TILE, cpp.DECODE_STAGES, cpp.DECODE_KEY_WARPS in ((64, 2, 4), (32, 3, 1)):
            for split_k in (0, 2, 13, 1024):
                results = []
                for cpp.DECODE_FUSED in (True, True, False):
                    results.append(_general(lambda: _run("cuda.flash", q, k, v, feats, split_k=split_k)))
                (out, lse, splits), again, two = results
                assert splits >= 1 and again[2] == two[2] == splits
                assert torch.equal(out, again[0]) and torch.equal(lse, again[1]), "fused: not bit-identical run to run"
                assert torch.equal(out, two[0]) and torch.equal(lse, two[1]), "fused and two launches differ"
                if split_k in (0, 13):
                    _check(out, lse, q, k, v, feats)
    finally:
        cpp.DECODE_FUSED, cpp.DECODE_TILE, cpp.DECODE_STAGES, cpp.DECODE_KEY_WARPS = saved
    torch.cuda.synchronize()
    assert _counters_are_zero()


@gpu
def test_fused_decode_with_more_kv_rows_than_counters():
    """A fused decode call over more k/v rows than the first counters hold (4096): the counters
    grow, the call gives the two launches' bits and agrees with the regular kernel, and every
    counter is back at zero after it; out only (the fused variant without lse)."""
    torch = _torch()
    from attnkern.backends.cuda import cpp

    q, k, v = _inputs((520, 8, 8, 1, 1024, 64), "bfloat16", seed=5)
    saved = cpp.DECODE_FUSED
    try:
        got = {}
        for cpp.DECODE_FUSED in (True, False):
            got[cpp.DECODE_FUSED] = _general(lambda: attnkern.attention(q, k, v, kernel="cuda.flash", split_k=3))
            assert attnkern.backends.cuda.last_split() == 3
    finally:
        cpp.DECODE_FUSED = saved
    assert torch.equal(got[True], got[False])
    regular = attnkern.attention(q, k, v, kernel="cuda.flash", split_k=1)
    bound = 2 * tolerance("bfloat16", rounds_p=True) * float(v.abs().max())
    assert float((got[True].double() - regular.double()).abs().max()) <= bound
    torch.cuda.synchronize()
    assert max(c.shape[0] for have in cpp._COUNTERS.values() for c in have) >= 4160
    assert _counters_are_zero()


@gpu
@pytest.mark.parametrize("fused", [True, False])
def test_shorter_long_chunks_match_the_reference(fused):
    """cpp.DECODE_LONG_MIN_CHUNK = 128 (B = 1, H 32/8, Nk = 4096: 32 chunks of 128 keys, 256
    blocks), fused and not, Nq 1 and 4: within the bound of the reference, bit-identical run to
    run, and (fused) the bits of the two launches."""
    torch = _torch()
    from attnkern.backends.cuda import cpp

    saved = cpp.DECODE_LONG_MIN_CHUNK, cpp.DECODE_FUSED
    feats = dict(causal="bottom_right")
    try:
        cpp.DECODE_LONG_MIN_CHUNK, cpp.DECODE_FUSED = 128, fused
        for nq in (1, 4):
            q, k, v = _inputs((1, 32, 8, nq, 4096, 128), "bfloat16", seed=30 + nq)
            out, lse, splits = _general(lambda: _run("cuda.flash", q, k, v, feats))
            assert splits == 32
            _check(out, lse, q, k, v, feats)
            again = _general(lambda: _run("cuda.flash", q, k, v, feats))
            assert torch.equal(out, again[0]) and torch.equal(lse, again[1])
            cpp.DECODE_FUSED = not fused
            other = _general(lambda: _run("cuda.flash", q, k, v, feats))
            cpp.DECODE_FUSED = fused
            assert torch.equal(out, other[0]) and torch.equal(lse, other[1])
    finally:
        cpp.DECODE_LONG_MIN_CHUNK, cpp.DECODE_FUSED = saved


@gpu
@pytest.mark.parametrize("stages", [2, 3])
def test_decode_prefetch_changes_no_bits(stages):
    """The K/V loads' L2 prefetch hint (cpp.DECODE_PREFETCH 64, 128, 256 bytes) and their L2
    evict-first policy (cpp.DECODE_EVICT_FIRST) change how the cache is fetched, not what is
    computed: the bits of neither, fused and in two launches, at 64-key tiles with 2 and 3
    buffers, within the bound of the reference."""
    torch = _torch()
    from attnkern.backends.cuda import cpp

    shape, feats = CASES["lengths"]
    q, k, v = _inputs(shape, "bfloat16", seed=40 + stages)
    saved = cpp.DECODE_PREFETCH, cpp.DECODE_FUSED, cpp.DECODE_STAGES, cpp.DECODE_EVICT_FIRST
    results = {}
    try:
        cpp.DECODE_STAGES = stages
        for cpp.DECODE_FUSED in (True, False):
            for cpp.DECODE_PREFETCH in (0, 64, 128, 256):
                for cpp.DECODE_EVICT_FIRST in (0, 1):
                    out, lse, splits = _general(lambda: _run("cuda.flash", q, k, v, feats, split_k=13))
                    assert splits >= 2
                    results[cpp.DECODE_FUSED, cpp.DECODE_PREFETCH, cpp.DECODE_EVICT_FIRST] = out, lse
    finally:
        cpp.DECODE_PREFETCH, cpp.DECODE_FUSED, cpp.DECODE_STAGES, cpp.DECODE_EVICT_FIRST = saved
    first_out, first_lse = results[True, 0, 0]
    _check(first_out, first_lse, q, k, v, feats)
    for key, (out, lse) in results.items():
        assert torch.equal(out, first_out) and torch.equal(lse, first_lse), key


# groups of at most 8 query rows (kv_group x nq), with the features the decode takes
KEYS_M_CASES = {
    "lengths-g4": ((3, 8, 2, 1, 9000, 128), dict(causal="bottom_right", key_lengths=[9000, 0, 1234])),
    "window-g2-nq4": ((1, 4, 2, 4, 8192, 128), dict(causal="bottom_right", window=(700, 0))),
    "top-left-g4-nq2-d64": ((1, 8, 2, 2, 2048, 64), dict(causal=True)),
    "softcap-g8-d48": ((1, 8, 1, 1, 3000, 48), dict(softcap=2.0, scale=0.5)),
    "mqa-nq8-d32": ((2, 1, 1, 8, 5000, 32), dict(causal="bottom_right")),
}


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", KEYS_M_CASES)
def test_decode_keys_on_m_layout(name, dtype):
    """Groups of at most 8 query rows take the decode kernel with the keys on the mma's M
    (cpp.DECODE_KEYS_M): it and the row layout (DECODE_KEYS_M = 0) are each within the bound
    of the float64 reference and of each other, each bit-identical run to run, and fused or in
    two launches the same bits; the kernel asked for is the one the setting names."""
    torch = _torch()
    from attnkern.backends.cuda import cpp

    shape, feats = KEYS_M_CASES[name]
    q, k, v = _inputs(shape, dtype, seed=sum(map(ord, name)))
    saved = cpp.DECODE_KEYS_M, cpp.DECODE_FUSED, cpp.flash_decode_kernel
    asked = []

    def recording(*args, **kwargs):
        asked.append(kwargs.get("keys_m", False))
        return saved[2](*args, **kwargs)

    results = {}
    try:
        cpp.flash_decode_kernel = recording
        for cpp.DECODE_KEYS_M in (1, 0):
            for cpp.DECODE_FUSED in (True, False):
                asked.clear()
                runs = [_general(lambda: _run("cuda.flash", q, k, v, feats, split_k=7)) for _ in range(2)]
                assert asked and all(x == bool(cpp.DECODE_KEYS_M) for x in asked), asked
                (out, lse, splits), (again, again_lse, _) = runs
                assert splits >= 2
                assert torch.equal(out, again) and torch.equal(lse, again_lse), "not bit-identical run to run"
                results[cpp.DECODE_KEYS_M, cpp.DECODE_FUSED] = out, lse
    finally:
        cpp.DECODE_KEYS_M, cpp.DECODE_FUSED, cpp.flash_decode_kernel = saved
    for keys_m in (1, 0):
        out, lse = results[keys_m, True]
        _check(out, lse, q, k, v, feats)
        assert torch.equal(out, results[keys_m, False][0]) and torch.equal(lse, results[keys_m, False][1]), keys_m
    per = 2 * tolerance(dtype, rounds_p=True) * max(1.0, float(v.abs().max()))
    assert float((results[1, True][0].double() - results[0, True][0].double()).abs().max()) <= per
