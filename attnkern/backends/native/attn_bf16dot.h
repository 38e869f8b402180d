/* bfloat16 products (AVX512_BF16's vdpbf16ps) for the backward of bfloat16 inputs:
 * attn_kernels.h's backward under ATTN_BWD_DOT (attn_avx512bf16.c)
 * takes its five matmuls from here. Its arrays are float32 widened from bfloat16,
 * so q, k, v and dO are bfloat16 values exactly: their pairs are the float32 bits'
 * high halves, no rounding. The probabilities P and dS are rounded to bfloat16 (to
 * nearest even) for the products that take them (dV = Pᵀ dO, dK = dSᵀ Q, dQ = dS K),
 * as GPU FlashAttention rounds them; every sum is float32. vdpbf16ps adds
 * a[2i] b[2i] + a[2i+1] b[2i+1] to each float32 lane i: 32 multiply-adds an
 * instruction where vfmadd231ps does 16.
 *
 * Layouts (a pair word holds the element of the even index in its low half):
 *   rows:   a row's pairs along its columns (dot_pairs_rows);
 *   Kt:     panels of DOT_NR rows, panel j0 at j0 * d2, d2 rows of DOT_NR pairs, pair t of
 *           row j0 + c at t * DOT_NR + c (dot_pack_kt): the right operand of A Bᵀ;
 *   V:      panels of DOT_NR columns, panel c0 at c0 * rows2, rows2 = ceil(rows / 2) rows
 *           of DOT_NR pairs, rows 2t and 2t + 1 of column c0 + c at t * DOT_NR + c
 *           (dot_pack_v): the right operand of A B;
 * with zeros past the rows and columns. Included by attn_avx512.c (its vtranspose_f32 transposes
 * 16 x 16 words). */
#ifndef ATTN_BF16DOT_H
#define ATTN_BF16DOT_H

#include <immintrin.h>
#include <string.h>

#include "attn_common.h"

#define DOT_NR 32 /* columns of a register tile and of a panel: NR of the float32 AVX-512 code */
#define DOT_MR 8  /* rows of a register tile */

/* How dot_tile writes its tile x: DOT_EPI_SCALE, o = x * c; DOT_EPI_KAHAN, o += x with
 * Kahan's compensation in comp (laid out as o); DOT_EPI_ROWS, o += x in the rows r whose
 * seen[r] is set, o = x in the others (attn_kernels.h's ATTN_EPI_KAHAN and _ROWS). */
#define DOT_EPI_SCALE 0
#define DOT_EPI_KAHAN 1
#define DOT_EPI_ROWS 2

/* 16 pairs (a[i], b[i]) of float32 vectors holding bfloat16 values. */
static ATTN_INLINE __m512i dot_pair16(__m512 a, __m512 b)
{
    return _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(a), 16),
                           _mm512_and_si512(_mm512_castps_si512(b), _mm512_set1_epi32((int)0xffff0000u)));
}

static ATTN_INLINE uint32_t dot_pair(float a, float b)
{
    uint32_t x, y;
    memcpy(&x, &a, sizeof x);
    memcpy(&y, &b, sizeof y);
    return x >> 16 | (y & 0xffff0000u);
}

/* out[r * ldo + t] = pair (x[r][2t], x[r][2t + 1]) for r < rows, t < ceil(n / 2), x[r][n] = 0:
 * rows of bfloat16 values as pairs, exactly. */
static void dot_pairs_rows(const float *x, int64_t ldx, int64_t rows, int64_t n, uint32_t *out, int64_t ldo)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        for (int64_t t = 0; t < (n + 1) / 2; t++)
            out[r * ldo + t] = dot_pair(xr[2 * t], 2 * t + 1 < n ? xr[2 * t + 1] : 0.0f);
    }
}

/* The pairs (x[2t], x[2t + 1]) for t < 16 of 32 float32 holding bfloat16 values: their
 * high halves, in order. */
