/* AVX-512F: 512-bit vectors, 8 x 32 (float) register tiles: 16 accumulators
 * of the 32 zmm registers, twice the work per FMA of AVX2. attn_avx512bf16.c
 * includes this file under its own ISA tag. */
#include <immintrin.h>

#include "attn_common.h"

#ifndef ISA
#define ISA avx512
#endif
#define MR 8

static ATTN_INLINE __m512 vload_f32(const float *p) { return _mm512_load_ps(p); }
static ATTN_INLINE __m512 vloadu_f32(const float *p) { return _mm512_loadu_ps(p); }
static ATTN_INLINE void vstore_f32(float *p, __m512 x) { _mm512_store_ps(p, x); }
static ATTN_INLINE void vstoreu_f32(float *p, __m512 x) { _mm512_storeu_ps(p, x); }
static ATTN_INLINE __m512 vset1_f32(float x) { return _mm512_set1_ps(x); }
static ATTN_INLINE __m512 vzero_f32(void) { return _mm512_setzero_ps(); }
static ATTN_INLINE __m512 vfma_f32(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
static ATTN_INLINE __m512 vmul_f32(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
static ATTN_INLINE __m512 vadd_f32(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
static ATTN_INLINE __m512 vsub_f32(__m512 a, __m512 b) { return _mm512_sub_ps(a, b); }
static ATTN_INLINE __m512 vdiv_f32(__m512 a, __m512 b) { return _mm512_div_ps(a, b); }
static ATTN_INLINE __m512 vmax_f32(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }
/* |a| with the sign of b: the sign bit from b, the rest from a (vpternlogd; AVX-512F
 * has no floating-point and/or) */
static ATTN_INLINE __m512 vcopysign_f32(__m512 a, __m512 b)
{
    return _mm512_castsi512_ps(_mm512_ternarylogic_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b),
                                                         _mm512_set1_epi32(0x7fffffff), 0xe4));
}
static ATTN_INLINE __m512 vround_f32(__m512 x)
{
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static ATTN_INLINE __m512 vpow2i_f32(__m512 n)
{
    __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}
static ATTN_INLINE float vhsum_f32(__m512 x) { return _mm512_reduce_add_ps(x); }

/* dst[j * ldd + i] = src[i * lds + j] for i, j < 16: a 16 x 16 transpose in
 * registers, for packing Kt panels (TRANSPOSE_T of attn_kernels.h). Four
 * rounds; round h exchanges, in each pair of rows i and i + h (bit h of i
 * clear), the elements whose column has bit h set with the partner's elements
 * h columns to the left: the block swaps of a recursive transpose, one
 * vpermt2ps per row and round. */
#define ATTN_T_ROUND(h, lo, hi)                                            \
    for (int i = 0; i < 16; i++) {                                         \
        if (i & (h))                                                       \
            continue;                                                      \
        __m512 a = r[i], b = r[i + (h)];                                   \
        r[i] = _mm512_permutex2var_ps(a, lo, b);                           \
        r[i + (h)] = _mm512_permutex2var_ps(a, hi, b);                     \
    }
/* The transpose of the 16 rows r in place. */
static ATTN_INLINE void vtranspose_regs(__m512 r[16])
{
    /* per round h, lo: row i keeps columns without bit h, takes the partner's
     * (16 + j - h) where j has it; hi: row i + h takes row i's j + h where j
     * lacks bit h, keeps its own (16 + j) where j has it */
    const __m512i lo8 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    const __m512i hi8 = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const __m512i lo4 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    const __m512i hi4 = _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    const __m512i lo2 = _mm512_setr_epi32(0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
    const __m512i hi2 = _mm512_setr_epi32(2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    const __m512i lo1 = _mm512_setr_epi32(0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
    const __m512i hi1 = _mm512_setr_epi32(1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
#pragma GCC unroll 16
    ATTN_T_ROUND(8, lo8, hi8)
#pragma GCC unroll 16
    ATTN_T_ROUND(4, lo4, hi4)
#pragma GCC unroll 16
    ATTN_T_ROUND(2, lo2, hi2)
#pragma GCC unroll 16
    ATTN_T_ROUND(1, lo1, hi1)
}

static ATTN_INLINE void vtranspose_f32(const float *src, int64_t lds, float *dst, int64_t ldd)
{
    __m512 r[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++)
        r[i] = _mm512_loadu_ps(src + i * lds);
    vtranspose_regs(r);
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++)
        _mm512_storeu_ps(dst + j * ldd, r[j]);
}

/* The same transpose of the rows times c (each element multiplied once, as it is
 * loaded): the backward's scaled Qt panels (TRANSPOSE_T_SCALED of attn_kernels.h). */
static ATTN_INLINE void vtranspose_scaled_f32(const float *src, int64_t lds, float *dst, int64_t ldd, float c)
{
    __m512 r[16];
    const __m512 vc = _mm512_set1_ps(c);
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++)
        r[i] = _mm512_mul_ps(_mm512_loadu_ps(src + i * lds), vc);
    vtranspose_regs(r);
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++)
        _mm512_storeu_ps(dst + j * ldd, r[j]);
}

/* The same transpose from bfloat16 (kind 0) or float16 (kind 1) rows, widened to
 * float32 in registers as they are loaded (exact): the decode path packs half K
 * panels with it, with no widened copy of the rows in memory. */
static ATTN_INLINE void vtranspose_half(int kind, const uint16_t *src, int64_t lds, float *dst, int64_t ldd)
{
    __m512 r[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(src + i * lds));
        r[i] = kind ? _mm512_cvtph_ps(h) : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    vtranspose_regs(r);
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++)
        _mm512_storeu_ps(dst + j * ldd, r[j]);
}
#define vtranspose_bf16(src, lds, dst, ldd) vtranspose_half(0, src, lds, dst, ldd)
#define vtranspose_f16(src, lds, dst, ldd) vtranspose_half(1, src, lds, dst, ldd)
#undef ATTN_T_ROUND

static ATTN_INLINE float vhmax_f32(__m512 x) { return _mm512_reduce_max_ps(x); }

static ATTN_INLINE __m512d vload_f64(const double *p) { return _mm512_load_pd(p); }
static ATTN_INLINE __m512d vloadu_f64(const double *p) { return _mm512_loadu_pd(p); }
static ATTN_INLINE void vstore_f64(double *p, __m512d x) { _mm512_store_pd(p, x); }
static ATTN_INLINE void vstoreu_f64(double *p, __m512d x) { _mm512_storeu_pd(p, x); }
static ATTN_INLINE __m512d vset1_f64(double x) { return _mm512_set1_pd(x); }
static ATTN_INLINE __m512d vzero_f64(void) { return _mm512_setzero_pd(); }
static ATTN_INLINE __m512d vfma_f64(__m512d a, __m512d b, __m512d c) { return _mm512_fmadd_pd(a, b, c); }
static ATTN_INLINE __m512d vmul_f64(__m512d a, __m512d b) { return _mm512_mul_pd(a, b); }
static ATTN_INLINE __m512d vadd_f64(__m512d a, __m512d b) { return _mm512_add_pd(a, b); }
static ATTN_INLINE __m512d vsub_f64(__m512d a, __m512d b) { return _mm512_sub_pd(a, b); }
static ATTN_INLINE __m512d vdiv_f64(__m512d a, __m512d b) { return _mm512_div_pd(a, b); }
static ATTN_INLINE __m512d vmax_f64(__m512d a, __m512d b) { return _mm512_max_pd(a, b); }
static ATTN_INLINE __m512d vcopysign_f64(__m512d a, __m512d b)
{
    return _mm512_castsi512_pd(_mm512_ternarylogic_epi64(_mm512_castpd_si512(a), _mm512_castpd_si512(b),
                                                         _mm512_set1_epi64(0x7fffffffffffffff), 0xe4));
}
static ATTN_INLINE __m512d vround_f64(__m512d x)
{
    return _mm512_roundscale_pd(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* see attn_avx2.c: 1.5 * 2^52 puts n in the low mantissa bits */
static ATTN_INLINE __m512d vpow2i_f64(__m512d n)
{
    __m512i bits = _mm512_castpd_si512(_mm512_add_pd(n, _mm512_set1_pd(0x1.8p52 + 1023.0)));
    return _mm512_castsi512_pd(_mm512_slli_epi64(bits, 52));
}
static ATTN_INLINE double vhsum_f64(__m512d x) { return _mm512_reduce_add_pd(x); }
static ATTN_INLINE double vhmax_f64(__m512d x) { return _mm512_reduce_max_pd(x); }

/* 2^x for x <= 0: the polynomial of attn_common.h for 2^f, f = x - round(x), times
 * 2^round(x) by vscalefps instead of exponent bits built and multiplied (four
 * instructions fewer); x <= -126 (masked scores are -inf; the results would be
 * subnormal, which the FMAs after would slow on) gives exactly 0. */
static ATTN_INLINE __m512 vexp2_avx512_f32(__m512 x)
{
    __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.0f), _CMP_GT_OQ);
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps((float)attn_exp2_f32[ATTN_EXP2_DEGREE_f32]);
    for (int i = ATTN_EXP2_DEGREE_f32 - 1; i >= 0; i--)
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps((float)attn_exp2_f32[i]));
    return _mm512_maskz_scalef_ps(live, p, n);
}
#define VEXP2_F32 vexp2_avx512_f32

/* The decode path's products from the cache's own rows (attn_decode.h), for float32
 * (DECODE_KIND below) and the half kinds (attn_half.h, under ATTN_DECODE_DIRECT). */
#define DEC_VW 16
typedef __m512 dec_vt;
static ATTN_INLINE __m512 dec_zero(void) { return _mm512_setzero_ps(); }
static ATTN_INLINE __m512 dec_loadu(const float *p) { return _mm512_loadu_ps(p); }
static ATTN_INLINE void dec_storeu(float *p, __m512 x) { _mm512_storeu_ps(p, x); }
static ATTN_INLINE __m512 dec_set1(float x) { return _mm512_set1_ps(x); }
static ATTN_INLINE __m512 dec_fma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
static ATTN_INLINE __m512 dec_mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
/* 32 halves of one 64-byte load (dec_raw) widened to float32 in registers: dec_lo the
 * even elements, dec_hi the odd (bfloat16: x << 16 and x & 0xffff0000; float16: vpmovdw,
 * then vcvtph2ps). Values, not pointers, so that the vectors stay in registers. */
typedef __m512i dec_raw;
static ATTN_INLINE __m512i dec_raw_load(const uint16_t *p) { return _mm512_loadu_si512(p); }
static ATTN_INLINE __m512 dec_lo(int kind, __m512i x)
{
    return kind == 0 ? _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)) : _mm512_cvtph_ps(_mm512_cvtepi32_epi16(x));
}
static ATTN_INLINE __m512 dec_hi(int kind, __m512i x)
{
    return kind == 0 ? _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)))
                     : _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(x, 16)));
}
/* The lane sums of a[0:16), 45 shuffles and adds: the sum of a[s] lands in lane
 * 4 (s % 4) + s / 4, so slot s takes key DEC_KEY(s) = s / 4 + 4 (s % 4). */
