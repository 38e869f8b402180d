// cuda.flash for float16 and bfloat16: the FlashAttention-2 forward on tensor cores.
//
// A CUDA C++ device function that a numba-cuda kernel calls (kernels.py,
// flash_mma_kernel): numba-cuda compiles this source with NVRTC and links it into
// the kernel, which it launches like every other kernel of attnkern. Before
// compilation kernels.py prepends the constants:
//   ATTNKERN_D     the head size (D = Dv), a multiple of 16 up to 128
//   ATTNKERN_BF16  1 for bfloat16, 0 for float16
//   ATTNKERN_NAME  the function's name
// No header is included: the tensor-core, shared-memory and conversion
// instructions are written as inline PTX.
//
// A block of 4 warps owns BM = 64 query rows (16 per warp) and streams K/V tiles
// of BN = 64 keys through shared memory with cp.async (rows padded by 16 bytes, so
// ldmatrix reads are free of bank conflicts). Per tile, each warp computes its
// 16 x 64 scores with mma.sync m16n8k16 (float32 accumulation; Q's fragments are
// loaded from global memory once and kept in registers), scales them into the
// log2 domain, masks the causal diagonal and the keys past nk, updates the running
// row max (reduced over the 4 lanes that share a row) and the lanes' partial row
// sums, rescales its output accumulator, and multiplies P (rounded to the input
// dtype, the score accumulators reused as the A operand) by the V tile
// (ldmatrix.trans gives the B operand). The V tile streams in while the scores
// are computed and the next K tile while P V is computed, one buffer each.

#define BM 64
#define BN 64
#define NTHREADS 128
#define D ATTNKERN_D
#define LD (D + 8)  // shared row stride, in elements

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

static __device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

static __device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

static __device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

static __device__ __forceinline__ void ldsm_x2(u32 addr, u32& r0, u32& r1) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}

static __device__ __forceinline__ void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