static ATTN_INLINE __m512i dot_pairs32(const float *x)
{
    const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29,
                                         27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    return _mm512_permutex2var_epi16(_mm512_castps_si512(_mm512_loadu_ps(x)), odd,
                                     _mm512_castps_si512(_mm512_loadu_ps(x + 16)));
}

/* Kt panels (the layout above) of rows [0, rows) of x (row stride d), exactly. Full
 * panels with d a multiple of 32 go 16 rows x 16 pairs at a time: the rows' pairs
 * (dot_pairs32), then vtranspose_f32 (a transpose of 32-bit words); the rest element
 * by element. */
static void dot_pack_kt(const float *x, int64_t rows, int64_t d, uint32_t *kt)
{
    const int64_t d2 = (d + 1) / 2;
    uint32_t sq[16 * 16] __attribute__((aligned(64)));
    for (int64_t j0 = 0; j0 < rows; j0 += DOT_NR) {
        uint32_t *panel = kt + j0 * d2;
        int64_t nc = rows - j0 < DOT_NR ? rows - j0 : DOT_NR, t0 = 0;
        if (nc == DOT_NR && d % 32 == 0) {
            for (; t0 < d2; t0 += 16)
                for (int64_t c0 = 0; c0 < DOT_NR; c0 += 16) {
                    for (int c = 0; c < 16; c++)
                        _mm512_store_si512(sq + 16 * c, dot_pairs32(x + (j0 + c0 + c) * d + 2 * t0));
                    vtranspose_f32((const float *)sq, 16, (float *)(panel + t0 * DOT_NR + c0), DOT_NR);
                }
        }
        for (int64_t c = 0; c < DOT_NR; c++) {
            const float *xr = x + (j0 + c) * d;
            for (int64_t t = t0; t < d2; t++)
                panel[t * DOT_NR + c] = c < nc ? dot_pair(xr[2 * t], 2 * t + 1 < d ? xr[2 * t + 1] : 0.0f) : 0;
        }
    }
}

/* V panels (the layout above) of rows [0, rows) and columns [0, cols) of x (row
 * stride cols), exactly. */
static void dot_pack_v(const float *x, int64_t rows, int64_t cols, uint32_t *vp)
{
    const int64_t rows2 = (rows + 1) / 2;
    for (int64_t c0 = 0; c0 < cols; c0 += DOT_NR) {
        uint32_t *panel = vp + c0 * rows2;
        int64_t nc = cols - c0 < DOT_NR ? cols - c0 : DOT_NR;
        for (int64_t t = 0; t < rows2; t++) {
            const float *r0 = x + 2 * t * cols + c0, *r1 = r0 + cols;
            int two = 2 * t + 1 < rows;
            uint32_t *pt = panel + t * DOT_NR;
            if (nc == DOT_NR) {
                for (int h = 0; h < DOT_NR; h += 16) {
                    __m512 b = two ? _mm512_loadu_ps(r1 + h) : _mm512_setzero_ps();
                    _mm512_store_si512(pt + h, dot_pair16(_mm512_loadu_ps(r0 + h), b));
                }
                continue;
            }
            int64_t c = 0;
            for (; c < nc; c++)
                pt[c] = dot_pair(r0[c], two ? r1[c] : 0.0f);
            for (; c < DOT_NR; c++)
                pt[c] = 0;
        }
    }
}

/* out[r * ldo + t] = pair (bf16(x[r][2t]), bf16(x[r][2t + 1])) for r < rows, t < n / 2
 * (n a multiple of 32), rounded to nearest even: rows of float32 as bfloat16 pairs. */
static void dot_round_rows(const float *x, int64_t ldx, int64_t rows, int64_t n, uint32_t *out, int64_t ldo)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < n; j += 32) {
            __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + r * ldx + j + 16), _mm512_loadu_ps(x + r * ldx + j));
            _mm512_storeu_si512(out + r * ldo + j / 2, (__m512i)h);
        }
}

