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


def start_fork(child) -> int:
    """Fork; the child runs `child()` and exits with its return value (an exception
    exits 99). Returns the child's pid."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 99
        try:
            code = child()
        finally:
            os._exit(code)
    return pid


def run_in_fork(child, timeout=60.0) -> int:
    """start_fork, then the exit code, or a failure if the child hangs or dies from
    a signal."""
    pid = start_fork(child)
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
def test_forked_child_runs_the_kernels_on_the_requested_threads(kernel):
    """A child forked after the parent's pool ran gets a fresh pool: its calls run on the
    threads asked for (read back from the kernel's OpenMP teams), bit-identical to the
    parent's, and the parent keeps its threads after the fork."""
    q, k, v = inputs()
    before = attnkern.attention(q, k, v, kernel=kernel, num_threads=2)  # the pool runs now
    assert attnkern.threads_used(kernel) == 2

    def child():
        if _attn.fork_state() != "fresh_pool":
            return 2
        out = attnkern.attention(q, k, v, kernel=kernel, num_threads=2)
        if attnkern.threads_used(kernel) != 2:
            return 4
        return 0 if np.array_equal(out, before) else 3

    assert run_in_fork(child) == 0
    assert _attn.fork_state() == "none"
    assert np.array_equal(attnkern.attention(q, k, v, kernel=kernel, num_threads=2), before)
    assert attnkern.threads_used(kernel) == 2


FORK_SCRIPT = textwrap.dedent("""
    import os, sys, numpy as np, attnkern
    kernel, warm = sys.argv[1], sys.argv[2] == "warm"
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, 97, 32)).astype(np.float32) for _ in range(3))
    call = lambda: attnkern.attention(q, k, v, kernel=kernel, num_threads=2, causal=True)
    if warm:
        call()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        out = call()
        os.write(w, out.tobytes() + bytes([attnkern.threads_used(kernel)]))
        os._exit(0)
    os.close(w)
    got = b""
    while chunk := os.read(r, 1 << 16):
        got += chunk
    os.waitpid(pid, 0)
    out = call()
    assert got[:-1] == out.tobytes(), "the child's result differs from the parent's"
    assert got[-1] == 2, f"the child ran on {got[-1]} threads, not 2"
    assert attnkern.threads_used(kernel) == 2, "the parent lost its threads"
    print("ok")
""")


@pytest.mark.parametrize("warm", ["cold", "warm"])
def test_fork_before_and_after_the_first_call(warm):
    """In a fresh interpreter: fork before any kernel ran (cold) and after (warm); the
    child runs native.flash on 2 threads, bit-identical to the parent's call after it."""
    proc = subprocess.run([sys.executable, "-c", FORK_SCRIPT, "native.flash", warm], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def _pool_task(args):
    kernel, seed = args
    q, k, v = inputs(seed=seed)
    out = attnkern.attention(q, k, v, kernel=kernel, num_threads=2)
    return out, attnkern.threads_used(kernel)


def test_multiprocessing_pool_with_fork():
    """multiprocessing.Pool with the fork start method, the parent warm: every worker
    runs on 2 threads and returns the parent's bits."""
    import multiprocessing

    jobs = [(kernel, seed) for kernel in NATIVE for seed in (0, 1)]
    expected = [_pool_task(job)[0] for job in jobs]
    with multiprocessing.get_context("fork").Pool(2) as pool:
        results = pool.map_async(_pool_task, jobs).get(timeout=120)
    for job, want, (out, threads) in zip(jobs, expected, results):
        assert threads == 2, job
        assert np.array_equal(out, want), job


def test_fork_while_another_thread_is_inside_a_kernel():
    """One Python thread calls native.flash in a loop (the GIL released inside) while
    the main thread forks five times: each fork waits for the running kernel to finish,
    each child computes on 2 threads, and the looping thread's results never change."""
    import threading

    big = inputs((1, 4, 1024, 64), seed=3)
    want_big = attnkern.attention(*big, kernel="native.flash", num_threads=2)
    q, k, v = inputs()
    want = attnkern.attention(q, k, v, kernel="native.flash", num_threads=2)
    stop, wrong = threading.Event(), []

    def loop():
        while not stop.is_set():
            if not np.array_equal(attnkern.attention(*big, kernel="native.flash", num_threads=2), want_big):
                wrong.append(1)

    def child():
        out = attnkern.attention(q, k, v, kernel="native.flash", num_threads=2)
        return 0 if np.array_equal(out, want) and attnkern.threads_used("native.flash") == 2 else 3

    worker = threading.Thread(target=loop)
    worker.start()
    try:
        for _ in range(5):
            time.sleep(0.01)
            assert run_in_fork(child) == 0
    finally:
        stop.set()
        worker.join()
    assert not wrong


def test_a_child_of_a_child_keeps_its_threads():
    q, k, v = inputs()
    want = attnkern.attention(q, k, v, kernel="native.tiled", num_threads=2)

    def grandchild():
        out = attnkern.attention(q, k, v, kernel="native.tiled", num_threads=2)
        return 0 if np.array_equal(out, want) and attnkern.threads_used("native.tiled") == 2 else 3

    def child():
        attnkern.attention(q, k, v, kernel="native.tiled", num_threads=2)  # the child's own pool runs
        _, status = os.waitpid(start_fork(grandchild), 0)
        return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 5

    assert run_in_fork(child) == 0


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
