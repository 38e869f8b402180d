"""The cuda backend: cuda.naive and cuda.flash (cuda.flash also returns the
log-sum-exp and has a backward), written with numba-cuda, on GPU arrays
(GpuArray) or NumPy arrays copied to the GPU and back (arrays.py). numba-cuda is
optional and imported on first use. This module owns the kernels'
registration (with what they support and their tuning lattice), cuda.flash's
tile choice and the memory checks. The kernels, by job: launch.py (launches
below Numba's dispatcher, the NaN scan), numba_kernels.py (the Numba kernels),
cpp.py (the CUDA C++ kernels and their configurations), backward.py.

(No module here may have "numba.cuda" in its dotted name: numba-cuda's import
redirector takes any such name for its own.)"""

from __future__ import annotations

import functools
import importlib.util
import threading

import numpy as np

from ..._gpuarray import GpuArray
from ..._registry import Kernel, Param, SearchSpace, register
from .._split import DECODE_MAX_SPLITS, PREPARED_FEATURES


@functools.cache
def unavailable():
    """None where the cuda.* kernels can run here, else why not."""
    if importlib.util.find_spec("numba_cuda") is None:
        return "numba-cuda is not installed (pip install 'attnkern[cuda]')"
    from numba import cuda

    if cuda.is_available():
        return None
    try:
        cuda.current_context()
    except Exception as exc:  # the driver's own words: no driver, no device, ...
        detail = " ".join(str(exc).split())
        return f"no usable CUDA GPU: {detail}"
    return "no usable CUDA GPU"  # pragma: no cover - is_available() and a context disagree


def _staged(inputs: list, outputs: list, run) -> list:
    """run(*device inputs, *device outputs) on GPU copies of the NumPy arrays
    `inputs`, with GPU arrays of the (shape, dtype) specs `outputs`; returns the
    outputs as NumPy arrays. Through the GPU's pinned staging buffers (staging.py),
    or pageable copies where staging is off (staging.STAGING, the simulator) or
    the call needs more than staging.KEEP_BYTES."""
    from . import arrays, staging

    inputs = [np.ascontiguousarray(x) for x in inputs]
    if staging.enabled(staging.staged_bytes(inputs, outputs)):
        with staging.for_current_device().call(inputs, outputs) as (dev_in, dev_out, results):
            run(*dev_in, *dev_out)
        return results
    dev_in = [arrays.from_host(x) for x in inputs]
    dev_out = [arrays.device_empty(shape, dtype) for shape, dtype in outputs]
    run(*dev_in, *dev_out)
    return [arrays.to_host(x) for x in dev_out]


def _host_forward(q, k, v, lse, run):
    """A forward kernel's call on NumPy q, k, v: run(q, k, v, out, lse) on their GPU
    copies (lse None where the caller wants none); returns out, and fills the
    caller's NumPy lse."""
    outputs = [((q.shape[0], q.shape[1], v.shape[2]), q.dtype)] + ([] if lse is None else [(lse.shape, q.dtype)])
    results = _staged([q, k, v], outputs, lambda dq, dk, dv, out, dlse=None: run(dq, dk, dv, out, dlse))
    if lse is not None:
        lse[...] = results[1]
    return results[0]


def _device_out(q, v, out):
    """`out` when the caller gave one (attention() does for GPU inputs), else a new GPU array."""
    from . import arrays

    return out if out is not None else arrays.device_empty((q.shape[0], q.shape[1], v.shape[2]), q.dtype)


def _cuda_naive(q, k, v, causal, scale, tile=16, out=None):
    from . import numba_kernels

    need = numba_kernels.naive_workspace_bytes(q.shape[0], q.shape[1], k.shape[1], q.dtype.itemsize)
    free = _device_free_memory()
    if need > free:
        raise MemoryError(
            f"cuda.naive: out of GPU memory: its score matrix needs {need / 2**30:.1f} GiB and "
            f"{free / 2**30:.1f} GiB are free; use cuda.flash (no N x N buffer)"
        )
    if isinstance(q, np.ndarray):
        return _host_forward(q, k, v, None, lambda dq, dk, dv, out, _: numba_kernels.naive(dq, dk, dv, out, causal,
                                                                                            scale, tile))
    out = _device_out(q, v, out)
    numba_kernels.naive(q, k, v, out, causal, scale, tile)
    return out


def _device_free_memory() -> int:
    from numba import cuda

    try:
        return cuda.current_context().get_memory_info().free
    except Exception:  # the simulator has no memory to report
        return 1 << 62


def _tile_fits(bq: int, bk: int, d: int, dv: int, itemsize: int, explicit: bool) -> bool:
    """Whether cuda.flash runs this tile: its shared memory within the 48 KB a kernel
    gets without asking, or else (dynamic shared memory, the kernel's limit raised)
    within the GPU's limit for tiles of up to 64 x 32 (64 x 64 when asked for)."""
    from . import launch, numba_kernels

    need = numba_kernels.flash_shared_bytes(bq, bk, d, dv, itemsize)
    return need <= launch.SHARED_BYTES or (need <= launch.shared_limit() and bq * bk <= (4096 if explicit else 2048))


