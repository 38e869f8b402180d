"""The forward/backward study of attention training: time and memory of the
forward and of the backward over a grid of sequence lengths and head sizes, the
smallest configuration that runs out of memory, and a theoretical memory account
(the N x N scores that the naive graph saves for backward, the O(N) log-sum-exp
that FlashAttention-2 saves instead) to set beside the measured peaks.

    run_study(settings)     measure every (N, d, kernel); rows of plain values
    account(kernel, ...)    the memory model of one kernel and configuration
    smallest_oom(rows)      the smallest configuration out of memory, per kernel
    write_csv / write_markdown / write_plots
    cmd_study               the `attnkern study` command (registered in cli.py)

On cuda every measurement runs in this process; on cpu each (kernel,
configuration) runs in a fresh Python process (as memory.py's probe does), so
that its resident set says what that configuration took. (Forking them from a
server that has imported torch would save the import, about 2.5 s a row, but
breaks the OpenMP thread pools of torch and of attnkern's native kernels in the
children: they run on one thread.)
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import math
import os
import resource
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Callable

from .counts import attention_flops
from .timing import CudaEventClock, WallClock, medians

MIB = 2**20
ITEMSIZE = 4  # float32: the study's only dtype
TORCH_KERNELS = ("torch.naive", "torch.sdpa")  # torch with autograd; attnkern's registry entries of these names
# (no backward) are not what runs here
CSV_COLUMNS = ("batch", "seq_len", "d_model", "kernel", "causal", "status", "error", "forward_ms", "backward_ms",
               "memory_before_backward_mib", "peak_memory_mib", "predicted_peak_mib")

STUDY_HELP = """\
Times the forward and the backward of attention and measures their memory over a
grid of sequence lengths N (--seqs) and head sizes d (--dims): the study of
attention training that motivates FlashAttention-2's recomputation.

For each N, d and kernel (N ascending), on float32 q, k, v of shape
(--batch, --heads, N, d) that require grad, and an upstream gradient dout of the
output's shape made with them. --heads is 1 by default: one head, so d is the
model width d_model, as in the assignment this follows; with --heads H each of
the H heads has size d.
  memory  one forward and one out.backward(dout), after a small one (N <= 64)
          that loads code, starts threads and makes library handles: in use after
          the forward ("before backward") and the peak over forward + backward,
          both above what the process held before q, k, v and dout were made
          (so they include those inputs), in MiB.
          cuda: torch.cuda.memory_allocated() and max_memory_allocated() after
            reset_peak_memory_stats(): bytes of live tensors of torch's allocator
            (its cache and the CUDA context not counted).
          cpu (Linux): a fresh Python process per kernel and configuration; its
            resident set (VmRSS) and peak resident set (VmHWM, reset through
            /proc/self/clear_refs). For this its malloc gives every block of
            128 KiB or more a mapping of its own (mallopt M_MMAP_THRESHOLD), so
            that freed tensors leave the resident set as they leave
            memory_allocated on the GPU; smaller blocks and pages blur the
            smallest sizes.
  time    then --warmup untimed and --iters timed iterations, each a forward and
          out.backward(dout) timed separately (the gradients set to None between,
          outside the timings); the median of each.
          cuda: CUDA events around each region, which wait for its kernels; TF32
          off (no one-pass TF32; float32 forwards on tensor cores run 3xTF32).
          cpu: the wall clock, --threads threads for torch and attnkern alike;
          malloc's threshold set to 32 MiB first, where glibc's own goes once
          large blocks have been freed (as in a long training loop).
  out of memory  a configuration that runs out is recorded (status "oom" and the
          error) and the run goes on: cuda: torch.cuda.OutOfMemoryError (the cache
          emptied after); cpu: MemoryError or a failed allocation in the row's
          process, or the process killed. Once a kernel runs out at some N for a
          d, its larger N for that d are recorded as skipped, not tried
          (--no-skip-larger tries them). --memory-cap studies the boundary of a
          smaller device on a bigger one.
Kernels (--kernels; default torch.naive, torch.sdpa and attnkern's flash kernel
with a backward for the device: native.flash on cpu, cuda.flash on cuda):
  torch.naive   softmax(q k^T * scale) v in torch ops under autograd, the N x N
                scores materialised (attnkern.backends.torch.naive_attention)
  torch.sdpa    torch.nn.functional.scaled_dot_product_attention (torch picks its
                fused backend; the JSON names the backward node, grad_fn)
  attnkern's    attnkern.attention(q, k, v, causal=, kernel=name,
                check_finite=False) on the torch tensors, differentiable through
                the kernel's backward (which recomputes the scores from the saved
                log-sum-exp). check_finite=False skips attnkern's scan of the
                inputs for NaN/inf, which the torch kernels do not make either.
