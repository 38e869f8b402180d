"""The cuda.* kernels against the float64 reference. Without a GPU they run in
Numba's CUDA simulator (conftest sets NUMBA_ENABLE_CUDASIM=1 unless
ATTNKERN_TEST_GPU=1), which runs a Python thread per GPU thread: shapes are
small, tiles smaller, so several tiles, partial tiles and the causal diagonal
are all crossed. The simulator has no warp shuffles; attnkern.backends.cuda.numba_kernels.lane_reduce
emulates them there (the device script checks the real ones on a GPU)."""

import functools
import importlib.util
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest

import attnkern
from conftest import assert_lse_matches_reference, assert_matches_reference, random_qkv, require_cuda_kernels

CUDA = [k for k in attnkern.kernels() if k.startswith("cuda.")]
SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"
require_cuda_kernels()
assert all(attnkern.kernel_info(k)["available"] for k in CUDA), [attnkern.kernel_info(k)["reason"] for k in CUDA]

from numba import cuda  # noqa: E402  (numba-cuda is there: the kernels are available)


def is_gpu_array(x):
    # the simulator's device arrays have no __cuda_array_interface__
    simulated = type(x).__module__.startswith("numba.cuda.simulator")
    return (simulated or hasattr(x, "__cuda_array_interface__")) and not isinstance(x, np.ndarray)

# (kernel, tunables): tiles of 8 and 16 on the odd sizes below give several
# full tiles, a partial one, and (for flash) groups of 2, 4 and 8 lanes
CONFIGS = [
    ("cuda.naive", {"tile": 8}),
    ("cuda.flash", {"block_q": 8, "block_k": 8}),
    ("cuda.flash", {"block_q": 16, "block_k": 16}),
    ("cuda.flash", {"block_q": 8, "block_k": 32}),
]
# (lead, nq, nk, d, dv): sizes that do not divide the tiles, nq > nk and nq < nk, D = 1
SHAPES = [((), 13, 11, 5, 3), ((2,), 9, 20, 17, 8), ((1, 2), 10, 6, 1, 2)]


@pytest.mark.parametrize("kernel, params", CONFIGS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_reference(kernel, params, dtype, causal):
    rng = np.random.default_rng(zlib.crc32(repr((kernel, params, dtype, causal)).encode()))
    for lead, nq, nk, d, dv in SHAPES:
        q, k, v = random_qkv(rng, lead, nq, nk, d, dv, dtype)
        scale = rng.uniform(-1, 1)
        out = attnkern.attention(q, k, v, causal=causal, scale=scale, kernel=kernel, **params)
        assert isinstance(out, np.ndarray)  # NumPy in, NumPy out (copied there and back)
        assert_matches_reference(out, q, k, v, causal, scale)


@pytest.mark.parametrize("kernel", CUDA)
def test_default_tiles_and_huge_scores(kernel):
    """Default tunables, scores of 1e4 (stable softmax), the one-hot answer."""
    rng = np.random.default_rng(1)
    n, d = 21, 4
    q = np.zeros((1, n, d), np.float32)
    k = np.zeros((1, n, d), np.float32)
    q[..., 0] = 100.0
    k[..., 0] = 100.0 + rng.permutation(n) * 0.5
    v = rng.standard_normal((1, n, 3)).astype(np.float32)
    for causal in (False, True):
        out = attnkern.attention(q, k, v, causal=causal, scale=1.0, kernel=kernel)
        ref = attnkern.reference(q, k, v, causal=causal, scale=1.0)
        np.testing.assert_allclose(out, ref, rtol=0, atol=1e-6 * np.abs(v).max())


@pytest.mark.parametrize("kernel", CUDA)
def test_device_arrays_in_device_arrays_out(kernel):
    rng = np.random.default_rng(2)
    q, k, v = random_qkv(rng, (2,), 10, 12, 6, 5, np.float32)
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    params = dict(CONFIGS)[kernel]
    out = attnkern.attention(dq, dk, dv, causal=True, kernel=kernel, **params)
    assert is_gpu_array(out)
    assert out.shape == (2, 10, 5)
    assert_matches_reference(out.copy_to_host(), q, k, v, causal=True)


def test_auto_sends_gpu_arrays_to_cuda_flash():
    rng = np.random.default_rng(8)
    q, k, v = random_qkv(rng, (), 10, 12, 6, 5, np.float32)
    out = attnkern.attention(*(cuda.to_device(x) for x in (q, k, v)))
    assert is_gpu_array(out)
    assert_matches_reference(out.copy_to_host(), q, k, v)
    assert attnkern._api._auto(device=True).name == "cuda.flash"


class Borrowed:
    """Some other library's GPU array: only __cuda_array_interface__."""

    def __init__(self, device_array):
        self._owner = device_array
        self.__cuda_array_interface__ = device_array.__cuda_array_interface__


@pytest.mark.skipif(SIMULATED, reason="the simulator's device arrays have no __cuda_array_interface__")
def test_any_cuda_array_interface_object():
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, (), 7, 9, 4, 4, np.float64)
    dq, dk, dv = (Borrowed(cuda.to_device(x)) for x in (q, k, v))
    out = attnkern.attention(dq, dk, dv, kernel="cuda.naive", tile=8)
    assert is_gpu_array(out)
    assert_matches_reference(out.copy_to_host(), q, k, v)


def test_device_bad_input():
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, (2,), 6, 6, 4, 4, np.float32)
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    with pytest.raises(TypeError, match="all be host .NumPy. arrays or all GPU arrays, got q on the GPU, k on the host"):
        attnkern.attention(dq, k, v, kernel="cuda.flash")
    with pytest.raises(TypeError, match="native.flash runs on the CPU and q, k, v are GPU arrays"):
        attnkern.attention(dq, dk, dv, kernel="native.flash")
    bad = q.copy()
    bad[1, 2, 3] = np.nan
    with pytest.raises(ValueError, match="q contains NaN or infinity"):
        attnkern.attention(cuda.to_device(bad), dk, dv)
    with pytest.raises(TypeError, match="must share one dtype"):
        attnkern.attention(dq, cuda.to_device(k.astype(np.float64)), dv)
    with pytest.raises(ValueError, match="multiple of the k/v heads"):  # 2 query heads, 3 k/v heads
        attnkern.attention(dq, cuda.to_device(np.concatenate([k, k[:1]])), cuda.to_device(np.concatenate([v, v[:1]])))
    with pytest.raises(ValueError, match="cuda.naive does not support grouped-query attention"):  # cuda.flash does
        attnkern.attention(dq, cuda.to_device(k[:1]), cuda.to_device(v[:1]), kernel="cuda.naive")
    with pytest.raises(ValueError, match="not C-contiguous"):
        attnkern.attention(cuda.to_device(np.asfortranarray(q)), dk, dv)
    empty = attnkern.attention(cuda.to_device(q[:, :0]), dk, dv)
    assert is_gpu_array(empty) and empty.shape == (2, 0, 4)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the simulator computes in NumPy: overflow, inf - inf
def test_overflowing_scores_raise():
    q = np.full((4, 8), 1e20, dtype=np.float32)
    with pytest.raises(FloatingPointError, match="overflows float32"):
        attnkern.attention(q, q, q, kernel="cuda.flash", block_q=8, block_k=8)


def test_tunables_are_validated():
    q, k, v = random_qkv(np.random.default_rng(5), (), 4, 4, 4, 4, np.float32)
    with pytest.raises(ValueError, match=r"block_q=12 is not allowed; choose one of 0, 8, 16, 32, 64, 128"):
        attnkern.attention(q, k, v, kernel="cuda.flash", block_q=12)
    with pytest.raises(ValueError, match=r"tile=64 is not allowed; choose one of 8, 16, 32"):
        attnkern.attention(q, k, v, kernel="cuda.naive", tile=64)
    with pytest.raises(TypeError, match="cuda.flash does not take 'num_threads'"):
        attnkern.attention(q, k, v, kernel="cuda.flash", num_threads=2)
    # a tile that does not fit in shared memory is refused before launch ...
    big_d = np.ones((4, 2048), np.float64)
    with pytest.raises(ValueError, match="needs .* bytes of shared memory: cuda.flash takes up to 49152"):
        attnkern.attention(big_d, big_d, big_d, kernel="cuda.flash", block_q=128, block_k=128)
    # ... and with 0 (the default) the largest that fits is picked; at D = 2048 in
    # float64 none does, even with a GPU's dynamic shared memory, and the error says
    # what to do instead
    with pytest.raises(ValueError, match="use smaller blocks .*, float32, or cuda.naive"):
        attnkern.attention(big_d, big_d, big_d, kernel="cuda.flash")
    info = attnkern.kernel_info("cuda.flash")["params"]
    assert info["block_q"]["choices"] == [0, 8, 16, 32, 64, 128]


def test_the_fast_path_keys_numpy_scales_and_refuses_ambiguous_arguments():
    # A NumPy scale (1 / np.sqrt(d)) keys a plan as the float it equals; True (== 1) does not
    from attnkern._torch_cuda import _arguments_fit

    for scale in (None, 0.125, 2, np.float64(0.125), np.float32(0.5), np.int64(3)):
        assert _arguments_fit(False, scale, "cuda.flash", {}), scale
    assert {(False, np.float64(0.125)): 1}[(False, 0.125)] == 1  # equal keys, one plan
    for causal, scale, params in ((1, None, {}), (False, True, {}), (False, "0.1", {}),
                                  (False, None, {"block_q": 64.0})):
        assert not _arguments_fit(causal, scale, "cuda.flash", params), (causal, scale, params)


def test_bitwise_deterministic():
    rng = np.random.default_rng(6)
    q, k, v = random_qkv(rng, (), 17, 15, 6, 3, np.float32)
    for kernel, params in CONFIGS[:2]:
        first = attnkern.attention(q, k, v, causal=True, kernel=kernel, **params)
        again = attnkern.attention(q, k, v, causal=True, kernel=kernel, **params)
        assert first.tobytes() == again.tobytes()


def test_without_a_gpu_the_kernels_say_why():
    """A fresh process with the simulator off, on a machine with no GPU."""
    code = (
        "import attnkern, numpy as np\n"
        "info = attnkern.kernel_info('cuda.flash')\n"
        "print('AVAILABLE' if info['available'] else 'REASON ' + info['reason'])\n"
        "try:\n"
        "    attnkern.attention(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32),"
        " np.ones((2, 2), np.float32), kernel='cuda.flash')\n"
        "except RuntimeError as exc:\n"
        "    print('ERROR', exc)\n"
    )
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    if "AVAILABLE" in result.stdout:
        pytest.skip("this machine has a usable GPU")
    assert "REASON no usable CUDA GPU" in result.stdout
    assert "ERROR kernel cuda.flash is not available here: no usable CUDA GPU" in result.stdout


def test_half_head_size_refusals():
    """float16/bfloat16 take D = Dv a multiple of 16 up to 256 (forward and backward; above 128
    on flash_mma.cu's 64-row blocks and flash_bwd_mma.cu's column slices), anything else is
    refused naming triton.flash; float32's tensor-core kernels and the decode path stay at 128."""
    from attnkern.backends import cuda as cuda_backend
    from attnkern.backends.cuda import cpp

    for d, dv in ((160, 160), (208, 208), (256, 256), (16, 16)):
        assert cuda_backend._flash_head_sizes(d, dv, "bfloat16") is None
    for d, dv in ((272, 272), (256, 128), (40, 40)):
        why = cuda_backend._flash_head_sizes(d, dv, "float16")
        assert "multiple of 16 up to 256" in why and "triton.flash" in why
    assert not cpp.mma_head_size_ok(256, 256) and cpp.tf32_config(256, 256) is None
    assert "up to 128" in cpp.decode_refusal("bfloat16", 1, 8, 256, 256, None)
    # the forward's division above 128: 4 warps of one mma tile, Q in shared memory, 32-key tiles, within
    # the A100's shared memory
    for d in (144, 256):
        config = cpp.mma_config(d, "bfloat16")
        assert (config.mt, config.warps, config.block_k, config.q_smem) == (1, 4, 32, True)
        assert config.shared_bytes(d) <= 163 * 1024


