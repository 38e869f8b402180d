"""Ring attention over a torch.distributed process group.

Each rank holds a shard of the sequence (attnkern.distributed.layout) for q, k
and v. Its queries stay put; the key/value shards travel around the ring, one hop
per step, so that after W steps every query has met every key. Each step runs one
of attnkern's kernels on the local block (return_lse=True) and merges the block's
(out, lse) into the running result:

    lse' = logaddexp(lse, lse_b)
    out' = out * exp(lse - lse') + out_b * exp(lse_b - lse')

in float32 (float64 for float64 inputs), which is exact for the first block and
never overflows. Half-precision inputs (bfloat16, float16) are rounded once, at
the end: every block's out and lse reach the merge in float32 (cuda.flash's
half kernel writes them so; other kernels compute the block on float32 copies
of it), and the backward's dq, dk, dv are summed in float32 and cast once.

The transfer of the next key/value shard (isend to rank r+1,
irecv from r-1, into one of two buffers) is started before the current block
is computed, so the two overlap; the first step sends the shards themselves. On NCCL
a step's transfers are one batch_isend_irecv, on gloo plain isend/irecv pairs (Ring.exchange
says why).

Backward (torch tensors that require grad) walks the same ring: the kernel's
backward on each block, given the full rows' out and lse, gives that block's
share of dq (summed here, in a fixed order) and its dk, dv, which travel the ring
with the key/value shard, one partial sum per hop, and arrive at their owner
after W hops.

The code uses only the inputs' device and the group's backend: gloo for CPU
tensors and NumPy arrays, NCCL for CUDA tensors.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass, field

import numpy as np

from .._api import attention, attention_backward
from .._extras import require
from .layout import Segment, check_layout, chunks_of, segments


@dataclass
class RingStats:
    """What one ring_attention call (forward, and backward if it ran) did on this rank.

    compute_s: seconds in the local kernels and the merges; wait_s: seconds spent
    waiting for transfers after the local work was done (the communication that was
    not hidden); bytes_sent: payload this rank sent; steps: ring steps; per_step:
    [(compute_s, wait_s, bytes_sent)] per step, forward then backward. On a GPU the
    clocks wait for the device (after each step's kernels, and after each wait for a
    transfer, which on NCCL only orders the stream), so keeping stats costs overlap
    across steps. serial=True (set before the call) waits for each step's key/value
    transfer before computing: wait_s is then the transfers' whole time, not what
    the overlap left exposed (a profile of the ring, not a way to run it)."""

    serial: bool = False
    compute_s: float = 0.0
    wait_s: float = 0.0
    bytes_sent: int = 0
    steps: int = 0
    kernel_calls: int = 0
    per_step: list = field(default_factory=list)

    @property
    def overlap_efficiency(self) -> float:
        """compute / (compute + exposed communication): 1.0 when every transfer was hidden."""
        total = self.compute_s + self.wait_s
        return self.compute_s / total if total > 0 else 1.0


def ring_attention(q, k, v, *, causal=False, scale=None, group=None, layout="contiguous", kernel="auto",
                   return_lse=False, stats: RingStats | None = None, **params):
    """softmax(Q K^T * scale) V over a sequence sharded across the ranks of group.

    q, k, v are this rank's shards (..., n, D), (..., n, D), (..., n, Dv) of the full
    sequence, cut by attnkern.distributed.shard(x, layout); every rank calls this
    with shards of one shape, dtype and kind (NumPy arrays or torch tensors, CPU or
    CUDA). Returns this rank's shard of the output (and of the lse with return_lse),
    of the inputs' kind and dtype. causal masks by global position in the full
    sequence; layout="zigzag" balances the causal work over the ranks.

    kernel and params (tunables such as num_threads) choose the local kernel; it
    must return the log-sum-exp (kernel_info(name)["returns_lse"]), and for gradients
    have a backward. With torch tensors that require grad the result is
    differentiable; every rank must then run backward through its output (each
    backward step is a ring exchange). stats, a RingStats, is filled with this
    rank's compute time, exposed communication and bytes sent.

    torch.distributed must be initialized (gloo for CPU tensors, NCCL for CUDA);
    set a timeout in init_process_group so that a failed rank cannot leave the
    others waiting forever (attnkern.distributed.launch does).
    """
    torch = require("torch", "torch", "attnkern.distributed")
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention needs torch.distributed initialized (dist.init_process_group, torchrun, "
                           "or attnkern.distributed.launch)")
    check_layout(layout)
    numpy_in = isinstance(q, np.ndarray)
    tq, tk, tv = (_as_tensor(x, name) for x, name in ((q, "q"), (k, "k"), (v, "v")))
    ring = _Ring.make(tq, tk, tv, causal=causal, scale=scale, group=group, layout=layout, kernel=kernel,
                      params=params, stats=stats)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (tq, tk, tv))
    if grad:
        out, lse = _function().apply(tq, tk, tv, ring)
    else:
        with torch.no_grad():
            out, lse = (x.to(tq.dtype) for x in ring.forward(tq, tk, tv))
    if numpy_in:
        from .._torch_api import to_numpy

        out, lse = to_numpy(out), to_numpy(lse)
    return (out, lse) if return_lse else out


def _as_tensor(x, name):
    import torch

    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        from .._torch_api import from_numpy

        return from_numpy(np.ascontiguousarray(x))
    raise TypeError(f"{name} must be a NumPy array or a torch tensor, got {type(x).__name__}")


_ACCEPTED = ("float32", "float64", "float16", "bfloat16")


@dataclass
class _Ring:
    """One call's settings, checked to agree on every rank."""

    group: object
    rank: int
    world: int
    layout: str
    causal: bool
    scale: float
    kernel: str
    params: dict
    chunk: int
    lead: tuple
    n: int
    d: int
    dv: int
    dtype: str
    stats: RingStats | None

    @classmethod
    def make(cls, q, k, v, *, causal, scale, group, layout, kernel, params, stats):
        import torch
        import torch.distributed as dist

        problem = _local_problem(q, k, v, causal, scale)
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        # Every rank states its call, so that a mismatch is an error everywhere, not a hang:
        # first a checksum of it (one small collective), and only when they differ the calls.
        mine = {"shapes": [tuple(x.shape) for x in (q, k, v)], "dtype": str(q.dtype), "device": q.device.type,
                "causal": bool(causal), "layout": layout, "kernel": str(kernel), "params": sorted(params.items()),
                "scale": scale}
        checksum = zlib.crc32(repr(mine).encode())
        stated = torch.tensor([problem is not None, checksum], dtype=torch.int64,
                              device=q.device if dist.get_backend(group) == "nccl" else "cpu")
        gathered = [torch.empty_like(stated) for _ in range(world)]
        dist.all_gather(gathered, stated, group=group)
        if any(bool(g[0]) or int(g[1]) != checksum for g in gathered):
            everyone = [None] * world
            dist.all_gather_object(everyone, {**mine, "problem": problem}, group=group)
            for other_rank, other in enumerate(everyone):
                if other["problem"] is not None:
                    raise ValueError(f"rank {other_rank}: {other['problem']}")
            for other_rank, other in enumerate(everyone):
                diff = [key for key in mine if other[key] != mine[key]]
                if diff:
                    raise ValueError(
                        "every rank must call ring_attention with shards of one shape and dtype and the same "
                        f"settings; rank {rank} has " + ", ".join(f"{key}={mine[key]!r}" for key in diff)
                        + f", rank {other_rank} has " + ", ".join(f"{key}={other[key]!r}" for key in diff))
        n, d, dv = q.shape[-2], q.shape[-1], v.shape[-1]
        per_rank = len(chunks_of(layout, rank, world))
        if n % per_rank:
            raise ValueError(f"a {layout} shard holds {per_rank} equal chunks, but its length is {n}; "
                             "cut the full sequence with attnkern.distributed.shard")
        if scale is None:
            scale = 1.0 / math.sqrt(d)
        return cls(group=group, rank=rank, world=world, layout=layout, causal=bool(causal), scale=float(scale),
                   kernel=kernel, params=dict(params), chunk=n // per_rank, lead=tuple(q.shape[:-2]), n=n, d=d,
                   dv=dv, dtype=str(q.dtype).removeprefix("torch."), stats=stats)

    # -- the ring ---------------------------------------------------------------------------

    def segments_of(self, rank: int) -> tuple[Segment, ...]:
        return segments(self.layout, rank, self.world, self.chunk)

    def peer(self, offset: int) -> int:
        """The global rank of the group member offset places after this one."""
        import torch.distributed as dist

        local = (self.rank + offset) % self.world
        return local if self.group is None else dist.get_global_rank(self.group, local)

    def pairs(self, owner: int):
        """(q rows, key rows, causal) of the blocks this rank computes against owner's
        keys: slices into the local shards. Without a mask one call covers them all."""
        everything = slice(0, self.n)
        if not self.causal:
            yield everything, everything, False
            return
        for qs in self.segments_of(self.rank):
            for ks in self.segments_of(owner):
                if ks.stop <= qs.start:  # keys wholly before the queries: all visible
                    yield _rows(qs), _rows(ks), False
                elif ks.start == qs.start:  # the same rows: the diagonal block
                    yield _rows(qs), _rows(ks), True
                # keys wholly after the queries: masked out, nothing to compute

    def exchange(self, sends, recvs, pending: list) -> int:
        """Starts sends -> next rank and recvs <- previous rank (tensors matched in order);
        the requests join pending. Returns the bytes sent. On NCCL the transfers go as one
        batch (batch_isend_irecv: one group call on the group's own communicator): separate
        isend/irecv calls make NCCL open a communicator per pair of ranks, and on a 2-GPU
        H200 host (torch 2.11, NCCL 2.28.9) that path failed with an illegal memory access
        even for plain torch tensors, while the batched one ran. On gloo, where
        batch_isend_irecv is reported to hang, they are separate calls."""
        import torch.distributed as dist

        if dist.get_backend(self.group) == "nccl":
            ops = [dist.P2POp(dist.isend, tensor, self.peer(1), group=self.group) for tensor in sends]
            ops += [dist.P2POp(dist.irecv, tensor, self.peer(-1), group=self.group) for tensor in recvs]
            if ops:
                pending.extend(dist.batch_isend_irecv(ops))
        else:
            pending.extend(dist.isend(tensor, self.peer(1), group=self.group) for tensor in sends)
            pending.extend(dist.irecv(tensor, self.peer(-1), group=self.group) for tensor in recvs)
        sent = sum(t.numel() * t.element_size() for t in sends)
        if self.stats is not None:
            self.stats.bytes_sent += sent
        return sent

    def kv_exchange(self, step: int, block, buffers: list, pending: list):
        """Starts sending the key/value block in hand on and receiving the next one into
        buffers[step % 2] (made on first use; step 0 sends the shards themselves, so a
        rank holds at most two blocks beside them). Returns (next block, bytes sent)."""
        import torch

        if step >= self.world - 1:
            return None, 0
        slot = step % 2
        if buffers[slot] is None:
            size = math.prod(self.lead) * self.n * (self.d + self.dv)
            buffers[slot] = torch.empty(size, dtype=block[0].dtype, device=block[0].device)
        incoming = self.unpack(buffers[slot])
        return incoming, self.exchange(block, incoming, pending)

    def wait(self, pending: list, like=None) -> float:
        """Waits for the transfers in pending; seconds waited. With stats kept and like a
        GPU tensor, also for the device: an NCCL request's wait() only makes the current
        stream wait, and the next step's clock would count the rest as compute."""
        start = time.perf_counter()
        for request in pending:
            request.wait()
        if pending and like is not None:
            self.sync(like)
        pending.clear()
        return time.perf_counter() - start

    def unpack(self, buf):
        """Views of a flat buffer as a (keys, values) block."""
        size = math.prod(self.lead) * self.n
        k, v = buf[:size * self.d], buf[size * self.d:]
        return k.view(*self.lead, self.n, self.d), v.view(*self.lead, self.n, self.dv)

    def local(self, q, k, v, causal):
        """(out, lse) of one block on the local kernel. torch.sdpa on CUDA tensors is torch's
        fused kernel called directly (attnkern's torch.sdpa is a CPU kernel). Half blocks come
        back in float32: from cuda.flash's half kernel where it takes them (it writes its rows
        before their rounding), else from the kernel on float32 copies (see widen)."""
        if self.half:
            wide = self.wide_local(q, k, v, causal)
            if wide is not None:
                return wide
            q, k, v = (self.widen(x) for x in (q, k, v))
        if self.kernel == "torch.sdpa" and q.is_cuda:
            from ..backends.torch import sdpa_with_lse

            return sdpa_with_lse(q, k, v, causal, self.scale)
        return attention(*_dense(q, k, v), causal=causal, scale=self.scale, kernel=self.kernel,
                         check_finite=False, return_lse=True, **self.params)

    def wide_local(self, q, k, v, causal):
        """float32 (out, lse) of a half block from a kernel that computes it in half precision
        and returns its results before rounding (cuda.flash on the GPU), or None."""
        if not q.is_cuda or self.kernel not in ("auto", "cuda.flash") or self.params:
            return None
        import torch

        from .._gpu import from_torch
        from ..backends import cuda

        q3, k3, v3 = (x.contiguous().reshape(-1, *x.shape[-2:]) for x in (q, k, v))
        out = torch.empty(*q3.shape[:-1], v3.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.empty(q3.shape[:-1], dtype=torch.float32, device=q.device)
        arrays = [from_torch(x, name) for x, name in ((q3, "q"), (k3, "k"), (v3, "v"), (out, "out"), (lse, "lse"))]
        if not cuda.flash_half_float32(*arrays, causal, self.scale):
            return None
        lse.mul_(math.log(2))  # the kernel's lse is in the log2 domain
        return out.reshape(*q.shape[:-1], v.shape[-1]), lse.reshape(q.shape[:-1])

    @property
    def half(self) -> bool:
        return self.dtype in ("float16", "bfloat16")

    def widen(self, x):
        """x in float32 where the ring runs in half precision: the products of half inputs
        are exact in float32, so a block computed on the copies is the half problem's, with
        float32 results that the merge needs (a kernel's half path rounds out and lse to the
        dtype: a bfloat16 lse near 8 by up to 0.016, which weighs the block 1.6% off)."""
        import torch

        return x.to(torch.float32) if self.half else x

    def record(self, compute: float, waited: float, sent: int):
        if self.stats is not None:
            self.stats.compute_s += compute
            self.stats.wait_s += waited
            self.stats.steps += 1
            self.stats.per_step.append((compute, waited, sent))

    def sync(self, like):
        """Waits for queued GPU work, so that the clocks see it (only when stats are kept)."""
        if self.stats is not None and like.is_cuda:
            import torch

            torch.cuda.synchronize(like.device)

    # -- forward ------------------------------------------------------------------------------

    def forward(self, q, k, v):
        import torch

        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = torch.zeros(*self.lead, self.n, self.dv, dtype=acc, device=q.device)
        lse = torch.full((*self.lead, self.n), -math.inf, dtype=acc, device=q.device)
        block, buffers = (k, v), [None, None]
        pending: list = []
        filled = set()  # query rows (slice starts) that hold a block's result already
        for step in range(self.world):
            owner = (self.rank - step) % self.world
            incoming, sent = self.kv_exchange(step, block, buffers, pending)
            transfer = self.wait(pending, q) if self.stats is not None and self.stats.serial else 0.0
            start = time.perf_counter()
            keys, values = block
            for qrows, krows, causal in self.pairs(owner):
                block_out, block_lse = self.local(q[..., qrows, :], keys[..., krows, :], values[..., krows, :], causal)
                if qrows.start in filled:
                    _merge(out[..., qrows, :], lse[..., qrows], block_out, block_lse)
                else:  # the first block of these rows: its result as it is
                    out[..., qrows, :] = block_out
                    lse[..., qrows] = block_lse
                    filled.add(qrows.start)
                if self.stats is not None:
                    self.stats.kernel_calls += 1
            self.sync(q)
            compute = time.perf_counter() - start
            waited = transfer + self.wait(pending, q)
            self.record(compute, waited, sent)
            block = incoming
        return out, lse  # in the accumulator's dtype: the caller rounds them, once

    # -- backward -----------------------------------------------------------------------------

    def backward(self, q, k, v, out, dout, lse):
        """(dq, dk, dv) in q's dtype, given the forward's out and lse in the accumulator's
        dtype (for half inputs the float32 results before their rounding)."""
        import torch

        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        dtype = q.dtype
        q, dout = self.widen(q), self.widen(dout)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        block, buffers = (k, v), [None, None]
        size = math.prod(self.lead) * self.n * (self.d + self.dv)
        grads_in = None  # dk, dv of the block in hand, summed over the ranks it has visited
        kv_pending: list = []
        grad_pending: list = []
        for step in range(self.world):
            owner = (self.rank - step) % self.world
            incoming, sent = self.kv_exchange(step, block, buffers, kv_pending)
            transfer = self.wait(kv_pending, q) if self.stats is not None and self.stats.serial else 0.0
            start = time.perf_counter()
            keys, values = block
            part = torch.zeros(size, dtype=acc, device=q.device)
            dkeys, dvalues = self.unpack(part)
            if self.half:  # the block's backward on float32 copies: float32 gradients, summed unrounded
                keys, values = self.widen(keys), self.widen(values)
            for qrows, krows, causal in self.pairs(owner):
                bq, bk, bv = attention_backward(
                    *_dense(q[..., qrows, :], keys[..., krows, :], values[..., krows, :], out[..., qrows, :],
                            dout[..., qrows, :], lse[..., qrows]),
                    causal=causal, scale=self.scale, kernel=self.kernel, **self.params)
                dq[..., qrows, :] += bq
                dkeys[..., krows, :] += bk
                dvalues[..., krows, :] += bv
                if self.stats is not None:
                    self.stats.kernel_calls += 1
            self.sync(q)
            compute = time.perf_counter() - start
            # this block's partial sums arrive from the previous rank (none at step 0: our own block)
            waited = transfer + self.wait(grad_pending, q)
            if grads_in is not None:
                part += grads_in
            if self.world == 1:
                grads_in = part
            else:  # on to the next rank; the last hop takes them home to their owner
                grads_in = torch.empty_like(part)
                sent += self.exchange([part], [grads_in], grad_pending)
            waited += self.wait(kv_pending, q)
            self.record(compute, waited, sent)
            block = incoming
        waited = self.wait(grad_pending, q)  # our own block's dk, dv, back from their trip round the ring
        if self.stats is not None:
            self.stats.wait_s += waited
        dk, dv = self.unpack(grads_in)
        return dq.to(dtype), dk.to(dtype).contiguous(), dv.to(dtype).contiguous()


def _dense(*blocks):
    """The blocks as the local kernel can take them. A block's rows of a shard are a
    strided view wherever the shard holds more than one (batch, head) pair; the CPU
    kernels read such views, the cuda.* kernels take GPU arrays in place and only
    contiguous ones, so on the GPU a strided block is copied once here."""
    return tuple(x.contiguous() if x.is_cuda and not x.is_contiguous() else x for x in blocks)


def _rows(segment: Segment) -> slice:
    return slice(segment.offset, segment.offset + segment.length)


def _merge(out, lse, block_out, block_lse):
    """Folds one block's (out, lse) into the running (out, lse), in place, in their dtype."""
    import torch

    block_out, block_lse = block_out.to(out.dtype), block_lse.to(lse.dtype)
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


def _local_problem(q, k, v, causal, scale) -> str | None:
    """What is wrong with this rank's arguments, or None (so that every rank can be told)."""
    import torch

    kinds = {type(x) for x in (q, k, v)}
    if len(kinds) > 1 or not isinstance(q, torch.Tensor):
        return "q, k, v must all be NumPy arrays or all torch tensors"
    if len({x.device for x in (q, k, v)}) > 1:
        return f"q, k, v must be on one device, got {', '.join(str(x.device) for x in (q, k, v))}"
    dtype = str(q.dtype).replace("torch.", "")
    if dtype not in _ACCEPTED or not q.dtype == k.dtype == v.dtype:
        return f"q, k, v must share one of the dtypes {', '.join(_ACCEPTED)}, got {q.dtype}, {k.dtype}, {v.dtype}"
    if not all(2 <= x.dim() <= 4 for x in (q, k, v)):
        return f"q, k, v must have 2 to 4 dimensions, got shapes {[tuple(x.shape) for x in (q, k, v)]}"
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2] and q.shape[-2] == k.shape[-2] == v.shape[-2]
            and q.shape[-1] == k.shape[-1]):
        return ("the shards of q, k, v must have the same leading dimensions and length, and q, k the same D; got "
                f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[-2] == 0 or q.shape[-1] == 0:
        return f"the shards are empty (shape {tuple(q.shape)}); every rank needs at least one row and D >= 1"
    if not isinstance(causal, (bool, np.bool_)):
        return f"causal must be True or False, got {causal!r}"
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        return f"scale must be a finite real number or None, got {scale!r}"
    for x, name in ((q, "q"), (k, "k"), (v, "v")):
        low, high = torch.aminmax(x.detach())  # NaN propagates, infinities show: one pass, no mask array
        if not (math.isfinite(low) and math.isfinite(high)):
            return f"{name} contains NaN or infinity; pass finite values"
    return None


class _Holder:
    cls = None


def _function():
    """The torch.autograd.Function of a ring call, made on first use."""
    if _Holder.cls is not None:
        return _Holder.cls
    import torch

    class RingAttention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, ring):
            out, lse = ring.forward(q.detach(), k.detach(), v.detach())
            ctx.save_for_backward(q, k, v, out, lse)  # unrounded: the backward's D = rowsum(dout * out) and P
            ctx.ring = ring
            out_q, lse_q = out.to(q.dtype), lse.to(q.dtype)
            ctx.mark_non_differentiable(lse_q)
            return out_q, lse_q

        @staticmethod
        def backward(ctx, dout, _dlse):
            q, k, v, out, lse = ctx.saved_tensors
            if dout is None:
                dout = torch.zeros_like(q[..., :out.shape[-1]])
            dq, dk, dv = ctx.ring.backward(q.detach(), k.detach(), v.detach(), out, dout.contiguous(), lse)
            return dq, dk, dv, None

    _Holder.cls = RingAttention
    return RingAttention
