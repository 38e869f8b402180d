"""Copies of NumPy arrays to the GPU and back through page-locked (pinned) host
memory, for the cuda.* kernels called on NumPy arrays.

A copy from pageable memory (an ordinary NumPy array) is synchronous: the driver
copies it piecewise through a small pinned buffer of its own, and the host waits
for each piece. Here each GPU keeps one pinned host buffer and one device buffer
(`Staging`), grown when a call needs more and reused by later calls. A call lays
its inputs and outputs out in them (256-byte aligned), copies each input into the
pinned buffer and issues its host-to-device copy asynchronously on the legacy
default stream (where the kernels run) before copying the next input: the DMA of
q runs while the host copies k into the pinned buffer, and so on. The kernel is
queued behind the copies; the outputs come back with asynchronous device-to-host
copies into the pinned buffer, one wait, then a copy into new NumPy arrays that
the caller owns. A call needing more than KEEP_BYTES copies from pageable memory
as before; the kept buffers are freed at exit (or by release()).

One lock per GPU serialises the calls that use its buffers (from the first copy to
the last read of the outputs), so threads calling at once never share them.

The driver side (allocations, asynchronous copies, the wait) is an object with five
methods (`CudaDriver` on a GPU); tests/test_staging.py runs the layout, reuse,
growth and ordering with a recording fake in NumPy memory."""

from __future__ import annotations

import atexit
import contextlib
import threading

import numpy as np

ALIGN = 256  # bytes: every array starts at a multiple (the kernels' vector loads need 16)
# buffers up to 64 MiB each are kept between calls; a call that needs more copies from
# pageable memory (cuda.flash's _staged: allocating pinned memory per call costs more
# than it saves), or, through Staging.call, gets buffers freed after it. Above that size
# the host's copies into and out of the pinned buffer cost what the faster DMA saves:
# on an H200 host (`attnkern transfer`) a call moving 16 MiB ran 1.28x faster staged, one
# moving 256 MiB 0.93x as fast, so large calls take the pageable copies
KEEP_BYTES = 64 << 20
STAGING = True  # False: the pageable copies (cuda.to_device, copy_to_host), for comparison (attnkern transfer)


