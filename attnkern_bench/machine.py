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


def thread_params(kernel: str, threads: int) -> dict:
    """{num_threads: threads} for a kernel that takes it, else {}."""
    import attnkern

    return {"num_threads": threads} if "num_threads" in attnkern.kernel_info(kernel)["params"] else {}
