"""The cuda backend: cuda.naive and cuda.flash (kernels.py; cuda.flash also
returns the log-sum-exp and has a backward), written with numba-cuda, on GPU
arrays (arrays.py) or NumPy arrays copied to the GPU and back. numba-cuda is
optional and imported on first use. This module owns the kernels'
registration, cuda.flash's tile choice, the memory checks and attention()'s
fast path for torch CUDA tensors (torch_attention).

(No module here may have "numba.cuda" in its dotted name: numba-cuda's import
redirector takes any such name for its own.)"""

from __future__ import annotations

import functools
import importlib.util
import math
import threading
import time

import numpy as np

from ..._registry import Kernel, Param, register

@functools.cache
def _cuda_unavailable():
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


def _to_device(q, k, v, out):
    """q, k, v as GpuArrays (copies of NumPy arrays), and an output there: `out`
    when the caller gave one (attention() does for GPU inputs), else a new one."""
    from . import arrays

    if isinstance(q, np.ndarray):
        q, k, v = (arrays.from_host(x) for x in (q, k, v))
    if out is None:
        out = arrays.device_empty((q.shape[0], q.shape[1], v.shape[2]), q.dtype)
    return q, k, v, out


def _from_device(out, host: bool):
    from . import arrays

    return arrays.to_host(out) if host else out


def _cuda_naive(q, k, v, causal, scale, tile=16, out=None):
    from . import kernels

    need = kernels.naive_workspace_bytes(q.shape[0], q.shape[1], k.shape[1], q.dtype.itemsize)
    free = _device_free_memory()
    if need > free:
        raise MemoryError(
            f"cuda.naive: out of GPU memory: its score matrix needs {need / 2**30:.1f} GiB and "
            f"{free / 2**30:.1f} GiB are free; use cuda.flash (no N x N buffer)"
        )
    host = isinstance(q, np.ndarray)
    dq, dk, dv, out = _to_device(q, k, v, out)
    kernels.naive(dq, dk, dv, out, causal, scale, tile)
    return _from_device(out, host)


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
    from . import kernels

    need = kernels.flash_shared_bytes(bq, bk, d, dv, itemsize)
    return need <= kernels.SHARED_BYTES or (need <= kernels.shared_limit() and bq * bk <= (4096 if explicit else 2048))


@functools.cache  # a pure function of its arguments, asked on every call
def _flash_tiles(block_q: int, block_k: int, d: int, dv: int, itemsize: int) -> tuple[int, int]:
    """The tile to run: as given, or for 0 ('auto') the first of the preferred
    tiles that fits shared memory for this head size and dtype."""
    from . import kernels

    explicit = bool(block_q and block_k)

    def fits(bq, bk):
        return _tile_fits(bq, bk, d, dv, itemsize, explicit)

    candidates = [(bq, bk) for bq, bk in _TILE_PREFERENCE if block_q in (0, bq) and block_k in (0, bk)]
    for bq, bk in candidates:
        if fits(bq, bk):
            return bq, bk
    bq, bk = candidates[0] if block_q and block_k else (block_q or 8, block_k or 8)
    need = kernels.flash_shared_bytes(bq, bk, d, dv, itemsize)
    raise ValueError(
        f"cuda.flash: block_q={bq}, block_k={bk} with D={d}, Dv={dv} in {itemsize * 8}-bit floats needs "
        f"{need} bytes of shared memory: cuda.flash takes up to {kernels.SHARED_BYTES}, or up to this GPU's "
        f"{kernels.shared_limit()} for tiles of at most 64 x 64; use smaller blocks (0 picks the largest that "
        "fits), float32, or cuda.naive"
    )