@functools.cache  # a pure function of its arguments, asked on every call
def _flash_tiles(block_q: int, block_k: int, d: int, dv: int, itemsize: int) -> tuple[int, int]:
    """The tile to run: as given, or for 0 ('auto') the first of the preferred
    tiles that fits shared memory for this head size and dtype."""
    from . import launch, numba_kernels

    explicit = bool(block_q and block_k)

    def fits(bq, bk):
        return _tile_fits(bq, bk, d, dv, itemsize, explicit)

    candidates = [(bq, bk) for bq, bk in _TILE_PREFERENCE if block_q in (0, bq) and block_k in (0, bk)]
    for bq, bk in candidates:
        if fits(bq, bk):
            return bq, bk
    bq, bk = candidates[0] if block_q and block_k else (block_q or 8, block_k or 8)
    need = numba_kernels.flash_shared_bytes(bq, bk, d, dv, itemsize)
    raise ValueError(
        f"cuda.flash: block_q={bq}, block_k={bk} with D={d}, Dv={dv} in {itemsize * 8}-bit floats needs "
        f"{need} bytes of shared memory: cuda.flash takes up to {launch.SHARED_BYTES}, or up to this GPU's "
        f"{launch.shared_limit()} for tiles of at most 64 x 64; use smaller blocks (0 picks the largest that "
        "fits), float32, or cuda.naive"
    )


# False: attention() on torch CUDA tensors runs every call of cuda.flash and triton.flash through the
# general path, not the frontend's prepared launches (_torch_cuda): measurements compare the two
FAST_PATH = True
# False: a planned call shape on torch CUDA tensors takes attention()'s whole way (its checks,
# then the plan) instead of running the plan from attention()'s first line; dev/gpu_library_host.py
# measures the difference
QUICK_PATH = True
# Bumped by forget_plans(): the frontend's prepared launches (_torch_cuda) made before are dropped
PLANS_EPOCH = [0]


def forget_plans() -> None:
    """Makes attention() on torch CUDA tensors plan each call shape again: a prepared launch
    keeps the kernel chosen when it was made, so a measurement that changes cpp's default
    divisions (cpp.WGMMA_DEFAULT, ...) between calls calls this after each change."""
    PLANS_EPOCH[0] += 1


# False: every differentiable call on torch CUDA tensors goes through the custom op attnkern::attention,
# also outside torch.compile, not the core's eager autograd Function: measurements compare the two
EAGER_AUTOGRAD = True
_LAST = threading.local()  # per thread: the key chunks of the last cuda.flash call (0: no split)


def last_split() -> int:
    """The number of key chunks cuda.flash's last call on this thread ran on its split-K
    decode path (cpp.flash_decode), or 0 where it ran a regular kernel."""
    return getattr(_LAST, "splits", 0)


def _decode_splits(q, k, v, features, split_k: int) -> int:
    """The chunks cuda.flash's decode path runs this call in (_split.decode_splits), 0 for
    the regular kernels; a ValueError where split_k >= 2 forces it on a call it cannot take."""
    from . import cpp

    batch, nq, d = q.shape
    group = features.kv_group if features is not None else 1
    why = cpp.decode_refusal(q.dtype.name, nq, group, d, v.shape[2], features)
    if why is not None:
        if split_k > 1:
            raise ValueError(f"cuda.flash: split_k={split_k} asks for the split-K decode path, but {why}; "
                             "pass split_k=0 (automatic) or 1 (off)")
        return 0
    return cpp.decode_auto_splits(k.shape[0], nq, k.shape[1], d, split_k, group)


def _cuda_flash(q, k, v, causal, scale, block_q=0, block_k=0, tensor_cores=1, fastmath=0, split_k=0, out=None,
                lse=None, features=None):
    """lse: None, or a (batch, nq) array of q's dtype to fill with each row's
    log-sum-exp: a GpuArray, or a NumPy array (filled from a copy on the GPU).
    features: a _registry.Features (grouped k/v, alignment, window, key lengths,
    softcap: every kernel below runs its featured variant), or None. fastmath: 1
    runs the CUDA C++ kernels' fastmath variant (ATTNKERN_FAST in flash_common.cuh);
    the Numba kernel (float64, and float32 where no CUDA C++ kernel runs) has one form.
    split_k: the split-K decode path's key chunks (0: by shape, 1: off; _decode_splits)."""
    from . import cpp, launch, numba_kernels

    if isinstance(q, np.ndarray):
        return _host_forward(q, k, v, lse, lambda dq, dk, dv, dout, dlse: _cuda_flash(
            dq, dk, dv, causal, scale, block_q, block_k, tensor_cores, fastmath, split_k, out=dout, lse=dlse,
            features=features))
    _LAST.splits = 0
    _check_varlen(features, q.dtype.name)
    splits = _decode_splits(q, k, v, features, split_k)
    feat = launch.KernelFeatures.of(features, q.shape[0], q.dtype)
    dropout = feat is not None and feat.dropout_p > 0
    if q.dtype.name in cpp.MMA_DTYPES:
        return _cuda_flash_half(q, k, v, causal, scale, out, lse, feat, fastmath, splits)
    # float32 dropout runs the Numba kernel: the float32 CUDA C++ kernels have no Philox
    # (float16/bfloat16 dropout runs flash_mma.cu's dropout variant)
    division = None if dropout else _cpp_kernel(block_q, block_k, q.shape[2], v.shape[2], q.dtype, tensor_cores)
    out = _device_out(q, v, out)
    ptrs = [a.ptr for a in (q, k, v, out)] + ([] if lse is None else [lse.ptr])
    if division is not None and _cpp_aligned(division)(*ptrs):
        kernel, grid, block, args = _cpp_launch(division)(q, k, v, out, causal, scale, lse, division, feat,
                                                          bool(fastmath))
        launch.launch(kernel, grid, block, *args)
    else:  # the Numba kernel, also for float32 arrays the CUDA C++ kernels cannot take at their addresses
        block_q, block_k = _flash_tiles(block_q, block_k, q.shape[2], v.shape[2], q.dtype.itemsize)
        numba_kernels.flash(q, k, v, out, causal, scale, block_q, block_k, lse=lse, feat=feat)
    return out


