"""cuda.flash's backward in Numba kernels (three launches, FlashAttention-2
order, deterministic). Importing this module imports numba.cuda.

P is recomputed from the saved lse (P_ij = 2^(s_ij - lse_i log2 e), no row
max, no N x N buffer). 1. flash_backward_delta: D_i = dO_i . O_i, a thread
per row. 2. flash_backward_dkdv: a block per block_k keys, a thread per
key; it streams the tiles of block_q queries that can see its keys (causal:
from the diagonal on) with their dO rows, lse and D through shared memory
(every thread reads the same element: a broadcast) and accumulates dK_j and
dV_j in thread-local arrays of the padded head size. 3. flash_backward_dq:
a block per block_q queries, a thread per query, K/V tiles of block_k keys
streamed (causal: up to the diagonal), dQ_i accumulated the same way. Each
gradient row is summed by one thread over the queries or keys in order: no
atomics, and results that depend neither on the tiles nor on scheduling.
Tiles are block_q and block_k as given (0: 64), halved until shared memory
fits (backends/cuda/__init__.py, _flash_backward_tiles).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import config, cuda, int64, uint64

from ..._gpuarray import GpuArray
from .arrays import workspace
from .launch import LOG2E, round_up
from .numba_kernels import (NO_GROUP, dropout_factor, feature_args, key_range, mask_base, masked, philox4x32_10,
                            pick_word)


def flash_backward_padded_dims(d: int, dv: int) -> tuple[int, int]:
    """Head sizes of the backward's per-thread rows, rounded up (zero-filled) to
    16: compile-time sizes, so their loops unroll, and one kernel serves many D."""
    return round_up(d, 16), round_up(dv, 16)


def flash_backward_shared_bytes(block_q: int, block_k: int, d: int, dv: int, itemsize: int) -> int:
    """Shared memory of the larger of the backward's two blocks: the dK/dV block's
    Q and dO tiles with their lse and D, the dQ block's K and V tiles."""
    dp, dvp = flash_backward_padded_dims(d, dv)
    return max(block_q * (dp + dvp + 2), block_k * (dp + dvp)) * itemsize


DELTA_THREADS = 32 if config.ENABLE_CUDASIM else 128


@functools.cache
def flash_backward_delta_kernel(dtype: str):
    """D_i = dO_i . O_i for every row of (batch * nq): one thread per row."""
    ZERO = np.dtype(dtype).type(0)
    U_1 = np.uint64(1)

    @cuda.jit
    def flash_backward_delta(out, dout, delta, rows, dv):
        rows, dv = uint64(rows), uint64(dv)
        row = uint64(cuda.grid(1))
        if row < rows:
            acc = ZERO
            at = row * dv
            for _ in range(dv):
                acc += dout[at] * out[at]
                at += U_1
            delta[row] = acc

    return flash_backward_delta


