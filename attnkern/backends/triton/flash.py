"""triton.flash: FlashAttention-2 forward and backward written in Triton.

Forward (flash_forward). One program per (block of BLOCK_M queries, head). It
loads its Q block once, then streams K/V blocks of BLOCK_N keys: S = Q K^T on
tensor cores (float16 and bfloat16 inputs; float32 inputs by default in 3xTF32,
input_precision "tf32x3": each operand split into two TF32 parts and three
products summed, about as accurate as float32 FMAs, or in exact float32
products, "ieee"; plain TF32 never enters), an online softmax in float32 in the
log2 domain (scores scaled by scale * log2(e), exp2), the row maximum and sum
kept per query row, and O += P V with P cast to the input dtype for the second
matmul, accumulated in float32. The output is divided by the row sum once at the
end, and with WITH_LSE each row's natural-log log-sum-exp is written too.

The features (attnkern's Features) are compile-time switches, so that a plain
call carries none of their code: grouped k/v heads (query row block bh reads k/v
head bh // GROUP, no copy); key lengths (keys j >= the sequence's length are
hidden; LENS holds one per sequence of ROWS_PER_SEQ query heads); the diagonal
offset of the causal and window masks (bottom-right: length - nq); a causal mask
or a window's right side (j <= i + off + right: causal is right = 0), a window's
left side (j >= i + off - left); a softcap c (S = c tanh(R / c)). A row that sees
no key gets 0 and lse -inf.

Each program's key loop has three stages so that the blocks inside every row's
visible range carry no masks: [lo, a) and [b, hi) are masked (the window's and
the diagonal's edges, the partial last block), [a, b) is not (_key_range).

Backward, in two kernels, deterministic (no atomics), as the Triton tutorial's
fused attention: flash_backward_dq, one program per query block, recomputes P
from the saved lse and writes dQ, and for the second kernel delta = rowsum(dO O)
and the lse in float32 (below); flash_backward_dkdv, one program per key block
and k/v head, recomputes P^T block by block over the query blocks of every
query head that shares the k/v head (grouped-query attention sums there), and
writes dK and dV. The saved lse may have been rounded to float16 or bfloat16,
which would scale each recomputed row of P by up to exp(u |lse|), far beyond the
gradients' bounds. The dQ kernel therefore also sums each row's recomputed P
(one more reduction, no more products) and corrects the lse by the log of that
sum, but only by up to the rounding the lse's dtype allows (u |lse|, plus a
float32 margin): an lse that is exact stays as it is, so out and lse of whole
rows of which k, v hold a block (ring attention) still give that block's share.

Block sizes, warps and pipeline stages come from a fixed table per kernel, dtype
size, head size, sequence class and mask (TABLE, config): the same call runs the
same compiled kernel in every process, so its output is the same bit for bit.
ATTNKERN_TRITON_AUTOTUNE=1 hands the choice to triton.autotune instead (opt-in).

With a causal mask (or a window's right side) the forward and dQ programs take
their query blocks last first: the blocks that see the most keys start in the
first wave and the short ones fill the tail.

The forward's Hopper variant (the switch TMA; HOPPER_TABLE, hopper_ready) loads
the K and V blocks of the unmasked middle stage through device-side tensor
descriptors (the copy engine), optionally in a warp-specialized loop, and folds
the scale into one FMA there; the masked stages keep pointer loads. Calls it
cannot take, or whose compilation fails, run the pointer-load kernel
(docs/triton.md).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Each kernel's (BLOCK_M, BLOCK_N, num_warps, num_stages) comes from a fixed table, so that the same
# call compiles and runs the same kernel in every process (the output's bits depend on the blocks,
# and an autotuner's timing-based pick swung from run to run). Keys: (kernel, the itemsize of the
# inputs, the head-size class (64: D, Dv <= 64; 128: <= 128; 256: larger), the sequence class
# ("small": both lengths' power-of-two buckets <= 512, else "large"), masked: causal or a window).
# The 16-bit large entries were measured on an H100 with dev/triton_measure.py --parts configs
# (docs/gpu-backward.md); the others are the configs that compile for sm_90 with no register
# spills. dQ programs hold a query block and stream key blocks, dK/dV programs the reverse (two
# BLOCK_N x D float32 accumulators). ATTNKERN_TRITON_AUTOTUNE=1 lets triton.autotune pick per call
# shape among CANDIDATES instead (opt-in: the pick, and so the output's bits, may vary between runs).
TABLE = {
    # forward
    ("forward", 2, 64, "large", False): (64, 64, 4, 3),
    ("forward", 2, 64, "large", True): (64, 64, 4, 3),
    ("forward", 2, 128, "large", False): (64, 64, 4, 3),
    ("forward", 2, 128, "large", True): (64, 64, 4, 3),
    # dQ
    ("dq", 2, 64, "large", False): (64, 64, 4, 3),
    ("dq", 2, 64, "large", True): (64, 64, 4, 3),
    ("dq", 2, 128, "large", False): (128, 64, 8, 3),
    ("dq", 2, 128, "large", True): (128, 64, 8, 3),
    # dK/dV
    ("dkdv", 2, 64, "large", False): (64, 64, 4, 3),
    ("dkdv", 2, 64, "large", True): (64, 64, 4, 3),
    ("dkdv", 2, 128, "large", False): (32, 64, 4, 3),
    ("dkdv", 2, 128, "large", True): (32, 64, 4, 3),
}
# what a key without an entry takes (the configs these kernels ran before the table): the forward
# short query blocks for short sequences (which still fill the GPU's multiprocessors), tall ones
# for long 16-bit ones, narrow ones for float32 (a float32 tile takes twice the shared memory and
# registers); the backward larger tiles for 16-bit inputs with head sizes up to 64 ("half64"),
# smaller ones for the rest ("other")
DEFAULT = {"forward": {"short": (64, 32, 4, 3), "half": (128, 64, 4, 3), "other": (64, 32, 4, 3)},
           "dq": {"half64": (64, 64, 8, 3), "other": (64, 32, 4, 2)},
           "dkdv": {"half64": (32, 64, 8, 3), "other": (32, 32, 4, 2)}}
# the autotuner's candidates (opt-in), beside the table's entry for the call
CANDIDATES = {"forward": [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 32, 4, 3), (128, 64, 4, 3)],
              "dq": [(64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3), (128, 32, 8, 3), (64, 32, 4, 2)],
              "dkdv": [(64, 64, 4, 3), (32, 64, 4, 3), (32, 128, 8, 3), (32, 32, 4, 2)]}
# tests and measurements: kernel name -> a config that replaces the table's for every call
OVERRIDE: dict = {}

# The forward's Hopper variant (TMA: K and V of the unmasked stage through tensor descriptors), per
# (dtype size, head-size class, sequence class, masked) as TABLE's forward keys:
# (BLOCK_M, BLOCK_N, num_warps, num_stages, warp_specialize). It runs where its key has an entry and
# the call can take it (hopper_ready); everything else runs the pointer-load kernel of TABLE.
# The entries were measured on an H100 (2026-11-27, Triton 3.6.0, torch 2.11) at (B, 16, N, D)
# bfloat16, B 1-8, N 2048-16384, 3 runs, launched without lse as the library call's default: each
# candidate against the previous entry in the same turns (dev/trihop_sweep.py; docs/triton.md).
# Without warp specialization the same tiles (and at D = 64 causal 128 x 64 tiles of 8 warps
# rather than 64 x 64 of 4) were at least as fast in every call of 0.4-5 ms (medians 1-8% faster),
# their medians within 2% either way in longer calls.
HOPPER_TABLE = {
    (2, 64, "large", False): (128, 64, 8, 3, False),
    (2, 64, "large", True): (128, 64, 8, 3, False),
    (2, 128, "large", False): (128, 128, 8, 3, False),
    (2, 128, "large", True): (128, 128, 8, 3, False),
}
# what a key without an entry takes where ATTNKERN_TRITON_HOPPER=all forces the variant on every
# call that can take it (tests of the variant's features at small shapes)
HOPPER_DEFAULT = (64, 64, 4, 3, False)


def hopper_config(itemsize: int, head: int, bucket: int, masked: bool):
    """The forward's Hopper variant config (HOPPER_TABLE) for a call (config's arguments), or
    None: no entry, or ATTNKERN_TRITON_HOPPER=0. OVERRIDE["forward_hopper"] replaces it (None:
    the variant off); ATTNKERN_TRITON_HOPPER=all gives keys without an entry HOPPER_DEFAULT."""
    import os

    if "forward_hopper" in OVERRIDE:
        return OVERRIDE["forward_hopper"]
    mode = os.environ.get("ATTNKERN_TRITON_HOPPER", "")
    if mode == "0":
        return None
    size = "small" if bucket <= 512 else "large"
    cls = 64 if head <= 64 else 128 if head <= 128 else 256
    found = HOPPER_TABLE.get((itemsize, cls, size, masked))
    return HOPPER_DEFAULT if found is None and mode == "all" else found


_HOPPER_GPU: dict = {}


def hopper_ready(tensors, d: int, dv: int, itemsize: int) -> bool:
    """Whether a forward call can run the Hopper variant: this Triton has device-side tensor
    descriptors, the GPU is a Hopper or later (compute capability 9+), 16-bit inputs, rows of
    a multiple of 16 bytes (d, dv multiples of 8) and 16-byte-aligned addresses, as the copy
    engine requires."""
    if itemsize != 2 or d % 8 or dv % 8 or not hasattr(tl, "make_tensor_descriptor") \
            or not hasattr(triton, "set_allocator") or any(t.data_ptr() % 16 for t in tensors):
        return False
    if "ok" not in _HOPPER_GPU:
        try:
            target = triton.runtime.driver.active.get_current_target()
            _HOPPER_GPU["ok"] = target.backend == "cuda" and int(target.arch) >= 90
        except Exception:  # no driver, an unknown backend: the pointer-load kernel
            _HOPPER_GPU["ok"] = False
    return _HOPPER_GPU["ok"]


def _scratch(size: int, alignment: int, stream):
    """Triton's allocator for the descriptors' global scratch (128 bytes per descriptor and
    program): torch's caching allocator, on torch's current stream."""
    import torch

    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Sets _scratch as Triton's allocator where none is set in this context (Triton keeps it in
    a context variable: each thread starts without one); an allocator set by the caller stays."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def config(kernel: str, itemsize: int, head: int, bucket: int, masked: bool) -> tuple:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of `kernel` ("forward", "dq", "dkdv") for inputs of
    itemsize bytes, padded head size head (max of D and Dv), the larger power-of-two bucket of
    the two sequence lengths, masked (causal or a window)."""
    if kernel in OVERRIDE:
        return OVERRIDE[kernel]
    size = "small" if bucket <= 512 else "large"
    cls = 64 if head <= 64 else 128 if head <= 128 else 256
    found = TABLE.get((kernel, itemsize, cls, size, masked))
    if found is not None:
        return found
    if kernel == "forward":
        return DEFAULT[kernel]["short" if size == "small" else "half" if itemsize == 2 else "other"]
    return DEFAULT[kernel]["half64" if itemsize == 2 and cls == 64 else "other"]


