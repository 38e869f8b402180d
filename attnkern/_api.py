"""attnkern.attention: input validation and kernel dispatch, in one place."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import _registry

_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


@dataclass(frozen=True)
class Call:
    """A validated call: q, k, v as C-contiguous (batch, n, d) arrays, NumPy
    arrays on the host or backends.cuda.arrays.GpuArray on the GPU (device=True);
    like is the caller's q, whose kind of array the output takes."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    causal: bool
    scale: float
    out_shape: tuple[int, ...]
    device: bool = False
    like: object = None

    @property
    def empty(self) -> bool:
        return math.prod(self.out_shape) == 0


def _gpu():
    """attnkern's GPU array helpers; they need numba-cuda."""
    try:
        from .backends.cuda import arrays
    except ImportError as exc:
        raise TypeError(
            f"GPU arrays need numba-cuda, which failed to import ({exc}): pip install 'attnkern[cuda]', "
            "or copy the arrays to the host"
        ) from None
    return arrays


def _as_array(x, name: str):
    """A NumPy array, or for GPU arrays a GpuArray view of them."""
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("numba.cuda.simulator"):  # the tests' GPU: no interface
        return _gpu().as_device_array(x, name, None)
    try:  # read once: torch computes the interface on every access
        desc = x.__cuda_array_interface__
    except AttributeError:  # a host object (CPU torch tensors raise this too)
        desc = None
    except Exception as exc:  # e.g. a CUDA tensor that requires grad
        raise TypeError(f"{name} is a GPU array whose __cuda_array_interface__ failed: {exc}") from None
    if desc is not None:
        return _gpu().as_device_array(x, name, desc)
    try:
        arr = np.asarray(x)
    except Exception as exc:  # e.g. a torch tensor that requires grad
        raise TypeError(f"{name} cannot be converted to a NumPy array: {exc}") from None
    if arr.dtype == object:
        raise TypeError(f"{name} must be an array of numbers, got {type(x).__name__} of objects (ragged?)")
    return arr


