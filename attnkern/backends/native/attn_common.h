/* Shared by every ISA translation unit, before attn_kernels.h. */
#ifndef ATTNKERN_ATTN_COMMON_H
#define ATTNKERN_ATTN_COMMON_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attn.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* The team size of the last kernel run from this thread (attn_last_team): the dispatch
 * sets it to 1 before a kernel, and thread 0 of each of the kernel's parallel regions
 * (the calling thread) writes its team's size, as the OpenMP runtime gave it. */
extern _Thread_local int attn_team_size;
/* The key chunks of the last forward's decode path from this thread (attn_last_split):
 * the dispatch sets it to 0 before a kernel, the decode path to its chunk count. */
extern _Thread_local int attn_split_chunks;
#ifdef _OPENMP
#define ATTN_NOTE_TEAM()                                 \
    do {                                                 \
        if (omp_get_thread_num() == 0)                   \
            attn_team_size = omp_get_num_threads();      \
    } while (0)
#else
#define ATTN_NOTE_TEAM() ((void)0)
#endif

#define ATTN_INLINE inline __attribute__((always_inline))
#define ATTN_LOG2E 1.4426950408889634
#define ATTN_LN2 0.6931471805599453
#define ATTN_ALIGN 64

/* Polynomials for 2^f, |f| <= 1/2, lowest degree first.
 * float32: degree 5 with the constant term exactly 1, so that 2^0 is 1 (a row's largest
 * score gets probability 1, as in exact arithmetic: a constant of 1 + 7.5e-8, which float32
 * rounds to 1 + 2^-23, made p v overflow for v near float32's largest value and put 1.2e-7
 * in the lse of a lone key); the other coefficients fitted for the least largest relative
 * error, 1.7e-7 evaluated in float32 FMAs over |f| <= 1/2 (the unconstrained degree-5
 * Chebyshev interpolant before it: 2.2e-7; dev/exp2_fit.py fits and measures both).
 * float64: Taylor series (ln 2)^k / k! to degree 13, truncation error 2e-16. */
static const double attn_exp2_f32[6] = {
    1.0, 0.6931469776433113, 0.2402224213749696,
    0.0555073371388895, 0.009671509212427367, 0.0013264722783000956,
};
static const double attn_exp2_f64[14] = {
    1.0, 0.6931471805599453, 0.2402265069591007, 0.055504108664821576,
    0.009618129107628477, 0.0013333558146428441, 0.00015403530393381606,
    1.5252733804059838e-05, 1.3215486790144305e-06, 1.0178086009239696e-07,
    7.054911620801121e-09, 4.44553827187081e-10, 2.5678435993488196e-11,
    1.3691488853904124e-12,
};
/* By dtype tag (attn_kernels.h picks them with DT): the degree of each polynomial,
 * and the exponent whose 2^n has all exponent bits zero (2^x there is exactly 0). */
#define ATTN_EXP2_DEGREE_f32 5
#define ATTN_EXP2_DEGREE_f64 13
#define ATTN_EXP2_LO_f32 (-127)
#define ATTN_EXP2_LO_f64 (-1023)

/* The keys each query row of one batch entry sees (attn_problem's mask): row i
 * sees keys j with i + lo <= j <= i + hi and j < len. An unbounded side is
 * ATTN_SPAN_FAR (2^61) away, farther than any key from any row, yet small enough
 * that sums of it with row and key indices (below 2^60: attn_check_problem bounds
 * nq and nk) cannot overflow. The plain problem's span: lo = -ATTN_SPAN_FAR and
 * hi = ATTN_SPAN_FAR, or hi = 0 with causal; len = nk. */
#define ATTN_SPAN_FAR ((int64_t)1 << 61)
typedef struct {
    int64_t lo, hi, len;
} attn_span;

static inline int64_t attn_window_side(int64_t w)
{
    return w == ATTN_UNBOUNDED || w > ATTN_SPAN_FAR ? ATTN_SPAN_FAR : w;
}

/* 1 if p uses a feature beyond the plain problem (attn_has_features). */
static inline int attn_features_on(const attn_problem *p)
{
    return p->kv_group != 1 || p->align != ATTN_ALIGN_TOP_LEFT || p->window_left != ATTN_UNBOUNDED ||
           p->window_right != ATTN_UNBOUNDED || p->seqlen_k != NULL || p->softcap != 0 || p->mask != NULL ||
           p->dropout_p != 0 || p->cu_seqlens_q != NULL || p->alibi != NULL;
}


