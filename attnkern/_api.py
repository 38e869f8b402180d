"""The core: attention()'s validation (validate), kernel choice (choose) and run
(run), in one place, for every kind of array. Below it, the frontends turn the
caller's arrays into what kernels take and back (NumPy arrays are the core's
own; _torch_api: torch tensors; _gpu: GPU arrays; _torch_cuda: the fast path
for torch CUDA tensors), then the backends (the kernels), then the registry,
whose entries say what each kernel supports: choose() reads that and, where a
kernel refuses a call, says why for every kernel."""

from __future__ import annotations

import ast
import inspect
import math
import time
import warnings
from dataclasses import dataclass

import numpy as np

from . import _gpu, _registry, _torch_api, _torch_cuda, _torch_ops, _tuned


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
    # grouped k/v, alignment, window, key lengths, softcap (_registry.Features); k and v
    # have q's batch / features.kv_group rows, and kv_shape is k's shape as given
    features: _registry.Features = _registry.PLAIN
    kv_shape: tuple[int, ...] = ()

    @property
    def needs(self) -> frozenset[str]:
        """The features (_registry.FEATURES) the call needs of a kernel."""
        return self.features.needs()

    def feature_args(self) -> dict:
        """What a kernel's run and backward take for the features: {features: ...}
        where the call has any, else nothing (kernels without features never see it)."""
        return {"features": self.features} if self.needs else {}

    @property
    def empty(self) -> bool:
        return math.prod(self.out_shape) == 0


def _as_array(x, name: str):
    """A NumPy array, or for GPU arrays a GpuArray view of them."""
    if isinstance(x, np.ndarray):
        return x
    gpu = _gpu.as_array(x, name)
    if gpu is not None:
        return gpu
    try:
        arr = np.asarray(x)
    except Exception as exc:  # e.g. a torch tensor that requires grad
        raise TypeError(f"{name} cannot be converted to a NumPy array: {exc}") from None
    if arr.dtype == object:
        raise TypeError(f"{name} must be an array of numbers, got {type(x).__name__} of objects (ragged?)")
    return arr


_ALIGNS = ("top_left", "bottom_right")


