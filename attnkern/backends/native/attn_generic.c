/* Portable C: a "vector" is a small array of lanes that the compiler may map
 * onto whatever SIMD the baseline target has (SSE2 on x86-64). Same vector width
 * as AVX2, so it is also the check that the vector paths compute the same thing. */
#include "attn_common.h"

#define ISA generic
#define MR 4

#define ATTN_GENERIC_OPS(T, DT, W, UT, BIAS, MANT)                                          \
    typedef struct { T x[W]; } vec_##DT;                                                    \
    static ATTN_INLINE vec_##DT vloadu_##DT(const T *p)                                     \
    {                                                                                       \
        vec_##DT r;                                                                         \
        memcpy(r.x, p, sizeof r.x);                                                         \
        return r;                                                                           \
    }                                                                                       \
    static ATTN_INLINE vec_##DT vload_##DT(const T *p) { return vloadu_##DT(p); }           \
    static ATTN_INLINE void vstoreu_##DT(T *p, vec_##DT a) { memcpy(p, a.x, sizeof a.x); }  \
    static ATTN_INLINE void vstore_##DT(T *p, vec_##DT a) { vstoreu_##DT(p, a); }           \
    static ATTN_INLINE vec_##DT vset1_##DT(T s)                                             \
    {                                                                                       \
        vec_##DT r;                                                                         \
        for (int i = 0; i < W; i++)                                                         \
            r.x[i] = s;                                                                     \
        return r;                                                                           \
    }                                                                                       \
    static ATTN_INLINE vec_##DT vzero_##DT(void) { return vset1_##DT(0); }                  \
    static ATTN_INLINE vec_##DT vfma_##DT(vec_##DT a, vec_##DT b, vec_##DT c)               \
    {                                                                                       \
        for (int i = 0; i < W; i++)                                                         \
            c.x[i] += a.x[i] * b.x[i];                                                      \
        return c;                                                                           \
    }                                                                                       \
    static ATTN_INLINE vec_##DT vmul_##DT(vec_##DT a, vec_##DT b)                           \
    {                                                                                       \
        for (int i = 0; i < W; i++)                                                         \
            a.x[i] *= b.x[i];                                                               \
        return a;                                                                           \
    }                                                                                       \
    static ATTN_INLINE vec_##DT vadd_##DT(vec_##DT a, vec_##DT b)                           \
    {                                                                                       \
        for (int i = 0; i < W; i++)                                                         \
            a.x[i] += b.x[i];                                                               \
        return a;                                                                           \
    }                                                                                       \
    static ATTN_INLINE vec_##DT vsub_##DT(vec_##DT a, vec_##DT b)                           \
    {                                                                                       \
        for (int i = 0; i < W; i++)                                                         \
            a.x[i] -= b.x[i];                                                               \
        return a;                                                                           \
    }                                                                                       \
    static ATTN_INLINE vec_##DT vdiv_##DT(vec_##DT a, vec_##DT b)                           \
    {                                                                                       \
        for (int i = 0; i < W; i++)                                                         \
            a.x[i] /= b.x[i];                                                               \
        return a;                                                                           \
    }                                                                                       \
    static ATTN_INLINE vec_##DT vmax_##DT(vec_##DT a, vec_##DT b)                           \
    {                                                                                       \
        for (int i = 0; i < W; i++)                                                         \
            a.x[i] = b.x[i] > a.x[i] ? b.x[i] : a.x[i];                                     \
        return a;                                                                           \
    }                                                                                       \
    /* |a| with the sign of b */                                                            \
    static ATTN_INLINE vec_##DT vcopysign_##DT(vec_##DT a, vec_##DT b)                      \
    {                                                                                       \
        for (int i = 0; i < W; i++)                                                         \
            a.x[i] = (T)copysign(a.x[i], b.x[i]); /* exact for float, through double */        \
        return a;                                                                           \
    }                                                                                       \
    /* nearest integer, halves away from zero; |x| is clamped so the cast is defined */     \
    static ATTN_INLINE vec_##DT vround_##DT(vec_##DT a)                                     \
    {                                                                                       \
        for (int i = 0; i < W; i++) {                                                       \
            T x = a.x[i] > (T)1048576 ? (T)1048576 : (a.x[i] < (T)-1048576 ? (T)-1048576    \
                                                                          : a.x[i]);        \
            a.x[i] = x >= 0 ? (T)(int64_t)(x + (T)0.5) : -(T)(int64_t)((T)0.5 - x);         \
        }                                                                                   \
        return a;                                                                           \
    }                                                                                       \
    static ATTN_INLINE vec_##DT vpow2i_##DT(vec_##DT n)                                     \
    {                                                                                       \
        for (int i = 0; i < W; i++) {                                                       \
            UT bits = (UT)((int64_t)n.x[i] + BIAS) << MANT;                                 \
            memcpy(&n.x[i], &bits, sizeof bits);                                            \
        }                                                                                   \
        return n;                                                                           \
    }                                                                                       \
    static ATTN_INLINE T vhsum_##DT(vec_##DT a)                                             \
    {                                                                                       \
        for (int w = W / 2; w >= 1; w /= 2)                                                 \
            for (int i = 0; i < w; i++)                                                     \
                a.x[i] += a.x[i + w];                                                       \
        return a.x[0];                                                                      \
    }                                                                                       \
    static ATTN_INLINE T vhmax_##DT(vec_##DT a)                                             \
    {                                                                                       \
        T m = a.x[0];                                                                       \
        for (int i = 1; i < W; i++)                                                         \
            m = a.x[i] > m ? a.x[i] : m;                                                    \
        return m;                                                                           \
    }

ATTN_GENERIC_OPS(float, f32, 8, uint32_t, 127, 23)
ATTN_GENERIC_OPS(double, f64, 4, uint64_t, 1023, 52)

#define T float
#define DT f32
#define VT vec_f32
#define VW 8
#include "attn_kernels.h"

#define T double
#define DT f64
#define VT vec_f64
#define VW 4
#include "attn_kernels.h"

#define VT_F32 vec_f32
#define VW_F32 8
#define F16_LOAD(x) attn_f16_to_f32(x)
#define F16_STORE(x) attn_f32_to_f16(x)
#include "attn_half.h"
