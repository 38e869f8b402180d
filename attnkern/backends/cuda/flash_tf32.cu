// cuda.flash for float32 on tensor cores: flash_mma.cu's FlashAttention-2 forward
// with both products in 3xTF32.
//
// TF32 keeps 10 of float32's 23 mantissa bits. Each float32 operand x is split
// into big = x rounded to TF32 and small = x - big (exact) rounded to TF32, and a
// product a b is accumulated as a_small b_big + a_big b_small + a_big b_big on
// mma.sync m16n8k8 (float32 accumulation): what is dropped (a_small b_small, and
// the rounding of the small parts) is within about 2^-22 of a b. This is CUTLASS's
// "3xTF32", which torch's own float32 SDPA kernel uses on these GPUs: close to
// float32 FMAs' accuracy at three tensor-core products a product. The output's
// accumulator grows over all keys, and small terms added to it lose their low bits
// in the tensor core's additions, so P V's small terms get an accumulator of their
// own, added to the big products' once at the end (this took the error against
// float64 from about 9e-7 to 3-4e-7; dev/gpu_flash_versions.py measures it).
//
// Hosted as flash_mma.cu is (kernels.py, flash_mma_kernel): a CUDA C++ device
// function that numba-cuda compiles with NVRTC and links into a kernel launched
// below its dispatcher. Before compilation kernels.py prepends the constants
// (kernels.MmaConfig):
//   ATTNKERN_D        the head size (D = Dv), a multiple of 16 up to 128
//   ATTNKERN_NAME     the function's name
//   ATTNKERN_BN       keys per K/V tile
//   ATTNKERN_MT       16-row mma tiles per warp: a warp owns 16 MT query rows
//   ATTNKERN_NW       warps per block: a block owns BM = 16 MT NW query rows
//   ATTNKERN_QSMEM    1: Q stays in shared memory and its fragments are reloaded
//                     and split every tile; 0: they are split once and held in
//                     registers for the whole call
//   ATTNKERN_DYNAMIC  1: shared memory is the launch's dynamic shared memory
// and then flash_common.cuh (types, cp.async, ex2, the online softmax). The grid is
// (query blocks, batch), NTHREADS = 32 NW threads a block.
//
// What differs from flash_mma.cu besides the split: fragments are read from shared
// memory with plain 8- and 4-byte loads (ldmatrix moves 16-bit elements), and the
// 8 keys of an mma k step are taken in the order 0, 2, 4, 6, 1, 3, 5, 7 (the same
// for P and V, so the sum is unchanged): a lane then holds, as P's A fragment,
// exactly the scores its Q K^T accumulator holds (keys 2t and 2t + 1), with no
// shuffle. The head dimension of Q K^T is permuted likewise, so a lane reads each
// Q and K pair as one float2. K and Q rows are padded to D + 8 floats and V rows
// to D + 4, which keeps each of those reads free of bank conflicts.

#define D ATTNKERN_D
#define BN ATTNKERN_BN
#define MT ATTNKERN_MT
#define NW ATTNKERN_NW
#define QSMEM ATTNKERN_QSMEM
#define BM (16 * MT * NW)
#define NTHREADS (32 * NW)
#define LDK (D + 8)  // Q and K row stride, in floats
#define LDV (D + 4)  // V row stride
// shared memory, in floats: [Q (BM rows) if QSMEM] [K: 2 tiles] [V: 2 tiles]
#define Q_ELEMS (QSMEM ? BM * LDK : 0)
#define K_ELEMS (BN * LDK)
#define V_ELEMS (BN * LDV)
#define SMEM_ELEMS (Q_ELEMS + 2 * K_ELEMS + 2 * V_ELEMS)

// one K or V tile of BN rows (keys j0...) into shared memory rows of LD floats,
// rows past nk zero-filled
template <int LD>
static __device__ __forceinline__ void load_tile(const float* src, u32 dst, int j0, int nk, int tid) {
    constexpr int CPR = D / 4;  // 16-byte chunks per row
#pragma unroll
    for (int c = tid; c < BN * CPR; c += NTHREADS) {
        const int row = c / CPR, col = (c % CPR) * 4;
        const int key = j0 + row;
        const bool live = key < nk;
        cp_async16(dst + (u32)(row * LD + col) * 4u, src + (u64)(live ? key : 0) * D + col, live ? 16 : 0);
    }
}

