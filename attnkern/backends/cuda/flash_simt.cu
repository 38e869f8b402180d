// cuda.flash for float32: the FlashAttention-2 forward on the CUDA cores, with
// register blocking.
//
// A CUDA C++ device function that a numba-cuda kernel calls (kernels.py,
// flash_simt_kernel), hosted like flash_mma.cu. Before compilation kernels.py
// prepends flash_common.cuh and, before that, the constants (kernels.SimtConfig):
//   ATTNKERN_NAME  the function's name
//   ATTNKERN_DP    the head size the tiles hold: d rounded up to a multiple of 4 KG
//                  (columns past d are zero)
//   ATTNKERN_BM    query rows a block
//   ATTNKERN_BN    keys a K/V tile
//   ATTNKERN_TM    query rows a thread
//   ATTNKERN_TN    keys a thread (of each tile's scores)
// A block has (BM / TM) x (BN / TN) threads: row group rg owns rows rg + RG i,
// key group kg keys kg + KG j and, for P V, output columns 4 kg + 4 KG c...
// (float4 chunks). The KG threads of a row group are consecutive lanes, so row
// maxima and sums reduce with shuffles. The arrays are float32 (batch, n, d), d a
// multiple of 4 (16-byte rows), d = dv.
//
// Q, K and V are kept row-major in shared memory (rows padded by 16 bytes, so the
// float4 reads of a warp hit distinct banks or broadcast); K/V tiles are
// double-buffered with cp.async. Per tile: S = Q K^T from float4 reads along the
// head size (TM + TN 16-byte reads per 4 TM TN FMAs), the online softmax in the
// log2 domain (scores times scale log2 e, so a negative scale needs nothing
// special), P through shared memory, O += P V from float4 reads of P's rows and
// V's columns. Masks only on tiles that cross nk or the causal diagonal; with
// causal masking a block stops at its last row and blocks with the most tiles go
// first. Every sum runs in a fixed order: results are bit-identical run to run.

#define DP ATTNKERN_DP
#define BM ATTNKERN_BM
#define BN ATTNKERN_BN
#define TM ATTNKERN_TM
#define TN ATTNKERN_TN
#define RG (BM / TM)
#define KG (BN / TN)
#define NTHREADS (RG * KG)
#define LDQ (DP + 4)  // row strides in shared memory, in floats
#define LDP (BN + 8)
#define CH (DP / (4 * KG))  // float4 output chunks a thread
#define SMEM_FLOATS (BM * LDQ + 4 * BN * LDQ + BM * LDP)

// rows r0... of a (n, d) float32 array into a shared tile of `rows` rows (stride
// LDQ), rows past n and columns past d zero-filled
static __device__ __forceinline__ void load_rows(const float* src, float* dst, int r0, int rows, int n, int d,
                                                 int tid) {
    constexpr int CPR = DP / 4;  // 16-byte chunks a row
    const u32 base = smem_u32(dst);
    for (int c = tid; c < rows * CPR; c += NTHREADS) {
        const int row = c / CPR, col = (c % CPR) * 4;
        const bool live = r0 + row < n && col < d;
        cp_async16(base + (u32)(row * LDQ + col) * 4u, src + (live ? (u64)(r0 + row) * d + col : 0), live ? 16 : 0);
    }
}

struct f4 {
    float x, y, z, w;
};

static __device__ __forceinline__ f4 lds4(const float* p) {
    f4 r;
    asm volatile("ld.shared.v4.f32 {%0,%1,%2,%3}, [%4];\n"
                 : "=f"(r.x), "=f"(r.y), "=f"(r.z), "=f"(r.w) : "r"(smem_u32(p)));
    return r;
}