def _autotuning() -> bool:
    import os

    return os.environ.get("ATTNKERN_TRITON_AUTOTUNE") == "1"


def _bench(fn, quantiles=None):
    # short autotuning runs: each config is timed for about 20 ms
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


_TUNED = {}


def _tuned(jit, kernel: str, chosen: tuple, key: list):
    """jit wrapped in triton.autotune over CANDIDATES[kernel] and chosen (opt-in autotuning)."""
    if (kernel, chosen) not in _TUNED:
        configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
                   for bm, bn, w, s in dict.fromkeys([chosen] + CANDIDATES[kernel])]
        _TUNED[kernel, chosen] = triton.autotune(configs=configs, key=key, do_bench=_bench)(jit)
    return _TUNED[kernel, chosen]


def _launch(jit, kernel: str, chosen: tuple, key: list, grid, args, switches):
    """Launch jit on grid(BLOCK_M, BLOCK_N) with the table's config chosen, or (opt-in) the
    autotuner's; returns (the compiled kernel, the config's (BLOCK_M, BLOCK_N))."""
    if _autotuning():
        tuned = _tuned(jit, kernel, chosen, key)
        compiled = tuned[lambda meta: grid(meta["BLOCK_M"], meta["BLOCK_N"])](*args, **switches)
        best = tuned.best_config
        return compiled, (best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"])
    bm, bn, warps, stages = chosen
    compiled = jit[grid(bm, bn)](*args, **switches, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    return compiled, (bm, bn)


# what the opt-in autotuner's key holds besides each kernel's own switches: the size buckets, head
# sizes, the mask and the features
_KEY = ["N_BUCKET_Q", "N_BUCKET_K", "HEAD_DIM", "HEAD_DV", "HAS_LEFT", "HAS_RIGHT", "HAS_LENS", "SOFTCAP",
        "GROUP_GT1"]


@triton.jit
def _block_start(BLOCK_M: tl.constexpr, LAST_FIRST: tl.constexpr):
    """This program's first query row: block program_id(0), or with LAST_FIRST (a right-side
    mask, under which later blocks see more keys) the blocks in reverse, longest first."""
    pid = tl.program_id(0)
    if LAST_FIRST:
        pid = tl.num_programs(0) - 1 - pid
    return pid * BLOCK_M


@triton.jit
def _length(LENS, bh, nk, ROWS_PER_SEQ, HAS_LENS: tl.constexpr):
    """The key length of query row block bh's sequence (nk without key lengths)."""
    if HAS_LENS:
        return tl.load(LENS + bh // ROWS_PER_SEQ).to(tl.int32)
    else:
        return nk


@triton.jit
def _tile(base, rows, row_ok, cols, n, N: tl.constexpr, EVEN: tl.constexpr, TRANSPOSED: tl.constexpr):
    """(pointers or offsets from base, mask) of a tile of rows `rows` (row_ok: those inside the
    array) and columns `cols` of a C-contiguous array with n columns (N: n rounded up to a power
    of two; EVEN: n == N, which drops the column mask and makes the row stride a constant), as
    (rows, cols) or TRANSPOSED (cols, rows)."""
    if EVEN:
        stride = N
    else:
        stride = n
    if TRANSPOSED:
        ptrs = base + rows[None, :] * stride + cols[:, None]
        mask = row_ok[None, :]
        if not EVEN:
            mask = mask & (cols[:, None] < n)
    else:
        ptrs = base + rows[:, None] * stride + cols[None, :]
        mask = row_ok[:, None]
        if not EVEN:
            mask = mask & (cols[None, :] < n)
    return ptrs, mask


@triton.jit
def _key_range(start_m, length, off, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """(lo, a, b, hi) for the query rows start_m + [0, BLOCK_M): the keys any row sees lie in
    [lo, hi), those every row sees in [a, b) (a, b, lo multiples of BLOCK_N; lo <= a <= b <= hi
    unless the range is empty). Values are kept >= 0 before integer division."""
    lo = 0
    hi = length
    if HAS_LEFT:
        lo = tl.maximum(start_m + off - left, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(hi, tl.maximum(start_m + BLOCK_M + off + right, 0))
    a = lo
    if HAS_LEFT:  # the last row's first key, rounded up
        a = tl.maximum(start_m + BLOCK_M - 1 + off - left, lo)
        a = ((a + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    b = length
    if HAS_RIGHT:  # the first row's last key + 1
        b = tl.minimum(b, tl.maximum(start_m + off + right + 1, 0))
    b = (b // BLOCK_N) * BLOCK_N
    hi_up = ((tl.maximum(hi, lo) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    a = tl.minimum(a, hi_up)
    b = tl.maximum(b, a)
    return lo, a, b, hi


@triton.jit
def _visible(rows, keys, length, off, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """(BLOCK_M, BLOCK_N): whether query row i sees key j."""
    seen = keys[None, :] < length
    if HAS_RIGHT:
        seen = seen & (keys[None, :] <= rows[:, None] + off + right)
    if HAS_LEFT:
        seen = seen & (keys[None, :] >= rows[:, None] + off - left)
    return seen


@triton.jit
def _scores(q, kt, qk_scale, cap_in, cap_out, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """Scores in the log2 domain, and tanh(R / c) with a softcap (else 0.0): without a cap
    R log2(e) = (q.k) qk_scale; with one, c tanh(R / c) log2(e) = cap_out tanh((q.k) cap_in)."""
    dot = tl.dot(q, kt, input_precision=PRECISION)
    if SOFTCAP:
        # tanh x = 1 - 2 / (e^(2x) + 1): exact at both ends (e^(2x) overflowing to inf gives 1)
        t = 1.0 - 2.0 / (tl.math.exp2(dot * cap_in) + 1.0)
        return t * cap_out, t
    else:
        return dot * qk_scale, 0.0


@triton.jit
def _attend_block(acc, l_i, m_i, q, k_base, v_base, start_n, offs_m, offs_n, offs_d, offs_e, nk, d, dv, qk_scale,
                  cap_in, cap_out, length, off, left, right,
                  MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                  EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, PRECISION: tl.constexpr):
    """One K/V block of keys start_n + offs_n (loaded through pointers) folded into the running
    (acc, l_i, m_i)."""
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
    return _fold(acc, l_i, m_i, q, kt, v, keys, offs_m, qk_scale, cap_in, cap_out, length, off, left, right,
                 MASKED, HAS_LEFT, HAS_RIGHT, SOFTCAP, PRECISION, False)


@triton.jit
def _fold(acc, l_i, m_i, q, kt, v, keys, offs_m, qk_scale, cap_in, cap_out, length, off, left, right,
          MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
          PRECISION: tl.constexpr, SCALE_LATE: tl.constexpr):
    """The block of keys `keys` (K^T kt, V v) folded into the running (acc, l_i, m_i). SCALE_LATE
    (unmasked, no softcap): the row maximum is taken of the unscaled products and each
    exponent is one FMA, q.k qk_scale - m, as in Triton's fused-attention tutorial."""
    if SCALE_LATE:
        dot = tl.dot(q, kt, input_precision=PRECISION)
        m_new = tl.maximum(m_i, tl.max(dot, 1) * qk_scale)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(dot * qk_scale - m_new[:, None])
    else:
        s, _ = _scores(q, kt, qk_scale, cap_in, cap_out, SOFTCAP, PRECISION)
        if MASKED:
            s = tl.where(_visible(offs_m, keys, length, off, left, right, HAS_LEFT, HAS_RIGHT), s, float("-inf"))
            # a row may see no key of this block, nor of any before: keep exp2's arguments finite
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return acc, l_i, m_new


@triton.jit
def flash_forward(Q, K, V, O, LSE, LENS, nq, nk, d, dv, qk_scale, cap_in, cap_out, left, right, bottom_right,
                  ROWS_PER_SEQ, GROUP, N_BUCKET_Q, N_BUCKET_K,
                  HEAD_DIM: tl.constexpr, HEAD_DV: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
                  HAS_LENS: tl.constexpr, SOFTCAP: tl.constexpr, GROUP_GT1: tl.constexpr, WITH_LSE: tl.constexpr,
                  EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, PRECISION: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr = False,
                  WARP_SPECIALIZE: tl.constexpr = False):
    # Q, O: (batch, nq, d|dv) rows; K, V: (batch / GROUP, nk, d|dv); LSE: (batch, nq); all C-contiguous.
    # TMA (Hopper): the unmasked middle stage loads its K and V blocks through tensor descriptors
    # (the copy engine, asynchronously), optionally in a warp-specialized loop (WARP_SPECIALIZE:
    # producer warps load, consumer warps compute); the masked stages keep pointer loads, whose
    # masks give zeros past nk (a descriptor over every k/v head's rows would read the next head's)
    start_m = _block_start(BLOCK_M, HAS_RIGHT)
    bh = tl.program_id(1)
    bh_kv = bh
    if GROUP_GT1:
        bh_kv = bh // GROUP
    bh64, bh_kv64 = bh.to(tl.int64), bh_kv.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_e = tl.arange(0, HEAD_DV)
    q_base = Q + bh64 * nq * d
    k_base = K + bh_kv64 * nk * d
    v_base = V + bh_kv64 * nk * dv
    row_ok = offs_m < nq
    q = tl.load(q_base + offs_m[:, None] * d + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < d),
                other=0.0)
    length = _length(LENS, bh, nk, ROWS_PER_SEQ, HAS_LENS)
    off = (length - nq) * bottom_right  # the diagonal: row i's own key is i + off

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DV], tl.float32)
    lo, a, b, hi = _key_range(start_m, length, off, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    for start_n in range(lo, a, BLOCK_N):
        acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, k_base, v_base, start_n, offs_m, offs_n, offs_d, offs_e,
                                      nk, d, dv, qk_scale, cap_in, cap_out, length, off, left, right, True,
                                      HAS_LEFT, HAS_RIGHT, SOFTCAP, EVEN_D, EVEN_DV, PRECISION)
    if TMA:
        # every k/v head's rows as one (batch_kv nk, d) matrix; this head's start at row bh_kv nk; the
        # stage's keys [a, b) lie below length <= nk, so its blocks never reach the next head's rows.
        # Columns past d (HEAD_DIM > d) come as zeros.
        kv_rows = tl.num_programs(1) // GROUP * nk
        k_desc = tl.make_tensor_descriptor(K, shape=[kv_rows, d], strides=[d, 1], block_shape=[BLOCK_N, HEAD_DIM])
        v_desc = tl.make_tensor_descriptor(V, shape=[kv_rows, dv], strides=[dv, 1],
                                           block_shape=[BLOCK_N, HEAD_DV])
        row0 = bh_kv * nk
        for start_n in tl.range(a, b, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            kt = k_desc.load([row0 + start_n, 0]).T
            v = v_desc.load([row0 + start_n, 0])
            acc, l_i, m_i = _fold(acc, l_i, m_i, q, kt, v, start_n + offs_n, offs_m, qk_scale, cap_in, cap_out,
                                  length, off, left, right, False, HAS_LEFT, HAS_RIGHT, SOFTCAP, PRECISION,
                                  not SOFTCAP)
    else:
        for start_n in range(a, b, BLOCK_N):
            acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, k_base, v_base, start_n, offs_m, offs_n, offs_d,
                                          offs_e, nk, d, dv, qk_scale, cap_in, cap_out, length, off, left, right,
                                          False, HAS_LEFT, HAS_RIGHT, SOFTCAP, EVEN_D, EVEN_DV, PRECISION)
    for start_n in range(b, hi, BLOCK_N):
        acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, k_base, v_base, start_n, offs_m, offs_n, offs_d, offs_e,
                                      nk, d, dv, qk_scale, cap_in, cap_out, length, off, left, right, True,
                                      HAS_LEFT, HAS_RIGHT, SOFTCAP, EVEN_D, EVEN_DV, PRECISION)

    empty = l_i == 0.0  # rows that see no key: out 0, lse -inf
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    o_base = O + bh64 * nq * dv
    tl.store(o_base + offs_m[:, None] * dv + offs_e[None, :], out.to(O.dtype.element_ty),
             mask=row_ok[:, None] & (offs_e[None, :] < dv))
    if WITH_LSE:
        # m_i and log2(l_i) are in the log2 domain: lse = ln(sum_j exp(S_j)) = (m + log2 l) ln 2
        lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        tl.store(LSE + bh64 * nq + offs_m, lse.to(LSE.dtype.element_ty), mask=row_ok)


@triton.jit
def flash_backward_dq(Q, K, V, O, DO, LSE, DQ, DELTA, LSE2, LENS, nq, nk, d, dv, scale, qk_scale, cap_in, cap_out,
                      left, right, bottom_right, ROWS_PER_SEQ, GROUP, N_BUCKET_Q, N_BUCKET_K, LSE_ROUNDING,
                      HEAD_DIM: tl.constexpr, HEAD_DV: tl.constexpr, HAS_LEFT: tl.constexpr,
                      HAS_RIGHT: tl.constexpr, HAS_LENS: tl.constexpr, SOFTCAP: tl.constexpr,
                      GROUP_GT1: tl.constexpr, PRECISION: tl.constexpr, EVEN_D: tl.constexpr,
                      EVEN_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # dQ of one query block; DELTA, LSE2 (batch, nq) float32: rowsum(dO O) and the lse in the log2
    # domain (corrected within LSE_ROUNDING |lse|; +inf for rows that see no key) for the dK/dV kernel
    start_m = _block_start(BLOCK_M, HAS_RIGHT)
    bh = tl.program_id(1)
    bh_kv = bh
    if GROUP_GT1:
        bh_kv = bh // GROUP
    bh64, bh_kv64 = bh.to(tl.int64), bh_kv.to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_e = tl.arange(0, HEAD_DV)
    row_ok = offs_m < nq
    q_ptrs, qmask = _tile(bh64 * nq * d, offs_m, row_ok, offs_d, d, HEAD_DIM, EVEN_D, False)  # offsets
    q = tl.load(Q + q_ptrs, mask=qmask, other=0.0)
    o_ptrs, omask = _tile(bh64 * nq * dv, offs_m, row_ok, offs_e, dv, HEAD_DV, EVEN_DV, False)
    do = tl.load(DO + o_ptrs, mask=omask, other=0.0)
    delta = tl.sum(do.to(tl.float32) * tl.load(O + o_ptrs, mask=omask, other=0.0).to(tl.float32), 1)
    lse = tl.load(LSE + bh64 * nq + offs_m, mask=row_ok, other=float("inf")).to(tl.float32)
    lse = tl.where(lse == float("-inf"), float("inf"), lse)  # no key seen: every P is 0
    lse2 = lse * 1.4426950408889634
    k_base = K + bh_kv64 * nk * d
    v_base = V + bh_kv64 * nk * dv
    length = _length(LENS, bh, nk, ROWS_PER_SEQ, HAS_LENS)
    off = (length - nq) * bottom_right

    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    lo, a, b, hi = _key_range(start_m, length, off, left, right, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT)
    for start_n in range(lo, a, BLOCK_N):
        acc, l_i = _dq_block(acc, l_i, q, do, delta, lse2, k_base, v_base, start_n, offs_m, offs_n, offs_d, offs_e,
                             nk, d, dv, qk_scale, cap_in, cap_out, length, off, left, right, True, HAS_LEFT,
                             HAS_RIGHT, SOFTCAP, PRECISION, HEAD_DIM, HEAD_DV, EVEN_D, EVEN_DV)
    for start_n in range(a, b, BLOCK_N):
        acc, l_i = _dq_block(acc, l_i, q, do, delta, lse2, k_base, v_base, start_n, offs_m, offs_n, offs_d, offs_e,
                             nk, d, dv, qk_scale, cap_in, cap_out, length, off, left, right, False, HAS_LEFT,
                             HAS_RIGHT, SOFTCAP, PRECISION, HEAD_DIM, HEAD_DV, EVEN_D, EVEN_DV)
    for start_n in range(b, hi, BLOCK_N):
        acc, l_i = _dq_block(acc, l_i, q, do, delta, lse2, k_base, v_base, start_n, offs_m, offs_n, offs_d, offs_e,
                             nk, d, dv, qk_scale, cap_in, cap_out, length, off, left, right, True, HAS_LEFT,
                             HAS_RIGHT, SOFTCAP, PRECISION, HEAD_DIM, HEAD_DV, EVEN_D, EVEN_DV)

    # the saved lse, corrected by ln(sum_j P_j) within its dtype's rounding: P, and so dQ, scale by
    # exp(-correction)
    fix = tl.math.log2(tl.where(l_i > 0.0, l_i, 1.0))
    bound = tl.where(lse == float("inf"), 0.0, tl.abs(lse2) * LSE_ROUNDING + 1e-6)
    fix = tl.minimum(tl.maximum(fix, -bound), bound)
    acc = acc * (tl.math.exp2(-fix) * scale)[:, None]
    tl.store(DQ + q_ptrs, acc.to(DQ.dtype.element_ty), mask=qmask)
    tl.store(DELTA + bh64 * nq + offs_m, delta, mask=row_ok)
    tl.store(LSE2 + bh64 * nq + offs_m, lse2 + fix, mask=row_ok)


@triton.jit
def _dq_block(acc, l_i, q, do, delta, lse2, k_base, v_base, start_n, offs_m, offs_n, offs_d, offs_e, nk, d, dv,
              qk_scale, cap_in, cap_out, length, off, left, right, MASKED: tl.constexpr, HAS_LEFT: tl.constexpr,
              HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, HEAD_DIM: tl.constexpr,
              HEAD_DV: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr):
    """One K/V block's share of dQ (unscaled) and of each row's sum of P."""
    keys = start_n + offs_n
    key_ok = keys < nk
    kt_ptrs, kt_mask = _tile(k_base, keys, key_ok, offs_d, d, HEAD_DIM, EVEN_D, True)
    kt = tl.load(kt_ptrs, mask=kt_mask, other=0.0)
    vt_ptrs, vt_mask = _tile(v_base, keys, key_ok, offs_e, dv, HEAD_DV, EVEN_DV, True)
    vt = tl.load(vt_ptrs, mask=vt_mask, other=0.0)
    s, t = _scores(q, kt, qk_scale, cap_in, cap_out, SOFTCAP, PRECISION)
    p = tl.math.exp2(s - lse2[:, None])
    if MASKED:
        p = tl.where(_visible(offs_m, keys, length, off, left, right, HAS_LEFT, HAS_RIGHT), p, 0.0)
    l_i += tl.sum(p, 1)
    dp = tl.dot(do, vt, input_precision=PRECISION)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    acc = tl.dot(ds.to(q.dtype), tl.trans(kt), acc, input_precision=PRECISION)
    return acc, l_i


@triton.jit
def flash_backward_dkdv(Q, K, V, DO, DELTA, LSE2, DK, DV, LENS, nq, nk, d, dv, scale, qk_scale, cap_in, cap_out,
                        left, right, bottom_right, ROWS_PER_SEQ, GROUP, N_BUCKET_Q, N_BUCKET_K,
                        HEAD_DIM: tl.constexpr, HEAD_DV: tl.constexpr, HAS_LEFT: tl.constexpr,
                        HAS_RIGHT: tl.constexpr, HAS_LENS: tl.constexpr, SOFTCAP: tl.constexpr,
                        GROUP_GT1: tl.constexpr, PRECISION: tl.constexpr, EVEN_D: tl.constexpr,
                        EVEN_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # dK, dV of one block of BLOCK_N keys of k/v head bh_kv, summed over the GROUP query heads
    # that read it and, for each, over the query blocks that see any of its keys
    start_n = tl.program_id(0) * BLOCK_N
    bh_kv = tl.program_id(1)
    bh_kv64 = bh_kv.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_e = tl.arange(0, HEAD_DV)
    key_ok = offs_n < nk
    k_ptrs, kmask = _tile(bh_kv64 * nk * d, offs_n, key_ok, offs_d, d, HEAD_DIM, EVEN_D, False)
    v_ptrs, vmask = _tile(bh_kv64 * nk * dv, offs_n, key_ok, offs_e, dv, HEAD_DV, EVEN_DV, False)
    k = tl.load(K + k_ptrs, mask=kmask, other=0.0)
    v = tl.load(V + v_ptrs, mask=vmask, other=0.0)
    length = _length(LENS, bh_kv * GROUP, nk, ROWS_PER_SEQ, HAS_LENS)
    off = (length - nq) * bottom_right

    # the query rows that see any key of the block: i >= j - off - right, i <= j - off + left;
    # all of its keys: those with the block below length, i >= last key - off - right, i <= first - off + left
    lo = 0
    hi = nq
    if HAS_RIGHT:
        lo = tl.maximum(start_n - off - right, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
    if HAS_LEFT:
        hi = tl.minimum(hi, tl.maximum(start_n + BLOCK_N - off + left, 0))
    hi = tl.where(start_n < length, hi, lo)  # keys past the length: no rows
    a = lo
    if HAS_RIGHT:
        a = tl.maximum(start_n + BLOCK_N - 1 - off - right, lo)
        a = ((a + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    b = nq
    if HAS_LEFT:
        b = tl.minimum(b, tl.maximum(start_n - off + left + 1, 0))
    b = (b // BLOCK_M) * BLOCK_M
    b = tl.where(start_n + BLOCK_N <= length, b, 0)
    hi_up = ((tl.maximum(hi, lo) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    a = tl.minimum(a, hi_up)
    b = tl.maximum(b, a)

    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv_acc = tl.zeros([BLOCK_N, HEAD_DV], tl.float32)
    for g in range(0, GROUP):
        bh64 = bh_kv64 * GROUP + g
        q_base = Q + bh64 * nq * d
        do_base = DO + bh64 * nq * dv
        row_base = bh64 * nq
        for start_m in range(lo, a, BLOCK_M):
            dk, dv_acc = _dkdv_block(dk, dv_acc, k, v, q_base, do_base, DELTA + row_base, LSE2 + row_base, start_m,
                                     offs_m, offs_n, offs_d, offs_e, nq, d, dv, qk_scale, cap_in, cap_out, length,
                                     off, left, right, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, PRECISION, HEAD_DIM,
                                     HEAD_DV, EVEN_D, EVEN_DV)
        for start_m in range(a, b, BLOCK_M):
            dk, dv_acc = _dkdv_block(dk, dv_acc, k, v, q_base, do_base, DELTA + row_base, LSE2 + row_base, start_m,
                                     offs_m, offs_n, offs_d, offs_e, nq, d, dv, qk_scale, cap_in, cap_out, length,
                                     off, left, right, False, HAS_LEFT, HAS_RIGHT, SOFTCAP, PRECISION, HEAD_DIM,
                                     HEAD_DV, EVEN_D, EVEN_DV)
        for start_m in range(b, hi, BLOCK_M):
            dk, dv_acc = _dkdv_block(dk, dv_acc, k, v, q_base, do_base, DELTA + row_base, LSE2 + row_base, start_m,
                                     offs_m, offs_n, offs_d, offs_e, nq, d, dv, qk_scale, cap_in, cap_out, length,
                                     off, left, right, True, HAS_LEFT, HAS_RIGHT, SOFTCAP, PRECISION, HEAD_DIM,
                                     HEAD_DV, EVEN_D, EVEN_DV)
    dk = dk * scale
    tl.store(DK + k_ptrs, dk.to(DK.dtype.element_ty), mask=kmask)
    tl.store(DV + v_ptrs, dv_acc.to(DV.dtype.element_ty), mask=vmask)


@triton.jit
def _dkdv_block(dk, dv_acc, k, v, q_base, do_base, delta_base, lse2_base, start_m, offs_m, offs_n, offs_d, offs_e,
                nq, d, dv, qk_scale, cap_in, cap_out, length, off, left, right, MASKED: tl.constexpr,
                HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
                HEAD_DIM: tl.constexpr, HEAD_DV: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr):
    """One query block's share of dK (unscaled) and dV, from P^T and dS^T (keys x queries)."""
    rows = start_m + offs_m
    row_ok = rows < nq
    # the loads keep their row masks in every stage: without them the dK/dV kernel (whose loops nest
    # in the loop over the group's heads) read out of bounds on an H100 (Triton 3.6, float32)
    qt_ptrs, qt_mask = _tile(q_base, rows, row_ok, offs_d, d, HEAD_DIM, EVEN_D, True)
    qt = tl.load(qt_ptrs, mask=qt_mask, other=0.0)
    do_ptrs, do_mask = _tile(do_base, rows, row_ok, offs_e, dv, HEAD_DV, EVEN_DV, False)
    do = tl.load(do_ptrs, mask=do_mask, other=0.0)
    lse2 = tl.load(lse2_base + rows, mask=row_ok, other=float("inf"))  # rows past nq: P = 0
    delta = tl.load(delta_base + rows, mask=row_ok, other=0.0)
    st, t = _scores(k, qt, qk_scale, cap_in, cap_out, SOFTCAP, PRECISION)  # (BLOCK_N, BLOCK_M)
    pt = tl.math.exp2(st - lse2[None, :])
    if MASKED:
        seen = tl.trans(_visible(rows, offs_n, length, off, left, right, HAS_LEFT, HAS_RIGHT))
        pt = tl.where(seen, pt, 0.0)
    dv_acc = tl.dot(pt.to(do.dtype), do, dv_acc, input_precision=PRECISION)
    dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
    dst = pt * (dpt - delta[None, :])
    if SOFTCAP:
        dst = dst * (1.0 - t * t)
    dk = tl.dot(dst.to(qt.dtype), tl.trans(qt), dk, input_precision=PRECISION)
    return dk, dv_acc


@triton.jit
def flash_decode_partial(Q, K, V, PO, PLSE, LENS, nq, nk, d, dv, qk_scale, cap_in, cap_out, left, right,
                         bottom_right, ROWS_PER_SEQ, GROUP, chunk,
                         HEAD_DIM: tl.constexpr, HEAD_DV: tl.constexpr, HAS_LEFT: tl.constexpr,
                         HAS_RIGHT: tl.constexpr, HAS_LENS: tl.constexpr, SOFTCAP: tl.constexpr,
                         EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, PRECISION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # The split-K decode's first kernel: one program per (key chunk, k/v head). Its rows are the
    # GROUP nq query rows of the k/v head's group (head h's row i as row h nq + i: consecutive in
    # Q), so one K/V read serves them all. It writes each row's partial (normalised by its own
    # sum, float32) to PO and its lse in the log2 domain (-inf: no key of the chunk seen) to
    # PLSE, both at (k/v head, chunk, row).
    split = tl.program_id(0)
    kv = tl.program_id(1)
    kv64 = kv.to(tl.int64)
    rows = GROUP * nq
    offs_m = tl.arange(0, BLOCK_M)
    qrow = offs_m % nq  # the query row each row is, as the masks count
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_e = tl.arange(0, HEAD_DV)
    row_ok = offs_m < rows
    q = tl.load(Q + kv64 * rows * d + offs_m[:, None] * d + offs_d[None, :],
                mask=row_ok[:, None] & (offs_d[None, :] < d), other=0.0)
    k_base = K + kv64 * nk * d
    v_base = V + kv64 * nk * dv
    length = _length(LENS, kv * GROUP, nk, ROWS_PER_SEQ, HAS_LENS)
    off = (length - nq) * bottom_right
    # this chunk's keys that some query row sees (the first row's window start, the last row's end)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, length)
    if HAS_LEFT:
        lo = tl.maximum(lo, ((tl.maximum(off - left, 0)) // BLOCK_N) * BLOCK_N)
    if HAS_RIGHT:
        hi = tl.minimum(hi, tl.maximum(nq + off + right, 0))

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DV], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, k_base, v_base, start_n, qrow, offs_n, offs_d, offs_e,
                                      nk, d, dv, qk_scale, cap_in, cap_out, length, off, left, right, True,
                                      HAS_LEFT, HAS_RIGHT, SOFTCAP, EVEN_D, EVEN_DV, PRECISION)
    empty = l_i == 0.0
    part = (kv64 * tl.num_programs(0) + split) * rows
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    tl.store(PO + (part + offs_m[:, None]) * HEAD_DV + offs_e[None, :], out, mask=row_ok[:, None])
    lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    tl.store(PLSE + part + offs_m, lse, mask=row_ok)


@triton.jit
def flash_decode_combine(PO, PLSE, O, LSE, splits, rows, dv, HEAD_DV: tl.constexpr, WITH_LSE: tl.constexpr,
                         BLOCK_S: tl.constexpr):
    # The split-K decode's second kernel: output row r (of k/v head r // rows) from its chunks'
    # partials, weighted by 2^(lse - max), BLOCK_S chunks at a time in chunk order (deterministic)
    r = tl.program_id(0)
    kv = r // rows
    base = kv.to(tl.int64) * splits * rows + r % rows  # partial (kv, 0, row); chunk s at + s rows
    offs_s = tl.arange(0, BLOCK_S)
    offs_e = tl.arange(0, HEAD_DV)
    mx = tl.full([BLOCK_S], float("-inf"), tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        mx = tl.maximum(mx, tl.load(PLSE + base + (s0 + offs_s) * rows, mask=s0 + offs_s < splits,
                                    other=float("-inf")))
    m = tl.max(mx, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([HEAD_DV], tl.float32)
    den = tl.zeros([BLOCK_S], tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        ok = s0 + offs_s < splits
        w = tl.math.exp2(tl.load(PLSE + base + (s0 + offs_s) * rows, mask=ok, other=float("-inf")) - m_use)
        part = tl.load(PO + (base + (s0 + offs_s[:, None]) * rows) * HEAD_DV + offs_e[None, :], mask=ok[:, None],
                       other=0.0)
        acc += tl.sum(part * w[:, None], 0)
        den += w
    total = tl.sum(den, 0)
    empty = total == 0.0
    out = acc / tl.where(empty, 1.0, total)
    tl.store(O + r.to(tl.int64) * dv + offs_e, out.to(O.dtype.element_ty), mask=offs_e < dv)
    if WITH_LSE:
        lse = tl.where(empty, float("-inf"), (m_use + tl.math.log2(tl.where(empty, 1.0, total))) * 0.6931471805599453)
        tl.store(LSE + r, lse.to(LSE.dtype.element_ty))


def launch_decode(q, k, v, out, lse, lens, scratch, splits: int, batch: int, batch_kv: int, nq: int, nk: int, d: int,
                  dv: int, causal: bool, scale: float, dtype_name: str, tensor_cores: int = 1, features=None,
                  record=None) -> int:
    """The split-K decode (flash_decode_partial, flash_decode_combine) of launch's call in
    `splits` chunks (_split.decode_chunk; its query rows per group within
    _split.DECODE_MAX_ROWS); scratch(n) returns n float32 on the GPU. Returns the chunks run;
    record (a list) receives each launch's (compiled kernel, its arguments in the kernel's
    order, grid), for prepared launches."""
    from .._split import DECODE_BLOCK_K, decode_chunk

    scalars, switches = problem(batch, batch_kv, nq, nk, d, dv, causal, scale, features, dtype_name, tensor_cores)
    switches.update(EVEN_D=switches["HEAD_DIM"] == d, EVEN_DV=switches["HEAD_DV"] == dv)
    del switches["GROUP_GT1"]  # a block's rows are its k/v head's group: no per-row k/v head to find
    chunk, splits = decode_chunk(nk, splits)
    rows = batch // batch_kv * nq
    hdv = switches["HEAD_DV"]
    parts = batch_kv * splits * rows
    buf = scratch(parts * (hdv + 1))
    po, plse = buf[:parts * hdv], buf[parts * hdv:]
    first = [q, k, v, po, plse, q if lens is None else lens, *(scalars[n] for n in _DECODE_SCALARS), chunk]
    blocks = dict(BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=DECODE_BLOCK_K)
    kernel = flash_decode_partial[(splits, batch_kv)](*first, **switches, **blocks, num_warps=4, num_stages=3)
    if record is not None:
        named = dict(zip(flash_decode_partial.arg_names, first), **switches, **blocks)
        record.append((kernel, [named[n] for n in flash_decode_partial.arg_names], (splits, batch_kv)))
    second = [po, plse, out, out if lse is None else lse, splits, rows, dv]
    switches = dict(HEAD_DV=hdv, WITH_LSE=lse is not None, BLOCK_S=16)
    kernel = flash_decode_combine[(batch * nq,)](*second, **switches, num_warps=4)
    if record is not None:
        named = dict(zip(flash_decode_combine.arg_names, second), **switches)
        record.append((kernel, [named[n] for n in flash_decode_combine.arg_names], (batch * nq, 1)))
    return splits


def _bucket(n: int) -> int:
    """The power of two at or above n (at least 16): the autotuner's key, so that
    nearby sequence lengths share one tuned config."""
    return max(16, 1 << max(0, n - 1).bit_length())


def problem(batch: int, batch_kv: int, nq: int, nk: int, d: int, dv: int, causal: bool, scale: float, features,
            dtype_name: str, tensor_cores: int) -> tuple[dict, dict]:
    """(the kernels' runtime scalars, their compile-time switches) for a call; features: a
    _registry.Features or None (plain)."""
    left = right = -1
    cap, align, lengths = 0.0, "top_left", None
    if features is not None:
        left, right, cap = features.window_left, features.window_right, features.softcap
        align, lengths = features.align, features.key_lengths
    if causal:
        right = 0
    group = batch // batch_kv
    scalars = dict(nq=nq, nk=nk, d=d, dv=dv, qk_scale=scale * LOG2E,
                   cap_in=2.0 * scale / cap * LOG2E if cap else 0.0, cap_out=cap * LOG2E,
                   left=max(left, 0), right=max(right, 0), bottom_right=int(align == "bottom_right"),
                   ROWS_PER_SEQ=batch // len(lengths) if lengths is not None else 1, GROUP=group,
                   N_BUCKET_Q=_bucket(nq), N_BUCKET_K=_bucket(nk))
    hd, hdv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dv))
    switches = dict(HEAD_DIM=hd, HEAD_DV=hdv, HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, HAS_LENS=lengths is not None,
                    SOFTCAP=cap > 0, GROUP_GT1=group > 1,
                    # 16-bit inputs ignore the precision; float32 never runs plain (one-pass) TF32
                    PRECISION=("tf32x3" if tensor_cores else "ieee") if dtype_name == "float32" else "tf32")
    return scalars, switches


_FORWARD_SCALARS = ("nq", "nk", "d", "dv", "qk_scale", "cap_in", "cap_out", "left", "right", "bottom_right",
                    "ROWS_PER_SEQ", "GROUP", "N_BUCKET_Q", "N_BUCKET_K")
_BACKWARD_SCALARS = ("nq", "nk", "d", "dv", "scale", "qk_scale", "cap_in", "cap_out", "left", "right",
                     "bottom_right", "ROWS_PER_SEQ", "GROUP", "N_BUCKET_Q", "N_BUCKET_K")
_DECODE_SCALARS = ("nq", "nk", "d", "dv", "qk_scale", "cap_in", "cap_out", "left", "right", "bottom_right",
                   "ROWS_PER_SEQ", "GROUP")
# the unit roundoff of the saved lse's dtype: how far the backward may correct it
LSE_ROUNDING = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -23}


def _configs_of(scalars: dict, switches: dict, dtype_name: str, *kernels: str):
    """The table's config (config) of each of kernels for a call of problem's scalars and switches."""
    itemsize = 4 if dtype_name == "float32" else 2
    head = max(switches["HEAD_DIM"], switches["HEAD_DV"])
    bucket = max(scalars["N_BUCKET_Q"], scalars["N_BUCKET_K"])
    masked = switches["HAS_LEFT"] or switches["HAS_RIGHT"]
    return [hopper_config(itemsize, head, bucket, masked) if kernel == "hopper" else
            config(kernel, itemsize, head, bucket, masked) for kernel in kernels]


# the Hopper variant's compilations that failed: (switches, config, the int arguments' and output
# pointers' specialization, as Triton's): their calls run the pointer-load kernel
HOPPER_FAILED: set = set()


def _hopper_launch(hopper: tuple, grid, args, switches: dict, outputs):
    """Launch the forward's Hopper variant at config hopper; (the compiled kernel, (BLOCK_M,
    BLOCK_N)), or None where it does not compile here. Triton 3.6's ptxas crashed
    (SIGSEGV) on some specializations of it (64 x 64 blocks, 4 warps: grouped k/v heads with
    some lengths and lse settings), and a toolchain may lack a feature it uses: those calls
    keep the pointer-load kernel (switches unchanged), which compiled before."""
    *chosen, ws = hopper
    trial = dict(switches, TMA=True, WARP_SPECIALIZE=bool(ws))
    spec = tuple((a == 1, a % 16 == 0) for a in args if isinstance(a, int)) + \
        tuple(p.data_ptr() % 16 == 0 for p in outputs)
    key = (tuple(sorted(trial.items())), tuple(hopper), spec)
    if key in HOPPER_FAILED:
        return None
    ensure_allocator()
    try:
        found = _launch(flash_forward, "forward", tuple(chosen), [], grid, args, trial)
    except Exception:  # a compiler failure, raised before anything ran on the GPU
        HOPPER_FAILED.add(key)
        return None
    switches.update(TMA=True, WARP_SPECIALIZE=bool(ws))
    return found


def launch(q, k, v, out, lse, lens, batch: int, batch_kv: int, nq: int, nk: int, d: int, dv: int, causal: bool,
           scale: float, dtype_name: str, tensor_cores: int = 1, features=None):
    """out (and lse, unless None) = the attention of (batch, n, d) q and (batch_kv, n, d) k, v;
    q, k, v, out, lse: torch tensors or objects with data_ptr() and a dtype Triton knows;
    lens: the key lengths on the GPU (int64) where features has them, else None; float32
    products in 3xTF32 with tensor_cores, else exact. Returns (the compiled kernel, its
    arguments in the kernel's order, its grid) for prepared launches."""
    scalars, switches = problem(batch, batch_kv, nq, nk, d, dv, causal, scale, features, dtype_name, tensor_cores)
    switches.update(WITH_LSE=lse is not None, EVEN_D=switches["HEAD_DIM"] == d, EVEN_DV=switches["HEAD_DV"] == dv,
                    TMA=False, WARP_SPECIALIZE=False)
    (chosen,) = _configs_of(scalars, switches, dtype_name, "forward")
    hopper = None if _autotuning() else _configs_of(scalars, switches, dtype_name, "hopper")[0]

    def grid(bm, bn):
        return (triton.cdiv(nq, bm), batch)

    pointers = (q, k, v, out, out if lse is None else lse, q if lens is None else lens)
    args = [*pointers, *(scalars[n] for n in _FORWARD_SCALARS)]
    found = None
    if hopper is not None and hopper_ready((q, k, v), d, dv, 4 if dtype_name == "float32" else 2):
        # warp specialization ran on the GPU (its tests) only in calls without windows, key lengths,
        # softcaps or bottom-right alignment: those keep the config's blocks without it
        if switches["HAS_LEFT"] or switches["HAS_LENS"] or switches["SOFTCAP"] or scalars["bottom_right"]:
            hopper = (*hopper[:4], False)
        found = _hopper_launch(hopper, grid, args, switches, pointers[3:5])
    if found is None:
        found = _launch(flash_forward, "forward", chosen, _KEY + ["WITH_LSE"], grid, args, switches)
    kernel, (bm, bn) = found
    named = dict(zip(("Q", "K", "V", "O", "LSE", "LENS"), pointers), **scalars, **switches, BLOCK_M=bm, BLOCK_N=bn)
    return kernel, [named[n] for n in flash_forward.arg_names], grid(bm, bn)


def launch_backward(q, k, v, out, dout, lse, dq, dk, dv_, lens, delta, lse2, batch: int, batch_kv: int, nq: int,
                    nk: int, d: int, dv: int, causal: bool, scale: float, dtype_name: str, tensor_cores: int = 1,
                    features=None, record=None) -> None:
    """dq, dk, dv_ of attention (launch's arguments) given out, its gradient dout and lse;
    delta, lse2: (batch, nq) float32 scratch on the GPU. record (a list) receives each
    launch's (compiled kernel, its arguments in the kernel's order, grid), for prepared
    launches."""
    scalars, switches = problem(batch, batch_kv, nq, nk, d, dv, causal, scale, features, dtype_name, tensor_cores)
    scalars["scale"] = scale
    switches.update(EVEN_D=switches["HEAD_DIM"] == d, EVEN_DV=switches["HEAD_DV"] == dv)
    first, second = _configs_of(scalars, switches, dtype_name, "dq", "dkdv")
    rest = [scalars[n] for n in _BACKWARD_SCALARS]
    lens = q if lens is None else lens
    rounding = LSE_ROUNDING[dtype_name]  # lse has the inputs' dtype
    for jit, kernel, chosen, key, grid, args in (
            (flash_backward_dq, "dq", first, _KEY + ["LSE_ROUNDING"], lambda bm, bn: (triton.cdiv(nq, bm), batch),
             [q, k, v, out, dout, lse, dq, delta, lse2, lens, *rest, rounding]),
            (flash_backward_dkdv, "dkdv", second, _KEY, lambda bm, bn: (triton.cdiv(nk, bn), batch_kv),
             [q, k, v, dout, delta, lse2, dk, dv_, lens, *rest])):
        compiled, (bm, bn) = _launch(jit, kernel, chosen, key, grid, args, switches)
        if record is not None:
            named = dict(zip(jit.arg_names, args), **switches, BLOCK_M=bm, BLOCK_N=bn)
            record.append((compiled, [named[n] for n in jit.arg_names], grid(bm, bn)))
