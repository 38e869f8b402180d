"""C-contiguous NumPy inputs are used in place (docs/api.md, "Copies"): each
kernel gets the caller's buffers, the native kernels' C entry points get them
too, no copy of an input is allocated on the way, and the inputs are only read
(read-only arrays work and come back unchanged). Inputs that are not
C-contiguous are copied once, and the same checks see that copy, so they can
fail."""

import dataclasses
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

import attnkern
from attnkern import _registry
from attnkern.backends.native import _attn
from conftest import AVAILABLE, NATIVE, assert_matches_reference, random_qkv


def address(x) -> int:
    return x.__array_interface__["data"][0]


def recorded_calls(monkeypatch, name) -> list:
    """The (q, k, v) each call of kernel `name`'s run receives, from now on in this test."""
    calls = []
    kernel = _registry.get(name)

    def run(q, k, v, *args, **kwargs):
        calls.append((q, k, v))
        return kernel.run(q, k, v, *args, **kwargs)

    monkeypatch.setitem(_registry._KERNELS, name, dataclasses.replace(kernel, run=run))
    return calls


@pytest.mark.parametrize("kernel", AVAILABLE)
@pytest.mark.parametrize("lead", [(), (3,), (2, 3)])
def test_c_contiguous_inputs_reach_the_kernel_in_place(kernel, lead, monkeypatch):
    q, k, v = random_qkv(len(lead), lead, 9, 11, 8, 4, np.float32)
    calls = recorded_calls(monkeypatch, kernel)
    out = attnkern.attention(q, k, v, kernel=kernel)
    assert_matches_reference(out, q, k, v)
    [received] = calls
    for got, x in zip(received, (q, k, v)):
        assert address(got) == address(x) and got.nbytes == x.nbytes
    # not C-contiguous: copied once before the kernel (a Fortran-ordered k, a strided v)
    kf, vs = np.asfortranarray(k), np.repeat(v, 2, axis=-2)[..., ::2, :]
    attnkern.attention(q, kf, vs, kernel=kernel)
    got_q, got_k, got_v = calls[1]
    assert address(got_q) == address(q)
    assert not np.shares_memory(got_k, kf) and not np.shares_memory(got_v, vs)
    assert got_k.flags.c_contiguous and got_v.flags.c_contiguous


def takes(kernels, dtypes):
    """(kernel, dtype) for each dtype each kernel takes."""
    return [pytest.param(k, d, id=f"{k}-{np.dtype(d).name}") for k in kernels for d in dtypes
            if np.dtype(d).name in attnkern.kernel_info(k)["dtypes"]]


@pytest.mark.parametrize("kernel, dtype", takes(NATIVE, [np.float32, np.float64, np.float16, ml_dtypes.bfloat16]))
def test_native_entry_points_get_the_callers_buffers(kernel, dtype, monkeypatch):
    seen = []
    for name in ("forward", "forward_half"):
        real = getattr(_attn, name)

        def spy(*args, real=real, **kwargs):
            seen.append([a for a in args if isinstance(a, np.ndarray)])
            return real(*args, **kwargs)

        monkeypatch.setattr(_attn, name, spy)
    q, k, v = random_qkv(1, (2, 2), 17, 13, 8, 8, dtype)
    out = attnkern.attention(q, k, v, kernel=kernel)
    assert_matches_reference(out, q, k, v, kernel=kernel)
    [arrays] = seen
    assert [address(a) for a in arrays[:3]] == [address(x) for x in (q, k, v)]
    assert address(arrays[3]) == address(out)  # and the output it returns is the one C wrote


@pytest.mark.parametrize("kernel, dtype", takes(NATIVE, [np.float32, ml_dtypes.bfloat16]))
def test_native_kernels_allocate_no_copy_of_an_input(kernel, dtype):
    """tracemalloc sees NumPy's allocations (the kernels' C work buffers are not NumPy's):
    with K and V of 2 MiB or more and a small output, a copy of any input would show."""
    q, k, v = random_qkv(2, (1,), 4, 16384, 64, 64, dtype)
    attnkern.attention(q, k, v, kernel=kernel)  # first-call work (imports, thread pools) outside the window
    kf = np.asfortranarray(k)

    def allocated(*args):
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            out = attnkern.attention(*args, kernel=kernel)
            return tracemalloc.get_traced_memory()[1] - before, out
        finally:
            tracemalloc.stop()

    in_place, out = allocated(q, k, v)
    assert in_place < k.nbytes // 4, f"{in_place} bytes allocated for an output of {out.nbytes}"
    copied, _ = allocated(q, kf, v)  # the check sees a copy: k's, here
    assert copied >= k.nbytes


# torch.from_numpy warns that torch could write a read-only array; the torch kernels do not
@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
@pytest.mark.parametrize("kernel", AVAILABLE)
def test_read_only_inputs_are_read_and_left_unchanged(kernel):
    q, k, v = random_qkv(3, (2,), 12, 15, 8, 8, np.float32)
    before = [x.copy() for x in (q, k, v)]
    for x in (q, k, v):
        x.flags.writeable = False
    out = attnkern.attention(q, k, v, causal=True, kernel=kernel)
    assert_matches_reference(out, q, k, v, causal=True)
    assert all(np.array_equal(x, b) for x, b in zip((q, k, v), before))
