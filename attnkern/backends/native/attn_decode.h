/* The decode path's products straight from the cache (attn_kernels.h's decode_item
 * under DECODE_KIND): S = Q K^T and O = O alpha + P V read K and V rows as they are
 * stored (bfloat16, float16 or float32), with no packed or widened copy of a block in
 * memory. A template over the vector unit: attn_avx512.c and attn_avx2.c define, before
 * including it,
 *   DEC_VW, dec_vt           float32 lanes of a vector and its type
 *   dec_zero dec_loadu dec_storeu dec_set1 dec_fma dec_mul   float32 vector operations
 *   dec_raw, dec_raw_load(p), dec_lo(kind, x), dec_hi(kind, x)  2 DEC_VW halves
 *                            loaded, then widened to float32 in registers, DEC_VW each
 *                            (which element goes to which lane: the unit's choice, the
 *                            same for q, K and V rows)
 *   dec_lane_sums(acc), DEC_KEY(s)  one vector of the DEC_VW accumulators' lane sums;
 *                            accumulator s takes key DEC_KEY(s) of a group, which puts
 *                            key j's sum in lane j
 *   dec_in_order(kind, o, n) the partial O's n columns (a multiple of 2 DEC_VW) back in
 *                            column order from dec_lo's and dec_hi's lanes
 *   DEC_DOT_BF16(acc, q, k)  optional: acc plus the dot products of the 2 DEC_VW
 *                            bfloat16 at q and k, pair by pair (vdpbf16ps); with it,
 *                            DEC_DOT_BF16_BCAST(acc, w, b) (the pair word w against each
 *                            of b's 16) and DEC_TRANSPOSE16(src, lds, dst) (16 x 16 words)
 *   DEC_PV_WIDE, DEC_PV_MID, DEC_PV_MANY  the P V register tiles (rows, vectors) for at most
 *                            2, 4 and any number of rows
 *
 *   Q K^T, row-major: a query row against DEC_VW keys at a time, each key a vector
 *     accumulator along d (bfloat16 with DEC_DOT_BF16 where the unit has it: q and K as
 *     stored, 2 DEC_VW products an instruction; else q's and K's halves widened in
 *     registers, two FMAs; float32: one FMA of DEC_VW). The accumulators' lane sums give
 *     one vector of scores; the keys go into the accumulators in the order that lands
 *     each score in its key's lane. Scores are the dot products times the score factor (q
 *     is not scaled first: that would round it again). The group's K rows stay in L1 while
 *     every query row reads them.
 *   Q K^T, keys in the lanes (bfloat16 with DEC_DOT_BF16, over DEC_PAIRS_ROWS rows): K's
 *     pair words of 16 keys transposed into an L1 panel, then register tiles of 8 rows.
 *   P V: register tiles of query rows x columns over the block's keys; each V row's
 *     columns are loaded once per tile and widened in registers (half: in dec_lo's and
 *     dec_hi's lanes, the partial O put back in column order once per work item by
 *     attn_dec_finish). The probabilities are the float32 ones of the softmax.
 * Each key group asks for K rows ahead (float32: DEC_PF_BYTES ahead into L2; the half kinds
 * two groups ahead into L1, and bfloat16 with keys in the lanes both) and for its own V rows
 * (L2), so the memory streams overlap the arithmetic. The order of every sum depends on the shape only:
 * results are the same for every thread count (the decode path's chunks are fixed by the
 * shape). */
#ifndef ATTN_DECODE_H
#define ATTN_DECODE_H

#include "attn_common.h"

#define DEC_BF16 0
#define DEC_F16 1
#define DEC_F32 2
/* The row-major Q K^T runs up to this many query rows per k/v row (float32: DEC_F32_ROWS;
 * bfloat16 with DEC_DOT_BF16: DEC_PAIRS_ROWS): above it the lane sums (per row and key
 * group) cost more than keys in the lanes, which bfloat16 gets with DEC_DOT_BF16 from K's
 * pairs transposed in L1 (dec_qk_pairs; it also keeps more cache lines in flight), and the
 * other kinds from the packed path's Kt panels. Chosen from alternating single-thread
 * runs of both forms on a Zen 5 (GQA 32 over 8, D 128, Nq 1 and 2), to be confirmed on a
 * quiet machine. */
#define DEC_ROWS 8
#define DEC_F32_ROWS 4
#define DEC_PAIRS_ROWS 2