def validate(q, k, v, *, causal, scale, check_finite, window=None, key_lengths=None, softcap=None) -> Call:
    """Checks shapes, dtypes, values and the features; raises TypeError/ValueError
    saying what to fix."""
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
    group = _kv_group(q.shape, k.shape, v.shape)
    (nq, d), (nk, dk), (nv, dv) = q.shape[-2:], k.shape[-2:], v.shape[-2:]
    if d != dk:
        raise ValueError(f"q and k must have the same feature size D, got q {q.shape} and k {k.shape}")
    if nk != nv:
        raise ValueError(f"k and v must have the same sequence length, got k {k.shape} and v {v.shape}")
    if d == 0:
        raise ValueError("the feature size D of q and k is 0; attention needs D >= 1")
    if nk == 0:
        raise ValueError("k and v have no keys (sequence length 0): softmax over nothing is undefined")
    causal, align = _causal(causal)
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be a real number or None, got {scale!r}")
    elif not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale!r}")
    features = _features(q.shape, nk, group, causal, align, float(scale), window, key_lengths, softcap)
    if device:
        for x, n in ((q, "q"), (k, "k"), (v, "v")):
            if not x.is_c_contiguous():
                raise ValueError(
                    f"{n} is a GPU array that is not C-contiguous (strides {x.strides}); GPU inputs are used in "
                    "place, never copied: pass a contiguous one (torch: .contiguous(), CuPy: cupy.ascontiguousarray)"
                )
    lead = q.shape[:-2]
    batch = math.prod(lead)
    contiguous = (lambda x: x) if device else np.ascontiguousarray
    call = Call(
        q=contiguous(q).reshape(batch, nq, d),
        k=contiguous(k).reshape(batch // group, nk, d),
        v=contiguous(v).reshape(batch // group, nk, dv),
        causal=causal,
        scale=float(scale),
        out_shape=(*lead, nq, dv),
        device=device,
        like=like,
        features=features,
        kv_shape=tuple(k.shape),
    )
    if check_finite and not device:  # GPU inputs are scanned after the kernel, with its output (run)
        _check_host_inputs(call.q, call.k, call.v, features.key_lengths)
    return call


def _kv_group(q_shape, k_shape, v_shape) -> int:
    """How many query heads share each k/v head: 1, or H / H_kv for grouped-query
    attention, where k and v have H_kv heads (the dimension before (N, D)) and q
    has H, a multiple; the batch dimension, where there is one, must match."""
    if not k_shape[:-2] == v_shape[:-2]:
        raise ValueError(f"k and v must have the same leading (batch, head) dimensions, got shapes {k_shape}, "
                         f"{v_shape}")
    if len(q_shape) != len(k_shape) or q_shape[:-3] != k_shape[:-3]:
        raise ValueError(f"q, k, v must have the same leading (batch, head) dimensions (k and v may have fewer "
                         f"heads than q: grouped-query attention), got shapes {q_shape}, {k_shape}, {v_shape}")
    if len(q_shape) == 2 or q_shape[-3] == k_shape[-3]:
        return 1
    heads, kv_heads = q_shape[-3], k_shape[-3]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"q has {heads} heads and k, v have {kv_heads}: for grouped-query attention the query "
                         f"heads H must be a multiple of the k/v heads H_kv (each k/v head serves H / H_kv "
                         f"consecutive query heads), got shapes {q_shape}, {k_shape}, {v_shape}")
    return heads // kv_heads


def _causal(causal) -> tuple[bool, str]:
    """(whether there is a causal mask, where its diagonal lies): True is top-left,
    as torch's is_causal."""
    if isinstance(causal, (bool, np.bool_)):
        return bool(causal), "top_left"
    if isinstance(causal, str):
        if causal not in _ALIGNS:
            raise ValueError(f"causal must be False, True (= 'top_left', torch's is_causal) or 'bottom_right' "
                             f"(FlashAttention's, for a KV cache: the last query sees the last key), got {causal!r}")
        return True, causal
    raise TypeError(f"causal must be False, True, 'top_left' or 'bottom_right', got {causal!r}")


def _window_side(value, side: str, bound: int) -> int:
    """A window side as attn_problem takes it: -1 for None (unbounded), else the
    number of keys, at most bound (a side that long masks nothing)."""
    if value is None:
        return -1
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"window's {side} side must be a whole number of keys or None (unbounded), got {value!r}")
    if value < 0:
        raise ValueError(f"window's {side} side must be >= 0 keys, or None for unbounded (FlashAttention's -1), "
                         f"got {value}")
    return int(min(value, bound))


def _key_lengths(key_lengths, q_shape, nk: int) -> np.ndarray:
    """key_lengths as int64, one per sequence: B of (B, H, N, D) inputs, else 1."""
    if type(key_lengths).__module__.startswith("torch") and hasattr(key_lengths, "cpu"):
        key_lengths = key_lengths.detach().cpu().numpy()
    lengths = np.asarray(key_lengths)
    if lengths.size == 0 and lengths.dtype.kind == "f":  # [] is float64 to NumPy
        lengths = lengths.astype(np.int64)
    sequences = q_shape[0] if len(q_shape) == 4 else 1
    if lengths.dtype.kind not in "iu":
        raise TypeError(f"key_lengths must hold integers (one key count per sequence), got dtype {lengths.dtype}")
    if lengths.shape != (sequences,):
        raise ValueError(f"key_lengths must have one length per sequence: shape ({sequences},) for q of shape "
                         f"{tuple(q_shape)}, got shape {lengths.shape}")
    if lengths.size and not (lengths.min() >= 0 and lengths.max() <= nk):
        raise ValueError(f"key_lengths must lie in [0, {nk}] (Nk, the keys there are), got "
                         f"{lengths.min()}..{lengths.max()}")
    return np.ascontiguousarray(lengths, np.int64)


