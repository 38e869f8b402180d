"""What machine this is, and pinning every runtime's threads to one count."""

from __future__ import annotations

import contextlib


def cpu_name() -> str:
    """The CPU's model name, as attnkern records it (attnkern.machine())."""
    import attnkern

    return attnkern.machine()["cpu"]


@contextlib.contextmanager
def blas_threads(threads: int):
    """Limits NumPy's BLAS (and other native thread pools threadpoolctl knows) to
    `threads` for the block."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        raise SystemExit("pinning BLAS threads needs threadpoolctl: pip install 'attnkern[bench]'") from None
    with threadpool_limits(limits=threads):
        yield


def blas_kernel() -> str:
    """The BLAS NumPy's matmul runs and the CPU kernel it chose, e.g. "OpenBLAS 0.3.31
    SkylakeX" (threadpoolctl's report; "" where it has none). OpenBLAS picks its kernel by
    CPU model: on one of the team's AMD EPYC VMs it ran its Haswell (AVX2) kernel on
    AVX-512 cores at half their matmul speed, so a %matmul above 100% there was the
    ceiling's shortfall, not the kernel's feat."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return ""
    for pool in threadpool_info():
        if pool.get("user_api") == "blas":
            name = {"openblas": "OpenBLAS", "mkl": "MKL", "blis": "BLIS"}.get(pool.get("internal_api"),
                                                                             pool.get("internal_api", ""))
            return " ".join(str(x) for x in (name, pool.get("version"), pool.get("architecture")) if x)
    return ""


def thread_params(kernel: str, threads: int) -> dict:
    """{num_threads: threads} for a kernel that takes it, else {}."""
    import attnkern

    return {"num_threads": threads} if "num_threads" in attnkern.kernel_info(kernel)["params"] else {}
