// Definitions shared by the CUDA C++ kernels of cuda.flash (flash_mma.cu, flash_tf32.cu, flash_simt.cu):
// kernels.py compiles each kernel's source with this file prepended (NVRTC gets one
// source string, no include path). Inline PTX: no header is needed.

// each kernel uses some of these helpers (the plain kernels none of the features'): no
// "declared but never referenced" warnings (NVRTC's log becomes a UserWarning in numba-cuda)
#pragma nv_diag_suppress 177

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

static __device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

static __device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}

// cp_async16 with an L2 prefetch-size hint (PTX .L2::64B, .L2::128B, .L2::256B: an L2 miss may
// fetch that many bytes around the 16 asked for): P 0 is cp_async16 itself. The data and its
// arithmetic are the same; only how the L2 fetches from memory changes.
template <int P>
static __device__ __forceinline__ void cp_async16_prefetch(u32 dst, const void* src, int src_bytes) {
    static_assert(P == 0 || P == 64 || P == 128 || P == 256, "an L2 prefetch size of 0, 64, 128 or 256 bytes");
    if (P == 256)
        asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
    else if (P == 128)
        asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
    else if (P == 64)
        asm volatile("cp.async.cg.shared.global.L2::64B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
    else
        cp_async16(dst, src, src_bytes);
}

// cp_async16_prefetch with an L2 cache policy (createpolicy's 64-bit handle) on the copy
template <int P>
static __device__ __forceinline__ void cp_async16_policy(u32 dst, const void* src, int src_bytes, u64 policy) {
    static_assert(P == 0 || P == 64 || P == 128 || P == 256, "an L2 prefetch size of 0, 64, 128 or 256 bytes");
    if (P == 256)
        asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;\n"
                     ::"r"(dst), "l"(src), "r"(src_bytes), "l"(policy));
    else if (P == 128)
        asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::128B [%0], [%1], 16, %2, %3;\n"
                     ::"r"(dst), "l"(src), "r"(src_bytes), "l"(policy));
    else if (P == 64)
        asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::64B [%0], [%1], 16, %2, %3;\n"
                     ::"r"(dst), "l"(src), "r"(src_bytes), "l"(policy));
    else
        asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n"
                     ::"r"(dst), "l"(src), "r"(src_bytes), "l"(policy));
}

static __device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

static __device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

// waits until at most N of this thread's commit groups are in flight
template <int N>
static __device__ __forceinline__ void cp_async_wait_group() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ATTNKERN_FAST 1 compiles the fastmath variant (the fastmath tunable): the per-row
// operations take the hardware's approximations with denormals flushed to zero
// (lg2.approx.ftz, rcp.approx.ftz, __fdividef); with 0 (the default) they are CUDA's
// accurate forms: log2f (within 1 ulp, where lg2.approx has an absolute error of about
// 2^-22 near 1), 1.f / x (rcp.rn, correctly rounded) and x / y (div.rn).
// The per-score 2^x is ex2.approx.ftz.f32 in both variants (within 2 ulp): exp2f, which
// keeps subnormal results, measured 2-5% slower in float32 and 10-16% in float16/bfloat16
// with the same largest output errors (gpu-measuring.md); what it adds are probabilities
// below 2^-126 of the row's largest, which cannot change a row sum that is at least 1.
#ifndef ATTNKERN_FAST
#define ATTNKERN_FAST 0
#endif

static __device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// ATTNKERN_FP8_EXP (flash_wgmma.cu's FP8 variant; 0 elsewhere): k > 0 hands softmax_tile's
// probabilities out times 2^8 (FP8's P scale, flash_wgmma.cu's P_SCALE) by an offset of 8 in the
// exponent rather than a multiply a score; k > 1 also computes those of every k-th 8-key tile with
// exp2_fma, on the FMA and integer pipes, beside the ex2 unit (16 results a clock an SM, which the
// softmax of FP8's twice-as-fast products waits on).
#ifndef ATTNKERN_FP8_EXP
#define ATTNKERN_FP8_EXP 0
#endif
// ATTNKERN_FP8_EXP_H (with ATTNKERN_FP8_EXP 1): the probabilities two at a time by ex2.approx.f16x2
// (one PTX instruction for two results, but ptxas makes it two MUFU.EX2.F16 on sm_90a, one a half,
// and a PRMT: no fewer ex2 unit operations), their arguments s c - m c + 8 formed in float32 and rounded
// to half precision before it (relative error of 2^x: 2^-11 of x's magnitude times ln 2, at most
// 0.5% for x > -32, where 2^x is below 2^-24 of the row's largest and e4m3's 2^-4 rounding of P dominates)
#ifndef ATTNKERN_FP8_EXP_H
#define ATTNKERN_FP8_EXP_H 0
#endif

