"""The triton backend: triton.flash, a FlashAttention-2 forward and backward
written in Triton (flash.py), float16, bfloat16 and float32, causal or not, with
its log-sum-exp and the features gqa, bottom_right, window, key_lengths and
softcap (forward and backward; masks, dropout and ALiBi are refused).
It runs on an NVIDIA GPU where Triton and torch (whose CUDA
context and streams Triton uses) are installed: `pip install 'attnkern[triton]'`.
Triton is imported on first use.

It takes GPU arrays as attention() hands them to cuda.* kernels (GpuArrays over
torch CUDA tensors, CuPy arrays, ...; see backends/cuda/arrays.py), and NumPy
arrays, which are copied to the GPU through torch and back. Triton launches on
torch's current stream; the prepared launches of _torch_cuda's fast path (prepared:
the forward; prepared_backward: the backward's two kernels, under torch autograd and
attention_backward) on the legacy default stream, as cuda.flash's."""

from __future__ import annotations

import functools
import importlib.util
import threading

import numpy as np

from ..._registry import Kernel, Param, register
from .._split import DECODE_MAX_SPLITS, PREPARED_FEATURES, decode_splits, rows_refusal


@functools.cache
def _unavailable():
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install 'attnkern[triton]')"
    if importlib.util.find_spec("torch") is None:
        return "Triton's launcher needs torch, which is not installed (pip install 'attnkern[triton]')"
    import torch

    if not torch.cuda.is_available():
        return "no usable CUDA GPU (torch.cuda.is_available() is False)"
    return None


class _Pointer:
    """A GPU buffer as Triton takes a tensor argument: its address and dtype."""

    __slots__ = ("ptr", "dtype", "itemsize")

    def __init__(self, ptr: int, dtype_name: str, itemsize: int):
        self.ptr, self.dtype, self.itemsize = ptr, dtype_name, itemsize

    def data_ptr(self) -> int:
        return self.ptr

    def element_size(self) -> int:
        return self.itemsize


def _arg(x):
    """A GpuArray as a Triton argument: the torch tensor it views, else its address."""
    owner = getattr(x, "owner", None)
    if owner is not None and type(owner).__module__.startswith("torch"):
        return owner
    return _Pointer(x.ptr, x.dtype.name, x.dtype.itemsize)


def _torch_dtype(torch, dtype):
    return getattr(torch, np.dtype(dtype).name)


def _lens(features, device):
    """The key lengths as an int64 torch tensor on device, or None where there are none."""
    if features is None or features.key_lengths is None:
        return None
    import torch

    return torch.from_numpy(features.key_lengths).to(device)


_LAST = threading.local()  # per thread: the key chunks of the last triton.flash forward (0: no split)


def last_split() -> int:
    """The number of key chunks triton.flash's last forward on this thread ran on its split-K
    decode path (flash.launch_decode), or 0 where it ran the regular kernel."""
    return getattr(_LAST, "splits", 0)


