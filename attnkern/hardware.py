"""This machine as attnkern's measurements see it, for code outside the library
(attnkern_bench, tools): the CPUs this process may use and the CPU's name, torch's
thread count pinned for a block, and the native kernels' ceiling loops (the peak
FMA rate of an instruction set, STREAM-style bandwidth) and instruction sets."""

from __future__ import annotations

import contextlib

from ._registry import cpu_count
from ._tuned import cpu_model
from .backends import native as _native


def _attn():
    if _native._attn is None:
        raise RuntimeError(_native._IMPORT_ERROR)
    return _native._attn


@contextlib.contextmanager
def torch_threads(threads: int):
    """torch's process-wide intra-op thread count set to `threads` for the block,
    restored afterwards (how the torch.* kernels take num_threads)."""
    import torch

    from .backends.torch import _threads

    with _threads(torch, threads):
        yield


def fma_peak(isa: str, iterations: int, threads: int) -> tuple[float, float]:
    """(seconds, flops) of a register-only loop of fused multiply-adds in `isa` on
    `threads` threads: the instruction set's peak compute rate."""
    return _attn().fma_peak(isa, iterations, threads)


def stream(kind: str, a, b, c, threads: int) -> float:
    """Seconds of one STREAM-style pass ("copy": a = b; "triad": a = b + 3 c; "read": b
    summed, each thread's sum in a[thread]) over float32 arrays on `threads` threads: memory
    bandwidth (bytes: 8, 12 and 4 an element)."""
    return _attn().stream(kind, a, b, c, threads)


def isa_supported(isa: str) -> bool:
    """Whether this build and CPU run the native kernels in instruction set `isa`."""
    return _attn().isa_supported(isa)


def isa_reason(isa: str) -> str:
    """Why this build or CPU cannot run instruction set `isa`."""
    return _attn().isa_reason(isa)


__all__ = ["cpu_count", "cpu_model", "torch_threads", "fma_peak", "stream", "isa_supported", "isa_reason"]
