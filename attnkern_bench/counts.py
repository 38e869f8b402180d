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