# cuda.flash's dtypes but FP8, which has grouped k/v heads and bottom-right causal masking only
WIDE_DTYPES = ("float32", "float64", "float16", "bfloat16")
# the dtypes in which cuda.flash runs packed varlen sequences in one launch (flash_mma.cu's and
# flash_bwd_mma.cu's ATTNKERN_VARLEN variants); in the others attention_varlen runs one call a sequence
VARLEN_DTYPES = ("float16", "bfloat16")
# a launch's grid z (the sequences of a varlen call) is at most 65535 blocks
MAX_SEQUENCES = 65535


def _check_varlen(features, dtype: str) -> None:
    """ValueError where a varlen call (packed sequences) is one cuda.flash cannot run in one launch."""
    if features is None or features.cu_seqlens_q is None:
        return
    if dtype not in VARLEN_DTYPES:
        raise ValueError(f"cuda.flash runs packed varlen sequences in one launch in float16 and bfloat16 only, not "
                         f"{dtype}: attention_varlen runs {dtype} one sequence at a time")
    if len(features.cu_seqlens_q) - 1 > MAX_SEQUENCES:
        raise ValueError(f"cuda.flash takes at most {MAX_SEQUENCES} packed sequences in one launch, got "
                         f"{len(features.cu_seqlens_q) - 1}: split the batch")


def _cpp_kernel(block_q: int, block_k: int, d: int, dv: int, dtype, tensor_cores: int):
    """The CUDA C++ kernel that runs a float32 call with this tile, as its division:
    a cpp.MmaConfig for the tensor-core kernel (flash_tf32.cu, 3xTF32; with
    tensor_cores, where it has the tile and head size: cpp.tf32_config), else a
    cpp.SimtConfig for the register-blocked kernel (flash_simt.cu, float32 FMAs;
    where it has them: cpp.simt_config), else None: the Numba kernel runs it, as
    it runs float64 and everything under the simulator, which runs no CUDA C++."""
    from numba import config

    from . import cpp

    d, dv = int(d), int(dv)
    if np.dtype(dtype) != np.float32 or config.ENABLE_CUDASIM:
        return None
    if tensor_cores and (tc := cpp.tf32_config(d, dv, block_q, block_k)) is not None:
        return tc
    return cpp.simt_config(d, block_q, block_k) if cpp.simt_applies(d, dv) else None


def _cpp_launch(division):
    """The launch function (cpp.flash_mma_launch or flash_simt_launch) of the kernel _cpp_kernel chose."""
    from . import cpp

    return cpp.flash_mma_launch if isinstance(division, cpp.MmaConfig) else cpp.flash_simt_launch


def _cpp_aligned(division):
    """The address test of the kernel _cpp_kernel chose."""
    from . import cpp

    return cpp.tf32_aligned if isinstance(division, cpp.MmaConfig) else cpp.simt_aligned


def _cuda_flash_half(q, k, v, causal, scale, out, lse, feat=None, fastmath=0, splits=0):
    """cuda.flash on float16/bfloat16: the tensor-core kernel (cpp.flash_mma),
    whose divisions are fixed (cpp.tensor_core_config; 64 query rows above D = 128): block_q and block_k do not apply;
    with splits, the split-K decode path (cpp.flash_decode) where the addresses suit it."""
    from numba import config

    from . import cpp

    d, dv = q.shape[2], v.shape[2]
    if config.ENABLE_CUDASIM:
        raise RuntimeError("cuda.flash: float16/bfloat16 run CUDA C++ on tensor cores, which Numba's CUDA simulator "
                           "cannot run; use float32 there")
    why = _flash_head_sizes(d, dv, q.dtype.name)
    if why is not None:
        raise ValueError(f"cuda.flash: {why}")
    out = _device_out(q, v, out)
    if splits and cpp.decode_aligned(*[a.ptr for a in (q, k, v, out) + (() if lse is None else (lse,))]):
        _LAST.splits = cpp.flash_decode(q, k, v, out, causal, scale, lse, feat, splits, bool(fastmath))
    else:
        cpp.flash_mma(q, k, v, out, causal, scale, lse=lse, feat=feat, fast=bool(fastmath))
    return out