Reported per row: status (ok, oom, error, skipped), forward and backward median
ms, GFLOP/s of forward + backward counting 4*B*H*N^2*d for the forward (half with
--causal; attnkern_bench.counts) and 2.5 times that for the backward
(FlashAttention-2's convention: five N^2*d matmuls, the recomputed scores
counted), MiB before backward and peak, and with --account the predicted peak
and predicted / measured. Then the smallest configuration out of memory per
kernel (smallest N, then d). Progress goes to stderr, the table to stdout.
--account also prints the memory model: every tensor of the forward and the
backward (which ones autograd saves), the peak over the steps of each, and how
the peak splits into N^2 and N terms as N grows.
"""


# ---------------------------------------------------------------- settings and grid


@dataclass
class Settings:
    batch: int = 8
    heads: int = 1
    dims: list[int] = field(default_factory=lambda: [16, 32, 64, 128])
    seqs: list[int] = field(default_factory=lambda: [256, 1024, 4096, 8192, 16384])
    causal: bool = False
    kernels: list[str] = field(default_factory=list)
    device: str = "cpu"
    warmup: int = 10
    iters: int = 100
    threads: int = 1
    memory_cap_gib: float | None = None
    skip_larger: bool = True


def default_kernels(device: str) -> list[str]:
    return [*TORCH_KERNELS, "cuda.flash" if device == "cuda" else "native.flash"]


def kernel_problem(name: str, device: str) -> str | None:
    """Why `name` cannot take part on `device` (None: it can); an unknown name exits."""
    if name in TORCH_KERNELS:
        return None
    import attnkern

    if name not in attnkern.kernels():
        raise SystemExit(f"unknown kernel {name!r}: {', '.join(TORCH_KERNELS)} or attnkern's kernels with a "
                         f"backward ({', '.join(attnkern.kernels())})")
    info = attnkern.kernel_info(name)
    if info["device"] != device:
        return f"runs on {info['device']}, not {device}"
    if not info["backward"]:
        return "has no backward pass"
    if not info["available"]:
        return info["reason"]
    return None


def backward_flops(b: int, h: int, nq: int, nk: int, d: int, causal: bool = False) -> float:
    """FLOPs of attention's backward by FlashAttention-2's convention: 2.5 times the
    forward's (five N^2*d matmuls, dV, dP, dQ, dK and the recomputed S, against the
    forward's two). A backward that keeps P does four (2.0x); the count stays the
    convention so that rates compare across kernels."""
    return 2.5 * attention_flops(b, h, nq, nk, d, causal)


# ---------------------------------------------------------------- the memory account


@dataclass
class Term:
    name: str
    formula: str  # elements (or bytes, for bool) in B, H, N, d
    nbytes: int
    order: int  # the power of N it grows with: 1 or 2
    note: str = ""


@dataclass
class Stage:
    phase: str  # "forward" or "backward"
    step: str
    live: tuple[str, ...]  # names of the terms live during the step


@dataclass
class Account:
    """The tensors of one forward and backward and the steps they are live in;
    bytes live at a step are the sum of its terms. Inputs q, k, v and dout are in
    every step: the measurement counts them too."""

    kernel: str
    batch: int
    heads: int
    seq: int
    dim: int
    causal: bool
    terms: dict[str, Term]
    stages: list[Stage]
    after_forward: tuple[str, ...]  # live once the forward returns: what "before backward" measures
    saved: tuple[str, ...]  # saved by autograd for the backward, beyond the inputs
    notes: list[str] = field(default_factory=list)

    def live_bytes(self, names) -> int:
        return sum(self.terms[n].nbytes for n in names)

    @property
    def before_backward(self) -> int:
        return self.live_bytes(self.after_forward)

    def peak_stage(self, phase: str | None = None) -> Stage:
        stages = [s for s in self.stages if phase is None or s.phase == phase]
        return max(stages, key=lambda s: self.live_bytes(s.live))

    def peak(self, phase: str | None = None) -> int:
        return self.live_bytes(self.peak_stage(phase).live)

    def by_order(self, names) -> dict[int, int]:
        """Bytes of the terms that grow as N (1) and as N^2 (2)."""
        out = {1: 0, 2: 0}
        for n in names:
            out[self.terms[n].order] += self.terms[n].nbytes
        return out

    def as_dict(self) -> dict:
        peak = self.peak_stage()
        return {"kernel": self.kernel, "batch": self.batch, "heads": self.heads, "seq_len": self.seq,
                "d_model": self.dim, "causal": self.causal, "terms": [asdict(t) for t in self.terms.values()],
                "stages": [{**asdict(s), "bytes": self.live_bytes(s.live)} for s in self.stages],
                "saved_for_backward": list(self.saved), "before_backward_bytes": self.before_backward,
                "forward_peak_bytes": self.peak("forward"), "backward_peak_bytes": self.peak("backward"),
                "peak_bytes": self.live_bytes(peak.live), "peak_step": f"{peak.phase}: {peak.step}",
                "peak_n2_bytes": self.by_order(peak.live)[2], "peak_n_bytes": self.by_order(peak.live)[1],
                "notes": self.notes}


def account(kernel: str, batch: int, heads: int, seq: int, dim: int, causal: bool = False, device: str = "cpu",
            threads: int = 1, itemsize: int = ITEMSIZE) -> Account:
    """The memory model of one forward and backward of `kernel` at (batch, heads,
    seq, dim): torch.naive's graph, a fused torch.sdpa, or an attnkern flash kernel."""
    b, h, n, d = batch, heads, seq, dim
    bhnd, bhn, bhn2 = b * h * n * d * itemsize, b * h * n * itemsize, b * h * n * n * itemsize
    terms = [Term("q, k, v", "3 B*H*N*d", 3 * bhnd, 1, "the inputs, requires_grad"),
             Term("dout", "B*H*N*d", bhnd, 1, "the upstream gradient, made with the inputs"),
             Term("out", "B*H*N*d", bhnd, 1)]
    inputs = ("q, k, v", "dout")
    notes: list[str] = []
    if kernel == "torch.naive":
        terms += [
            Term("S = q k^T", "B*H*N^2", bhn2, 2, "freed after the scaling: MulBackward0 saves nothing of it "
                                                     "(the scale is a number)"),
            Term("S * scale", "B*H*N^2", bhn2, 2),
        ]
        if causal:
            terms += [Term("ones(N, N)", "N^2 bytes (bool)", n * n, 2, "freed after .triu(1)"),
                      Term("mask", "N^2 bytes (bool)", n * n, 2, "saved by MaskedFillBackward0"),
                      Term("masked scores", "B*H*N^2", bhn2, 2)]
        scores = "masked scores" if causal else "S * scale"
        mask = ("mask",) if causal else ()
        terms += [
            Term("P = softmax", "B*H*N^2", bhn2, 2, "saved by SoftmaxBackward0 (its result) and by the P v "
                                                   "matmul's BmmBackward0"),
            Term("dP = dout v^T", "B*H*N^2", bhn2, 2),
            Term("dv = P^T dout", "B*H*N*d", bhnd, 1),
            Term("dS (softmax backward)", "B*H*N^2", bhn2, 2),
        ]
        cuda_tmp = ()
        if device == "cuda":
            terms.append(Term("dP * P (CUDA softmax backward)", "B*H*N^2", bhn2, 2,
                              "torch's CUDA softmax backward forms grad * output in a new tensor first "
                              "(softmax_backward_cuda_out); the CPU kernel does not"))
            cuda_tmp = ("dP * P (CUDA softmax backward)",)
        if causal:
            terms.append(Term("dS masked (masked_fill backward)", "B*H*N^2", bhn2, 2))
        ds = "dS masked (masked_fill backward)" if causal else "dS (softmax backward)"
        terms += [
            Term("dS * scale", "B*H*N^2", bhn2, 2),
            Term("dq", "B*H*N*d", bhnd, 1),
            Term("dk^T (bmm result)", "B*H*N*d", bhnd, 1, "a transposed view of k's layout"),
            Term("dk", "B*H*N*d", bhnd, 1, "AccumulateGrad copies dk^T into k's layout"),
        ]
        fwd = [Stage("forward", "S = q k^T", (*inputs, "S = q k^T")),
               Stage("forward", "S * scale", (*inputs, "S = q k^T", "S * scale"))]
        if causal:
            fwd += [Stage("forward", "mask = ones(N, N).triu(1)", (*inputs, "S * scale", "ones(N, N)", "mask")),
                    Stage("forward", "masked_fill(mask, -inf)", (*inputs, "S * scale", "mask", "masked scores"))]
        fwd += [Stage("forward", "P = softmax", (*inputs, *mask, scores, "P = softmax")),
                # naive_attention's local `scores` keeps the scores alive until it returns
                Stage("forward", "out = P v (scores still referenced)",
                      (*inputs, *mask, scores, "P = softmax", "out"))]
        after = (*inputs, *mask, "P = softmax", "out")
        base = (*inputs, "out")
        bwd = [Stage("backward", "dP = dout v^T, dv = P^T dout",
                     (*base, *mask, "P = softmax", "dP = dout v^T", "dv = P^T dout")),
               Stage("backward", "dS = P * (dP - rowsum(dP * P))",
                     (*base, *mask, "P = softmax", "dP = dout v^T", *cuda_tmp, "dS (softmax backward)",
                      "dv = P^T dout"))]
        if causal:
            bwd.append(Stage("backward", "masked_fill backward", (*base, "mask", "dS (softmax backward)", ds,
                                                                 "dv = P^T dout")))
        bwd += [Stage("backward", "* scale backward", (*base, ds, "dS * scale", "dv = P^T dout")),
                Stage("backward", "dq = dS k, dk^T = q^T dS", (*base, "dS * scale", "dq", "dk^T (bmm result)",
                                                              "dv = P^T dout")),
                Stage("backward", "k.grad: dk^T copied to k's layout", (*base, "dq", "dk^T (bmm result)", "dk",
                                                                        "dv = P^T dout")),
                Stage("backward", "after backward", (*base, "dq", "dk", "dv = P^T dout"))]
        saved = (*mask, "P = softmax")
        notes.append("autograd saves, beyond q, k and v themselves (views: no bytes): P (softmax's result, also "
                     "the P v matmul's input)" + (" and the bool mask (MaskedFillBackward0); not the masked "
                                                  "scores" if causal else "") + "; the raw scores are freed "
                     "after the scaling, the scaled ones when naive_attention returns")
    else:
        lse_note = "log-sum-exp per query row, saved for the backward"
        if kernel == "torch.sdpa" and device == "cuda":
            # the memory-efficient kernel (float32 on the GPU) pads lse to 32 rows
            lse = Term("lse", "B*H*ceil(N/32)*32", b * h * -(-n // 32) * 32 * itemsize, 1, lse_note)
        else:
            lse = Term("lse", "B*H*N", bhn, 1, lse_note)
        terms += [lse, Term("dq, dk, dv", "3 B*H*N*d", 3 * bhnd, 1)]
        fwd_extra: tuple[str, ...] = ()
        bwd_extra: tuple[str, ...] = ()
        if kernel == "torch.sdpa":
            terms.append(Term("delta = rowsum(dout * out)", "B*H*N", bhn, 1))
            bwd_extra = ("delta = rowsum(dout * out)",)
            notes.append("torch.sdpa: modelled as torch's fused kernels (flash on the CPU, memory-efficient for "
                         "float32 on the GPU): out and lse saved; their work buffers are not modelled"
                         + (" (on an H100 with torch 2.11 the backward took B*H*N*max(d, 64)*4 bytes more, "
                            "an O(N) float32 buffer)" if device == "cuda" else ""))
        elif device == "cuda":
            terms.append(Term("delta = rowsum(dout * out)", "B*H*N", bhn, 1,
                              "a Numba allocation: outside torch's counters"))
            bwd_extra = ("delta = rowsum(dout * out)",)
            notes.append(f"{kernel}: tiles live in shared memory; delta is allocated through Numba, which "
                         "torch.cuda.max_memory_allocated does not see")
        else:
            fwd_ws, bwd_ws = _native_work_elements(kernel, d, threads)
            terms += [Term("work buffers (forward)", f"{threads} threads x blocks", fwd_ws * itemsize, 1,
                           "per thread, O(block_q * block_k); padding ignored"),
                      Term("lse2, D (backward)", "2 B*H*N", 2 * bhn, 1, "lse * log2(e) and rowsum(dout * out)"),
                      Term("work buffers (backward)", f"{threads} threads x blocks", bwd_ws * itemsize, 1,
                           "per thread, O(block_q * block_k); padding ignored")]
            fwd_extra, bwd_extra = ("work buffers (forward)",), ("lse2, D (backward)", "work buffers (backward)")
        fwd = [Stage("forward", "out, lse", (*inputs, "out", "lse", *fwd_extra))]
        after = (*inputs, "out", "lse")
        bwd = [Stage("backward", "dq, dk, dv", (*inputs, "out", "lse", *bwd_extra, "dq, dk, dv")),
               Stage("backward", "after backward", (*inputs, "out", "dq, dk, dv"))]
        saved = ("out", "lse")
        notes.append(f"{kernel}: saves q, k, v, out and the lse (O(N)); the backward recomputes P block by block: "
                     "no N x N tensor")
    return Account(kernel, b, h, n, d, causal, {t.name: t for t in terms}, fwd + bwd, after, saved, notes)


def _native_work_elements(kernel: str, d: int, threads: int) -> tuple[int, int]:
    """Elements of the per-thread work buffers of a native flash forward and
    backward (attn_kernels.h: ws_alloc, bwd_alloc), with the default blocks."""
    import attnkern

    params = attnkern.kernel_info(kernel)["params"]
    bq, bk = params["block_q"]["default"], params["block_k"]["default"]
    strip = min(bq, 64)  # the forward's scores: one strip of 8 MR rows at a time (MR = 8 on AVX-512)
    fwd = bq * d + d * bk + bk * d + strip * bk + bq * d + 3 * bq
    bwd = bk * d + d * max(bq, bk) + 2 * bq * bk + 2 * bk * d + 3 * max(bq, bk)
    return threads * fwd, threads * bwd


# ---------------------------------------------------------------- measuring one row


class RssMeter:
    """This process's resident set (Linux /proc/self): in use, and the peak since
    the last reset (VmHWM, reset to the current resident set by clear_refs 5)."""

    def in_use(self) -> int:
        return proc_status("VmRSS")

    def reset_peak(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def peak(self) -> int:
        return proc_status("VmHWM")


class CudaMeter:
    """Bytes of live tensors of torch's CUDA allocator, and their peak since the
    last reset."""

    def __init__(self, torch):
        self.torch = torch

    def in_use(self) -> int:
        self.torch.cuda.synchronize()
        return self.torch.cuda.memory_allocated()

    def reset_peak(self) -> None:
        self.torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        self.torch.cuda.synchronize()
        return self.torch.cuda.max_memory_allocated()


def proc_status(key: str) -> int:
    """A size from /proc/self/status (VmRSS, VmHWM, VmSize...), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def attention_fn(kernel: str, device: str, threads: int) -> Callable:
    """(q, k, v, causal) -> out for a study kernel, on torch tensors, differentiable."""
    import torch

    if kernel == "torch.naive":
        from attnkern.backends.torch import naive_attention

        return lambda q, k, v, c: naive_attention(q, k, v, c, q.shape[-1] ** -0.5)
    if kernel == "torch.sdpa":
        return lambda q, k, v, c: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=c,
                                                                                  scale=q.shape[-1] ** -0.5)
    import attnkern

    from .machine import thread_params

    params = thread_params(kernel, threads) if device == "cpu" else {}
    return lambda q, k, v, c: attnkern.attention(q, k, v, causal=c, scale=q.shape[-1] ** -0.5, kernel=kernel,
                                                 check_finite=False, **params)


def is_oom(exc: BaseException) -> bool:
    """Whether an exception says that memory ran out (torch's CPU and CUDA
    allocators, NumPy, attnkern's native and Numba's CUDA allocations)."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc).lower()
    return any(s in text for s in ("out of memory", "can't allocate memory", "cannot allocate memory",
                                   "cuda_error_out_of_memory"))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def measure(spec: dict, meter, clock, sync: Callable[[], None] = lambda: None,
            after_warmup: Callable[[], None] = lambda: None,
            before_timing: Callable[[], None] = lambda: None) -> dict:
    """Memory and times of one (kernel, configuration) on spec's device: a small
    forward and backward, after_warmup(), the measured forward and backward,
    before_timing(), the timed ones. {status, error, memory_*, forward_ms,
    backward_ms, grad_fn}; never raises: a failure is the row's status."""
    got: dict = {}
    step = {"now": "warm-up"}
    try:
        _measure(spec, meter, clock, sync, after_warmup, before_timing, got, step)
        return {"status": "ok", "error": "", **got}
    except Exception as exc:  # noqa: BLE001 - every failure is a row's result
        where = " (in the timed iterations)" if step["now"] == "time" else ""
        return {**got, "status": "oom" if is_oom(exc) else "error", "error": _first_line(exc) + where}


def _measure(spec, meter, clock, sync, after_warmup, before_timing, got: dict, step: dict) -> None:
    """Fills `got` as results come: the memory ones stay if the timed iterations fail."""
    import torch

    b, h, n, d, causal, device = spec["batch"], spec["heads"], spec["seq"], spec["dim"], spec["causal"], spec["device"]
    fn = attention_fn(spec["kernel"], device, spec["threads"])

    def inputs(rows):
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(b, h, rows, d, device=device, generator=gen, requires_grad=True) for _ in range(3))
        return q, k, v, torch.randn(b, h, rows, d, device=device, generator=gen)

    q, k, v, dout = inputs(min(n, 64))  # load code, start threads, make library handles and workspaces
    fn(q, k, v, causal).backward(dout)
    del q, k, v, dout
    sync()
    after_warmup()
    step["now"] = "memory"
    base = meter.in_use()
    q, k, v, dout = inputs(n)
    meter.reset_peak()
    out = fn(q, k, v, causal)
    before = meter.in_use() - base
    grad_fn = out.grad_fn.name() if out.grad_fn is not None else ""
    out.backward(dout)
    peak = meter.peak() - base
    del out
    got.update(memory_before_backward_mib=before / MIB, peak_memory_mib=peak / MIB, grad_fn=grad_fn)
    step["now"] = "time"
    before_timing()
    state = {}

    def forward():
        state["out"] = fn(q, k, v, causal)

    def backward():
        state.pop("out").backward(dout)

    times: dict[str, list[float]] = {"forward": [], "backward": []}
    for i in range(spec["warmup"] + spec["iters"]):
        q.grad = k.grad = v.grad = None
        tf, tb = clock.seconds(forward), clock.seconds(backward)
        if i >= spec["warmup"]:
            times["forward"].append(tf)
            times["backward"].append(tb)
    med = medians(times) if spec["iters"] else {"forward": math.nan, "backward": math.nan}
    got.update(forward_ms=med["forward"] * 1e3, backward_ms=med["backward"] * 1e3)


def _cpu_main() -> None:
    """A CPU row's process (python -c, spec as JSON in argv[1]): pins torch's
    threads, has malloc map large blocks on their own, caps the address space
    after the small warm-up (at what it spans then plus the cap), measures the
    memory, then (without a cap) gives malloc glibc's steady-state threshold back
    for the timed iterations; prints the result as JSON."""
    import torch

    spec = json.loads(sys.argv[1])
    cap = spec.pop("cap_bytes", None)
    torch.set_num_threads(spec["threads"])
    _mallopt(_M_MMAP_THRESHOLD, 128 * 1024)

    def limit():
        if cap:
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            soft = proc_status("VmSize") + cap
            resource.setrlimit(resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard),
                                                    hard))

    def before_timing():
        if not cap:
            _mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)
            _mallopt(_M_TRIM_THRESHOLD, 64 * 2**20)

    print(json.dumps(measure(spec, RssMeter(), WallClock(), after_warmup=limit, before_timing=before_timing)))


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _mallopt(param: int, value: int) -> None:
    """glibc's mallopt. With M_MMAP_THRESHOLD 128 KiB every block of 128 KiB or
    more gets a mapping of its own, returned at free, and glibc stops raising the
    threshold after frees (by default it does, up to 32 MiB, and then keeps freed
    blocks in its heap, resident): the resident set follows the live tensors, as
    memory_allocated does on the GPU, and under a cap so does the address space.
    32 MiB (trim 64 MiB) is where glibc's own threshold goes once large blocks
    have been freed: the timings run with malloc as a long loop has it."""
    import ctypes

    try:
        ctypes.CDLL(None).mallopt(param, value)
    except (OSError, AttributeError):  # not glibc: freed blocks may stay resident
        pass