/* Decode (flash-decoding on the CPU): a problem with few query rows per k/v row
 * (kv_group * nq <= ATTN_DECODE_MAX_ROWS, nq <= ATTN_DECODE_MAX_NQ) against a long
 * cache runs one work item per (k/v row, key chunk): the k/v row's whole query group
 * as one block over a chunk of keys, then a log-sum-exp combine of the chunks in key
 * order. The chunk size depends only on the shape (never on the thread count), so
 * the result is the same for every thread count: a multiple of ATTN_DECODE_CHUNK
 * keys, large enough that the call has at most about ATTN_DECODE_ITEMS items (that
 * bounds the partial results' memory). Dropout and varlen keep the ordinary path.
 * A short cache (under 2 ATTN_DECODE_CHUNK keys: one or two chunks) takes it too,
 * where it has more keys than queries (or one query) and at most half
 * ATTN_DECODE_MAX_ROWS rows per k/v row: there the ordinary path's query panels are mostly empty lanes (one
 * query over 1000 keys of a 32-over-8 GQA model ran 8x slower), but it is faster
 * than key-major blocks for many rows over a few keys.
 * Returns the chunk size, or 0 where the ordinary path runs. */
#define ATTN_DECODE_CHUNK 512
#define ATTN_DECODE_ITEMS 256
#define ATTN_DECODE_MAX_NQ 16
#define ATTN_DECODE_MAX_ROWS 128
static inline int64_t attn_decode_chunk(const attn_problem *p)
{
    if (p->cu_seqlens_q || p->dropout_p != 0 || p->nq > ATTN_DECODE_MAX_NQ ||
        p->kv_group * p->nq > ATTN_DECODE_MAX_ROWS || p->nk < 1)
        return 0;
    if (p->nk < 2 * ATTN_DECODE_CHUNK &&
        ((p->nq > 1 && p->nk <= p->nq) || 2 * p->kv_group * p->nq > ATTN_DECODE_MAX_ROWS))
        return 0;
    int64_t batch_kv = p->batch / p->kv_group;
    int64_t per_row = ATTN_DECODE_ITEMS / batch_kv > 1 ? ATTN_DECODE_ITEMS / batch_kv : 1;
    int64_t chunk = (p->nk + per_row - 1) / per_row;
    chunk = (chunk + ATTN_DECODE_CHUNK - 1) / ATTN_DECODE_CHUNK * ATTN_DECODE_CHUNK;
    return chunk;
}

/* The attention mask's offset of folded row b (attn_problem's mask). */
static inline int64_t attn_mask_base(const attn_problem *p, int64_t b)
{
    return (b / p->mask_heads) * p->mask_stride[0] + (b % p->mask_heads) * p->mask_stride[1];
}

/* The mask's element at off in the log2 domain of the scores (times log2(e)): 0 or
 * -inf for a bool mask. */
static inline double attn_mask_log2(const attn_problem *p, int64_t off)
{
    switch (p->mask_kind) {
    case ATTN_MASK_BOOL:
        return ((const uint8_t *)p->mask)[off] ? 0.0 : -INFINITY;
    case ATTN_MASK_F32:
        return (double)((const float *)p->mask)[off] * ATTN_LOG2E;
    default:
        return ((const double *)p->mask)[off] * ATTN_LOG2E;
    }
}

/* Philox4x32-10 (Random123): the four words of counter c under key (k0, k1). */
static inline void attn_philox(uint32_t c[4], uint32_t k0, uint32_t k1)
{
    for (int r = 0; r < 10; r++) {
        if (r) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        uint64_t p0 = (uint64_t)0xD2511F53u * c[0], p1 = (uint64_t)0xCD9E8D57u * c[2];
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c[1] ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c[3] ^ k1;
        c[1] = (uint32_t)p1;
        c[3] = (uint32_t)p0;
        c[0] = n0;
        c[2] = n2;
    }
}

/* Dropout's keep decisions of row b, query i and keys [j, j + n) (attn_problem's
 * rule; offsets already added): keep[t] = 1 or 0. One Philox call per 4 keys. */
static inline void attn_dropout_keep(const attn_problem *p, int64_t b, int64_t i, int64_t j, int64_t n,
                                     uint8_t *keep)
{
    const uint64_t thresh = (uint64_t)nearbyint(p->dropout_p * 4294967296.0);
    const uint32_t k0 = (uint32_t)p->dropout_seed, k1 = (uint32_t)(p->dropout_seed >> 32);
    uint32_t c[4];
    for (int64_t t = 0; t < n; t++) {
        int64_t jj = j + t;
        if (t == 0 || (jj & 3) == 0) {
            c[0] = (uint32_t)(jj >> 2);
            c[1] = (uint32_t)i;
            c[2] = (uint32_t)b;
            c[3] = 0;
            attn_philox(c, k0, k1);
        }
        keep[t] = (uint64_t)c[jj & 3] >= thresh;
    }
}

