"""attnkern.attention: input validation and kernel dispatch, in one place."""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass

import numpy as np

from . import _registry, _tuned



def _half_dtypes() -> tuple[np.dtype, ...]:
    """float16, and bfloat16 where ml_dtypes (NumPy's bfloat16) is installed."""
    try:
        import ml_dtypes
    except ImportError:
        return (np.dtype(np.float16),)
    return (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), *_half_dtypes())
_DTYPE_NAMES = "float32, float64, float16 and bfloat16 (ml_dtypes.bfloat16 or torch.bfloat16)"


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
    if type(x).__module__.startswith("torch") and getattr(x, "is_cuda", False):  # read directly: cheaper
        return _gpu().from_torch(x, name)
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
            raise TypeError(f"{n} has dtype {x.dtype}; attnkern supports {_DTYPE_NAMES} (convert with .astype)")
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
    # GPU inputs are scanned after the kernel, with its output, in one pass (run)
    if check_finite and not device:
        _check_host_inputs(q, k, v)
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


def _check_host_inputs(q, k, v):
    if not _all_finite(False, q, k, v):  # one scan; then find the culprit
        for x, n in ((q, "q"), (k, "k"), (v, "v")):
            if not _all_finite(False, x):
                raise _registry.nonfinite_input(n)


def _all_finite(device: bool, *arrays) -> bool:
    if device:
        return _gpu().all_finite(*arrays)
    return all(np.isfinite(x).all() for x in arrays)


def _auto(device: bool = False, dtype: str = "float32", return_lse: bool = False,
          backward: bool = False) -> _registry.Kernel:
    """The kernel for kernel="auto": on the CPU the first available of
    native.flash, torch.sdpa, numpy.naive (fastest first; docs/results.md);
    GPU arrays go to cuda.flash. NumPy arrays stay on the CPU even where a GPU
    is present: ask for a cuda.* kernel to send them there. The first that takes
    the dtype and has what the call needs (the lse, a backward) wins; if none
    does, the first available (choose() then says why)."""
    def fits(k):
        return (dtype in k.dtypes and (k.returns_lse or not return_lse)
                and (k.backward is not None or not backward))

    if device:  # cuda.flash, else triton.flash for a dtype cuda.flash does not take
        gpu = [k for k in map(_registry.get, ("cuda.flash", "triton.flash"))]
        return next((k for k in gpu if fits(k) and k.unavailable_reason() is None), gpu[0])
    available = [k for k in map(_registry.get, ("native.flash", "torch.sdpa", "numpy.naive"))
                 if k.unavailable_reason() is None]
    if not available:  # pragma: no cover - numpy.naive always is
        raise RuntimeError("no attention kernel is available")
    return next((k for k in available if fits(k)), available[0])


def attention(q, k, v, *, causal=False, scale=None, kernel="auto", check_finite=True, return_lse=False,
              **params):
    """softmax(q k^T * scale) v.

    q (..., Nq, D), k (..., Nk, D), v (..., Nk, Dv) with the same 0 to 2 leading
    dimensions, of one dtype the kernel takes (float32 and float64 everywhere;
    float16/bfloat16 where kernel_info(name)["dtypes"] lists them); returns
    (..., Nq, Dv) in that dtype.
    GPU arrays (anything with __cuda_array_interface__: torch CUDA tensors, CuPy
    arrays, Numba device arrays) run on the cuda.* kernels in place, and the
    output is a GPU array of q's kind; the cuda.* kernels also take NumPy
    arrays, which they copy to the GPU and back.
    scale defaults to 1/sqrt(D); causal=True lets query i see keys j <= i (top-left
    aligned, as torch's is_causal). kernel is a name from attnkern.kernels() or
    "auto"; params are the kernel's tunables (attnkern.kernel_info(name)).

    torch tensors in give a torch tensor out, on their device (CPU tensors without a
    copy where they are C-contiguous); if any requires grad, the result is
    differentiable through the kernel's backward (kernel_info(name)["backward"]).

    return_lse=True returns (out, lse): lse (..., Nq), in out's dtype and kind of
    array, is each query row's natural-log log-sum-exp of its scaled, masked scores
    (kernel_info(name)["returns_lse"] says which kernels give it).

    Inputs that are not C-contiguous NumPy arrays (views, lists) are copied once;
    C-contiguous arrays are used in place. With check_finite, inputs with NaN/inf
    raise ValueError and a non-finite result (scores overflowing the dtype) raises
    FloatingPointError.
    """
    if _is_torch(q) or _is_torch(k) or _is_torch(v):
        if getattr(q, "is_cuda", False):  # device-resident tensors: a prepared launch per call shape
            fast = _torch_gpu_fast()
            result = None if fast is None else fast(q, k, v, causal, scale, kernel, check_finite, return_lse, params)
            if result is not None:
                return result
        from . import _torch_api

        return _torch_api.attention(q, k, v, causal=causal, scale=scale, kernel=kernel, check_finite=check_finite,
                                    return_lse=return_lse, **params)
    call = validate(q, k, v, causal=causal, scale=scale, check_finite=False)  # run checks, as the kernel lets it
    chosen, resolved = choose(call, kernel, params, return_lse=return_lse)
    return run(call, chosen, resolved, check_finite=check_finite, return_lse=return_lse)


