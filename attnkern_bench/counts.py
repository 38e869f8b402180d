"""Operation and byte counts of one attention forward."""

from __future__ import annotations


def attention_flops(b: int, h: int, nq: int, nk: int, d: int, causal: bool = False, dv: int | None = None) -> float:
    """Floating-point operations of softmax(Q K^T) V, counting the two matmuls
    (2*Nq*Nk*D for Q K^T, 2*Nq*Nk*Dv for P V) and not the softmax; half with a
    causal mask, the convention of FlashAttention's and torch's benchmarks."""
    dv = d if dv is None else dv
    flops = 2.0 * b * h * nq * nk * (d + dv)
    return flops / 2 if causal else flops


def io_bytes(b: int, h: int, nq: int, nk: int, d: int, itemsize: int, dv: int | None = None) -> int:
    """Bytes of q, k, v and the output: the least any kernel moves to and from memory."""
    dv = d if dv is None else dv
    return b * h * (nq * d + nk * d + nk * dv + nq * dv) * itemsize


# Passes over the N x N scores by an algorithm that materialises them (each a full
# read or write of B*H*Nq*Nk elements): native.naive computes, softmaxes and uses one
# row at a time, which stays in cache, so only its write-back reaches memory (one
# pass; dev/check_byte_model.py measured it); cuda.naive's three kernels make four
# (QK^T writes S, the softmax reads and writes it, P V reads it); NumPy's ops each make their own passes (matmul
# write; scale, subtract, exp and divide read and write; max and sum read; the second
# matmul reads); torch's are fewer, its softmax being one fused kernel (matmul write,
# scale read and write, softmax read and write, matmul read; the causal mask's
# masked_fill adds a read and a write, not counted).
SCORE_PASSES = {"native.naive": 1, "numpy.naive": 12, "torch.naive": 6, "cuda.naive": 4}
# Query rows per block of the algorithms that stream K and V once per query block
# (their default block_q; torch's CPU flash kernel's is not public: 64 assumed).
STREAM_BLOCK_Q = {"native.flash": 256, "native.tiled": 256, "numba.flash": 256, "torch.sdpa": 64,
                  "cuda.flash": 128, "triton.flash": 128}


def attention_bytes(kernel: str, b: int, h: int, nq: int, nk: int, d: int, itemsize: int, causal: bool = False,
                    dv: int | None = None, block_q: int | None = None) -> float:
    """Bytes one forward moves to and from memory, by a stated model of its algorithm:
    q, k, v read and out written once (io_bytes), plus
    - materialised scores (SCORE_PASSES): that many passes over B*H*Nq*Nk elements
      (half of them with a causal mask);
    - streaming (flash, tiled): K and V read once per query block of block_q rows
      (about half as often with a causal mask); score strips stay in cache.
    Caches are assumed to hold one block's working set and nothing across blocks."""
    dv = d if dv is None else dv
    base = io_bytes(b, h, nq, nk, d, itemsize, dv)
    frac = 0.5 if causal else 1.0
    if kernel in SCORE_PASSES:
        return base + SCORE_PASSES[kernel] * frac * b * h * nq * nk * itemsize
    bq = block_q or STREAM_BLOCK_Q.get(kernel)
    if bq is None:
        raise ValueError(f"no memory model for {kernel}")
    blocks = -(-nq // bq)
    rereads = (blocks - 1) * frac if blocks > 1 else 0
    return base + rereads * b * h * nk * (d + dv) * itemsize