def round_up(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


def layout(nbytes: list[int]) -> tuple[list[int], int]:
    """(offsets, total): arrays of these sizes one after another, each 256-byte aligned."""
    offsets, total = [], 0
    for n in nbytes:
        offsets.append(total)
        total += round_up(n)
    return offsets, total


class CudaDriver:
    """Pinned and device allocations through Numba (its context owns them), copies
    through cuda.bindings on the legacy default stream, the wait of launch._wait."""

    def alloc_host(self, nbytes: int) -> np.ndarray:
        from numba import cuda

        return cuda.pinned_array(nbytes, np.uint8)

    def alloc_device(self, nbytes: int):
        from numba import cuda

        return cuda.device_array(nbytes, np.uint8)

    def device_ptr(self, buf) -> int:
        return buf.device_ctypes_pointer.value

    def h2d_async(self, dst: int, src: int, nbytes: int) -> None:
        from .launch import _check, _driver

        cu, stream = _driver()
        _check(cu.cuMemcpyHtoDAsync(dst, src, nbytes, stream)[0], "cuMemcpyHtoDAsync")

    def d2h_async(self, dst: int, src: int, nbytes: int) -> None:
        from .launch import _check, _driver

        cu, stream = _driver()
        _check(cu.cuMemcpyDtoHAsync(dst, src, nbytes, stream)[0], "cuMemcpyDtoHAsync")

    def wait(self) -> None:
        from .launch import _wait

        _wait()


class Staging:
    """One GPU's pinned host buffer and device buffer, reused by calls on NumPy arrays."""

    def __init__(self, driver):
        self.driver = driver
        self.lock = threading.Lock()
        self.host = self.device = None
        self.capacity = 0  # bytes of each kept buffer
        self.allocations = 0  # how many times buffers were allocated (kept or temporary)

    def _buffers(self, total: int):
        """(host, device) of at least `total` bytes: the kept ones, grown (to at least
        twice their size, so a growing series of calls allocates a few times) when too
        small, or temporaries for a call above KEEP_BYTES."""
        if self.host is not None and total <= self.capacity:
            return self.host, self.device
        self.allocations += 1
        if total > KEEP_BYTES:
            return self.driver.alloc_host(total), self.driver.alloc_device(total)
        size = min(KEEP_BYTES, max(total, 2 * self.capacity, 1 << 20))
        self.host = self.device = None  # the old ones go before the new ones are made
        self.host, self.device = self.driver.alloc_host(size), self.driver.alloc_device(size)
        self.capacity = size
        return self.host, self.device

    def release(self) -> None:
        with self.lock:
            self.host = self.device = None
            self.capacity = 0

    @contextlib.contextmanager
    def call(self, inputs: list[np.ndarray], outputs: list[tuple[tuple, np.dtype]]):
        """Stages C-contiguous NumPy `inputs` on the GPU and yields (device inputs,
        device outputs, results): GpuArrays of the inputs' and the outputs' (shape,
        dtype) specs, and a list that is filled, after the block (whose kernels are
        queued on the legacy default stream), with the outputs as new NumPy arrays."""
        from ..._gpuarray import GpuArray

        outputs = [(tuple(shape), np.dtype(dtype)) for shape, dtype in outputs]
        sizes = [x.nbytes for x in inputs] + [int(np.prod(s, dtype=np.int64)) * d.itemsize for s, d in outputs]
        offsets, total = layout(sizes)
        results: list[np.ndarray] = []
        with self.lock:
            host, device = self._buffers(total)
            base = self.driver.device_ptr(device)
            hbase = host.ctypes.data
            dev_in = []
            for x, off in zip(inputs, offsets):
                # the host copy of this input runs while the previous inputs' DMA does
                np.copyto(host[off:off + x.nbytes].view(x.dtype).reshape(x.shape), x)
                if x.nbytes:
                    self.driver.h2d_async(base + off, hbase + off, x.nbytes)
                dev_in.append(GpuArray(x.shape, x.dtype, None, ptr=base + off, owner=device))
            out_offsets = offsets[len(inputs):]
            dev_out = [GpuArray(s, d, None, ptr=base + off, owner=device)
                       for (s, d), off in zip(outputs, out_offsets)]
            try:
                yield dev_in, dev_out, results
            except BaseException:
                self.driver.wait()  # no copy may still read the buffers when the next call writes them
                raise
            for (s, d), off, n in zip(outputs, out_offsets, sizes[len(inputs):]):
                if n:
                    self.driver.d2h_async(hbase + off, base + off, n)
            self.driver.wait()
            for (s, d), off, n in zip(outputs, out_offsets, sizes[len(inputs):]):
                results.append(host[off:off + n].view(d).reshape(s).copy())


_STAGING: dict[int, Staging] = {}
_STAGING_LOCK = threading.Lock()


def for_current_device(driver=None) -> Staging:
    """The current GPU's Staging (made on first use)."""
    from numba import cuda

    device = cuda.get_current_device().id
    with _STAGING_LOCK:
        if device not in _STAGING:
            _STAGING[device] = Staging(driver or CudaDriver())
        return _STAGING[device]


def staged_bytes(inputs: list[np.ndarray], outputs: list[tuple]) -> int:
    """The bytes of buffer a call with these inputs and (shape, dtype) outputs takes."""
    return layout([x.nbytes for x in inputs] + [int(np.prod(s, dtype=np.int64)) * np.dtype(d).itemsize
                                                for s, d in outputs])[1]


def enabled(nbytes: int = 0) -> bool:
    """Whether a call of nbytes (staged_bytes) stages through pinned memory here:
    not in Numba's simulator (no pinned memory or device addresses), nor above
    KEEP_BYTES."""
    from numba import config

    return STAGING and not config.ENABLE_CUDASIM and nbytes <= KEEP_BYTES


def release() -> None:
    """Frees every GPU's kept buffers (also at exit, before Numba tears its contexts down)."""
    with _STAGING_LOCK:
        for staging in _STAGING.values():
            staging.release()


atexit.register(release)