def measure_in_fresh_process(spec: dict, cap_bytes: int | None = None) -> dict:
    """measure() of a CPU row in a new Python process (_cpu_main)."""
    code = "from attnkern_bench.study import _cpu_main; _cpu_main()"
    proc = subprocess.run([sys.executable, "-c", code, json.dumps({**spec, "cap_bytes": cap_bytes})],
                          capture_output=True, text=True, check=False)
    if proc.returncode == 0 and proc.stdout.strip():
        return json.loads(proc.stdout.strip().splitlines()[-1])
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        killed = proc.returncode == -signal.SIGKILL
        return {"status": "oom" if killed else "error",
                "error": f"the process was killed by {name}" + (" (the kernel's OOM killer?)" if killed else "")}
    lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
    return {"status": "oom" if is_oom(RuntimeError(lines[-1])) else "error", "error": lines[-1][:200]}


# ---------------------------------------------------------------- the study


def run_study(cfg: Settings, emit: Callable[[dict], None] = lambda row: None) -> list[dict]:
    """Every (N ascending, d, kernel) of the grid: a row of plain values each,
    emit(row) as each is ready; progress on stderr."""
    cuda = cfg.device == "cuda"
    if cuda:
        import torch

        from .harness import CudaTarget

        target = CudaTarget()
        meter, clock, sync = CudaMeter(torch), CudaEventClock(torch), torch.cuda.synchronize
        if cfg.memory_cap_gib is not None:
            total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.memory_cap_gib * 2**30 / total))
    cap = int(cfg.memory_cap_gib * 2**30) if cfg.memory_cap_gib is not None and not cuda else None
    grid = [(n, d, kernel) for n in sorted(cfg.seqs) for d in cfg.dims for kernel in cfg.kernels]
    rows: list[dict] = []
    ooms: dict[tuple[str, int], int] = {}  # (kernel, d) -> smallest N out of memory
    for step, (n, d, kernel) in enumerate(grid, 1):
        print(f"[{step}/{len(grid)}] N={n} d={d} {kernel}", file=sys.stderr, flush=True)
        spec = {"kernel": kernel, "batch": cfg.batch, "heads": cfg.heads, "seq": n, "dim": d, "causal": cfg.causal,
                "device": cfg.device, "warmup": cfg.warmup, "iters": cfg.iters, "threads": cfg.threads}
        row = {"batch": cfg.batch, "heads": cfg.heads, "seq_len": n, "d_model": d, "kernel": kernel,
               "causal": cfg.causal, "device": cfg.device}
        first_oom = ooms.get((kernel, d))
        if cfg.skip_larger and first_oom is not None and n > first_oom:
            result = {"status": "skipped", "error": f"larger than an OOM configuration (N={first_oom}, d={d})"}
        elif cuda:
            result = measure(spec, meter, clock, sync)
            gc.collect()
            target.release()
        else:
            result = measure_in_fresh_process(spec, cap)
        row.update(result)
        if row["status"] == "oom":
            ooms[(kernel, d)] = min(n, ooms.get((kernel, d), n))
        if row["status"] == "ok":
            flops = attention_flops(cfg.batch, cfg.heads, n, n, d, cfg.causal)
            flops += backward_flops(cfg.batch, cfg.heads, n, n, d, cfg.causal)
            row["gflops"] = flops / ((row["forward_ms"] + row["backward_ms"]) / 1e3) / 1e9
        acc = account(kernel, cfg.batch, cfg.heads, n, d, cfg.causal, cfg.device, cfg.threads)
        row["predicted_before_backward_mib"] = acc.before_backward / MIB
        row["predicted_forward_peak_mib"] = acc.peak("forward") / MIB
        row["predicted_peak_mib"] = acc.peak() / MIB
        if row.get("peak_memory_mib"):
            row["predicted_over_measured"] = row["predicted_peak_mib"] / row["peak_memory_mib"]
        rows.append(row)
        emit(row)
    return rows


