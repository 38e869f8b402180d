"""The frontend's fast path for device-resident torch tensors, beside the other
frontends (not in a backend): attention() on torch CUDA tensors for cuda.flash
and triton.flash,
with the Python work per call cut to what changes between calls of one shape:
the addresses.

The first call of each (shapes, dtypes, device, causal, scale, kernel, tunables,
check_finite, return_lse) goes through the core's general path (validation,
kernel choice, tuned parameters, compilation): attention() returns a Pending,
and the core, having run the call, hands Pending.plan its validated call, kernel
and tunables, which leave a plan: the kernel's launch prepared (launch.Prepared:
parameters laid out once, the addresses written in per call), the output shapes
and, with check_finite, the scan of q, k, v and the output prepared likewise.
Later calls check what the plan cannot know (tensor types, grad, devices,
contiguity, torch's current stream, alignment), allocate the outputs with torch
and launch; a call without features outside autograd, torch.compile and autocast
reaches its plan from attention()'s first line (quick()), before the checks the plan
already made for its shape. A call on a split-K decode path (grouped k/v heads and bottom-right
causal masking at most: backends._split.PREPARED_FEATURES) has two launches and
scratch memory, allocated with torch per call on the legacy default stream (on
another stream such a call takes the general path). Anything else, any other
kernel and any call with no work (an empty dimension) returns None: the general
path runs. A non-finite flag also returns
None: the general path runs the call again and raises its error, worded in one
place. Plans are per thread (their parameter memory is written per call); one
whose tunables were not all given is rebuilt after a second, as the general
path looks up tuned parameters at most once a second per call shape."""

from __future__ import annotations

import math
import numbers
import threading
import time

from ._gpuarray import raw_stream

FAST_PATH = True  # False: every call takes the general path (measurements compare the two)
RECHECK_S = 1.0  # how long a plan with looked-up tunables is used before it is rebuilt
_LOCAL = threading.local()  # per thread: key -> Plan
_TORCH = []  # the torch module, imported on first use


def _torch():
    if not _TORCH:
        import torch

        _TORCH.append(torch)
    return _TORCH[0]


class Plan:
    """A call shape's prepared work; launch None: the general path's."""

    __slots__ = ("launch", "scan", "aligned", "stream", "out_shape", "lse_shape", "until", "scratch", "backward")

    def __init__(self, launch=None, scan=None, aligned=None, stream=None, out_shape=(), lse_shape=(),
                 until=math.inf, scratch=0):
        self.launch, self.scan, self.aligned, self.stream = launch, scan, aligned, stream
        self.out_shape, self.lse_shape, self.until = out_shape, lse_shape, until
        self.scratch = scratch  # float32 elements of scratch memory a launch takes (its last address), or 0
        # a differentiable forward's plan: (plans' epoch, thread, the backward's plan of its call
        # shape) once backward() found that plan on that thread
        self.backward = None


def usable() -> bool:
    """Whether the fast path can run here: numba-cuda with a GPU (asked once), and neither
    FAST_PATH nor the cuda backend's public switch (attnkern.backends.cuda.FAST_PATH, which
    the measurement sets) turned it off."""
    if not _USABLE:
        from .backends import cuda

        _USABLE.extend((cuda.unavailable() is None, cuda))
    return FAST_PATH and _USABLE[0] and _USABLE[1].FAST_PATH


_USABLE = []  # [whether numba-cuda has a GPU, the cuda backend module]


def eager_autograd() -> bool:
    """Whether differentiable calls outside torch.compile may skip the custom op's dispatch
    (the cuda backend's public switch attnkern.backends.cuda.EAGER_AUTOGRAD)."""
    if not _USABLE:
        usable()
    return _USABLE[1].EAGER_AUTOGRAD


class Pending:
    """A call with no plan yet: the core runs it through the general path, with
    check_finite=check and return_lse=with_lse (and for a backward call, the
    backward's arguments), then calls plan() with what it chose."""

    __slots__ = ("plans", "key", "check", "with_lse", "params", "backward", "make")

    def __init__(self, plans, key, check, with_lse, params, backward=False, make=None):
        self.plans, self.key, self.check, self.with_lse, self.params = plans, key, check, with_lse, params
        self.backward = backward  # choose a kernel with a backward
        self.make = make or _plan  # the plan's builder: _plan (forward) or _backward_plan

    def plan(self, call, chosen, resolved) -> None:
        """Keeps the plan for the next calls of this shape from the general path's
        validated call, its kernel and tunables."""
        if len(self.plans) >= 256:  # many shapes in turn: start over rather than keep them all
            self.plans.clear()
        self.plans[self.key] = self.make(call, chosen, resolved, self.params, self.with_lse, self.check)
        if not _QUICK:
            torch = _torch()
            _QUICK.extend((torch.Tensor, torch.is_grad_enabled, torch.compiler.is_compiling,
                           torch.is_autocast_enabled, torch.get_autocast_dtype))