def _features(q_shape, nk: int, group: int, causal: bool, align: str, scale: float, window, key_lengths,
              softcap) -> _registry.Features:
    """The call's features, checked and in the kernels' form (_registry.Features).
    Forms that mask the same keys as a plainer call take its form, so that more
    kernels run them: bottom-right is top-left where Nq = Nk and no key lengths are
    given, and causal already bounds the window's right side."""
    nq = q_shape[-2]
    left = right = -1
    if window is not None:
        if isinstance(window, (str, bytes)) or not hasattr(window, "__len__") or len(window) != 2:
            raise TypeError(f"window must be a pair (left, right) of key counts, each None for unbounded, e.g. "
                            f"(4095, 0); got {window!r}")
        left, right = (_window_side(x, side, nq + nk) for x, side in zip(window, ("left", "right")))
        if causal and right > 0:
            raise ValueError(f"a causal mask already sets the window's right side to 0; got window={tuple(window)}: "
                             "pass (left, 0) or (left, None), or causal=False for a two-sided window")
        if causal:
            right = -1
    lengths = None if key_lengths is None else _key_lengths(key_lengths, q_shape, nk)
    cap = 0.0
    if softcap is not None:
        if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, (int, float, np.integer, np.floating)):
            raise TypeError(f"softcap must be a positive real number or None, got {softcap!r}")
        if not (math.isfinite(softcap) and softcap > 0):
            raise ValueError(f"softcap must be a positive finite number (None for no cap, FlashAttention's 0.0), "
                             f"got {softcap!r}")
        if not math.isfinite(scale / softcap):
            raise ValueError(f"scale / softcap overflows (scale {scale!r}, softcap {softcap!r}); pass a larger "
                             "softcap")
        cap = float(softcap)
    if (nq == nk and lengths is None) or not (causal or left >= 0 or right >= 0):
        align = "top_left"  # the same mask either way
    return _registry.Features(kv_group=group, align=align, window_left=left, window_right=right,
                              key_lengths=lengths, softcap=cap)


def _check_host_inputs(q, k, v, key_lengths=None):
    """nonfinite_input for the first of q, k, v with NaN or infinity; with key
    lengths, the keys past each sequence's length are not read (padding)."""
    if key_lengths is not None and len(key_lengths) and int(key_lengths.min()) < k.shape[1]:
        seqs = _registry.Features(key_lengths=key_lengths).sequences(q.shape[0], k.shape[0], k.shape[1])
        keys = [(k[kv_rows, :n], v[kv_rows, :n]) for _, kv_rows, n in seqs]
        if not _all_finite(False, q):
            raise _registry.nonfinite_input("q")
        for i, name in enumerate("kv"):
            if not all(_all_finite(False, pair[i]) for pair in keys):
                raise _registry.nonfinite_input(name)
        return
    if not _all_finite(False, q, k, v):  # one scan; then find the culprit
        for x, n in ((q, "q"), (k, "k"), (v, "v")):
            if not _all_finite(False, x):
                raise _registry.nonfinite_input(n)


def _all_finite(device: bool, *arrays) -> bool:
    if device:
        return _gpu.all_finite(*arrays)
    return all(np.isfinite(x).all() for x in arrays)


def _auto(device: bool = False, dtype: str = "float32", return_lse: bool = False,
          backward: bool = False, features: frozenset[str] = frozenset()) -> _registry.Kernel:
    """The kernel for kernel="auto": on the CPU the first available of
    native.flash, torch.sdpa, numpy.naive (fastest first; docs/results.md);
    GPU arrays go to cuda.flash. NumPy arrays stay on the CPU even where a GPU
    is present: ask for a cuda.* kernel to send them there. The first that takes
    the dtype and has what the call needs (the lse, a backward, the features)
    wins; if none does, the first available (choose() then says why)."""
    def fits(k):
        return not k.not_supported_reasons(dtype=dtype, return_lse=return_lse, backward=backward,
                                           features=features)

    if device:  # cuda.flash, else triton.flash for a dtype cuda.flash does not take
        gpu = [k for k in map(_registry.get, ("cuda.flash", "triton.flash"))]
        return next((k for k in gpu if fits(k)), gpu[0])
    available = [k for k in map(_registry.get, ("native.flash", "torch.sdpa", "numpy.naive"))
                 if k.unavailable_reason() is None]
    if not available:  # pragma: no cover - numpy.naive always is
        raise RuntimeError("no attention kernel is available")
    return next((k for k in available if fits(k)), available[0])