def smallest_oom(rows: list[dict]) -> dict[str, dict | None]:
    """Per kernel, the row of the smallest configuration (N, then d) out of memory, or None."""
    out: dict[str, dict | None] = {}
    for row in rows:
        out.setdefault(row["kernel"], None)
        if row["status"] == "oom":
            best = out[row["kernel"]]
            if best is None or (row["seq_len"], row["d_model"]) < (best["seq_len"], best["d_model"]):
                out[row["kernel"]] = row
    return out


def capacity_bytes(cfg: Settings) -> int | None:
    """The memory a configuration may take: the cap, else the GPU's (None on a CPU without a cap)."""
    if cfg.memory_cap_gib is not None:
        return int(cfg.memory_cap_gib * 2**30)
    if cfg.device == "cuda":
        import torch

        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return None


def predicted_smallest_oom(cfg: Settings, capacity: int) -> dict[str, tuple[int, int] | None]:
    """Per kernel, the smallest (N, d) of the grid whose predicted peak exceeds capacity."""
    out = {}
    for kernel in cfg.kernels:
        over = [(n, d) for n in sorted(cfg.seqs) for d in sorted(cfg.dims)
                if account(kernel, cfg.batch, cfg.heads, n, d, cfg.causal, cfg.device, cfg.threads).peak() > capacity]
        out[kernel] = over[0] if over else None
    return out