def _arguments_fit(causal, scale, kernel, params) -> bool:
    """Whether the call's arguments are of types whose equality is their identity for
    the call (True is not 1 here), so that they can key a plan. A NumPy real scale
    (1 / np.sqrt(d) is a np.float64) keys as the float it equals: refusing it sent every
    such call through the general path, whose host work (0.3-0.5 ms) outlasts the
    kernel at (1, 16, 4096, 128) bfloat16 on an H100."""
    if (causal is not True and causal is not False and not (type(causal) is str and causal == "bottom_right")
            or type(kernel) is not str):
        return False
    if (scale is not None and type(scale) is not float and type(scale) is not int
            and (not isinstance(scale, numbers.Real) or isinstance(scale, bool))):
        return False
    return not (params and any(type(x) is not int for x in params.values()))


def _epoch() -> int:
    """How many times the cuda backend's forget_plans() was called (plans older than that are not used)."""
    return _USABLE[1].PLANS_EPOCH[0] if _USABLE else 0


def _plans(name: str = "plans") -> dict:
    """This thread's plans: the forward's ("plans") or the backward's ("backward_plans"),
    emptied when the cuda backend's forget_plans() was called since they were made."""
    epoch = _epoch()
    got = getattr(_LOCAL, name, None)
    if got is None or got[0] != epoch:
        got = (epoch, {})
        setattr(_LOCAL, name, got)
    return got[1]


def attention(q, k, v, causal, scale, kernel, check_finite, return_lse, params, backward=False):
    """attention(q, k, v, ...) for torch CUDA tensors q (the caller knows that much):
    the result; None where the general path must run; or a Pending where it must
    run and then plan this call shape. backward: the kernel must have a backward
    (the custom op's forward under autograd, which then asks for the lse). Inputs
    that require grad are read as they are: the callers are the custom op, whose
    autograd formula makes the result differentiable, and the eager path, which
    runs only where autograd records nothing."""
    if not usable():
        return None
    torch = _torch()
    tensor = torch.Tensor
    if type(q) is not tensor or type(k) is not tensor or type(v) is not tensor:
        return None
    if not _arguments_fit(causal, scale, kernel, params):
        return None
    device = q.get_device()
    if k.get_device() != device or v.get_device() != device:
        return None
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        return None
    check, with_lse = bool(check_finite), bool(return_lse)
    # (backward last: tests read the kernel at index 9)
    key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, device, causal, scale, kernel, check, with_lse,
           tuple(params.items()), bool(backward))
    plans = _plans()
    plan = plans.get(key)
    if plan is None or plan.until < time.monotonic():
        return Pending(plans, key, check, with_lse, params, bool(backward))
    return _run_plan(plan, q, k, v, device, with_lse)


def quick(q, k, v, causal, scale, kernel, check_finite, return_lse, params):
    """attention()'s first step, before any of its checks, for a call without features on
    torch CUDA tensors whose call shape has a plan (outside torch.compile, and outside autocast
    or with inputs of its dtype: where attention() would run the plan the same way): the
    result, or None where attention()'s whole way must run (it plans a new call shape). On an
    H100 that way's Python steps before the plan took 15 of a call's 45 µs, and 77 of 189 µs
    where the call followed other work (torch's SDPA calls, a wait for the GPU: code and data
    cold), which a timed run of 5 calls at (1, 16, 4096, 128) bfloat16 read as 13% over the
    kernel. A call whose inputs require grad (with the eager autograd path on) gets its plan
    instead (a Plan), which the caller's autograd function runs (run_plan)."""
    if not _QUICK or not usable() or not _USABLE[1].QUICK_PATH:
        return None
    tensor, grad_enabled, compiling, autocast, autocast_dtype = _QUICK
    if type(q) is not tensor or type(k) is not tensor or type(v) is not tensor:
        return None
    grad = grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if grad and not _USABLE[1].EAGER_AUTOGRAD:
        return None
    if compiling() or not _arguments_fit(causal, scale, kernel, params):
        return None
    if autocast("cuda"):
        # in an autocast region, inputs already of its dtype run as outside it: the op's autocast
        # policy and the eager autograd path's cast leave them as they are
        dtype = autocast_dtype("cuda")
        if q.dtype is not dtype or k.dtype is not dtype or v.dtype is not dtype:
            return None
    device = q.get_device()
    if k.get_device() != device or v.get_device() != device or device < 0:
        return None
    if not (q.is_contiguous() and k.is_contiguous() and v.is_contiguous()):
        return None
    check, with_lse = bool(check_finite), bool(return_lse) or grad
    # a differentiable call's forward is planned as the eager autograd path's (with the lse, a
    # kernel with a backward)
    key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, device, causal, scale, kernel, check, with_lse,
           tuple(params.items()), grad)
    plan = _plans().get(key)
    if plan is None or plan.until < time.monotonic():
        return None
    if grad:  # the caller runs the plan inside its autograd function (run_plan)
        return plan if plan.launch is not None else None
    return _run_plan(plan, q, k, v, device, with_lse)