// (2^x, 2^y) through one ex2.approx.f16x2: x and y rounded to half precision, the results back in float32
static __device__ __forceinline__ void ex2_half2(float x, float y, float& ex, float& ey) {
    unsigned int h, r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(h) : "f"(y), "f"(x));  // x in the low half
    asm("ex2.approx.f16x2 %0, %1;\n" : "=r"(r) : "r"(h));
    asm("{.reg .f16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.f32.f16 %0, lo;\n cvt.f32.f16 %1, hi;\n}\n"
        : "=f"(ex), "=f"(ey) : "r"(r));
}

// 2^x for x <= 0 without the ex2 unit: x clamped to -125 (smaller results are below any e4m3
// probability), x = j + f with j = rint(x) (the 1.5 2^23 shift: t's low mantissa bits are j) and
// f in [-0.5, 0.5], 2^f by a degree-3 polynomial (relative error 7.5e-5, a fit for 1 / 2^f
// weights), 2^j added to its exponent bits (t's bits shifted by 23 are j's, 0x4B400000's drop out)
static __device__ __forceinline__ float exp2_fma(float x) {
    x = fmaxf(x, -125.f);
    const float t = x + 12582912.f, f = x - (t - 12582912.f);
    const float p = fmaf(fmaf(fmaf(0.05517161637544632f, f, 0.24261116981506348f), f, 0.6932610273361206f), f,
                         0.9999280571937561f);
    return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}

static __device__ __forceinline__ float lg2(float x) {
#if ATTNKERN_FAST
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
#else
    return log2f(x);
#endif
}

// 1 / x: rcp.approx.ftz (within 1 ulp) in the fastmath variant, else correctly rounded
static __device__ __forceinline__ float recip(float x) {
#if ATTNKERN_FAST
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
#else
    return 1.f / x;
#endif
}

// x / y: __fdividef (2 ulp) in the fastmath variant, else correctly rounded
static __device__ __forceinline__ float divide(float x, float y) {
#if ATTNKERN_FAST
    return __fdividef(x, y);
#else
    return x / y;
#endif
}

static __device__ __forceinline__ float neg_inf() {
    float y;
    asm("mov.b32 %0, 0xff800000;\n" : "=f"(y));
    return y;
}

// ---------------------------------------------------------------- 3xTF32 (flash_tf32.cu, and flash_bwd_mma.cu
// for float32): see the top of flash_tf32.cu

// x rounded to TF32, to nearest with ties away from zero (as cvt.rna.tf32.f32, less
// its test for infinities: a non-finite input gives a non-finite result either way)
static __device__ __forceinline__ u32 tf32_rna(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }

// x = big + small, both TF32 bit patterns
static __device__ __forceinline__ void split(float x, u32& big, u32& small) {
    big = tf32_rna(x);
    small = tf32_rna(x - __uint_as_float(big));
}