// c (16 x 8, float32) += a (16 x 16) b (16 x 8)
static __device__ __forceinline__ void mma(float* c, const u32* a, u32 b0, u32 b1) {
#if ATTNKERN_BF16
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
#endif
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

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

static __device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

static __device__ __forceinline__ float lg2(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

static __device__ __forceinline__ float neg_inf() {
    float y;
    asm("mov.b32 %0, 0xff800000;\n" : "=f"(y));
    return y;
}

// one K or V tile of BN rows (keys j0...) into shared memory, rows past nk zero-filled
static __device__ __forceinline__ void load_tile(const u16* src, u32 dst, int j0, int nk, int tid) {
    constexpr int CPR = D / 8;  // 16-byte chunks per row
#pragma unroll
    for (int c = tid; c < BN * CPR; c += NTHREADS) {
        const int row = c / CPR, col = (c % CPR) * 8;
        const int key = j0 + row;
        const bool live = key < nk;
        cp_async16(dst + (u32)(row * LD + col) * 2u, src + (u64)(live ? key : 0) * D + col, live ? 16 : 0);
    }
    cp_async_commit();
}

extern "C" __device__ void ATTNKERN_NAME(u64 qp, u64 kp, u64 vp, u64 op, u64 lsep, int nq, int nk,
                                         float scale_log2, int causal, int with_lse) {
    constexpr int KC = D / 16;  // 16-wide chunks of the head size: the k steps of Q K^T
    constexpr int NS = BN / 8;  // 8-key tiles of a score row block
    constexpr int NO = D / 8;   // 8-column tiles of the output
    __shared__ __align__(128) u16 ks[BN * LD];
    __shared__ __align__(128) u16 vs[BN * LD];

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const u64 b = blockIdx.y;
    const int q0 = blockIdx.x * BM;
    const u16* q = (const u16*)qp + b * (u64)nq * D;
    const u16* k = (const u16*)kp + b * (u64)nk * D;
    const u16* v = (const u16*)vp + b * (u64)nk * D;
    const int r0 = q0 + warp * 16 + g, r1 = r0 + 8;  // this lane's two rows
    const float NEG_INF = neg_inf();

    // Q's A fragments: (row g, cols 2t..) (row g+8, cols 2t..) (row g, cols 8+2t..) (row g+8, cols 8+2t..)
    u32 qf[KC][4];
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
        const int c = kc * 16 + 2 * t;
        qf[kc][0] = r0 < nq ? *(const u32*)(q + (u64)r0 * D + c) : 0u;
        qf[kc][1] = r1 < nq ? *(const u32*)(q + (u64)r1 * D + c) : 0u;
        qf[kc][2] = r0 < nq ? *(const u32*)(q + (u64)r0 * D + c + 8) : 0u;
        qf[kc][3] = r1 < nq ? *(const u32*)(q + (u64)r1 * D + c + 8) : 0u;
    }
    float o[NO][4];
#pragma unroll
    for (int j = 0; j < NO; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.f, l1 = 0.f;

    const int kend = causal ? min(nk, q0 + BM) : nk;
    const int ntiles = (kend + BN - 1) / BN;
    const u32 ks0 = smem_u32(ks), vs0 = smem_u32(vs);
    const int warp_row0 = q0 + warp * 16;

    load_tile(k, ks0, 0, nk, tid);
    for (int jt = 0; jt < ntiles; ++jt) {
        const int j0 = jt * BN;
        cp_async_wait_all();
        __syncthreads();  // K(jt) is in; every warp is done with V(jt-1)
        load_tile(v, vs0, j0, nk, tid);

        float s[NS][4];
#pragma unroll
        for (int n = 0; n < NS; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int n = 0; n < NS; ++n) {
#pragma unroll
            for (int kc = 0; kc + 1 < KC; kc += 2) {
                u32 b0, b1, b2, b3;
                ldsm_x4(ks0 + (u32)((n * 8 + (lane & 7)) * LD + kc * 16 + (lane >> 3) * 8) * 2u, b0, b1, b2, b3);
                mma(s[n], qf[kc], b0, b1);
                mma(s[n], qf[kc + 1], b2, b3);
            }
            if (KC % 2) {
                u32 b0, b1;
                ldsm_x2(ks0 + (u32)((n * 8 + (lane & 7)) * LD + (KC - 1) * 16 + ((lane >> 3) & 1) * 8) * 2u, b0, b1);
                mma(s[n], qf[KC - 1], b0, b1);
            }
        }

        // log2 domain; masks only where the tile crosses nk or this warp's diagonal
        const bool masked = j0 + BN > nk || (causal && j0 + BN - 1 > warp_row0);
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int n = 0; n < NS; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[n][e] * scale_log2;
                if (masked) {
                    const int key = j0 + n * 8 + 2 * t + (e & 1), row = e < 2 ? r0 : r1;
                    if (key >= nk || (causal && key > row)) x = NEG_INF;
                }
                s[n][e] = x;
            }
            mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
            mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        // finite: key 0 is visible to every row and lies in the first tile
        const float a0 = ex2(m0 - mx0), a1 = ex2(m1 - mx1);
        m0 = mx0;
        m1 = mx1;
        u32 pf[NS][2];  // P in the input dtype: (row g, keys 2t..) and (row g+8, keys 2t..) of each 8-key tile
        float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
        for (int n = 0; n < NS; ++n) {
            const float p0 = ex2(s[n][0] - m0), p1 = ex2(s[n][1] - m0);
            const float p2 = ex2(s[n][2] - m1), p3 = ex2(s[n][3] - m1);
            ps0 += p0 + p1;
            ps1 += p2 + p3;
            pf[n][0] = pack2(p0, p1);
            pf[n][1] = pack2(p2, p3);
        }
        l0 = l0 * a0 + ps0;  // this lane's keys only; summed over the row's lanes at the end
        l1 = l1 * a1 + ps1;
#pragma unroll
        for (int j = 0; j < NO; ++j) {
            o[j][0] *= a0;
            o[j][1] *= a0;
            o[j][2] *= a1;
            o[j][3] *= a1;
        }

        cp_async_wait_all();
        __syncthreads();  // V(jt) is in; every warp is done with K(jt)
        if (jt + 1 < ntiles) load_tile(k, ks0, j0 + BN, nk, tid);

        // O += P V: the A fragment of keys 16c.. is the P of 8-key tiles 2c and 2c+1
#pragma unroll
        for (int c = 0; c < BN / 16; ++c) {
            const u32 a[4] = {pf[2 * c][0], pf[2 * c][1], pf[2 * c + 1][0], pf[2 * c + 1][1]};
#pragma unroll
            for (int j = 0; j < NO; j += 2) {
                u32 b0, b1, b2, b3;
                ldsm_x4_t(vs0 + (u32)((c * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + j * 8 + (lane >> 4) * 8) * 2u,
                          b0, b1, b2, b3);
                mma(o[j], a, b0, b1);
                mma(o[j + 1], a, b2, b3);
            }
        }
    }

    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = 1.f / l0, inv1 = 1.f / l1;
    u16* out = (u16*)op + b * (u64)nq * D;
#pragma unroll
    for (int j = 0; j < NO; ++j) {
        const int c = j * 8 + 2 * t;
        if (r0 < nq) *(u32*)(out + (u64)r0 * D + c) = pack2(o[j][0] * inv0, o[j][1] * inv0);
        if (r1 < nq) *(u32*)(out + (u64)r1 * D + c) = pack2(o[j][2] * inv1, o[j][3] * inv1);
    }
    if (with_lse && t == 0) {
        // m and log2(l) are in the log2 domain: lse = (m + log2 l) ln 2
        u16* lse = (u16*)lsep + b * (u64)nq;
        if (r0 < nq) lse[r0] = pack1((m0 + lg2(l0)) * 0.6931471805599453f);
        if (r1 < nq) lse[r1] = pack1((m1 + lg2(l1)) * 0.6931471805599453f);
    }
}
