"""FP8 (float8 e4m3) attention on Hopper, a frontend beside _torch_api: attention() hands it
torch CUDA tensors of dtype torch.float8_e4m3fn, with their per-tensor descales, and it runs
cuda.flash's FP8 forward (flash_wgmma.cu's ATTNKERN_FP8 variant, cpp.flash_fp8_launch):
output in bfloat16. quantize_fp8 makes such inputs from wider ones (per-tensor scales amax / 448,
optionally after an orthonormal Hadamard rotation of q and k: q H (k H)^T = q k^T, and the
rotation spreads a few large channels over all of them before the rounding to e4m3).

What FP8 has: D = Dv = 128, causal (top-left and bottom-right), grouped k/v heads, return_lse.
Everything else (other head sizes, windows, key lengths, softcap, masks, ALiBi, dropout, varlen,
tunables, a backward) is refused with a ValueError that names it, and so is a GPU without FP8
wgmma (compute capability other than 9.0: Hopper's sm_90a)."""

from __future__ import annotations

import math
import threading
from typing import NamedTuple

E4M3_MAX = 448.0  # the largest finite float8 e4m3fn value
FP8_CAPABILITY = (9, 0)  # wgmma with e4m3 operands is sm_90a's (Hopper's) only
FP8_DTYPE = "float8_e4m3fn"  # torch's name of the dtype


class Fp8Inputs(NamedTuple):
    """quantize_fp8's result: e4m3 tensors and the per-tensor descales (Python floats, or with
    device_scales one-element float32 tensors on the inputs' device) that attention(q, k, v,
    descale_q=..., descale_k=..., descale_v=...) takes: x ~ x8 * descale_x."""

    q: object
    k: object
    v: object
    descale_q: float
    descale_k: float
    descale_v: float

    def kwargs(self) -> dict:
        """The descales as attention()'s keywords."""
        return {"descale_q": self.descale_q, "descale_k": self.descale_k, "descale_v": self.descale_v}


def is_fp8(x) -> bool:
    """Whether x is a torch tensor of a float8 dtype (without importing torch)."""
    return "float8" in str(getattr(x, "dtype", ""))


def refuse(*named, what: str) -> None:
    """TypeError where any of the (name, array) pairs is a float8 tensor: FP8 has attention()'s
    forward only (no backward, no varlen)."""
    for name, x in named:
        if is_fp8(x):
            raise TypeError(f"{what} has no FP8: {name} is {x.dtype}; float8_e4m3fn runs attention()'s forward "
                            "only (cuda.flash on Hopper, with descale_q/k/v)")


def hadamard_matrix(d: int, device=None, dtype=None):
    """The orthonormal Hadamard matrix of size d (a power of two), Sylvester's construction
    scaled by 1 / sqrt(d): H H^T = I, H symmetric, a torch tensor (float32 unless dtype)."""
    import torch

    if not isinstance(d, int) or d < 1 or d & (d - 1):
        raise ValueError(f"a Hadamard matrix needs a size that is a power of two, not {d!r}")
    h = torch.ones((1, 1), dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / math.sqrt(d)).to(device=device, dtype=dtype or torch.float32)


def _scale_of(x) -> float:
    """x's per-tensor scale: its largest magnitude over E4M3_MAX (1 for an all-zero tensor)."""
    amax = float(x.abs().amax()) if x.numel() else 0.0
    if not math.isfinite(amax):
        raise ValueError("quantize_fp8: the input has NaN or inf")
    return amax / E4M3_MAX if amax > 0 else 1.0


def _device_scale_of(x):
    """_scale_of as a one-element float32 tensor on x's device, with no host read: NaN for an input
    with NaN or inf (attention's check_finite scan of the e4m3 inputs then reports it)."""
    import torch

    amax = x.abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).reshape(1)