/* The span of batch entry (query row) bh. */
static inline attn_span attn_span_of(const attn_problem *p, int64_t bh)
{
    attn_span s;
    s.len = p->seqlen_k ? p->seqlen_k[bh / p->heads] : p->nk;
    int64_t off = p->align == ATTN_ALIGN_BOTTOM_RIGHT ? s.len - p->nq : 0;
    s.lo = off - attn_window_side(p->window_left);
    s.hi = off + (p->causal ? 0 : attn_window_side(p->window_right));
    return s;
}

/* x clamped to [0, n]. */
static inline int64_t attn_clamp(int64_t x, int64_t n) { return x < 0 ? 0 : (x > n ? n : x); }

/* Cache-line aligned buffer of rows x cols elements of elem bytes; size 0
 * still gives a valid pointer. Every size product is checked: a request whose
 * size does not fit size_t (or whose factors are negative) returns NULL, which
 * the kernels report as ATTN_ENOMEM, never a short buffer. */
static inline void *attn_alloc(int64_t rows, int64_t cols, size_t elem)
{
    size_t n, size;
    if (rows < 0 || cols < 0 || __builtin_mul_overflow((size_t)rows, (size_t)cols, &n) ||
        __builtin_mul_overflow(n, elem, &size) || size > SIZE_MAX - ATTN_ALIGN)
        return NULL;
    size = (size + ATTN_ALIGN - 1) / ATTN_ALIGN * ATTN_ALIGN;
    return aligned_alloc(ATTN_ALIGN, size ? size : ATTN_ALIGN);
}

static inline void attn_free(void *p) { free(p); }

/* Varlen (attn_problem's cu_seqlens): sequence s as a problem of its own, its arrays at
 * the element offsets *qo (q, out: times d or dv), *ko (k, v) of the caller's. */
static inline attn_problem attn_varlen_sub(const attn_problem *p, int64_t s, int64_t *qo, int64_t *ko)
{
    attn_problem sp = *p;
    const int64_t q0 = p->cu_seqlens_q[s], k0 = p->cu_seqlens_k[s];
    sp.nq = p->cu_seqlens_q[s + 1] - q0;
    sp.nk = p->cu_seqlens_k[s + 1] - k0;
    sp.dropout_i0 += q0;
    sp.dropout_j0 += k0;
    sp.cu_seqlens_q = sp.cu_seqlens_k = NULL;
    sp.nseq = 0;
    if (sp.alibi)
        sp.alibi += s * p->alibi_seq_stride;
    *qo = q0 * p->batch;
    *ko = k0 * (p->batch / p->kv_group);
    return sp;
}

/* Varlen work items: prefix[s] is the first of sequence s, each sequence having rows *
 * ceil(len / block) of them (len of its queries, or with keys of its keys); prefix has
 * nseq + 1 entries (the last: their number). NULL when out of memory. */
static inline int64_t *attn_varlen_items(const attn_problem *p, int64_t rows, int64_t block, int keys)
{
    const int64_t *cu = keys ? p->cu_seqlens_k : p->cu_seqlens_q;
    int64_t *prefix = attn_alloc(p->nseq + 1, 1, sizeof(int64_t));
    if (!prefix)
        return NULL;
    prefix[0] = 0;
    for (int64_t s = 0; s < p->nseq; s++)
        prefix[s + 1] = prefix[s] + rows * ((cu[s + 1] - cu[s] + block - 1) / block);
    return prefix;
}

/* The sequence of work item t (prefix from attn_varlen_items): the last s with
 * prefix[s] <= t, by bisection. */