extern "C" __device__ void ATTNKERN_NAME(u64 qp, u64 kp, u64 vp, u64 op, u64 lsep, int nq, int nk,
                                         float scale_log2, int causal, int with_lse, FEAT_PARAMS) {
    constexpr int KC = D / 8;  // 8-wide k steps of Q K^T
    constexpr int NS = BN / 8;  // 8-key tiles of a score row block (the k steps of P V)
    constexpr int NO = D / 8;   // 8-column tiles of the output
#if ATTNKERN_DYNAMIC
    extern __shared__ __align__(128) float smem[];
#else
    __shared__ __align__(128) float smem[SMEM_ELEMS];
#endif

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const u64 b = blockIdx.y;
    const int q0 = block_first_row(causal, BM);
    const float* q = (const float*)qp + b * (u64)nq * D;
    const Feat f = make_feat(b, nq, nk, causal, FEAT_ARGS);
    const float* k = (const float*)kp + f.kv_row * (u64)nk * D;
    const float* v = (const float*)vp + f.kv_row * (u64)nk * D;
    const int wr0 = q0 + warp * 16 * MT;  // this warp's first row; its mma tile i has rows wr0 + 16 i...
    const float NEG_INF = neg_inf();
    const float c = fabsf(scale_log2);
    const float sign = scale_log2 < 0.f ? -1.f : 1.f;  // a negative scale negates Q once
    float* const ksm = smem + Q_ELEMS;
    float* const vsm = ksm + 2 * K_ELEMS;
    const u32 ks0 = smem_u32(ksm), vs0 = smem_u32(vsm);

#if QSMEM
    // Q's BM rows into shared memory (rows past nq zero), the sign applied on the way;
    // the first tile's barrier makes them visible
    for (int i = tid; i < BM * (D / 4); i += NTHREADS) {
        const int row = i / (D / 4), col = (i % (D / 4)) * 4;
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (q0 + row < nq) {
            x = *(const float4*)(q + (u64)(q0 + row) * D + col);
            x.x *= sign; x.y *= sign; x.z *= sign; x.w *= sign;
        }
        *(float4*)(smem + row * LDK + col) = x;
    }
#else
    // Q's A fragments, split once: per mma tile and k step, rows g and g + 8, columns 2t and 2t + 1
    u32 qb[MT][KC][4], qs[MT][KC][4];
#pragma unroll
    for (int i = 0; i < MT; ++i) {
        const int r0 = wr0 + 16 * i + g, r1 = r0 + 8;
#pragma unroll
        for (int kc = 0; kc < KC; ++kc) {
            const int col = kc * 8 + 2 * t;
            float2 x0 = r0 < nq ? *(const float2*)(q + (u64)r0 * D + col) : make_float2(0.f, 0.f);
            float2 x1 = r1 < nq ? *(const float2*)(q + (u64)r1 * D + col) : make_float2(0.f, 0.f);
            x0.x *= sign; x0.y *= sign; x1.x *= sign; x1.y *= sign;
            split_a(x0, x1, qb[i][kc], qs[i][kc]);
        }
    }
#endif
    float o[MT][NO][4], ol[MT][NO][4];  // the output's big x big products, and its small terms
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NO; ++j) {
            o[i][j][0] = o[i][j][1] = o[i][j][2] = o[i][j][3] = 0.f;
            ol[i][j][0] = ol[i][j][1] = ol[i][j][2] = ol[i][j][3] = 0.f;
        }
    float m[MT][2], l[MT][2];  // running max of the raw scores (after Q's sign); the lane's partial row sums
#pragma unroll
    for (int i = 0; i < MT; ++i) m[i][0] = m[i][1] = NEG_INF, l[i][0] = l[i][1] = 0.f;