def test_wgmma_tma_division_and_prepared_tensor_maps(monkeypatch):
    """flash_wgmma.cu's TMA producer (WgmmaConfig.tma, named by a t suffix) needs the
    warp-specialized variant; the plain kernel's default has it, the featured and float32-rows
    kernels' default (WGMMA_OTHER) not, nor does an explicit division's featured kernel; a prepared launch
    writes each call's K/V descriptor address (launch.TensorMap: looked up per call from the
    array's address), never the array's address, and looks nothing up for the placeholders."""
    import ctypes

    from attnkern._gpuarray import GpuArray
    from attnkern.backends.cuda import cpp, launch

    tma = cpp.WgmmaConfig(2, 128, 3, early_k=True, tma=True)
    assert str(tma) == "wg2k128s3et" and tma.tma_off() == cpp.WgmmaConfig(2, 128, 3, early_k=True)
    tma.check(128)
    # the plain kernel's default takes the TMA; the featured and float32-rows kernels' default never
    monkeypatch.setattr(cpp, "wgmma_applies", lambda d, dv: True)
    monkeypatch.setattr(cpp, "shared_limit", lambda: cpp.WGMMA_SHARED_LIMIT)
    for d in (64, 128):
        assert cpp.half_config(d) is cpp.WGMMA_DEFAULT[d] and cpp.half_config(d).tma
        assert cpp.half_config(d, plain=False) is cpp.WGMMA_OTHER[d] and not cpp.WGMMA_OTHER[d].tma
    with pytest.raises(ValueError, match="TMA with stages"):
        cpp.WgmmaConfig(2, 128, 0, tma=True).check(64)
    cpp.WgmmaConfig(2, 256, 2, pingpong=True, early_k=True, tma=True).check(64)  # m64n256 scores at D = 64
    with pytest.raises(ValueError, match="256-key tiles not in FP8"):
        cpp.WgmmaConfig(2, 256, 2, pingpong=True, early_k=True, tma=True).check(128, itemsize=1)
    with pytest.raises(ValueError, match="bytes of shared memory"):
        cpp.WgmmaConfig(2, 256, 2, pingpong=True, early_k=True, tma=True).check(128)  # 294 KB at D = 128
    looked_up = []

    def fake_address(ptr, shape, box_rows):
        looked_up.append((ptr, shape, box_rows))
        return 2 * ptr + box_rows

    monkeypatch.setattr(launch, "tensor_map_address", fake_address)
    roles = [GpuArray((2, 8, 64), np.uint16, None, ptr=0) for _ in range(2)]
    seen = []

    def raw(grid, block, params_at):
        params = (ctypes.c_void_p * 3).from_address(params_at)
        seen.append([ctypes.c_uint64.from_address(p).value for p in params])

    prepared = launch.Prepared(raw, (1, 1), 128, (launch.Addr(roles[0]), launch.TensorMap(roles[1], 128),
                                                  np.int32(5)), roles)
    assert looked_up == []
    prepared(4096, 8192)
    prepared(4096, 16384)
    assert seen == [[4096, 2 * 8192 + 128, 5], [4096, 2 * 16384 + 128, 5]]
    assert looked_up == [(8192, (2, 8, 64), 128), (16384, (2, 8, 64), 128)]


