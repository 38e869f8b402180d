"""Pinned-memory staging of NumPy inputs for the cuda.* kernels
(attnkern/backends/cuda/staging.py): the layout, reuse and growth of the per-GPU
buffers, the order of copies and kernels, errors and threads, with a fake driver
whose "device" is NumPy memory and whose stream runs queued work at the wait;
on a GPU (ATTNKERN_TEST_GPU=1) the real thing against the pageable copies."""

import ctypes
import os
import threading

import numpy as np
import pytest

from attnkern.backends.cuda import staging
from conftest import random_qkv

SIMULATED = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def at(ptr: int, nbytes: int) -> np.ndarray:
    """nbytes of memory at an address, as a uint8 array."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr)) if nbytes else np.empty(0, np.uint8)


class FakeDriver:
    """Host and "device" buffers in NumPy memory; copies and kernels are queued in
    order (one stream) and run at wait(), as a GPU runs them after the host queued them."""

    def __init__(self):
        self.log, self.queue, self.keep = [], [], []

    def alloc_host(self, n):
        self.log.append(("alloc_host", n))
        return np.zeros(n, np.uint8)

    def alloc_device(self, n):
        self.log.append(("alloc_device", n))
        buf = np.zeros(n, np.uint8)
        self.keep.append(buf)
        return buf

    def device_ptr(self, buf):
        return buf.ctypes.data

    def h2d_async(self, dst, src, n):
        self.log.append(("h2d", n))
        self.queue.append(lambda: at(dst, n).__setitem__(slice(None), at(src, n)))

    def d2h_async(self, dst, src, n):
        self.log.append(("d2h", n))
        self.queue.append(lambda: at(dst, n).__setitem__(slice(None), at(src, n)))

    def kernel(self, fn):
        self.log.append(("kernel",))
        self.queue.append(fn)

    def wait(self):
        self.log.append(("wait",))
        for work in self.queue:
            work()
        self.queue.clear()


def device_view(a):
    """A GpuArray of the fake device as a NumPy array."""
    return at(a.ptr, a.size * a.dtype.itemsize).view(a.dtype).reshape(a.shape)


def fma_call(st, driver, q, k, v):
    """out = q * k + v and s = the row sums of out, as a "kernel" on the fake device."""
    with st.call([q, k, v], [(q.shape, q.dtype), (q.shape[:-1], q.dtype)]) as (dev_in, dev_out, results):
        def kernel():
            out = device_view(dev_out[0])
            out[...] = device_view(dev_in[0]) * device_view(dev_in[1]) + device_view(dev_in[2])
            device_view(dev_out[1])[...] = out.sum(-1)
        driver.kernel(kernel)
    return results


def inputs(seed, shape=(2, 33, 20), dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(3)]


def test_results_through_the_buffers():
    driver = FakeDriver()
    st = staging.Staging(driver)
    q, k, v = inputs(0)
    out, s = fma_call(st, driver, q, k, v)
    np.testing.assert_array_equal(out, q * k + v)
    np.testing.assert_array_equal(s, (q * k + v).sum(-1))
    # the results are the caller's own arrays, not views of the pinned buffer
    assert out.base is None and s.base is None
    # copies in, the kernel, copies out, then one wait
    kinds = [e[0] for e in driver.log if not e[0].startswith("alloc")]
    assert kinds == ["h2d"] * 3 + ["kernel", "d2h", "d2h", "wait"]


def test_each_input_is_copied_to_pinned_memory_after_the_previous_ones_dma_is_issued():
    """The host copies k into the pinned buffer only after q's copy to the GPU is queued
    (so the DMA of q and the host's copy of k overlap)."""
    driver = FakeDriver()
    st = staging.Staging(driver)
    q, k, v = inputs(1)
    seen = []
    real = driver.h2d_async

    def noting(dst, src, n):
        host = st.host
        offsets, _ = staging.layout([x.nbytes for x in (q, k, v)])
        seen.append([bool(host[o:o + x.nbytes].any()) for o, x in zip(offsets, (q, k, v))])
        real(dst, src, n)

    driver.h2d_async = noting
    fma_call(st, driver, q, k, v)
    assert seen == [[True, False, False], [True, True, False], [True, True, True]]


def test_layout_is_aligned_and_buffers_are_reused_then_grown():
    driver = FakeDriver()
    st = staging.Staging(driver)
    offsets, total = staging.layout([1, 300, 0, 256, 17])
    assert offsets == [0, 256, 768, 768, 1024] and total == 1280
    for _ in range(3):
        fma_call(st, driver, *inputs(2))
    assert st.allocations == 1 and st.capacity == 1 << 20  # at least 1 MiB, kept
    big = inputs(3, shape=(4, 300, 256))  # 3 x 1.2 MB in, 1.2 MB out: grows
    out, _ = fma_call(st, driver, *big)
    np.testing.assert_array_equal(out, big[0] * big[1] + big[2])
    assert st.allocations == 2 and st.capacity >= 2 << 20
    capacity = st.capacity
    fma_call(st, driver, *inputs(4))  # smaller again: the grown buffers serve
    assert st.allocations == 2 and st.capacity == capacity
    st.release()
    assert st.host is None and st.device is None and st.capacity == 0


def test_calls_above_the_keep_limit_use_temporaries(monkeypatch):
    monkeypatch.setattr(staging, "KEEP_BYTES", 1 << 16)
    driver = FakeDriver()
    st = staging.Staging(driver)
    fma_call(st, driver, *inputs(5, shape=(1, 4, 4)))
    assert st.capacity == 1 << 16
    q, k, v = inputs(6, shape=(2, 100, 100))  # 80 KB an array: above the limit
    out, _ = fma_call(st, driver, q, k, v)
    np.testing.assert_array_equal(out, q * k + v)
    assert st.capacity == 1 << 16 and st.allocations == 2  # a temporary pair; the kept ones unchanged


def test_an_error_waits_for_queued_copies_and_frees_the_lock():
    driver = FakeDriver()
    st = staging.Staging(driver)
    with pytest.raises(RuntimeError, match="kernel failed"):
        with st.call(inputs(7), [((2, 33, 20), np.float32)]):
            raise RuntimeError("kernel failed")
    assert driver.log[-1] == ("wait",) and not driver.queue
    assert not st.lock.locked()


def test_threads_take_turns():
    driver = FakeDriver()
    st = staging.Staging(driver)
    errors = []

    def worker(seed):
        q, k, v = inputs(seed)
        for _ in range(20):
            out, _ = fma_call(st, driver, q, k, v)
            if not np.array_equal(out, q * k + v):
                errors.append(seed)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_empty_arrays_copy_nothing():
    driver = FakeDriver()
    st = staging.Staging(driver)
    q = np.zeros((1, 0, 8), np.float32)
    with st.call([q, q, q], [((1, 0, 8), np.float32)]) as (_, dev_out, results):
        pass
    assert results[0].shape == (1, 0, 8)
    assert not [e for e in driver.log if e[0] in ("h2d", "d2h")]


@pytest.mark.skipif(SIMULATED, reason="pinned memory needs a GPU")
@pytest.mark.parametrize("kernel", ["cuda.flash", "cuda.naive"])
def test_staged_calls_match_pageable_ones_bit_for_bit(kernel, monkeypatch):
    """On a GPU: NumPy inputs through the pinned buffers give the pageable copies'
    bits, forward (with lse) and backward, over growing sizes (the buffers grow) and
    back; both against float64."""
    import attnkern
    from conftest import assert_lse_matches_reference, assert_matches_reference

    staging.release()
    for n in (17, 300, 1500, 40):
        q, k, v = random_qkv(np.random.default_rng(n), (3,), n, n + 5, 64, 64, np.float32)
        kw = dict(kernel=kernel, causal=True)
        if kernel == "cuda.flash":
            kw["return_lse"] = True
        staged = attnkern.attention(q, k, v, **kw)
        monkeypatch.setattr(staging, "STAGING", False)
        pageable = attnkern.attention(q, k, v, **kw)
        monkeypatch.setattr(staging, "STAGING", True)
        for a, b in zip(staged if isinstance(staged, tuple) else (staged,),
                        pageable if isinstance(pageable, tuple) else (pageable,)):
            assert np.array_equal(a, b)
        out = staged[0] if isinstance(staged, tuple) else staged
        assert_matches_reference(out, q, k, v, causal=True)
        if kernel == "cuda.flash":
            assert_lse_matches_reference(staged[1], q, k, causal=True)
            dout = np.random.default_rng(1).standard_normal(out.shape).astype(np.float32)
            grads = attnkern.attention_backward(q, k, v, out, dout, staged[1], causal=True, kernel=kernel)
            monkeypatch.setattr(staging, "STAGING", False)
            again = attnkern.attention_backward(q, k, v, out, dout, staged[1], causal=True, kernel=kernel)
            monkeypatch.setattr(staging, "STAGING", True)
            for a, b in zip(grads, again):
                assert np.array_equal(a, b)
    assert staging.for_current_device().capacity > 0


@pytest.mark.skipif(not SIMULATED, reason="what the simulator refuses")
def test_transfer_command_needs_a_gpu(capsys):
    from attnkern_bench import cli

    assert cli.main(["transfer", "--device", "cuda"]) == 2
    assert "simulator" in capsys.readouterr().err
    assert not staging.enabled()  # the simulator never stages
