/* AVX2 + FMA: 256-bit vectors, 6 x 16 (float) register tiles: 12 accumulators,
 * two B vectors and one broadcast fit the 16 ymm registers. */
#include <immintrin.h>

#include "attn_common.h"

#define ISA avx2
#define MR 6

static ATTN_INLINE __m256 vload_f32(const float *p) { return _mm256_load_ps(p); }
static ATTN_INLINE __m256 vloadu_f32(const float *p) { return _mm256_loadu_ps(p); }
static ATTN_INLINE void vstoreu_f32(float *p, __m256 x) { _mm256_storeu_ps(p, x); }
static ATTN_INLINE void vstore_f32(float *p, __m256 x) { _mm256_store_ps(p, x); }
static ATTN_INLINE __m256 vset1_f32(float x) { return _mm256_set1_ps(x); }
static ATTN_INLINE __m256 vzero_f32(void) { return _mm256_setzero_ps(); }
static ATTN_INLINE __m256 vfma_f32(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
static ATTN_INLINE __m256 vmul_f32(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
static ATTN_INLINE __m256 vadd_f32(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
static ATTN_INLINE __m256 vsub_f32(__m256 a, __m256 b) { return _mm256_sub_ps(a, b); }
static ATTN_INLINE __m256 vdiv_f32(__m256 a, __m256 b) { return _mm256_div_ps(a, b); }
static ATTN_INLINE __m256 vmax_f32(__m256 a, __m256 b) { return _mm256_max_ps(a, b); }
/* |a| with the sign of b */
static ATTN_INLINE __m256 vcopysign_f32(__m256 a, __m256 b)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    return _mm256_or_ps(_mm256_andnot_ps(sign, a), _mm256_and_ps(sign, b));
}
static ATTN_INLINE __m256 vround_f32(__m256 x)
{
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* 2^n for integral n in [-127, 0]: n + 127 in the exponent field (0 for -127). */
static ATTN_INLINE __m256 vpow2i_f32(__m256 n)
{
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
static ATTN_INLINE float vhsum_f32(__m256 x)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static ATTN_INLINE float vhmax_f32(__m256 x)
{
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static ATTN_INLINE __m256d vload_f64(const double *p) { return _mm256_load_pd(p); }
static ATTN_INLINE __m256d vloadu_f64(const double *p) { return _mm256_loadu_pd(p); }
static ATTN_INLINE void vstoreu_f64(double *p, __m256d x) { _mm256_storeu_pd(p, x); }
static ATTN_INLINE void vstore_f64(double *p, __m256d x) { _mm256_store_pd(p, x); }
static ATTN_INLINE __m256d vset1_f64(double x) { return _mm256_set1_pd(x); }
static ATTN_INLINE __m256d vzero_f64(void) { return _mm256_setzero_pd(); }
static ATTN_INLINE __m256d vfma_f64(__m256d a, __m256d b, __m256d c) { return _mm256_fmadd_pd(a, b, c); }
static ATTN_INLINE __m256d vmul_f64(__m256d a, __m256d b) { return _mm256_mul_pd(a, b); }
static ATTN_INLINE __m256d vadd_f64(__m256d a, __m256d b) { return _mm256_add_pd(a, b); }
static ATTN_INLINE __m256d vsub_f64(__m256d a, __m256d b) { return _mm256_sub_pd(a, b); }
static ATTN_INLINE __m256d vdiv_f64(__m256d a, __m256d b) { return _mm256_div_pd(a, b); }
static ATTN_INLINE __m256d vmax_f64(__m256d a, __m256d b) { return _mm256_max_pd(a, b); }
static ATTN_INLINE __m256d vcopysign_f64(__m256d a, __m256d b)
{
    const __m256d sign = _mm256_set1_pd(-0.0);
    return _mm256_or_pd(_mm256_andnot_pd(sign, a), _mm256_and_pd(sign, b));
}
static ATTN_INLINE __m256d vround_f64(__m256d x)
{
    return _mm256_round_pd(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
/* 2^n for integral n in [-1023, 0]: adding 1.5 * 2^52 puts n in the low
 * mantissa bits; n + 1023 shifted into the exponent field is 2^n. */
static ATTN_INLINE __m256d vpow2i_f64(__m256d n)
{
    __m256i bits = _mm256_castpd_si256(_mm256_add_pd(n, _mm256_set1_pd(0x1.8p52 + 1023.0)));
    return _mm256_castsi256_pd(_mm256_slli_epi64(bits, 52));
}
static ATTN_INLINE double vhsum_f64(__m256d x)
{
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(x), _mm256_extractf128_pd(x, 1));
    return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}
static ATTN_INLINE double vhmax_f64(__m256d x)
{
    __m128d s = _mm_max_pd(_mm256_castpd256_pd128(x), _mm256_extractf128_pd(x, 1));
    return _mm_cvtsd_f64(_mm_max_sd(s, _mm_unpackhi_pd(s, s)));
}

/* The decode path's products from the cache's own rows (attn_decode.h), for float32
 * (DECODE_KIND below) and the half kinds (attn_half.h, under ATTN_DECODE_DIRECT). */
#define DEC_VW 8
typedef __m256 dec_vt;
static ATTN_INLINE __m256 dec_zero(void) { return _mm256_setzero_ps(); }
static ATTN_INLINE __m256 dec_loadu(const float *p) { return _mm256_loadu_ps(p); }
static ATTN_INLINE void dec_storeu(float *p, __m256 x) { _mm256_storeu_ps(p, x); }
static ATTN_INLINE __m256 dec_set1(float x) { return _mm256_set1_ps(x); }
static ATTN_INLINE __m256 dec_fma(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
static ATTN_INLINE __m256 dec_mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
/* 16 halves of one 32-byte load (dec_raw) widened to float32 in registers, in order:
 * dec_lo elements 0-7, dec_hi 8-15 (bfloat16: vpmovzxwd, then a 16-bit shift; float16:
 * vcvtph2ps). */
typedef __m256i dec_raw;
static ATTN_INLINE __m256i dec_raw_load(const uint16_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static ATTN_INLINE __m256 dec_lo(int kind, __m256i x)
{
    __m128i h = _mm256_castsi256_si128(x);
    return kind == 0 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
}
static ATTN_INLINE __m256 dec_hi(int kind, __m256i x)
{
    __m128i h = _mm256_extracti128_si256(x, 1);
    return kind == 0 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
}
/* The lane sums of a[0:8) in order (three rounds of horizontal adds, then the halves). */
#define DEC_KEY(s) (s)
static ATTN_INLINE __m256 dec_lane_sums(__m256 a[8])
{
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
/* dec_lo and dec_hi keep the columns in order: nothing to do */
static ATTN_INLINE void dec_in_order(int kind, float *o, int64_t n) { (void)kind; (void)o; (void)n; }
#define DEC_PV_WIDE 2, 4 /* P V tiles (rows, vectors) within the 16 registers */
#define DEC_PV_WIDE_NV 4
#define DEC_PV_MID 4, 2
#define DEC_PV_MID_NV 2
#define DEC_PV_MANY 6, 2
#include "attn_decode.h"
#define ATTN_DECODE_DIRECT

#define T float
#define DT f32
#define VT __m256
#define VW 8
#define DECODE_KIND DEC_F32
#include "attn_kernels.h"

#define T double
#define DT f64
#define VT __m256d
#define VW 4
#include "attn_kernels.h"

/* float16 through F16C (vcvtph2ps / vcvtps2ph, rounding to nearest even) */
#define VT_F32 __m256
#define VW_F32 8
#define F16_LOAD(x) _cvtsh_ss(x)
#define F16_STORE(x) ((uint16_t)_cvtss_sh((x), _MM_FROUND_TO_NEAREST_INT))
#include "attn_half.h"