@functools.cache
def flash_backward_kernels(dtype: str, block_q: int, block_k: int, dp: int, dvp: int, featured: bool = False,
                           mask_kind: int = 0, alibi: bool = False, dropout: bool = False):
    """cuda.flash's two backward kernels for one dtype, tile shape and padded
    head sizes: (dK/dV over key blocks of block_k threads, dQ over query blocks
    of block_q threads). Unsigned indices, as in flash_kernel. featured: the
    variant with the attention features (numba_kernels.feature_args): a dK/dV
    block per k/v row adds the kv_group query rows that share it in their order,
    so dk and dv stay deterministic. mask_kind: the attention mask's (launch.MASK_KINDS, 0: none).
    dropout (featured only): the variant that regenerates the forward's Philox mask
    (Z = keep / (1 - p)) for FlashAttention-2's dV = (P Z)^T dO and dS = P (dP Z - D),
    dP = dO V^T: the dK/dV block one Philox call per (query, key), the dQ block one
    per 4 consecutive keys of its query."""
    FEAT = bool(featured)  # a constant of the closure: the plain variant compiles none of it
    MASKED, IS_BOOL = FEAT and mask_kind != 0, mask_kind == 1
    ALIBI = FEAT and bool(alibi)  # ALiBi's -slope |i + len - nq - j|, after the softcap
    DROPOUT = FEAT and bool(dropout)
    NEG_INF = np.dtype(dtype).type(-np.inf)
    ftype = np.dtype(dtype).type
    ZERO = ftype(0)
    F_LOG2E = ftype(LOG2E)
    BQ, BK, DP, DVP = block_q, block_k, dp, dvp
    SQ_SIZE, SDO_SIZE = BQ * DP, BQ * DVP  # the dK/dV block's Q and dO tiles
    SK_SIZE, SV_SIZE = BK * DP, BK * DVP  # the dQ block's K and V tiles
    U = np.uint64
    U_BQ, U_BK, U_DP, U_DVP = U(BQ), U(BK), U(DP), U(DVP)
    U_0, U_1 = U(0), U(1)

    @cuda.jit
    def flash_backward_dkdv(q, k, v, dout, lse, delta, dk, dv, nq, nk, d, dvn, qscale, scale, causal, kv_group, lens,
                            seq_rows, bottom_right, wl, wr, capl, mask, mheads, msb, msh, msi, msj, munit, slopes,
                            aunit, dseed, dthr, dscale, di0, dj0):
        # flat arrays of (batch, n, d) rows; lse and delta: (batch, nq). Thread tid owns key k0 + tid
        # of k/v row b (featured: of the kv_group query rows b kv_group...; else of query row b).
        nq, nk, d, dvn = uint64(nq), uint64(nk), uint64(d), uint64(dvn)
        b = uint64(cuda.blockIdx.y)
        k0 = uint64(cuda.blockIdx.x) * U_BK
        tid = uint64(cuda.threadIdx.x)
        key = k0 + tid
        live = key < nk
        q_rows, kv_rows = b * nq, b * nk
        group, length, off, wr_c, i_first, i_end = U_1, nk, int64(0), int64(0), U_0, nq
        if FEAT:
            group = uint64(kv_group)
            length = uint64(lens[b * group // uint64(seq_rows)])  # one length for the group's rows
            live = key < length  # keys past it are never read; their gradients are 0
            off = int64(length) - int64(nq) if bottom_right else int64(0)
            wr_c = int64(0) if causal else int64(wr)
            # the query rows that see a key of k0..k0+BK-1: hi(i) > k0 and lo(i) < k0 + BK
            first = max(int64(0), int64(k0) - off - wr_c) if wr_c >= 0 else int64(0)
            end = min(int64(nq), int64(k0) + int64(BK) - off + int64(wl)) if wl >= 0 else int64(nq)
            i_first, i_end = uint64(first) // U_BQ * U_BQ, uint64(end) if end > first and k0 < length else U_0
        elif causal:  # query i sees key j when j <= i; the first query tile that sees a key of this block holds row k0
            i_first = (k0 // U_BQ) * U_BQ

        sq = cuda.shared.array(SQ_SIZE, ftype)
        sdo = cuda.shared.array(SDO_SIZE, ftype)
        slse = cuda.shared.array(BQ, ftype)  # lse in the log2 domain
        sdelta = cuda.shared.array(BQ, ftype)
        kj = cuda.local.array(DP, ftype)
        vj = cuda.local.array(DVP, ftype)
        dkj = cuda.local.array(DP, ftype)
        dvj = cuda.local.array(DVP, ftype)

        at = (kv_rows + key) * d
        for t in range(DP):
            ut = uint64(t)
            kj[t] = k[at + ut] if live and ut < d else ZERO  # (live: key below the length)
            dkj[t] = ZERO
        at = (kv_rows + key) * dvn
        for e in range(DVP):
            ue = uint64(e)
            vj[e] = v[at + ue] if live and ue < dvn else ZERO
            dvj[e] = ZERO

        for h in range(group):  # the query rows sharing this k/v row, in their order
            qb = b * group + uint64(h) if FEAT else b
            q_rows = qb * nq
            mat = mask_base(qb, mheads, msb, msh) + key * uint64(msj) if MASKED else U_0
            ab = slopes[qb] * aunit if ALIBI else ZERO  # ALiBi's slope (log2 domain)
            for i0 in range(i_first, i_end, U_BQ):
                cuda.syncthreads()  # the previous tiles are consumed
                for n in range(tid, SQ_SIZE, BK):
                    i, t = uint64(n) // U_DP, uint64(n) % U_DP
                    row = i0 + i
                    sq[n] = q[(q_rows + row) * d + t] if row < nq and t < d else ZERO
                for n in range(tid, SDO_SIZE, BK):
                    i, e = uint64(n) // U_DVP, uint64(n) % U_DVP
                    row = i0 + i
                    sdo[n] = dout[(q_rows + row) * dvn + e] if row < nq and e < dvn else ZERO
                for n in range(tid, BQ, BK):
                    row = i0 + uint64(n)
                    slse[n] = lse[q_rows + row] * F_LOG2E if row < nq else ZERO
                    sdelta[n] = delta[q_rows + row] if row < nq else ZERO
                cuda.syncthreads()
                if live:
                    qa, da = U_0, U_0  # row i's offsets in the Q and dO tiles
                    for i in range(U_0, min(U_BQ, nq - i0)):
                        if FEAT:
                            lo, hi = key_range(i0 + i, off, int64(wl), wr_c, int64(length))
                            seen = lo <= int64(key) < hi
                        else:
                            seen = not (causal and key > i0 + i)
                        if seen:
                            s = ZERO
                            for t in range(DP):
                                s += sq[qa + uint64(t)] * kj[t]
                            # P_ij from the forward's lse, scores in the log2 domain; the dQ kernel
                            # computes the same products in the same order, so the same P and dS
                            s *= qscale
                            slope = ftype(1)
                            if FEAT and capl > 0:  # the softcap and its derivative 1 - tanh^2
                                th = math.tanh(s / capl)
                                s = capl * th
                                slope = ftype(1) - th * th
                            if ALIBI:
                                s -= ab * ftype(abs(int64(i0 + i) + int64(length) - int64(nq) - int64(key)))
                            if MASKED:
                                s = masked(s, mask, IS_BOOL, mat + (i0 + i) * uint64(msi), munit, NEG_INF)
                            p = ZERO if MASKED and s == NEG_INF else math.exp2(s - slse[i])  # a hidden key: no NaN
                            z = ZERO
                            if DROPOUT:
                                z = dropout_factor(dseed, dthr, dscale, ZERO, qb, i0 + i + uint64(di0),
                                                   key + uint64(dj0))
                            pz = p * z if DROPOUT else p  # the dropped probability, what the forward multiplied V by
                            dp = ZERO
                            for e in range(DVP):
                                g = sdo[da + uint64(e)]
                                dvj[e] += pz * g
                                dp += g * vj[e]
                            if DROPOUT:
                                dp *= z
                            ds = p * (dp - sdelta[i]) * slope
                            for t in range(DP):
                                dkj[t] += ds * sq[qa + uint64(t)]
                        qa += U_DP
                        da += U_DVP

        if key < nk:  # featured: keys past the length get 0
            at = (kv_rows + key) * d
            for t in range(DP):
                ut = uint64(t)
                if ut < d:
                    dk[at + ut] = dkj[t] * scale
            at = (kv_rows + key) * dvn
            for e in range(DVP):
                ue = uint64(e)
                if ue < dvn:
                    dv[at + ue] = dvj[e]

    @cuda.jit
    def flash_backward_dq(q, k, v, dout, lse, delta, dq, nq, nk, d, dvn, qscale, scale, causal, kv_group, lens,
                          seq_rows, bottom_right, wl, wr, capl, mask, mheads, msb, msh, msi, msj, munit, slopes, aunit,
                          dseed, dthr, dscale, di0, dj0):
        # thread tid owns query row q0 + tid
        nq, nk, d, dvn = uint64(nq), uint64(nk), uint64(d), uint64(dvn)
        b = uint64(cuda.blockIdx.y)
        q0 = uint64(cuda.blockIdx.x) * U_BQ
        tid = uint64(cuda.threadIdx.x)
        row = q0 + tid
        live = row < nq
        q_rows, kv_rows = b * nq, b * nk
        j_first, kend, length = U_0, min(nk, q0 + U_BQ) if causal else nk, nk
        lo, hi, off, wr_c = int64(0), int64(0), int64(0), int64(0)
        if FEAT:
            kv_rows = b // uint64(kv_group) * nk
            length = uint64(lens[b // uint64(seq_rows)])
            off = int64(length) - int64(nq) if bottom_right else int64(0)
            wr_c = int64(0) if causal else int64(wr)
            first, _ = key_range(q0, off, int64(wl), wr_c, int64(length))
            _, last = key_range(min(q0 + U_BQ, nq) - U_1, off, int64(wl), wr_c, int64(length))
            j_first, kend = uint64(first) // U_BK * U_BK, uint64(last) if last > first else U_0
            lo, hi = key_range(row, off, int64(wl), wr_c, int64(length))
        mat = mask_base(b, mheads, msb, msh) + row * uint64(msi) if MASKED else U_0
        ab = slopes[b] * aunit if ALIBI else ZERO  # ALiBi's slope (log2 domain)

        sk = cuda.shared.array(SK_SIZE, ftype)
        sv = cuda.shared.array(SV_SIZE, ftype)
        qi = cuda.local.array(DP, ftype)
        doi = cuda.local.array(DVP, ftype)
        dqi = cuda.local.array(DP, ftype)

        at = (q_rows + row) * d
        for t in range(DP):
            ut = uint64(t)
            qi[t] = q[at + ut] if live and ut < d else ZERO
            dqi[t] = ZERO
        at = (q_rows + row) * dvn
        for e in range(DVP):
            ue = uint64(e)
            doi[e] = dout[at + ue] if live and ue < dvn else ZERO
        lse2 = lse[q_rows + row] * F_LOG2E if live else ZERO
        di = delta[q_rows + row] if live else ZERO

        group, w0, w1, w2, w3 = NO_GROUP, U_0, U_0, U_0, U_0  # dropout: the Philox words of the last key group
        for j0 in range(j_first, kend, U_BK):
            cuda.syncthreads()
            for n in range(tid, SK_SIZE, BQ):
                j, t = uint64(n) // U_DP, uint64(n) % U_DP
                key = j0 + j
                sk[n] = k[(kv_rows + key) * d + t] if key < length and t < d else ZERO
            for n in range(tid, SV_SIZE, BQ):
                j, e = uint64(n) // U_DVP, uint64(n) % U_DVP
                key = j0 + j
                sv[n] = v[(kv_rows + key) * dvn + e] if key < length and e < dvn else ZERO
            cuda.syncthreads()
            if live:
                ka, va = U_0, U_0  # key j's offsets in the K and V tiles
                for j in range(U_0, min(U_BK, nk - j0)):
                    if FEAT:
                        seen = lo <= int64(j0 + j) < hi
                    else:
                        if causal and j0 + j > row:
                            break  # and every later key of the tile
                        seen = True
                    if seen:
                        s = ZERO
                        for t in range(DP):
                            s += qi[t] * sk[ka + uint64(t)]
                        s *= qscale  # as in flash_backward_dkdv, bit for bit
                        slope = ftype(1)
                        if FEAT and capl > 0:
                            th = math.tanh(s / capl)
                            s = capl * th
                            slope = ftype(1) - th * th
                        if ALIBI:
                            s -= ab * ftype(abs(int64(row) + int64(length) - int64(nq) - int64(j0 + j)))
                        if MASKED:
                            s = masked(s, mask, IS_BOOL, mat + (j0 + j) * uint64(msj), munit, NEG_INF)
                        p = ZERO if MASKED and s == NEG_INF else math.exp2(s - lse2)  # a hidden key: no NaN
                        dp = ZERO
                        for e in range(DVP):
                            dp += doi[e] * sv[va + uint64(e)]
                        if DROPOUT:  # keys in order: one Philox call per group of 4 key counters
                            jc = j0 + j + uint64(dj0)
                            if (jc >> uint64(2)) != group:
                                group = jc >> uint64(2)
                                w0, w1, w2, w3 = philox4x32_10(group, row + uint64(di0), b, U_0, dseed)
                            dp = dp * dscale if pick_word(w0, w1, w2, w3, jc) >= dthr else ZERO
                        ds = p * (dp - di) * slope
                        for t in range(DP):
                            dqi[t] += ds * sk[ka + uint64(t)]
                    ka += U_DP
                    va += U_DVP

        if live:
            at = (q_rows + row) * d
            for t in range(DP):
                ut = uint64(t)
                if ut < d:
                    dq[at + ut] = dqi[t] * scale

    return flash_backward_dkdv, flash_backward_dq


def flash_backward(q, k, v, out, dout, lse, dq, dk, dv, causal: bool, scale: float, block_q: int, block_k: int,
                   feat=None) -> None:
    """dq, dk, dv (GpuArrays to fill) of out = softmax(q k^T * scale) v, given
    dout and the forward's out and lse, on GpuArrays (batch, n, d); k, v, dk, dv
    have batch / kv_group rows. feat: a launch.KernelFeatures, or None."""
    batch, nq, d = q.shape
    nk, dvn = k.shape[1], v.shape[2]
    if batch == 0:
        return
    ftype = q.dtype.type
    dp, dvp = flash_backward_padded_dims(d, dvn)
    dkdv_kernel, dq_kernel = flash_backward_kernels(q.dtype.name, block_q, block_k, dp, dvp, feat is not None,
                                                    0 if feat is None else feat.mask_kind,
                                                    feat is not None and feat.alibi is not None,
                                                    feat is not None and feat.dropout_p > 0)
    # from torch's caching allocator for torch tensors (no cudaMalloc, no synchronous free)
    delta = workspace(max(batch * nq, 1), q.dtype, q.owner).flat
    extra = [a.flat if isinstance(a, GpuArray) else a for a in feature_args(feat, nk, ftype, delta)]
    sizes = (nq, nk, d, dvn, ftype(scale * LOG2E), ftype(scale), causal, *extra)
    if nq:
        rows = batch * nq
        flash_backward_delta_kernel(q.dtype.name)[-(-rows // DELTA_THREADS), DELTA_THREADS](
            out.flat, dout.flat, delta, rows, dvn)
        dq_kernel[(-(-nq // block_q), batch), block_q](q.flat, k.flat, v.flat, dout.flat, lse.flat, delta, dq.flat,
                                                       *sizes)
    if nk:  # with no queries this writes zeros
        dkdv_kernel[(-(-nk // block_k), k.shape[0]), block_k](q.flat, k.flat, v.flat, dout.flat, lse.flat, delta,
                                                         dk.flat, dv.flat, *sizes)
