"""attnkern's torch.library custom ops, the frontend that makes attention on
torch tensors visible to torch.compile (one opaque node in the graph, no graph
break), to autograd and to autocast:

    attnkern::attention(q, k, v, ...) -> (out, lse)
    attnkern::attention_backward(q, k, v, out, dout, lse, ...) -> (dq, dk, dv)

Every argument is of a kind a custom op takes (Tensor, Tensor?, str, int,
float, float?, bool): the caller (the core, _api) encodes causal as a string,
the window as two ints (-1: unbounded), the key lengths and the dropout seed
as tensors and the kernel's tunables as a string "name=value,...". The core also supplies
what the ops run (install): this layer only defines them, their fake (meta)
implementations, their autograd formula and their autocast policy. torch is
imported on first use."""

_IMPL: dict = {}  # "forward" / "backward" / "backward_takes" / "dropout_takes": the core's functions (install)
_OPS: list = []  # [True] once the ops are defined
_LIBS: list = []  # the torch.library.Library objects holding the autocast registrations


def install(forward, backward, backward_takes, dropout_takes) -> None:
    """The core's implementations: forward(q, k, v, spec, *, check_finite, need_lse, need_backward)
    -> (out, lse) (lse empty without need_lse), backward(q, k, v, out, dout, lse, spec) -> (dq, dk, dv),
    spec being a dict of SPEC's names, backward_takes(kernel, dtype) -> whether the kernel's backward
    (kernel="auto": any kernel's) takes that dtype, and dropout_takes(kernel, dtype, device_type) ->
    whether the kernel (kernel="auto": one auto picks for tensors of that device) has dropout in that
    dtype (both for the autocast policy)."""
    _IMPL.update(forward=forward, backward=backward, backward_takes=backward_takes, dropout_takes=dropout_takes)


# the encoded arguments of both ops after their tensors, in order (attention then takes check_finite,
# need_lse, need_backward); _api's _encode gives them in this order
SPEC = ("causal", "scale", "kernel", "window_left", "window_right", "key_lengths", "softcap", "attn_mask",
        "alibi_slopes", "dropout_p", "dropout_seed", "params")


def ops():
    """torch.ops.attnkern with attention and attention_backward defined (on first call)."""
    _define_once()
    import torch

    return torch.ops.attnkern


def _define_once() -> bool:
    """Defines the ops unless they are; True."""
    if not _OPS:
        _define()
    return True


# torch.compile runs _define_once while tracing, as a constant, rather than tracing into it (which
# cannot define ops): the mark torch.compiler.assume_constant_result sets, set without importing torch
_define_once._dynamo_marked_constant = True