#define DEC_KEY(s) ((s) / 4 + 4 * ((s) % 4))
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
/* n columns kept as 16 even then 16 odd of each 32 (dec_lo, dec_hi), back in order. */
static ATTN_INLINE void dec_in_order(int kind, float *o, int64_t n)
{
    (void)kind;
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int64_t i = 0; i < n; i += 32) {
        __m512 ev = _mm512_loadu_ps(o + i), od = _mm512_loadu_ps(o + i + 16);
        _mm512_storeu_ps(o + i, _mm512_permutex2var_ps(ev, lo, od));
        _mm512_storeu_ps(o + i + 16, _mm512_permutex2var_ps(ev, hi, od));
    }
}
#ifdef __AVX512BF16__ /* the avx512bf16 and amx units: bfloat16 q.k on pairs, as stored */
#define DEC_DOT_BF16(acc, q, k) \
    _mm512_dpbf16_ps((acc), (__m512bh)_mm512_loadu_si512(q), (__m512bh)_mm512_loadu_si512(k))
#define DEC_DOT_BF16_BCAST(acc, w, b) _mm512_dpbf16_ps((acc), (__m512bh)_mm512_set1_epi32((int)(w)), (__m512bh)(b))
/* 16 x 16 32-bit words (the float transpose moves bits only) */
#define DEC_TRANSPOSE16(src, lds, dst) vtranspose_f32((const float *)(src), (lds), (float *)(dst), 16)
#endif
#define DEC_PV_WIDE 2, 8 /* P V tiles (rows, vectors): 16 accumulators of the 32 registers */
#define DEC_PV_WIDE_NV 8
#define DEC_PV_MID 4, 4
#define DEC_PV_MID_NV 4
#define DEC_PV_MANY 8, 2
#include "attn_decode.h"
#define ATTN_DECODE_DIRECT

#define T float
#define DT f32
#define DECODE_KIND DEC_F32
#define VT __m512
#define VW 16
#define TRANSPOSE_T vtranspose_f32
#define TRANSPOSE_T_SCALED vtranspose_scaled_f32
#define VEXP2_T VEXP2_F32
#ifdef ATTN_DOT_BF16 /* attn_avx512bf16.c: flash_backward_dot too */
#include "attn_bf16dot.h"
#define ATTN_BWD_DOT
#endif
#include "attn_kernels.h"

#define T double
#define DT f64
#define VT __m512d
#define VW 8
#include "attn_kernels.h"

/* float16 through F16C (vcvtph2ps / vcvtps2ph, rounding to nearest even); the
 * float32 transpose packs the half path's widened K rows (attn_kernels.h's decode) */
#define TRANSPOSE_F32 vtranspose_f32
#define TRANSPOSE_BF16 vtranspose_bf16
#define TRANSPOSE_F16 vtranspose_f16
#define VT_F32 __m512
#define VW_F32 16
#define F16_LOAD(x) _cvtsh_ss(x)
#define F16_STORE(x) ((uint16_t)_cvtss_sh((x), _MM_FROUND_TO_NEAREST_INT))
#include "attn_half.h"
