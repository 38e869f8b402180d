"""Machine ceilings measured in the same run as the kernels: a float32 matmul,
the dense operation attention's two matmuls cannot beat.

OpenBLAS (NumPy's BLAS) picks its kernel by CPU model when it loads. Where it does
not know the model it falls back to an older one: on the team's AMD EPYC (Zen 5,
AVX-512) NumPy's OpenBLAS 0.3.31 chose its Haswell (AVX2) kernel, 260 GFLOP/s on 2
threads, where its SkylakeX kernel ran 488 on the same cores; the ceiling was half
the machine's and native.flash read 170% of it. The kernel cannot be changed once
loaded (OPENBLAS_CORETYPE is read at load), so the matmul runs in a worker
process started with the stronger kernel, called once a turn over a pipe (a few
microseconds against a 35 ms matmul); the worker is used on every machine, as it also
keeps OpenBLAS's threads from spinning into the next kernel's turn."""

from __future__ import annotations

import os
import subprocess
import sys
import weakref
from typing import Callable

from .machine import blas_kernel
from .timing import CudaEventClock, medians, take_turns

# OpenBLAS kernels without AVX-512 (x86-64), which it also falls back to for CPUs it
# does not know; SkylakeX is its AVX-512 float32 kernel
_NO_AVX512 = {"Haswell", "Zen", "Sandybridge", "Nehalem", "Core2", "Penryn", "Dunnington", "Atom", "Prescott",
              "Barcelona", "Bulldozer", "Piledriver", "Steamroller", "Excavator", "Opteron", "Katmai"}

_WORKER = r"""
import sys
import numpy as np
from threadpoolctl import threadpool_info
n = int(sys.argv[1])
a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
a @ a
arch = next((p.get("architecture") or "" for p in threadpool_info() if p.get("user_api") == "blas"), "")
out, inp = sys.stdout.buffer, sys.stdin.buffer
out.write((arch + "\n").encode()); out.flush()
while inp.read(1) == b"c":
    a @ a
    out.write(b"d"); out.flush()
"""


def openblas_override() -> str | None:
    """The OpenBLAS kernel the ceiling's matmul should run instead of the one NumPy's
    OpenBLAS chose ("SkylakeX" where it chose one without AVX-512 on a CPU that has it;
    attnkern's own CPU check says which), or None: NumPy's choice stands. The
    environment variable ATTNKERN_SGEMM_CORETYPE sets it ("" for NumPy's choice)."""
    if "ATTNKERN_SGEMM_CORETYPE" in os.environ:
        return os.environ["ATTNKERN_SGEMM_CORETYPE"] or None
    import attnkern

    blas = blas_kernel()
    chosen = blas.split(" ")[-1] if blas.startswith("OpenBLAS") else ""
    return "SkylakeX" if chosen in _NO_AVX512 and "avx512" in attnkern.supported_isas() else None


class SgemmWorker:
    """A process doing NumPy float32 matmuls at n^3 on `threads` threads, with OpenBLAS
    forced to `coretype` where one is given; calling it does one and waits for it.
    `architecture` is the kernel the worker's BLAS reports (what ran, not what was asked)."""

    def __init__(self, coretype: str | None, threads: int, n: int = 2048):
        # OPENBLAS_THREAD_TIMEOUT: OpenBLAS's threads spin 2^28 cycles (a tenth of a second)
        # after each matmul by default, which slowed the next kernel's turn 3-5x (torch.sdpa
        # read 8.0 ms for 1.5 beside an idle worker); at 2^4 they sleep at once
        env = dict(os.environ, OPENBLAS_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
                   MKL_NUM_THREADS=str(threads), OPENBLAS_THREAD_TIMEOUT="4")
        if coretype:
            env["OPENBLAS_CORETYPE"] = coretype
        self._proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(n)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, env=env)
        weakref.finalize(self, SgemmWorker._stop, self._proc)
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the matmul worker (OPENBLAS_CORETYPE={coretype}) exited with {self._proc.wait()}")
        self.architecture = line.decode().strip()

    def __call__(self) -> None:
        self._proc.stdin.write(b"c")
        self._proc.stdin.flush()
        if self._proc.stdout.read(1) != b"d":
            raise RuntimeError(f"the matmul worker exited with {self._proc.wait()}")

    @staticmethod
    def _stop(proc) -> None:
        if proc.poll() is None:
            proc.stdin.close()
            proc.wait(timeout=10)


def sgemm_turn(n: int = 2048, threads: int | None = None) -> tuple[float, Callable[[], object], str]:
    """(flops, call, label): one NumPy float32 matmul at n^3 for timing in turns with the
    kernels (harness.run), in a SgemmWorker on `threads` threads (all cores if None): with
    the OpenBLAS kernel openblas_override() names, and with BLAS threads that sleep as soon
    as it is done (in this process, OpenBLAS's spinning threads slowed the kernel timed
    after the matmul 3-5x unless a pause came between them). The label says which BLAS
    kernel ran."""
    coretype = openblas_override()
    worker = SgemmWorker(coretype, threads or os.cpu_count() or 1, n)
    ran = f"OpenBLAS {worker.architecture}" if worker.architecture else "NumPy's BLAS"
    chose = f"; this process's OpenBLAS chose {blas_kernel().split(' ')[-1]}" if coretype else ""
    return 2.0 * n**3, worker, f"NumPy float32 matmul {n}^3 ({ran} in a worker process{chose})"


def sgemm_gflops(threads: int, n: int = 2048, repeat: int = 5) -> float:
    """Median GFLOP/s of NumPy's float32 matmul at n^3 on `threads` BLAS threads, in
    sgemm_turn's worker."""
    flops, call, _ = sgemm_turn(n, threads)
    seconds = medians(take_turns({"sgemm": call}, repeat=repeat))["sgemm"]
    return flops / seconds / 1e9


def cuda_sgemm_gflops(torch, n: int = 8192, repeat: int = 10, dtype=None) -> float:
    """Median GFLOP/s of torch's matmul at n^3 on the current GPU in dtype (a torch dtype; float32
    by default, TF32 as the caller set it)."""
    a = torch.randn(n, n, device="cuda", dtype=dtype or torch.float32)
    seconds = medians(take_turns({"sgemm": lambda: a @ a}, repeat=repeat, warmup=2,
                                 clock=CudaEventClock(torch)))["sgemm"]
    del a
    return 2.0 * n**3 / seconds / 1e9