def _splits(batch: int, batch_kv: int, nq: int, nk: int, split_k: int) -> int:
    """The decode path's key chunks for this call (_split.decode_splits), 0 for the regular
    kernel; a ValueError where split_k >= 2 forces it on a call it cannot take."""
    why = rows_refusal(nq, batch // batch_kv)
    if why is not None:
        if split_k > 1:
            raise ValueError(f"triton.flash: split_k={split_k} asks for the split-K decode path, but {why}; "
                             "pass split_k=0 (automatic) or 1 (off)")
        return 0
    return decode_splits(batch_kv, nq, nk, split_k)


def _run(q, k, v, causal, scale, tensor_cores=1, split_k=0, out=None, lse=None, features=None):
    """out (batch, nq, dv) = attention of (batch, n, d) q and (batch / kv_group, n, d) k, v:
    GpuArrays (out, and lse (batch, nq) when given, are GpuArrays to fill) or NumPy arrays
    (copied to the GPU; the result is returned as a NumPy array, lse filled in place).
    float32 products: 3xTF32 on tensor cores with tensor_cores, else exact float32.
    split_k: the decode path's key chunks (0: by shape, 1: off; _splits)."""
    from . import flash

    (batch, nq, d), (batch_kv, nk, dv) = q.shape, v.shape
    shape = (batch, batch_kv, nq, nk, d, dv, causal, scale, q.dtype.name, tensor_cores, features)
    _LAST.splits = 0
    splits = _splits(batch, batch_kv, nq, nk, split_k)
    if splits:
        return _run_decode(q, k, v, out, lse, features, shape, splits)
    if isinstance(q, np.ndarray):
        import torch

        tq, tk, tv = (_host_to_torch(torch, x) for x in (q, k, v))
        tout = torch.empty((batch, nq, dv), dtype=tq.dtype, device=tq.device)
        tlse = torch.empty((batch, nq), dtype=tq.dtype, device=tq.device) if lse is not None else None
        flash.launch(tq, tk, tv, tout, tlse, _lens(features, tq.device), *shape)
        if tlse is not None:
            lse[...] = _torch_to_host(tlse, lse.dtype)
        return _torch_to_host(tout, q.dtype)
    tq = _arg(q)
    flash.launch(tq, _arg(k), _arg(v), _arg(out), None if lse is None else _arg(lse), _lens(features, _device(tq)),
                 *shape)
    return out


def _run_decode(q, k, v, out, lse, features, shape, splits: int):
    """_run on the split-K decode path (flash.launch_decode) in `splits` chunks, its
    scratch memory from torch's caching allocator on torch's current stream (Triton's)."""
    import torch

    from . import flash

    host = isinstance(q, np.ndarray)
    if host:
        tq, tk, tv = (_host_to_torch(torch, x) for x in (q, k, v))
        tout = torch.empty((shape[0], shape[2], shape[5]), dtype=tq.dtype, device=tq.device)
        tlse = torch.empty((shape[0], shape[2]), dtype=tq.dtype, device=tq.device) if lse is not None else None
    else:
        tq, tk, tv, tout = (_arg(x) for x in (q, k, v, out))
        tlse = None if lse is None else _arg(lse)
    device = _device(tq)

    def scratch(n):
        return torch.empty(n, dtype=torch.float32, device=device)

    _LAST.splits = flash.launch_decode(tq, tk, tv, tout, tlse, _lens(features, device), scratch, splits, *shape)
    if not host:
        return out
    if tlse is not None:
        lse[...] = _torch_to_host(tlse, lse.dtype)
    return _torch_to_host(tout, q.dtype)


def _backward(q, k, v, out, dout, lse, causal, scale, tensor_cores=1, split_k=0, dq=None, dk=None, dv=None,
              features=None):
    """(dq, dk, dv) of attention (as _run) given its out, lse and the output's gradient dout
    (split_k applies to the forward only):
    GpuArrays (dq, dk, dv are GpuArrays to fill, and are returned) or NumPy arrays (copied
    to the GPU and back)."""
    import torch

    from . import flash

    (batch, nq, d), (batch_kv, nk, dv_) = q.shape, v.shape
    shape = (batch, batch_kv, nq, nk, d, dv_, causal, scale, q.dtype.name, tensor_cores, features)
    host = isinstance(q, np.ndarray)
    if host:
        arrays = [_host_to_torch(torch, x) for x in (q, k, v, out, dout, lse)]
        grads = [torch.empty_like(x) for x in arrays[:3]]
    else:
        arrays = [_arg(x) for x in (q, k, v, out, dout, lse)]
        grads = [_arg(x) for x in (dq, dk, dv)]
    device = _device(arrays[0])
    scratch = torch.empty((2, batch, nq), dtype=torch.float32, device=device)  # delta and the float32 lse
    flash.launch_backward(*arrays, *grads, _lens(features, device), scratch[0], scratch[1], *shape)
    if host:
        return tuple(_torch_to_host(g, q.dtype) for g in grads)
    return dq, dk, dv


def _device(x):
    """The torch device of a Triton argument: a tensor's own, else torch's current CUDA device."""
    import torch

    return x.device if isinstance(x, torch.Tensor) else torch.device("cuda", torch.cuda.current_device())


def prepared(call, resolved: dict, with_lse: bool):
    """A launch of triton.flash prepared for calls of this validated call's shape on torch CUDA
    tensors (the fast path of _torch_cuda): (launch(q, k, v, out[, lse]) on the tensors'
    addresses, aligned(*addresses)), or None where there is none (a call with features beyond
    PREPARED_FEATURES: grouped k/v heads and bottom-right causal masking).
    The compiled kernel, its grid and arguments are fixed here, so that a call costs one
    launch through Triton's C launcher on the legacy default stream (the stream of
    cuda.flash's launches and of the NaN scan), not Triton's Python dispatch (and, opted in,
    the autotuner's). The launch is checked once against Triton's own dispatch (bit-identical
    output and lse): a Triton whose launcher takes other arguments gets no fast path."""
    (batch, nq, _), (batch_kv, nk, _) = call.q.shape, call.v.shape
    if not call.needs <= PREPARED_FEATURES:
        return None
    splits = _splits(batch, batch_kv, nq, nk, resolved.get("split_k", 0))
    if splits:
        return _prepared_decode(call, resolved, with_lse, splits)
    import torch

    from . import flash

    q, k, v = (x.owner for x in (call.q, call.k, call.v))
    outs = [torch.empty((batch, nq, call.v.shape[2]), dtype=q.dtype, device=q.device) for _ in range(2)]
    lses = [torch.empty((batch, nq), dtype=q.dtype, device=q.device) if with_lse else None for _ in range(2)]
    # (grouped k/v heads and bottom-right alignment are scalars and switches of the kernel; with no key
    # lengths, the kernel's key-lengths pointer is q's, as _launcher passes it)
    kernel, args, grid = flash.launch(q, k, v, outs[0], lses[0], None, *_shape(call, resolved))
    constexprs = set(getattr(flash.flash_forward, "constexprs", ()))
    ptrs = [x.data_ptr() for x in (q, k, v, outs[1], lses[1]) if x is not None]
    # recent Tritons pass every argument to the launcher, older ones (3.0, 3.1) only the non-constexpr
    # ones; a launcher that refuses the arguments raises TypeError before launching anything
    for tail in (tuple(args[6:]), tuple(a for i, a in enumerate(args) if i >= 6 and i not in constexprs)):
        go = _launcher(kernel, grid, tail)
        outs[1].fill_(float("nan"))
        torch.cuda.synchronize(q.device)
        try:
            go(*ptrs)
        except TypeError:
            continue
        torch.cuda.synchronize(q.device)
        if torch.equal(outs[0], outs[1]) and (not with_lse or torch.equal(lses[0], lses[1])):
            return go, _aligned
        return None
    return None


def _prepared_decode(call, resolved: dict, with_lse: bool, splits: int):
    """prepared's answer for a call on the split-K decode path (features within
    PREPARED_FEATURES): (launch(q, k, v, out[, lse], scratch), aligned, the float32 elements
    of scratch memory a launch takes), its two kernels (flash.launch_decode) launched through
    Triton's C launcher on the legacy default stream, or None where that launcher takes
    other arguments. Checked once against Triton's own dispatch, bit for bit, as prepared is."""
    import torch

    from . import flash

    (batch, nq, d), (batch_kv, nk, dv) = call.q.shape, call.v.shape
    q, k, v = (x.owner for x in (call.q, call.k, call.v))
    shape = _shape(call, resolved)
    outs = [torch.empty((batch, nq, dv), dtype=q.dtype, device=q.device) for _ in range(2)]
    lses = [torch.empty((batch, nq), dtype=q.dtype, device=q.device) if with_lse else None for _ in range(2)]
    bufs, launches = [], []

    def scratch(n):
        bufs.append(torch.empty(n, dtype=torch.float32, device=q.device))
        return bufs[-1]

    splits = flash.launch_decode(q, k, v, outs[0], lses[0], None, scratch, splits, *shape, record=launches)
    (partial, first, grid1), (combine, second, grid2) = launches
    base, elems = bufs[0].data_ptr(), bufs[0].numel()
    lse_at = first[4].data_ptr() - base  # the partials' lse follow them in the scratch memory
    # the roles of each kernel's pointer arguments: 0 q, 1 k, 2 v, 3 out, 4 lse (else out), 5 the
    # partials, 6 their lse; the partial kernel's key lengths are q's (unused without them)
    roles = (((0, 0), (1, 1), (2, 2), (3, 5), (4, 6), (5, 0)), ((0, 5), (1, 6), (2, 3), (3, 4 if with_lse else 3)))
    kernels = ((partial, first, grid1, flash.flash_decode_partial),
               (combine, second, grid2, flash.flash_decode_combine))
    ptrs = [x.data_ptr() for x in (q, k, v, outs[1])] + ([lses[1].data_ptr()] if with_lse else [])

    def runner(steps):
        def run(*given):  # q, k, v, out[, lse], scratch
            full = (*given[:4], given[4] if with_lse else given[3], given[-1], given[-1] + lse_at)
            for step in steps:
                step(full)
            _LAST.splits = splits

        return run

    def attempt(steps):
        outs[1].fill_(float("nan"))
        again = scratch(elems)
        torch.cuda.synchronize(q.device)
        runner(steps)(*ptrs, again.data_ptr())
        torch.cuda.synchronize(q.device)
        return torch.equal(outs[0], outs[1]) and (not with_lse or torch.equal(lses[0], lses[1]))

    steps = _checked(kernels, roles, attempt)
    return None if steps is None else (runner(steps), _aligned, elems)


def prepared_backward(call, resolved: dict):
    """triton.flash's backward prepared for calls of this validated call's shape on torch CUDA
    tensors (the fast path of _torch_cuda.backward): (launch(q, k, v, out, dout, lse, dq, dk, dv,
    scratch) on the tensors' addresses, aligned(*the first nine), the float32 elements of
    scratch memory a launch takes: delta and the float32 lse, as _backward's), or None where
    the call has features beyond PREPARED_FEATURES or Triton's C launcher takes other
    arguments. Its two kernels (flash.launch_backward: dQ, then dK/dV), their grids and
    arguments are fixed here, so that a call costs two launches on the legacy default stream
    and no validation, no Triton dispatch. Checked once against Triton's own dispatch on
    this call's q, k, v (with out and lse of the forward, and out as the output's gradient):
    the same gradients bit for bit, else None."""
    if not call.needs <= PREPARED_FEATURES:
        return None
    import torch

    from . import flash

    (batch, nq, d), (batch_kv, nk, dv) = call.q.shape, call.v.shape
    q, k, v = (x.owner for x in (call.q, call.k, call.v))
    shape = _shape(call, resolved)
    rows = batch * nq

    def new(*size, dtype=q.dtype):
        return torch.empty(size, dtype=dtype, device=q.device)

    out, lse = new(batch, nq, dv), new(batch, nq)
    flash.launch(q, k, v, out, lse, None, *shape)
    dout = out  # any gradient serves a bit-for-bit comparison; out's values are at hand
    grads = [(new(batch, nq, d), new(batch_kv, nk, d), new(batch_kv, nk, dv)) for _ in range(2)]
    scratch = new(2 * rows, dtype=torch.float32)  # delta, then the float32 lse (as _backward's (2, batch, nq))
    launches = []
    flash.launch_backward(q, k, v, out, dout, lse, *grads[0], None, scratch[:rows], scratch[rows:], *shape,
                          record=launches)
    lse2_at = rows * 4  # the float32 lse's offset in the scratch memory
    # the roles of each kernel's pointer arguments: 0 q, 1 k, 2 v, 3 out, 4 dout, 5 lse, 6 dq, 7 dk,
    # 8 dv, 9 delta, 10 the float32 lse; the key lengths' pointer (unused without them) is q's
    roles = (((0, 0), (1, 1), (2, 2), (3, 3), (4, 4), (5, 5), (6, 6), (7, 9), (8, 10), (9, 0)),
             ((0, 0), (1, 1), (2, 2), (3, 4), (4, 9), (5, 10), (6, 7), (7, 8), (8, 0)))
    kernels = [(*launch, jit) for launch, jit in zip(launches, (flash.flash_backward_dq, flash.flash_backward_dkdv))]
    ptrs = [x.data_ptr() for x in (q, k, v, out, dout, lse, *grads[1])]

    def runner(steps):
        def run(*given):  # q, k, v, out, dout, lse, dq, dk, dv, scratch
            base = given[9]
            full = (*given[:9], base, base + lse2_at)
            for step in steps:
                step(full)

        return run

    def attempt(steps):
        for g in grads[1]:
            g.fill_(float("nan"))
        again = new(2 * rows, dtype=torch.float32)
        torch.cuda.synchronize(q.device)
        runner(steps)(*ptrs, again.data_ptr())
        torch.cuda.synchronize(q.device)
        return all(torch.equal(a, b) for a, b in zip(*grads))

    steps = _checked(kernels, roles, attempt)
    return None if steps is None else (runner(steps), _aligned, 2 * rows)


def _shape(call, resolved: dict) -> tuple:
    """flash.launch's trailing arguments (batch, batch_kv, nq, nk, d, dv, causal, scale, dtype
    name, tensor_cores, features) for a validated call."""
    (batch, nq, d), (batch_kv, nk, dv) = call.q.shape, call.v.shape
    return (batch, batch_kv, nq, nk, d, dv, call.causal, call.scale, call.q.dtype.name, resolved["tensor_cores"],
            call.features if call.needs else None)


def _checked(kernels, roles, attempt):
    """Launches of compiled kernels ((compiled kernel, its arguments in the kernel's order, grid,
    its jit function) each) through Triton's C launcher, kernel i's arguments at the positions
    of roles[i] replaced per call (_launcher_at): the first of two argument layouts, every
    argument (recent Tritons) or the non-constexpr ones (Triton 3.0, 3.1), that the launcher
    takes and for which attempt(steps) (a run checked against Triton's own dispatch) is True;
    None where it takes neither (a TypeError before launching) or the check fails."""
    for every in (True, False):
        steps = []
        for (kernel, args, grid, jit), role in zip(kernels, roles):
            constexprs = set(getattr(jit, "constexprs", ()))
            steps.append(_launcher_at(kernel, grid, [a for i, a in enumerate(args) if every or i not in constexprs],
                                      role))
        try:
            ok = attempt(steps)
        except TypeError:
            continue
        return steps if ok else None
    return None


def _launcher_at(kernel, grid, args, roles):
    """A launch of a compiled kernel through Triton's C launcher with arguments args, those at
    the positions of roles ((position, role) pairs) replaced by the addresses full[role]."""
    run, function, metadata = kernel.run, kernel.function, kernel.packed_metadata
    gx, gy = grid[0], grid[1]
    args = list(args)

    def go(full):
        for at, role in roles:
            args[at] = full[role]
        run(gx, gy, 1, 0, function, metadata, None, None, None, *args)

    return go


def _launcher(kernel, grid, tail):
    from .flash import ensure_allocator

    run, function, metadata = kernel.run, kernel.function, kernel.packed_metadata
    gx, gy = grid[0], grid[1]
    # the forward's Hopper variant builds tensor descriptors in global scratch, which Triton's
    # launcher takes from the allocator of the calling thread's context
    scratch = getattr(getattr(kernel, "metadata", None), "global_scratch_size", 0)

    def go(q, k, v, out, lse=None):
        if scratch:
            ensure_allocator()
        # the key lengths' pointer (unused without them) is q's, as when the kernel was compiled
        run(gx, gy, 1, 0, function, metadata, None, None, None, q, k, v, out, out if lse is None else lse, q, *tail)

    return go


def _aligned(*ptrs) -> bool:
    """Whether every address is 16-byte aligned, as Triton assumed when it compiled the kernel
    for the first call's tensors (torch's allocations are)."""
    return not any(p & 15 for p in ptrs)


def _host_to_torch(torch, x: np.ndarray):
    if x.dtype.name == "bfloat16":  # ml_dtypes.bfloat16: the same bits as torch.bfloat16
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).cuda().view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x)).cuda()