extern "C" __device__ void ATTNKERN_NAME(u64 qp, u64 kp, u64 vp, u64 op, u64 lsep, int nq, int nk, int d,
                                         float scale_log2, int causal, int with_lse, FEAT_PARAMS) {
#if ATTNKERN_DYNAMIC
    extern __shared__ __align__(16) float smem[];
#else
    __shared__ __align__(16) float smem[SMEM_FLOATS];
#endif
    float* qs = smem;
    float* ks = qs + BM * LDQ;  // two K tiles, then two V tiles
    float* vs = ks + 2 * BN * LDQ;
    float* ps = vs + 2 * BN * LDQ;

    const int tid = threadIdx.x, rg = tid / KG, kg = tid % KG;
    const u64 b = blockIdx.y;
    const int q0 = block_first_row(causal, BM);
    const float* q = (const float*)qp + b * (u64)nq * d;
    const Feat f = make_feat(b, nq, nk, causal, FEAT_ARGS);  // cap in the log2 domain's units
    const float* k = (const float*)kp + f.kv_row * (u64)nk * d;
    const float* v = (const float*)vp + f.kv_row * (u64)nk * d;
    const float NEG_INF = neg_inf();
    const float c = scale_log2;

    float o[TM][CH][4];
    float m[TM], l[TM];
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        m[i] = NEG_INF;
        l[i] = 0.f;
#pragma unroll
        for (int cc = 0; cc < CH; ++cc) o[i][cc][0] = o[i][cc][1] = o[i][cc][2] = o[i][cc][3] = 0.f;
    }

    // the key tiles [jt0, jt1) some row of the block sees; keys past the row's length are
    // zero-filled, never read
    int jt0, jt1;
    key_tiles(f, q0, BM, nq, BN, jt0, jt1);
    load_rows(q, qs, q0, BM, nq, d, tid);
    load_rows(k, ks + (jt0 & 1) * BN * LDQ, jt0 * BN, BN, f.len, d, tid);
    load_rows(v, vs + (jt0 & 1) * BN * LDQ, jt0 * BN, BN, f.len, d, tid);
    cp_async_commit();
    for (int jt = jt0; jt < jt1; ++jt) {
        const int j0 = jt * BN;
        const float* kt = ks + (jt & 1) * BN * LDQ;
        const float* vt = vs + (jt & 1) * BN * LDQ;
        cp_async_wait_all();
        __syncthreads();  // tile jt (and Q) are in; tile jt - 1's K, V and P are consumed
        if (jt + 1 < jt1) {
            load_rows(k, ks + ((jt + 1) & 1) * BN * LDQ, j0 + BN, BN, f.len, d, tid);
            load_rows(v, vs + ((jt + 1) & 1) * BN * LDQ, j0 + BN, BN, f.len, d, tid);
            cp_async_commit();
        }

        // S = Q K^T for rows rg + RG i, keys kg + KG j
        float s[TM][TN];
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int j = 0; j < TN; ++j) s[i][j] = 0.f;
#pragma unroll 2
        for (int t = 0; t < DP; t += 4) {
            f4 qa[TM];
#pragma unroll
            for (int i = 0; i < TM; ++i) qa[i] = lds4(qs + (rg + RG * i) * LDQ + t);
#pragma unroll
            for (int j = 0; j < TN; ++j) {
                const f4 kb = lds4(kt + (kg + KG * j) * LDQ + t);
#pragma unroll
                for (int i = 0; i < TM; ++i) {
                    s[i][j] = fmaf(qa[i].x, kb.x, s[i][j]);
                    s[i][j] = fmaf(qa[i].y, kb.y, s[i][j]);
                    s[i][j] = fmaf(qa[i].z, kb.z, s[i][j]);
                    s[i][j] = fmaf(qa[i].w, kb.w, s[i][j]);
                }
            }
        }

        // the online softmax in the log2 domain; P into shared memory
        const bool mask = tile_masked(f, j0, BN, q0, q0 + BM - 1);
