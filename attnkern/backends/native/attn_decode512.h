/* The decode path's products straight from the cache (AVX-512; attn_kernels.h's
 * decode_item under DECODE_KIND): S = Q K^T and O = O alpha + P V read K and V rows as
 * they are stored (bfloat16, float16 or float32), with no packed or widened copy of a
 * block in memory. Included by attn_avx512.c, so by both AVX-512 units: the
 * avx512bf16 unit (__AVX512BF16__) takes bfloat16 q.k with vdpbf16ps, the plain
 * avx512 unit widens the pairs in registers and uses FMAs.
 *
 *   Q K^T, row-major: the query rows' dot products with 16 keys at a time, each key
 *     a vector accumulator along d (bfloat16 on avx512bf16: vdpbf16ps, 32 products
 *     an instruction, exact bfloat16 q as stored; else the 32 halves of a 64-byte load
 *     widened in registers into the even and odd elements, x << 16 and x & 0xffff0000
 *     for bfloat16, vpmovdw + vcvtph2ps for float16, two FMAs with q's even and odd
 *     elements widened the same way; float32: one FMA of 16). The 16 accumulators are
 *     summed across their lanes by a tree of 45 shuffles and adds into one vector of
 *     16 scores; the keys go into the accumulators in the order that lands each score
 *     in its key's lane. Scores are the dot products times the score factor (q is
 *     not scaled first: that would round it again). The 16 keys' rows stay in L1
 *     while every query row reads them, so the group costs d/32 loads a row.
 *   P V: register tiles of query rows x 32-128 columns over the block's keys; each V
 *     row's 64 bytes are loaded once per tile and widened in registers (half: the even
 *     and odd columns, the partial O is kept with each 32 columns as 16 even then 16
 *     odd, and put back in order once per work item by attn_dec_finish). The
 *     probabilities are the float32 ones of the softmax.
 * Each block asks for the K rows 32 keys ahead (L1) and its own V rows (L2) while it
 * computes, so the memory streams overlap the arithmetic.
 * The order of every sum depends on the shape only: results are the same for every
 * thread count (the decode path's chunks are fixed by the shape). */
#ifndef ATTN_DECODE512_H
#define ATTN_DECODE512_H

#include <immintrin.h>

#include "attn_common.h"

#define DEC_BF16 0
#define DEC_F16 1
#define DEC_F32 2
/* float32 takes the direct path up to this many query rows per k/v row: above it the
 * packed Kt panels' register tiles (no lane sums) cost less than the row sums. */
#define DEC_F32_ROWS 4

/* 1 where the direct path runs for R query rows of head sizes d and dv. */
static inline int attn_dec_direct(int kind, int64_t R, int64_t d, int64_t dv)
{
    if (dv % 32 != 0 || d < 1 || dv < 1)
        return 0;
    return kind == DEC_F32 ? d % 16 == 0 && R <= DEC_F32_ROWS : d % 32 == 0;
}

/* The 32 halves of x (kind) as float32: the even elements into *ev, the odd into *od. */
static ATTN_INLINE void dec_widen(int kind, __m512i x, __m512 *ev, __m512 *od)
{
    if (kind == DEC_BF16) {
        *ev = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        *od = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
    } else {
        *ev = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x));
        *od = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16)));
    }
}

/* Lane j of the result: the sum of the lanes of a[s] where slot s holds key j (slot s
 * = j / 4 + 4 (j % 4): the tree leaves slot s's sum in lane 4 (s % 4) + s / 4). */
static ATTN_INLINE __m512 dec_lane_sums(__m512 a[16])
{
    __m512 z[8], w[4], u[2];
    for (int i = 0; i < 8; i++)  /* lanes 0-7: 8 partials of a[2i], 8-15: of a[2i + 1] */
        z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int m = 0; m < 4; m++)  /* block b: 4 partials of a[4m + b] */
        w[m] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * m], z[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(z[2 * m], z[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int n = 0; n < 2; n++)  /* block b: 2 partials of a[8n + b], then 2 of a[8n + 4 + b] */
        u[n] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * n], w[2 * n + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(w[2 * n], w[2 * n + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* block b: the sums of a[b], a[b + 4], a[b + 8], a[b + 12] */
    return _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* s[0:16) = c * (q . k_j) for the keys j < n of the 16 rows at k (row stride d
 * elements of kind), 0 for j >= n: one query row against one key group. */
static ATTN_INLINE void dec_qk_group(int kind, int full, const void *k, int64_t n, int64_t d, const void *q,
                                     __m512 c, float *s)
{
    __m512 acc[16];
    int64_t key[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) {
        acc[i] = _mm512_setzero_ps();
        key[i] = i / 4 + 4 * (i % 4);
    }
    if (kind == DEC_F32) {
        const float *kf = k, *qf = q;
        for (int64_t t = 0; t < d; t += 16) {
            __m512 qv = _mm512_loadu_ps(qf + t);
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++)
                if (full || key[i] < n)
                    acc[i] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kf + key[i] * d + t), acc[i]);
        }
    } else {
        const uint16_t *kh = k, *qh = q;
        for (int64_t t = 0; t < d; t += 32) {
            __m512i qx = _mm512_loadu_si512(qh + t);
#ifdef __AVX512BF16__
            if (kind == DEC_BF16) {
#pragma GCC unroll 16
                for (int i = 0; i < 16; i++)
                    if (full || key[i] < n)
                        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)qx,
                                                  (__m512bh)_mm512_loadu_si512(kh + key[i] * d + t));
                continue;
            }
#endif
            __m512 qe, qo;
            dec_widen(kind, qx, &qe, &qo);
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++)
                if (full || key[i] < n) {
                    __m512 ke, ko;
                    dec_widen(kind, _mm512_loadu_si512(kh + key[i] * d + t), &ke, &ko);
                    acc[i] = _mm512_fmadd_ps(qo, ko, _mm512_fmadd_ps(qe, ke, acc[i]));
                }
        }
    }
    _mm512_storeu_ps(s, _mm512_mul_ps(dec_lane_sums(acc), c));
}