def test_wgmma_persistent_division(monkeypatch):
    """flash_wgmma.cu's persistent kernel (WgmmaConfig.persistent, named by a P suffix): names parse
    back to their division; it needs the TMA producer and float16/bfloat16; the featured kernels' form
    (tma_off) is the plain walk's; a plain launch takes min(tiles, SMs) blocks and the batch rows as one
    more argument, the same division without P the (query blocks, batch rows) grid."""
    from attnkern._gpuarray import GpuArray
    from attnkern.backends.cuda import cpp

    persistent = cpp.WgmmaConfig(2, 176, 2, pingpong=True, early_k=True, tma=True, persistent=True)
    assert str(persistent) == "wg2k176s2petP"
    for name in ("wg2k176s2petP", "wg2k128s3etP", "wg2k128s3et", "wg3k64", "wg2k192s2petx1h", "wg2k128s3e",
                 "wg2k176s2petPd"):
        assert str(cpp.WgmmaConfig.parse(name)) == name
    assert cpp.WgmmaConfig.parse("wg2k176s2petP") == persistent
    with pytest.raises(ValueError, match="not a flash_wgmma.cu division"):
        cpp.WgmmaConfig.parse("wg2k176s2pPet")
    persistent.check(128)
    cpp.WgmmaConfig.parse("wg2k128s3etP").check(64)
    with pytest.raises(ValueError, match="persistent"):
        cpp.WgmmaConfig.parse("wg2k128s3eP").check(64)  # cp.async copies
    with pytest.raises(ValueError, match="persistent"):
        cpp.WgmmaConfig(2, 192, 2, True, True, True, fp8_exp=1, persistent=True).check(128, itemsize=1)
    assert persistent.tma_off() == cpp.WgmmaConfig(2, 176, 2, pingpong=True, early_k=True)
    monkeypatch.setattr(cpp, "sm_count", lambda: 132)
    assert cpp.persistent_grid(384) == (132, 1) and cpp.persistent_grid(20) == (20, 1)
    assert cpp.persistent_grid(0) == (1, 1)
    kernels = []
    monkeypatch.setattr(cpp, "flash_mma_kernel", lambda dtype, d, config, *a, **kw: kernels.append(str(config)))
    import ml_dtypes

    for batch, nq, grid in ((48, 1000, (132, 1)), (2, 300, (6, 1))):  # 8 x 48 tiles; 3 x 2
        q = GpuArray((batch, nq, 128), ml_dtypes.bfloat16, None, ptr=1 << 20)
        _, got, _, args = cpp.flash_mma_launch(q, q, q, q, True, 0.1, None, config=persistent)
        assert got == grid and args[-1] == np.int32(batch) and len(args) == 11 + len(cpp.FEAT_TYPES)
        _, got, _, args = cpp.flash_mma_launch(q, q, q, q, True, 0.1, None, config=persistent.tma_off())
        assert got == (-(-nq // 128), batch) and len(args) == 10 + len(cpp.FEAT_TYPES)
    assert kernels == ["wg2k176s2petP", "wg2k176s2pe"] * 2
    # the dynamic walk (Pd): the counter's address as one more argument, its two slots in shared memory
    dynamic = cpp.WgmmaConfig.parse("wg2k176s2petPd")
    dynamic.check(128)
    assert dynamic.shared_bytes(128) == persistent.shared_bytes(128) + 48
    with pytest.raises(ValueError, match="persistent"):
        cpp.WgmmaConfig.parse("wg2k176s2petd").check(128)
    monkeypatch.setattr(cpp, "tile_counters", lambda: 4096)
    _, got, _, args = cpp.flash_mma_launch(q, q, q, q, True, 0.1, None, config=dynamic)
    assert got == (6, 1) and args[-2:] == (np.int32(2), np.uint64(4096))


def test_plain_calls_take_the_dynamic_walk_where_it_was_measured(monkeypatch):
    """The default division's dynamic persistent form (Pd) runs a plain call of the TMA default whose
    query length lies in cpp.PERSIST_NQ[d][causal]'s range with at least its folded batch rows; outside that
    range, for featured calls, the float32-rows variant, an explicit division or with the rule off
    (PERSIST_NQ None), the division is as given."""
    import ml_dtypes

    from attnkern._gpuarray import GpuArray
    from attnkern.backends.cuda import cpp

    default = cpp.WgmmaConfig.parse("wg2k176s2pet")
    monkeypatch.setattr(cpp, "tensor_core_config", lambda d, dtype, plain=True: default if plain else default.tma_off())
    monkeypatch.setattr(cpp, "tile_counters", lambda: 4096)
    monkeypatch.setattr(cpp, "sm_count", lambda: 132)
    monkeypatch.setattr(cpp, "shared_limit", lambda: cpp.WGMMA_SHARED_LIMIT)
    kernels = []
    monkeypatch.setattr(cpp, "flash_mma_kernel", lambda dtype, d, config, *a, **kw: kernels.append(str(config)))
    for causal in (False, True):
        lo, hi, least = cpp.PERSIST_NQ[128][causal]
        for rows, nq, want in ((least, lo, "wg2k176s2petPd"), (128, hi, "wg2k176s2petPd"),
                               (least - 1, lo, "wg2k176s2pet"), (128, lo - 1, "wg2k176s2pet"),
                               (128, hi + 1, "wg2k176s2pet")):
            q = GpuArray((rows, nq, 128), ml_dtypes.bfloat16, None, ptr=1 << 20)
            kernels.clear()
            cpp.flash_mma_launch(q, q, q, q, causal, 0.1, None)
            assert kernels == [want], (rows, nq, causal)
    lo, hi, least = cpp.PERSIST_NQ[128][False]
    q = GpuArray((64, lo, 128), ml_dtypes.bfloat16, None, ptr=1 << 20)
    kernels.clear()
    cpp.flash_mma_launch(q, q, q, q, False, 0.1, None, config=default)  # a division given: as it is
    cpp.flash_mma_launch(q, q, q, q, False, 0.1, None, wide=True)  # the float32 rows' variant
    monkeypatch.setattr(cpp, "PERSIST_NQ", None)
    cpp.flash_mma_launch(q, q, q, q, False, 0.1, None)
    assert kernels == ["wg2k176s2pet", "wg2k176s2pe", "wg2k176s2pet"]
    assert str(cpp.persist_rule(cpp.WgmmaConfig.parse("wg2k128s3e"), 64, lo, 128)) == "wg2k128s3e"  # no TMA
    monkeypatch.setattr(cpp, "PERSIST_NQ", {128: {False: (lo, hi, least), True: (lo, hi, least)}})
    assert cpp.persist_rule(cpp.WgmmaConfig.parse("wg2k128s3et"), 64, lo, 64).persistent is False  # not measured
    monkeypatch.setattr(cpp, "shared_limit", lambda: default.shared_bytes(128))  # no room for the walk's slots
    assert cpp.persist_rule(default, 64, lo, 128) == default


def _rule_picks(monkeypatch):
    """cpp with Hopper's head sizes, 132 SMs and its shared memory a block, and flash_mma_kernel recording
    the division instead of compiling: picks(rows, nq, d, causal, **kw) -> the division a plain call of
    (rows, nq, d) bfloat16 arrays runs (flash_mma_launch's choice)."""
    import ml_dtypes

    from attnkern._gpuarray import GpuArray
    from attnkern.backends.cuda import cpp

    monkeypatch.setattr(cpp, "wgmma_applies", lambda d, dv: d == dv and d in cpp.WGMMA_HEAD_SIZES)
    monkeypatch.setattr(cpp, "tile_counters", lambda: 4096)
    monkeypatch.setattr(cpp, "sm_count", lambda: 132)
    monkeypatch.setattr(cpp, "shared_limit", lambda: cpp.WGMMA_SHARED_LIMIT)
    kernels = []
    monkeypatch.setattr(cpp, "flash_mma_kernel", lambda dtype, d, config, *a, **kw: kernels.append(str(config)))

    def picks(rows, nq, d, causal, **kw):
        q = GpuArray((rows, nq, d), ml_dtypes.bfloat16, None, ptr=1 << 20)
        kernels.clear()
        cpp.flash_mma_launch(q, q, q, q, causal, 0.1, None, **kw)
        return kernels[0]

    return picks


def test_plain_calls_take_the_short_walk_where_it_was_measured(monkeypatch):
    """cpp.persist_rule's first range: a plain call of the default whose query length lies in
    cpp.SHORT_NQ[d][causal]'s range, with at least its folded batch rows, runs WGMMA_SHORT[d]'s
    dynamic walk (wg2k128s3etPd; D = 128, and D = 64 causal at N = 1024); below the rows or outside
    the range the default or its own walk (PERSIST_NQ); a division given as it is; SHORT_NQ None
    turns the rule off."""
    from attnkern.backends.cuda import cpp

    picks = _rule_picks(monkeypatch)
    default, short = cpp.WGMMA_DEFAULT[128], f"{cpp.WGMMA_SHORT[128]}Pd"
    assert short == "wg2k128s3etPd"
    for causal in (False, True):
        lo, hi, least = cpp.SHORT_NQ[128][causal]
        for rows, nq, want in ((least, lo, short), (128, hi, short), (least - 1, lo, str(default)),
                               (128, lo - 1, str(default)), (128, hi + 1, f"{default}Pd")):
            assert picks(rows, nq, 128, causal) == want, (rows, nq, causal)
    assert picks(128, 1024, 128, False, config=default) == str(default)  # a division given: as it is
    # D = 64: causal calls at N = 1024 from 128 rows only; the rest as narrow_rule and PERSIST_NQ say
    d64 = f"{cpp.WGMMA_DEFAULT[64]}Pd"
    assert f"{cpp.WGMMA_SHORT[64]}Pd" == "wg2k128s3etPd"
    for rows, nq, causal, want in ((128, 1024, True, "wg2k128s3etPd"), (127, 1024, True, d64),
                                   (128, 2048, True, d64), (128, 1024, False, d64),
                                   (128, 1023, True, str(cpp.WGMMA_DEFAULT[64]))):  # below PERSIST_NQ's range
        assert picks(rows, nq, 64, causal) == want, (rows, nq, causal)
    monkeypatch.setattr(cpp, "SHORT_NQ", None)
    assert picks(128, 1024, 128, False) == str(default) and picks(128, 1024, 64, True) == d64


def test_plain_calls_take_narrower_blocks_where_the_last_wave_is_short(monkeypatch):
    """cpp.narrow_rule: a plain call without causal masking at D = 64 runs WGMMA_NARROW[64] (128-row
    blocks) where the default's 192-row blocks fill less than NARROW_FILL of their last wave on this
    GPU's SMs and the narrow ones fill more; else the default (or its walk, persist_rule): causal calls,
    other head sizes, a division given."""
    from attnkern.backends.cuda import cpp

    picks = _rule_picks(monkeypatch)
    assert cpp.wave_fill(132) == 1.0 and cpp.wave_fill(176) == 176 / 264
    default, narrow = cpp.WGMMA_DEFAULT[64], cpp.WGMMA_NARROW[64]
    assert (default.block_q, narrow.block_q) == (192, 128)
    for rows, nq, causal, want in ((16, 2048, False, str(narrow)),  # 176 blocks: 0.67 of 2 waves; 256: 0.97
                                   (16, 2048, True, f"{default}Pd"),
                                   (16, 4096, False, f"{default}Pd"),  # 352 blocks: 0.89
                                   (16, 16384, False, str(default)), (1, 100, False, str(default)),
                                   (16, 8192, False, str(default)), (16, 8192, True, f"{default}Pd")):
        assert picks(rows, nq, 64, causal) == want, (rows, nq, causal)
    assert picks(16, 2048, 64, False, config=default) == str(default)  # a division given: as it is
    assert cpp.narrow_rule(cpp.WGMMA_DEFAULT[128], 16, 2048, 128, False) is cpp.WGMMA_DEFAULT[128]


@pytest.mark.skipif(SIMULATED, reason="needs a GPU")
@pytest.mark.parametrize("dtype, d, name", [("bfloat16", 128, "wg2k176s2pet"), ("bfloat16", 64, "wg2k128s3et"),
                                            ("float16", 64, "wg2k128s2pet"), ("float16", 128, "wg2k128s3et"),
                                            ("bfloat16", 64, "wg3k128s3et"), ("bfloat16", 256, "wg2k64s2et"),
                                            ("float16", 192, "wg2k64s3et")])
@pytest.mark.parametrize("walk", ["P", "Pd"])
def test_wgmma_persistent_bit_identical(dtype, d, name, walk):
    """The persistent kernel (P) gives the same bits as the same division without it (one block a
    tile): out and lse, causal and not, a negative scale, partial blocks, more tiles than SMs (each
    block walks several, its ring and ping-pong turns running on), fewer; and the float64 reference's
    answer within the bound."""
    import torch

    from attnkern._gpu import from_torch
    from attnkern.backends.cuda import cpp, launch

    if not cpp.wgmma_applies(d, d):
        pytest.skip("flash_wgmma.cu runs on Hopper")
    base = cpp.WgmmaConfig.parse(name)
    persistent = cpp.WgmmaConfig.parse(name + walk)
    tdt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(d)
    for i, (batch, nq, nk) in enumerate(((40, 1000, 1000), (3, 77, 130), (300, 129, 64), (1, 2048, 2048),
                                         (5, 1030, 700))):
        q, k, v = (torch.randn(batch, n, d, generator=gen).to(tdt).cuda() for n in (nq, nk, nk))
        scale = -0.7 / d ** 0.5 if i == 1 else d ** -0.5
        for causal in (False, True):
            outs = []
            for config in (base, persistent):
                out = torch.full((batch, nq, d), float("nan"), dtype=tdt, device="cuda")
                lse = torch.full((batch, nq), float("nan"), dtype=tdt, device="cuda")
                kernel, grid, block, args = cpp.flash_mma_launch(*(from_torch(x, "x") for x in (q, k, v, out)),
                                                                 causal, scale, from_torch(lse, "lse"), config)
                launch.launch(kernel, grid, block, *args)
                outs.append((out, lse))
            torch.cuda.synchronize()
            (out, lse), (pout, plse) = outs
            assert torch.equal(out, pout) and torch.equal(lse, plse), (batch, nq, nk, causal)
            if i == 1:  # the half arrays as NumPy's (exact: each value came from them)
                import ml_dtypes

                half = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
                assert_matches_reference(*(x.float().cpu().numpy().astype(half) for x in (pout, q, k, v)),
                                         causal=causal, scale=scale, kernel="cuda.flash")


def test_wgmma_large_head_divisions(monkeypatch):
    """flash_wgmma.cu at D = 192 and 256: the warp-specialized variant with 64-key tiles only (the
    output's D / 2 accumulators a thread leave no room for wider scores), float16/bfloat16; each
    default (plain and featured) fits the H100's shared memory a block; the backward keeps its own
    head sizes (mma.sync above 128); where a GPU's shared memory is short, flash_mma.cu runs."""
    from attnkern.backends.cuda import cpp

    for d in (192, 256):
        for table in (cpp.WGMMA_DEFAULT, cpp.WGMMA_OTHER):
            table[d].check(d)
            assert table[d].block_k == 64 and table[d].shared_bytes(d) <= cpp.WGMMA_SHARED_LIMIT
        assert cpp.WGMMA_DEFAULT[d].tma and not cpp.WGMMA_OTHER[d].tma
        for name in ("wg2k128s2et", "wg3k64", "wg2k64", "wg2k176s2pet"):
            with pytest.raises(ValueError, match="192 or 256: stages and 64-key tiles"):
                cpp.WgmmaConfig.parse(name).check(d)
        with pytest.raises(ValueError, match="192 or 256"):
            cpp.WgmmaConfig.parse("wg2k64s2et").check(d, itemsize=1)
    with pytest.raises(ValueError, match="bytes of shared memory"):
        cpp.WgmmaConfig.parse("wg2k64s3et").check(256)  # 260 KB
    with pytest.raises(ValueError, match="D = 64 or 128"):
        cpp.WgmmaConfig.parse("wg2k64s2et").check(160)
    monkeypatch.setattr(cpp, "wgmma_applies", lambda d, dv: d == dv and d in cpp.WGMMA_HEAD_SIZES)
    monkeypatch.setattr(cpp, "shared_limit", lambda: cpp.WGMMA_SHARED_LIMIT)
    for d in (192, 256):
        assert cpp.half_config(d) is cpp.WGMMA_DEFAULT[d] and cpp.half_config(d, plain=False) is cpp.WGMMA_OTHER[d]
        # the walk: at D = 256 for causal calls only, never at 192
        walked = cpp.persist_rule(cpp.half_config(d), 64, 4096, d, causal=True)
        assert walked.dynamic if d == 256 else walked is cpp.half_config(d)
        assert cpp.persist_rule(cpp.half_config(d), 64, 4096, d) is cpp.half_config(d)
        assert cpp.bwd_config(d, "bfloat16").kv_split == 2  # the backward's mma.sync kernels
    monkeypatch.setattr(cpp, "shared_limit", lambda: 163 * 1024)  # an A100's, were it Hopper
    assert cpp.half_config(256) == cpp.mma_config(256, "bfloat16")


@pytest.mark.skipif(SIMULATED, reason="needs a GPU")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d, names", [(256, ("default", "wg2k64s2pet", "wg2k64s2e")),
                                      (192, ("default", "wg2k64s3pet", "wg2k64s2pet"))])
def test_wgmma_large_heads(dtype, d, names):
    """flash_wgmma.cu at D = 192 and 256 (Hopper) in each division: out and lse against the float64
    reference (causal and not, a negative scale, partial blocks and tiles, more query blocks than
    SMs), bit-identical run to run, and the library call on the plain default (the TMA producer)."""
    import torch

    from attnkern._gpu import from_torch
    from attnkern.backends.cuda import cpp, launch

    if not cpp.wgmma_applies(d, d):
        pytest.skip("flash_wgmma.cu runs on Hopper")
    tdt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(d)
    import ml_dtypes

    half = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
    for i, (batch, nq, nk) in enumerate(((3, 77, 130), (2, 1000, 1030), (40, 640, 640))):
        q, k, v = (torch.randn(batch, n, d, generator=gen).to(tdt).cuda() for n in (nq, nk, nk))
        scale = -0.7 / d ** 0.5 if i == 0 else d ** -0.5
        host = [x.float().cpu().numpy().astype(half) for x in (q, k, v)]
        for causal in (False, True):
            for name in names:
                config = cpp.half_config(d) if name == "default" else cpp.WgmmaConfig.parse(name)
                runs = []
                for _ in range(2):
                    out = torch.full((batch, nq, d), float("nan"), dtype=tdt, device="cuda")
                    lse = torch.full((batch, nq), float("nan"), dtype=tdt, device="cuda")
                    kernel, grid, block, args = cpp.flash_mma_launch(
                        *(from_torch(x, "x") for x in (q, k, v, out)), causal, scale, from_torch(lse, "lse"), config)
                    launch.launch(kernel, grid, block, *args)
                    runs.append((out, lse))
                torch.cuda.synchronize()
                (out, lse), (again, lse_again) = runs
                assert torch.equal(out, again) and torch.equal(lse, lse_again), (name, batch, nq, nk, causal)
                if i < 2 or name == "default":
                    assert_matches_reference(out.float().cpu().numpy().astype(half), *host, causal=causal,
                                             scale=scale, kernel="cuda.flash")
                    assert_lse_matches_reference(lse.float().cpu().numpy().astype(half), host[0], host[1],
                                                 causal=causal, scale=scale)
                if name == "default":
                    default_out = out
            lib = attnkern.attention(q[None], k[None], v[None], causal=causal, scale=scale, kernel="cuda.flash",
                                     check_finite=False)
            assert torch.equal(lib[0], default_out), (batch, nq, nk, causal)
    assert isinstance(cpp.half_config(d), cpp.WgmmaConfig) and cpp.half_config(d).tma