def _torch_to_host(t, dtype) -> np.ndarray:
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).cpu().numpy().view(dtype)
    return t.cpu().numpy()


register(
    Kernel(
        name="triton.flash",
        description="Triton: FlashAttention-2 forward, Q K^T and P V on tensor cores (float32: 3xTF32, or exact "
                    "float32 products), online softmax in float32, block sizes from a fixed table per dtype, head size and mask (on Hopper, "
                    "16-bit, D a multiple of 8, sequences over 512: the forward loads its unmasked K/V blocks by TMA); GQA, bottom-right, "
                    "window, key lengths, softcap; deterministic backward in two (dQ per query block, dK/dV per "
                    "key block)",
        run=_run,
        params=(Param("tensor_cores", 1, 0, 1, "float32: 1 computes the products on tensor cores in 3xTF32 "
                      "(Triton's input_precision 'tf32x3': about float32 FMAs' accuracy); 0 in exact float32 "
                      "('ieee'); forward and backward", choices=(0, 1)),
                Param("split_k", 0, 0, DECODE_MAX_SPLITS, "forward: the split-K decode path's key chunks (one "
                      "program per chunk and k/v head, the group's query heads packed into its rows, a "
                      "log-sum-exp combine): 0 by shape (nq <= 16, kv_group nq <= 128, nk >= 1024: about 264 "
                      "programs, chunks of >= 256 keys), 1 off, N >= 2 forced (at most one chunk per 64 keys)")),
        unavailable_reason=_unavailable,
        device="cuda",
        returns_lse=True,
        backward=_backward,
        backward_dtypes=("float32", "float16", "bfloat16"),
        dtypes=("float32", "float16", "bfloat16"),
        # masks, dropout, ALiBi and packed varlen are not in the kernels: refused (varlen runs per sequence)
        features=frozenset({"gqa", "bottom_right", "window", "key_lengths", "softcap"}),
    )
)