static ATTN_INLINE void dec_prefetch(const char *x, int64_t n, int l1)
{
    for (int64_t i = 0; i < n; i += 64) {
        if (l1)
            __builtin_prefetch(x + i, 0, 3);
        else
            __builtin_prefetch(x + i, 0, 2);
    }
}

/* s[r * lds + j] = c * (q_r . k_j) for rows r < R (q: R rows of d elements, unscaled)
 * and keys j < kb of k (rows of d), padded with zeros to a multiple of 16; the K rows
 * up to `ahead` keys from k are asked for 32 keys ahead, v's rows (stride dv) of the
 * block as it goes. */
static ATTN_INLINE void dec_qk_kind(int kind, const void *k, int64_t kb, int64_t ahead, int64_t d, const void *v,
                                    int64_t dv, const void *q, int64_t R, float c, float *s, int64_t lds)
{
    const int64_t es = kind == DEC_F32 ? 4 : 2;
    const char *kc = k, *qc = q, *vc = v;
    const __m512 vc_ = _mm512_set1_ps(c);
    for (int64_t j = 0; j < kb; j += 16) {
        int64_t n = kb - j < 16 ? kb - j : 16, pf = j + 32;
        if (pf < ahead)
            dec_prefetch(kc + pf * d * es, (ahead - pf < 16 ? ahead - pf : 16) * d * es, 1);
        dec_prefetch(vc + j * dv * es, n * dv * es, 0);
        for (int64_t r = 0; r < R; r++) {
            if (n == 16)
                dec_qk_group(kind, 1, kc + j * d * es, 16, d, qc + r * d * es, vc_, s + r * lds + j);
            else
                dec_qk_group(kind, 0, kc + j * d * es, n, d, qc + r * d * es, vc_, s + r * lds + j);
        }
    }
    if ((kb + 15) / 16 % 2)  /* the rest of the last 32-key panel, which the softmax reads */
        for (int64_t r = 0; r < R; r++)
            _mm512_storeu_ps(s + r * lds + (kb + 15) / 16 * 16, _mm512_setzero_ps());
}

/* One register tile of P V: o[r][0:16 NV) = o[r] alpha[r] + sum_j p[r][j] v_j for r < mr
 * (at most MRT), v_j the block's row j from column c0 (kind; halves as 16 even then 16
 * odd columns of each 32). */
static ATTN_INLINE void dec_pv_tile(int kind, int MRT, int NV, int mr, const void *v, int64_t kb, int64_t dv,
                                    const float *p, int64_t ldp, const float *alpha, float *o, int64_t ldo)
{
    __m512 acc[8][8];
    for (int r = 0; r < MRT; r++) {
        if (r >= mr)
            continue;
        __m512 a = _mm512_set1_ps(alpha[r]);
        for (int u = 0; u < NV; u++)
            acc[r][u] = _mm512_mul_ps(_mm512_loadu_ps(o + r * ldo + 16 * u), a);
    }
    for (int64_t j = 0; j < kb; j++) {
        __m512 x[8];
        if (kind == DEC_F32) {
            for (int u = 0; u < NV; u++)
                x[u] = _mm512_loadu_ps((const float *)v + j * dv + 16 * u);
        } else {
            for (int g = 0; g < NV / 2; g++)
                dec_widen(kind, _mm512_loadu_si512((const uint16_t *)v + j * dv + 32 * g), &x[2 * g], &x[2 * g + 1]);
        }
        for (int r = 0; r < MRT; r++) {
            if (r >= mr)
                continue;
            __m512 pr = _mm512_set1_ps(p[r * ldp + j]);
            for (int u = 0; u < NV; u++)
                acc[r][u] = _mm512_fmadd_ps(pr, x[u], acc[r][u]);
        }
    }
    for (int r = 0; r < MRT; r++) {
        if (r >= mr)
            continue;
        for (int u = 0; u < NV; u++)
            _mm512_storeu_ps(o + r * ldo + 16 * u, acc[r][u]);
    }
}

/* The tiles of rows MRT x 16 NV columns over R rows and dv columns (full tiles with a
 * constant row count, so that the accumulators stay in registers). */