def attention(q, k, v, *, causal=False, scale=None, kernel="auto", window=None, key_lengths=None, softcap=None,
              check_finite=True, return_lse=False, **params):
    """softmax(q k^T * scale) v.

    q (..., Nq, D), k (..., Nk, D), v (..., Nk, Dv) with the same 0 to 2 leading
    dimensions, of one dtype the kernel takes (float32 and float64 everywhere;
    float16/bfloat16 where kernel_info(name)["dtypes"] lists them); returns
    (..., Nq, Dv) in that dtype. k and v may have fewer heads than q, H_kv
    dividing H (grouped-query attention: query head h reads k/v head
    h // (H / H_kv)), without a copy.
    GPU arrays (anything with __cuda_array_interface__: torch CUDA tensors, CuPy
    arrays, Numba device arrays) run on the cuda.* kernels in place, and the
    output is a GPU array of q's kind; the cuda.* kernels also take NumPy
    arrays, which they copy to the GPU and back.
    scale defaults to 1/sqrt(D); causal=True (or "top_left") lets query i see keys
    j <= i (top-left aligned, as torch's is_causal); causal="bottom_right" keys
    j <= i + Nk - Nq (FlashAttention's: the last query sees the last key, as a KV
    cache needs). window=(left, right) lets query i see only keys within left
    before and right after its diagonal (None: unbounded; causal sets right to 0).
    key_lengths (one integer per sequence: B for (B, H, N, D) inputs) hides keys
    j >= its length (right-padded batches). softcap c replaces each score s by
    c * tanh(s / c). A row that sees no key gets 0 and lse -inf.
    kernel_info(name)["features"] says which kernels take which (docs/features.md).
    kernel is a name from attnkern.kernels() or "auto"; params are the kernel's
    tunables (attnkern.kernel_info(name)).

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
    feats = {"window": window, "key_lengths": key_lengths, "softcap": softcap}
    if _is_torch(q) or _is_torch(k) or _is_torch(v):
        return _torch_attention(q, k, v, causal, scale, kernel, check_finite, return_lse, feats, params)
    call = validate(q, k, v, causal=causal, scale=scale, check_finite=False, **feats)  # run checks as the kernel lets
    chosen, resolved = choose(call, kernel, params, return_lse=return_lse)
    return run(call, chosen, resolved, check_finite=check_finite, return_lse=return_lse)


def _eager(q, k, v) -> bool:
    """Whether a torch call may skip the custom op's dispatch (tens of microseconds): not
    under torch.compile, not in an autocast region of q's device, and no input requiring
    grad; the op serves those."""
    import torch

    return not (torch.compiler.is_compiling() or torch.is_autocast_enabled(q.device.type)
                or (torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))))


def _torch_cuda_attention(q, k, v, causal, scale, kernel, check_finite, return_lse, params):
    """The fast path's answer for torch CUDA tensors (_torch_cuda), or None: the
    general path runs. A call shape without a plan runs here through the general
    path's steps, and what they chose becomes the plan for the next calls."""
    got = _torch_cuda.attention(q, k, v, causal, scale, kernel, check_finite, return_lse, params)
    if not isinstance(got, _torch_cuda.Pending):
        return got
    try:
        call = validate(q, k, v, causal=causal, scale=scale, check_finite=got.check)
        chosen, resolved = choose(call, kernel, params, return_lse=got.with_lse)
    except (TypeError, ValueError, RuntimeError):
        return None  # the general path raises it, as it words it
    result = run(call, chosen, resolved, check_finite=got.check, return_lse=got.with_lse)  # compiles on first use
    got.plan(call, chosen, resolved)
    return result


def _torch_attention(q, k, v, causal, scale, kernel, check_finite, return_lse, feats, params):
    """attention() on torch tensors, through the custom op attnkern::attention (_torch_ops):
    torch in, torch out, on the inputs' device; differentiable through the kernel's backward
    when an input requires grad; traceable by torch.compile; cast under autocast. feats:
    attention()'s window, key_lengths, softcap (and the masks' keywords where given)."""
    import torch

    _torch_api.check_tensors((q, k, v), "q, k, v")
    if _eager(q, k, v):  # what the op would run, without its dispatch
        if feats.get("dropout_seed") is not None:  # a 0-d tensor (traceable, for the op) as the int it holds
            feats = {**feats, "dropout_seed": int(feats["dropout_seed"])}
        return _run_torch(q, k, v, causal, scale, kernel, check_finite, return_lse, False, feats, params)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    out, lse = _torch_ops.ops().attention(q, k, v, *_encode(causal, scale, kernel, feats, params), check_finite,
                                          return_lse or grad, grad)
    return (out, lse) if return_lse else out