def test_tensor_map_pool(monkeypatch):
    """launch.tensor_map_address: one descriptor per (address, shape, box), encoded and written
    once; a full pool's addresses are forgotten and a new pool takes over, no slot written twice,
    the last MAP_RETIRED full pools kept alive."""
    from attnkern.backends.cuda import launch

    pools, encoded = [], []

    def new_pool():
        pools.append([np.zeros(launch.MAP_SLOTS * launch.MAP_BYTES, np.uint8), 1 << 20 * (len(pools) + 1), 0])
        return pools[-1]

    def write(pool, slot, raw):
        at = slot * launch.MAP_BYTES
        assert not pool[0][at:at + launch.MAP_BYTES].any()  # never written twice
        pool[0][at:at + launch.MAP_BYTES] = raw

    def encode(ptr, shape, box_rows):
        encoded.append(ptr)
        return np.full(launch.MAP_BYTES, len(encoded), np.uint8)

    for name, value in (("_new_map_pool", new_pool), ("_write_map", write), ("_encode_tensor_map", encode),
                        ("_device_id", lambda: 0),
                        ("MAP_SLOTS", 2), ("MAP_RETIRED", 1), ("_MAPS", {}), ("_MAP_POOLS", {}),
                        ("_MAP_RETIRED", [])):
        monkeypatch.setattr(launch, name, value)
    shape = (2, 300, 128)
    first = launch.tensor_map_address(4096, shape, 176)
    assert launch.tensor_map_address(4096, shape, 176) == first and encoded == [4096]
    assert launch.tensor_map_address(4096, shape, 128) != first  # another box: another descriptor
    assert len(encoded) == 2 and len(pools) == 1
    third = launch.tensor_map_address(8192, shape, 176)  # the first pool is full: a second one
    assert len(pools) == 2 and third == pools[1][1] and launch._MAP_RETIRED == [pools[0]]
    again = launch.tensor_map_address(4096, shape, 176)  # forgotten with its pool, encoded anew
    assert again == pools[1][1] + launch.MAP_BYTES and encoded == [4096, 4096, 8192, 4096]
    assert (pools[1][0][launch.MAP_BYTES:2 * launch.MAP_BYTES] == 4).all()
    launch.tensor_map_address(1, shape, 176)
    assert len(pools) == 3 and launch._MAP_RETIRED == [pools[1]]  # one full pool kept


@pytest.mark.skipif(not SIMULATED, reason="what the simulator runs (on a GPU, the C++ tests below)")
def test_the_simulator_runs_the_numba_kernels_and_no_cuda_cpp():
    """docs/gpu.md: in the simulator cuda.flash's float32 calls never reach its CUDA C++
    kernels (flash_tf32.cu, flash_simt.cu), whatever the tile; its float16/bfloat16
    calls (flash_mma.cu, flash_wgmma.cu) are refused; float32 and float64 run the Numba
    kernel, which is what the tests here check."""
    from attnkern.backends import cuda as cuda_backend

    for d, bq, bk, tc in [(64, 0, 0, 1), (64, 64, 32, 1), (64, 64, 64, 0), (16, 32, 32, 1), (128, 128, 64, 1)]:
        assert cuda_backend._cpp_kernel(bq, bk, d, d, np.float32, tc) is None
    q = np.ones((1, 16, 16), np.float16)
    with pytest.raises(RuntimeError, match="CUDA C\\+\\+ on tensor cores, which Numba's CUDA simulator cannot run"):
        attnkern.attention(q, q, q, kernel="cuda.flash")


@pytest.mark.skipif(SIMULATED, reason="needs a GPU")
@pytest.mark.parametrize("library", ["torch", "cupy"])
def test_torch_and_cupy_arrays_stay_on_the_gpu(library):
    """No copies: the output is the caller's kind of array, on its device."""
    # torch is a test extra (a plain import); CuPy is not one (skipped where absent)
    lib = importlib.import_module(library) if library == "torch" else pytest.importorskip(library)
    if library == "torch" and not lib.cuda.is_available():
        pytest.skip("torch without CUDA")
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, (1, 2), 33, 40, 16, 8, np.float32)
    to_gpu = (lambda x: lib.from_numpy(x).cuda()) if library == "torch" else lib.asarray
    out = attnkern.attention(*(to_gpu(x) for x in (q, k, v)), causal=True)
    assert type(out).__module__.partition(".")[0] == library
    host = out.cpu().numpy() if library == "torch" else lib.asnumpy(out)
    assert_matches_reference(host, q, k, v, causal=True)


@pytest.mark.skipif(SIMULATED, reason="needs a GPU")
@pytest.mark.parametrize("d, block_q, block_k", [(126, 0, 0), (126, 64, 64), (62, 64, 64), (94, 32, 64)])
def test_flash_tiles_in_dynamic_shared_memory(d, block_q, block_k):
    """The Numba kernel's float32 tiles past the 48 KB of static shared memory (its
    auto tile at D = 126 is one; D not a multiple of 4, so the CUDA C++ kernel does
    not take them) run in dynamic shared memory with the kernel's limit raised, and
    match float64; with lse, causal and not, odd sizes."""
    from attnkern.backends.cuda import cpp, launch, numba_kernels

    rng = np.random.default_rng(d + block_q)
    q, k, v = random_qkv(rng, (2,), 150, 131, d, d, np.float32)
    tile = (block_q, block_k) if block_q else (64, 32)
    assert numba_kernels.flash_shared_bytes(*tile, d, d, 4) > launch.SHARED_BYTES
    assert not cpp.simt_applies(d, d)
    for causal in (False, True):
        out, lse = attnkern.attention(q, k, v, causal=causal, kernel="cuda.flash", block_q=block_q,
                                      block_k=block_k, return_lse=True)
        assert_matches_reference(out, q, k, v, causal=causal)
        assert_lse_matches_reference(lse, q, k, causal=causal)


@pytest.mark.skipif(SIMULATED, reason="needs a GPU")
@pytest.mark.parametrize("d", [4, 16, 36, 64, 80, 100, 128])
def test_float32_cuda_cpp_kernels(d, monkeypatch):
    """float32 with D = Dv a multiple of 4 up to 128 runs a CUDA C++ kernel (the Numba
    kernel is made to fail here) in every tile one has: the 3xTF32 tensor-core kernel
    where D is a multiple of 16 and the tile is its default or 64 or 128 x 32 or 64
    (with tensor_cores=1, the default), else the register-blocked FMA kernel in its
    default and every other tile. Each against float64 with lse, causal and not,
    partial blocks and nq != nk, a negative scale, bit-identical run to run. Arrays
    at addresses neither can take (not 16-byte aligned) go to the Numba kernel, with
    the same results to float32 rounding."""
    from attnkern.backends.cuda import cpp, numba_kernels

    import torch

    rng = np.random.default_rng(d)
    numba_flash = numba_kernels.flash
    ran = []

    def refuse(*args, **kwargs):
        raise AssertionError("the Numba kernel ran")

    def noting(module, name):
        real = getattr(module, name)
        return lambda *args, **kwargs: ran.append(name) or real(*args, **kwargs)

    monkeypatch.setattr(numba_kernels, "flash", refuse)
    for name in ("flash_mma_launch", "flash_simt_launch"):
        monkeypatch.setattr(cpp, name, noting(cpp, name))
    tc_tiles = {(0, 0), (64, 32), (64, 64), (128, 32), (128, 64)}
    simt_tiles = {(0, 0)} | {(bq, bk) for bq in cpp.SIMT_BLOCK_Q for bk in cpp.SIMT_BLOCK_K if bq * bk <= 4096}
    for nq, nk in ((150, 131), (1, 70), (200, 200)):
        q, k, v = random_qkv(rng, (2,), nq, nk, d, d, np.float32)
        for tensor_cores in (1, 0):
            for block_q, block_k in sorted(tc_tiles | simt_tiles):
                if tensor_cores and d % 16 == 0 and (block_q, block_k) in tc_tiles:
                    expected = "flash_mma_launch"
                elif (block_q, block_k) in simt_tiles:
                    expected = "flash_simt_launch"
                else:
                    continue  # a tile neither CUDA C++ kernel has: the Numba kernel's (other tests)
                for causal in (False, True):
                    scale = -0.6 / np.sqrt(d) if nq == 1 else None
                    run = functools.partial(attnkern.attention, q, k, v, causal=causal, scale=scale,
                                            kernel="cuda.flash", block_q=block_q, block_k=block_k,
                                            tensor_cores=tensor_cores, return_lse=True)
                    out, lse = run()
                    assert ran[-1] == expected, (block_q, block_k, tensor_cores)
                    assert_matches_reference(out, q, k, v, causal=causal, scale=scale)
                    assert_lse_matches_reference(lse, q, k, causal=causal, scale=scale)
                    again, lse_again = run()
                    assert np.array_equal(out, again) and np.array_equal(lse, lse_again)
    # a torch view 4 bytes past an aligned address: the Numba kernel takes it
    monkeypatch.setattr(numba_kernels, "flash", numba_flash)
    monkeypatch.setattr(numba_kernels, "flash", noting(numba_kernels, "flash"))
    base = torch.from_numpy(rng.standard_normal(3 * 64 * d + 1).astype(np.float32)).cuda()
    q = base[1:].view(3, 64, d)
    ran.clear()
    out = attnkern.attention(q, q, q, kernel="cuda.flash")
    assert ran[0] == "flash"  # (then the fast path prepares a launch for aligned tensors of this shape)
    assert_matches_reference(out.cpu().numpy(), *(q.cpu().numpy(),) * 3)