def _cuda_flash(q, k, v, causal, scale, block_q=0, block_k=0, tensor_cores=1, out=None, lse=None):
    """lse: None, or a (batch, nq) array of q's dtype to fill with each row's
    log-sum-exp: a GpuArray, or a NumPy array (filled from a copy on the GPU)."""
    from . import arrays, kernels

    if q.dtype.name in kernels.MMA_DTYPES:
        return _cuda_flash_half(q, k, v, causal, scale, out, lse)
    cpp = _cpp_kernel(block_q, block_k, q.shape[2], v.shape[2], q.dtype, tensor_cores)
    host = isinstance(q, np.ndarray)
    dq, dk, dv, out = _to_device(q, k, v, out)
    lse_host = isinstance(lse, np.ndarray)
    dlse = arrays.device_empty(lse.shape, q.dtype) if lse_host else lse
    ptrs = [a.ptr for a in (dq, dk, dv, out)] + ([] if dlse is None else [dlse.ptr])
    if cpp is not None and _cpp_aligned(cpp)(*ptrs):
        kernel, grid, block, args = _cpp_launch(cpp)(dq, dk, dv, out, causal, scale, dlse, cpp)
        kernels.launch(kernel, grid, block, *args)
    else:  # the Numba kernel, also for float32 arrays the CUDA C++ kernels cannot take at their addresses
        block_q, block_k = _flash_tiles(block_q, block_k, q.shape[2], v.shape[2], q.dtype.itemsize)
        kernels.flash(dq, dk, dv, out, causal, scale, block_q, block_k, lse=dlse)
    if lse_host:
        lse[...] = arrays.to_host(dlse)
    return _from_device(out, host)


def _cpp_kernel(block_q: int, block_k: int, d: int, dv: int, dtype, tensor_cores: int):
    """The CUDA C++ kernel that runs a float32 call with this tile, as its division:
    a kernels.MmaConfig for the tensor-core kernel (flash_tf32.cu, 3xTF32; with
    tensor_cores, where it has the tile and head size: kernels.tf32_config), else a
    kernels.SimtConfig for the register-blocked kernel (flash_simt.cu, float32 FMAs;
    where it has them: kernels.simt_config), else None: the Numba kernel runs it, as
    it runs float64 and everything under the simulator, which runs no CUDA C++."""
    from numba import config

    from . import kernels

    d, dv = int(d), int(dv)
    if np.dtype(dtype) != np.float32 or config.ENABLE_CUDASIM:
        return None
    if tensor_cores and (tc := kernels.tf32_config(d, dv, block_q, block_k)) is not None:
        return tc
    return kernels.simt_config(d, block_q, block_k) if kernels.simt_applies(d, dv) else None


def _cpp_launch(cpp):
    """The launch function (kernels.flash_mma_launch or flash_simt_launch) of the kernel _cpp_kernel chose."""
    from . import kernels

    return kernels.flash_mma_launch if isinstance(cpp, kernels.MmaConfig) else kernels.flash_simt_launch


def _cpp_aligned(cpp):
    """The address test of the kernel _cpp_kernel chose."""
    from . import kernels

    return kernels.tf32_aligned if isinstance(cpp, kernels.MmaConfig) else kernels.simt_aligned


def _cuda_flash_half(q, k, v, causal, scale, out, lse):
    """cuda.flash on float16/bfloat16: the tensor-core kernel (kernels.flash_mma),
    whose tiles are fixed (128 query rows x 64 or 32 keys): block_q and block_k do not apply."""
    from numba import config

    from . import arrays, kernels

    d, dv = q.shape[2], v.shape[2]
    if config.ENABLE_CUDASIM:
        raise RuntimeError("cuda.flash: float16/bfloat16 run CUDA C++ on tensor cores, which Numba's CUDA simulator "
                           "cannot run; use float32 there")
    if not kernels.mma_head_size_ok(d, dv):
        raise ValueError(f"cuda.flash: float16/bfloat16 need D = Dv, a multiple of 16 up to 128 (got D={d}, Dv={dv}); "
                         "use triton.flash, or float32")
    host = isinstance(q, np.ndarray)
    dq, dk, dv_, out = _to_device(q, k, v, out)
    lse_host = isinstance(lse, np.ndarray)
    dlse = arrays.device_empty(lse.shape, q.dtype) if lse_host else lse
    kernels.flash_mma(dq, dk, dv_, out, causal, scale, lse=dlse)
    if lse_host:
        lse[...] = arrays.to_host(dlse)
    return _from_device(out, host)