# ---------------------------------------------------------------- output


def _f(value, fmt: str, width: int) -> str:
    return f"{value:>{width}{fmt}}" if isinstance(value, (int, float)) and not math.isnan(value) else f"{'-':>{width}}"


def table_header(with_account: bool, width: int) -> str:
    head = (f"{'N':>6} {'d':>4} {'kernel':<{width}} {'status':<7} {'fwd ms':>9} {'bwd ms':>9} {'GFLOP/s':>8} "
            f"{'MiB pre-bwd':>11} {'peak MiB':>9}")
    return head + (f" {'pred MiB':>9} {'pred/meas':>9}" if with_account else "")


def table_line(row: dict, with_account: bool, width: int) -> str:
    line = (f"{row['seq_len']:>6} {row['d_model']:>4} {row['kernel']:<{width}} {row['status']:<7} "
            f"{_f(row.get('forward_ms'), '.3f', 9)} {_f(row.get('backward_ms'), '.3f', 9)} "
            f"{_f(row.get('gflops'), '.1f', 8)} {_f(row.get('memory_before_backward_mib'), '.1f', 11)} "
            f"{_f(row.get('peak_memory_mib'), '.1f', 9)}")
    if with_account:
        line += f" {_f(row.get('predicted_peak_mib'), '.1f', 9)} {_f(row.get('predicted_over_measured'), '.2f', 9)}"
    return line


