"""The core: attention()'s validation (validate), kernel choice (choose) and run
(run), in one place, for every kind of array. Below it, the frontends turn the
caller's arrays into what kernels take and back (NumPy arrays are the core's
own; _torch_api: torch tensors; _gpu: GPU arrays; _torch_cuda: the fast path
for torch CUDA tensors), then the backends (the kernels), then the registry,
whose entries say what each kernel supports: choose() reads that and, where a
kernel refuses a call, says why for every kernel."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import numbers
import time
import warnings
from dataclasses import dataclass

import numpy as np

from . import _fp8, _gpu, _gpuarray, _registry, _torch_api, _torch_cuda, _torch_ops, _tuned


def _half_dtypes() -> tuple[np.dtype, ...]:
    """float16, and bfloat16 where ml_dtypes (NumPy's bfloat16) is installed."""
    try:
        import ml_dtypes
    except ImportError:
        return (np.dtype(np.float16),)
    return (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


_DTYPES = (np.dtype(np.float32), np.dtype(np.float64), *_half_dtypes())
_DTYPE_NAMES = "float32, float64, float16 and bfloat16 (ml_dtypes.bfloat16 or torch.bfloat16)"
# dtype -> its name: NumPy's dtype.name is computed in Python on every access, and a plain call asks for it
# on its hot path (choose)
_NAME = {d: d.name for d in _DTYPES}


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
        return _NONE if self.features is _registry.PLAIN else self.features.needs()

    def feature_args(self) -> dict:
        """What a kernel's run and backward take for the features: {features: ...}
        where the call has any, else nothing (kernels without features never see it)."""
        return {"features": self.features} if self.needs else {}

    @functools.cached_property
    def empty(self) -> bool:  # asked several times a call: computed once
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
_NONE = frozenset()


def validate(q, k, v, *, causal, scale, check_finite, window=None, key_lengths=None, softcap=None, attn_mask=None,
             dropout_p=0.0, dropout_seed=None, dropout_offset=(0, 0), alibi_slopes=None) -> Call:
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
    if attn_mask is not None or dropout_p != 0.0 or alibi_slopes is not None:
        mask = _gpu_mask if device else _mask
        features = dataclasses.replace(features, **mask(attn_mask, q.shape, nk, q.dtype),
                                       **_dropout(dropout_p, dropout_seed, dropout_offset),
                                       **_alibi(alibi_slopes, q.shape))
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
        _check_mask(features.mask)
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
    if kv_heads == 0 or heads % kv_heads or heads == 0:  # (0 query heads over k/v heads: no group size)
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
    if window is None and key_lengths is None and softcap is None and group == 1 and (
            align == "top_left" or nq == nk or not causal):
        return _registry.PLAIN  # the plain call (most calls): no checks, no new Features
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


def _mask(attn_mask, q_shape, nk: int, dtype) -> dict:
    """attn_mask as Features' mask and mask_heads: a 4-D view (no copy) of the mask
    as given, its shape padded with leading 1s, broadcastable to (B, H, Nq, Nk)
    (B, H: 1 where q has fewer dimensions), as torch SDPA broadcasts it to the
    attention weights (..., Nq, Nk). bool: True takes part; float: added to the
    scores, of q's dtype (float32 or the half dtype itself for float16/bfloat16 q,
    widened to float32 exactly)."""
    if attn_mask is None:
        return {}
    half = dtype.name in ("float16", "bfloat16")
    if type(attn_mask).__module__.startswith("torch") and hasattr(attn_mask, "detach"):
        import torch

        if attn_mask.device.type != "cpu":
            raise TypeError(f"attn_mask is on {attn_mask.device}; pass a host (CPU) tensor or NumPy array")
        if attn_mask.dtype in (torch.float16, torch.bfloat16):
            if not half:
                raise TypeError(f"an additive attn_mask must be {dtype}, q's dtype, got {attn_mask.dtype}; convert "
                                "it with .to(q.dtype), or pass a bool mask")
            attn_mask = attn_mask.float()  # exact
        attn_mask = attn_mask.detach().numpy()
    mask = np.asarray(attn_mask)
    half = dtype.name in ("float16", "bfloat16")
    if mask.dtype != np.bool_:
        if mask.dtype.kind != "f" and mask.dtype.name != "bfloat16":
            raise TypeError(f"attn_mask has dtype {mask.dtype}; it must be bool (True: the key takes part, as torch "
                            f"SDPA) or a float mask added to the scores, of q's dtype {dtype}")
        if half and mask.dtype in (np.float32, dtype):
            mask = mask.astype(np.float32, copy=False)
        elif mask.dtype != dtype:
            wanted = f"{dtype} (q's dtype) or float32" if half else f"{dtype}, q's dtype"
            raise TypeError(f"an additive attn_mask must be {wanted}, got {mask.dtype}; convert it with "
                            ".astype (torch: .to(q.dtype)), or pass a bool mask")
    lead = tuple(q_shape[:-2])
    target = (*lead, q_shape[-2], nk)
    if mask.ndim > len(target) or any(m not in (1, t) for m, t in zip(mask.shape[::-1], target[::-1])):
        raise ValueError(f"attn_mask of shape {mask.shape} does not broadcast to the attention weights' shape "
                         f"{target} ((..., Nq, Nk) of these q, k: each dimension 1 or the weights' own, leading "
                         "ones may be left out, as torch SDPA takes it)")
    target4 = (1,) * (4 - len(target)) + target
    mask4 = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    if any(st < 0 or st % mask4.itemsize for st in mask4.strides):
        mask4 = np.ascontiguousarray(mask4)
    return {"mask": mask4, "mask_heads": target4[1]}


def _gpu_mask(attn_mask, q_shape, nk: int, dtype) -> dict:
    """_mask for GPU q: attn_mask a GPU array (torch CUDA tensor, CuPy, Numba) used
    where it lies, never copied: Features' mask is a 4-D GpuArray view of it (the
    shape padded with leading 1s, byte strides with 0 for every broadcast dimension).
    bool, or float of q's dtype (float16/bfloat16 q: also float32), as on the CPU."""
    if attn_mask is None:
        return {}
    mask = _gpu.mask_view(attn_mask, "attn_mask")
    if mask is None:
        raise TypeError("attn_mask must be a GPU array on q's device (torch CUDA tensor, CuPy, Numba device array) "
                        "when q, k, v are GPU arrays")
    half = dtype.name in ("float16", "bfloat16")
    if mask.dtype != np.bool_ and not (mask.dtype == dtype or (half and mask.dtype == np.float32)):
        wanted = f"{dtype} (q's dtype) or float32" if half else f"{dtype}, q's dtype"
        raise TypeError(f"attn_mask has dtype {mask.dtype}; it must be bool (True: the key takes part) or an "
                        f"additive float mask of {wanted}")
    target = (*tuple(q_shape[:-2]), q_shape[-2], nk)
    if mask.ndim > len(target) or any(m not in (1, t) for m, t in zip(mask.shape[::-1], target[::-1])):
        raise ValueError(f"attn_mask of shape {mask.shape} does not broadcast to the attention weights' shape "
                         f"{target} ((..., Nq, Nk) of these q, k: each dimension 1 or the weights' own, leading "
                         "ones may be left out, as torch SDPA takes it)")
    pad = 4 - mask.ndim
    shape = (1,) * pad + mask.shape
    strides = tuple(0 if n == 1 else st for n, st in zip(shape, (0,) * pad + tuple(mask.strides)))
    if any(st < 0 or st % mask.dtype.itemsize for st in strides):
        raise ValueError(f"attn_mask has strides {mask.strides}; GPU masks need non-negative strides that are "
                         "multiples of the element size (make it contiguous)")
    view = _gpuarray.GpuArray(shape, mask.dtype, strides, mask._flat, ptr=mask.ptr, owner=mask.owner,
                              contiguous=mask.contiguous)
    return {"mask": view, "mask_heads": ((1,) * (4 - len(target)) + target)[1]}


def _alibi(alibi_slopes, q_shape) -> dict:
    """alibi_slopes (H,) or (B, H), FlashAttention's, as Features' alibi: one float64
    slope per folded query row (B * H of them)."""
    if alibi_slopes is None:
        return {}
    if type(alibi_slopes).__module__.startswith("torch") and hasattr(alibi_slopes, "detach"):
        alibi_slopes = alibi_slopes.detach().cpu().float().numpy()
    slopes = np.asarray(alibi_slopes)
    if slopes.dtype.kind not in "fiu" or slopes.dtype == np.bool_:
        raise TypeError(f"alibi_slopes must hold real numbers (one slope per head), got dtype {slopes.dtype}")
    heads = q_shape[-3] if len(q_shape) >= 3 else 1
    batch = q_shape[0] if len(q_shape) == 4 else 1
    if slopes.shape not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape ({heads},) or ({batch}, {heads}) (one slope per head, or per "
                         f"sequence and head) for q of shape {tuple(q_shape)}, got {slopes.shape}")
    if not np.isfinite(slopes).all():
        raise ValueError("alibi_slopes must be finite")
    return {"alibi": np.ascontiguousarray(np.broadcast_to(slopes, (batch, heads)), np.float64).reshape(-1)}


def _check_mask(mask) -> None:
    """ValueError for a float mask with NaN or +infinity (-inf hides a key)."""
    if isinstance(mask, _gpuarray.GpuArray):
        return  # GPU masks are not scanned (docs/gpu.md)
    if mask is not None and mask.dtype != np.bool_ and (np.isnan(mask).any() or np.isposinf(mask).any()):
        raise ValueError("attn_mask contains NaN or +infinity; an additive mask holds finite values or -inf "
                         "(hides the key); or pass check_finite=False")


def _dropout(dropout_p, dropout_seed, offset) -> dict:
    """dropout_p and dropout_seed as Features' dropout fields (seed taken mod 2^64)."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    if not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must lie in [0, 1) (the probability of dropping an attention weight), "
                         f"got {dropout_p!r}")
    if dropout_seed is not None and (isinstance(dropout_seed, (bool, np.bool_))
                                     or not isinstance(dropout_seed, numbers.Integral)):
        raise TypeError(f"dropout_seed must be an integer (or None to draw one), got {dropout_seed!r}")
    if dropout_p == 0:
        return {}
    if dropout_seed is None:
        raise ValueError("dropout_seed is required with dropout_p > 0 here: pass the seed the forward used")
    return {"dropout_p": float(dropout_p), "dropout_seed": int(dropout_seed) % 2**64,
            "dropout_offset": tuple(int(x) for x in offset)}


def _draw_seed(dropout_p, dropout_seed, torch_inputs: bool):
    """dropout_seed, or where it is None and dropout is on, a fresh one: from torch's
    default generator for torch inputs (torch.manual_seed controls it), else from
    NumPy's global RNG (np.random.seed controls it)."""
    if dropout_seed is not None or isinstance(dropout_p, (bool, np.bool_)) or \
            not isinstance(dropout_p, numbers.Real) or not dropout_p > 0:
        return dropout_seed
    if torch_inputs:
        import torch

        return int(torch.randint(0, 2**62, (1,)).item())
    return int(np.random.randint(0, 2**63 - 1, dtype=np.int64))


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
    def fits(k):  # under autograd, its backward must take the dtype too
        return not k.not_supported_reasons(dtype=dtype, return_lse=return_lse, backward=backward,
                                           features=features) and (not backward or dtype in k.backward_dtypes)

    if device:  # cuda.flash, else triton.flash for a dtype cuda.flash does not take
        gpu = [k for k in map(_registry.get, ("cuda.flash", "triton.flash"))]
        return next((k for k in gpu if fits(k)), gpu[0])
    available = [k for k in map(_registry.get, ("native.flash", "torch.sdpa", "numpy.naive"))
                 if k.unavailable_reason() is None]
    if not available:  # pragma: no cover - numpy.naive always is
        raise RuntimeError("no attention kernel is available")
    return next((k for k in available if fits(k)), available[0])


def attention(q, k, v, *, causal=False, scale=None, kernel="auto", window=None, key_lengths=None, softcap=None,
              attn_mask=None, dropout_p=0.0, dropout_seed=None, alibi_slopes=None, check_finite=True,
              return_lse=False, descale_q=None, descale_k=None, descale_v=None, **params):
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
    c * tanh(s / c). attn_mask, broadcastable to (..., Nq, Nk) as torch SDPA takes
    it (NumPy array or CPU tensor), is bool (True: the key takes part) or float,
    added to the (capped) scores, of q's dtype (float32 or q's own for float16 and
    bfloat16); -inf hides a key. dropout_p in [0, 1) drops each probability with
    that chance and scales the kept ones by 1 / (1 - dropout_p), the lse staying
    that of the undropped softmax; the mask is Philox4x32-10 keyed by dropout_seed
    (attnkern._philox; None draws one from NumPy's global RNG, or from torch's
    default generator for torch inputs), so a seed gives the same result on every
    kernel that has dropout and every thread count. alibi_slopes, (H,) or (B, H)
    (FlashAttention's), adds -slope * |i + Nk - Nq - j| to the score of query i and
    key j (Nk: the sequence's key length). A row that sees no key gets 0 and lse -inf.
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

    FP8: torch CUDA tensors of dtype torch.float8_e4m3fn (all three) with descale_q,
    descale_k, descale_v (x ~ x8 * descale_x, per tensor: attnkern.quantize_fp8 makes
    them; numbers, or one-element CUDA tensors that the kernel reads on the GPU) run
    cuda.flash's FP8 forward on Hopper and return bfloat16; D = Dv = 128, causal and
    grouped k/v heads only (docs/gpu-fp8.md).
    """
    if (_torch_cuda._QUICK and window is None and key_lengths is None and softcap is None and attn_mask is None
            and alibi_slopes is None and dropout_seed is None and descale_q is None and descale_k is None
            and descale_v is None and type(dropout_p) in (float, int) and dropout_p == 0):
        # torch CUDA tensors of a planned call shape: the plan at once, before the checks below
        # (which it has made for that shape), whose Python work outlasts the launch
        got = _torch_cuda.quick(q, k, v, causal, scale, kernel, check_finite, return_lse, params)
        if type(got) is _torch_cuda.Plan:  # inputs that require grad: the autograd function runs the plan
            out, lse = _autograd_function().apply(q, k, v, (causal, scale, kernel, check_finite, {}, params, got))
            return (out, lse) if return_lse else out
        if got is not None:
            return got
    # NumPy arrays (the common host call) need no look at the module of each argument
    torch_inputs = not (type(q) is type(k) is type(v) is np.ndarray) and (_is_torch(q) or _is_torch(k) or
                                                                         _is_torch(v))
    descales = (descale_q, descale_k, descale_v)
    if torch_inputs and (_fp8.is_fp8(q) or _fp8.is_fp8(k) or _fp8.is_fp8(v)):
        feats = {"window": window, "key_lengths": key_lengths, "softcap": softcap, "attn_mask": attn_mask,
                 "dropout_p": dropout_p, "alibi_slopes": alibi_slopes}
        return _fp8.attention(q, k, v, causal, scale, kernel, feats, params, descales, return_lse, check_finite)
    if any(x is not None for x in descales):
        raise ValueError("descale_q, descale_k and descale_v are for float8_e4m3fn torch tensors only (quantize_fp8 "
                         f"makes them); these inputs are {getattr(q, 'dtype', type(q).__name__)}")
    if dropout_p and dropout_seed is None:
        dropout_seed = _draw_seed(dropout_p, dropout_seed, torch_inputs)
    feats = {"window": window, "key_lengths": key_lengths, "softcap": softcap, "attn_mask": attn_mask,
             "dropout_p": dropout_p, "dropout_seed": dropout_seed, "alibi_slopes": alibi_slopes}
    if torch_inputs:
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


def _torch_cuda_attention(q, k, v, causal, scale, kernel, check_finite, return_lse, params, backward=False):
    """The fast path's answer for torch CUDA tensors (_torch_cuda), or None: the
    general path runs. A call shape without a plan runs here through the general
    path's steps, and what they chose becomes the plan for the next calls. backward:
    the kernel must have a backward (the custom op under autograd)."""
    got = _torch_cuda.attention(q, k, v, causal, scale, kernel, check_finite, return_lse, params, backward)
    if not isinstance(got, _torch_cuda.Pending):
        return got
    try:  # (inputs that require grad are read detached, as the general path reads them)
        call = validate(q.detach(), k.detach(), v.detach(), causal=causal, scale=scale, check_finite=got.check)
        chosen, resolved = choose(call, kernel, params, return_lse=got.with_lse, backward=got.backward)
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
    if grad and q.is_cuda and _plain(feats) and _arguments_plain(causal, scale, kernel, params) \
            and _torch_cuda.eager_autograd() and not torch.compiler.is_compiling():
        cast = _eager_autocast(q, kernel)
        if cast is not False:
            if cast is not None:  # as the op's autocast policy casts: floating inputs, float64 excepted
                q, k, v = (x.to(cast) if x.dtype != cast and x.is_floating_point() and x.dtype != torch.float64
                           else x for x in (q, k, v))
            out, lse = _autograd_function().apply(q, k, v, (causal, scale, kernel, check_finite, feats, params))
            return (out, lse) if return_lse else out
    out, lse = _torch_ops.ops().attention(q, k, v, *_encode(causal, scale, kernel, feats, params), check_finite,
                                          return_lse or grad, grad)
    return (out, lse) if return_lse else out


def _arguments_plain(causal, scale, kernel, params) -> bool:
    """Whether attention()'s arguments are of the types the custom op would take as they are
    (the eager autograd path skips _encode, whose errors the op's path raises)."""
    return (isinstance(causal, (bool, str)) and isinstance(kernel, str)
            and (scale is None or type(scale) in (int, float)) and all(type(x) is int for x in params.values()))


def _eager_autocast(q, kernel):
    """For a differentiable CUDA call outside torch.compile: None outside an autocast
    region, the region's dtype where the kernel's backward takes it, else False (the
    custom op's autocast policy runs the call, in float32)."""
    import torch

    if not torch.is_autocast_enabled(q.device.type):
        return None
    dtype = torch.get_autocast_dtype(q.device.type)
    return dtype if _backward_takes(kernel, str(dtype).removeprefix("torch.")) else False


@functools.cache
def _autograd_function():
    """The torch.autograd.Function of differentiable CUDA calls without features (but
    grouped k/v heads and bottom-right causal masking) outside torch.compile: what the
    custom op's autograd formula does (_torch_ops), without the op's dispatch, which
    costs more host time than the prepared launches themselves. The forward and the
    backward run the op's implementations (_run_torch, _torch_attention_backward)."""
    import torch

    class Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, args):
            causal, scale, kernel, check_finite, feats, params = args[:6]
            # args[6]: the call shape's plan, where attention() found one (_torch_cuda.quick)
            got = _torch_cuda.run_plan(args[6], q, k, v) if len(args) > 6 else None
            out, lse = got or _run_torch(q, k, v, causal, scale, kernel, check_finite, True, True, feats, params)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.args = args
            ctx.mark_non_differentiable(lse)
            # no zeros for the lse's gradient (it has none) nor for an unused out: a
            # missing gradient arrives as None instead of an allocation and a fill kernel
            ctx.set_materialize_grads(False)
            return out, lse

        @staticmethod
        def backward(ctx, dout, _dlse):
            if dout is None:  # out took no part in what is differentiated
                return None, None, None, None
            q, k, v, out, lse = ctx.saved_tensors
            causal, scale, kernel, _, feats, params = ctx.args[:6]
            return (*_torch_attention_backward(q, k, v, out, dout.contiguous(), lse, causal=causal, scale=scale,
                                               kernel=kernel, feats=feats,
                                               forward_plan=ctx.args[6] if len(ctx.args) > 6 else None,
                                               **params), None)

    return Attention


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
        # an int64 tensor holds seeds of 2^63 and above as their two's complement: the
        # kernels take the seed mod 2^64 (_dropout), which maps it back
        seed = int(seed) % 2**64
        seed = torch.tensor(seed - 2**64 if seed >= 2**63 else seed, dtype=torch.int64)
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
    unknown = set(used) - set(inspect.signature(validate).parameters) if used else ()  # (signature: slow)
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
    if q.is_cuda and _plain(feats):
        # device-resident tensors: a prepared launch per call shape, for calls without features
        # (but grouped k/v heads and bottom-right causal masking), under autograd too
        result = _torch_cuda_attention(q, k, v, causal, scale, kernel, check_finite, return_lse, params, backward)
        if result is not None:
            return result
    return _torch_forward(q, k, v, causal, scale, kernel, check_finite, return_lse, feats, params,
                          backward=backward)[0]


def _plain(feats) -> bool:
    """Whether attention()'s feature keywords are all unused (None, or a number equal to
    the neutral value). An array (NumPy's ALiBi slopes beside torch tensors, a mask) is
    never neutral: comparing it with == would be elementwise, its truth ambiguous."""
    return all(x is None or (isinstance(x, numbers.Number) and x == _NEUTRAL.get(n)) for n, x in feats.items())


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


def _dropout_takes(kernel: str, dtype: str, device_type: str) -> bool:
    """Whether the kernel (kernel="auto": one that auto picks for tensors on device_type)
    has dropout in dtype (autocast's policy; cuda.flash has it in every dtype it takes)."""
    auto = ("cuda.flash", "triton.flash") if device_type == "cuda" else ("native.flash", "numpy.naive")
    names = auto if kernel == "auto" else (kernel,)
    try:
        return any("dropout" in _registry.get(n).features_in(dtype) for n in names)
    except ValueError:
        return False  # an unknown kernel: the op itself refuses it


_torch_ops.install(_op_forward, _op_backward, _backward_takes, _dropout_takes)


def attention_backward(q, k, v, out, dout, lse, *, causal=False, scale=None, kernel="auto", window=None,
                       key_lengths=None, softcap=None, attn_mask=None, dropout_p=0.0, dropout_seed=None,
                       alibi_slopes=None, **params):
    """(dq, dk, dv) of attention(q, k, v, ...) given the output's gradient dout:
    out and lse are what attention(..., return_lse=True) returned for the same
    arguments (causal, scale, window, key_lengths, softcap, attn_mask, alibi_slopes, dropout_p as
    there, and with dropout the dropout_seed the forward used: required); dk and dv
    have k's and v's shapes (H_kv heads under grouped-query attention, each the
    sum over the query heads it serves). out and lse may also be those of whole
    rows of which k, v hold one block of keys (ring attention): the result is then
    that block's share of the gradients (dq a partial sum over blocks, dk and dv
    exact for this block).
    NumPy arrays or torch tensors (CPU or CUDA), in the kernel's dtypes; the kernel
    must have a backward (kernel_info(name)["backward"])."""
    _fp8.refuse(("q", q), ("k", k), ("v", v), what="attention_backward")
    args = (q, k, v, out, dout, lse)
    feats = {"window": window, "key_lengths": key_lengths, "softcap": softcap, "attn_mask": attn_mask,
             "dropout_p": dropout_p, "dropout_seed": dropout_seed, "alibi_slopes": alibi_slopes}
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


def _torch_attention_backward(q, k, v, out, dout, lse, *, causal, scale, kernel, feats, forward_plan=None,
                              **params):
    """attention_backward on torch tensors. On CUDA tensors without features (but
    grouped k/v heads and bottom-right causal masking), a call shape's first call
    leaves a plan (_torch_cuda.backward) that the next ones launch. forward_plan: the
    plan that ran the forward (the eager autograd function's), which keeps the backward's."""
    import torch

    pending = None
    if type(q) is torch.Tensor and q.is_cuda and _plain(feats):
        pending = _torch_cuda.backward(q, k, v, out, dout, lse, causal, scale, kernel, params, forward_plan)
        if pending is not None and not isinstance(pending, _torch_cuda.Pending):
            return pending
    _torch_api.check_tensors((q, k, v, out, dout, lse), "q, k, v, out, dout, lse")
    call = validate(*_torch_api.views((q, k, v)), causal=causal, scale=scale, check_finite=False, **feats)
    chosen, resolved = choose(call, kernel, params, return_lse=True, backward=True)
    _torch_api.check_like_q(q, ((out, "out", call.out_shape), (dout, "dout", call.out_shape),
                                (lse, "lse", call.out_shape[:-1])))
    _check_backward_dtype(chosen, call.q.dtype.name)
    with torch.no_grad():
        grads = _torch_api.backward(q.detach(), k.detach(), v.detach(), out.detach(), dout.detach(), lse.detach(),
                                    call=call, chosen=chosen, resolved=resolved)
    if pending is not None:  # the general path took the call: the next ones of its shape take the plan
        pending.plan(call, chosen, resolved)
    return grads


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
    dtype = _NAME.get(call.q.dtype) or call.q.dtype.name
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
        able = ", ".join(_registry.supporting(need["features"], need["backward"], dtype)) or "none"
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
    "window", "key_lengths", "softcap", "mask", "dropout", "alibi", "varlen": a packed
    varlen batch in one call), backward_features (those its backward takes),
    feature_dtypes ({feature: [dtypes]}: features it has only in those dtypes, forward and
    backward; every other feature it has in each of its dtypes),
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
        "feature_dtypes": {n: list(kernel.feature_dtypes[n]) for n in _registry.FEATURES if n in kernel.feature_dtypes},
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
    if check_finite and call.features.mask is not None:
        _check_mask(call.features.mask)
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
        if call.features.key_lengths is not None and (bad[1] or bad[2]):
            # the padding past each key length may hold anything: k and v again, up to the lengths
            seqs = call.features.sequences(call.q.shape[0], call.k.shape[0], call.k.shape[1])
            bad[1:3] = [_gpu.nonfinite_before(x, seqs) for x in (call.k, call.v)]
        for n, flag in zip("qkv", bad):
            if flag:
                raise _registry.nonfinite_input(n)
        overflow = bad[3:] == [True]
    else:
        overflow = check_finite and not in_kernel and not call.empty and not _all_finite(call.device, out)
    if overflow:
        raise _registry.nonfinite_output(chosen.name, call.q.dtype)
    return (returned, lse_returned) if return_lse else returned


# ------------------------------------------------------------------ varlen
def _cu_seqlens(cu, name: str, total: int) -> np.ndarray:
    """cu_seqlens as int64: 1-D int32/int64, starting at 0, non-decreasing, ending at
    total (the packed length); ValueError/TypeError saying what to fix."""
    if type(cu).__module__.startswith("torch") and hasattr(cu, "detach"):
        cu = cu.detach().cpu().numpy()
    cu = np.asarray(cu)
    if cu.dtype not in (np.int32, np.int64):
        raise TypeError(f"{name} must be int32 or int64 (FlashAttention's cu_seqlens), got dtype {cu.dtype}")
    if cu.ndim != 1 or cu.size < 1:
        raise ValueError(f"{name} must be 1-D with nseq + 1 offsets, got shape {cu.shape}")
    if cu[0] != 0:
        raise ValueError(f"{name} must start at 0, got {cu[0]}")
    if (np.diff(cu) < 0).any():
        raise ValueError(f"{name} must be non-decreasing (cumulative sequence lengths), got {cu.tolist()}")
    if cu[-1] != total:
        raise ValueError(f"{name} must end at the packed length {total} (the first dimension of its arrays), "
                         f"got {cu[-1]}")
    return cu.astype(np.int64)


def _max_seqlen(value, cu: np.ndarray, name: str) -> None:
    if value is None:
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer or None, got {value!r}")
    longest = int(np.diff(cu).max(initial=0))
    if value < longest:
        raise ValueError(f"{name}={value} is smaller than the longest sequence, {longest}; pass at least that "
                         "(or None)")


@dataclass(frozen=True)
class _Varlen:
    """A validated varlen call: packed q (total_q, H, D), k, v (total_k, H_kv, .), and
    each sequence's query and key offsets."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    cu_q: np.ndarray
    cu_k: np.ndarray
    slopes: object = None  # ALiBi: float64 (H,) or (nseq, H), or None


def _seq_slopes(call: _Varlen, s: int):
    """Sequence s's ALiBi slopes (H,), or None."""
    return None if call.slopes is None else (call.slopes if call.slopes.ndim == 1 else call.slopes[s])


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes=None) -> _Varlen:
    q, k, v = (_as_array(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v")))
    for x, n in ((q, "q"), (k, "k"), (v, "v")):
        if not isinstance(x, np.ndarray):
            raise TypeError("attention_varlen takes host arrays (NumPy, CPU tensors)")
        if x.ndim != 3:
            raise ValueError(f"{n} has shape {x.shape}; attention_varlen takes packed (total, heads, D) arrays "
                             "(FlashAttention's varlen layout)")
    for x, n in ((q, "q"), (k, "k"), (v, "v")):  # also where no sequence runs a kernel
        if x.dtype not in _DTYPES:
            raise TypeError(f"{n} has dtype {x.dtype}; attnkern supports {_DTYPE_NAMES} (convert with .astype)")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[2] != k.shape[2] or q.shape[2] == 0:
        raise ValueError(f"q and k must have the same feature size D >= 1, got q {q.shape} and k {k.shape}")
    if q.shape[1] % max(k.shape[1], 1) or k.shape[1] == 0 or (q.shape[1] == 0) != (k.shape[1] == 0):
        raise ValueError(f"q has {q.shape[1]} heads and k, v have {k.shape[1]}: the query heads H must be a "
                         "multiple of the k/v heads H_kv (grouped-query attention)")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k and v must have the same (total_k, heads), got {k.shape} and {v.shape}")
    cu_q = _cu_seqlens(cu_seqlens_q, "cu_seqlens_q", q.shape[0])
    cu_k = _cu_seqlens(cu_seqlens_k, "cu_seqlens_k", k.shape[0])
    if cu_q.size != cu_k.size:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must have one length per sequence each, got "
                         f"{cu_q.size - 1} and {cu_k.size - 1} sequences")
    _max_seqlen(max_seqlen_q, cu_q, "max_seqlen_q")
    _max_seqlen(max_seqlen_k, cu_k, "max_seqlen_k")
    slopes = None
    if alibi_slopes is not None:  # (H,) or (nseq, H): checked as attention() checks (B, H) slopes
        nseq, heads = cu_q.size - 1, q.shape[1]
        shaped = np.asarray(alibi_slopes.detach().cpu().float().numpy() if _is_torch(alibi_slopes) else alibi_slopes)
        slopes = _alibi(shaped, (nseq if shaped.ndim == 2 else 1, heads, 1, 1))["alibi"]
        slopes = slopes.reshape(nseq, heads) if shaped.ndim == 2 else slopes
    return _Varlen(q, k, v, cu_q, cu_k, slopes)


def _packed_rows(cu: np.ndarray, heads: int) -> np.ndarray:
    """(total, heads) row indices into attn.h's varlen layout (sequence after sequence,
    each a (heads, len, .) block) of the packed (total, heads, .) rows: token t of
    sequence s (local index i) and head h go to row cu[s] * heads + h * len_s + i."""
    lens = np.diff(cu)
    seq = np.repeat(np.arange(lens.size), lens)
    start = cu[seq]
    return (start * heads + np.arange(cu[-1]) - start)[:, None] + np.arange(heads)[None, :] * lens[seq][:, None]


def _to_layout(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """A packed (total, heads, c) array in the varlen layout, as (heads, total, c)."""
    out = np.empty((x.shape[0] * x.shape[1], x.shape[2]), x.dtype)
    out[rows.ravel()] = x.reshape(x.shape[0] * x.shape[1], x.shape[2])
    return out.reshape(x.shape[1], x.shape[0], x.shape[2])


def _packed_call(call: _Varlen, causal, scale, window, softcap, dropout_p, dropout_seed):
    """The whole varlen batch as one Call in attn.h's varlen layout (Features with the
    cu_seqlens), and the row maps of q's and k's tokens; None where there are no queries
    or no keys at all (nothing for a kernel to do), or Dv = 0 (no kernel runs; each
    sequence's lse comes from its own call)."""
    if call.q.shape[0] == 0 or call.k.shape[0] == 0 or call.v.shape[2] == 0:
        return None
    rows_q, rows_k = _packed_rows(call.cu_q, call.q.shape[1]), _packed_rows(call.cu_k, call.k.shape[1])
    whole = validate(_to_layout(call.q, rows_q), _to_layout(call.k, rows_k), _to_layout(call.v, rows_k),
                     causal=causal, scale=scale, check_finite=False, window=window, softcap=softcap,
                     dropout_p=dropout_p, dropout_seed=dropout_seed)
    on, align = _causal(causal)
    f = whole.features
    masked = on or f.window_left >= 0 or f.window_right >= 0
    features = dataclasses.replace(f, align=align if masked else "top_left", cu_seqlens_q=call.cu_q,
                                   cu_seqlens_k=call.cu_k)
    if call.slopes is not None:
        features = dataclasses.replace(features, alibi=call.slopes.reshape(-1),
                                       alibi_seq_stride=call.q.shape[1] if call.slopes.ndim == 2 else 0)
    return dataclasses.replace(whole, features=features), rows_q, rows_k


def _packed_kernel(packed, kernel, backward: bool):
    """The kernel that runs a packed varlen call in one go (it has "varlen", forward and
    with backward its backward), or None: attention_varlen then runs one call per sequence."""
    if packed is None:
        return None
    needs = packed[0].needs
    dtype = packed[0].q.dtype.name
    chosen = _auto(False, dtype, True, backward, needs) if kernel == "auto" else _registry.get(kernel)
    has = chosen.features_of_backward() if backward else chosen.features
    return chosen if "varlen" in has and not chosen.not_supported_reasons(
        dtype=dtype, return_lse=True, backward=backward, features=needs) else None


def _heads_first(x, lo, hi):
    """Rows [lo, hi) of a packed (total, heads, D) array as (heads, hi - lo, D)."""
    return np.ascontiguousarray(x[lo:hi].transpose(1, 0, 2))


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, *, causal=False,
                     scale=None, window=None, softcap=None, dropout_p=0.0, dropout_seed=None, kernel="auto",
                     return_lse=False, alibi_slopes=None, **params):
    """attention() of packed variable-length sequences, FlashAttention's
    flash_attn_varlen_func layout: q (total_q, H, D), k (total_k, H_kv, D), v
    (total_k, H_kv, Dv); sequence s is q[cu_seqlens_q[s]:cu_seqlens_q[s + 1]] with
    k, v[cu_seqlens_k[s]:cu_seqlens_k[s + 1]] (cu_seqlens int32/int64, from 0, non-
    decreasing, ending at total). Returns out (total_q, H, Dv) and with return_lse
    also lse (H, total_q), as FlashAttention's softmax_lse. causal True / "top_left"
    aligns each sequence's diagonal top-left (torch's), "bottom_right" bottom-right
    (FlashAttention's default for varlen causal: pass it to match flash_attn); window,
    softcap and dropout as attention()'s, per sequence, the Philox counters of
    dropout being (head, packed query index, packed key index); alibi_slopes (H,) or
    (nseq, H) as FlashAttention's, per sequence. max_seqlen_q/k are
    checked (>= the longest sequence) and otherwise unused. A kernel with "varlen"
    (kernel_info(name)["features"]: native.flash) runs the whole batch in one call,
    scheduling (sequence, head, query block) work items (no padding work, no block
    across sequences); any other kernel runs one (H, len, D) call per sequence.
    torch CPU tensors give torch tensors, differentiable through
    attention_varlen_backward."""
    _fp8.refuse(("q", q), ("k", k), ("v", v), what="attention_varlen")
    torch_inputs = _is_torch(q) or _is_torch(k) or _is_torch(v)
    seed = _draw_seed(dropout_p, dropout_seed, torch_inputs)
    kw = {"causal": causal, "scale": scale, "window": window, "softcap": softcap, "dropout_p": dropout_p,
          "dropout_seed": seed, "kernel": kernel, "alibi_slopes": alibi_slopes}
    if torch_inputs:
        return _torch_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, return_lse, kw, params)
    check_finite = params.pop("check_finite", True)
    call = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes)
    heads, dv = call.q.shape[1], call.v.shape[2]
    out = np.zeros((call.q.shape[0], heads, dv), call.q.dtype)
    lse = np.full((heads, call.q.shape[0]), -np.inf, call.q.dtype)
    _dropout(dropout_p, seed, (0, 0))  # checked once, also where no sequence runs
    packed = _packed_call(call, causal, scale, window, softcap, dropout_p, seed)
    whole = _packed_kernel(packed, kernel, backward=False)
    if whole is not None:  # one call: (sequence, head, query block) work items inside the kernel
        chosen, resolved = choose(packed[0], whole.name, params, return_lse=True)
        got, got_lse = run(packed[0], chosen, resolved, check_finite=check_finite, return_lse=True)
        rows = packed[1]
        out = got.reshape(-1, dv)[rows]
        lse = got_lse.reshape(-1)[rows].T.copy()
        return (out, lse) if return_lse else out
    for s in range(call.cu_q.size - 1):
        (q0, q1), (k0, k1) = call.cu_q[s:s + 2], call.cu_k[s:s + 2]
        if q1 == q0 or k1 == k0:  # no queries, or no keys: out 0, lse -inf
            continue
        sq, sk, sv = (_heads_first(x, a, b) for x, a, b in ((call.q, q0, q1), (call.k, k0, k1), (call.v, k0, k1)))
        seq = validate(sq, sk, sv, causal=kw["causal"], scale=scale, check_finite=False, window=window,
                       softcap=softcap, dropout_p=dropout_p, dropout_seed=seed, dropout_offset=(int(q0), int(k0)),
                       alibi_slopes=_seq_slopes(call, s))
        chosen, resolved = choose(seq, kernel, params, return_lse=True)
        got, got_lse = run(seq, chosen, resolved, check_finite=check_finite, return_lse=True)
        out[q0:q1] = got.transpose(1, 0, 2)
        lse[:, q0:q1] = got_lse
    return (out, lse) if return_lse else out