# the keywords of masks, ALiBi and dropout, when not used
_NEUTRAL = {"attn_mask": None, "alibi_slopes": None, "dropout_p": 0.0, "dropout_seed": None}


def _encode(causal, scale, kernel, feats, params) -> tuple:
    """attention()'s arguments as the custom ops take them (str, float, int, Tensor?), in
    the order of _torch_ops.SPEC. Type errors are raised here, as validate words them;
    values are checked by validate, inside the op."""
    import torch

    on, align = _causal(causal)
    if scale is not None:
        scale = float(_real(scale, "scale must be a real number or None, got {!r}"))
    if not isinstance(kernel, str):
        raise TypeError(f"kernel must be a kernel's name (attnkern.kernels()) or 'auto', got {kernel!r}")
    left = right = -1
    window = feats.get("window")
    if window is not None:
        if isinstance(window, (str, bytes)) or not hasattr(window, "__len__") or len(window) != 2:
            raise TypeError(f"window must be a pair (left, right) of key counts, each None for unbounded, e.g. "
                            f"(4095, 0); got {window!r}")
        left, right = (_window_side(x, side, 2**62) for x, side in zip(window, ("left", "right")))
    key_lengths = feats.get("key_lengths")
    if key_lengths is not None and not isinstance(key_lengths, torch.Tensor):
        key_lengths = torch.as_tensor(np.asarray(key_lengths))
    softcap = feats.get("softcap")
    if softcap is not None:
        softcap = float(_real(softcap, "softcap must be a positive real number or None, got {!r}"))
    mask, slopes, dropout_p, seed = (feats.get(n, d) for n, d in _NEUTRAL.items())
    mask, slopes = (x if x is None or isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
                    for x in (mask, slopes))  # NumPy arrays with tensors
    if seed is not None and not isinstance(seed, torch.Tensor):
        seed = torch.tensor(int(seed), dtype=torch.int64)
    for name, value in params.items():
        if not isinstance(value, (int, float, str, np.integer, np.floating)) or "," in str(value):
            raise TypeError(f"tunable {name} must be a number (attnkern.kernel_info(name)['params']), got {value!r}")
    encoded = ",".join(f"{name}={value!r}" for name, value in sorted(params.items()))  # traceable, unlike json
    return (align if on else "none", scale, kernel, left, right, key_lengths, softcap, mask, slopes,
            float(dropout_p), seed, encoded)


def _real(value, message: str):
    """value, if a real number (not a bool), else TypeError(message with it)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(message.format(value))
    return value


def _decode(spec: dict) -> tuple:
    """_encode's inverse, from the op's arguments (named as _torch_ops.SPEC): (causal, scale, kernel,
    feats, params), feats holding the masks' keywords only where they are not neutral, so that
    a core without them runs every call that does not use them."""
    causal = {"none": False, "top_left": True, "bottom_right": "bottom_right"}[spec["causal"]]
    left, right = spec["window_left"], spec["window_right"]
    window = None if left == right == -1 else tuple(None if x == -1 else x for x in (left, right))
    feats = {"window": window, "key_lengths": spec["key_lengths"], "softcap": spec["softcap"]}
    seed = spec["dropout_seed"]
    given = {"attn_mask": spec["attn_mask"], "alibi_slopes": spec["alibi_slopes"], "dropout_p": spec["dropout_p"],
             "dropout_seed": None if seed is None else int(seed)}
    used = {n: x for n, x in given.items() if x is not None and x != _NEUTRAL[n]}
    feats.update(used)
    unknown = set(used) - set(inspect.signature(validate).parameters)
    if unknown:
        raise NotImplementedError(f"this attnkern has no {', '.join(sorted(unknown))} (attention() does not take "
                                  "it yet)")
    params = dict(item.split("=", 1) for item in spec["params"].split(",")) if spec["params"] else {}
    return causal, spec["scale"], spec["kernel"], feats, {n: ast.literal_eval(x) for n, x in params.items()}


def _op_forward(q, k, v, spec, *, check_finite, need_lse, need_backward):
    """attnkern::attention's implementation: (out, lse), lse empty without need_lse; need_backward
    chooses a kernel with a backward (an input requires grad)."""
    causal, scale, kernel, feats, params = _decode(spec)
    result = _run_torch(q, k, v, causal, scale, kernel, check_finite, need_lse, need_backward, feats, params)
    return result if need_lse else (result, q.new_empty((0,)))


def _run_torch(q, k, v, causal, scale, kernel, check_finite, return_lse, backward, feats, params):
    """out, or (out, lse) with return_lse, for torch tensors; backward: choose a kernel with a
    backward (whose lse the caller then asks for)."""
    if q.is_cuda and not backward and all(x is None or x == _NEUTRAL.get(n) for n, x in feats.items()):
        # device-resident tensors: a prepared launch per call shape, for calls without features
        result = _torch_cuda_attention(q, k, v, causal, scale, kernel, check_finite, return_lse, params)
        if result is not None:
            return result
    return _torch_forward(q, k, v, causal, scale, kernel, check_finite, return_lse, feats, params,
                          backward=backward)[0]


def _op_backward(q, k, v, out, dout, lse, spec):
    """attnkern::attention_backward's implementation: (dq, dk, dv)."""
    causal, scale, kernel, feats, params = _decode(spec)
    return _torch_attention_backward(q, k, v, out, dout, lse, causal=causal, scale=scale, kernel=kernel,
                                     feats=feats, **params)