// c (16 x 8) += a (16 x 8) b (8 x 8), TF32 inputs, float32 accumulation
static __device__ __forceinline__ void mma_tf32(float* c, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c += a b in 3xTF32, a and b given split (big, small); the small terms first
static __device__ __forceinline__ void mma3(float* c, const u32* ab, const u32* as, const u32* bb, const u32* bs) {
    mma_tf32(c, as, bb[0], bb[1]);
    mma_tf32(c, ab, bs[0], bs[1]);
    mma_tf32(c, ab, bb[0], bb[1]);
}

// the same with the small terms added to an accumulator of their own, cl: for P V,
// whose accumulator grows over every key (flash_tf32.cu's top says why)
static __device__ __forceinline__ void mma3_apart(float* c, float* cl, const u32* ab, const u32* as, const u32* bb,
                                                  const u32* bs) {
    mma_tf32(cl, as, bb[0], bb[1]);
    mma_tf32(cl, ab, bs[0], bs[1]);
    mma_tf32(c, ab, bb[0], bb[1]);
}

// A fragment (split) of 16 rows x 8 head columns from two float2s: rows g and g + 8,
// columns 2t and 2t + 1 (k indices t and t + 4 in the permuted order)
static __device__ __forceinline__ void split_a(float2 x0, float2 x1, u32 (&big)[4], u32 (&small)[4]) {
    split(x0.x, big[0], small[0]);
    split(x1.x, big[1], small[1]);
    split(x0.y, big[2], small[2]);
    split(x1.y, big[3], small[3]);
}

// ---------------------------------------------------------------- attention features
// ATTNKERN_FEAT 1 compiles a kernel's featured variant: grouped k/v rows, the
// alignment of the causal and window masks, sliding windows, key lengths and the
// softcap come as kernel arguments (FEAT_PARAMS). With 0 (the plain variant) they
// are ignored and Feat holds constants, so the plain kernel compiles to the code it
// had without them.
#ifndef ATTNKERN_FEAT
#define ATTNKERN_FEAT 0
#endif
// ATTNKERN_MASK, a MASK_* kind (with ATTNKERN_FEAT 1): the variant that also reads
// an attention mask of that kind; with 0 the featured kernel ignores the mask's
// parameters and compiles as it did without them
#ifndef ATTNKERN_MASK
#define ATTNKERN_MASK 0
#endif
// ATTNKERN_ALIBI 1 (with ATTNKERN_FEAT 1): the variant that adds ALiBi's -slope |i + len - nq - j|
#ifndef ATTNKERN_ALIBI
#define ATTNKERN_ALIBI 0
#endif
// ATTNKERN_DECODE 1 (flash_mma.cu, with ATTNKERN_FEAT 1): the split-K decode variant, whose
// block rows are the (query head, query row) pairs of one k/v head's group: row r is query
// row r % nq of head r / nq (QUERY_ROW)
#ifndef ATTNKERN_DECODE
#define ATTNKERN_DECODE 0
#endif
// ATTNKERN_WIDE 1 (flash_mma.cu, flash_wgmma.cu): the variant that writes its rows in float32
// before their rounding to the half dtype, and their lse in float32 in the log2 domain
// (store_partial_rows): for callers that merge rows computed over different keys (ring attention)
#ifndef ATTNKERN_WIDE
#define ATTNKERN_WIDE 0
#endif
// ATTNKERN_DROPOUT 1 (flash_mma.cu, flash_bwd_mma.cu, with ATTNKERN_FEAT 1): the variant that
// multiplies each probability by dropout's factor Z (keep / (1 - p), Philox4x32-10: dropout_bits)
#ifndef ATTNKERN_DROPOUT
#define ATTNKERN_DROPOUT 0
#endif
// ATTNKERN_VARLEN 1 (flash_mma.cu, flash_bwd_mma.cu, with ATTNKERN_FEAT 1): packed sequences
// (varlen_sequence): the grid's z is the sequence, cuqp and cukp its int32 cu_seqlens; seq_rows
// is then the stride of ALiBi's slopes between sequences (0: shared), key lengths unused
#ifndef ATTNKERN_VARLEN
#define ATTNKERN_VARLEN 0
#endif
#define FEAT_PARAMS int kv_group, u64 lensp, int seq_rows, int bottom_right, int window_left, int window_right, \
                    float softcap, u64 maskp, int mask_kind, int mask_heads, u64 mask_sb, u64 mask_sh, u64 mask_si, \
                    u64 mask_sj, float mask_unit, u64 alibip, float alibi_unit, u64 dseed, u64 dthr, float dscale, \
                    u64 di0, u64 dj0, u64 cuqp, u64 cukp
#define FEAT_ARGS kv_group, lensp, seq_rows, bottom_right, window_left, window_right, softcap, maskp, mask_kind, \
                  mask_heads, mask_sb, mask_sh, mask_si, mask_sj, mask_unit, alibip, \
                  alibi_unit, dseed, dthr, dscale, di0, dj0, cuqp, cukp

// One batch row's mask and cap: query row i sees key j iff lo(i) <= j < hi(i), with
// lo(i) = i + off - wl (0 for wl = -1), hi(i) = min(len, i + off + wr + 1) (len for wr
// = -1); off = 0 (top-left) or len - nq (bottom-right), causal is wr = 0. cap: the
// softcap in the units of the kernel's scores (0: none), cap_k = -2 log2(e) / cap.
// The attention mask (read by ATTNKERN_MASK kernels) at element mask_at + row
// msi + key msj (mask_at: this batch row's (b / heads, b % heads) entry; strides in
// elements, 0 where broadcast), an additive one scaled by munit into the kernel's units.
struct Feat {
    int len, off, wl, wr;
    u64 kv_row;  // the k/v row of this query row
    float cap, cap_k;
    const void* mask;
    int nq;
    u64 mask_at, msi, msj;
    float munit;
#if ATTNKERN_ALIBI
    float slope;  // ALiBi's slope of this batch row in the kernel's units
#endif
#if ATTNKERN_DROPOUT
    // dropout: Philox's key (the seed's halves), the keep threshold round(p 2^32), the factor
    // 1 / (1 - p), the counter offsets of query and key and the counter of this batch row
    u32 seed0, seed1;
    u64 thr;
    float zscale;
    u64 di0, dj0;
    u32 drow;
#endif
};
#define MASK_BOOL 1
#define MASK_F32 2
#define MASK_F16 3
#define MASK_BF16 4

static __device__ __forceinline__ Feat make_feat(u64 b, int nq, int nk, int causal, FEAT_PARAMS) {
#if ATTNKERN_FEAT
    const int len = lensp ? ((const int*)lensp)[b / (u64)seq_rows] : nk;
    const u64 heads = (u64)max(mask_heads, 1);
    Feat f{len, bottom_right ? len - nq : 0, window_left, causal ? 0 : window_right, b / (u64)kv_group,
           softcap, softcap > 0.f ? -2.8853900817779268f / softcap : 0.f, (const void*)maskp, nq,
           b / heads * mask_sb + b % heads * mask_sh, mask_si, mask_sj, mask_unit};
#if ATTNKERN_ALIBI
    f.slope = ((const float*)alibip)[b] * alibi_unit;
#endif
#if ATTNKERN_DROPOUT
    f.seed0 = (u32)dseed;
    f.seed1 = (u32)(dseed >> 32);
    f.thr = dthr;
    f.zscale = dscale;
    f.di0 = di0;
    f.dj0 = dj0;
    f.drow = (u32)b;
#endif
    return f;
#else
    return Feat{nk, 0, -1, causal ? 0 : -1, b, 0.f, 0.f, nullptr, nq, 0, 0, 0, 0.f};
#endif
}

// a visible key's score s with the attention mask (featured kernels with a mask):
// -inf where a bool mask is false, else s plus the additive mask's value in the
// kernel's units (-inf stays -inf); rows past nq read nothing
static __device__ __forceinline__ float mask_score(const Feat& f, float s, int key, int row) {
#if ATTNKERN_FEAT && ATTNKERN_ALIBI
    s -= f.slope * fabsf((float)(row + f.len - f.nq - key));
#endif
#if ATTNKERN_FEAT && ATTNKERN_MASK
    if (row >= f.nq) return s;
    const u64 at = f.mask_at + (u64)row * f.msi + (u64)key * f.msj;
    if (ATTNKERN_MASK == MASK_BOOL) return ((const unsigned char*)f.mask)[at] ? s : neg_inf();
    float x;
    if (ATTNKERN_MASK == MASK_F32) {
        x = ((const float*)f.mask)[at];
    } else {
        const u16 h = ((const u16*)f.mask)[at];
        if (ATTNKERN_MASK == MASK_F16)
            asm("cvt.f32.f16 %0, %1;\n" : "=f"(x) : "h"(h));
        else
            x = __uint_as_float((u32)h << 16);
    }
    return s + x * f.munit;
#else
    return s;
#endif
}

#if ATTNKERN_DROPOUT
// ---------------------------------------------------------------- dropout
// Philox4x32-10 (attnkern._philox, the Numba kernels' and the C kernels' attn_philox): the
// keep decision of query row i, key j of folded batch row b is word (j + dj0) % 4 of
// Philox((j + dj0) / 4, i + di0, b, 0) (counters mod 2^32) >= thr. dropout_bits gives the
// four decisions of one call as bits 0..3 (bit w: word w).
static __device__ __forceinline__ u32 dropout_bits(const Feat& f, int row, u64 group) {
    u32 c0 = (u32)group, c1 = (u32)((u64)row + f.di0), c2 = f.drow, c3 = 0u, k0 = f.seed0, k1 = f.seed1;
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        const u32 hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const u32 hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return (u32)(c0 >= f.thr) | (u32)(c1 >= f.thr) << 1 | (u32)(c2 >= f.thr) << 2 | (u32)(c3 >= f.thr) << 3;
}

// dropout's factor of query row `row`, key `key` on its own: Z or 0
static __device__ __forceinline__ float dropout_one(const Feat& f, int row, int key) {
    const u64 j = (u64)key + f.dj0;
    return (dropout_bits(f, row, j >> 2) >> (u32)(j & 3)) & 1u ? f.zscale : 0.f;
}

// The factors z of a lane's four elements of an m16n8 accumulator tile whose first key is
// kbase (a multiple of 8): rows r0 (z[0], z[1]) and r0 + 8 (z[2], z[3]), keys kbase + 2t and
// + 1 (t = lane % 4). Where dj0 is a multiple of 4 the quad's 4 lanes need 4 Philox calls
// (2 rows x 2 groups of 4 keys): each lane makes one, lane t the (row r0 + 8 (t / 2),
// keys kbase + 4 (t % 2)) one, and takes its bits from the quad by shuffles (the warp must
// be converged); else each element is its own call.
static __device__ __forceinline__ void dropout_rows(const Feat& f, int r0, int kbase, float (&z)[4]) {
    const int lane = threadIdx.x & 31, t = lane & 3;
    if ((f.dj0 & 3) == 0) {
        const u32 mine = dropout_bits(f, r0 + 8 * (t >> 1), ((u64)kbase + f.dj0) / 4 + (t & 1));
        const u32 top = __shfl_sync(0xffffffffu, mine, (lane & ~3) | (t >> 1));
        const u32 bottom = __shfl_sync(0xffffffffu, mine, (lane & ~3) | (2 + (t >> 1)));
        const int w = 2 * (t & 1);
        z[0] = (top >> w) & 1u ? f.zscale : 0.f;
        z[1] = (top >> (w + 1)) & 1u ? f.zscale : 0.f;
        z[2] = (bottom >> w) & 1u ? f.zscale : 0.f;
        z[3] = (bottom >> (w + 1)) & 1u ? f.zscale : 0.f;
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) z[e] = dropout_one(f, r0 + 8 * (e >> 1), kbase + 2 * t + (e & 1));
    }
}
#endif