def run_plan(plan, q, k, v):
    """(out, lse) of a plan that quick() returned for a differentiable call, run on its
    inputs (read as they are; the caller's autograd function records the call), or None
    where the general path must run."""
    return _run_plan(plan, q, k, v, q.get_device(), True)


_QUICK = []  # [torch.Tensor, is_grad_enabled, compiler.is_compiling, is_autocast_enabled, get_autocast_dtype]
# once a plan is made


def _run_plan(plan, q, k, v, device, with_lse):
    """The planned call's result, or None where the general path must run."""
    if plan.launch is None:
        return None
    if plan.stream(device):  # not the legacy default stream: its queued work must come first
        if plan.scratch:  # torch would hand the scratch memory out again on that stream: the general path
            return None
        _torch().cuda.current_stream(device).synchronize()
    out = q.new_empty(plan.out_shape)
    ptrs = [q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()]
    if with_lse:
        lse = q.new_empty(plan.lse_shape)
        ptrs.append(lse.data_ptr())
    if plan.aligned is not None and not plan.aligned(*ptrs):
        return None
    if plan.scratch:
        # from torch's caching allocator on the legacy default stream, the launches' stream: a later
        # reuse of this memory is queued after them
        scratch = q.new_empty(plan.scratch, dtype=_torch().float32)
        plan.launch(*ptrs, scratch.data_ptr())
    else:
        plan.launch(*ptrs)
    if plan.scan is not None and plan.scan(*ptrs[:4]):
        return None
    return (out, lse) if with_lse else out


def backward(q, k, v, out, dout, lse, causal, scale, kernel, params, forward_plan=None):
    """attention_backward(q, k, v, out, dout, lse, ...) for torch CUDA tensors q (the
    caller knows that much) without features beyond grouped k/v heads and bottom-right
    causal masking: (dq, dk, dv); None where the general path must run; or a Pending
    where it must run and then plan this call shape. A plan launches cuda.flash's
    tensor-core backward (float16, bfloat16; float32 in 3xTF32) or triton.flash's two
    backward kernels prepared, its gradients and float32 scratch memory allocated with
    torch on the legacy default stream, which the kernels run on (on another stream: the
    general path): no wait for the GPU and no allocation of Numba's.

    forward_plan: the plan that ran the forward of q, k, v (the eager autograd function's,
    out and lse its results): its backward's plan, once found here, is kept on it, so that
    later calls check only dout (autograd hands it in out's dtype, shape and device; its
    layout is checked) instead of looking the plan up."""
    if not usable():
        return None
    tensor = _torch().Tensor
    if forward_plan is not None and forward_plan.backward is not None:
        # (the plan is this thread's and of the plans' current epoch: as _plans() would give it)
        epoch, thread, plan = forward_plan.backward
        if (thread == threading.get_ident() and epoch == _epoch() and plan.until >= time.monotonic()
                and type(dout) is tensor and dout.dtype is out.dtype and dout.shape == out.shape
                and dout.is_contiguous() and dout.get_device() == out.get_device()):
            return _launch_backward(plan, q, k, v, out, dout, lse)
    if (type(q) is not tensor or type(k) is not tensor or type(v) is not tensor or type(out) is not tensor
            or type(dout) is not tensor or type(lse) is not tensor):
        return None
    if not _arguments_fit(causal, scale, kernel, params):
        return None
    device = q.get_device()
    if any(x.get_device() != device or not x.is_contiguous() for x in (k, v, out, dout, lse)) \
            or not q.is_contiguous():
        return None
    key = (q.shape, k.shape, v.shape, out.shape, dout.shape, lse.shape, q.dtype, k.dtype, v.dtype, out.dtype,
           dout.dtype, lse.dtype, device, causal, scale, kernel, tuple(params.items()))
    plans = _plans("backward_plans")
    plan = plans.get(key)
    if plan is None or plan.until < time.monotonic():
        return Pending(plans, key, False, True, params, True, _backward_plan)
    if plan.launch is None:
        return None
    if forward_plan is not None:
        forward_plan.backward = (_epoch(), threading.get_ident(), plan)
    return _launch_backward(plan, q, k, v, out, dout, lse)


