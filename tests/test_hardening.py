"""Processes and threads around the kernels: fork after the OpenMP pool has
started, many Python threads at once, Ctrl-C during a long call, and sizes no
machine could hold (the C entry points' own checks)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import attnkern
from attnkern.backends.native import _attn

NATIVE = ["native.naive", "native.tiled", "native.flash"]


def inputs(shape=(2, 3, 97, 32), seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape).astype(dtype) for _ in range(3))


def run_in_fork(child, timeout=60.0) -> int:
    """Fork; the child runs `child()` and exits with its return value (an
    exception exits 99). Returns the exit code, or fails if the child hangs or
    dies from a signal."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 99
        try:
            code = child()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if os.WIFSIGNALED(status):
                pytest.fail(f"the forked child was killed by signal {os.WTERMSIG(status)}")
            return os.WEXITSTATUS(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child hung for {timeout} s")


@pytest.mark.parametrize("kernel", NATIVE)
def test_forked_child_can_call_the_kernels(kernel):
    q, k, v = inputs()
    before = attnkern.attention(q, k, v, kernel=kernel, num_threads=2)  # the pool runs now

    def child():
        if not _attn.in_forked_child():
            return 2
        out = attnkern.attention(q, k, v, kernel=kernel, num_threads=2)
        return 0 if np.array_equal(out, before) else 3

    assert run_in_fork(child) == 0
    assert not _attn.in_forked_child()


def test_forked_child_numba_raises_instead_of_dying():
    assert attnkern.kernel_info("numba.flash")["available"], attnkern.kernel_info("numba.flash")["reason"]
    q, k, v = inputs((1, 2, 40, 16))
    before = attnkern.attention(q, k, v, kernel="numba.flash", num_threads=2)

    def child():
        try:
            out = attnkern.attention(q, k, v, kernel="numba.flash", num_threads=2)
        except RuntimeError as exc:  # Numba's omp layer cannot run here: a clear error
            return 0 if "forked" in str(exc) else 4
        return 0 if np.array_equal(out, before) else 3  # workqueue/tbb layers can

    assert run_in_fork(child) == 0


def test_many_python_threads_with_different_thread_counts():
    """Twelve calls from six Python threads at once, each kernel with 1-4 OpenMP
    threads: every result bit-identical to the same call made alone."""
    q, k, v = inputs()
    jobs = [(kernel, threads, causal) for kernel in NATIVE for threads in (1, 4) for causal in (False, True)]
    alone = {job: attnkern.attention(q, k, v, kernel=job[0], num_threads=job[1], causal=job[2]) for job in jobs}

    def call(job):
        kernel, threads, causal = job
        return attnkern.attention(q, k, v, kernel=kernel, num_threads=threads, causal=causal)

    with ThreadPoolExecutor(max_workers=6) as pool:
        for _ in range(3):
            for job, out in zip(jobs, pool.map(call, jobs)):
                assert np.array_equal(out, alone[job]), job


def test_ctrl_c_during_a_long_call_leaves_the_process_usable():
    """SIGINT while a kernel runs with the GIL released: the call finishes (the C
    code is not interrupted), KeyboardInterrupt is raised when it returns, and
    the next call works."""
    script = textwrap.dedent("""
        import os, signal, threading, numpy as np, attnkern
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((1, 8, 2048, 64)).astype(np.float32) for _ in range(3))
        small = tuple(x[:, :1, :128] for x in (q, k, v))
        expected = attnkern.attention(*small, kernel="native.flash")
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            attnkern.attention(q, k, v, kernel="native.naive", num_threads=2)
            print("finished before the signal")
        except KeyboardInterrupt:
            print("interrupted")
        out = attnkern.attention(*small, kernel="native.flash")
        print("usable" if np.array_equal(out, expected) else "WRONG")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-1] == "usable", proc.stdout + proc.stderr
    assert "interrupted" in proc.stdout or "finished before the signal" in proc.stdout


@pytest.mark.parametrize("algo", ["naive", "tiled", "flash"])
def test_sizes_beyond_64_bit_arithmetic_are_refused_in_c(algo):
    isa = attnkern.active_isa()
    assert _attn.check_problem(algo, isa, 1, 1024, 1024, 64, 64) == "ok"
    for batch, nq, nk, d, dv in [(1, 2**40, 2**40, 64, 64), (2**62, 2, 2, 64, 64), (1, 4, 4, 2**62, 1),
                                 (2**31, 2**31, 4, 2**10, 1), (1, 2**32, 2**32, 1, 1)]:
        assert _attn.check_problem(algo, isa, batch, nq, nk, d, dv) == "toobig", (batch, nq, nk, d, dv)
    for bad in [dict(block_q=0), dict(block_k=10**6), dict(num_threads=0), dict(num_threads=10**4),
                dict(scale=float("nan"))]:
        assert _attn.check_problem(algo, isa, 1, 8, 8, 4, 4, **bad) == "invalid", bad
    assert _attn.check_problem(algo, isa, 1, 8, 0, 4, 4) == "invalid"  # no keys
    with pytest.raises(ValueError, match="algo must be one of"):
        _attn.check_problem("fast", isa, 1, 8, 8, 4, 4)
    with pytest.raises(ValueError, match="isa must be one of"):
        _attn.check_problem(algo, "sse9", 1, 8, 8, 4, 4)


def test_score_buffer_beyond_memory_names_the_kernel_that_needs_none():
    q = np.zeros((1, 1, 1 << 21, 1), np.float32)  # 8 MiB each; an N x N buffer of 16 TiB
    with pytest.raises(MemoryError, match="native.flash"):
        attnkern.attention(q, q, q, kernel="native.naive", check_finite=False)


@pytest.mark.skipif("asan" in os.environ.get("LD_PRELOAD", ""),
                    reason="AddressSanitizer's quarantine holds freed blocks (up to 256 MiB), so the resident set "
                           "grows without a leak; the normal build runs this check")
def test_repeated_calls_do_not_grow_memory():
    """Every work buffer is freed on every path: 300 calls of each native kernel,
    the resident set grows by less than one call's buffers would leak."""
    def rss():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    q, k, v = inputs((1, 2, 300, 32))
    for kernel in NATIVE:
        attnkern.attention(q, k, v, kernel=kernel, num_threads=2)
    before = rss()
    for _ in range(300):
        for kernel in NATIVE:
            attnkern.attention(q, k, v, kernel=kernel, num_threads=2, causal=True)
    grown = rss() - before
    # a leaked naive score buffer alone is 300 x 304 x 4 bytes = 356 KiB a call, 100 MiB over 300 calls
    assert grown < 16 * 2**20, f"resident memory grew by {grown / 2**20:.1f} MiB over 900 calls"