#if ATTNKERN_VARLEN
// ---------------------------------------------------------------- packed sequences
// Sequence s of a packed call (attn.h's varlen layout: sequence after sequence, each a (heads,
// len, D) block): its query and key counts nq, nk and its first packed query and key rows qs, ks,
// from the int32 cu_seqlens at cuqp and cukp. Head h's rows of it start at row qs H + h nq of q
// (out, lse, dout, dq likewise), k/v head h_kv's at ks H_kv + h_kv nk.
static __device__ __forceinline__ void varlen_sequence(u64 cuqp, u64 cukp, int s, int& nq, int& nk, u64& qs,
                                                       u64& ks) {
    const int* cq = (const int*)cuqp;
    const int* ck = (const int*)cukp;
    qs = (u64)cq[s];
    ks = (u64)ck[s];
    nq = cq[s + 1] - cq[s];
    nk = ck[s + 1] - ck[s];
}

// f (made for head b of sequence s) with dropout's counters offset by the sequence's first packed
// query and key rows, and ALiBi's slope that of (s, b): slopes `stride` apart a sequence (0: shared)
static __device__ __forceinline__ void varlen_feat(Feat& f, u64 b, int s, u64 qs, u64 ks, u64 alibip, int stride,
                                                   float alibi_unit) {
#if ATTNKERN_DROPOUT
    f.di0 += qs;
    f.dj0 += ks;
#endif
#if ATTNKERN_ALIBI
    f.slope = ((const float*)alibip)[(u64)s * (u64)stride + b] * alibi_unit;
#endif
}
#endif

