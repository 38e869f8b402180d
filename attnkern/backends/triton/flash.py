"""triton.flash: the FlashAttention-2 forward written in Triton.

One program per (block of BLOCK_M queries, head). It loads its Q block once,
then streams K/V blocks of BLOCK_N keys: S = Q K^T on tensor cores (float16 and
bfloat16 inputs; float32 inputs by default in 3xTF32, input_precision "tf32x3":
each operand split into two TF32 parts and three products summed, about as
accurate as float32 FMAs, or in exact float32 products, "ieee"; plain TF32 never
enters), an online softmax in float32 in the log2 domain
(Q K^T is scaled by scale * log2(e) and exp2 is used), the row maximum and sum
kept per query row, and O += P V with P cast to the input dtype for the second
matmul, accumulated in float32. The output is divided by the row sum once at the
end, and with WITH_LSE each row's natural-log log-sum-exp is written too.

The key loop has two stages so that the common case carries no masks: keys
[0, full_end) are visible to every row of the block and inside nk (no bounds or
causal checks), keys [full_end, end) are masked (the causal diagonal and the
partial last block). Causal blocks stop at the diagonal (top-left aligned: query
i sees keys j <= i, as torch's is_causal).

Block sizes, warps and pipeline stages are chosen by triton.autotune per head
size, mask, dtype and power-of-two bucket of the sequence lengths, among the
three configs chosen by the kind of problem (_prune).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

LOG2E = math.log2(math.e)
# (BLOCK_M, BLOCK_N, num_warps, num_stages) tried by the autotuner, three per kind of problem so
# that a new key compiles and times three configs: short sequences (a bucket of at most 512) get short
# query blocks, which still fill the GPU's multiprocessors; long ones tall blocks (fewer K/V reloads),
# with narrower key blocks for float32, whose tiles take twice the shared memory and registers
SMALL = [(64, 32, 4, 3), (32, 32, 2, 3), (64, 64, 4, 2)]
LARGE_16BIT = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3)]
LARGE_32BIT = [(64, 32, 4, 3), (128, 32, 4, 3), (64, 64, 4, 2)]
CONFIGS = list(dict.fromkeys(SMALL + LARGE_16BIT + LARGE_32BIT))


def _prune(configs, named_args, **kwargs):
    """The configs of this kind of problem (SMALL, LARGE_16BIT or LARGE_32BIT)."""
    itemsize = named_args["Q"].element_size()
    bucket = max(named_args["N_BUCKET_Q"], named_args["N_BUCKET_K"])
    group = SMALL if bucket <= 512 else LARGE_32BIT if itemsize == 4 else LARGE_16BIT
    wanted = set(group)
    kept = [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in wanted]
    return kept or configs[:1]


def _bench(fn, quantiles=None):
    # short autotuning runs: each config is timed for about 20 ms
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


@triton.jit
def _attend_block(acc, l_i, m_i, q, k_base, v_base, start_n, offs_m, offs_n, offs_d, offs_e, nk, d, dv, qk_scale,
                  MASKED: tl.constexpr, CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr,
                  PRECISION: tl.constexpr):
    """One K/V block of keys start_n + offs_n folded into the running (acc, l_i, m_i)."""
    keys = start_n + offs_n
    kt_ptrs = k_base + keys[None, :] * d + offs_d[:, None]  # K^T: (HEAD_DIM, BLOCK_N)
    v_ptrs = v_base + keys[:, None] * dv + offs_e[None, :]
    if MASKED:
        kt = tl.load(kt_ptrs, mask=(keys[None, :] < nk) & (offs_d[:, None] < d), other=0.0)
        v = tl.load(v_ptrs, mask=(keys[:, None] < nk) & (offs_e[None, :] < dv), other=0.0)
    else:
        if EVEN_D:
            kt = tl.load(kt_ptrs)
        else:
            kt = tl.load(kt_ptrs, mask=offs_d[:, None] < d, other=0.0)
        if EVEN_DV:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=offs_e[None, :] < dv, other=0.0)
    s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale
    if MASKED:
        visible = keys[None, :] < nk
        if CAUSAL:
            visible = visible & (keys[None, :] <= offs_m[:, None])
        s = tl.where(visible, s, float("-inf"))
    # every row has a visible key in the first block it sees, so m_new is finite
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return acc, l_i, m_new


@triton.autotune(
    configs=[triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in CONFIGS],
    key=["N_BUCKET_Q", "N_BUCKET_K", "HEAD_DIM", "HEAD_DV", "CAUSAL", "WITH_LSE"],
    prune_configs_by={"early_config_prune": _prune},
    do_bench=_bench,
)
@triton.jit
def flash_forward(Q, K, V, O, LSE, nq, nk, d, dv, qk_scale, N_BUCKET_Q, N_BUCKET_K,
                  HEAD_DIM: tl.constexpr, HEAD_DV: tl.constexpr, CAUSAL: tl.constexpr, WITH_LSE: tl.constexpr,
                  EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, PRECISION: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # Q, O: (batch, nq, d|dv) rows; K, V: (batch, nk, d|dv); LSE: (batch, nq); all C-contiguous
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_e = tl.arange(0, HEAD_DV)
    q_base = Q + bh * nq * d
    k_base = K + bh * nk * d
    v_base = V + bh * nk * dv
    row_ok = offs_m < nq
    q = tl.load(q_base + offs_m[:, None] * d + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < d),
                other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DV], tl.float32)
    if CAUSAL:
        end = tl.minimum(nk, start_m + BLOCK_M)
        full_end = tl.minimum(start_m, nk)  # keys before the block's first row: visible to all its rows
    else:
        end = nk
        full_end = nk
    full_end = (full_end // BLOCK_N) * BLOCK_N
    for start_n in range(0, full_end, BLOCK_N):
        acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, k_base, v_base, start_n, offs_m, offs_n, offs_d, offs_e,
                                      nk, d, dv, qk_scale, False, CAUSAL, EVEN_D, EVEN_DV, PRECISION)
    for start_n in range(full_end, end, BLOCK_N):
        acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, k_base, v_base, start_n, offs_m, offs_n, offs_d, offs_e,
                                      nk, d, dv, qk_scale, True, CAUSAL, EVEN_D, EVEN_DV, PRECISION)

    out = acc / l_i[:, None]
    o_base = O + bh * nq * dv
    tl.store(o_base + offs_m[:, None] * dv + offs_e[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (offs_e[None, :] < dv))
    if WITH_LSE:
        # m_i and log2(l_i) are in the log2 domain: lse = ln(sum_j exp(scale q.k_j)) = (m + log2 l) ln 2
        lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
        tl.store(LSE + bh * nq + offs_m, lse.to(LSE.dtype.element_ty), mask=row_ok)


def _bucket(n: int) -> int:
    """The power of two at or above n (at least 16): the autotuner's key, so that
    nearby sequence lengths share one tuned config."""
    return max(16, 1 << max(0, n - 1).bit_length())


def launch(q, k, v, out, lse, batch: int, nq: int, nk: int, d: int, dv: int, causal: bool, scale: float,
           dtype_name: str, tensor_cores: int = 1) -> None:
    """out (and lse, unless None) = the attention of (batch, n, d) arrays; q, k, v,
    out, lse: torch tensors or objects with data_ptr() and a dtype Triton knows;
    float32 products in 3xTF32 with tensor_cores, else exact."""
    hd, hdv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dv))
    # 16-bit inputs ignore the precision; float32 never runs plain (one-pass) TF32
    precision = ("tf32x3" if tensor_cores else "ieee") if dtype_name == "float32" else "tf32"

    def grid(meta):
        return (triton.cdiv(nq, meta["BLOCK_M"]), batch)

    flash_forward[grid](q, k, v, out, out if lse is None else lse, nq, nk, d, dv, scale * LOG2E,
                        _bucket(nq), _bucket(nk), HEAD_DIM=hd, HEAD_DV=hdv, CAUSAL=bool(causal),
                        WITH_LSE=lse is not None, EVEN_D=hd == d, EVEN_DV=hdv == dv, PRECISION=precision)