#pragma unroll
        for (int i = 0; i < TM; ++i) {
            const int row = q0 + rg + RG * i;
            float mx = m[i];
#pragma unroll
            for (int j = 0; j < TN; ++j) {
                float x = s[i][j] * c;
                if (ATTNKERN_FEAT && f.cap > 0.f) x = capped(f, x);
                if (mask) {
                    const int key = j0 + kg + KG * j;
                    if (key_hidden(f, key, row))
                        x = NEG_INF;
                    else if (ATTNKERN_MASK || ATTNKERN_ALIBI)
                        x = mask_score(f, x, key, row);
                }
                s[i][j] = x;
                mx = fmaxf(mx, x);
            }
#pragma unroll
            for (int w = 1; w < KG; w *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, w));
            // plain: mx is finite (key 0, in the first tile, is visible to every row); a
            // featured row that has seen no key yet keeps mx -inf, and its p and sums 0
            const float mref = ATTNKERN_FEAT && mx == NEG_INF ? 0.f : mx;
            const float alpha = ex2(m[i] - mref);
            m[i] = mx;
            float part = 0.f;
#pragma unroll
            for (int j = 0; j < TN; ++j) {
                const float p = ex2(s[i][j] - mref);
                part += p;
                ps[(rg + RG * i) * LDP + kg + KG * j] = p;
            }
            l[i] = l[i] * alpha + part;  // this thread's keys only; summed over the row group at the end
#pragma unroll
            for (int cc = 0; cc < CH; ++cc) {
                o[i][cc][0] *= alpha;
                o[i][cc][1] *= alpha;
                o[i][cc][2] *= alpha;
                o[i][cc][3] *= alpha;
            }
        }
        __syncthreads();  // P is complete

        // O += P V for rows rg + RG i, columns 4 kg + 4 KG cc...
#pragma unroll 2
        for (int j = 0; j < BN; j += 4) {
            f4 pa[TM];
#pragma unroll
            for (int i = 0; i < TM; ++i) pa[i] = lds4(ps + (rg + RG * i) * LDP + j);
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
#pragma unroll
                for (int cc = 0; cc < CH; ++cc) {
                    const f4 vb = lds4(vt + (j + jj) * LDQ + 4 * kg + 4 * KG * cc);
#pragma unroll
                    for (int i = 0; i < TM; ++i) {
                        const float p = jj == 0 ? pa[i].x : jj == 1 ? pa[i].y : jj == 2 ? pa[i].z : pa[i].w;
                        o[i][cc][0] = fmaf(p, vb.x, o[i][cc][0]);
                        o[i][cc][1] = fmaf(p, vb.y, o[i][cc][1]);
                        o[i][cc][2] = fmaf(p, vb.z, o[i][cc][2]);
                        o[i][cc][3] = fmaf(p, vb.w, o[i][cc][3]);
                    }
                }
            }
        }
    }

    if (ATTNKERN_FEAT) cp_async_wait_all();  // a block whose rows see no key loaded a tile it never waited for
    float* out = (float*)op + b * (u64)nq * d;
#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int row = q0 + rg + RG * i;
        float total = l[i];
#pragma unroll
        for (int w = 1; w < KG; w *= 2) total += __shfl_xor_sync(0xffffffffu, total, w);
        const float inv = row_inverse(total);
        if (row < nq) {
#pragma unroll
            for (int cc = 0; cc < CH; ++cc) {
                const int col = 4 * kg + 4 * KG * cc;
                if (col < d) {
                    float* dst = out + (u64)row * d + col;
                    asm volatile("st.global.v4.f32 [%0], {%1,%2,%3,%4};\n" ::"l"(dst), "f"(o[i][cc][0] * inv),
                                 "f"(o[i][cc][1] * inv), "f"(o[i][cc][2] * inv), "f"(o[i][cc][3] * inv));
                }
            }
            // lse = (m + log2 total) ln 2, m being the row max in the log2 domain
            if (with_lse && kg == 0) ((float*)lsep)[b * (u64)nq + row] = (m[i] + lg2(total)) * 0.6931471805599453f;
        }
    }
}