// the query row (as the masks count them) of a kernel's row r: r itself, or in the decode
// variant, whose rows pack the query heads of a group, r % nq (a macro: the other kernels compile
// to the code they had without the decode variant)
#if ATTNKERN_DECODE
#define QUERY_ROW(f, r) ((r) % (f).nq)
#else
#define QUERY_ROW(f, r) (r)
#endif

// the first key row i sees, and one past its last (hi <= lo: it sees none)
static __device__ __forceinline__ int key_lo(const Feat& f, int row) {
    return f.wl < 0 ? 0 : max(0, row + f.off - f.wl);
}
static __device__ __forceinline__ int key_hi(const Feat& f, int row) {
    return f.wr < 0 ? f.len : min(f.len, max(0, row + f.off + f.wr + 1));
}

static __device__ __forceinline__ bool key_hidden(const Feat& f, int key, int row) {
#if ATTNKERN_FEAT
    return key < key_lo(f, row) || key >= key_hi(f, row);
#else
    return key >= f.len || (f.wr == 0 && key > row);
#endif
}

// The key tiles of bn keys that the block of rows q0..q0 + bm - 1 visits: [begin, end).
// lo and hi grow with the row, so the first row's lo and the last row's (below nq) hi
// bound them: a window of W keys costs O(rows (W + bn)), not O(rows nk). The plain
// kernel keeps its own bound (keys up to the block's last row with causal masking).
static __device__ __forceinline__ void key_tiles(const Feat& f, int q0, int bm, int nq, int bn, int& begin, int& end) {
#if ATTNKERN_FEAT
    const int lo = key_lo(f, q0), hi = key_hi(f, min(q0 + bm, nq) - 1);
    begin = lo / bn;
    end = hi > lo ? (hi + bn - 1) / bn : begin;
#else
    begin = 0;
    end = ((f.wr == 0 ? min(f.len, q0 + bm) : f.len) + bn - 1) / bn;
#endif
}

// whether no row of first..last sees a key of [j0, j0 + bn)
static __device__ __forceinline__ bool tile_unseen(const Feat& f, int j0, int bn, int first, int last) {
#if ATTNKERN_FEAT
    return j0 >= key_hi(f, last) || j0 + bn <= key_lo(f, first);
#else
    return f.wr == 0 && j0 > last;
#endif
}

// whether some row of first..last misses some key of [j0, j0 + bn), or the kernel
// reads an attention mask: the tile needs masks
static __device__ __forceinline__ bool tile_masked(const Feat& f, int j0, int bn, int first, int last) {
#if ATTNKERN_FEAT
    return ATTNKERN_MASK || ATTNKERN_ALIBI || j0 < key_lo(f, last) || j0 + bn > key_hi(f, first);
#else
    return j0 + bn > f.len || (f.wr == 0 && j0 + bn - 1 > first);
#endif
}