@pytest.mark.skipif(SIMULATED, reason="needs a GPU")
def test_torch_fast_path_matches_the_general_path():
    """Device-resident torch tensors: the first call of a shape takes the general
    path and leaves a prepared launch; later calls (new tensors, aliased ones,
    lse, the finite checks, tunables given) match the general path bit for bit,
    and whatever the plan cannot take falls back to it with its errors."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    from attnkern import _torch_cuda as fast

    rng = np.random.default_rng(9)

    def tensors(dtype=np.float32, lead=(2, 3), nq=37, nk=45, d=16, dv=16):
        return [torch.from_numpy(x).cuda() for x in random_qkv(rng, lead, nq, nk, d, dv, dtype)]

    def general(*args, **kw):
        fast.FAST_PATH = False
        try:
            return attnkern.attention(*args, **kw)
        finally:
            fast.FAST_PATH = True

    for kw in ({}, {"causal": True, "scale": 0.3}, {"block_q": 16, "block_k": 32}, {"check_finite": False},
               {"scale": np.float64(0.3)}):
        for _ in range(3):  # the first call builds the plan; the later ones use it, on new tensors
            q, k, v = tensors()
            out = attnkern.attention(q, k, v, **kw)
            assert torch.equal(out, general(q, k, v, **kw))
        assert_matches_reference(out.cpu().numpy(), q.cpu().numpy(), k.cpu().numpy(), v.cpu().numpy(),
                                 kw.get("causal", False), kw.get("scale"))
    plans = [p for p in fast._plans().values() if p.launch is not None]
    assert plans, "no call took the prepared launch"
    from attnkern.backends import cuda

    cuda.forget_plans()  # the public way to make every call shape plan again
    assert not fast._plans()
    q, k, v = tensors()
    assert torch.equal(attnkern.attention(q, k, v), general(q, k, v)) and len(fast._plans()) == 1
    q, k, v = tensors(nq=45)
    for _ in range(2):  # q, k and v one tensor
        assert torch.equal(attnkern.attention(q, q, q), general(q, q, q))
    for _ in range(2):
        out, lse = attnkern.attention(q, k, v, causal=True, return_lse=True)
        ref_out, ref_lse = general(q, k, v, causal=True, return_lse=True)
        assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse) and lse.shape == (2, 3, 45)
    bad = k.clone()
    bad[1, 2, 3, 4] = float("inf")
    with pytest.raises(ValueError, match="k contains NaN or infinity"):
        attnkern.attention(q, bad, v)
    huge = torch.full_like(q, 1e20)  # finite inputs, scores that overflow: q, q, q's plan meets a bad output
    with pytest.raises(FloatingPointError, match="overflows float32"):
        attnkern.attention(huge, huge, huge)
    strided = torch.empty(2, 3, 16, 45, device=q.device).transpose(-1, -2)
    with pytest.raises(ValueError, match="not C-contiguous"):
        attnkern.attention(strided, k, v)
    if importlib.util.find_spec("ml_dtypes") is not None:  # bfloat16 tensors: the tensor-core kernel
        q, k, v = (x.to(torch.bfloat16) for x in tensors(lead=(2,), nq=70, nk=64, d=32, dv=32))
        for _ in range(2):
            assert torch.equal(attnkern.attention(q, k, v), general(q, k, v))
        flat = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)
        odd = flat[1:].view(q.shape)  # contiguous, 2-byte aligned
        odd.copy_(q)
        with pytest.raises(ValueError, match="16-byte aligned"):
            attnkern.attention(odd, k, v)


@pytest.mark.skipif(SIMULATED, reason="needs a GPU")
def test_planned_calls_skip_attentions_checks(monkeypatch):
    """A call shape with a plan runs it from attention()'s first line (_torch_cuda.quick),
    bit-identical to the general path; a call under autograd or autocast, with a feature,
    with check_finite changed or with the fast path off takes attention()'s whole way."""
    import torch

    from attnkern import _api
    from attnkern import _torch_cuda as fast

    # plans whose tunables were looked up are rebuilt after RECHECK_S (1 s): the autocast and
    # autograd calls below compile kernels for longer than that
    monkeypatch.setattr(fast, "RECHECK_S", 1e9)
    rng = np.random.default_rng(11)
    q, k, v = (torch.from_numpy(x).cuda() for x in random_qkv(rng, (2, 3), 40, 40, 16, 16, np.float32))
    attnkern.attention(q, k, v, causal=True)  # plans the shape
    whole = []
    real = _api._torch_attention
    monkeypatch.setattr(_api, "_torch_attention", lambda *a: whole.append(1) or real(*a))
    out = attnkern.attention(q, k, v, causal=True)
    assert not whole, "a planned call took attention()'s whole way"
    fast.FAST_PATH = False
    try:
        assert torch.equal(out, attnkern.attention(q, k, v, causal=True)) and len(whole) == 1
    finally:
        fast.FAST_PATH = True
    attnkern.attention(q, k, v, causal=True, window=(8, 0))
    attnkern.attention(q, k, v, causal=True, check_finite=False)  # another plan's key: planned now
    with torch.autocast("cuda", dtype=torch.bfloat16):
        attnkern.attention(q, k, v, causal=True)
    qg = q.clone().requires_grad_()
    attnkern.attention(qg, k, v, causal=True).sum().backward()
    assert len(whole) == 5 and qg.grad is not None
    assert torch.equal(attnkern.attention(q, k, v, causal=True, check_finite=False), out) and len(whole) == 5


def test_quick_path_leaves_other_arrays_alone(monkeypatch):
    """With a plan made (_torch_cuda._QUICK set), NumPy arrays and CPU tensors still take
    attention()'s whole way, with the same results."""
    import torch

    from attnkern import _torch_cuda as fast

    rng = np.random.default_rng(12)
    q, k, v = random_qkv(rng, (2,), 24, 24, 16, 16, np.float32)
    before = attnkern.attention(q, k, v, causal=True, kernel="numpy.naive")
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    tbefore = attnkern.attention(tq, tk, tv, kernel="numpy.naive")
    monkeypatch.setattr(fast, "_QUICK", [torch.Tensor, torch.is_grad_enabled, torch.compiler.is_compiling,
                                         torch.is_autocast_enabled, torch.get_autocast_dtype])
    assert fast.quick(tq, tk, tv, False, None, "numpy.naive", True, False, {}) is None
    np.testing.assert_array_equal(attnkern.attention(q, k, v, causal=True, kernel="numpy.naive"), before)
    assert torch.equal(attnkern.attention(tq, tk, tv, kernel="numpy.naive"), tbefore)