def prepared_flash(batch: int, nq: int, nk: int, d: int, dv: int, dtype, causal: bool, scale: float,
                   block_q: int, block_k: int, tensor_cores: int, with_lse: bool):
    """cuda.flash's launch for (batch, n, d) GPU arrays of these sizes and dtype,
    with everything but the addresses fixed: (kernels.Prepared taking the addresses
    of q, k, v, out[, lse], the test the addresses must pass or None), or None where
    the kernel is not compiled yet or the call is one _cuda_flash refuses (its error
    is raised there)."""
    from . import arrays, kernels

    dtype = np.dtype(dtype)
    shapes = [(batch, nq, d), (batch, nk, d), (batch, nk, dv), (batch, nq, dv)] + ([(batch, nq)] if with_lse else [])
    roles = [arrays.GpuArray(shape, dtype, None, ptr=0) for shape in shapes]
    lse = roles[4] if with_lse else None
    aligned = None
    try:
        if dtype.name in kernels.MMA_DTYPES:
            if not kernels.mma_head_size_ok(d, dv):
                return None
            kernel, grid, block, args = kernels.flash_mma_launch(*roles[:4], causal, scale, lse)
            aligned = kernels.mma_aligned
        elif (cpp := _cpp_kernel(block_q, block_k, d, dv, dtype, tensor_cores)) is not None:
            kernel, grid, block, args = _cpp_launch(cpp)(*roles[:4], causal, scale, lse, cpp)
            aligned = _cpp_aligned(cpp)
        else:
            block_q, block_k = _flash_tiles(block_q, block_k, d, dv, dtype.itemsize)
            kernel, grid, block, args = kernels.flash_launch(*roles[:4], causal, scale, block_q, block_k, lse=lse)
    except ValueError:
        return None
    raw = kernels.raw_kernel(kernel)
    return None if raw is None else (kernels.Prepared(raw, grid, block, args, roles), aligned)


def _flash_backward_tiles(block_q: int, block_k: int, d: int, dv: int, itemsize: int) -> tuple[int, int]:
    """The backward's tiles: block_q and block_k as given (0: 64), each halved
    until the backward's shared memory fits. Its results do not depend on them:
    every gradient row is summed by one thread over the rows or keys in order."""
    from . import kernels

    bq, bk = block_q or 64, block_k or 64
    while kernels.flash_backward_shared_bytes(bq, bk, d, dv, itemsize) > kernels.SHARED_BYTES:
        if bq == bk == _TILE_SIZES[0]:
            need = kernels.flash_backward_shared_bytes(bq, bk, d, dv, itemsize)
            raise ValueError(
                f"cuda.flash backward: D={d}, Dv={dv} in {itemsize * 8}-bit floats needs {need} bytes of shared "
                f"memory with the smallest tiles, over the {kernels.SHARED_BYTES}-byte limit"
            )
        if bq >= bk and bq > _TILE_SIZES[0]:
            bq //= 2
        else:
            bk //= 2
    return bq, bk


def _cuda_flash_backward(q, k, v, out, dout, lse, causal, scale, block_q=0, block_k=0, tensor_cores=1, dq=None,
                         dk=None, dv=None):
    """(dq, dk, dv) of cuda.flash, from the forward's out and lse and the
    output's gradient dout. GpuArrays: dq, dk, dv are the caller's, filled and
    returned; NumPy arrays: copied to the GPU, the gradients copied back. The
    backward runs float32 FMAs: tensor_cores applies to the forward only."""
    from . import arrays, kernels

    if q.dtype.name in kernels.MMA_DTYPES:
        raise TypeError(f"cuda.flash's backward takes float32 and float64, not {q.dtype.name}; "
                        "convert with .float() for training")
    block_q, block_k = _flash_backward_tiles(block_q, block_k, q.shape[2], v.shape[2], q.dtype.itemsize)
    host = isinstance(q, np.ndarray)
    if host:
        q, k, v, out, dout, lse = (arrays.from_host(np.ascontiguousarray(x)) for x in (q, k, v, out, dout, lse))
    grads = [g if g is not None and not host else arrays.device_empty(x.shape, q.dtype)
             for g, x in ((dq, q), (dk, k), (dv, v))]
    kernels.flash_backward(q, k, v, out, dout, lse, *grads, causal, scale, block_q, block_k)
    if not host:
        return tuple(grads)
    result = []
    for given, g in zip((dq, dk, dv), grads):
        g = arrays.to_host(g)
        if given is not None:  # NumPy arrays to fill
            given[...] = g
            g = given
        result.append(g)
    return tuple(result)


def flash_default_tile(d: int, dv: int, itemsize: int) -> tuple[int, int]:
    """The (block_q, block_k) that cuda.flash runs for block_q = block_k = 0 (and
    tensor_cores = 1): the default tile of the float32 CUDA C++ kernel that runs
    (_cpp_kernel), else the first of flash_tiles."""
    cpp = _cpp_kernel(0, 0, d, dv, np.float32, 1) if itemsize == 4 else None
    return (cpp.block_q, cpp.block_k) if cpp is not None else flash_tiles(d, dv, itemsize)[0]