def flash_half_float32(q, k, v, out, lse, causal: bool, scale: float) -> bool:
    """cuda.flash's float16/bfloat16 kernel on GpuArrays q, k, v (batch, n, d), writing out
    (batch, nq, dv) and lse (batch, nq) in float32: each row as the kernel has it before
    rounding it to q's dtype, and its lse in the log2 domain (log2 of the row's sum of
    2^(scores log2 e): the natural lse times log2 e), for callers that merge rows computed
    over different keys (attnkern.distributed's ring). False, with nothing written, where that kernel does
    not take these head sizes (or Numba's simulator runs, which cannot run it)."""
    from numba import config

    from . import cpp

    if config.ENABLE_CUDASIM or _flash_head_sizes(q.shape[2], v.shape[2], q.dtype.name) is not None:
        return False
    cpp.flash_mma(q, k, v, out, causal, scale, lse=lse)
    return True


def prepared_flash(batch: int, nq: int, nk: int, d: int, dv: int, dtype, causal: bool, scale: float,
                   block_q: int, block_k: int, tensor_cores: int, with_lse: bool, fastmath: int = 0,
                   split_k: int = 0, features=None):
    """cuda.flash's launch for (batch, n, d) GPU arrays of these sizes and dtype,
    with everything but the addresses fixed: (launch.Prepared taking the addresses
    of q, k, v, out[, lse], the test the addresses must pass or None), or for a call
    on the split-K decode path (launch(q, k, v, out[, lse], scratch), its test,
    the float32 elements of scratch memory it takes); None where the kernel is not
    compiled yet, the call is one _cuda_flash refuses (its error is raised there),
    or it has features (a _registry.Features) beyond PREPARED_FEATURES, or features
    on the Numba kernel (float64; float32 where no CUDA C++ kernel runs)."""
    from . import cpp, launch, numba_kernels

    dtype = np.dtype(dtype)
    group = 1 if features is None else features.kv_group
    if features is not None and not features.needs() <= PREPARED_FEATURES:
        return None
    batch_kv = batch // group
    shapes = [(batch, nq, d), (batch_kv, nk, d), (batch_kv, nk, dv), (batch, nq, dv)] + (
        [(batch, nq)] if with_lse else [])
    roles = [GpuArray(shape, dtype, None, ptr=0) for shape in shapes]
    lse = roles[4] if with_lse else None
    aligned = None
    try:
        feat = launch.KernelFeatures.of(features, batch, dtype)  # grouped k/v, bottom-right: no arrays
        if dtype.name in cpp.MMA_DTYPES:
            if _flash_head_sizes(d, dv, dtype.name) is not None:
                return None
            if cpp.decode_refusal(dtype.name, nq, group, d, dv, feat) is None and (splits := cpp.decode_auto_splits(
                    batch_kv, nq, nk, d, split_k, group)):
                return _prepared_decode(roles, causal, scale, feat, splits, bool(fastmath))
            # the regular kernel, its featured variant for grouped k/v heads or bottom-right masking
            kernel, grid, block, args = cpp.flash_mma_launch(*roles[:4], causal, scale, lse, feat=feat,
                                                             fast=bool(fastmath))
            aligned = cpp.mma_aligned
        elif (division := _cpp_kernel(block_q, block_k, d, dv, dtype, tensor_cores)) is not None:
            kernel, grid, block, args = _cpp_launch(division)(*roles[:4], causal, scale, lse, division, feat,
                                                              fast=bool(fastmath))
            aligned = _cpp_aligned(division)
        elif feat is not None:  # the Numba kernel's featured calls: the general path
            return None
        else:
            block_q, block_k = _flash_tiles(block_q, block_k, d, dv, dtype.itemsize)
            kernel, grid, block, args = numba_kernels.flash_launch(*roles[:4], causal, scale, block_q, block_k, lse=lse)
    except ValueError:
        return None
    raw = launch.raw_kernel(kernel)
    return None if raw is None else (launch.Prepared(raw, grid, block, args, roles), aligned)