def quantize_fp8(q, k, v, *, hadamard: bool = False, device_scales: bool = False) -> Fp8Inputs:
    """q, k, v (torch tensors of a float dtype, (..., N, D)) as float8 e4m3 with per-tensor scales
    (amax / 448: the largest magnitude maps to e4m3's largest value), rounded to nearest. hadamard:
    q and k are rotated first by the orthonormal Hadamard matrix of size D (q H, k H; D a power of
    two), which leaves q k^T unchanged and spreads outlier channels before the rounding (v is not
    rotated: the output would be rotated too). Returns Fp8Inputs(q8, k8, v8, descale_q, descale_k,
    descale_v); attention(*r[:3], **r.kwargs()) runs them. device_scales: the descales stay on the
    inputs' device as one-element float32 tensors, views of one (3,) tensor whose address the kernel
    takes as is (no host read: nothing waits for the GPU; an input
    with NaN or inf is then found by attention's check_finite scan, not here), which attention's
    kernel reads there."""
    import torch

    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or is_fp8(x):
            raise TypeError(f"quantize_fp8: {name} must be a torch tensor of float32, float16 or bfloat16, "
                            f"not {getattr(x, 'dtype', type(x).__name__)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"quantize_fp8: q and k must have one head size, not {q.shape[-1]} and {k.shape[-1]}")
    if hadamard:
        h = hadamard_matrix(q.shape[-1], q.device)
        q, k = (x.float() @ h for x in (q, k))
    if device_scales:  # one (3,) tensor, its elements the descales: attention() passes its address as is
        both = torch.cat([_device_scale_of(x) for x in (q, k, v)])
        scales = [both[i:i + 1] for i in range(3)]
    else:
        scales = [_scale_of(x) for x in (q, k, v)]
    out = [(x.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn) for x, s in zip((q, k, v), scales)]
    return Fp8Inputs(*out, *scales)


# attention()'s feature keywords, none of which FP8 has (dropout_p: any nonzero value)
_FEATURE_NAMES = ("window", "key_lengths", "softcap", "attn_mask", "alibi_slopes")


def _descale(value, name: str, device):
    """A descale as a positive finite float (a Python number or a one-element tensor on the host), or
    a one-element floating tensor on the inputs' CUDA device as a float32 scalar tensor, unread (the
    kernel reads it; one that is not positive and finite makes the output NaN)."""
    import torch

    if value is None:
        raise ValueError(f"FP8 inputs need their descales: {name}= is missing (quantize_fp8 gives them; 1.0 "
                         "for values stored unscaled)")
    if isinstance(value, torch.Tensor) and value.is_cuda:
        if value.numel() != 1 or not value.is_floating_point() or value.device != device:
            raise ValueError(f"{name} as a CUDA tensor must have one element of a floating dtype on the inputs' "
                             f"device {device}, not {tuple(value.shape)} {value.dtype} on {value.device}")
        return value.reshape(()).float()
    try:
        out = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name} must be a number or a one-element tensor, not {type(value).__name__}") from None
    if not (math.isfinite(out) and out > 0):
        raise ValueError(f"{name} must be positive and finite, not {out}")
    return out