def _backward_takes(kernel: str, dtype: str) -> bool:
    """Whether the kernel's backward (kernel="auto": some kernel's) takes dtype (autocast's policy)."""
    names = _registry.with_feature("backward") if kernel == "auto" else [kernel]
    try:
        return any(dtype in _registry.get(n).backward_dtypes for n in names)
    except (KeyError, ValueError):
        return False  # an unknown kernel: the op itself refuses it


def _torch_forward(q, k, v, causal, scale, kernel, check_finite, return_lse, feats, params, backward):
    """(result, call, chosen, resolved): result is out or (out, lse) as torch tensors."""
    _torch_api.check_dtypes((q, k, v))
    call = validate(*_torch_api.views((q, k, v)), causal=causal, scale=scale, check_finite=False,  # run checks
                    **feats)
    chosen, resolved = choose(call, kernel, params, return_lse=return_lse or backward, backward=backward)
    result = run(call, chosen, resolved, check_finite=check_finite, return_lse=return_lse or backward)
    return _torch_api.as_torch(result, call.device), call, chosen, resolved


_torch_ops.install(_op_forward, _op_backward, _backward_takes)


def attention_backward(q, k, v, out, dout, lse, *, causal=False, scale=None, kernel="auto", window=None,
                       key_lengths=None, softcap=None, **params):
    """(dq, dk, dv) of attention(q, k, v, ...) given the output's gradient dout:
    out and lse are what attention(..., return_lse=True) returned for the same
    arguments (causal, scale, window, key_lengths, softcap as there); dk and dv
    have k's and v's shapes (H_kv heads under grouped-query attention, each the
    sum over the query heads it serves). out and lse may also be those of whole
    rows of which k, v hold one block of keys (ring attention): the result is then
    that block's share of the gradients (dq a partial sum over blocks, dk and dv
    exact for this block).
    NumPy arrays or torch tensors (CPU or CUDA), in the kernel's dtypes; the kernel
    must have a backward (kernel_info(name)["backward"])."""
    args = (q, k, v, out, dout, lse)
    feats = {"window": window, "key_lengths": key_lengths, "softcap": softcap}
    if any(_is_torch(x) for x in args):  # through the custom op attnkern::attention_backward (torch.compile)
        _torch_api.check_tensors(args, "q, k, v, out, dout, lse")
        return _torch_ops.ops().attention_backward(*(x.detach() for x in args),
                                                   *_encode(causal, scale, kernel, feats, params))
    call = validate(q, k, v, causal=causal, scale=scale, check_finite=False, **feats)
    if call.device:
        raise TypeError("attention_backward takes NumPy arrays or torch tensors; pass GPU arrays as torch tensors")
    chosen, resolved = choose(call, kernel, params, return_lse=True, backward=True)
    _check_backward_dtype(chosen, call.q.dtype.name)
    (batch, nq, d), nk, dv = call.q.shape, call.k.shape[1], call.v.shape[2]
    out, dout, lse = (check_like(x, name, shape, call.q.dtype)
                      for x, name, shape in ((out, "out", call.out_shape), (dout, "dout", call.out_shape),
                                             (lse, "lse", call.out_shape[:-1])))
    if batch * nq * nk == 0:
        grads = tuple(np.zeros_like(x) for x in (call.q, call.k, call.v))
    else:
        grads = chosen.backward(call.q, call.k, call.v, out.reshape(batch, nq, dv), dout.reshape(batch, nq, dv),
                                lse.reshape(batch, nq), call.causal, call.scale, **call.feature_args(), **resolved)
    shapes = ((*call.out_shape[:-2], nq, d), call.kv_shape, (*call.kv_shape[:-1], dv))
    return tuple(g.reshape(shape) for g, shape in zip(grads, shapes))