def _prepared_decode(roles: list, causal: bool, scale: float, feat, splits: int, fast: bool):
    """prepared_flash's answer for a call on the split-K decode path: its launches
    (cpp.flash_decode_launches: one fused, or two) prepared, taking the addresses of the roles (q, k, v,
    out[, lse]) and of the call's float32 scratch memory; or None where they are not
    compiled yet. A launch records its chunks for last_split(), as _cuda_flash does."""
    from . import cpp, launch

    q, k = roles[0], roles[1]
    batch, nq, d = q.shape
    chunk, splits, elems = cpp.decode_scratch(batch, k.shape[0], nq, k.shape[1], d, splits)
    part_o, part_lse = cpp.scratch_views(GpuArray((elems,), np.float32, None, ptr=0), elems, d)
    everything = roles + [part_o, part_lse]
    steps = []
    for kernel, grid, block, args in cpp.flash_decode_launches(*roles[:4], roles[4] if len(roles) > 4 else None,
                                                               part_o, part_lse, causal, scale, feat, splits, chunk,
                                                               fast):
        raw = launch.raw_kernel(kernel)
        if raw is None:
            return None
        steps.append(launch.Prepared(raw, grid, block, args, everything))
    lse_at = part_lse.ptr  # the lse's offset in the scratch (its base was 0)

    def run(*ptrs):  # q, k, v, out[, lse], scratch
        base = ptrs[-1]
        full = (*ptrs[:-1], base, base + lse_at)
        for step in steps:  # one (cpp.DECODE_FUSED) or two
            step(*full)
        _LAST.splits = splits

    return run, cpp.decode_aligned, elems


def prepared_flash_backward(batch: int, nq: int, nk: int, d: int, dv: int, dtype, causal: bool, scale: float,
                            tensor_cores: int, features=None):
    """cuda.flash's backward on tensor cores (cpp.flash_bwd_mma: float16, bfloat16, and
    float32 with tensor_cores) for (batch, n, d) GPU arrays of these sizes and dtype, with
    everything but the addresses fixed: (launch(q, k, v, out, dout, lse, dq, dk, dv,
    scratch), the test the first nine addresses must pass, the float32 elements of
    scratch memory it takes). None where the Numba kernels run the call (float64, float32
    with tensor_cores=0, other head sizes, the simulator), its kernels are not compiled
    yet, or the call has features beyond PREPARED_FEATURES (grouped k/v heads and
    bottom-right causal masking)."""
    from numba import config

    from . import cpp, launch

    dtype = np.dtype(dtype)
    ok = cpp.half_head_size_ok if dtype.name in cpp.MMA_DTYPES else cpp.mma_head_size_ok
    if config.ENABLE_CUDASIM or not ok(d, dv) or batch * nq * nk == 0:
        return None
    if dtype.name not in cpp.MMA_DTYPES and not (dtype == np.float32 and tensor_cores):
        return None
    if features is not None and not features.needs() <= PREPARED_FEATURES:
        return None
    group = 1 if features is None else features.kv_group
    batch_kv = batch // group
    shapes = [(batch, nq, d), (batch_kv, nk, d), (batch_kv, nk, dv), (batch, nq, dv), (batch, nq, dv), (batch, nq),
              (batch, nq, d), (batch_kv, nk, d), (batch_kv, nk, dv)]
    roles = [GpuArray(shape, dtype, None, ptr=0) for shape in shapes]
    rows = batch * nq
    feat = launch.KernelFeatures.of(features, batch, dtype)
    fused = cpp.bwd_fused_config(d, dtype.name, feat) is not None  # cpp.BWD_DETERMINISTIC False
    lse32, delta, dq32 = cpp.bwd_scratch_views(0, rows, None, d if fused else 0, batch)
    scratch = [lse32, delta] + ([dq32] if fused else [])
    steps = []
    for kernel, grid, block, args in cpp.flash_bwd_launches(*roles, lse32, delta, causal, scale, feat, dq32=dq32):
        raw = launch.raw_kernel(kernel)
        if raw is None:
            return None
        steps.append(launch.Prepared(raw, grid, block, args, roles + scratch))
    offsets = [a.ptr for a in scratch]  # the scratch arrays' offsets (its base was 0)

    def run(*ptrs):  # q, k, v, out, dout, lse, dq, dk, dv, scratch
        base = ptrs[-1]
        full = (*ptrs[:-1], *(base + at for at in offsets))
        for step in steps:  # two launches, or the fused backward's three
            step(*full)

    return run, cpp.bwd_aligned(2 * dtype.itemsize), cpp.bwd_scratch_elems(rows, d, fused, batch)


def _flash_backward_tiles(block_q: int, block_k: int, d: int, dv: int, itemsize: int) -> tuple[int, int]:
    """The backward's tiles: block_q and block_k as given (0: 64), each halved
    until the backward's shared memory fits. Its results do not depend on them:
    every gradient row is summed by one thread over the rows or keys in order."""
    from . import backward, launch

    bq, bk = block_q or 64, block_k or 64
    while backward.flash_backward_shared_bytes(bq, bk, d, dv, itemsize) > launch.SHARED_BYTES:
        if bq == bk == _TILE_SIZES[0]:
            need = backward.flash_backward_shared_bytes(bq, bk, d, dv, itemsize)
            raise ValueError(
                f"cuda.flash backward: D={d}, Dv={dv} in {itemsize * 8}-bit floats needs {need} bytes of shared "
                f"memory with the smallest tiles, over the {launch.SHARED_BYTES}-byte limit"
            )
        if bq >= bk and bq > _TILE_SIZES[0]:
            bq //= 2
        else:
            bk //= 2
    return bq, bk