def _launch_backward(plan, q, k, v, out, dout, lse):
    """The planned backward's (dq, dk, dv), or None where the general path must run."""
    if plan.stream(q.get_device()):
        return None
    grads = (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), dout.data_ptr(), lse.data_ptr(),
            *(g.data_ptr() for g in grads))
    if not plan.aligned(*ptrs):
        return None
    # from torch's caching allocator on the legacy default stream, the launches' stream: a later
    # reuse of this memory is queued after them
    scratch = q.new_empty(plan.scratch, dtype=_torch().float32)
    plan.launch(*ptrs, scratch.data_ptr())
    return grads


def _backward_plan(call, chosen, resolved, params, *_) -> Plan:
    """backward()'s plan from the general path's validated call (the forward's), its
    kernel and tunables."""
    from .backends._split import PREPARED_FEATURES

    if call.empty or chosen.name not in ("cuda.flash", "triton.flash") or not call.needs <= PREPARED_FEATURES:
        return Plan()
    if chosen.name == "triton.flash":
        from .backends.triton import prepared_backward

        prepared = prepared_backward(call, resolved)
    else:
        from .backends.cuda import prepared_flash_backward

        (batch, nq, d), nk, dv = call.q.shape, call.k.shape[1], call.v.shape[2]
        prepared = prepared_flash_backward(batch, nq, nk, d, dv, call.q.dtype, call.causal, call.scale,
                                           resolved["tensor_cores"], call.features if call.needs else None)
    if prepared is None:
        return Plan(until=time.monotonic() + RECHECK_S)
    looked_up = len(params) < len(chosen.params)  # tunables from the tuning cache or defaults
    return Plan(prepared[0], None, prepared[1], raw_stream, until=time.monotonic() + RECHECK_S if looked_up
                 else math.inf, scratch=prepared[2])


def _plan(call, chosen, resolved, params, with_lse, check) -> Plan:
    from .backends._split import PREPARED_FEATURES
    from .backends.cuda import launch, prepared_flash

    # featured calls take the general path, but those with grouped k/v heads and bottom-right causal
    # masking only (a KV-cache decode step), which the backends prepare on their split-K decode paths
    if call.empty or chosen.name not in ("cuda.flash", "triton.flash") or not call.needs <= PREPARED_FEATURES:
        return Plan()
    (batch, nq, d), nk, dv = call.q.shape, call.k.shape[1], call.v.shape[2]
    if chosen.name == "triton.flash":
        from .backends.triton import prepared as prepared_triton

        prepared = prepared_triton(call, resolved, with_lse)
    else:
        prepared = prepared_flash(batch, nq, nk, d, dv, call.q.dtype, call.causal, call.scale,
                                  resolved["block_q"], resolved["block_k"], resolved["tensor_cores"], with_lse,
                                  resolved["fastmath"], resolved.get("split_k", 0),
                                  call.features if call.needs else None)
    sizes = (call.q.size, call.k.size, call.v.size, math.prod(call.out_shape))
    scan = launch.FiniteScan.prepare(call.q.dtype, sizes) if check else None
    if prepared is None or (check and scan is None):
        return Plan(until=time.monotonic() + RECHECK_S)
    looked_up = len(params) < len(chosen.params)  # tunables from the tuning cache or defaults
    return Plan(prepared[0], scan, prepared[1], raw_stream, call.out_shape,
                 call.out_shape[:-1],
                 time.monotonic() + RECHECK_S if looked_up else math.inf,
                 prepared[2] if len(prepared) > 2 else 0)