static inline int64_t attn_varlen_seq(const int64_t *prefix, int64_t nseq, int64_t t)
{
    int64_t lo = 0, hi = nseq - 1;
    while (lo < hi) {
        int64_t mid = (lo + hi + 1) / 2;
        if (prefix[mid] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* bfloat16 and float16 (IEEE binary16) bits to and from float32, portable C: widening is
 * exact; narrowing rounds to nearest, ties to even (float16: overflow to infinity,
 * subnormals kept), NaN stays a quiet NaN. The AVX2/AVX-512 units use F16C instead
 * for float16, which rounds the same way. */
static inline float attn_bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t attn_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)  /* NaN: keep it quiet, never round it to infinity */
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float attn_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (mant << 13);
    } else if (exp == 0) {  /* zero or subnormal: mant * 2^-24, exact in float32 */
        float f = (float)mant * 0x1p-24f;
        return sign ? -f : f;
    } else {
        u = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t attn_f32_to_f16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t sign = (u >> 16) & 0x8000u, o;
    u &= 0x7fffffffu;
    if (u >= 0x47800000u) {  /* |f| >= 65536, infinity or NaN */
        o = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
    } else if (u < 0x38800000u) {  /* below 2^-14: a subnormal or zero float16 */
        /* adding 0.5 aligns the float16 subnormal's bits at the bottom of the
         * mantissa; the float32 addition rounds them to nearest even */
        float a, magic = 0.5f;
        uint32_t mu;
        memcpy(&a, &u, sizeof a);
        a += magic;
        memcpy(&o, &a, sizeof o);
        memcpy(&mu, &magic, sizeof mu);
        o -= mu;
    } else {  /* rebias the exponent, round the 13 dropped bits to nearest even */
        u += ((uint32_t)(15 - 127) << 23) + 0xfffu + ((u >> 13) & 1u);
        o = u >> 13;  /* a carry past 65504 gives 0x7c00, infinity */
    }
    return (uint16_t)(o | sign);
}

#define ATTN_DECLARE_DT(isa, dt, T)                                                             \
    int attn_naive_##dt##_##isa(const attn_problem *, const T *, const T *, const T *, T *, T *); \
    int attn_tiled_##dt##_##isa(const attn_problem *, const T *, const T *, const T *, T *, T *); \
    int attn_flash_##dt##_##isa(const attn_problem *, const T *, const T *, const T *, T *, T *); \
    int attn_flash_backward_##dt##_##isa(const attn_problem *, const T *, const T *, const T *,   \
                                         const T *, const T *, const T *, T *, T *, T *); \
    double attn_fma_peak_##dt##_##isa(int64_t, int);
#define ATTN_DECLARE_HALF(isa, dt)                                                                     \
    int attn_tiled_##dt##_##isa(const attn_problem *, const uint16_t *, const uint16_t *, const uint16_t *, \
                                uint16_t *, uint16_t *);                                                 \
    int attn_flash_##dt##_##isa(const attn_problem *, const uint16_t *, const uint16_t *, const uint16_t *, \
                                uint16_t *, uint16_t *);
#define ATTN_DECLARE_ISA(isa) ATTN_DECLARE_DT(isa, f32, float) ATTN_DECLARE_DT(isa, f64, double) \
    ATTN_DECLARE_HALF(isa, bf16) ATTN_DECLARE_HALF(isa, f16)

ATTN_DECLARE_ISA(generic)
ATTN_DECLARE_ISA(avx2)
ATTN_DECLARE_ISA(avx512)
ATTN_DECLARE_ISA(avx512bf16)
ATTN_DECLARE_ISA(amx)
/* flash on bfloat16 with vdpbf16ps dot products (attn_avx512bf16.c) */
int attn_flash_bf16dot_avx512bf16(const attn_problem *, const uint16_t *, const uint16_t *, const uint16_t *,
                                  uint16_t *, uint16_t *);
int attn_flash_bf16dot_lse_avx512bf16(const attn_problem *, const uint16_t *, const uint16_t *, float *);
/* flash on bfloat16 with AMX tiles (attn_amx.c) */
int attn_flash_bf16amx_amx(const attn_problem *, const uint16_t *, const uint16_t *, const uint16_t *,
                           uint16_t *, uint16_t *);
/* the float32 backward with bfloat16 products, for float32 arrays of bfloat16 values
 * (attn_kernels.h under ATTN_BWD_DOT, attn_bf16dot.h) */
int attn_flash_backward_dot_f32_avx512bf16(const attn_problem *, const float *, const float *, const float *,
                                           const float *, const float *, const float *, float *, float *,
                                           float *);
/* element conversions of each unit, for the tests: out[i] = narrow(in[i]), back[i] = widen(out[i]) */
#define ATTN_DECLARE_CVT(isa) \
    void attn_convert_##isa(int kind, const float *in, int64_t n, uint16_t *out, float *back);
ATTN_DECLARE_CVT(generic)
ATTN_DECLARE_CVT(avx2)
ATTN_DECLARE_CVT(avx512)
ATTN_DECLARE_CVT(avx512bf16)
ATTN_DECLARE_CVT(amx)

#endif
