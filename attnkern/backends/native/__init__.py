"""The C kernels (attn_kernels.h) registered as native.naive, native.tiled and
native.flash. The instruction set is chosen at run time: the best the CPU has,
or the one named by the environment variable ATTNKERN_ISA (generic, avx2,
avx512, avx512bf16, amx), read on every call so tests can force the portable fallback.

native.tiled and native.flash also take float16 and bfloat16 (ml_dtypes.bfloat16
on the host): float32 arithmetic inside, the output and lse in the input's dtype.
On avx512bf16, bfloat16 flash runs both matmuls as vdpbf16ps dot products, on amx
(AMX-TILE and AMX-BF16, where the OS grants the tile data) on AMX tiles; every
other combination widens blocks to float32 as it packs them (docs/half-precision.md).

native.flash has the features of docs/features.md, forward (every dtype) and backward:
the core's Features become the keywords of _attn.forward, forward_half and backward."""

from __future__ import annotations

import contextlib
import os

import numpy as np

from ..._registry import (ALL_FEATURES, Features, Kernel, Param, nonfinite_input, nonfinite_output,
                          num_threads_param, register)

try:
    from . import _attn
except ImportError as exc:  # pragma: no cover - a broken build
    import sys

    _attn = None
    _IMPORT_ERROR = f"the compiled extension failed to import: {exc}"
    if "partially initialized module" in str(exc):  # Python's words for a submodule it cannot find
        _IMPORT_ERROR += (f" (that is: no _attn extension importable by this Python, {sys.implementation.cache_tag}; "
                          "build it for this interpreter: make setup, or pip install .)")
else:
    _IMPORT_ERROR = None


def active_isa() -> str:
    """The instruction set the native kernels use now."""
    if _attn is None:
        raise RuntimeError(_IMPORT_ERROR)
    forced = os.environ.get("ATTNKERN_ISA", "").strip().lower()
    if not forced:
        return _attn.best_isa()
    if forced not in _attn.ISAS:
        raise ValueError(f"ATTNKERN_ISA={forced!r} is not one of: {', '.join(_attn.ISAS)}")
    if not _attn.isa_supported(forced):
        raise RuntimeError(f"ATTNKERN_ISA={forced!r}: not supported by this build or CPU: {_attn.isa_reason(forced)}")
    return forced


def supported_isas() -> tuple[str, ...]:
    """Instruction sets this build and CPU can run, portable first."""
    return tuple(i for i in _attn.ISAS if _attn.isa_supported(i)) if _attn else ()


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 1 << 62