def attention_varlen_backward(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None,
                              max_seqlen_k=None, *, causal=False, scale=None, window=None, softcap=None,
                              dropout_p=0.0, dropout_seed=None, kernel="auto", return_lse=False, alibi_slopes=None,
                              **params):
    """(dq, dk, dv) of attention_varlen(q, k, v, ...) given the output's gradient dout
    (total_q, H, Dv): out and lse (H, total_q) as attention_varlen(...,
    return_lse=True) returned them, the same keywords (dropout_seed required with
    dropout). dk and dv have k's and v's shapes. return_lse is accepted for symmetry
    with attention_varlen and ignored."""
    _fp8.refuse(("q", q), ("k", k), ("v", v), what="attention_varlen_backward")
    kw = {"causal": causal, "scale": scale, "window": window, "softcap": softcap, "dropout_p": dropout_p,
          "dropout_seed": dropout_seed, "kernel": kernel, "alibi_slopes": alibi_slopes}
    arrays = (q, k, v, out, dout, lse)
    if any(_is_torch(x) for x in arrays):
        import torch

        _torch_api.check_tensors(arrays, "q, k, v, out, dout, lse")
        grads = attention_varlen_backward(*_torch_api.views([x.contiguous() for x in arrays]), cu_seqlens_q,
                                          cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw, **params)
        return tuple(torch.from_numpy(g) for g in grads)
    call = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes)
    heads, total_q, dvn = call.q.shape[1], call.q.shape[0], call.v.shape[2]
    out = check_like(out, "out", (total_q, heads, dvn), call.q.dtype)
    dout = check_like(dout, "dout", (total_q, heads, dvn), call.q.dtype)
    lse = check_like(lse, "lse", (heads, total_q), call.q.dtype)
    _dropout(dropout_p, dropout_seed, (0, 0))
    packed = _packed_call(call, causal, scale, window, softcap, dropout_p, dropout_seed)
    whole = _packed_kernel(packed, kernel, backward=True)
    if whole is not None:
        pc, rows_q, rows_k = packed
        chosen, resolved = choose(pc, whole.name, params, return_lse=True, backward=True)
        _check_backward_dtype(chosen, pc.q.dtype.name)
        lse_p = np.empty(heads * total_q, call.q.dtype)
        lse_p[rows_q.ravel()] = lse.T.reshape(-1)
        grads = chosen.backward(pc.q, pc.k, pc.v, _to_layout(out, rows_q), _to_layout(dout, rows_q),
                                lse_p.reshape(heads, total_q), pc.causal, pc.scale, **pc.feature_args(), **resolved)
        return tuple(g.reshape(-1, g.shape[2])[rows] for g, rows in zip(grads, (rows_q, rows_k, rows_k)))
    dq, dk, dv = np.zeros_like(call.q), np.zeros_like(call.k), np.zeros_like(call.v)
    for s in range(call.cu_q.size - 1):
        (q0, q1), (k0, k1) = call.cu_q[s:s + 2], call.cu_k[s:s + 2]
        if q1 == q0 or k1 == k0:
            continue
        seq = [_heads_first(x, a, b) for x, a, b in ((call.q, q0, q1), (call.k, k0, k1), (call.v, k0, k1),
                                                      (out, q0, q1), (dout, q0, q1))]
        call_s = validate(*seq[:3], causal=causal, scale=scale, check_finite=False, window=window, softcap=softcap,
                          dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=(int(q0), int(k0)),
                          alibi_slopes=_seq_slopes(call, s))
        chosen, resolved = choose(call_s, kernel, params, return_lse=True, backward=True)
        _check_backward_dtype(chosen, call_s.q.dtype.name)
        g = chosen.backward(call_s.q, call_s.k, call_s.v, seq[3], seq[4], np.ascontiguousarray(lse[:, q0:q1]),
                            call_s.causal, call_s.scale, **call_s.feature_args(), **resolved)
        for full, part, a, b in ((dq, g[0], q0, q1), (dk, g[1], k0, k1), (dv, g[2], k0, k1)):
            full[a:b] = part.transpose(1, 0, 2)
    return dq, dk, dv


def _torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, return_lse, kw, params):
    """attention_varlen on CPU torch tensors: torch out, differentiable where an input
    requires grad (through attention_varlen_backward)."""
    import torch

    _torch_api.check_tensors((q, k, v), "q, k, v")
    if any(x.is_cuda for x in (q, k, v)):
        raise TypeError("attention_varlen runs on the CPU: pass CPU tensors")

    def forward(q, k, v):
        out, lse = attention_varlen(*_torch_api.views((q, k, v)), cu_q, cu_k, max_q, max_k, return_lse=True, **kw,
                                    **params)
        return torch.from_numpy(out), torch.from_numpy(lse)

    class Varlen(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = forward(q, k, v)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, _dlse):
            q, k, v, out, lse = ctx.saved_tensors
            return attention_varlen_backward(q.detach(), k.detach(), v.detach(), out, dout.contiguous(), lse, cu_q,
                                             cu_k, max_q, max_k, **kw, **params)

    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        out, lse = Varlen.apply(q, k, v)
    else:
        out, lse = forward(q, k, v)
    return (out, lse) if return_lse else out