def check(q, k, v, causal, scale, kernel, feats: dict, params: dict, descales: tuple) -> tuple:
    """Validates an FP8 call; returns (align, scale, kv_group, descales) or raises a ValueError or
    TypeError that says what to fix. descales: three floats, or, where any was given as a CUDA
    tensor, the three as a (3,) float32 tensor on the inputs' device (read by the kernel alone)."""
    import torch

    if kernel not in ("auto", "cuda.flash"):
        raise ValueError(f"FP8 (float8_e4m3fn) inputs run on cuda.flash only, not {kernel!r}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"FP8 inputs must all be torch tensors: {name} is a {type(x).__name__}")
        if x.dtype != torch.float8_e4m3fn:
            raise TypeError(f"FP8 attention takes q, k and v all of dtype torch.float8_e4m3fn: {name} is "
                            f"{x.dtype} (quantize_fp8 converts)")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not x.is_cuda:
            raise ValueError(f"FP8 inputs must be CUDA tensors: {name} is on {x.device}")
        if x.requires_grad:
            raise ValueError("cuda.flash has no FP8 backward: FP8 inputs must not require grad")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, not {q.device}, {k.device}, {v.device}")
    capability = torch.cuda.get_device_capability(q.device)
    if tuple(capability) != FP8_CAPABILITY:
        raise ValueError(f"cuda.flash's FP8 forward needs Hopper's FP8 wgmma (compute capability 9.0, sm_90a); "
                         f"{torch.cuda.get_device_name(q.device)} has compute capability "
                         f"{capability[0]}.{capability[1]}: use bfloat16 or float16 there")
    if not 2 <= q.ndim <= 4 or not q.ndim == k.ndim == v.ndim:
        raise ValueError(f"q, k, v must be (N, D), (H, N, D) or (B, H, N, D) alike, not ranks {q.ndim}, {k.ndim}, "
                         f"{v.ndim}")
    if k.shape != v.shape:
        raise ValueError(f"FP8: k and v must have one shape, not {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[-1] != 128 or k.shape[-1] != 128:
        raise ValueError(f"cuda.flash's FP8 forward takes head size D = Dv = 128 only, not D={q.shape[-1]}, "
                         f"Dv={v.shape[-1]}")
    if q.ndim == 4 and q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have one batch size, not {q.shape[0]} and {k.shape[0]}")
    heads, kv_heads = (q.shape[-3], k.shape[-3]) if q.ndim >= 3 else (1, 1)
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(f"k/v heads ({kv_heads}) must divide q's heads ({heads})")
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        if not x.is_contiguous():
            raise ValueError(f"FP8: {name} must be contiguous (pass {name}.contiguous())")
        if x.data_ptr() % 16:  # the kernels' 16-byte copies and the TMA's tensor maps
            raise ValueError(f"FP8: {name} must start at a 16-byte aligned address (pass {name}.clone())")
    given = [n for n, val in feats.items() if n in _FEATURE_NAMES and val is not None]
    if feats.get("dropout_p"):
        given.append("dropout_p")
    if given:
        raise ValueError(f"cuda.flash's FP8 forward has causal masking (top-left, bottom-right) and grouped k/v "
                         f"heads only: {', '.join(given)} is not supported in FP8 (use bfloat16)")
    if params:
        raise ValueError(f"cuda.flash's FP8 forward has no tunables: {', '.join(sorted(params))} given")
    if causal not in (False, True, "top_left", "bottom_right"):
        raise ValueError(f"causal must be False, True, 'top_left' or 'bottom_right', not {causal!r}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number, not {scale!r}")
    ds = tuple(_descale(x, n, q.device) for x, n in zip(descales, ("descale_q", "descale_k", "descale_v")))
    if any(isinstance(x, torch.Tensor) for x in ds):  # read by the kernel: the three in one device array
        if all(isinstance(x, torch.Tensor) for x in ds):  # consecutive elements of one tensor: used in place
            ds = _device_descales(ds, q.device)
        else:
            ds = torch.stack([x if isinstance(x, torch.Tensor) else torch.full((), x, device=q.device)
                              for x in ds])
    return ("bottom_right" if causal == "bottom_right" else "top_left"), float(scale), heads // kv_heads, ds


def attention(q, k, v, causal, scale, kernel, feats: dict, params: dict, descales: tuple, return_lse: bool,
              check_finite: bool):
    """attention() on FP8 torch CUDA tensors (see the module's docstring): bfloat16 out (and lse)."""
    import numpy as np
    import torch

    from ._gpuarray import GpuArray, raw_stream
    from .backends.cuda import cpp, launch

    key = _plan_key(q, k, v, causal, scale, kernel, feats, params, descales, return_lse, check_finite)
    plans = _plans()
    plan = plans.get(key) if key is not None else None
    if plan is not None:
        got = plan.run(q, k, v, descales, check_finite)
        if got is not None:
            return got
    align, scale, group, descales = check(q, k, v, causal, scale, kernel, feats, params, descales)
    on_device = isinstance(descales, torch.Tensor)  # (3,) float32 on the GPU: the kernel multiplies them in
    dq, dk, dv = (1.0, 1.0, 1.0) if on_device else descales
    if check_finite:  # e4m3fn has no infinity; NaN is every bit of exponent and mantissa set
        for name, x in (("q", q), ("k", k), ("v", v)):
            if bool(((x.view(torch.uint8) & 0x7F) == 0x7F).any()):
                raise ValueError(f"{name} has NaN (pass check_finite=False to skip this scan)")
    lead, nq, nk, d = q.shape[:-2], q.shape[-2], k.shape[-2], q.shape[-1]
    rows, rows_kv = math.prod(lead), math.prod(k.shape[:-2])
    out = torch.empty((*lead, nq, d), dtype=torch.bfloat16, device=q.device)
    lse = torch.empty((*lead, nq), dtype=torch.bfloat16, device=q.device) if return_lse else None
    if rows == 0 or nq == 0 or nk == 0:
        out.zero_()
        if lse is not None:
            lse.fill_(-math.inf)
        return (out, lse) if return_lse else out
    with torch.cuda.device(q.device):
        def view(x, shape):
            return GpuArray(shape, np.uint8, None, ptr=x.data_ptr(), owner=x)

        if cpp.FP8_VT_KERNEL:  # V^T by flash_fp8_vt.cu below, on the legacy default stream as the kernel
            nkp = -(-nk // cpp.FP8_VT_KEYS) * cpp.FP8_VT_KEYS
            vt = torch.empty((rows_kv, d, nkp), dtype=torch.uint8, device=q.device)
        else:  # by a torch copy, on torch's stream
            vt = cpp.fp8_transpose_v(v.reshape(rows_kv, nk, d), cpp.FP8_VT_KEYS)
        if raw_stream(q.device.index):  # the kernels run on the legacy default stream: torch's work first
            torch.cuda.current_stream(q.device).synchronize()
        if cpp.FP8_VT_KERNEL:
            kernel, grid, block, args = cpp.fp8_vt_launch(view(v, (rows_kv, nk, d)), view(vt, tuple(vt.shape)))
            launch.launch(kernel, grid, block, *args)

        feat = None
        if group > 1 or align == "bottom_right":
            feat = launch.KernelFeatures(group, None, rows, int(align == "bottom_right"), -1, -1, 0.0)
        args = cpp.flash_fp8_launch(view(q, (rows, nq, d)), view(k, (rows_kv, nk, d)), view(vt, tuple(vt.shape)),
                                    view(out, (rows, nq, d)), None if lse is None else view(lse, (rows, nq)),
                                    bool(causal), scale * dq * dk * launch.LOG2E, dv / cpp.FP8_P_SCALE, feat,
                                    descales=GpuArray((3,), np.float32, None, ptr=descales.data_ptr(), owner=descales)
                                    if on_device else None)
        launch.launch(*args[:3], *args[3])
        if raw_stream(q.device.index):  # V^T must outlive the kernel: torch's stream may reuse its memory
            torch.cuda.synchronize(q.device)
        elif key is not None and plan is None:
            made = _Plan.make(rows, rows_kv, nq, nk, d, tuple(vt.shape), bool(causal), scale * dq * dk,
                              dv, feat, on_device, out.shape, None if lse is None else lse.shape)
            if made is not None:
                if len(plans) >= 64:  # many shapes in turn: start over rather than keep them all
                    plans.clear()
                plans[key] = made
    if check_finite and not bool(torch.isfinite(out).all()):
        raise FloatingPointError("FP8 attention gave a non-finite output (descales too large for bfloat16, or, "
                                 "given as CUDA tensors, not positive and finite?)")
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------- per-shape plans

_LOCAL = threading.local()  # per thread: (the cuda backend's plan epoch, {key: _Plan})


def _plans() -> dict:
    """This thread's FP8 plans, emptied when the cuda backend's forget_plans() was called since they
    were made (as _torch_cuda's)."""
    from .backends import cuda

    epoch = cuda.PLANS_EPOCH[0]
    got = getattr(_LOCAL, "plans", None)
    if got is None or got[0] != epoch:
        got = (epoch, {})
        _LOCAL.plans = got
    return got[1]


def _plan_key(q, k, v, causal, scale, kernel, feats, params, descales, return_lse, check_finite):
    """The key of a call's plan, or None where the call is not planned (features, tunables,
    arguments whose equality is not their identity for the call). Everything check() decides from
    other than the tensors' addresses, grad and the descale tensors' values is in it: shapes,
    dtypes, device, causal, scale, kernel, the host descales' values (device ones as "device"), and
    cpp's FP8 settings (a measurement swaps cpp.FP8_DEFAULT and cpp.FP8_VT_KERNEL between calls)."""
    import torch

    from .backends.cuda import cpp

    if params or any(feats.get(n) is not None for n in _FEATURE_NAMES) or feats.get("dropout_p"):
        return None
    if type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None
    if (causal is not True and causal is not False and causal != "top_left" and causal != "bottom_right") \
            or type(kernel) is not str or not (scale is None or type(scale) in (float, int)):
        return None
    kinds = []
    for x in descales:
        if type(x) is float or type(x) is int:
            kinds.append(x)
        elif type(x) is torch.Tensor and x.is_cuda:
            kinds.append("device")
        else:
            return None
    return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, causal, scale, kernel, tuple(kinds),
            bool(return_lse), bool(check_finite), cpp.FP8_DEFAULT, cpp.FP8_VT_KERNEL)


class _Plan:
    """An FP8 call shape's launches with everything fixed but the addresses (launch.Prepared): the
    V^T kernel's (v, V^T) and the attention kernel's (q, k, V^T, out, lse, descales), made after
    the shape's first call went through check() and the general launches (which compiled the
    kernels). A later call of the key checks what the key cannot know (devices, contiguity, 16-byte
    alignment, grad, the descale tensors, torch's current stream), allocates out, lse and V^T with
    torch and launches: the host's work a call is two Prepared calls, not check(), two argument
    layouts and the tensor maps' lookups by shape."""

    __slots__ = ("vt_launch", "main", "vt_shape", "out_shape", "lse_shape", "on_device")

    @classmethod
    def make(cls, rows, rows_kv, nq, nk, d, vt_shape, causal, scale, dv, feat, on_device, out_shape, lse_shape):
        """The plan, or None where a kernel has no raw launch (the simulator, the torch V^T copy)."""
        import numpy as np

        from ._gpuarray import GpuArray
        from .backends.cuda import cpp, launch

        if not cpp.FP8_VT_KERNEL:
            return None
        v_, vt_ = GpuArray((rows_kv, nk, d), np.uint8, None, ptr=0), GpuArray(vt_shape, np.uint8, None, ptr=0)
        q_, k_ = GpuArray((rows, nq, d), np.uint8, None, ptr=0), GpuArray((rows_kv, nk, d), np.uint8, None, ptr=0)
        out_, lse_ = GpuArray((rows, nq, d), np.uint8, None, ptr=0), GpuArray((rows, nq), np.uint8, None, ptr=0)
        ds_ = GpuArray((3,), np.float32, None, ptr=0)
        vt_kernel, grid, block, vt_args = cpp.fp8_vt_launch(v_, vt_)
        kernel, mgrid, mblock, margs = cpp.flash_fp8_launch(
            q_, k_, vt_, out_, None if lse_shape is None else lse_, causal, scale * launch.LOG2E,
            dv / cpp.FP8_P_SCALE, feat, descales=ds_ if on_device else None)
        raw_vt, raw = launch.raw_kernel(vt_kernel), launch.raw_kernel(kernel)
        if raw_vt is None or raw is None:
            return None
        # the tensor maps' arrays are views of k and V^T made by flash_fp8_launch: their roles are theirs
        maps = [a.array for a in margs if isinstance(a, launch.TensorMap)]
        k_role, vt_role = maps if len(maps) == 2 else (k_, vt_)
        plan = cls()
        plan.vt_launch = launch.Prepared(raw_vt, grid, block, vt_args, (v_, vt_))
        plan.main = launch.Prepared(raw, mgrid, mblock, margs, (q_, k_role, vt_role, out_, lse_, ds_))
        plan.vt_shape, plan.out_shape, plan.lse_shape, plan.on_device = vt_shape, out_shape, lse_shape, on_device
        return plan

    def run(self, q, k, v, descales, check_finite):
        """The planned call's result, or None where the general way must run (it then raises
        what is wrong, worded in one place, or runs a call this plan cannot)."""
        import torch

        from ._gpuarray import raw_stream

        device = q.device
        # the launches go to the current device's context, on the legacy default stream
        if k.device != device or v.device != device or device.index != torch.cuda.current_device() \
                or raw_stream(device.index):
            return None
        if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
            return None
        if q.requires_grad or k.requires_grad or v.requires_grad:
            return None
        ptrs = [q.data_ptr(), k.data_ptr(), v.data_ptr()]
        if any(p % 16 for p in ptrs):
            return None
        ds_ptr = 0
        if self.on_device:
            ds = _device_descales(descales, device)
            if ds is None:
                return None
            ds_ptr = ds.data_ptr()
        if check_finite:  # as attention() below
            for name, x in (("q", q), ("k", k), ("v", v)):
                if bool(((x.view(torch.uint8) & 0x7F) == 0x7F).any()):
                    raise ValueError(f"{name} has NaN (pass check_finite=False to skip this scan)")
        out = torch.empty(self.out_shape, dtype=torch.bfloat16, device=device)
        lse = None if self.lse_shape is None else torch.empty(self.lse_shape, dtype=torch.bfloat16, device=device)
        # from torch's caching allocator on the legacy default stream, the launches' stream: a later
        # reuse of this memory is queued after them
        vt = torch.empty(self.vt_shape, dtype=torch.uint8, device=device)
        self.vt_launch(ptrs[2], vt.data_ptr())
        self.main(ptrs[0], ptrs[1], vt.data_ptr(), out.data_ptr(),
                  out.data_ptr() if lse is None else lse.data_ptr(), ds_ptr)
        if check_finite and not bool(torch.isfinite(out).all()):
            return None  # the general way runs the call again and raises its error
        return (out, lse) if lse is not None else out


def _device_descales(descales, device):
    """The three CUDA descales as one (3,) float32 tensor, or None where one is not a one-element
    floating CUDA tensor on `device`: three consecutive float32 elements of one tensor (as
    quantize_fp8(device_scales=True) makes them) are used in place, others are stacked."""
    import torch

    for x in descales:
        if type(x) is not torch.Tensor or x.device != device or x.numel() != 1 or not x.is_floating_point():
            return None
    dq, dk, dv = descales
    base = dq.data_ptr()
    if (dq.dtype == dk.dtype == dv.dtype == torch.float32 and dk.data_ptr() == base + 4
            and dv.data_ptr() == base + 8 and dq.untyped_storage().data_ptr() == dv.untyped_storage().data_ptr()):
        return dq
    return torch.stack([x.reshape(()).float() for x in descales])