/* 1 where the direct path runs for R query rows of head sizes d and dv. */
static inline int attn_dec_direct(int kind, int64_t R, int64_t d, int64_t dv)
{
    if (dv % (2 * DEC_VW) != 0 || d < 1 || dv < 1)
        return 0;
    if (kind == DEC_F32)
        return d % DEC_VW == 0 && R <= DEC_F32_ROWS;
#ifdef DEC_DOT_BF16
    if (kind == DEC_BF16)
        return d % (2 * DEC_VW) == 0;
#endif
    return d % (2 * DEC_VW) == 0 && R <= DEC_ROWS;
}

/* s[0:DEC_VW) = c * (q . k_j) for the keys j < n of the DEC_VW rows at k (row stride d
 * elements of kind), 0 for j >= n: one query row against one key group. */
static ATTN_INLINE void dec_qk_group(int kind, int full, const void *k, int64_t n, int64_t d, const void *q,
                                     dec_vt c, float *s)
{
    dec_vt acc[DEC_VW];
    int64_t key[DEC_VW];
#pragma GCC unroll 16
    for (int i = 0; i < DEC_VW; i++) {
        acc[i] = dec_zero();
        key[i] = DEC_KEY(i);
    }
    if (kind == DEC_F32) {
        const float *kf = k, *qf = q;
        for (int64_t t = 0; t < d; t += DEC_VW) {
            dec_vt qv = dec_loadu(qf + t);
#pragma GCC unroll 16
            for (int i = 0; i < DEC_VW; i++)
                if (full || key[i] < n)
                    acc[i] = dec_fma(qv, dec_loadu(kf + key[i] * d + t), acc[i]);
        }
    } else {
        const uint16_t *kh = k, *qh = q;
        for (int64_t t = 0; t < d; t += 2 * DEC_VW) {
#ifdef DEC_DOT_BF16
            if (kind == DEC_BF16) {
#pragma GCC unroll 16
                for (int i = 0; i < DEC_VW; i++)
                    if (full || key[i] < n)
                        acc[i] = DEC_DOT_BF16(acc[i], qh + t, kh + key[i] * d + t);
                continue;
            }
#endif
            dec_raw qx = dec_raw_load(qh + t);
            dec_vt qa = dec_lo(kind, qx), qb = dec_hi(kind, qx);
#pragma GCC unroll 16
            for (int i = 0; i < DEC_VW; i++)
                if (full || key[i] < n) {
                    dec_raw kx = dec_raw_load(kh + key[i] * d + t);
                    acc[i] = dec_fma(qb, dec_hi(kind, kx), dec_fma(qa, dec_lo(kind, kx), acc[i]));
                }
        }
    }
    dec_storeu(s, dec_mul(dec_lane_sums(acc), c));
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

/* How far ahead K is asked for into L2: on a Zen 4 EPYC (2 threads, 32 query heads over 8,
 * D 128) float32 read the cache 1.2-1.3x faster with 32-64 KB than with the L1 prefetch two
 * groups (8 KB) ahead, 96 KB less; a prefetcht0 that far ahead would hold L1's miss buffers. */
#define DEC_PF_BYTES 65536
/* How many keys ahead (a multiple of the group size g, at least two groups) the K rows
 * of row size `row` bytes are asked for: DEC_PF_BYTES. */
static ATTN_INLINE int64_t dec_pf_keys(int64_t row, int64_t g)
{
    int64_t keys = DEC_PF_BYTES / row / g * g;
    return keys > 2 * g ? keys : 2 * g;
}

/* s[r * lds + j] = c * (q_r . k_j) for rows r < R (q: R rows of d elements, unscaled)
 * and keys j < kb of k (rows of d), zero from kb to a multiple of 2 DEC_VW; the K rows
 * up to `ahead` keys from k are asked for ahead (float32: into L2, DEC_PF_BYTES ahead; the
 * half kinds: into L1, two groups ahead), v's rows (stride dv) of the
 * block as it goes. */
static ATTN_INLINE void dec_qk_kind(int kind, const void *k, int64_t kb, int64_t ahead, int64_t d, const void *v,
                                    int64_t dv, const void *q, int64_t R, float c, float *s, int64_t lds)
{
    const int64_t es = kind == DEC_F32 ? 4 : 2, G = DEC_VW;
    const char *kc = k, *qc = q, *vc = v;
    const dec_vt vcf = dec_set1(c);
    for (int64_t j = 0; j < kb; j += G) {
        /* float32: K asked into L2 DEC_PF_BYTES ahead; the half kinds (half the bytes a key,
         * and their widening or dot products to do) into L1 two groups ahead */
        int64_t n = kb - j < G ? kb - j : G, pf = j + (kind == DEC_F32 ? dec_pf_keys(d * es, G) : 2 * G);
        if (pf < ahead)
            dec_prefetch(kc + pf * d * es, (ahead - pf < G ? ahead - pf : G) * d * es, kind != DEC_F32);
        dec_prefetch(vc + j * dv * es, n * dv * es, 0);
        for (int64_t r = 0; r < R; r++) {
            if (n == G)
                dec_qk_group(kind, 1, kc + j * d * es, G, d, qc + r * d * es, vcf, s + r * lds + j);
            else
                dec_qk_group(kind, 0, kc + j * d * es, n, d, qc + r * d * es, vcf, s + r * lds + j);
        }
    }
    if ((kb + G - 1) / G % 2)  /* the rest of the last panel of 2 DEC_VW keys, which the softmax reads */
        for (int64_t r = 0; r < R; r++)
            dec_storeu(s + r * lds + (kb + G - 1) / G * G, dec_zero());
}

#ifdef DEC_DOT_BF16
/* The pair (p[0], p[1]) as one word (the arrays need only 2-byte alignment). */
static ATTN_INLINE uint32_t dec_word(const uint16_t *p)
{
    uint32_t w;
    memcpy(&w, p, sizeof w);
    return w;
}

/* s[r][0:16) = c * sum_t q_r pair t . panel[t] for r < mr (at most 8): one register
 * tile of Q K^T with the 16 keys in the lanes (q: rows of d2 pairs; panel: d2 rows of
 * 16 pair words). */
static ATTN_INLINE void dec_pairs_tile(int mr, const uint16_t *q, int64_t d2, const uint32_t *panel, __m512 c,
                                       float *s, int64_t lds)
{
    __m512 acc[8];
    for (int r = 0; r < 8; r++)
        acc[r] = _mm512_setzero_ps();
    for (int64_t t = 0; t < d2; t++) {
        __m512i b = _mm512_loadu_si512(panel + 16 * t);
        for (int r = 0; r < 8; r++)
            if (r < mr)
                acc[r] = DEC_DOT_BF16_BCAST(acc[r], dec_word(q + 2 * (r * d2 + t)), b);
    }
    for (int r = 0; r < 8; r++)
        if (r < mr)
            _mm512_storeu_ps(s + r * lds, _mm512_mul_ps(acc[r], c));
}

/* dec_qk_kind for many bfloat16 rows: each key group's K pairs (k[j][2t], k[j][2t + 1])
 * transposed in registers into panel (d / 2 rows of the 16 keys' pair words, in L1),
 * then register tiles of 8 rows with the keys in the lanes: no lane sums, and the
 * transposes are shared by all the rows. K is asked for DEC_PF_BYTES ahead into L2 and two
 * groups ahead into L1 (the transposes read it from there). A function of its own,
 * 64-byte aligned, as dec_qk_f32. */
__attribute__((noinline, aligned(64))) static void dec_qk_pairs(const uint16_t *k, int64_t kb, int64_t ahead,
                                                                int64_t d, const uint16_t *v, int64_t dv,
                                                                const uint16_t *q, int64_t R, float c, float *s,
                                                                int64_t lds, uint32_t *panel)
{
    const int64_t d2 = d / 2;
    const __m512 vc = _mm512_set1_ps(c);
    for (int64_t j = 0; j < kb; j += 16) {
        int64_t n = kb - j < 16 ? kb - j : 16, pf = j + dec_pf_keys(d * 2, 16);
        if (pf < ahead)
            dec_prefetch((const char *)(k + pf * d), (ahead - pf < 16 ? ahead - pf : 16) * d * 2, 0);
        if (j + 32 < ahead)
            dec_prefetch((const char *)(k + (j + 32) * d), (ahead - j - 32 < 16 ? ahead - j - 32 : 16) * d * 2, 1);
        dec_prefetch((const char *)(v + j * dv), n * dv * 2, 0);
        const uint16_t *kj = k + j * d;
        if (n == 16)
            for (int64_t t0 = 0; t0 < d2; t0 += 16)
                DEC_TRANSPOSE16(kj + 2 * t0, d2, panel + 16 * t0);
        else
            for (int64_t t = 0; t < d2; t++)
                for (int64_t i = 0; i < 16; i++)
                    panel[16 * t + i] = i < n ? dec_word(kj + i * d + 2 * t) : 0;
        for (int64_t r0 = 0; r0 < R; r0 += 8) {
            int mr = (int)(R - r0 < 8 ? R - r0 : 8);
            if (mr == 8)
                dec_pairs_tile(8, q + r0 * d, d2, panel, vc, s + r0 * lds + j, lds);
            else
                dec_pairs_tile(mr, q + r0 * d, d2, panel, vc, s + r0 * lds + j, lds);
        }
    }
    if ((kb + 15) / 16 % 2)  /* the rest of the last 32-key panel, which the softmax reads */
        for (int64_t r = 0; r < R; r++)
            _mm512_storeu_ps(s + r * lds + (kb + 15) / 16 * 16, _mm512_setzero_ps());
}
#endif

/* One register tile of P V: o[r][0:NV DEC_VW) = o[r] alpha[r] + sum_j p[r][j] v_j for
 * r < mr (at most MRT), v_j the block's row j from the tile's first column (kind; halves
 * in dec_lo's and dec_hi's lanes). */
static ATTN_INLINE void dec_pv_tile(int kind, int MRT, int NV, int mr, const void *v, int64_t kb, int64_t dv,
                                    const float *p, int64_t ldp, const float *alpha, float *o, int64_t ldo)
{
    dec_vt acc[8][8];
    for (int r = 0; r < MRT; r++) {
        if (r >= mr)
            continue;
        dec_vt a = dec_set1(alpha[r]);
        for (int u = 0; u < NV; u++)
            acc[r][u] = dec_mul(dec_loadu(o + r * ldo + DEC_VW * u), a);
    }
    for (int64_t j = 0; j < kb; j++) {
        dec_vt x[8];
        if (kind == DEC_F32) {
            for (int u = 0; u < NV; u++)
                x[u] = dec_loadu((const float *)v + j * dv + DEC_VW * u);
        } else {
            for (int g = 0; g < NV / 2; g++) {
                dec_raw vx = dec_raw_load((const uint16_t *)v + j * dv + 2 * DEC_VW * g);
                x[2 * g] = dec_lo(kind, vx);
                x[2 * g + 1] = dec_hi(kind, vx);
            }
        }
        for (int r = 0; r < MRT; r++) {
            if (r >= mr)
                continue;
            dec_vt pr = dec_set1(p[r * ldp + j]);
            for (int u = 0; u < NV; u++)
                acc[r][u] = dec_fma(pr, x[u], acc[r][u]);
        }
    }
    for (int r = 0; r < MRT; r++) {
        if (r >= mr)
            continue;
        for (int u = 0; u < NV; u++)
            dec_storeu(o + r * ldo + DEC_VW * u, acc[r][u]);
    }
}

/* The tiles of MRT rows x NV vectors over R rows and dv columns (full tiles with a
 * constant row count, so that the accumulators stay in registers). */
#define DEC_PV_TILES(kind, MRT, NV)                                                                    \
    for (int64_t r0 = 0; r0 < R; r0 += MRT) {                                                          \
        int mr = (int)(R - r0 < MRT ? R - r0 : MRT);                                                   \
        for (int64_t c0 = 0; c0 < dv; c0 += DEC_VW * NV) {                                             \
            const void *vb = (const char *)v + c0 * es;                                                \
            if (mr == MRT)                                                                             \
                dec_pv_tile(kind, MRT, NV, MRT, vb, kb, dv, p + r0 * ldp, ldp, alpha + r0, o + r0 * dv + c0, dv); \
            else                                                                                       \
                dec_pv_tile(kind, MRT, NV, mr, vb, kb, dv, p + r0 * ldp, ldp, alpha + r0, o + r0 * dv + c0, dv); \
        }                                                                                              \
    }
#define DEC_PV_WITH(kind, tile) DEC_PV_TILES(kind, tile)

/* o (R rows of dv) = o alpha + p . V for the block's kb rows of v (row stride dv): few
 * rows take wide tiles (enough accumulators for the FMA latency), many rows tall ones. */
static ATTN_INLINE void dec_pv_kind(int kind, const void *v, int64_t kb, int64_t R, int64_t dv, const float *p,
                                    int64_t ldp, const float *alpha, float *o)
{
    const int64_t es = kind == DEC_F32 ? 4 : 2;
    if (R <= 2 && dv % (DEC_VW * DEC_PV_WIDE_NV) == 0) {
        DEC_PV_WITH(kind, DEC_PV_WIDE)
    } else if (R <= 4 && dv % (DEC_VW * DEC_PV_MID_NV) == 0) {
        DEC_PV_WITH(kind, DEC_PV_MID)
    } else {
        DEC_PV_WITH(kind, DEC_PV_MANY)
    }
}
#undef DEC_PV_WITH
#undef DEC_PV_TILES

/* The float32 and bfloat16 row-major Q K^T in functions of their own, 64-byte aligned: their
 * loops' placement then does not move with the code of the other kinds (on a Zen 4 one
 * placement of the same float32 code read the cache 15% slower than another). */
__attribute__((noinline, aligned(64))) static void dec_qk_f32(const void *k, int64_t kb, int64_t ahead, int64_t d,
                                                              const void *v, int64_t dv, const void *q, int64_t R,
                                                              float c, float *s, int64_t lds)
{
    dec_qk_kind(DEC_F32, k, kb, ahead, d, v, dv, q, R, c, s, lds);
}

__attribute__((noinline, aligned(64))) static void dec_qk_bf16(const void *k, int64_t kb, int64_t ahead, int64_t d,
                                                               const void *v, int64_t dv, const void *q, int64_t R,
                                                               float c, float *s, int64_t lds)
{
    dec_qk_kind(DEC_BF16, k, kb, ahead, d, v, dv, q, R, c, s, lds);
}

/* The entry points, one instantiation per kind (attn_kernels.h's decode_item). */
static void attn_dec_qk(int kind, const void *k, int64_t kb, int64_t ahead, int64_t d, const void *v, int64_t dv,
                        const void *q, int64_t R, float c, float *s, int64_t lds, void *panel)
{
#ifdef DEC_DOT_BF16
    if (kind == DEC_BF16 && R > DEC_PAIRS_ROWS) {
        dec_qk_pairs(k, kb, ahead, d, v, dv, q, R, c, s, lds, panel);
        return;
    }
#endif
    (void)panel;
    if (kind == DEC_BF16)
        dec_qk_bf16(k, kb, ahead, d, v, dv, q, R, c, s, lds);
    else if (kind == DEC_F16)
        dec_qk_kind(DEC_F16, k, kb, ahead, d, v, dv, q, R, c, s, lds);
    else
        dec_qk_f32(k, kb, ahead, d, v, dv, q, R, c, s, lds);
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

/* The partial O (R rows of dv) in column order (float32 is in order already). */
static void attn_dec_finish(int kind, float *o, int64_t R, int64_t dv)
{
    if (kind != DEC_F32)
        dec_in_order(kind, o, R * dv);
}

/* 1 if any of the n elements (kind) at x is infinite or NaN, by their bits: an element
 * whose exponent bits are all ones, i.e. (x & ~sign) >= the infinity's bits, has the top
 * bit of (x & ~sign) + (2^(top) - infinity) set; OR-ed over 32-bit words (a half kind's two
 * elements a word each in its own 16 bits: the sum stays inside them). Integer ANDs, adds
 * and ORs of one cycle each, in two chains: the x * 0 sums it replaces waited an FMA's
 * latency twice per vector, which on a Zen 4 took a quarter of a bfloat16 decode's time. */
typedef uint32_t dec_u32v __attribute__((vector_size(DEC_VW * 4)));

static int attn_dec_nonfinite(int kind, const void *x, int64_t n)
{
    const uint32_t mask = kind == DEC_F32 ? 0x7fffffffu : 0x7fff7fffu;
    const uint32_t add = kind == DEC_F32 ? 0x00800000u : kind == DEC_BF16 ? 0x00800080u : 0x04000400u;
    const uint32_t top = kind == DEC_F32 ? 0x80000000u : 0x80008000u;
    const int64_t es = kind == DEC_F32 ? 4 : 2, bytes = n * es, vb = (int64_t)sizeof(dec_u32v);
    const char *c = (const char *)x;
    dec_u32v a0 = {0}, a1 = {0}, w0, w1;
    int64_t i = 0;
    for (; i + 2 * vb <= bytes; i += 2 * vb) {
        memcpy(&w0, c + i, sizeof w0);
        memcpy(&w1, c + i + vb, sizeof w1);
        a0 |= (w0 & mask) + add;
        a1 |= (w1 & mask) + add;
    }
    a0 |= a1;
    uint32_t any = 0;
    for (int l = 0; l < DEC_VW; l++)
        any |= a0[l];
    for (; i < bytes; i += es) {
        uint32_t e = 0;
        memcpy(&e, c + i, (size_t)es);  /* a half element in the low 16 bits */
        any |= ((e & mask) + add) & (kind == DEC_F32 ? top : 0x8000u);
    }
    return (any & top) != 0;
}

#endif /* ATTN_DECODE_H */