def account_text(acc: Account, markdown: bool = False) -> list[str]:
    """The breakdown of one account: every term with its bytes and whether it is
    saved for backward, then the peak step of forward and backward."""
    peak = acc.peak_stage()
    split = acc.by_order(peak.live)
    title = (f"{acc.kernel} at B={acc.batch} H={acc.heads} N={acc.seq} d={acc.dim}"
             f"{' causal' if acc.causal else ''}, float32")
    saved = set(acc.saved)
    rows = [(t.name, t.formula, f"{t.nbytes / MIB:.3f}", f"N^{t.order}" if t.order == 2 else "N",
             ", ".join(r for r, on in (("saved", t.name in saved), ("at peak", t.name in peak.live)) if on), t.note)
            for t in acc.terms.values()]
    heads = ("tensor", "elements", "MiB", "grows as", "", "note")
    summary = [f"before backward (after forward): {acc.before_backward / MIB:.3f} MiB",
               f"forward peak: {acc.peak('forward') / MIB:.3f} MiB at {acc.peak_stage('forward').step}",
               f"backward peak: {acc.peak('backward') / MIB:.3f} MiB at {acc.peak_stage('backward').step}",
               f"predicted peak: {acc.peak() / MIB:.3f} MiB ({acc.peak()} bytes): "
               f"N^2 terms {split[2] / MIB:.3f} MiB, N terms {split[1] / MIB:.3f} MiB",
               *acc.notes]
    if markdown:
        out = [f"### {title}", "", "| " + " | ".join(h or "role" for h in heads) + " |",
               "|" + "---|" * len(heads)]
        out += ["| " + " | ".join(r) + " |" for r in rows]
        return out + [""] + [f"- {s}" for s in summary] + [""]
    w = max(len(r[0]) for r in rows)
    fw = max(len(r[1]) for r in rows)
    out = [f"## memory account: {title}"]
    out += [f"{r[0]:<{w}}  {r[1]:<{fw}}  {r[2]:>10}  {r[3]:<4}  {r[4]:<14}  {r[5]}".rstrip() for r in rows]
    return out + [f"# {s}" for s in summary]


def scaling_rows(cfg: Settings, dim: int) -> list[dict]:
    """The predicted peak of every kernel at every N of the grid (head size dim),
    split into its N^2 and N terms."""
    out = []
    for kernel in cfg.kernels:
        for n in sorted(cfg.seqs):
            acc = account(kernel, cfg.batch, cfg.heads, n, dim, cfg.causal, cfg.device, cfg.threads)
            stage = acc.peak_stage()
            split = acc.by_order(stage.live)
            out.append({"kernel": kernel, "seq_len": n, "d_model": dim, "peak_mib": acc.peak() / MIB,
                        "n2_mib": split[2] / MIB, "n_mib": split[1] / MIB, "peak_step": f"{stage.phase}: {stage.step}"})
    return out


def scaling_text(rows: list[dict], markdown: bool = False) -> list[str]:
    if markdown:
        out = ["| kernel | N | N^2 terms MiB | N terms MiB | peak MiB | peak at |", "|---|---|---|---|---|---|"]
        return out + [f"| {r['kernel']} | {r['seq_len']} | {r['n2_mib']:.2f} | {r['n_mib']:.2f} | "
                      f"{r['peak_mib']:.2f} | {r['peak_step']} |" for r in rows] + [""]
    w = max(len(r["kernel"]) for r in rows)
    out = [f"{'kernel':<{w}} {'N':>6} {'N^2 MiB':>10} {'N MiB':>9} {'peak MiB':>10}  peak at"]
    return out + [f"{r['kernel']:<{w}} {r['seq_len']:>6} {r['n2_mib']:>10.2f} {r['n_mib']:>9.2f} "
                  f"{r['peak_mib']:>10.2f}  {r['peak_step']}" for r in rows]


def account_focus(cfg: Settings, rows: list[dict]) -> tuple[int, int]:
    """The configuration the breakdown is printed for: the smallest one out of
    memory (what it explains), else the largest of the grid."""
    ooms = [r for r in smallest_oom(rows).values() if r is not None]
    if ooms:
        r = min(ooms, key=lambda r: (r["seq_len"], r["d_model"]))
        return r["seq_len"], r["d_model"]
    return max(cfg.seqs), max(cfg.dims)


def oom_lines(rows: list[dict], cfg: Settings, predicted: dict | None) -> list[str]:
    out = []
    for kernel, row in smallest_oom(rows).items():
        if row is None:
            line = f"{kernel}: none out of memory (up to N={max(cfg.seqs)}, d={max(cfg.dims)})"
        else:
            line = (f"{kernel}: N={row['seq_len']} d={row['d_model']} (batch {row['batch']}), predicted "
                    f"{row['predicted_forward_peak_mib']:.1f} MiB at the forward's peak, "
                    f"{row['predicted_peak_mib']:.1f} MiB at the backward's: {row['error']}")
        if predicted is not None:
            p = predicted.get(kernel)
            line += f"; the account predicts {'N=%d d=%d' % p if p else 'none'}"
        out.append(line)
    return out


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({c: row.get(c, "") for c in CSV_COLUMNS})