def _check_workspace(algo, q, k, block_q, num_threads):
    """Refuse score buffers larger than the machine's memory: with overcommit the
    allocation would succeed and the process be killed when it touches them."""
    nk = k.shape[1] + 64  # rounded up to a vector multiple per block in C; 64 covers it
    if algo == "naive":
        need = q.shape[1] * nk * q.itemsize
    elif algo == "tiled":
        # half-precision inputs keep float32 scores
        need = min(num_threads, q.shape[0] * -(-q.shape[1] // block_q)) * block_q * nk * max(q.itemsize, 4)
    else:
        return
    if need > _physical_memory():
        raise MemoryError(
            f"native.{algo}: out of memory: its score buffer needs {need / 2**30:.1f} GiB, more than this "
            f"machine's {_physical_memory() / 2**30:.1f} GiB; use native.flash (no N x N buffer)"
        )


_HALF = ("float16", "bfloat16")  # computed in float32; passed to C as their uint16 bits
_FLOAT = ("float32", "float64")


def _keywords(features: Features | None) -> dict:
    """The features as the Cython entry points' keywords (none for a plain call);
    k/v rows shared by query rows need none: the C layer reads them from k's shape."""
    if features is None:
        return {}
    extra = {}
    if features.mask is not None:
        extra.update(mask=features.mask, mask_heads=features.mask_heads)
    if features.dropout_p > 0:
        extra.update(dropout_p=features.dropout_p, dropout_seed=features.dropout_seed,
                     dropout_i0=features.dropout_offset[0], dropout_j0=features.dropout_offset[1])
    if features.cu_seqlens_q is not None:
        extra.update(cu_seqlens_q=features.cu_seqlens_q, cu_seqlens_k=features.cu_seqlens_k)
    if features.alibi is not None:
        extra.update(alibi=features.alibi, alibi_seq_stride=features.alibi_seq_stride)
    return {"align": features.align, "window_left": features.window_left, "window_right": features.window_right,
            "seqlen_k": features.key_lengths, "softcap": features.softcap, **extra}


def _runner(algo: str):
    def run(q, k, v, causal, scale, block_q=1, block_k=1, num_threads=1, lse=None, check_finite=False,
            features=None):
        _check_workspace(algo, q, k, block_q, num_threads)
        out = np.empty((q.shape[0], q.shape[1], v.shape[2]), dtype=q.dtype)
        if q.itemsize == 2:  # float16 or bfloat16 (the core passes no other 2-byte dtype)
            bits = (x.view(np.uint16) for x in (q, k, v, out))
            bad = _attn.forward_half(algo, active_isa(), q.dtype.name, *bits, causal, scale, block_q, block_k,
                                     num_threads, None if lse is None else lse.view(np.uint16),
                                     check_finite=check_finite, **_keywords(features))
        else:
            bad = _attn.forward(algo, active_isa(), q, k, v, out, causal, scale, block_q, block_k, num_threads,
                                lse, check_finite=check_finite, **_keywords(features))
        if bad:  # the inputs first: a non-finite input makes the output so
            raise nonfinite_input(bad[0]) if bad[0] != "out" else nonfinite_output(f"native.{algo}", q.dtype)
        return out

    run.__name__ = f"native_{algo}"
    return run


def _flash_backward(q, k, v, out, dout, lse, causal, scale, block_q=1, block_k=1, num_threads=1, features=None):
    """The gradients (dq, dk, dv) of sum(out * dout), recomputing the scores block by
    block from the forward's lse: memory O(threads * block_k * block_q) plus partial dq
    buffers, never N x N. dk and dv have k's rows (fewer than q's under grouped-query
    attention). float32 and float64 natively; bfloat16 and float16 widened to float32
    (float32 accumulators; float32 products, but vdpbf16ps ones for bfloat16 on avx512bf16,
    P and dS rounded to bfloat16; the rows' lse recomputed in float32 where the given one
    is it rounded to the dtype), the gradients rounded to the inputs' dtype."""
    dq, dk, dv = np.empty_like(q), np.empty_like(k), np.empty_like(v)
    if q.itemsize == 2:  # float16 or bfloat16 (the core passes no other 2-byte dtype)
        bits = (x.view(np.uint16) for x in (q, k, v, out, dout))
        grads = (x.view(np.uint16) for x in (dq, dk, dv))
        _attn.backward_half(active_isa(), q.dtype.name, *bits, np.ascontiguousarray(lse, dtype=np.float32), *grads,
                            causal, scale, block_q, block_k, num_threads, **_keywords(features))
        return dq, dk, dv
    _attn.backward(active_isa(), q, k, v, out, dout, lse, dq, dk, dv, causal, scale, block_q, block_k,
                   num_threads, **_keywords(features))
    return dq, dk, dv


def _unavailable():
    return _IMPORT_ERROR


_OTHER_BUILDS: dict = {}


@contextlib.contextmanager
def other_build(path: str):
    """Within the block, native kernels run another build's compiled extension (the
    `_attn*.so` at path, e.g. a checkout of main's build folder), so that two builds
    can be timed in turns in one process (dev/cpu_decode_bandwidth.py --base-so). Not
    thread-safe: the whole module switches. The other build must take the same
    arguments as this one's Python layer passes."""
    import importlib.machinery
    import importlib.util

    global _attn
    if not os.path.isfile(path):
        raise FileNotFoundError(f"other_build: no compiled extension at {path!r} (give the path of another "
                                f"build's attnkern/backends/native/_attn*.so)")
    module = _OTHER_BUILDS.get(path)
    if module is None:  # loaded once a path: the block's own cost is two assignments
        name = "attnkern_other_build._attn"  # the last part names the extension's init function
        loader = importlib.machinery.ExtensionFileLoader(name, path)
        module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path, loader=loader))
        loader.exec_module(module)
        _OTHER_BUILDS[path] = module
    own, _attn = _attn, module
    try:
        yield module
    finally:
        _attn = own


def _team():
    """The OpenMP team size the last native kernel called from this thread ran on."""
    return (_attn.last_team() or None) if _attn else None


_MAX_BLOCK_Q = _attn.MAX_BLOCK_Q if _attn else 1024
_MAX_BLOCK_K = _attn.MAX_BLOCK_K if _attn else 4096
_THREADS = num_threads_param(_attn.MAX_THREADS if _attn else 256)


def _blocks(block_q: int, block_k: int) -> tuple[Param, ...]:
    return (
        Param("block_q", block_q, 1, _MAX_BLOCK_Q, "query rows per task"),
        Param("block_k", block_k, 1, _MAX_BLOCK_K, "keys per streamed K/V block"),
    )


register(
    Kernel(
        name="native.naive",
        description="C/SIMD: the full N x N score matrix of each head, row softmax, rows over OpenMP threads",
        run=_runner("naive"),
        params=(_THREADS,),
        unavailable_reason=_unavailable,
        returns_lse=True,
        checks_finite=True,
        threads_used=_team,
    )
)
register(
    Kernel(
        name="native.tiled",
        description="C/SIMD: packed K/V blocks and register-tiled matmuls; exact softmax over a block_q x N score strip",
        run=_runner("tiled"),
        params=(*_blocks(256, 256), _THREADS),
        unavailable_reason=_unavailable,
        returns_lse=True,
        checks_finite=True,
        threads_used=_team,
        dtypes=(*_FLOAT, *_HALF),
    )
)
register(
    Kernel(
        name="native.flash",
        description="C/SIMD: online softmax over streamed K/V blocks (FlashAttention-2 order), no N x N buffer",
        run=_runner("flash"),
        params=(*_blocks(256, 256), _THREADS),
        unavailable_reason=_unavailable,
        returns_lse=True,
        checks_finite=True,
        threads_used=_team,
        backward=_flash_backward,
        backward_dtypes=(*_FLOAT, *_HALF),
        dtypes=(*_FLOAT, *_HALF),
        features=ALL_FEATURES,
    )
)