_TORCH_GPU_FAST = []  # backends.cuda.torch_attention, or None without numba-cuda; found on first use


def _torch_gpu_fast():
    if not _TORCH_GPU_FAST:
        from .backends import cuda

        _TORCH_GPU_FAST.append(cuda.torch_attention if cuda._cuda_unavailable() is None else None)
    return _TORCH_GPU_FAST[0]


def attention_backward(q, k, v, out, dout, lse, *, causal=False, scale=None, kernel="auto", **params):
    """(dq, dk, dv) of attention(q, k, v, ...) given the output's gradient dout:
    out and lse are what attention(..., return_lse=True) returned for the same
    arguments. out and lse may also be those of whole rows of which k, v hold one
    block of keys (ring attention): the result is then that block's share of the
    gradients (dq a partial sum over blocks, dk and dv exact for this block).
    NumPy arrays or torch tensors (CPU or CUDA), in the kernel's dtypes; the kernel
    must have a backward (kernel_info(name)["backward"])."""
    args = (q, k, v, out, dout, lse)
    if any(_is_torch(x) for x in args):
        from . import _torch_api

        return _torch_api.attention_backward(*args, causal=causal, scale=scale, kernel=kernel, **params)
    call = validate(q, k, v, causal=causal, scale=scale, check_finite=False)
    if call.device:
        raise TypeError("attention_backward takes NumPy arrays or torch tensors; pass GPU arrays as torch tensors")
    chosen, resolved = choose(call, kernel, params, return_lse=True, backward=True)
    (batch, nq, d), nk, dv = call.q.shape, call.k.shape[1], call.v.shape[2]
    lead = call.out_shape[:-2]
    out, dout, lse = (check_like(x, name, shape, call.q.dtype)
                      for x, name, shape in ((out, "out", call.out_shape), (dout, "dout", call.out_shape),
                                             (lse, "lse", call.out_shape[:-1])))
    if batch * nq * nk == 0:
        grads = tuple(np.zeros_like(x) for x in (call.q, call.k, call.v))
    else:
        grads = chosen.backward(call.q, call.k, call.v, out.reshape(batch, nq, dv), dout.reshape(batch, nq, dv),
                                lse.reshape(batch, nq), call.causal, call.scale, **resolved)
    return tuple(g.reshape(*lead, *x.shape[1:]) for g, x in zip(grads, (call.q, call.k, call.v)))


def check_like(x, name: str, shape: tuple, dtype) -> np.ndarray:
    """x as a C-contiguous NumPy array of the shape and dtype a call implies, or a
    ValueError/TypeError naming it."""
    x = _as_array(x, name)
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} is a GPU array and the inputs are host arrays")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {tuple(shape)} for these q, k, v")
    if x.dtype != dtype:
        raise TypeError(f"{name} has dtype {x.dtype}; expected {dtype}, the dtype of q, k, v")
    return np.ascontiguousarray(x)


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "requires_grad")


def choose(call: Call, kernel, params: dict, *, return_lse: bool = False, backward: bool = False):
    """The kernel for a validated call and its resolved tunables; raises if it cannot
    run here, cannot take the call's arrays or lacks what is asked of it."""
    dtype = call.q.dtype.name
    chosen = _auto(call.device, dtype, return_lse, backward) if kernel == "auto" else _registry.get(kernel)
    if call.device and chosen.device != "cuda":
        raise TypeError(
            f"{chosen.name} runs on the CPU and q, k, v are GPU arrays: use kernel='auto' or a cuda.* kernel, "
            "or copy the arrays to the host"
        )
    reason = chosen.unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"kernel {chosen.name} is not available here: {reason}")
    if dtype not in chosen.dtypes:
        takes = ", ".join(_registry.with_feature(dtype)) or "none"
        raise TypeError(f"{chosen.name} does not take {dtype} inputs (it takes {', '.join(chosen.dtypes)}); "
                        f"kernels that take {dtype}: {takes}; or convert the inputs with .astype")
    if return_lse and not chosen.returns_lse:
        raise ValueError(f"{chosen.name} cannot return the log-sum-exp; kernels that can: "
                         f"{', '.join(_registry.with_feature('returns_lse'))}")
    if backward and chosen.backward is None:
        raise ValueError(f"{chosen.name} has no backward pass, and an input requires grad; differentiable "
                         f"kernels: {', '.join(_registry.with_feature('backward'))} (or call it under "
                         "torch.no_grad(), or detach the inputs)")
    return chosen, _with_tuned(call, chosen, params)