def write_markdown(path: str, result: dict, cfg: Settings) -> None:
    rows = result["rows"]
    lines = ["# attnkern study: forward and backward of attention", "", f"- device: {result['device']}",
             f"- {result['setup']}", "",
             "| N | d | kernel | status | fwd ms | bwd ms | GFLOP/s | MiB before bwd | peak MiB | predicted MiB "
             "| predicted / measured | error |", "|" + "---|" * 12]

    def cell(row, key, fmt):
        value = row.get(key)
        return format(value, fmt) if isinstance(value, (int, float)) and not math.isnan(value) else ""

    for r in rows:
        lines.append(f"| {r['seq_len']} | {r['d_model']} | {r['kernel']} | {r['status']} | "
                     f"{cell(r, 'forward_ms', '.3f')} | {cell(r, 'backward_ms', '.3f')} | {cell(r, 'gflops', '.1f')} | "
                     f"{cell(r, 'memory_before_backward_mib', '.1f')} | {cell(r, 'peak_memory_mib', '.1f')} | "
                     f"{cell(r, 'predicted_peak_mib', '.1f')} | {cell(r, 'predicted_over_measured', '.2f')} | "
                     f"{r['error'].replace('|', '/')} |")
    lines += ["", "## Smallest configuration out of memory, per kernel", ""]
    lines += [f"- {s}" for s in result["oom_lines"]] + [""]
    lines += ["## Memory account", ""]
    n, d = account_focus(cfg, rows)
    for kernel in cfg.kernels:
        lines += account_text(account(kernel, cfg.batch, cfg.heads, n, d, cfg.causal, cfg.device, cfg.threads),
                              markdown=True)
    lines += [f"### Scaling with N (d={max(cfg.dims)})", ""]
    lines += scaling_text(scaling_rows(cfg, max(cfg.dims)), markdown=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def write_plots(directory: str, rows: list[dict], cfg: Settings, with_account: bool) -> list[str]:
    """One PNG per d: forward ms, backward ms and peak MiB against N, log-log, a
    line per kernel (dashed: the predicted peak; x: where it ran out of memory)."""
    Figure, FigureCanvasAgg = _matplotlib()
    os.makedirs(directory, exist_ok=True)
    paths = []
    colors = {k: f"C{i}" for i, k in enumerate(cfg.kernels)}
    for d in cfg.dims:
        fig = Figure(figsize=(15, 4.5), layout="constrained")
        FigureCanvasAgg(fig)
        axes = fig.subplots(1, 3)
        panels = (("forward_ms", "forward (ms)"), ("backward_ms", "backward (ms)"),
                  ("peak_memory_mib", "peak memory (MiB)"))
        for ax, (key, label) in zip(axes, panels):
            for kernel in cfg.kernels:
                mine = [r for r in rows if r["kernel"] == kernel and r["d_model"] == d]
                ok = [r for r in mine if r["status"] == "ok" and r.get(key) and r[key] > 0]
                if ok:
                    ax.plot([r["seq_len"] for r in ok], [r[key] for r in ok], "o-", color=colors[kernel], label=kernel)
                if key == "peak_memory_mib" and with_account:
                    ax.plot([r["seq_len"] for r in mine], [r["predicted_peak_mib"] for r in mine], "--",
                            color=colors[kernel], alpha=0.6, label=f"{kernel} predicted")
                for r in mine:
                    if r["status"] == "oom":
                        ax.axvline(r["seq_len"], color=colors[kernel], linestyle=":", alpha=0.8)
                        ax.annotate(f"{kernel} OOM", (r["seq_len"], 0.95), xycoords=("data", "axes fraction"),
                                    rotation=90, ha="right", va="top", fontsize=7, color=colors[kernel])
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(cfg.seqs), [str(n) for n in sorted(cfg.seqs)])
            ax.minorticks_off()
            ax.set_yscale("log")
            ax.set_xlabel("sequence length N")
            ax.set_ylabel(label)
            ax.grid(True, which="both", alpha=0.3)
            if ax.has_data():
                ax.legend(fontsize=7)
        fig.suptitle(f"attention forward/backward, B={cfg.batch} H={cfg.heads} d={d}"
                     f"{' causal' if cfg.causal else ''}, float32, {cfg.device}")
        path = os.path.join(directory, f"study_d{d}.png")
        fig.savefig(path, dpi=100)
        paths.append(path)
    return paths


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise SystemExit("--plots needs matplotlib: pip install 'attnkern[bench]'") from None
    return Figure, FigureCanvasAgg


# ---------------------------------------------------------------- the command