/* out[t * ldo + i] = pair (bf16(x[2t][i]), bf16(x[2t + 1][i])) for t < ceil(rows / 2), i < n
 * (n a multiple of 16), x[rows][i] = 0, rounded to nearest even: the columns of x
 * as bfloat16 pairs along its rows (the pairs of xᵀ's rows, stored by column). */
static void dot_round_cols(const float *x, int64_t ldx, int64_t rows, int64_t n, uint32_t *out, int64_t ldo)
{
    for (int64_t t = 0; t < (rows + 1) / 2; t++) {
        const float *r0 = x + 2 * t * ldx, *r1 = r0 + ldx;
        int two = 2 * t + 1 < rows;
        for (int64_t i = 0; i < n; i += 16) {
            __m512i a = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(r0 + i)));
            __m512i b = two ? _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(r1 + i)))
                            : _mm512_setzero_si512();
            _mm512_storeu_si512(out + t * ldo + i, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
        }
    }
}

/* One register tile of A B on pairs: x[r][0:DOT_NR) = sum_t A[r][t] . b[t] for r < mr,
 * A[r][t] = a[r * ars + t * ats] (a pair word), b a panel (k2 rows of DOT_NR pairs);
 * written to o + r * ldo as epi says. With half, only x[r][0:16) (a panel of at most 16
 * valid columns): half the products, the same sums for those columns. */
static ATTN_INLINE void dot_tile(int mr, int64_t k2, const uint32_t *a, int64_t ars, int64_t ats,
                                 const uint32_t *b, float *o, int64_t ldo, float *comp, const uint8_t *seen,
                                 float c, int epi, int half)
{
    __m512 acc[DOT_MR][2];
    for (int r = 0; r < DOT_MR; r++)
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
#pragma GCC unroll 2
    for (int64_t t = 0; t < k2; t++) {
        __m512bh b0 = (__m512bh)_mm512_load_si512(b + t * DOT_NR);
        __m512bh b1 = half ? b0 : (__m512bh)_mm512_load_si512(b + t * DOT_NR + 16);
        for (int r = 0; r < DOT_MR; r++) {
            if (r < mr) {
                __m512bh ar = (__m512bh)_mm512_set1_epi32((int)a[r * ars + t * ats]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], ar, b0);
                if (!half)
                    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], ar, b1);
            }
        }
    }
    const __m512 vc = _mm512_set1_ps(c);
    for (int r = 0; r < DOT_MR; r++) {
        if (r >= mr)
            continue;
        for (int h = 0; h < (half ? 1 : 2); h++) {
            float *op = o + r * ldo + h * 16;
            if (epi == DOT_EPI_SCALE) {
                _mm512_storeu_ps(op, _mm512_mul_ps(acc[r][h], vc));
            } else if (epi == DOT_EPI_KAHAN) {  /* s += x: y = x - c, t = s + y, c = (t - s) - y, s = t */
                float *cp = comp + r * ldo + h * 16;
                __m512 sv = _mm512_loadu_ps(op), y = _mm512_sub_ps(acc[r][h], _mm512_loadu_ps(cp));
                __m512 t = _mm512_add_ps(sv, y);
                _mm512_storeu_ps(cp, _mm512_sub_ps(_mm512_sub_ps(t, sv), y));
                _mm512_storeu_ps(op, t);
            } else {
                _mm512_storeu_ps(op, seen[r] ? _mm512_add_ps(_mm512_loadu_ps(op), acc[r][h]) : acc[r][h]);
            }
        }
    }
}

/* The last panel of dot_gemm where it holds at most 16 valid columns (from column c0): 8 x 16
 * tiles, half the products. Kept out of dot_gemm's loop so that the full tiles compile as before. */