def _cuda_flash_backward(q, k, v, out, dout, lse, causal, scale, block_q=0, block_k=0, tensor_cores=1, fastmath=0,
                         split_k=0, dq=None, dk=None, dv=None, features=None):
    """(dq, dk, dv) of cuda.flash, from the forward's out and lse and the
    output's gradient dout. GpuArrays: dq, dk, dv are the caller's, filled and
    returned; NumPy arrays: copied to the GPU (through the pinned staging buffers),
    the gradients copied back. float16/bfloat16 run the tensor-core kernels
    (cpp.flash_bwd_mma; block_q, block_k and tensor_cores do not apply); float32 with
    tensor_cores = 1 too, in 3xTF32 (where _tf32_backward takes the call: D = Dv a
    multiple of 16 up to 128, no dropout, aligned addresses; block_q and block_k do not
    apply); float64, and float32 otherwise, the Numba kernels (backward.py; FMAs in the
    input's dtype, tiles block_q x block_k). fastmath and split_k apply to the forward only.
    features: a _registry.Features or None, as for the forward (dk and dv of a
    group of query rows sharing k/v rows summed in the rows' order)."""
    from numba import config

    from . import arrays, backward, cpp, launch

    half = q.dtype.name in cpp.MMA_DTYPES
    if half:
        if config.ENABLE_CUDASIM:
            raise RuntimeError("cuda.flash: the float16/bfloat16 backward runs CUDA C++ on tensor cores, which "
                               "Numba's CUDA simulator cannot run; use float32 there")
        why = _flash_head_sizes(q.shape[2], v.shape[2], q.dtype.name)
        if why is not None:
            raise ValueError(f"cuda.flash backward: {why}")
    else:
        block_q, block_k = _flash_backward_tiles(block_q, block_k, q.shape[2], v.shape[2], q.dtype.itemsize)
    _check_varlen(features, q.dtype.name)
    feat = launch.KernelFeatures.of(features, q.shape[0], q.dtype)

    def run(*a):
        if half or _tf32_backward(a, tensor_cores, scale, feat):
            cpp.flash_bwd_mma(*a, causal, scale, feat)
        else:
            backward.flash_backward(*a, causal, scale, block_q, block_k, feat)

    if isinstance(q, np.ndarray):
        grads = _staged([q, k, v, out, dout, lse], [(x.shape, q.dtype) for x in (q, k, v)], run)
        result = []
        for given, g in zip((dq, dk, dv), grads):
            if given is not None:  # NumPy arrays to fill
                given[...] = g
                g = given
            result.append(g)
        return tuple(result)
    grads = [g if g is not None else arrays.device_empty(x.shape, q.dtype) for g, x in ((dq, q), (dk, k), (dv, v))]
    run(q, k, v, out, dout, lse, *grads)
    return tuple(grads)


def _tf32_backward(arrays, tensor_cores: int, scale: float, feat) -> bool:
    """Whether a float32 backward on these GpuArrays (q, k, v, out, dout, lse, dq, dk, dv)
    runs on tensor cores in 3xTF32 (cpp.flash_bwd_mma): with tensor_cores = 1, D = Dv a
    multiple of 16 up to 128, outside the simulator and where cpp.bwd_refusal takes it
    (aligned addresses, no dropout, no additive mask with scale 0); else the Numba kernels."""
    from numba import config

    from . import cpp

    q, v = arrays[0], arrays[2]
    return (bool(tensor_cores) and q.dtype == np.float32 and not config.ENABLE_CUDASIM
            and cpp.mma_head_size_ok(q.shape[2], v.shape[2])
            and cpp.bwd_refusal(*arrays[:5], *arrays[6:9], scale, feat) is None)


def _flash_head_sizes(d: int, dv: int, dtype: str) -> str | None:
    """Why cuda.flash does not take these head sizes in this dtype, or None: its
    float16/bfloat16 kernels (tensor cores, forward and backward) need D = Dv, a multiple of
    16 up to 256 (cpp.half_head_size_ok)."""
    from . import cpp

    if dtype in cpp.MMA_DTYPES and not cpp.half_head_size_ok(d, dv):
        return (f"float16/bfloat16 need D = Dv, a multiple of 16 up to {cpp.HALF_MAX_HEAD} (got D={d}, Dv={dv}); "
                "use triton.flash, or float32")
    if dtype == "float8_e4m3fn" and not d == dv in cpp.FP8_HEAD_SIZES:
        return f"float8_e4m3fn needs D = Dv = 128 (got D={d}, Dv={dv}); use bfloat16"
    return None