def _torch_attention_backward(q, k, v, out, dout, lse, *, causal, scale, kernel, feats, **params):
    """attention_backward on torch tensors."""
    import torch

    _torch_api.check_tensors((q, k, v, out, dout, lse), "q, k, v, out, dout, lse")
    call = validate(*_torch_api.views((q, k, v)), causal=causal, scale=scale, check_finite=False, **feats)
    chosen, resolved = choose(call, kernel, params, return_lse=True, backward=True)
    _torch_api.check_like_q(q, ((out, "out", call.out_shape), (dout, "dout", call.out_shape),
                                (lse, "lse", call.out_shape[:-1])))
    _check_backward_dtype(chosen, call.q.dtype.name)
    with torch.no_grad():
        return _torch_api.backward(q.detach(), k.detach(), v.detach(), out.detach(), dout.detach(), lse.detach(),
                                   call=call, chosen=chosen, resolved=resolved)


def _check_backward_dtype(chosen: _registry.Kernel, dtype: str) -> None:
    """TypeError where the kernel's backward does not take the inputs' dtype
    (chosen.backward_dtypes), though its forward may."""
    if dtype not in chosen.backward_dtypes:
        takes = " and ".join(chosen.backward_dtypes)
        raise TypeError(f"{chosen.name}'s backward takes {takes}, not {dtype} (its forward takes {dtype}); for "
                        f"gradients, run attention in {chosen.backward_dtypes[0]}: convert with .astype "
                        "(torch: .float())")


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
    chosen = (_auto(call.device, dtype, return_lse, backward, call.needs) if kernel == "auto"
              else _registry.get(kernel))
    # the head sizes of a call with no work are not checked: no kernel runs
    need = {"device": call.device, "dtype": dtype, "d": None if call.empty else call.q.shape[2],
            "dv": call.v.shape[2], "return_lse": return_lse, "backward": backward, "features": call.needs}
    reasons = dict(chosen.not_supported_reasons(**need))
    if reasons:
        raise _refusal(chosen, reasons, need)
    return chosen, _with_tuned(call, chosen, params)


def _refusal(chosen: _registry.Kernel, reasons: dict, need: dict) -> Exception:
    """The error for a kernel that refuses a call (reasons: its not_supported_reasons),
    for the first reason in the order below, followed by every kernel's answer to the
    call, so that one error shows what would run it."""
    name, dtype = chosen.name, need["dtype"]
    if "device" in reasons:
        exc = TypeError(f"{name} runs on the CPU and q, k, v are GPU arrays: use kernel='auto' or a cuda.* kernel, "
                        "or copy the arrays to the host")
    elif "available" in reasons:
        exc = RuntimeError(f"kernel {name} is not available here: {reasons['available']}")
    elif "dtype" in reasons:
        takes = ", ".join(_registry.with_feature(dtype)) or "none"
        exc = TypeError(f"{name} does not take {dtype} inputs (it takes {', '.join(chosen.dtypes)}); "
                        f"kernels that take {dtype}: {takes}; or convert the inputs with .astype")
    elif "lse" in reasons:
        exc = ValueError(f"{name} cannot return the log-sum-exp; kernels that can: "
                         f"{', '.join(_registry.with_feature('returns_lse'))}")
    elif "backward" in reasons:
        exc = ValueError(f"{name} has no backward pass, and an input requires grad; differentiable "
                         f"kernels: {', '.join(_registry.with_feature('backward'))} (or call it under "
                         "torch.no_grad(), or detach the inputs)")
    elif "features" in reasons:
        able = ", ".join(_registry.supporting(need["features"], need["backward"])) or "none"
        exc = ValueError(f"{name} {reasons['features']}; kernels that support this call's features"
                         f"{' (forward and backward)' if need['backward'] else ''}: {able} "
                         "(kernel_info(name)['features'], docs/features.md)")
    else:
        exc = ValueError(f"{name}: {reasons['head_size']}")
    answers = []
    for kernel in _registry.all_kernels():
        why = kernel.not_supported_reasons(**need)
        answers.append(f"  {kernel.name}: {'; '.join(r for _, r in why) if why else 'runs it'}")
    exc.args = (f"{exc.args[0]}\nevery kernel for this call ({_describe(need)}):\n" + "\n".join(answers),)
    return exc