#define DEC_PV_TILES(kind, MRT, NV)                                                                    \
    for (int64_t r0 = 0; r0 < R; r0 += MRT) {                                                          \
        int mr = (int)(R - r0 < MRT ? R - r0 : MRT);                                                   \
        for (int64_t c0 = 0; c0 < dv; c0 += 16 * NV) {                                                 \
            const void *vb = (const char *)v + c0 * es;                                                \
            if (mr == MRT)                                                                             \
                dec_pv_tile(kind, MRT, NV, MRT, vb, kb, dv, p + r0 * ldp, ldp, alpha + r0, o + r0 * dv + c0, dv); \
            else                                                                                       \
                dec_pv_tile(kind, MRT, NV, mr, vb, kb, dv, p + r0 * ldp, ldp, alpha + r0, o + r0 * dv + c0, dv); \
        }                                                                                              \
    }

/* o (R rows of dv) = o alpha + p . V for the block's kb rows of v (row stride dv): few
 * rows take wide tiles (enough accumulators for the FMA latency), many rows 8 x 32. */
static ATTN_INLINE void dec_pv_kind(int kind, const void *v, int64_t kb, int64_t R, int64_t dv, const float *p,
                                    int64_t ldp, const float *alpha, float *o)
{
    const int64_t es = kind == DEC_F32 ? 4 : 2;
    if (R <= 2 && dv % 128 == 0) {
        DEC_PV_TILES(kind, 2, 8)
    } else if (R <= 4 && dv % 64 == 0) {
        DEC_PV_TILES(kind, 4, 4)
    } else {
        DEC_PV_TILES(kind, 8, 2)
    }
}
#undef DEC_PV_TILES

/* The entry points, one instantiation per kind (attn_kernels.h's decode_item). */
static void attn_dec_qk(int kind, const void *k, int64_t kb, int64_t ahead, int64_t d, const void *v, int64_t dv,
                        const void *q, int64_t R, float c, float *s, int64_t lds)
{
    if (kind == DEC_BF16)
        dec_qk_kind(DEC_BF16, k, kb, ahead, d, v, dv, q, R, c, s, lds);
    else if (kind == DEC_F16)
        dec_qk_kind(DEC_F16, k, kb, ahead, d, v, dv, q, R, c, s, lds);
    else
        dec_qk_kind(DEC_F32, k, kb, ahead, d, v, dv, q, R, c, s, lds);
}

static void attn_dec_pv(int kind, const void *v, int64_t kb, int64_t R, int64_t dv, const float *p, int64_t ldp,
                        const float *alpha, float *o)
{
    if (kind == DEC_BF16)
        dec_pv_kind(DEC_BF16, v, kb, R, dv, p, ldp, alpha, o);
    else if (kind == DEC_F16)
        dec_pv_kind(DEC_F16, v, kb, R, dv, p, ldp, alpha, o);
    else
        dec_pv_kind(DEC_F32, v, kb, R, dv, p, ldp, alpha, o);
}

/* The partial O (R rows of dv) in column order: halves kept each 32 columns as 16
 * even then 16 odd (dec_pv_tile); float32 is in order already. */
static void attn_dec_finish(int kind, float *o, int64_t R, int64_t dv)
{
    if (kind == DEC_F32)
        return;
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int64_t i = 0; i < R * dv; i += 32) {
        __m512 ev = _mm512_loadu_ps(o + i), od = _mm512_loadu_ps(o + i + 16);
        _mm512_storeu_ps(o + i, _mm512_permutex2var_ps(ev, lo, od));
        _mm512_storeu_ps(o + i + 16, _mm512_permutex2var_ps(ev, hi, od));
    }
}

/* 1 if any of the n elements (kind) at x is infinite or NaN: x * 0 summed, in registers. */
static int attn_dec_nonfinite(int kind, const void *x, int64_t n)
{
    const int64_t es = kind == DEC_F32 ? 4 : 2, step = 64 / es;
    const char *xc = x;
    __m512 acc = _mm512_setzero_ps(), zero = acc;
    int64_t i = 0;
    for (; i + step <= n; i += step) {
        __m512i w = _mm512_loadu_si512(xc + i * es);
        if (kind == DEC_F32) {
            acc = _mm512_fmadd_ps(_mm512_castsi512_ps(w), zero, acc);
        } else {
            __m512 ev, od;
            dec_widen(kind, w, &ev, &od);
            acc = _mm512_fmadd_ps(od, zero, _mm512_fmadd_ps(ev, zero, acc));
        }
    }
    float tail = 0;
    for (; i < n; i++) {
        float y;
        if (kind == DEC_F32)
            memcpy(&y, xc + 4 * i, 4);
        else if (kind == DEC_BF16)
            y = attn_bf16_to_f32(((const uint16_t *)x)[i]);
        else
            y = _cvtsh_ss(((const uint16_t *)x)[i]);
        tail += y * 0;
    }
    return !(_mm512_reduce_add_ps(acc) + tail == 0);
}

#endif /* ATTN_DECODE512_H */