def flash_tiles(d: int, dv: int, itemsize: int, tensor_cores: int = 1) -> list[tuple[int, int]]:
    """cuda.flash's (block_q, block_k) tiles that run for this head size and dtype:
    those of the Numba kernel whose shared memory fits, in the order block_q =
    block_k = 0 tries them, and in float32 with tensor_cores those of the
    tensor-core kernel (flash_tf32.cu) too, its default first."""
    from . import kernels

    auto = [t for t in _TILE_PREFERENCE if _tile_fits(*t, d, dv, itemsize, False)]
    tiles = auto + [t for t in _TILE_PREFERENCE if t not in auto and _tile_fits(*t, d, dv, itemsize, True)]
    if itemsize != 4 or not tensor_cores:
        return tiles
    tc = [(bq, bk) for bq in kernels.TF32_BLOCK_Q for bk in kernels.TF32_BLOCK_K
          if isinstance(_cpp_kernel(bq, bk, d, dv, np.float32, 1), kernels.MmaConfig)]
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
        unavailable_reason=_cuda_unavailable,
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
                    "float16/bfloat16: tensor cores; float64: Numba); "
                    "deterministic backward in two (dK/dV per key block, dQ per query block)",
        run=_cuda_flash,
        params=(
            Param("block_q", 0, 0, 128, "queries per thread block; 0: the kernel's default (float32 CUDA C++ "
                  "kernels: 128 on tensor cores, else 64; Numba kernel: the largest tile that fits; backward: "
                  "64, halved until it fits)", choices=(0, *_TILE_SIZES)),
            Param("block_k", 0, 0, 128, "keys per streamed K/V tile; 0: the kernel's default (float32 CUDA C++ "
                  "kernels: 64, but 32 without tensor cores above D = 64; Numba kernel: the largest tile that "
                  "fits; backward: 64, halved until it fits)", choices=(0, *_TILE_SIZES)),
            Param("tensor_cores", 1, 0, 1, "float32 forward: 1 computes Q K^T and P V on tensor cores in 3xTF32 "
                  "(each operand split into two TF32 parts, three products: about float32 FMAs' accuracy) where "
                  "that kernel has the tile (64 or 128 x 32 or 64) and head size (D = Dv a multiple of 16 up to "
                  "128); 0 runs float32 FMAs", choices=(0, 1)),
        ),
        unavailable_reason=_cuda_unavailable,
        device="cuda",
        returns_lse=True,
        backward=_cuda_flash_backward,
        # float16/bfloat16: the tensor-core forward (flash_mma.cu), D = Dv a multiple of 16 up to 128
        dtypes=("float32", "float64", "float16", "bfloat16"),
    )
)


# ---------------------------------------------------------------- torch tensors' fast path
#
# attention() on device-resident torch tensors, for cuda.flash, with the Python
# work per call cut to what changes between calls of one shape: the addresses.
#
# The first call of each (shapes, dtypes, device, causal, scale, kernel, tunables,
# check_finite, return_lse) goes through attention()'s general path (validation,
# kernel choice, tuned parameters, compilation) and leaves a plan: the kernel's
# launch prepared (kernels.Prepared: parameters laid out once, the addresses
# written in per call), the output shapes and, with check_finite, the scan of q, k,
# v and the output prepared likewise. Later calls check what the plan cannot know
# (tensor types, grad, devices, contiguity, torch's current stream, alignment),
# allocate the outputs with torch and launch. Anything else, any other kernel and
# any call with no work (an empty dimension) returns None: the general path runs.
# A non-finite flag also returns None: the general path runs the call again and
# raises its error, worded in one place. Plans are per thread (their parameter
# memory is written per call); one whose tunables were not all given is rebuilt
# after a second, as the general path looks up tuned parameters at most once a
# second per call shape.

FAST_PATH = True  # False: every call takes the general path (measurements compare the two)
RECHECK_S = 1.0  # how long a plan with looked-up tunables is used before it is rebuilt
_LOCAL = threading.local()  # per thread: key -> _Plan
_TORCH = []  # the torch module, imported on first use