def _define() -> None:
    import torch
    from torch import Tensor

    @torch.library.custom_op("attnkern::attention", mutates_args=())
    def attention(q: Tensor, k: Tensor, v: Tensor, causal: str, scale: float | None, kernel: str, window_left: int,
                  window_right: int, key_lengths: Tensor | None, softcap: float | None, attn_mask: Tensor | None,
                  alibi_slopes: Tensor | None, dropout_p: float, dropout_seed: Tensor | None, params: str,
                  check_finite: bool, need_lse: bool, need_backward: bool) -> tuple[Tensor, Tensor]:
        spec = dict(zip(SPEC, (causal, scale, kernel, window_left, window_right, key_lengths, softcap, attn_mask,
                               alibi_slopes, dropout_p, dropout_seed, params)))
        out, lse = _IMPL["forward"](q, k, v, spec, check_finite=check_finite, need_lse=need_lse,
                                    need_backward=need_backward)
        return out, lse

    @attention.register_fake
    def _(q, k, v, *args):
        need_lse = args[len(SPEC) + 1]
        return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1] if need_lse else (0,))

    @torch.library.custom_op("attnkern::attention_backward", mutates_args=())
    def attention_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, dout: Tensor, lse: Tensor, causal: str,
                           scale: float | None, kernel: str, window_left: int, window_right: int,
                           key_lengths: Tensor | None, softcap: float | None, attn_mask: Tensor | None,
                           alibi_slopes: Tensor | None, dropout_p: float, dropout_seed: Tensor | None,
                           params: str) -> tuple[Tensor, Tensor, Tensor]:
        spec = dict(zip(SPEC, (causal, scale, kernel, window_left, window_right, key_lengths, softcap, attn_mask,
                               alibi_slopes, dropout_p, dropout_seed, params)))
        dq, dk, dv = _IMPL["backward"](q, k, v, out, dout, lse, spec)
        return dq.contiguous(), dk.contiguous(), dv.contiguous()

    @attention_backward.register_fake
    def _(q, k, v, out, dout, lse, *rest):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the real ones

    # the spec's tensor arguments (key lengths, mask, slopes, seed): not differentiated, saved for the backward
    tensors = [i for i, n in enumerate(SPEC) if n in ("key_lengths", "attn_mask", "alibi_slopes", "dropout_seed")]

    def setup_context(ctx, inputs, output):
        q, k, v = inputs[:3]
        out, lse = output
        ctx.no_backward = not inputs[-1]  # need_backward: the core sets it whenever an input requires grad
        spec = inputs[3:3 + len(SPEC)]
        ctx.save_for_backward(q, k, v, out, lse, *(spec[i] for i in tensors))  # tensors (or None) are saved
        ctx.spec = [None if i in tensors else x for i, x in enumerate(spec)]
        ctx.mark_non_differentiable(lse)

    def backward(ctx, dout, _dlse):
        if ctx.no_backward:
            raise RuntimeError("attnkern::attention was called with need_backward=False and an input requires "
                               "grad; call it through attnkern.attention, which sets it then")
        q, k, v, out, lse, *saved = ctx.saved_tensors
        spec = list(ctx.spec)
        for i, x in zip(tensors, saved):
            spec[i] = x
        dq, dk, dv = torch.ops.attnkern.attention_backward(q, k, v, out, dout.contiguous(), lse, *spec)
        return dq, dk, dv, *([None] * (len(SPEC) + 3))

    attention.register_autograd(backward, setup_context=setup_context)
    for device in ("cpu", "cuda"):
        _register_autocast(torch, "attention", device)
    _OPS.append(True)


def _register_autocast(torch, opname: str, device_type: str) -> None:
    """Autocast's policy for attnkern::attention, as SDPA's: in an autocast region of
    the device, floating q, k, v (and a float attn_mask) are cast to the region's dtype
    (torch.get_autocast_dtype: bfloat16 on the CPU, float16 on CUDA unless set), then
    the op runs with autocast off. Where an input requires grad and no kernel's
    backward takes that dtype (cuda.flash's backward is float32/float64), the
    op runs in float32 instead and its output is cast to the region's dtype: the
    forward and the backward both work, the gradients computed in float32 and
    returned in each input's own dtype (autograd's casts). Likewise with dropout
    where the kernel has no dropout in that dtype (cuda.flash: float32 and float64
    only). torch.library's
    register_autocast takes one fixed dtype; this reads the region's."""
    key = getattr(torch._C.DispatchKey, "Autocast" + torch._C._dispatch_key_for_device(device_type))
    op = getattr(torch.ops.attnkern, opname).default

    def policy(*args):
        dtype = torch.get_autocast_dtype(device_type)
        compute = dtype
        # need_backward, the last argument: the core sets it where an input requires grad
        kernel, mask = args[3 + SPEC.index("kernel")], 3 + SPEC.index("attn_mask")
        name = str(dtype).removeprefix("torch.")
        dropout = args[3 + SPEC.index("dropout_p")] > 0
        no_backward = args[-1] and not _IMPL["backward_takes"](kernel, name)
        if no_backward or (dropout and not _IMPL["dropout_takes"](kernel, name, device_type)):
            compute = torch.float32

        def cast(x):  # as autocast casts: floating tensors of the device, float64 excepted
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64 \
                    and x.device.type == device_type:
                return x.to(compute)
            return x

        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            out, lse = op(*map(cast, args[:3]), *args[3:mask], cast(args[mask]), *args[mask + 1:])
        if out.dtype != compute:  # float64 inputs: not cast, nor is their output
            return out, lse
        return out.to(dtype), lse.to(dtype)

    if op.has_kernel_for_dispatch_key(key):
        op.py_kernels.pop(key)
    op.py_impl(key)(policy)
    _LIBS.append(torch.library.Library("attnkern", "IMPL"))  # a registration lives as long as its Library
    _LIBS[-1].impl(opname, lambda _keyset, *args: policy(*args), "Autocast" + torch._C._dispatch_key_for_device(
        device_type), with_keyset=True)