// cap tanh(s / cap) for a score s in the kernel's units: tanh |x| = (1 - e) / (1 + e),
// e = 2^(-2 log2(e) |x|), the sign restored (absolute error a few ulp of 1)
static __device__ __forceinline__ float capped(const Feat& f, float s) {
    const float e = ex2(fabsf(s) * f.cap_k);
    return copysignf(f.cap * divide(1.f - e, 1.f + e), s);
}

// 1 / l for a row sum l, 0 where a featured row saw no key (its output is 0, never NaN)
static __device__ __forceinline__ float row_inverse(float l) {
    return ATTNKERN_FEAT && l == 0.f ? 0.f : recip(l);
}

// whether pred holds on any lane of the (converged) warp
static __device__ __forceinline__ bool warp_any(bool pred) {
    u32 r;
    asm volatile("{ .reg .pred p, q; setp.ne.u32 p, %1, 0; vote.sync.any.pred q, p, 0xffffffff; selp.u32 %0, 1, 0, q; }"
                 : "=r"(r) : "r"((u32)pred));
    return r != 0;
}

// The online softmax of one tile's raw scores s (16 rows x 8 NS keys, in the layout
// of an mma.sync m16n8 accumulator: lane rows r0 and r0 + 8, keys j0 + 8 n + 2t
// and + 1, t = lane % 4), for the tensor-core kernels (flash_mma.cu, flash_tf32.cu):
// masks (MASK: keys past nk, and past the row with causal masking), updates the
// running max m of the raw scores and the lane's partial sums l, returns the
// factors a that rescale the old sums and output rows, and hands each 8-key tile's
// probabilities p = 2^(s c - m c) (one FFMA and ex2.approx a score; c = the
// scale's magnitude times log2(e)) to emit(n, p), which stores them as its kernel
// multiplies them (so they need not outlive the call in float32).
template <int NS, bool MASK, class Emit>
static __device__ __forceinline__ void softmax_tile(float (&s)[NS][4], float (&m)[2], float (&l)[2], float (&a)[2],
                                                    float c, int j0, const Feat& f, int r0, Emit emit) {
    const float NEG_INF = neg_inf();
    const int t = threadIdx.x & 3;
    float mx0 = m[0], mx1 = m[1];
#pragma unroll
    for (int n = 0; n < NS; ++n) {
        if (ATTNKERN_FEAT && f.cap > 0.f) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = capped(f, s[n][e]);
        }
        if (MASK) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = j0 + n * 8 + 2 * t + (e & 1), row = QUERY_ROW(f, r0 + (e >> 1) * 8);
                if (key_hidden(f, key, row))
                    s[n][e] = NEG_INF;
                else if (ATTNKERN_MASK || ATTNKERN_ALIBI)
                    s[n][e] = mask_score(f, s[n][e], key, row);
            }
        }
        mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
        mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    // a row with no visible key yet keeps max -inf: its p, sums and factors stay 0
    const float mc0 = mx0 == NEG_INF ? 0.f : mx0 * c, mc1 = mx1 == NEG_INF ? 0.f : mx1 * c;
    a[0] = m[0] == NEG_INF ? 0.f : ex2(m[0] * c - mc0);
    a[1] = m[1] == NEG_INF ? 0.f : ex2(m[1] * c - mc1);
    m[0] = mx0;
    m[1] = mx1;
    float ps0 = 0.f, ps1 = 0.f;
#if ATTNKERN_FP8_EXP
    const float mp0 = mc0 - 8.f, mp1 = mc1 - 8.f;  // p times 2^8 (ATTNKERN_FP8_EXP)
#else
    const float mp0 = mc0, mp1 = mc1;
#endif
#pragma unroll
    for (int n = 0; n < NS; ++n) {
        float p[4];
        if (ATTNKERN_FP8_EXP_H) {
            float x[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) x[e] = fmaf(s[n][e], c, -(e < 2 ? mp0 : mp1));
            ex2_half2(x[0], x[1], p[0], p[1]);
            ex2_half2(x[2], x[3], p[2], p[3]);
#pragma unroll
            for (int e = 0; e < 4; ++e)
                if (MASK && s[n][e] == NEG_INF) p[e] = 0.f;  // also where c = 0
        } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float x = fmaf(s[n][e], c, -(e < 2 ? mp0 : mp1));
                p[e] = ATTNKERN_FP8_EXP > 1 && n % ATTNKERN_FP8_EXP == ATTNKERN_FP8_EXP - 1 ? exp2_fma(x) : ex2(x);
                if (MASK && s[n][e] == NEG_INF) p[e] = 0.f;  // also where c = 0
            }
        }
        ps0 += p[0] + p[1];
        ps1 += p[2] + p[3];
        emit(n, p);
    }
    l[0] = l[0] * a[0] + ps0;  // this lane's keys only; summed over the row's lanes at the end
    l[1] = l[1] * a[1] + ps1;
}

