"""The study's model: its settings and grid of configurations, and the
theoretical memory account of one kernel and configuration (the N x N scores
that the naive graph saves for backward, the O(N) log-sum-exp that
FlashAttention-2 saves instead) to set beside the measured peaks."""

from __future__ import annotations

import os

from dataclasses import asdict, dataclass, field

from ..counts import attention_flops

MIB = 2**20
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}  # the study's dtypes
TORCH_KERNELS = ("torch.naive", "torch.sdpa")  # torch with autograd; attnkern's registry entries of these names
# (no backward) are not what runs here
CSV_COLUMNS = ("batch", "seq_len", "d_model", "kernel", "causal", "status", "error", "forward_ms", "backward_ms",
               "memory_before_backward_mib", "peak_memory_mib", "predicted_peak_mib")


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
    dtype: str = "float32"


def default_kernels(device: str) -> list[str]:
    return [*TORCH_KERNELS, *(("cuda.flash", "triton.flash") if device == "cuda" else ("native.flash",))]


def kernel_problem(name: str, device: str, dtype: str = "float32") -> str | None:
    """Why `name` cannot take part on `device` in `dtype` (None: it can); an unknown name
    exits. A kernel without a backward for dtype (but with one for float32) takes part
    with its forward alone (has_backward)."""
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
    if dtype not in info["dtypes"]:
        return f"does not take {dtype} (it takes {', '.join(info['dtypes'])})"
    return None


def has_backward(name: str, dtype: str) -> bool:
    """Whether the study can run `name`'s backward in dtype (torch's always)."""
    if name in TORCH_KERNELS:
        return True
    import attnkern

    return dtype in attnkern.kernel_info(name)["backward_dtypes"]


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
    dtype: str = "float32"

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
        return {"kernel": self.kernel, "dtype": self.dtype, "batch": self.batch, "heads": self.heads,
                "seq_len": self.seq,
                "d_model": self.dim, "causal": self.causal, "terms": [asdict(t) for t in self.terms.values()],
                "stages": [{**asdict(s), "bytes": self.live_bytes(s.live)} for s in self.stages],
                "saved_for_backward": list(self.saved), "before_backward_bytes": self.before_backward,
                "forward_peak_bytes": self.peak("forward"), "backward_peak_bytes": self.peak("backward"),
                "peak_bytes": self.live_bytes(peak.live), "peak_step": f"{peak.phase}: {peak.step}",
                "peak_n2_bytes": self.by_order(peak.live)[2], "peak_n_bytes": self.by_order(peak.live)[1],
                "notes": self.notes}


def settings_account(cfg: Settings, kernel: str, seq: int, dim: int) -> Account:
    """account() of kernel at (seq, dim) with the rest from the study's settings."""
    return account(kernel, cfg.batch, cfg.heads, seq, dim, cfg.causal, cfg.device, cfg.threads, cfg.dtype)


def account(kernel: str, batch: int, heads: int, seq: int, dim: int, causal: bool = False, device: str = "cpu",
            threads: int = 1, dtype: str = "float32") -> Account:
    """The memory model of one forward and backward of `kernel` at (batch, heads,
    seq, dim) in dtype: torch.naive's graph, a fused torch.sdpa, or an attnkern flash
    kernel. Every tensor is of dtype, but for torch.sdpa's lse and the backward's
    row sums (float32 always) and native.flash's half backward (float32 copies)."""
    itemsize = ITEMSIZE[dtype]
    b, h, n, d = batch, heads, seq, dim
    bhnd, bhn, bhn2 = b * h * n * d * itemsize, b * h * n * itemsize, b * h * n * n * itemsize
    bhn4 = b * h * n * 4  # a float32 value per row
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
            lse = Term("lse", "B*H*ceil(N/32)*32", b * h * -(-n // 32) * 32 * 4, 1, lse_note + " (float32)")
        elif kernel == "torch.sdpa":
            lse = Term("lse", "B*H*N", bhn4, 1, lse_note + " (float32)")
        else:
            lse = Term("lse", "B*H*N", bhn, 1, lse_note)
        terms += [lse, Term("dq, dk, dv", "3 B*H*N*d", 3 * bhnd, 1)]
        fwd_extra: tuple[str, ...] = ()
        bwd_extra: tuple[str, ...] = ()
        if kernel == "torch.sdpa":
            terms.append(Term("delta = rowsum(dout * out)", "B*H*N", bhn4, 1, "float32"))
            bwd_extra = ("delta = rowsum(dout * out)",)
            notes.append("torch.sdpa: modelled as torch's fused kernels (flash on the CPU, memory-efficient for "
                         "float32 on the GPU): out and lse saved; their work buffers are not modelled"
                         + (" (on an H100 with torch 2.11 the backward took B*H*N*max(d, 64)*4 bytes more, "
                            "an O(N) float32 buffer)" if device == "cuda" else ""))
        elif device == "cuda":
            terms.append(Term("delta = rowsum(dout * out)", "B*H*N", bhn4, 1,
                              "float32, a Numba allocation: outside torch's counters"))
            bwd_extra = ("delta = rowsum(dout * out)",)
            notes.append(f"{kernel}: tiles live in shared memory; delta is allocated through Numba, which "
                         "torch.cuda.max_memory_allocated does not see")
            if kernel == "triton.flash" and os.environ.get("ATTNKERN_TRITON_AUTOTUNE") == "1":
                # by default triton.flash's configs come from a fixed table: no autotuning, no such buffer
                notes.append("triton.flash: with ATTNKERN_TRITON_AUTOTUNE=1 the first call of a shape runs Triton's "
                             "autotuner, whose timing (triton.testing.do_bench) allocates a 256 MiB buffer to flush "
                             "the L2 cache; the study measures memory on that first call, so its peak includes those "
                             "256 MiB (later calls of the shape do not allocate it)")
        else:
            fwd_ws, bwd_ws = _native_work_elements(kernel, d, threads)
            terms += [Term("work buffers (forward)", f"{threads} threads x blocks", fwd_ws * 4, 1,
                           "float32, per thread, O(block_q * block_k); padding ignored"),
                      Term("lse2, D (backward)", "2 B*H*N", 2 * bhn4, 1, "lse * log2(e) and rowsum(dout * out)"),
                      Term("work buffers (backward)", f"{threads} threads x blocks", bwd_ws * 4, 1,
                           "float32, per thread, O(block_q * block_k); padding ignored")]
            fwd_extra, bwd_extra = ("work buffers (forward)",), ("lse2, D (backward)", "work buffers (backward)")
            if itemsize != 4:
                terms.append(Term("float32 copies (half backward)", "8 B*H*N*d float32", 8 * b * h * n * d * 4, 1,
                                  "q, k, v, out, dout widened once and dq, dk, dv computed in float32"))
                bwd_extra += ("float32 copies (half backward)",)
        fwd = [Stage("forward", "out, lse", (*inputs, "out", "lse", *fwd_extra))]
        after = (*inputs, "out", "lse")
        bwd = [Stage("backward", "dq, dk, dv", (*inputs, "out", "lse", *bwd_extra, "dq, dk, dv")),
               Stage("backward", "after backward", (*inputs, "out", "dq, dk, dv"))]
        saved = ("out", "lse")
        notes.append(f"{kernel}: saves q, k, v, out and the lse (O(N)); the backward recomputes P block by block: "
                     "no N x N tensor")
    return Account(kernel, b, h, n, d, causal, {t.name: t for t in terms}, fwd + bwd, after, saved, notes, dtype)


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