static __attribute__((noinline)) void dot_gemm_half(const uint32_t *a, int64_t ars, int64_t ats, int64_t rows,
                                                    const uint32_t *pack, int64_t kpanel2, int64_t k2, int64_t c0,
                                                    float *o, int64_t ldo, float *comp, const uint8_t *seen, int epi)
{
    for (int64_t r0 = 0; r0 < rows; r0 += DOT_MR) {
        int mr = (int)(rows - r0 < DOT_MR ? rows - r0 : DOT_MR);
        const uint32_t *ar = a + r0 * ars, *bp = pack + c0 * kpanel2;
        float *op = o + r0 * ldo + c0, *cp = comp ? comp + r0 * ldo + c0 : NULL;
        const uint8_t *sr = seen ? seen + r0 : NULL;
        if (mr == DOT_MR && epi == DOT_EPI_KAHAN)
            dot_tile(DOT_MR, k2, ar, ars, ats, bp, op, ldo, cp, sr, 1.0f, DOT_EPI_KAHAN, 1);
        else if (mr == DOT_MR)
            dot_tile(DOT_MR, k2, ar, ars, ats, bp, op, ldo, cp, sr, 1.0f, DOT_EPI_ROWS, 1);
        else
            dot_tile(mr, k2, ar, ars, ats, bp, op, ldo, cp, sr, 1.0f, epi, 1);
    }
}

/* o[0:rows, 0:round_up(ncols, DOT_NR)) (+)= A . B as epi says (dot_tile), A[r][t] =
 * a[r * ars + t * ats] (rows x k2 pair words), B the panels at pack (k2 pair rows of
 * each, one panel every kpanel2 pair rows of DOT_NR, ncols columns). The sums into
 * running outputs (DOT_EPI_KAHAN, DOT_EPI_ROWS: dV, dK, dQ, whose readers take their
 * first ncols columns) take a last panel of at most 16 valid columns in dot_gemm_half,
 * which leaves its columns from 16 on unwritten; DOT_EPI_SCALE writes whole panels (the
 * score buffers' padding is read as pairs). */
static void dot_gemm(const uint32_t *a, int64_t ars, int64_t ats, int64_t rows, const uint32_t *pack,
                     int64_t kpanel2, int64_t k2, int64_t ncols, float *o, int64_t ldo, float *comp,
                     const uint8_t *seen, float c, int epi)
{
    const int64_t tail = ncols % DOT_NR;
    const int64_t full = epi != DOT_EPI_SCALE && tail && tail <= 16 ? ncols - tail : ncols;
    for (int64_t r0 = 0; r0 < rows; r0 += DOT_MR) {
        int mr = (int)(rows - r0 < DOT_MR ? rows - r0 : DOT_MR);
        for (int64_t c0 = 0; c0 < full; c0 += DOT_NR) {
            const uint32_t *ar = a + r0 * ars, *bp = pack + c0 * kpanel2;
            float *op = o + r0 * ldo + c0, *cp = comp ? comp + r0 * ldo + c0 : NULL;
            const uint8_t *sr = seen ? seen + r0 : NULL;
            if (mr == DOT_MR && epi == DOT_EPI_SCALE)
                dot_tile(DOT_MR, k2, ar, ars, ats, bp, op, ldo, cp, sr, c, DOT_EPI_SCALE, 0);
            else if (mr == DOT_MR && epi == DOT_EPI_KAHAN)
                dot_tile(DOT_MR, k2, ar, ars, ats, bp, op, ldo, cp, sr, c, DOT_EPI_KAHAN, 0);
            else if (mr == DOT_MR)
                dot_tile(DOT_MR, k2, ar, ars, ats, bp, op, ldo, cp, sr, c, DOT_EPI_ROWS, 0);
            else
                dot_tile(mr, k2, ar, ars, ats, bp, op, ldo, cp, sr, c, epi, 0);
        }
    }
    if (full < ncols)  /* epi is DOT_EPI_KAHAN or DOT_EPI_ROWS: c is not used */
        dot_gemm_half(a, ars, ats, rows, pack, kpanel2, k2, full, o, ldo, comp, seen, epi);
}

#endif /* ATTN_BF16DOT_H */