// softmax_tile with its masks only where the tile needs them (mask: tile_masked, it
// crosses a row's length, window or causal diagonal)
template <int NS, class Emit>
static __device__ __forceinline__ void softmax_tile_masked_if(bool mask, float (&s)[NS][4], float (&m)[2], float (&l)[2],
                                                              float (&a)[2], float c, int j0, const Feat& f, int r0,
                                                              Emit emit) {
    if (mask)
        softmax_tile<NS, true>(s, m, l, a, c, j0, f, r0, emit);
    else
        softmax_tile<NS, false>(s, m, l, a, c, j0, f, r0, emit);
}

// o's rows g (elements 0, 1 of each 8-column tile) and g + 8 (2, 3) times a[0] and a[1]
template <int NO>
static __device__ __forceinline__ void scale_rows(float (&o)[NO][4], const float (&a)[2]) {
#pragma unroll
    for (int j = 0; j < NO; ++j) {
        o[j][0] *= a[0];
        o[j][1] *= a[0];
        o[j][2] *= a[1];
        o[j][3] *= a[1];
    }
}

// the sum of x over the 4 lanes that share an accumulator row
static __device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// a row's log-sum-exp from its max m of the raw scores and its sum l of 2^(s c - m c):
// (m c + log2 l) ln 2, m c being the scaled max in the log2 domain
static __device__ __forceinline__ float row_lse(float m, float c, float l) {
    return (m * c + lg2(l)) * 0.6931471805599453f;
}

// The decode variant's partial (flash_mma.cu, ATTNKERN_DECODE): a lane's two rows r0
// and r0 + 8 of the accumulator (8 DH columns), divided by their row sums, in
// float32 where they are below nq, and their log-sum-exp in the log2 domain (-inf
// where a row saw no key) from the lane with t = 0.
// (store_half_rows' steps with float32 stores: kept apart so that the half-precision
// kernels compile to the code they had, which a shared template with the stores as
// lambdas did not)
template <int DH>
static __device__ __forceinline__ void store_partial_rows(float* out, float* lse, const float (&o)[DH / 8][4],
                                                          const float (&l)[2], const float (&m)[2], float c, int r0,
                                                          int nq) {
    const int t = threadIdx.x & 3, r1 = r0 + 8;
    const float l0 = quad_sum(l[0]), l1 = quad_sum(l[1]);
    const float inv0 = row_inverse(l0), inv1 = row_inverse(l1);
#pragma unroll
    for (int j = 0; j < DH / 8; ++j) {
        const int col = j * 8 + 2 * t;
        if (r0 < nq) *(float2*)(out + (u64)r0 * DH + col) = make_float2(o[j][0] * inv0, o[j][1] * inv0);
        if (r1 < nq) *(float2*)(out + (u64)r1 * DH + col) = make_float2(o[j][2] * inv1, o[j][3] * inv1);
    }
    if (t == 0) {
        if (r0 < nq) lse[r0] = l0 == 0.f ? neg_inf() : m[0] * c + lg2(l0);
        if (r1 < nq) lse[r1] = l1 == 0.f ? neg_inf() : m[1] * c + lg2(l1);
    }
}

// the first query row of this block of bm rows: with causal masking block x does
// (x + 1) bm rows' worth of keys, so the grid is walked from its last block (the
// blocks with the most tiles are issued first)
static __device__ __forceinline__ int block_first_row(int causal, int bm) {
    return (causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * bm;
}

#ifdef ATTNKERN_BF16
// The half-precision kernels' (flash_mma.cu, flash_wgmma.cu: ATTNKERN_BF16 is 1 for
// bfloat16, 0 for float16) roundings to the input dtype and their last step.

// two floats rounded to the input dtype, lo in the low half
static __device__ __forceinline__ u32 pack2(float lo, float hi) {
    u32 r;
#if ATTNKERN_BF16
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}

static __device__ __forceinline__ u16 pack1(float x) {
    u16 r;
#if ATTNKERN_BF16
    asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(r) : "f"(x));
#else
    asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(r) : "f"(x));
#endif
    return r;
}

// A lane's two output rows r0 and r0 + 8 (an m16n8 accumulator's layout, 8 DH
// columns), divided by their row sums (the lanes' partial sums l, summed over the
// quad), stored rounded to the input dtype where they are below nq; and their
// log-sum-exp into lse (rows of the batch entry; null: none) from the lane with t = 0.
template <int DH>
static __device__ __forceinline__ void store_half_rows(u16* out, u16* lse, const float (&o)[DH / 8][4],
                                                       const float (&l)[2], const float (&m)[2], float c, int r0,
                                                       int nq) {
    const int t = threadIdx.x & 3, r1 = r0 + 8;
    const float l0 = quad_sum(l[0]), l1 = quad_sum(l[1]);
    const float inv0 = row_inverse(l0), inv1 = row_inverse(l1);
#pragma unroll
    for (int j = 0; j < DH / 8; ++j) {
        const int col = j * 8 + 2 * t;
        if (r0 < nq) *(u32*)(out + (u64)r0 * DH + col) = pack2(o[j][0] * inv0, o[j][1] * inv0);
        if (r1 < nq) *(u32*)(out + (u64)r1 * DH + col) = pack2(o[j][2] * inv1, o[j][3] * inv1);
    }
    if (lse && t == 0) {
        if (r0 < nq) lse[r0] = pack1(row_lse(m[0], c, l0));
        if (r1 < nq) lse[r1] = pack1(row_lse(m[1], c, l1));
    }
}
#endif