def _describe(need: dict) -> str:
    """A call's needs in words, for _refusal."""
    parts = ["GPU arrays" if need["device"] else "host arrays", need["dtype"]]
    if need["d"] is not None:
        parts.append(f"D={need['d']}, Dv={need['dv']}")
    parts += [what for what, asked in (("the log-sum-exp", need["return_lse"]), ("a backward", need["backward"]))
              if asked]
    if need["features"]:
        parts.append("features " + ", ".join(n for n in _registry.FEATURES if n in need["features"]))
    return ", ".join(parts)


def kernel_info(name: str) -> dict:
    """Whether kernel `name` runs here (and why not), and its tunables:
    {name, description, device, available, reason, params: {p: {default, min, max, doc}},
    returns_lse (attention(..., return_lse=True) works), backward (it is differentiable),
    dtypes (the input dtypes it takes), backward_dtypes (those its backward takes),
    features (the features of docs/features.md its forward takes: "gqa", "bottom_right",
    "window", "key_lengths", "softcap"), backward_features (those its backward takes),
    tuned: this machine's cached results of attnkern.tune, [{key, params, seconds}], which
    replace the defaults for calls that match their key};
    a tunable restricted to a set of values also has "choices"."""
    kernel = _registry.get(name)
    reason = kernel.unavailable_reason()
    return {
        "name": kernel.name,
        "description": kernel.description,
        "device": kernel.device,
        "available": reason is None,
        "reason": reason,
        "params": {p.name: _registry.param_info(p) for p in kernel.params},
        "returns_lse": kernel.returns_lse,
        "backward": kernel.backward is not None,
        "dtypes": list(kernel.dtypes),
        "backward_dtypes": list(kernel.backward_dtypes) if kernel.backward is not None else [],
        "features": [n for n in _registry.FEATURES if n in kernel.features],
        "backward_features": [n for n in _registry.FEATURES if n in kernel.features_of_backward()],
        "tuned": _tuned.entries_for(kernel.name) if kernel.params else [],
    }


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
    extra = call.feature_args()
    in_kernel = check_finite and chosen.checks_finite and not call.device and not call.empty
    if check_finite and not call.device and not in_kernel:
        _check_host_inputs(call.q, call.k, call.v, call.features.key_lengths)
    if in_kernel:
        extra["check_finite"] = True
    if call.device:  # outputs are allocated here, as the caller's kind of GPU array
        out, returned = _gpu.empty_like_kind(call.out_shape, call.q.dtype, call.like)
        if return_lse:
            lse, lse_returned = _gpu.empty_like_kind(lse_shape, call.q.dtype, call.like)
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
        q, k = (_gpu.to_host(x) if call.device else x for x in (call.q, call.k))
        softmax_attention(q, k, np.zeros((k.shape[0], k.shape[1], 0), q.dtype), call.causal, call.scale, lse=host,
                          features=call.features if call.needs else None)
        if call.device:
            extra["lse"].view().copy_to_device(host)
        else:
            extra["lse"][...] = host
    if check_finite and call.device:  # inputs and output in one scan, one wait
        bad = _gpu.nonfinite(call.q, call.k, call.v, *([] if call.empty else [out]))
        for n, flag in zip("qkv", bad):
            if flag:
                raise _registry.nonfinite_input(n)
        overflow = bad[3:] == [True]
    else:
        overflow = check_finite and not in_kernel and not call.empty and not _all_finite(call.device, out)
    if overflow:
        raise _registry.nonfinite_output(chosen.name, call.q.dtype)
    return (returned, lse_returned) if return_lse else returned