def _torch():
    if not _TORCH:
        import torch

        _TORCH.append(torch)
    return _TORCH[0]


class _Plan:
    """A call shape's prepared work; launch None: the general path's."""

    __slots__ = ("launch", "scan", "aligned", "stream", "out_shape", "lse_shape", "until")

    def __init__(self, launch=None, scan=None, aligned=None, stream=None, out_shape=(), lse_shape=(),
                 until=math.inf):
        self.launch, self.scan, self.aligned, self.stream = launch, scan, aligned, stream
        self.out_shape, self.lse_shape, self.until = out_shape, lse_shape, until


def torch_attention(q, k, v, causal, scale, kernel, check_finite, return_lse, params):
    """attention(q, k, v, ...) for torch CUDA tensors q (the caller knows that much),
    or None where the general path must run."""
    if not FAST_PATH:
        return None
    torch = _torch()
    tensor = torch.Tensor
    if type(q) is not tensor or type(k) is not tensor or type(v) is not tensor:
        return None
    if q.requires_grad or k.requires_grad or v.requires_grad:  # autograd: the general path
        return None
    # only argument types whose equality is their identity for the call (True is not 1 here)
    if (causal is not True and causal is not False) or type(kernel) is not str:
        return None
    if scale is not None and type(scale) is not float and type(scale) is not int:
        return None
    if params and any(type(x) is not int for x in params.values()):
        return None
    device = q.get_device()
    if k.get_device() != device or v.get_device() != device:
        return None
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        return None
    check, with_lse = bool(check_finite), bool(return_lse)
    key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, device, causal, scale, kernel, check, with_lse,
           tuple(params.items()))
    plans = getattr(_LOCAL, "plans", None)
    if plans is None:
        plans = _LOCAL.plans = {}
    plan = plans.get(key)
    if plan is None or plan.until < time.monotonic():
        return _first_call(plans, key, q, k, v, causal, scale, kernel, check, with_lse, params)
    if plan.launch is None:
        return None
    if plan.stream(device):  # not the legacy default stream: its queued work must come first
        torch.cuda.current_stream(device).synchronize()
    out = q.new_empty(plan.out_shape)
    ptrs = [q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()]
    if with_lse:
        lse = q.new_empty(plan.lse_shape)
        ptrs.append(lse.data_ptr())
    if plan.aligned is not None and not plan.aligned(*ptrs):
        return None
    plan.launch(*ptrs)
    if plan.scan is not None and plan.scan(*ptrs[:4]):
        return None
    return (out, lse) if with_lse else out


def _first_call(plans, key, q, k, v, causal, scale, kernel, check, with_lse, params):
    """The call through the general path's steps, and the plan for the next ones."""
    from ... import _api

    try:
        call = _api.validate(q, k, v, causal=causal, scale=scale, check_finite=check)
        chosen, resolved = _api.choose(call, kernel, params, return_lse=with_lse)
    except (TypeError, ValueError, RuntimeError):
        return None  # the general path raises it, as it words it
    result = _api.run(call, chosen, resolved, check_finite=check, return_lse=with_lse)  # compiles on first use
    if len(plans) >= 256:  # many shapes in turn: start over rather than keep them all
        plans.clear()
    plans[key] = _plan(call, chosen, resolved, params, with_lse, check)
    return result


def _plan(call, chosen, resolved, params, with_lse, check) -> _Plan:
    from . import arrays, kernels

    if call.empty or chosen.name != "cuda.flash":
        return _Plan()
    (batch, nq, d), nk, dv = call.q.shape, call.k.shape[1], call.v.shape[2]
    prepared = prepared_flash(batch, nq, nk, d, dv, call.q.dtype, call.causal, call.scale,
                              resolved["block_q"], resolved["block_k"], resolved["tensor_cores"], with_lse)
    sizes = (call.q.size, call.k.size, call.v.size, math.prod(call.out_shape))
    scan = kernels.FiniteScan.prepare(call.q.dtype, sizes) if check else None
    if prepared is None or (check and scan is None):
        return _Plan(until=time.monotonic() + RECHECK_S)
    looked_up = len(params) < len(chosen.params)  # tunables from the tuning cache or defaults
    return _Plan(prepared[0], scan, prepared[1], arrays.raw_stream, call.out_shape,
                 call.out_shape[:-1],
                 time.monotonic() + RECHECK_S if looked_up else math.inf)