@pytest.mark.skipif(SIMULATED, reason="needs a GPU")
def test_cuda_naive_on_torch_tensors():
    """cuda.naive's score matrix from torch's allocator, its kernels on flat arrays."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    rng = np.random.default_rng(10)
    q, k, v = random_qkv(rng, (2, 2), 70, 33, 24, 40, np.float32)
    for causal in (False, True):
        for tile in (8, 16, 32):
            out = attnkern.attention(*(torch.from_numpy(x).cuda() for x in (q, k, v)), causal=causal,
                                     kernel="cuda.naive", tile=tile)
            assert_matches_reference(out.cpu().numpy(), q, k, v, causal)


# ---------------------------------------------------------------- attention features (docs/features.md)
# name: ((B, H), H_kv, nq, nk, keywords). Small for the simulator: several 8-key tiles,
# a window inside them, rows that see no key, padding (NaN, never read) and GQA.
FEATURE_CASES_SMALL = {
    "gqa-causal": ((2, 4), 2, 13, 13, dict(causal=True)),
    "everything": ((2, 4), 2, 9, 19, dict(causal="bottom_right", window=(5, 0), key_lengths=[19, 3], softcap=3.0,
                                          scale=0.6)),
    "window": ((1, 2), 1, 14, 14, dict(window=(3, 2))),
    "tall-bottom-right": ((2, 2), 2, 12, 6, dict(causal="bottom_right", key_lengths=[5, 0])),  # empty rows
    "window-misses": ((1, 2), 2, 11, 4, dict(window=(0, 0), softcap=2.0, scale=1.0)),  # rows past nk see nothing
}
# the same on the GPU at sizes that cross many 64- and 128-key tiles and skip some
FEATURE_CASES = {
    "gqa-causal": ((2, 4), 2, 200, 200, dict(causal=True)),
    "everything": ((2, 4), 2, 130, 300, dict(causal="bottom_right", window=(70, 0), key_lengths=[300, 77],
                                             softcap=3.0, scale=0.3)),
    "window": ((1, 2), 1, 260, 260, dict(window=(40, 25))),
    "sliding-causal-softcap": ((1, 4), 2, 400, 400, dict(causal=True, window=(63, None), softcap=20.0)),
    "tall-bottom-right": ((3, 2), 2, 150, 90, dict(causal="bottom_right", key_lengths=[70, 0, 90])),
    "window-misses": ((1, 2), 2, 150, 40, dict(window=(0, 0))),
    "decode": ((2, 8), 1, 1, 333, dict(causal="bottom_right", key_lengths=[333, 129])),
}


def feature_inputs(case, d, dtype, seed=0):
    """q, k, v of a feature case as float64 NumPy arrays rounded to dtype's precision
    (k and v NaN past each key length: the padding is never read)."""
    (b, h), hkv, nq, nk, kw = case
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s) for s in ((b, h, nq, d), (b, hkv, nk, d), (b, hkv, nk, d)))
    for b_, n in enumerate(kw.get("key_lengths") or []):
        k[b_, :, n:] = v[b_, :, n:] = np.nan
    return (q, k, v), kw


def check_features_forward(out, lse, q, k, v, kw, tol):
    """out and lse (float64 NumPy) of a featured call against the float64 reference:
    rows that see no key exactly 0 and lse -inf, the rest within tol of the scaled
    error bound (attnkern_bench.accuracy) and the lse within 10 tol."""
    from attnkern_bench.accuracy import conditioning

    ref, ref_lse = attnkern.reference(q, k, v, return_lse=True, **kw)
    empty = np.isneginf(ref_lse)
    assert np.isfinite(out).all() and np.array_equal(np.isneginf(lse), empty), "no NaN; -inf lse only where empty"
    assert (out[empty] == 0).all()
    lengths = kw.get("key_lengths") or [k.shape[-2]] * k.shape[0]
    vmax = max(1.0, max(np.abs(v[b_, :, :n]).max(initial=0) for b_, n in enumerate(lengths)))
    per = vmax * conditioning(np.nan_to_num(q), np.nan_to_num(k), kw.get("scale"))
    err = np.abs(out - ref).max(initial=0) / per
    assert err <= tol, f"out: scaled error {err:.3g} > {tol:.3g}"
    lse_err = np.abs(lse[~empty] - ref_lse[~empty]).max(initial=0) / max(1.0, np.abs(ref_lse[~empty]).max(initial=0))
    assert lse_err <= 10 * tol, f"lse: {lse_err:.3g}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", FEATURE_CASES_SMALL if SIMULATED else FEATURE_CASES)
def test_features_numba_forward(name, dtype):
    """The Numba forward (float64 everywhere, float32 in the simulator) with every
    feature and their combinations against the float64 reference, on NumPy arrays;
    bit-identical run to run."""
    from attnkern_bench.accuracy import tolerance

    if not SIMULATED and dtype == np.float32:
        pytest.skip("float32 runs the CUDA C++ kernels on a GPU (test_features_float32_cuda_cpp)")
    (q, k, v), kw = feature_inputs((FEATURE_CASES_SMALL if SIMULATED else FEATURE_CASES)[name], 8, dtype)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    tiles = dict(block_q=8, block_k=8) if SIMULATED else {}
    run = functools.partial(attnkern.attention, q, k, v, kernel="cuda.flash", return_lse=True, **tiles, **kw)
    out, lse = run()
    assert out.dtype == dtype and isinstance(out, np.ndarray)
    check_features_forward(out.astype(np.float64), lse.astype(np.float64), q, k, v, kw, tolerance(dtype))
    again, lse_again = run()
    assert again.tobytes() == out.tobytes() and lse_again.tobytes() == lse.tobytes()


def test_features_on_gpu_arrays_and_auto():
    """kernel='auto' sends featured GPU arrays to cuda.flash, which takes them in place
    (k, v with H_kv heads); check_finite does not read the padding past key lengths,
    but a NaN before a length is an error naming k."""
    (q, k, v), kw = feature_inputs(FEATURE_CASES_SMALL["everything"], 8, np.float32)
    q, k, v = (x.astype(np.float32) for x in (q, k, v))
    dq, dk, dv = (cuda.to_device(x) for x in (q, k, v))
    out = attnkern.attention(dq, dk, dv, block_q=8, block_k=8, **kw)
    assert is_gpu_array(out)
    host = out.copy_to_host() if hasattr(out, "copy_to_host") else np.asarray(out)
    np.testing.assert_array_equal(host, attnkern.attention(q, k, v, kernel="cuda.flash", block_q=8, block_k=8, **kw))
    k[1, 0, 1] = np.nan
    with pytest.raises(ValueError, match="k contains NaN or infinity"):
        attnkern.attention(dq, cuda.to_device(k), dv, block_q=8, block_k=8, **kw)


@pytest.mark.skipif(SIMULATED, reason="needs a GPU")
@pytest.mark.parametrize("d", [64, 128, 36])
def test_features_float32_cuda_cpp(d, monkeypatch):
    """float32 with features on the CUDA C++ kernels' featured variants: the 3xTF32
    tensor-core kernel (D 64 and 128, default and 64 x 32 tiles) and the FMA kernel
    (tensor_cores=0, and D = 36, which the tensor cores do not take); torch
    tensors, key lengths as a torch tensor."""
    import torch

    from attnkern.backends.cuda import cpp

    ran = []
    for name in ("flash_mma_kernel", "flash_simt_kernel"):
        real = getattr(cpp, name)
        monkeypatch.setattr(cpp, name, lambda *a, _real=real, _name=name, **kw: ran.append(
            (_name, kw.get("featured", a[-1] if len(a) > 2 else False))) or _real(*a, **kw))
    for name, case in FEATURE_CASES.items():
        (q, k, v), kw = feature_inputs(case, d, np.float32, seed=len(name))
        tq, tk, tv = (torch.from_numpy(x.astype(np.float32)).cuda() for x in (q, k, v))
        tkw = dict(kw, key_lengths=None if "key_lengths" not in kw else torch.tensor(kw["key_lengths"]))
        for tensor_cores, tile in ((1, (0, 0)), (1, (64, 32)), (0, (0, 0))):
            out, lse = attnkern.attention(tq, tk, tv, kernel="cuda.flash", return_lse=True, tensor_cores=tensor_cores,
                                          block_q=tile[0], block_k=tile[1], check_finite=False, **tkw)
            want = "flash_mma_kernel" if tensor_cores and d % 16 == 0 else "flash_simt_kernel"
            assert ran[-1] == (want, True), (name, tensor_cores, ran[-1])
            check_features_forward(out.double().cpu().numpy(), lse.double().cpu().numpy(), q, k, v, kw, 2e-5)


@pytest.mark.skipif(SIMULATED, reason="needs a GPU")
@pytest.mark.parametrize("kind", ["bfloat16", "float16"])
@pytest.mark.parametrize("d", [64, 128, 32, 96, 160, 192, 256])
def test_features_half_cuda_cpp(kind, d, monkeypatch):
    """float16/bfloat16 with features: flash_wgmma.cu's featured variant on Hopper
    at D = 64, 128, 192 and 256, flash_mma.cu's at D = 32, 96 and 160 (and elsewhere), against float64 from the
    rounded inputs (tolerance: attnkern_bench.accuracy's for rounded P), bit-identical
    run to run."""
    import torch

    from attnkern.backends.cuda import cpp
    from attnkern_bench.accuracy import tolerance

    configs = []
    real = cpp.flash_mma_kernel
    monkeypatch.setattr(cpp, "flash_mma_kernel", lambda dtype, d_, config=None, featured=False, **kw: configs.append(
        (type(config or cpp.tensor_core_config(d_, dtype)).__name__, featured)) or real(dtype, d_, config, featured,
                                                                                        **kw))
    tdtype = getattr(torch, kind)
    for name, case in FEATURE_CASES.items():
        (q, k, v), kw = feature_inputs(case, d, np.float32, seed=len(name))
        tq, tk, tv = (torch.from_numpy(x.astype(np.float32)).cuda().to(tdtype) for x in (q, k, v))
        out, lse = attnkern.attention(tq, tk, tv, kernel="cuda.flash", return_lse=True, check_finite=False, **kw)
        again = attnkern.attention(tq, tk, tv, kernel="cuda.flash", check_finite=False, **kw)
        assert torch.equal(out, again)
        wgmma = cpp.wgmma_applies(d, d)
        assert configs[-1] == ("WgmmaConfig" if wgmma else "MmaConfig", True), configs[-1]
        rounded = [x.double().cpu().numpy() for x in (tq, tk, tv)]
        check_features_forward(out.double().cpu().numpy(), lse.double().cpu().numpy(), *rounded, kw,
                               tolerance(kind, rounds_p=True))


@pytest.mark.skipif(SIMULATED, reason="needs a GPU")
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_repeated_featured_calls_keep_their_features(dtype):
    """Repeated calls of one shape on torch CUDA tensors take a prepared launch after the
    first (_torch_cuda); for grouped k/v heads and bottom-right causal masking outside the
    decode path that must stay the featured kernel: every repeat equals the first call
    bit for bit and the float64 reference."""
    import torch

    from attnkern_bench.accuracy import tolerance

    tdtype = getattr(torch, dtype)
    for hq, hkv, nq, nk, causal in ((4, 2, 200, 200, True), (4, 4, 70, 200, "bottom_right"),
                                    (8, 2, 96, 160, "bottom_right")):
        rng = np.random.default_rng(nq + nk)
        q, k, v = (rng.standard_normal((2, h, n, 64)) for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
        tq, tk, tv = (torch.from_numpy(x).cuda().to(tdtype) for x in (q, k, v))
        first, lse = attnkern.attention(tq, tk, tv, kernel="cuda.flash", causal=causal, check_finite=False,
                                        return_lse=True)
        for _ in range(3):
            again, lse_again = attnkern.attention(tq, tk, tv, kernel="cuda.flash", causal=causal,
                                                  check_finite=False, return_lse=True)
            assert torch.equal(first, again) and torch.equal(lse, lse_again), (dtype, hq, hkv, nq, nk, causal)
        rounded = [x.double().cpu().numpy() for x in (tq, tk, tv)]
        check_features_forward(first.double().cpu().numpy(), lse.double().cpu().numpy(), *rounded,
                               {"causal": causal}, tolerance(dtype, rounds_p=dtype == "bfloat16"))


# ---------------------------------------------------------------- attention masks (attn_mask)
# (mask kind, mask shape as given for (B, H, nq, nk) = (2, 4, nq, nk)): bool, additive with
# -inf, additive finite; full, per-head broadcast, 2-D, keys only, queries only
MASK_CASES = [("bool", "full"), ("neginf", "heads"), ("float", "2d"), ("bool", "keys"), ("neginf", "queries")]


def make_mask(kind, dims, nq, nk, dtype, seed=0):
    """A mask for (2, 4, nq, nk) weights: bool (True about 70%; query row 1 hidden
    entirely where the shape has rows), additive float of dtype (-inf where a bool is
    False, or finite only)."""
    rng = np.random.default_rng(seed)
    shape = {"full": (2, 4, nq, nk), "heads": (4, 1, nk), "2d": (nq, nk), "keys": (nk,),
             "queries": (2, 1, nq, 1)}[dims]
    keep = rng.random(shape) < 0.7
    if dims in ("full", "2d"):
        keep[..., 1, :] = False  # a row no key takes part in: out 0, lse -inf
    if kind == "bool":
        return keep
    if kind == "neginf":
        return np.where(keep, rng.standard_normal(shape), -np.inf).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind, dims", MASK_CASES)
def test_mask_numba_forward(kind, dims, dtype):
    """The Numba forward (float64; float32 in the simulator) with an attention mask,
    alone and with GQA, bottom-right causal masking, key lengths and a softcap, on
    NumPy arrays and as GPU arrays (the mask too), against the float64 reference;
    bit-identical run to run."""
    from attnkern_bench.accuracy import tolerance

    if not SIMULATED and dtype == np.float32:
        pytest.skip("float32 runs the CUDA C++ kernels on a GPU (test_mask_cuda_cpp)")
    if SIMULATED and dtype == np.float32 and (kind, dims) != MASK_CASES[0]:
        pytest.skip("the simulator runs float32 on the first case only (the same Numba code as float64's, "
                    "typed float32; each simulated case costs seconds)")
    if SIMULATED and (kind, dims) in MASK_CASES[3:]:
        pytest.skip("the simulator runs each kind of mask once (bool, -inf, finite; full, per-head, 2-D "
                    "broadcasts): the keys-only and queries-only broadcasts run on a GPU")
    nq, nk = (9, 19) if SIMULATED else (130, 300)
    mask = make_mask(kind, dims, nq, nk, dtype)
    tiles = dict(block_q=8, block_k=8) if SIMULATED else {}
    for extra in ({}, dict(causal="bottom_right", key_lengths=[nk, nk // 3], softcap=3.0, scale=0.6)):
        (q, k, v), kw = feature_inputs(((2, 4), 2, nq, nk, extra), 8, dtype, seed=len(extra))
        q, k, v = (x.astype(dtype) for x in (q, k, v))
        kw = dict(kw, attn_mask=mask)
        out, lse = attnkern.attention(q, k, v, kernel="cuda.flash", return_lse=True, **tiles, **kw)
        check_features_forward(out.astype(np.float64), lse.astype(np.float64), q, k, v, kw, tolerance(dtype))
        if SIMULATED and extra:  # the repeat and the GPU-array call once per case in the simulator (seconds each)
            continue
        again = attnkern.attention(q, k, v, kernel="cuda.flash", **tiles, **kw)
        assert again.tobytes() == out.tobytes()
        on_gpu = attnkern.attention(*(cuda.to_device(x) for x in (q, k, v)), kernel="cuda.flash", check_finite=False,
                                    **tiles, **dict(kw, attn_mask=cuda.to_device(mask)))
        host = on_gpu.copy_to_host() if hasattr(on_gpu, "copy_to_host") else np.asarray(on_gpu)
        np.testing.assert_array_equal(host, out)


def test_mask_bad_input_on_gpu_arrays():
    """GPU q, k, v: a host mask, an integer mask, a float64 mask for float32 q and a mask
    that does not broadcast each raise an error saying what to fix."""
    q = cuda.to_device(np.ones((1, 2, 4, 8), np.float32))
    with pytest.raises(TypeError, match="attn_mask must be a GPU array"):
        attnkern.attention(q, q, q, kernel="cuda.flash", attn_mask=np.ones((4, 4), bool))
    with pytest.raises(TypeError, match="bool .* or an additive float mask of float32"):
        attnkern.attention(q, q, q, kernel="cuda.flash", attn_mask=cuda.to_device(np.ones((4, 4), np.int32)))
    with pytest.raises(TypeError, match="float32"):
        attnkern.attention(q, q, q, kernel="cuda.flash", attn_mask=cuda.to_device(np.ones((4, 4), np.float64)))
    with pytest.raises(ValueError, match="does not broadcast"):
        attnkern.attention(q, q, q, kernel="cuda.flash", attn_mask=cuda.to_device(np.ones((3, 4), bool)))


@pytest.mark.skipif(SIMULATED, reason="needs a GPU")
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "float16"])
def test_mask_cuda_cpp(kind):
    """The CUDA C++ kernels' mask variants (float32: 3xTF32 and FMA kernels, D 64 and
    36; float16/bfloat16: wgmma at D 64, 128 and 256, mma.sync at D 96) on torch tensors with
    torch masks: bool through an expanded (stride 0) view, additive float32 and (half q)
    q's dtype, with and without the other features; bit-identical run to run."""
    import torch

    from attnkern_bench.accuracy import tolerance

    tdtype = getattr(torch, kind)
    half = kind != "float32"
    nq, nk = 130, 300
    heads = (64, 128, 96, 256) if half else (64, 36)
    runs = ((1,), ) if half else ((1,), (0,))
    for d in heads:
        for n, (mkind, dims) in enumerate(MASK_CASES):
            mask = make_mask(mkind, dims, nq, nk, np.float32, seed=d + n)
            tmask = torch.from_numpy(mask).cuda()
            if mkind != "bool" and half and n % 2:
                tmask = tmask.to(tdtype)  # q's own dtype (exactly what the reference gets below)
                mask = tmask.double().cpu().numpy().astype(np.float32)
            if dims == "2d":
                tmask = tmask.expand(2, 4, nq, nk)  # strides 0: read where it lies
            for extra in ({}, dict(causal="bottom_right", key_lengths=[nk, 77], softcap=3.0, scale=0.3)):
                (q, k, v), kw = feature_inputs(((2, 4), 2, nq, nk, extra), d, np.float32, seed=n)
                tq, tk, tv = (torch.from_numpy(x.astype(np.float32)).cuda().to(tdtype) for x in (q, k, v))
                for (tc,) in runs:
                    args = dict(kernel="cuda.flash", check_finite=False, attn_mask=tmask, **kw)
                    if not half:
                        args["tensor_cores"] = tc
                    out, lse = attnkern.attention(tq, tk, tv, return_lse=True, **args)
                    assert torch.equal(out, attnkern.attention(tq, tk, tv, **args))
                    rounded = [x.double().cpu().numpy() for x in (tq, tk, tv)]
                    tol = tolerance(kind, rounds_p=True) if half else 2e-5
                    check_features_forward(out.double().cpu().numpy(), lse.double().cpu().numpy(), *rounded,
                                           dict(kw, attn_mask=mask if mask.dtype == bool else mask.astype(np.float64)),
                                           tol)


