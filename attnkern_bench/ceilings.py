"""Machine ceilings measured in the same run as the kernels: a float32 matmul,
the dense operation attention's two matmuls cannot beat."""

from __future__ import annotations

from typing import Callable

import numpy as np

from .machine import blas_threads
from .timing import CudaEventClock, medians, take_turns


def sgemm_turn(n: int = 2048) -> tuple[float, Callable[[], object]]:
    """(flops, call): one NumPy float32 matmul at n^3, with the BLAS threads the caller
    pins; for timing in turns with the kernels (harness.run)."""
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    return 2.0 * n**3, lambda: a @ a


def sgemm_gflops(threads: int, n: int = 2048, repeat: int = 5) -> float:
    """Median GFLOP/s of NumPy's float32 matmul at n^3 with `threads` BLAS threads."""
    flops, call = sgemm_turn(n)
    with blas_threads(threads):
        seconds = medians(take_turns({"sgemm": call}, repeat=repeat))["sgemm"]
    return flops / seconds / 1e9


def cuda_sgemm_gflops(torch, n: int = 8192, repeat: int = 10) -> float:
    """Median GFLOP/s of torch's float32 matmul at n^3 on the current GPU (TF32 as
    the caller set it)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.float32)
    seconds = medians(take_turns({"sgemm": lambda: a @ a}, repeat=repeat, warmup=2,
                                 clock=CudaEventClock(torch)))["sgemm"]
    del a
    return 2.0 * n**3 / seconds / 1e9