def validate(q, k, v, *, causal, scale, check_finite) -> Call:
    """Checks shapes, dtypes and values; raises TypeError/ValueError saying what to fix."""
    like = q
    q, k, v = (_as_array(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    on_gpu = [not isinstance(x, np.ndarray) for x in (q, k, v)]
    if any(on_gpu) and not all(on_gpu):
        where = ", ".join(f"{n} on the {'GPU' if g else 'host'}" for n, g in zip("qkv", on_gpu))
        raise TypeError(f"q, k, v must all be host (NumPy) arrays or all GPU arrays, got {where}")
    device = all(on_gpu)
    for x, n in ((q, "q"), (k, "k"), (v, "v")):
        if x.dtype not in _DTYPES:
            raise TypeError(f"{n} has dtype {x.dtype}; attnkern supports float32 and float64 (convert with .astype)")
        if not 2 <= x.ndim <= 4:
            raise ValueError(
                f"{n} has {x.ndim} dimension(s), shape {x.shape}; expected 2 to 4: (N, D), (H, N, D) or (B, H, N, D)"
            )
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:
        raise ValueError(
            f"q, k, v must have the same leading (batch, head) dimensions, got shapes {q.shape}, {k.shape}, {v.shape}"
        )
    (nq, d), (nk, dk), (nv, dv) = q.shape[-2:], k.shape[-2:], v.shape[-2:]
    if d != dk:
        raise ValueError(f"q and k must have the same feature size D, got q {q.shape} and k {k.shape}")
    if nk != nv:
        raise ValueError(f"k and v must have the same sequence length, got k {k.shape} and v {v.shape}")
    if d == 0:
        raise ValueError("the feature size D of q and k is 0; attention needs D >= 1")
    if nk == 0:
        raise ValueError("k and v have no keys (sequence length 0): softmax over nothing is undefined")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be True or False, got {causal!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    elif not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale!r}")
    if device:
        for x, n in ((q, "q"), (k, "k"), (v, "v")):
            if not x.is_c_contiguous():
                raise ValueError(
                    f"{n} is a GPU array that is not C-contiguous (strides {x.strides}); GPU inputs are used in "
                    "place, never copied: pass a contiguous one (torch: .contiguous(), CuPy: cupy.ascontiguousarray)"
                )
    if check_finite and not _all_finite(device, q, k, v):  # one scan; then find the culprit
        for x, n in ((q, "q"), (k, "k"), (v, "v")):
            if not _all_finite(device, x):
                raise ValueError(f"{n} contains NaN or infinity; pass finite values (or check_finite=False)")
    lead = q.shape[:-2]
    batch = math.prod(lead)
    contiguous = (lambda x: x) if device else np.ascontiguousarray
    return Call(
        q=contiguous(q).reshape(batch, nq, d),
        k=contiguous(k).reshape(batch, nk, d),
        v=contiguous(v).reshape(batch, nk, dv),
        causal=bool(causal),
        scale=float(scale),
        out_shape=(*lead, nq, dv),
        device=device,
        like=like,
    )


def _all_finite(device: bool, *arrays) -> bool:
    if device:
        return _gpu().all_finite(*arrays)
    return all(np.isfinite(x).all() for x in arrays)


def _auto(device: bool = False) -> _registry.Kernel:
    """The kernel for kernel="auto": on the CPU the first available of
    native.flash, torch.sdpa, numpy.naive (fastest first; docs/results.md);
    GPU arrays go to cuda.flash. NumPy arrays stay on the CPU even where a GPU
    is present: ask for a cuda.* kernel to send them there."""
    if device:
        return _registry.get("cuda.flash")
    for name in ("native.flash", "torch.sdpa", "numpy.naive"):
        kernel = _registry.get(name)
        if kernel.unavailable_reason() is None:
            return kernel
    raise RuntimeError("no attention kernel is available")  # pragma: no cover - numpy.naive always is


def attention(q, k, v, *, causal=False, scale=None, kernel="auto", check_finite=True, **params) -> np.ndarray:
    """softmax(q k^T * scale) v.

    q (..., Nq, D), k (..., Nk, D), v (..., Nk, Dv) with the same 0 to 2 leading
    dimensions, float32 or float64 (one dtype); returns (..., Nq, Dv) in that dtype.
    GPU arrays (anything with __cuda_array_interface__: torch CUDA tensors, CuPy
    arrays, Numba device arrays) run on the cuda.* kernels in place, and the
    output is a GPU array of q's kind; the cuda.* kernels also take NumPy
    arrays, which they copy to the GPU and back.
    scale defaults to 1/sqrt(D); causal=True lets query i see keys j <= i (top-left
    aligned, as torch's is_causal). kernel is a name from attnkern.kernels() or
    "auto"; params are the kernel's tunables (attnkern.kernel_info(name)).

    Inputs that are not C-contiguous NumPy arrays (views, lists, CPU tensors) are
    copied once; C-contiguous arrays are used in place. With check_finite, inputs
    with NaN/inf raise ValueError and a non-finite result (scores overflowing the
    dtype) raises FloatingPointError.
    """
    call = validate(q, k, v, causal=causal, scale=scale, check_finite=check_finite)
    chosen = _auto(call.device) if kernel == "auto" else _registry.get(kernel)
    if call.device and chosen.device != "cuda":
        raise TypeError(
            f"{chosen.name} runs on the CPU and q, k, v are GPU arrays: use kernel='auto' or a cuda.* kernel, "
            "or copy the arrays to the host"
        )
    reason = chosen.unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"kernel {chosen.name} is not available here: {reason}")
    resolved = chosen.resolve_params(params)
    if call.device:  # the output is allocated here, as the caller's kind of GPU array
        out, returned = _gpu().empty_like_kind(call.out_shape, call.q.dtype, call.like)
        if not call.empty:
            chosen.run(call.q, call.k, call.v, call.causal, call.scale,
                       out=out.reshape(call.q.shape[0], call.q.shape[1], call.v.shape[2]), **resolved)
    elif call.empty:
        out = returned = np.zeros(call.out_shape, call.q.dtype)
    else:
        out = returned = chosen.run(call.q, call.k, call.v, call.causal, call.scale, **resolved).reshape(call.out_shape)
    if check_finite and not call.empty and not _all_finite(call.device, out):
        raise FloatingPointError(
            f"{chosen.name} produced non-finite values: q k^T * scale overflows {call.q.dtype}; "
            "scale the inputs down or use float64"
        )
    return returned

