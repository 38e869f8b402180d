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
static ATTN_INLINE __m512 vmax_f32(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }
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
static ATTN_INLINE __m512d vmax_f64(__m512d a, __m512d b) { return _mm512_max_pd(a, b); }
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

#define T float
#define DT f32
#define VT __m512
#define VW 16
#include "attn_kernels.h"

#define T double
#define DT f64
#define VT __m512d
#define VW 8
#include "attn_kernels.h"

/* float16 through F16C (vcvtph2ps / vcvtps2ph, rounding to nearest even) */
#define VT_F32 __m512
#define VW_F32 16
#define F16_LOAD(x) _cvtsh_ss(x)
#define F16_STORE(x) ((uint16_t)_cvtss_sh((x), _MM_FROUND_TO_NEAREST_INT))
#include "attn_half.h"