def _with_tuned(call: Call, chosen: _registry.Kernel, params: dict) -> dict:
    """The kernel's tunables: those given, else a cached tuned result for this machine
    and problem (attnkern.tune), else the built-in defaults."""
    resolved = chosen.resolve_params(params)
    if not chosen.params or call.empty or len(params) == len(chosen.params):
        return resolved
    hit = _tuned_lookup(chosen.name, chosen.device, call.q.dtype, call.causal, call.q.shape[1], call.k.shape[1],
                        call.q.shape[2], call.v.shape[2], call.device)
    if hit is None:
        return resolved
    tuned = {name: value for name, value in hit[0].items() if name not in params}
    try:
        return chosen.resolve_params({**tuned, **params})
    except (TypeError, ValueError) as exc:  # a result for another build or machine: not ours to use
        warnings.warn(f"ignoring the tuned parameters {hit[1]!r}: {exc}", RuntimeWarning, stacklevel=4)
        return resolved


_GPU_TUNED: dict = {}  # GPU calls: (lookup's arguments) -> (when looked up, its result)


def _tuned_lookup(*args):
    """_tuned.lookup(*args[:-1]); for GPU calls (args[-1]), whose whole launch costs tens of
    microseconds, the answer is kept for a second rather than the cache file checked every call."""
    if not args[-1]:
        return _tuned.lookup(*args[:-1])
    now = time.monotonic()
    memo = _GPU_TUNED.get(args)
    if memo is None or now - memo[0] > 1.0:
        if len(_GPU_TUNED) > 1024:
            _GPU_TUNED.clear()
        memo = _GPU_TUNED[args] = (now, _tuned.lookup(*args[:-1]))
    return memo[1]


def run(call: Call, chosen: _registry.Kernel, resolved: dict, *, check_finite: bool, return_lse: bool):
    """Runs the chosen kernel on a validated call: out, or (out, lse) with return_lse.
    With check_finite, non-finite inputs raise ValueError and a non-finite output
    FloatingPointError: host arrays are scanned here unless the kernel checks them
    itself (chosen.checks_finite), GPU arrays after the kernel."""
    batch, nq, dv = call.q.shape[0], call.q.shape[1], call.v.shape[2]
    lse_shape = call.out_shape[:-1]
    extra = {}
    in_kernel = check_finite and chosen.checks_finite and not call.device and not call.empty
    if check_finite and not call.device and not in_kernel:
        _check_host_inputs(call.q, call.k, call.v)
    if in_kernel:
        extra["check_finite"] = True
    if call.device:  # outputs are allocated here, as the caller's kind of GPU array
        out, returned = _gpu().empty_like_kind(call.out_shape, call.q.dtype, call.like)
        if return_lse:
            lse, lse_returned = _gpu().empty_like_kind(lse_shape, call.q.dtype, call.like)
            extra["lse"] = lse.reshape(batch, nq)
        if not call.empty:
            chosen.run(call.q, call.k, call.v, call.causal, call.scale, out=out.reshape(batch, nq, dv),
                       **extra, **resolved)
    else:
        if return_lse:
            lse = lse_returned = np.empty(lse_shape, call.q.dtype)
            extra["lse"] = lse.reshape(batch, nq)
        if call.empty:
            out = returned = np.zeros(call.out_shape, call.q.dtype)
        else:
            out = returned = chosen.run(call.q, call.k, call.v, call.causal, call.scale, **extra,
                                        **resolved).reshape(call.out_shape)
    if call.empty and return_lse and math.prod(lse_shape):  # Dv = 0: no output, but the scores exist
        from .backends.numpy import softmax_attention

        host = np.empty((batch, nq), call.q.dtype)
        q, k = (_gpu().to_host(x) if call.device else x for x in (call.q, call.k))
        softmax_attention(q, k, np.zeros((batch, k.shape[1], 0), q.dtype), call.causal, call.scale, lse=host)
        if call.device:
            extra["lse"].view().copy_to_device(host)
        else:
            extra["lse"][...] = host
    if check_finite and call.device:  # inputs and output in one scan, one wait
        bad = _gpu().nonfinite(call.q, call.k, call.v, *([] if call.empty else [out]))
        for n, flag in zip("qkv", bad):
            if flag:
                raise _registry.nonfinite_input(n)
        overflow = bad[3:] == [True]
    else:
        overflow = check_finite and not in_kernel and not call.empty and not _all_finite(call.device, out)
    if overflow:
        raise _registry.nonfinite_output(chosen.name, call.q.dtype)
    return (returned, lse_returned) if return_lse else returned