def study_parser(sub) -> None:
    p = sub.add_parser("study", help="forward/backward time and memory of attention training over N and d, "
                                     "the smallest out-of-memory configuration, a memory account",
                       description=STUDY_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--batch", type=int, default=8, help="batch size B (default 8)")
    p.add_argument("--dims", type=int, nargs="+", default=[16, 32, 64, 128],
                   help="head sizes d; with one head (the default) d is d_model (default 16 32 64 128)")
    p.add_argument("--seqs", type=int, nargs="+", default=[256, 1024, 4096, 8192, 16384],
                   help="sequence lengths N (default 256 1024 4096 8192 16384: the GPU grid; on a small CPU try "
                        "--seqs 256 512 1024 --dims 16 64 --iters 5 --warmup 1)")
    p.add_argument("--heads", type=int, default=1, help="heads H, each of size d (default 1)")
    p.add_argument("--causal", action="store_true", help="causal mask (default none)")
    p.add_argument("--kernels", nargs="+", help="torch.naive, torch.sdpa and attnkern kernels with a backward "
                                                "(default torch.naive torch.sdpa, then native.flash on cpu, "
                                                "cuda.flash on cuda)")
    p.add_argument("--warmup", type=int, default=10, help="untimed iterations before the timed ones (default 10)")
    p.add_argument("--iters", type=int, default=100, help="timed iterations (default 100)")
    p.add_argument("--threads", type=int, help="cpu: threads of torch and of attnkern's kernels (default: the CPUs "
                                               "this process may use)")
    p.add_argument("--memory-cap", type=float, metavar="GIB",
                   help="memory a configuration may take, in GiB (2^30 bytes). cuda: "
                        "torch.cuda.set_per_process_memory_fraction(cap / total), which bounds what torch's "
                        "allocator may reserve. cpu: each row's process gets RLIMIT_AS = its address space after "
                        "the warm-up + cap, and its malloc maps every block of 128 KiB or more on its own, also for "
                        "the timings; RLIMIT_AS counts virtual memory (address space reserved, touched or not: "
                        "malloc arenas, thread stacks), not the resident set, so the boundary is approximate")
    p.add_argument("--no-skip-larger", dest="skip_larger", action="store_false",
                   help="also try the N larger than one out of memory (for the same kernel and d)")
    p.add_argument("--account", action="store_true",
                   help="print the memory model: tensors of forward and backward, which are saved, the predicted "
                        "peak beside the measured, and its N^2 and N terms as N grows")
    p.add_argument("--json", help="write settings, rows, smallest OOMs and account to this JSON file")
    p.add_argument("--csv", help="write the rows to this CSV file (" + ", ".join(CSV_COLUMNS) + ")")
    p.add_argument("--markdown", help="write a Markdown report: the table, the smallest OOM per kernel, the account")
    p.add_argument("--plots", metavar="DIR", help="write PNG plots (matplotlib) of forward, backward time and peak "
                                                  "memory against N, one file per d")
    p.set_defaults(func=cmd_study)


def cmd_study(args) -> int:
    try:
        import torch
    except ImportError:
        raise SystemExit("attnkern study needs PyTorch: pip install 'attnkern[torch]'") from None
    if args.plots:
        _matplotlib()  # fail before the measurements, not after
    if args.device == "cpu" and not os.path.exists("/proc/self/clear_refs"):
        raise SystemExit("attnkern study --device cpu measures memory through /proc/self (Linux)")
    if min(args.seqs + args.dims + [args.batch, args.heads]) < 1 or args.iters < 0 or args.warmup < 0:
        raise SystemExit("--seqs, --dims, --batch and --heads must be positive, --iters and --warmup not negative")
    from attnkern.hardware import cpu_count

    names = args.kernels or default_kernels(args.device)
    kernels = []
    for name in names:
        why = kernel_problem(name, args.device)
        if why is None:
            kernels.append(name)
        else:
            print(f"# skipping {name}: {why}")
    if not kernels:
        raise SystemExit("no kernel to study")
    cfg = Settings(batch=args.batch, heads=args.heads, dims=list(args.dims), seqs=sorted(args.seqs),
                   causal=args.causal, kernels=kernels, device=args.device, warmup=args.warmup, iters=args.iters,
                   threads=args.threads or cpu_count(), memory_cap_gib=args.memory_cap, skip_larger=args.skip_larger)
    if cfg.device == "cuda":
        from .harness import CudaTarget

        device = CudaTarget().describe()
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        device += f", {total / 2**30:.1f} GiB"
        how = "CUDA events; memory: torch.cuda.memory_allocated above the baseline"
    else:
        from .harness import CpuTarget

        device = f"{CpuTarget(cfg.threads).describe()}, torch {torch.__version__}"
        how = "wall clock; memory: resident set above the baseline, a fresh process per row"
    setup = (f"batch {cfg.batch}, heads {cfg.heads}, float32, causal {cfg.causal}; median of {cfg.iters} timed "
             f"iterations after {cfg.warmup} warm-up ({how})"
             + (f"; memory cap {cfg.memory_cap_gib:g} GiB" if cfg.memory_cap_gib is not None else ""))
    print(f"# {device}")
    print(f"# {setup}")
    width = max(12, *(len(k) for k in kernels))
    print(table_header(args.account, width), flush=True)
    rows = run_study(cfg, lambda row: print(table_line(row, args.account, width), flush=True))
    capacity = capacity_bytes(cfg)
    predicted = predicted_smallest_oom(cfg, capacity) if capacity is not None else None
    result = {"device": device, "setup": setup, "settings": asdict(cfg), "rows": rows,
              "smallest_oom": {k: (None if r is None else {"seq_len": r["seq_len"], "d_model": r["d_model"],
                                                            "error": r["error"]})
                               for k, r in smallest_oom(rows).items()},
              "predicted_smallest_oom": (None if predicted is None else
                                         {k: (None if p is None else {"seq_len": p[0], "d_model": p[1]})
                                          for k, p in predicted.items()}),
              "capacity_bytes": capacity}
    result["oom_lines"] = oom_lines(rows, cfg, predicted)
    print("# smallest configuration out of memory, per kernel"
          + (f" (capacity {capacity / MIB:.0f} MiB)" if capacity is not None else "") + ":")
    for line in result["oom_lines"]:
        print(f"#   {line}")
    n, d = account_focus(cfg, rows)
    accounts = [account(k, cfg.batch, cfg.heads, n, d, cfg.causal, cfg.device, cfg.threads) for k in kernels]
    scaling = scaling_rows(cfg, max(cfg.dims))
    result["account"] = {"breakdown": [a.as_dict() for a in accounts], "scaling": scaling}
    if args.account:
        for acc in accounts:
            print()
            print("\n".join(account_text(acc)))
        print()
        print(f"## predicted peak by N (d={max(cfg.dims)}): the N^2 terms (scores) against the N terms")
        print("\n".join(scaling_text(scaling)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.csv:
        write_csv(args.csv, rows)
    if args.markdown:
        write_markdown(args.markdown, result, cfg)
    if args.plots:
        for path in write_plots(args.plots, rows, cfg, args.account):
            print(f"# plot: {path}", file=sys.stderr)
    errors = [r for r in rows if r["status"] == "error"]
    for r in errors:
        print(f"# ERROR: {r['kernel']} at N={r['seq_len']} d={r['d_model']}: {r['error']}", file=sys.stderr)
    return 1 if errors else 0