#if ATTNKERN_FEAT
#define LOAD_LEN f.len
#define TILE_MASKED(i) tile_masked(f, j0, BN, wr0 + 16 * (i), wr0 + 16 * (i) + 15)
    // the key tiles [jt0, jt1) some row of the block sees; keys past the row's length are
    // zero-filled, never read
    int jt0, jt1;
    key_tiles(f, q0, BM, nq, BN, jt0, jt1);

    load_tile<LDK>(k, ks0 + (jt0 & 1) * K_ELEMS * 4u, jt0 * BN, f.len, tid);
    load_tile<LDV>(v, vs0 + (jt0 & 1) * V_ELEMS * 4u, jt0 * BN, f.len, tid);
    cp_async_commit();
    const int jt_end = jt1;
    for (int jt = jt0; jt < jt_end; ++jt) {
#else
#define LOAD_LEN nk
#define TILE_MASKED(i) (j0 + BN > nk || (causal && j0 + BN - 1 > wr0 + 16 * (i)))
    // the plain kernel's own loop, as it was before the features (its registers are at the limit)
    const int kend = causal ? min(nk, q0 + BM) : nk;
    const int ntiles = (kend + BN - 1) / BN;

    load_tile<LDK>(k, ks0, 0, nk, tid);
    load_tile<LDV>(v, vs0, 0, nk, tid);
    cp_async_commit();
    const int jt_end = ntiles;
    for (int jt = 0; jt < jt_end; ++jt) {
#endif
        const int j0 = jt * BN;
        const float* kt = ksm + (jt & 1) * K_ELEMS;
        const float* vt = vsm + (jt & 1) * V_ELEMS;
        cp_async_wait_all();
        __syncthreads();  // tile jt is in; every warp is done with tile jt - 1, whose buffers refill now
        if (jt + 1 < jt_end) {
            load_tile<LDK>(k, ks0 + ((jt + 1) & 1) * K_ELEMS * 4u, j0 + BN, LOAD_LEN, tid);
            load_tile<LDV>(v, vs0 + ((jt + 1) & 1) * V_ELEMS * 4u, j0 + BN, LOAD_LEN, tid);
            cp_async_commit();
        }
        // a warp none of whose rows sees a key of the tile has nothing to add
#if ATTNKERN_FEAT
        if (tile_unseen(f, j0, BN, wr0, wr0 + 16 * MT - 1)) continue;
#else
        if (causal && j0 > wr0 + 16 * MT - 1) continue;
#endif

        float s[MT][NS][4];
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int n = 0; n < NS; ++n) {
                s[i][n][0] = s[i][n][1] = s[i][n][2] = s[i][n][3] = 0.f;
            }
#pragma unroll
        for (int kc = 0; kc < KC; ++kc) {
#if QSMEM
            u32 ab[MT][4], as[MT][4];
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                const float* qr = smem + (warp * 16 * MT + 16 * i + g) * LDK + kc * 8 + 2 * t;
                split_a(*(const float2*)qr, *(const float2*)(qr + 8 * LDK), ab[i], as[i]);
            }
#else
            const u32 (&ab)[MT][KC][4] = qb;
            const u32 (&as)[MT][KC][4] = qs;
#endif
#pragma unroll
            for (int n = 0; n < NS; ++n) {
                // B fragment: keys 8 n + g, head columns 2t and 2t + 1
                const float2 kx = *(const float2*)(kt + (n * 8 + g) * LDK + kc * 8 + 2 * t);
                u32 bb[2], bs[2];
                split(kx.x, bb[0], bs[0]);
                split(kx.y, bb[1], bs[1]);
#pragma unroll
                for (int i = 0; i < MT; ++i) {
#if QSMEM
                    mma3(s[i][n], ab[i], as[i], bb, bs);
#else
                    mma3(s[i][n], ab[i][kc], as[i][kc], bb, bs);
#endif
                }
            }
        }

        // masks only where the tile crosses a row's length, window or diagonal; s becomes P
        float a[MT][2];  // rescale factors of the old output rows
        bool rescale = false;
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            const int r0 = wr0 + 16 * i + g;
            const auto emit = [&](int n, const float (&p)[4]) {
                s[i][n][0] = p[0];
                s[i][n][1] = p[1];
                s[i][n][2] = p[2];
                s[i][n][3] = p[3];
            };
            softmax_tile_masked_if(TILE_MASKED(i), s[i], m[i], l[i], a[i], c,
                                   j0, f, r0, emit);
            rescale |= a[i][0] != 1.f || a[i][1] != 1.f;
        }
        if (warp_any(rescale)) {
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                scale_rows(o[i], a[i]);
                scale_rows(ol[i], a[i]);
            }
        }

        // O += P V, k step n = keys 8 n.. in the order 2t (k index t), 2t + 1 (t + 4)
#pragma unroll
        for (int n = 0; n < NS; ++n) {
            u32 pb[MT][4], ps[MT][4];
#pragma unroll
            for (int i = 0; i < MT; ++i)
                split_a(make_float2(s[i][n][0], s[i][n][1]), make_float2(s[i][n][2], s[i][n][3]), pb[i], ps[i]);
            const float* vr = vt + (n * 8 + 2 * t) * LDV + g;
#pragma unroll
            for (int j = 0; j < NO; ++j) {
                u32 bb[2], bs[2];
                split(vr[j * 8], bb[0], bs[0]);
                split(vr[LDV + j * 8], bb[1], bs[1]);
#pragma unroll
                for (int i = 0; i < MT; ++i) mma3_apart(o[i][j], ol[i][j], pb[i], ps[i], bb, bs);
            }
        }
    }

    if (ATTNKERN_FEAT) cp_async_wait_all();  // a block whose rows see no key loaded a tile it never waited for
    float* out = (float*)op + b * (u64)nq * D;
#pragma unroll
    for (int i = 0; i < MT; ++i) {
        const int r0 = wr0 + 16 * i + g, r1 = r0 + 8;
        const float l0 = quad_sum(l[i][0]), l1 = quad_sum(l[i][1]);
        const float inv0 = row_inverse(l0), inv1 = row_inverse(l1);
#pragma unroll
        for (int j = 0; j < NO; ++j) {
            const int col = j * 8 + 2 * t;
            const float o0 = o[i][j][0] + ol[i][j][0], o1 = o[i][j][1] + ol[i][j][1];
            const float o2 = o[i][j][2] + ol[i][j][2], o3 = o[i][j][3] + ol[i][j][3];
            if (r0 < nq) *(float2*)(out + (u64)r0 * D + col) = make_float2(o0 * inv0, o1 * inv0);
            if (r1 < nq) *(float2*)(out + (u64)r1 * D + col) = make_float2(o2 * inv1, o3 * inv1);
        }
        if (with_lse && t == 0) {
            float* lse = (float*)lsep + b * (u64)nq;
            if (r0 < nq) lse[r0] = row_lse(m[i][0], c, l0);
            if (r1 < nq) lse[r1] = row_lse(m[i][1], c, l1);
        }
    }
}