def _flash_search_space(nq: int, nk: int, d: int, dv: int, itemsize: int) -> SearchSpace:
    """cuda.flash's tuning lattice: the tiles that run for this head size and dtype
    (flash_tiles), with and without tensor cores where float32 has a tensor-core
    kernel; its default is the tile block_q = block_k = 0 runs."""
    tiles = flash_tiles(d, dv, itemsize)
    lattice = {"block_q": sorted({bq for bq, _ in tiles}), "block_k": sorted({bk for _, bk in tiles})}
    if tiles != flash_tiles(d, dv, itemsize, tensor_cores=0):  # float32 with a tensor-core kernel
        lattice["tensor_cores"] = [0, 1]
    bq, bk = flash_default_tile(d, dv, itemsize)
    default = {"block_q": bq, "block_k": bk, **({"tensor_cores": 1} if "tensor_cores" in lattice else {})}
    fits = [set(flash_tiles(d, dv, itemsize, tensor_cores=tc)) for tc in (0, 1)]
    return SearchSpace(lattice, default, lambda p: (p["block_q"], p["block_k"]) in fits[p.get("tensor_cores", 1)])


def flash_default_tile(d: int, dv: int, itemsize: int) -> tuple[int, int]:
    """The (block_q, block_k) that cuda.flash runs for block_q = block_k = 0 (and
    tensor_cores = 1): the default tile of the float32 CUDA C++ kernel that runs
    (_cpp_kernel), else the first of flash_tiles."""
    division = _cpp_kernel(0, 0, d, dv, np.float32, 1) if itemsize == 4 else None
    return (division.block_q, division.block_k) if division is not None else flash_tiles(d, dv, itemsize)[0]


def flash_tiles(d: int, dv: int, itemsize: int, tensor_cores: int = 1) -> list[tuple[int, int]]:
    """cuda.flash's (block_q, block_k) tiles that run for this head size and dtype:
    those of the Numba kernel whose shared memory fits, in the order block_q =
    block_k = 0 tries them, and in float32 with tensor_cores those of the
    tensor-core kernel (flash_tf32.cu) too, its default first."""
    from . import cpp

    auto = [t for t in _TILE_PREFERENCE if _tile_fits(*t, d, dv, itemsize, False)]
    tiles = auto + [t for t in _TILE_PREFERENCE if t not in auto and _tile_fits(*t, d, dv, itemsize, True)]
    if itemsize != 4 or not tensor_cores:
        return tiles
    tc = [(bq, bk) for bq in cpp.TF32_BLOCK_Q for bk in cpp.TF32_BLOCK_K
          if isinstance(_cpp_kernel(bq, bk, d, dv, np.float32, 1), cpp.MmaConfig)]
    if tc:
        default = flash_default_tile(d, dv, itemsize)  # the tensor-core kernel's: tc is not empty
        tc.sort(key=lambda t: t != default)
    return tc + [t for t in tiles if t not in tc]


_TILE_SIZES = (8, 16, 32, 64, 128)
# cuda.flash's tiles in order of preference for block_q = block_k = 0: the first that
# fits shared memory is used. block_k >= 16 first (a narrower tile leaves each thread
# Dv/2 output columns, more than its registers hold), then larger tiles (fewer K/V
# reloads), then, among tiles of one area, block_q = 2 block_k (64 x 32 before 128 x 16:
# twice the blocks over short sequences, each with as many threads), then taller ones.
# This order is the Numba kernel's (float64, and float32 where the CUDA C++ kernel
# does not run: _cpp_kernel); a tile whose shared memory exceeds the 48 KB a kernel gets
# without asking takes dynamic shared memory, up to the GPU's limit (_tile_fits).
# docs/results.md has the measured sweep behind this order.
_TILE_PREFERENCE = tuple(
    sorted(((bq, bk) for bq in _TILE_SIZES for bk in _TILE_SIZES),
           key=lambda t: (t[1] < 16, -t[0] * t[1], t[0] != 2 * t[1], -t[0]))
)