// The split-K decode's merge of one output row from its chunks' partials (flash_combine.cu's
// kernel, and flash_mma.cu's fused decode variant in the last block of a k/v row), a warp per
// row: lane t holds columns 4t..4t + 3. part: the row's partial of chunk 0 (DH floats), the next
// chunk's `stride` rows further; plse: its lse (log2 domain, -inf where the chunk saw no key of
// the row), likewise. The chunks are added in their order, one after another (w_s = 2^(lse_s - M),
// out = sum w_s o_s / sum w_s, lse = (M + log2 sum w_s) ln 2; a row that saw no key: 0, -inf), so
// the result does not depend on which block or kernel merges. U chunks' partials are loaded before
// they are added (in order: the same bits for every U), so that a warp has U reads in flight.
// COHERENT 0 reads through the read-only cache (partials written by an earlier kernel); 1 at L2
// (ld.global.cg: partials other blocks of this kernel wrote, behind their fences). lse: the row's
// lse (input dtype) to write, or null.
template <bool COHERENT>
static __device__ __forceinline__ float4 combine_load4(const float* p) {
    float4 x;
    // volatile: kept where it is written (not sunk into the branch that uses it), so that a loop's
    // loads are all issued before their first use
    if (COHERENT)
        asm volatile("ld.global.cg.v4.f32 {%0,%1,%2,%3}, [%4];\n" : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w) : "l"(p));
    else
        asm volatile("ld.global.nc.v4.f32 {%0,%1,%2,%3}, [%4];\n" : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w) : "l"(p));
    return x;
}

template <bool COHERENT>
static __device__ __forceinline__ float combine_load1(const float* p) {
    float x;
    if (COHERENT)
        asm volatile("ld.global.cg.f32 %0, [%1];\n" : "=f"(x) : "l"(p));
    else
        asm volatile("ld.global.nc.f32 %0, [%1];\n" : "=f"(x) : "l"(p));
    return x;
}

template <int DH, int U, bool COHERENT>
static __device__ __forceinline__ void combine_row(const float* part, const float* plse, int splits, int stride,
                                                   u16* out, u16* lse) {
    const int lane = threadIdx.x & 31;
    const float NEG_INF = neg_inf();
    float mx = NEG_INF;
    for (int s = lane; s < splits; s += 32) mx = fmaxf(mx, combine_load1<COHERENT>(plse + (u64)s * stride));
#pragma unroll
    for (int w = 16; w > 0; w >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, w));
    float acc[4] = {0.f, 0.f, 0.f, 0.f}, den = 0.f;
    // adds chunk s's partial (x, its lse ls) to the row, in chunk order
    const auto add = [&](float ls, const float4& x) {
        if (ls == NEG_INF) return;  // the chunk saw no key of this row: its partial is 0
        const float w = ex2(ls - mx);
        den += w;
        acc[0] = fmaf(w, x.x, acc[0]);
        acc[1] = fmaf(w, x.y, acc[1]);
        acc[2] = fmaf(w, x.z, acc[2]);
        acc[3] = fmaf(w, x.w, acc[3]);
    };
    const bool cols = 4 * lane < DH;
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    if (mx != NEG_INF) {
        int s = 0;
        for (; s + U <= splits; s += U) {
            float ls[U];
            float4 x[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                ls[u] = combine_load1<COHERENT>(plse + (u64)(s + u) * stride);
                x[u] = cols ? combine_load4<COHERENT>(part + (u64)(s + u) * stride * DH + 4 * lane) : zero;
            }
#pragma unroll
            for (int u = 0; u < U; ++u) add(ls[u], x[u]);
        }
        for (; s < splits; ++s)
            add(combine_load1<COHERENT>(plse + (u64)s * stride),
                cols ? combine_load4<COHERENT>(part + (u64)s * stride * DH + 4 * lane) : zero);
    }
    const float inv = den > 0.f ? recip(den) : 0.f;  // a row that sees no key: 0, lse -inf
    if (cols) *(uint2*)(out + 4 * lane) = make_uint2(pack2(acc[0] * inv, acc[1] * inv), pack2(acc[2] * inv, acc[3] * inv));
    if (lse != nullptr && lane == 0) *lse = pack1(mx == NEG_INF ? NEG_INF : (mx + lg2(den)) * 0.6931471805599453f);
}