# ---------------------------------------------------------------- ALiBi (alibi_slopes)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_alibi_numba_forward(dtype):
    """The Numba forward with ALiBi ((H,) and (B, H) slopes), alone and with bottom-right
    causal masking, key lengths, a softcap and a mask, against the float64 reference."""
    from attnkern_bench.accuracy import tolerance

    if not SIMULATED and dtype == np.float32:
        pytest.skip("float32 runs the CUDA C++ kernels on a GPU (test_alibi_cuda_cpp)")
    nq, nk = (9, 19) if SIMULATED else (130, 300)
    rng = np.random.default_rng(3)
    tiles = dict(block_q=8, block_k=8) if SIMULATED else {}
    for extra in ({"alibi_slopes": rng.random(4)},
                  dict(alibi_slopes=rng.random((2, 4)), causal="bottom_right", key_lengths=[nk, nk // 3], softcap=3.0,
                       attn_mask=make_mask("bool", "2d", nq, nk, dtype))):
        (q, k, v), kw = feature_inputs(((2, 4), 2, nq, nk, extra), 8, dtype, seed=len(extra))
        q, k, v = (x.astype(dtype) for x in (q, k, v))
        out, lse = attnkern.attention(q, k, v, kernel="cuda.flash", return_lse=True, **tiles, **kw)
        check_features_forward(out.astype(np.float64), lse.astype(np.float64), q, k, v, kw, tolerance(dtype))


@pytest.mark.skipif(SIMULATED, reason="needs a GPU")
@pytest.mark.parametrize("kind", ["float32", "bfloat16", "float16"])
def test_alibi_cuda_cpp(kind):
    """ALiBi on the CUDA C++ kernels (float32: 3xTF32 and FMA; half: wgmma D 64 and
    mma.sync D 96), slopes as a torch CUDA tensor, with and without the other features
    and a mask, against the float64 reference."""
    import torch

    from attnkern_bench.accuracy import tolerance

    tdtype = getattr(torch, kind)
    half = kind != "float32"
    nq, nk = 130, 300
    rng = np.random.default_rng(4)
    for d in ((64, 96) if half else (64, 36)):
        for extra in ({"alibi_slopes": rng.random(4) * 0.5},
                      dict(alibi_slopes=rng.random((2, 4)) * 0.5, causal="bottom_right", key_lengths=[nk, 77],
                           softcap=3.0, scale=0.3)):
            (q, k, v), kw = feature_inputs(((2, 4), 2, nq, nk, extra), d, np.float32, seed=d)
            tq, tk, tv = (torch.from_numpy(x.astype(np.float32)).cuda().to(tdtype) for x in (q, k, v))
            mask = make_mask("neginf", "heads", nq, nk, np.float32, seed=d)
            for with_mask in (False, True):
                kw_ = dict(kw, attn_mask=mask) if with_mask else kw
                targs = dict(kw_, alibi_slopes=torch.from_numpy(kw["alibi_slopes"]).cuda())
                if with_mask:
                    targs["attn_mask"] = torch.from_numpy(mask).cuda()
                for tc in ((1,) if half else (1, 0)):
                    extra_args = {} if half else {"tensor_cores": tc}
                    out, lse = attnkern.attention(tq, tk, tv, kernel="cuda.flash", return_lse=True,
                                                  check_finite=False, **extra_args, **targs)
                    rounded = [x.double().cpu().numpy() for x in (tq, tk, tv)]
                    ref_kw = dict(kw_, attn_mask=mask.astype(np.float64)) if with_mask else kw_
                    check_features_forward(out.double().cpu().numpy(), lse.double().cpu().numpy(), *rounded, ref_kw,
                                           tolerance(kind, rounds_p=True) if half else 2e-5)


# ---------------------------------------------------------------- dropout (dropout_p, dropout_seed)
def test_philox_device_function_is_numpys_bit_for_bit():
    """numba_kernels.philox4x32_10 (uint64 arithmetic on 32-bit words) gives the words of
    attnkern._philox for random counters and 64-bit keys, the extremes included."""
    from attnkern import _philox
    from attnkern.backends.cuda import numba_kernels

    philox = numba_kernels.philox4x32_10

    @cuda.jit
    def words(c, seeds, out):
        t = cuda.grid(1)
        if t < c.shape[0]:
            w0, w1, w2, w3 = philox(c[t, 0], c[t, 1], c[t, 2], c[t, 3], seeds[t])
            out[t, 0], out[t, 1], out[t, 2], out[t, 3] = w0, w1, w2, w3

    n = 64 if SIMULATED else 1 << 16
    rng = np.random.default_rng(11)
    c = rng.integers(0, 2**32, (n, 4), dtype=np.uint64)
    seeds = rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)
    c[0], seeds[0] = 0, 0
    c[1], seeds[1] = 0xFFFFFFFF, 2**64 - 1
    c[2], seeds[2] = (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), 0x299F31D0A4093822
    out = cuda.to_device(np.zeros((n, 4), np.uint64))
    words[-(-n // 32), 32](cuda.to_device(c), cuda.to_device(seeds), out)
    got = out.copy_to_host()
    for t in range(n) if SIMULATED else range(0, n, 997):  # NumPy's Philox is per seed
        want = [int(w) for w in _philox.philox4x32_10(*c[t], int(seeds[t]))]
        assert [int(w) for w in got[t]] == want, t
    assert [int(w) for w in got[2]] == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]  # Random123's


def kept_by_cuda_flash(p, seed, dtype, batch=2, nq=16, nk=24, **tiles):
    """cuda.flash's keep mask and output, read back: q = 0 gives P = 1/nk, and v = the
    identity out[b, i, j] = Z[b, i, j] / nk."""
    q = np.zeros((batch, nq, 4), dtype)
    k = np.ones((batch, nk, 4), dtype)
    v = np.broadcast_to(np.eye(nk, dtype=dtype), (batch, nk, nk)).copy()
    out = attnkern.attention(q, k, v, dropout_p=p, dropout_seed=seed, kernel="cuda.flash", **tiles)
    return out * nk * (1 - p) > 0.5, out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dropout_mask_is_the_cpus_and_scaled(dtype):
    """The forward's keep mask equals attnkern._philox's (the CPU kernels' and the
    reference's) element for element, every kept probability is scaled by exactly
    1 / (1 - p) (in the dtype) and the keep rate lies within a binomial bound."""
    from attnkern import _philox

    tiles = dict(block_q=8, block_k=8) if SIMULATED else {}
    shape = (2, 16, 24) if SIMULATED else (4, 256, 384)
    for p, seed in ((0.3, 2**40 + 12345), (0.75, 2**64 - 3)):
        kept, out = kept_by_cuda_flash(p, seed, dtype, *shape, **tiles)
        b, i, j = np.ogrid[:shape[0], :shape[1], :shape[2]]
        np.testing.assert_array_equal(kept, _philox.keep(seed, p, b, i, j))
        want = dtype(1 / (1 - p)) / dtype(shape[2])
        assert np.allclose(out[kept], want, rtol=8 * np.finfo(dtype).eps, atol=0) and not out[~kept].any()
        n = kept.size
        assert abs(kept.sum() - n * (1 - p)) <= 6 * np.sqrt(n * p * (1 - p))
        if SIMULATED:
            break


# name: ((B, H), H_kv, nq, nk, keywords), each with dropout_p and dropout_seed
DROPOUT_CASES_SMALL = {
    "plain": ((1, 2), 2, 11, 13, dict(dropout_p=0.25, dropout_seed=1234)),
    "everything": ((2, 4), 2, 9, 19, dict(causal="bottom_right", window=(5, 0), key_lengths=[19, 3], softcap=3.0,
                                          scale=0.6, alibi_slopes=[0.5, 0.25, 0.125, 0.0625], dropout_p=0.4,
                                          dropout_seed=2**63 + 5)),
}
DROPOUT_CASES = {
    "plain": ((2, 4), 4, 200, 333, dict(dropout_p=0.1, dropout_seed=1234)),
    "gqa-causal": ((2, 4), 2, 300, 300, dict(causal=True, dropout_p=0.5, dropout_seed=7)),
    "everything": ((2, 4), 2, 130, 300, dict(causal="bottom_right", window=(70, 0), key_lengths=[300, 77],
                                             softcap=3.0, scale=0.3, alibi_slopes=[0.5, 0.25, 0.125, 0.0625],
                                             dropout_p=0.4, dropout_seed=2**63 + 5)),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", DROPOUT_CASES_SMALL if SIMULATED else DROPOUT_CASES)
def test_dropout_forward_matches_the_reference(name, dtype):
    """cuda.flash's forward with dropout (and the other features, a mask included)
    against the float64 reference, which applies the same Philox mask: elementwise;
    lse that of the undropped softmax; bit-identical repeats, on NumPy and GPU arrays;
    another seed gives another output."""
    from attnkern_bench.accuracy import tolerance

    cases = DROPOUT_CASES_SMALL if SIMULATED else DROPOUT_CASES
    if SIMULATED and dtype == np.float32 and name != next(iter(cases)):
        pytest.skip("the simulator runs float32 on the first case only")
    (q, k, v), kw = feature_inputs(cases[name], 8 if SIMULATED else 64, dtype, seed=len(name))
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    if name == "everything":
        kw = dict(kw, attn_mask=make_mask("bool", "2d", q.shape[-2], k.shape[-2], dtype))
    tiles = dict(block_q=8, block_k=8) if SIMULATED else {}
    out, lse = attnkern.attention(q, k, v, kernel="cuda.flash", return_lse=True, **tiles, **kw)
    # the output grows by up to 1 / (1 - p): so may its rounding
    check_features_forward(out.astype(np.float64), lse.astype(np.float64), q, k, v, kw,
                           tolerance(dtype) / (1 - kw["dropout_p"]))
    undropped = attnkern.attention(q, k, v, kernel="cuda.flash", return_lse=True, **tiles,
                                   **dict(kw, dropout_p=0.0))
    assert not np.array_equal(out, undropped[0])
    np.testing.assert_allclose(lse, undropped[1], rtol=10 * tolerance(dtype))
    again = attnkern.attention(q, k, v, kernel="cuda.flash", **tiles, **kw)
    assert again.tobytes() == out.tobytes()
    other = attnkern.attention(q, k, v, kernel="cuda.flash", **tiles, **dict(kw, dropout_seed=kw["dropout_seed"] + 1))
    assert not np.array_equal(other, out)
    if not SIMULATED or name == next(iter(cases)):
        gpu = [cuda.to_device(x) for x in (q, k, v)]
        gkw = dict(kw, attn_mask=cuda.to_device(kw["attn_mask"])) if "attn_mask" in kw else kw  # the mask there too
        on_gpu = attnkern.attention(*gpu, kernel="cuda.flash", check_finite=False, **tiles, **gkw)
        host = on_gpu.copy_to_host() if hasattr(on_gpu, "copy_to_host") else np.asarray(on_gpu)
        np.testing.assert_array_equal(host, out)


def test_dropout_seed_none_draws_from_numpys_generator_on_gpu_arrays():
    """dropout_seed=None on GPU arrays draws from NumPy's global generator, as on the
    host: np.random.seed repeats it, and the draw is the seed the reference takes."""
    q, k, v = (cuda.to_device(x) for x in random_qkv(np.random.default_rng(2), (2,), 9, 10, 8, 8, np.float64))
    tiles = dict(block_q=8, block_k=8) if SIMULATED else {}

    def run():
        got = attnkern.attention(q, k, v, kernel="cuda.flash", dropout_p=0.5, **tiles)
        return got.copy_to_host() if hasattr(got, "copy_to_host") else np.asarray(got)

    np.random.seed(3)
    a = run()
    seed = np.random.RandomState(3).randint(0, 2**63 - 1, dtype=np.int64)
    np.random.seed(3)
    b = run()
    assert np.array_equal(a, b) and not np.array_equal(a, run())
    hq, hk, hv = (x.copy_to_host() for x in (q, k, v))
    np.testing.assert_allclose(a, attnkern.reference(hq, hk, hv, dropout_p=0.5, dropout_seed=int(seed)), atol=1e-12)


def test_dropout_in_half_precision_runs_on_the_tensor_core_kernels():
    """cuda.flash has dropout in float16/bfloat16 too (flash_mma.cu's and flash_bwd_mma.cu's
    dropout variants: tests/test_dropout.py checks them on a GPU): kernel_info has no
    per-dtype limit on dropout, and the simulator, which runs no CUDA C++, refuses a half call as it
    refuses one without dropout."""
    info = attnkern.kernel_info("cuda.flash")
    assert "dropout" in info["features"] and "dropout" in info["backward_features"]
    # dropout in every dtype but FP8, whose forward has grouped k/v heads and bottom-right causal only
    wide = ["float32", "float64", "float16", "bfloat16"]
    assert info["feature_dtypes"] == {"varlen": ["float16", "bfloat16"], **{f: wide for f in (
        "window", "key_lengths", "softcap", "mask", "dropout", "alibi")}}
    if SIMULATED:
        q = np.ones((1, 2, 16, 16), np.float16)
        with pytest.raises(RuntimeError, match="simulator cannot run"):
            attnkern.attention(q, q, q, kernel="cuda.flash", dropout_p=0.1, dropout_seed=1)


@pytest.mark.skipif(SIMULATED, reason="needs a GPU")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("d, causal", [(64, False), (128, True), (64, True), (256, True)])
def test_half_kernel_writes_its_rows_unrounded_in_float32(dtype, d, causal, monkeypatch):
    """flash_half_float32 (ring attention's blocks, the ATTNKERN_WIDE variant): a float32 out
    that rounds bit for bit to the half kernel's out in the same work division (on Hopper
    cpp.WGMMA_OTHER: the plain default at D = 128 has 176-key tiles, another order of sums), and
    a log2-domain lse that, in natural units, rounds to within one rounding of the half lse;
    both closer to float64."""
    import torch

    from attnkern._gpu import from_torch
    from attnkern.backends.cuda import cpp, flash_half_float32, forget_plans
    from attnkern_bench.accuracy import reference_lse

    gen = torch.Generator().manual_seed(d)
    tdt = getattr(torch, dtype)
    q, k, v = (torch.randn(6, 200, d, generator=gen).to(tdt).cuda() for _ in range(3))
    monkeypatch.setitem(cpp.WGMMA_DEFAULT, d, cpp.WGMMA_OTHER[d])  # the plain kernel in the variant's division
    forget_plans()
    try:
        half_out, half_lse = attnkern.attention(q, k, v, causal=causal, kernel="cuda.flash", return_lse=True)
    finally:
        forget_plans()
    out = torch.empty(6, 200, d, device="cuda")
    lse = torch.empty(6, 200, device="cuda")
    assert flash_half_float32(*(from_torch(x, "x") for x in (q, k, v, out, lse)), causal, d ** -0.5)
    torch.cuda.synchronize()
    lse = lse * np.log(2)
    assert torch.equal(out.to(tdt), half_out)
    assert torch.allclose(lse.to(tdt).float(), half_lse.float(), rtol=2.0 ** -7 if dtype == "bfloat16" else 2.0 ** -10,
                          atol=0)
    host = [x.double().cpu().numpy() for x in (q, k, v)]
    ref = attnkern.reference(*host, causal=causal)
    assert np.abs(out.double().cpu().numpy() - ref).max() < np.abs(half_out.double().cpu().numpy() - ref).max()
    ref_lse = reference_lse(*host[:2], causal=causal)
    assert np.abs(lse.double().cpu().numpy() - ref_lse).max() < np.abs(half_lse.double().cpu().numpy() - ref_lse).max()


# bit patterns of each width: exponent bits all set (NaN, +-inf) and their nearest finite neighbours
_NONFINITE_BITS = {np.float16: ([0x7C00, 0xFC00, 0x7E00, 0x7C01], [0x7BFF, 0xFBFF, 0x03FF, 0x8000]),
                   "bfloat16": ([0x7F80, 0xFF80, 0x7FC0, 0x7F81], [0x7F7F, 0xFF7F, 0x007F, 0x8000]),
                   np.float32: ([0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001], [0x7F7FFFFF, 0xFF7FFFFF, 1, 0]),
                   np.float64: ([0x7FF0 << 48, 0xFFF0 << 48, 0x7FF8 << 48, (0x7FF0 << 48) + 1],
                                [(0x7FF0 << 48) - 1, (0xFFF0 << 48) - 1, 1, 0])}


@pytest.mark.parametrize("dtype", list(_NONFINITE_BITS), ids=str)
def test_nonfinite_scan_finds_every_position(dtype):
    """The finite scan's kernel (64-bit words, then the elements past them) on the
    simulator's threads: one NaN or infinity at any position of any of its four
    arrays, in the words or the tail, whole or not read as words (nw = 0: an unaligned
    address), flags that array and no other; the largest finite values, subnormals
    and negative zeros flag nothing."""
    from attnkern.backends.cuda import launch

    name = "bfloat16" if dtype == "bfloat16" else np.dtype(dtype).name
    itype, mask = launch._EXPONENT[name]
    size = np.dtype(itype).itemsize
    lanes = 8 // size
    wmask, wadd = launch._word_constants(size, mask)
    kernel = launch.nonfinite_kernel(size)
    bad, good = _NONFINITE_BITS[dtype]
    rng = np.random.default_rng(5)
    sizes = [0, 1, lanes + 1, 37, 8 * 64 + 3]  # more words than the simulator's grid (2 x 32 threads)

    def flags(arrays, words):
        host = [np.zeros(-(-max(len(a), 1) // lanes) * lanes, itype) for a in arrays]
        for h, a in zip(host, arrays):
            h[:len(a)] = a
        nws = [len(a) // lanes if words else 0 for a in arrays]
        wide = [cuda.to_device(h.view(np.uint64)[:max(nw, 1)]) for h, nw in zip(host, nws)]
        elems = [cuda.to_device(h) for h in host]
        out = cuda.to_device(np.zeros(4, np.int32))
        kernel[2, 32](*wide, *elems, *nws, *(len(a) for a in arrays), wmask, wadd, itype(mask), out)
        return out.copy_to_host().tolist()

    for words in (True, False):
        clean = [rng.choice(np.array(good, dtype=itype), n) for n in sizes[1:]]
        assert flags(clean, words) == [0, 0, 0, 0]
        assert flags([np.zeros(0, itype)] * 4, words) == [0, 0, 0, 0]
        for which, base in enumerate(clean):
            n = len(base)
            for at in sorted({0, n - 1, n // 2, (n // lanes) * lanes, n - 1 - n % lanes} & set(range(n))):
                arrays = [x.copy() for x in clean]
                arrays[which][at] = bad[at % len(bad)]
                assert flags(arrays, words) == [int(i == which) for i in range(4)], (which, at, words)


@pytest.mark.skipif(SIMULATED, reason="needs a GPU")
def test_prepared_finite_scan_on_gpu():
    """The finite scan on a GPU, the general path's (launch.nonfinite) and the fast path's
    prepared one (launch.FiniteScan), by words at 8-byte-aligned addresses and element by
    element at others: one NaN or infinity anywhere in any of four arrays is seen (and
    named by the general path), finite arrays pass, for each 16- and 32-bit dtype."""
    import torch

    from attnkern._gpuarray import GpuArray
    from attnkern.backends.cuda import launch

    dtypes = {torch.float16: np.dtype(np.float16), torch.float32: np.dtype(np.float32)}
    if importlib.util.find_spec("ml_dtypes") is not None:
        import ml_dtypes

        dtypes[torch.bfloat16] = np.dtype(ml_dtypes.bfloat16)
    sizes = (4099, 1, 8, 20483)
    for dtype, npdtype in dtypes.items():
        pool = torch.randn(sum(sizes) + 64, device="cuda").to(dtype)
        for shift in (0, 1):  # element offsets: every address aligned (the pool's start is), or none
            views, at = [], shift
            for n in sizes:
                views.append(pool[at:at + n])
                at += -(-(n + shift) // 8) * 8
            ptrs = [x.data_ptr() for x in views]
            assert all((p % 8 == 0) == (shift == 0) for p in ptrs)
            arrays = [GpuArray((n,), npdtype, None, ptr=p, owner=x) for n, p, x in zip(sizes, ptrs, views)]
            assert launch.nonfinite(arrays) == [False] * 4
            scan = launch.FiniteScan.prepare(npdtype, sizes)
            assert scan is not None and scan(*ptrs) is False
            for which, x in enumerate(views):
                for pos in sorted({0, len(x) - 1, len(x) // 2}):
                    keep = x[pos].clone()
                    x[pos] = float("nan") if pos % 2 else float("-inf")
                    assert scan(*ptrs) is True, (dtype, shift, which, pos)
                    assert launch.nonfinite(arrays) == [i == which for i in range(4)], (dtype, shift, which, pos)
                    x[pos] = keep
            assert scan(*ptrs) is False