register(
    Kernel(
        name="cuda.naive",
        description="numba-cuda: tiled Q K^T into an N x N score matrix, a shuffle-reduced row softmax, tiled P V",
        run=_cuda_naive,
        params=(Param("tile", 16, 8, 32, "square tile of the two matmuls", choices=(8, 16, 32)),),
        unavailable_reason=unavailable,
        device="cuda",
    )
)
# cuda.flash's block_q and block_k also set its backward's tiles (queries per dQ block
# and per tile streamed by the dK/dV blocks; keys per dK/dV block and per tile streamed
# by the dQ blocks): see _flash_backward_tiles.
register(
    Kernel(
        name="cuda.flash",
        description="numba-cuda: FlashAttention-2 forward in one kernel, K/V tiles streamed through shared memory "
                    "(float32: tensor cores in 3xTF32, or register-blocked float32 FMAs, CUDA C++; "
                    "float16/bfloat16: tensor cores, wgmma warp-specialized on Hopper at D = 64, 128, 192, 256, "
                    "dropout on mma.sync; float64, and float32 with dropout: "
                    "Numba); "
                    "deterministic backward in two (dQ per query block, dK/dV per key block; float16/bfloat16 "
                    "on tensor cores (wgmma on Hopper at D = 64/128 without masks, ALiBi, dropout or varlen; "
                    "opt-in, cpp.BWD_DETERMINISTIC = False or ATTNKERN_BWD_DETERMINISTIC=0: at D = 64 a fused "
                    "backward with dQ added to a float32 accumulator by bulk reductions, not bit-identical run to run, "
                    "measured 1.38-1.48x the default's time on an H200) and "
                    "float32 in 3xTF32, CUDA C++; float64, and float32 with tensor_cores=0 or "
                    "dropout: Numba); float16/bfloat16 forward and backward at D = Dv a multiple of 16 up to 256 "
                    "(the backward above 128 on mma.sync, dK/dV's columns in two blocks), float32 on tensor "
                    "cores up to 128 "
                    "(above: float32 FMAs forward, Numba backward)",
        run=_cuda_flash,
        params=(
            Param("block_q", 0, 0, 128, "queries per thread block; 0: the kernel's default (float32 CUDA C++ "
                  "kernels: 128 on tensor cores, else 64; Numba kernel: the largest tile that fits; Numba backward "
                  "(float64, float32 with tensor_cores=0): 64, halved until it fits; the tensor-core backward and "
                  "float16/bfloat16 run fixed divisions)",
                  choices=(0, *_TILE_SIZES)),
            Param("block_k", 0, 0, 128, "keys per streamed K/V tile; 0: the kernel's default (float32 CUDA C++ "
                  "kernels: 64, but 32 without tensor cores above D = 64; Numba kernel: the largest tile that "
                  "fits; Numba backward (float64, float32 with tensor_cores=0): 64, halved until it fits; the "
                  "tensor-core backward and float16/bfloat16 run fixed divisions)",
                  choices=(0, *_TILE_SIZES)),
            Param("tensor_cores", 1, 0, 1, "float32: 1 computes the products on tensor cores in 3xTF32 "
                  "(each operand split into two TF32 parts, three products: about float32 FMAs' accuracy): the "
                  "forward's Q K^T and P V where that kernel has the tile (64 or 128 x 32 or 64) and head size "
                  "(D = Dv a multiple of 16 up to 128), the backward's seven products (flash_bwd_mma.cu) at those "
                  "head sizes without dropout; 0 runs float32 FMAs (the backward: the Numba kernels)",
                  choices=(0, 1)),
            Param("fastmath", 0, 0, 1, "forward, CUDA C++ kernels (float32, float16, bfloat16): 1 compiles them "
                  "with the hardware's approximations (ex2.approx.ftz, lg2.approx.ftz, rcp.approx.ftz, __fdividef; "
                  "denormals flushed); 0 with CUDA's accurate exp2f, log2f and IEEE division. The Numba kernel "
                  "(float64, and float32 where no CUDA C++ kernel runs) and the backward ignore it",
                  choices=(0, 1), switch=True),
            Param("split_k", 0, 0, DECODE_MAX_SPLITS,
                  "float16/bfloat16 forward: the split-K decode path's key chunks (one block per chunk and k/v "
                  "head, the group's query heads packed into its rows, a log-sum-exp combine in chunk order by the "
                  "last block of each k/v head, in the same launch): 0 by shape (nq <= "
                  "16, kv_group nq <= 128, nk >= 1024: enough chunks of >= 256 keys for 264 blocks where that "
                  "makes at most 264 blocks; else chunks of about 1280 keys, their blocks rounded to whole waves "
                  "of the blocks the GPU holds at once, chunks >= 128 keys), 1 off, N >= 2 forced (at most "
                  "one chunk per 64 keys); masks, ALiBi and dropout run the regular kernels"),
        ),
        unavailable_reason=unavailable,
        device="cuda",
        returns_lse=True,
        backward=_cuda_flash_backward,
        # every code path, forward and backward, has these features (docs/features.md); dropout
        # in every dtype: float16/bfloat16 on flash_mma.cu (mma.sync, also on Hopper) and
        # flash_bwd_mma.cu, float32 and float64 on the Numba kernels; varlen (packed sequences in
        # one launch) in float16/bfloat16 only (float32/float64 run one call a sequence)
        features=frozenset({"gqa", "bottom_right", "window", "key_lengths", "softcap", "mask", "alibi", "dropout",
                            "varlen"}),
        # FP8 (float8_e4m3fn, forward only, Hopper) has grouped k/v heads and bottom-right causal only
        feature_dtypes={"varlen": VARLEN_DTYPES, **{f: WIDE_DTYPES for f in ("window", "key_lengths", "softcap",
                                                                             "mask", "alibi", "dropout")}},
        # float16/bfloat16: the tensor-core forward (flash_mma.cu, flash_wgmma.cu) and backward
        # (flash_bwd_mma.cu), D = Dv a multiple of 16 up to 256 (_flash_head_sizes); float8_e4m3fn:
        # the FP8 forward (attnkern._fp8, flash_wgmma.cu's ATTNKERN_FP8) on Hopper, D = Dv = 128, no backward
        dtypes=("float32", "float64", "float16", "bfloat16", "float8_e4m3fn"),
        backward_dtypes=("float32", "float64", "float16", "bfloat16"),
        head_sizes=_flash_head_sizes,
        search_space=_flash_search_space,
    )
)
