// cuda.flash for float16 and bfloat16: the FlashAttention-2 forward on tensor cores.
//
// A CUDA C++ device function that a numba-cuda kernel calls (kernels.py,
// flash_mma_kernel): numba-cuda compiles this source with NVRTC and links it into
// the kernel, which it launches like every other kernel of attnkern. Before
// compilation kernels.py prepends the constants (kernels.MmaConfig):
//   ATTNKERN_D        the head size (D = Dv), a multiple of 16 up to 256 (the decode variant: 128)
//   ATTNKERN_BF16     1 for bfloat16, 0 for float16
//   ATTNKERN_NAME     the function's name
//   ATTNKERN_BN       keys per K/V tile
//   ATTNKERN_MT       16-row mma tiles per warp (1 or 2): a warp owns 16 MT query rows
//   ATTNKERN_NW       warps per block: a block owns BM = 16 MT NW query rows
//   ATTNKERN_QSMEM    1: Q stays in shared memory and its fragments are reloaded
//                     every tile (frees registers for large D MT); 0: they are
//                     held in registers for the whole call
//   ATTNKERN_DYNAMIC  1: shared memory is the launch's dynamic shared memory (the
//                     launch path sets the kernel's limit above 48 KB); 0: static
//   ATTNKERN_VARLEN   1 (with ATTNKERN_FEAT 1): packed sequences, grid (query blocks of the
//                     longest sequence, heads, sequences); a block past its sequence's rows
//                     returns at once (flash_common.cuh's varlen_sequence)
//   ATTNKERN_DROPOUT  1 (with ATTNKERN_FEAT 1): each P times dropout's Z after the row sums
//                     (flash_common.cuh's dropout_rows; the Hopper kernel, flash_wgmma.cu,
//                     has no dropout: cpp.py runs dropout calls here)
// and then flash_common.cuh (types, cp.async, ex2). The grid is (query blocks,
// batch), NTHREADS = 32 NW threads a block. No header is included: the
// tensor-core, shared-memory and conversion instructions are written as inline PTX.
//
// K/V tiles stream through shared memory with cp.async, double-buffered: tile
// j+1's K and V load while tile j is computed, one barrier a tile (rows padded by
// 16 bytes, so ldmatrix reads are free of bank conflicts). Per tile, each warp
// computes its 16 MT x BN raw scores with mma.sync m16n8k16 (float32
// accumulation; every K fragment loaded by ldmatrix feeds MT mma tiles), takes the
// running row max of the raw scores (reduced over the 4 lanes that share a row),
// and forms p = 2^(s c - m c) with one FFMA and ex2.approx per score,
// c = |scale| log2(e): a negative scale is applied by negating Q once. It rescales
// its output accumulators (skipped when no row max of the warp changed, the factor
// then being exactly 1) and multiplies P (rounded to the input dtype, the score
// accumulators reused as the A operand) by the V tile (ldmatrix.trans gives the B
// operand, again shared by the MT tiles). Masks are applied only on tiles that
// cross nk or an mma tile's causal diagonal; with causal masking a block stops at
// its last row, a warp skips tiles entirely above its rows, and the blocks with
// the most tiles are issued first.
//
// ATTNKERN_DECODE 1 compiles the split-K decode variant (flash-decoding; with
// ATTNKERN_FEAT 1, MT 1, QSMEM 0): a block's rows are the nq = kv_group qrows
// query rows of one k/v head's group (head h, row i as block row h qrows + i: in
// q's layout these rows are consecutive, so the group is one (nq, D) slab), the
// grid is (splits, k/v rows), and block x reads only keys [x chunk, (x + 1) chunk)
// (chunk a multiple of BN): one K/V read serves the whole group. It writes its
// rows' partial result, normalised by its own row sums, in float32 to op and its
// partial log-sum-exp (log2 domain, -inf where a row saw no key of the chunk) to
// lsep, at partial (k/v row, x); flash_combine.cu merges the partials. Its K/V tiles go
// through ATTNKERN_STAGES buffers (2: double buffering, as the other variants), STAGES - 1
// of them loading while one is computed; the depth changes no arithmetic (the same bits).
// ATTNKERN_KW (decode only; default 1): key warps. The block has NW KW warps; warp w takes row
// tile w % NW and keys [(w / NW) BN / KW, (w / NW + 1) BN / KW) of every K/V tile, so that KW
// warps compute each tile (more warps an SM for the same shared memory and bytes in flight).
// Each keeps its own running max, sums and output rows; at the end the key warps' rows are
// merged through shared memory in key-warp order (out = sum 2^(m_w c - M c) o_w, likewise the
// sums, M the largest m_w): a fixed order, so the same bits run after run.
// ATTNKERN_PREFETCH (decode only; default 0): the K/V loads' L2 prefetch size in bytes (64, 128,
// 256: PTX's .L2::NB hint on cp.async), for a cache streamed once; the same bits.
// ATTNKERN_KEYS_M (decode only, a group of at most 8 query rows, NW 1): the keys on the mma's
// M dimension and the query rows on its N (8 columns): S^T = K Q^T, 16 keys x 8 rows an mma, and
// O^T = V^T P^T, 16 head columns x 8 rows, P^T's B fragments by movmatrix from S^T's accumulators.
// A group of 4 rows fills half of each mma's columns where the row layout (16 rows an mma) fills a
// quarter: half the mma, probabilities and rescales a key. Its row sums add a lane's keys in
// another order than the row layout's, so the two layouts' bits differ; each is deterministic.
// ATTNKERN_FUSED (decode only; with ATTNKERN_UNROLL): one launch instead of two. The last block
// of a k/v row to finish (found by a per-row int32 counter in global memory, countp: zero before
// the launch, set back to zero by that block) merges the row's partials into outp (and olsep) as
// flash_combine.cu would, in chunk order: the same bits whichever block is last.

#define D ATTNKERN_D
#define BN ATTNKERN_BN
#define MT ATTNKERN_MT
#define NW ATTNKERN_NW
#define QSMEM ATTNKERN_QSMEM
#define BM (16 * MT * NW)
#if ATTNKERN_DECODE && defined(ATTNKERN_KW)
#define KW ATTNKERN_KW
#else
#define KW 1
#endif
#define BNW (BN / KW)  // keys of a K/V tile that one warp computes
#if ATTNKERN_DECODE && defined(ATTNKERN_KEYS_M) && ATTNKERN_KEYS_M
#define KEYS_M 1
#else
#define KEYS_M 0
#endif
// the K/V tiles' L2 prefetch size (flash_common.cuh's cp_async16_prefetch): decode only, 0 unless given
#if ATTNKERN_DECODE && defined(ATTNKERN_PREFETCH)
#define PREFETCH ATTNKERN_PREFETCH
#else
#define PREFETCH 0
#endif
#define NTHREADS (32 * NW * KW)
#define LD (D + 8)  // shared row stride, in elements
// K/V buffers: two (double buffering), or in the decode variant ATTNKERN_STAGES (STAGES - 1
// tiles in flight while one is computed: a block of one warp has little else to hide memory
// latency with)
#if ATTNKERN_DECODE
#define STAGES ATTNKERN_STAGES
#else
#define STAGES 2
#endif
// shared memory, in elements: [Q (BM rows) if QSMEM] [K: STAGES tiles] [V: STAGES tiles]
#define Q_ELEMS (QSMEM ? BM * LD : 0)
#define SMEM_ELEMS (Q_ELEMS + 2 * STAGES * BN * LD)

struct __align__(16) u32x4 { u32 x, y, z, w; };

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

// c (16 x 8, float32) += a (16 x 16) b (16 x 8); a pure computation, which the
// compiler may schedule freely
static __device__ __forceinline__ void mma(float* c, const u32* a, u32 b0, u32 b1) {
#if ATTNKERN_BF16
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
#else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
#endif
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#if KEYS_M
// the 8 x 8 16-bit matrix whose fragment (lane row g, columns 2t, 2t + 1) is x, transposed:
// the lane gets rows 2t and 2t + 1 of column g
static __device__ __forceinline__ u32 movmatrix_t(u32 x) {
    u32 y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

// The online softmax of one tile's raw scores in the keys-on-M layout: s[n] is the m16n8
// accumulator of S^T for keys j0 + 16 n + g (elements 0, 1) and + 8 (2, 3), block rows (query
// columns) 2t (elements 0, 2) and 2t + 1 (1, 3). Masks as softmax_tile's; m, l and a are per
// column (l: this lane's keys only, summed over the column's 8 lanes at the end); the
// probabilities leave as P^T's B fragments of O^T += V^T P^T, pb[n] (keys 0-7 and 8-15 of the
// 16, in the input dtype).
template <int NSM, bool MASK>
static __device__ __forceinline__ void softmax_tile_t(float (&s)[NSM][4], float (&m)[2], float (&l)[2], float (&a)[2],
                                                      float c, int j0, const Feat& f, u32 (&pb)[NSM][2]) {
    const float NEG_INF = neg_inf();
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int n = 0; n < NSM; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            if (ATTNKERN_FEAT && f.cap > 0.f) s[n][e] = capped(f, s[n][e]);
            if (MASK) {
                const int key = j0 + 16 * n + g + 8 * (e >> 1), row = QUERY_ROW(f, 2 * t + (e & 1));
                if (key_hidden(f, key, row))
                    s[n][e] = NEG_INF;
                else if (ATTNKERN_MASK || ATTNKERN_ALIBI)
                    s[n][e] = mask_score(f, s[n][e], key, row);
            }
            mx[e & 1] = fmaxf(mx[e & 1], s[n][e]);
        }
    }
    float mc[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        // a column's keys are spread over the 8 lanes of its t
#pragma unroll
        for (int w = 4; w < 32; w <<= 1) mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], w));
        // a row with no visible key yet keeps max -inf: its p, sums and factors stay 0
        mc[h] = mx[h] == NEG_INF ? 0.f : mx[h] * c;
        a[h] = m[h] == NEG_INF ? 0.f : ex2(m[h] * c - mc[h]);
        m[h] = mx[h];
    }
    float ps[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < NSM; ++n) {
        float p[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            p[e] = ex2(fmaf(s[n][e], c, -mc[e & 1]));
            if (MASK && s[n][e] == NEG_INF) p[e] = 0.f;  // also where c = 0
        }
        ps[0] += p[0] + p[2];
        ps[1] += p[1] + p[3];
        pb[n][0] = movmatrix_t(pack2(p[0], p[1]));
        pb[n][1] = movmatrix_t(pack2(p[2], p[3]));
    }
    l[0] = l[0] * a[0] + ps[0];
    l[1] = l[1] * a[1] + ps[1];
}

// The keys-on-M partial: this lane's columns (block rows) 2t and 2t + 1 of O^T (head columns
// 16 j + g and + 8), divided by their row sums (l: summed here over the column's 8 lanes), in
// float32 where below nq, and their log-sum-exp in the log2 domain from the lanes with g = 0
// (store_partial_rows' values in the other layout).
template <int DH>
static __device__ __forceinline__ void store_partial_cols(float* out, float* lse, const float (&o)[DH / 16][4],
                                                          const float (&l)[2], const float (&m)[2], float c, int nq) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float lh = l[h];
#pragma unroll
        for (int w = 4; w < 32; w <<= 1) lh += __shfl_xor_sync(0xffffffffu, lh, w);
        const int r = 2 * t + h;
        if (r >= nq) continue;
        const float inv = row_inverse(lh);
#pragma unroll
        for (int j = 0; j < DH / 16; ++j) {
            out[(u64)r * DH + 16 * j + g] = o[j][h] * inv;
            out[(u64)r * DH + 16 * j + g + 8] = o[j][h + 2] * inv;
        }
        if (g == 0) lse[r] = lh == 0.f ? neg_inf() : m[h] * c + lg2(lh);
    }
}
#endif

// one K or V tile of BN rows (keys j0...) into shared memory, rows past nk zero-filled. Thread
// tid copies 16-byte chunks tid, tid + NTHREADS, ... of the tile's BN D / 8 (rows of D / 8 chunks).
// The decode variant, which does little else than copy, copies a tile whose rows are all below nk
// without the per-row test and, where NTHREADS is a multiple of a row's chunks, from one base
// address at constant offsets (a fixed count of copies, unrolled), in blocks of up to 128 threads;
// its last, ragged tile, its blocks of 8 warps and the other variants take the plain loop (at their
// register limits the unrolled one spilled more in some and less in others).
static __device__ __forceinline__ void load_tile(const u16* src, u32 dst, int j0, int nk, int tid) {
    constexpr int CPR = D / 8;  // 16-byte chunks per row
    constexpr int CHUNKS = BN * CPR;
#if ATTNKERN_DECODE && defined(ATTNKERN_EVICT_FIRST)
    // the decode streams K and V through once: the L2 may evict those lines first
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
#define COPY16(to, from, bytes) cp_async16_policy<PREFETCH>(to, from, bytes, policy)
#else
#define COPY16(to, from, bytes) cp_async16_prefetch<PREFETCH>(to, from, bytes)
#endif
#if ATTNKERN_DECODE
    constexpr int ITERS = (CHUNKS + NTHREADS - 1) / NTHREADS;
    if (NTHREADS % CPR == 0 && NTHREADS <= 128 && j0 + BN <= nk) {
        // a thread's chunks share their column (tid % CPR), rows tid / CPR + NTHREADS / CPR i:
        // one source pointer and one shared address, the copies at constant offsets from them
        const int row0 = tid / CPR, col = (tid % CPR) * 8;
        const u16* from = src + (u64)(j0 + row0) * D + col;
        const u32 to = dst + (u32)(row0 * LD + col) * 2u;
#pragma unroll
        for (int i = 0; i < ITERS; ++i) {
            if (CHUNKS % NTHREADS != 0 && tid + i * NTHREADS >= CHUNKS) break;
            COPY16(to + (u32)(i * (NTHREADS / CPR) * LD * 2), from + (u64)(i * (NTHREADS / CPR)) * D, 16);
        }
        return;
    }
#endif
#pragma unroll
    for (int c = tid; c < CHUNKS; c += NTHREADS) {
        const int row = c / CPR, col = (c % CPR) * 8;
        const int key = j0 + row;
        const bool live = key < nk;
        COPY16(dst + (u32)(row * LD + col) * 2u, src + (u64)(live ? key : 0) * D + col, live ? 16 : 0);
    }
#undef COPY16
}

#if ATTNKERN_DECODE && ATTNKERN_FUSED
// the fused decode's output rows, their lse (with_lse) and its int32 counters, one a k/v row
#define DECODE_PARAMS , int qrows, int chunk, u64 outp, u64 olsep, u64 countp
#elif ATTNKERN_DECODE
#define DECODE_PARAMS , int qrows, int chunk
#else
#define DECODE_PARAMS
#endif

extern "C" __device__ void ATTNKERN_NAME(u64 qp, u64 kp, u64 vp, u64 op, u64 lsep, int nq, int nk,
                                         float scale_log2, int causal, int with_lse, FEAT_PARAMS DECODE_PARAMS) {
    constexpr int KC = D / 16;  // 16-wide chunks of the head size: the k steps of Q K^T
    constexpr int NS = BNW / 8;  // 8-key tiles of a warp's score row block
    constexpr int NO = D / 8;   // 8-column tiles of the output
    constexpr u32 TILE = BN * LD * 2;  // bytes of one K or V buffer
#if ATTNKERN_DYNAMIC
    extern __shared__ __align__(128) u16 smem[];
#else
    __shared__ __align__(128) u16 smem[SMEM_ELEMS];
#endif

    const int tid = threadIdx.x, lane = tid & 31, g = lane >> 2;
    // the warp's row tile and its share of each tile's keys (KW 1: the code without key warps)
    const int warp = KW > 1 ? (tid >> 5) % NW : tid >> 5, kw = KW > 1 ? (tid >> 5) / NW : 0;
    const u64 b = blockIdx.y;  // the batch row; in the decode variant the k/v row
#if ATTNKERN_DECODE
    const int q0 = 0;
    const u16* q = (const u16*)qp + b * (u64)nq * D;
    // the group's first query head (its heads share the key length: a sequence's heads are whole groups)
    const Feat f = make_feat(b * (u64)kv_group, qrows, nk, causal, FEAT_ARGS);
    const u64 qrow = b * (u64)nq, kvrow = f.kv_row * (u64)nk;
#elif ATTNKERN_VARLEN
    // grid (query blocks of the longest sequence, heads, sequences): this sequence's blocks only
    u64 qs, ks;
    varlen_sequence(cuqp, cukp, blockIdx.z, nq, nk, qs, ks);
    const int nblocks = (nq + BM - 1) / BM;
    if ((int)blockIdx.x >= nblocks) return;
    const int q0 = (causal ? nblocks - 1 - (int)blockIdx.x : (int)blockIdx.x) * BM;
    const u64 qrow = qs * gridDim.y + b * (u64)nq;  // this (sequence, head)'s first row of q, out and lse
    const u16* q = (const u16*)qp + qrow * D;
    Feat f = make_feat(b, nq, nk, causal, FEAT_ARGS);
    varlen_feat(f, b, blockIdx.z, qs, ks, alibip, seq_rows, alibi_unit);
    const u64 kvrow = ks * (gridDim.y / (u64)kv_group) + f.kv_row * (u64)nk;
#else
    const int q0 = block_first_row(causal, BM);
    const u64 qrow = b * (u64)nq;
    const u16* q = (const u16*)qp + qrow * D;
    const Feat f = make_feat(b, nq, nk, causal, FEAT_ARGS);
    const u64 kvrow = f.kv_row * (u64)nk;
#endif
    const u16* k = (const u16*)kp + kvrow * D;
    const u16* v = (const u16*)vp + kvrow * D;
    const int wr0 = q0 + warp * 16 * MT;  // this warp's first row; its mma tile i has rows wr0 + 16 i...
    const float NEG_INF = neg_inf();
    const float c = fabsf(scale_log2);
    const u32 sign = scale_log2 < 0.f ? 0x80008000u : 0u;  // negates both halves of a Q pair
    const u32 qs0 = smem_u32(smem), ks0 = qs0 + Q_ELEMS * 2, vs0 = ks0 + STAGES * TILE;

#if QSMEM
    // Q's BM rows into shared memory (rows past nq zero), the sign applied on the way;
    // the first tile's barrier makes them visible
    {
        constexpr int CPR = D / 8;
        for (int i = tid; i < BM * CPR; i += NTHREADS) {
            const int row = i / CPR, col = (i % CPR) * 8;
            u32x4 x = {0u, 0u, 0u, 0u};
            if (q0 + row < nq) {
                x = *(const u32x4*)(q + (u64)(q0 + row) * D + col);
                x.x ^= sign; x.y ^= sign; x.z ^= sign; x.w ^= sign;
            }
            *(u32x4*)(smem + row * LD + col) = x;
        }
    }
#elif KEYS_M
    // Q's B fragments of S^T = K Q^T (the rows on the mma's N): row g, cols 2t.. and 8+2t..
    u32 qf[KC][2];
#pragma unroll
    for (int kc = 0; kc < KC; ++kc) {
        const int col = kc * 16 + 2 * (lane & 3);
        qf[kc][0] = g < nq ? *(const u32*)(q + (u64)g * D + col) ^ sign : 0u;
        qf[kc][1] = g < nq ? *(const u32*)(q + (u64)g * D + col + 8) ^ sign : 0u;
    }
#else
    // Q's A fragments, per mma tile: (row g, cols 2t..) (row g+8, cols 2t..) (row g, cols 8+2t..)
    // (row g+8, cols 8+2t..)
    u32 qf[MT][KC][4];
#pragma unroll
    for (int i = 0; i < MT; ++i) {
        const int r0 = wr0 + 16 * i + g, r1 = r0 + 8;
#pragma unroll
        for (int kc = 0; kc < KC; ++kc) {
            const int col = kc * 16 + 2 * (lane & 3);
            qf[i][kc][0] = r0 < nq ? *(const u32*)(q + (u64)r0 * D + col) ^ sign : 0u;
            qf[i][kc][1] = r1 < nq ? *(const u32*)(q + (u64)r1 * D + col) ^ sign : 0u;
            qf[i][kc][2] = r0 < nq ? *(const u32*)(q + (u64)r0 * D + col + 8) ^ sign : 0u;
            qf[i][kc][3] = r1 < nq ? *(const u32*)(q + (u64)r1 * D + col + 8) ^ sign : 0u;
        }
    }
#endif
    // the output accumulators: O (16 rows x 8 columns a tile), or with KEYS_M O^T (16 head columns x 8 rows)
    constexpr int NOT = KEYS_M ? D / 16 : NO;
    float o[MT][NOT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NOT; ++j) o[i][j][0] = o[i][j][1] = o[i][j][2] = o[i][j][3] = 0.f;
    float m[MT][2], l[MT][2];  // running max of the raw scores (after Q's sign); the lane's partial row sums
#pragma unroll
    for (int i = 0; i < MT; ++i) m[i][0] = m[i][1] = NEG_INF, l[i][0] = l[i][1] = 0.f;

#if ATTNKERN_FEAT
#define LOAD_LEN f.len
    // the key tiles [jt0, jt1) some row of the block sees; keys past the row's length are
    // zero-filled, never read
    int jt0, jt1;
#if ATTNKERN_DECODE
    // every warp may hold every query row: the bounds of rows 0 and qrows - 1 serve, within this block's chunk
#define TILE_MASKED(i) tile_masked(f, j0, BNW, 0, qrows - 1)
    key_tiles(f, 0, qrows, qrows, BN, jt0, jt1);
    jt0 = max(jt0, (int)blockIdx.x * (chunk / BN));
    jt1 = max(jt0, min(jt1, ((int)blockIdx.x + 1) * (chunk / BN)));
#else
#define TILE_MASKED(i) tile_masked(f, j0, BN, wr0 + 16 * (i), wr0 + 16 * (i) + 15)
    key_tiles(f, q0, BM, nq, BN, jt0, jt1);
#endif

#if ATTNKERN_DECODE
    // tiles jt0 .. jt0 + STAGES - 2 in flight, one commit group each (empty past the chunk);
    // tile jt lives in buffer (jt - jt0) % STAGES
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (jt0 + s < jt1) {
            load_tile(k, ks0 + (u32)s * TILE, (jt0 + s) * BN, f.len, tid);
            load_tile(v, vs0 + (u32)s * TILE, (jt0 + s) * BN, f.len, tid);
        }
        cp_async_commit();
    }
#else
    load_tile(k, ks0 + (jt0 & 1) * TILE, jt0 * BN, f.len, tid);
    load_tile(v, vs0 + (jt0 & 1) * TILE, jt0 * BN, f.len, tid);
    cp_async_commit();
#endif
    const int jt_end = jt1;
    for (int jt = jt0; jt < jt_end; ++jt) {
#else
#define LOAD_LEN nk
#define TILE_MASKED(i) (j0 + BN > nk || (causal && j0 + BN - 1 > wr0 + 16 * (i)))
    // the plain kernel's own loop, as it was before the features (its registers are at the limit)
    const int kend = causal ? min(nk, q0 + BM) : nk;
    const int ntiles = (kend + BN - 1) / BN;

    load_tile(k, ks0, 0, nk, tid);
    load_tile(v, vs0, 0, nk, tid);
    cp_async_commit();
    const int jt_end = ntiles;
    for (int jt = 0; jt < jt_end; ++jt) {
#endif
#if ATTNKERN_DECODE
        const int jb = jt * BN;  // the tile's first key; this warp's share starts at j0
        const int j0 = jb + kw * BNW;
        const u32 slot = (u32)((jt - jt0) % STAGES);
        const u32 kb = ks0 + slot * TILE + (u32)(kw * BNW * LD * 2), vb = vs0 + slot * TILE + (u32)(kw * BNW * LD * 2);
        cp_async_wait_group<STAGES - 2>();  // the groups of the tiles after jt may stay in flight
        __syncthreads();  // tile jt is in; every warp is done with tile jt - 1, whose buffers refill now
        if (jt + STAGES - 1 < jt_end) {
            const u32 next = (u32)((jt - jt0 + STAGES - 1) % STAGES);  // tile jt - 1's buffers
            load_tile(k, ks0 + next * TILE, jb + (STAGES - 1) * BN, LOAD_LEN, tid);
            load_tile(v, vs0 + next * TILE, jb + (STAGES - 1) * BN, LOAD_LEN, tid);
        }
        cp_async_commit();  // a group every tile (empty at the end), so that the wait above counts tiles
#else
        const int j0 = jt * BN;
        const u32 kb = ks0 + (jt & 1) * TILE, vb = vs0 + (jt & 1) * TILE;
        cp_async_wait_all();
        __syncthreads();  // tile jt is in; every warp is done with tile jt - 1, whose buffers refill now
        if (jt + 1 < jt_end) {
            load_tile(k, ks0 + ((jt + 1) & 1) * TILE, j0 + BN, LOAD_LEN, tid);
            load_tile(v, vs0 + ((jt + 1) & 1) * TILE, j0 + BN, LOAD_LEN, tid);
            cp_async_commit();
        }
#endif
        // a warp none of whose rows sees a key of the tile has nothing to add
#if ATTNKERN_DECODE
        if (tile_unseen(f, j0, BNW, 0, qrows - 1)) continue;
#elif ATTNKERN_FEAT
        if (tile_unseen(f, j0, BN, wr0, wr0 + 16 * MT - 1)) continue;
#else
        if (causal && j0 > wr0 + 16 * MT - 1) continue;
#endif
#if KEYS_M
        {
            // S^T = K Q^T: keys 16 n.. of the warp's share (A: K rows from shared memory) x the rows
            constexpr int NSM = BNW / 16;
            float st[NSM][4];
#pragma unroll
            for (int n = 0; n < NSM; ++n) st[n][0] = st[n][1] = st[n][2] = st[n][3] = 0.f;
#pragma unroll
            for (int kc = 0; kc < KC; ++kc)
#pragma unroll
                for (int n = 0; n < NSM; ++n) {
                    u32 ka[4];
                    ldsm_x4(kb + (u32)((n * 16 + (lane & 15)) * LD + kc * 16 + (lane >> 4) * 8) * 2u, ka[0], ka[1],
                            ka[2], ka[3]);
                    mma(st[n], ka, qf[kc][0], qf[kc][1]);
                }
            float a[2];
            u32 pb[NSM][2];
            if (TILE_MASKED(0))
                softmax_tile_t<NSM, true>(st, m[0], l[0], a, c, j0, f, pb);
            else
                softmax_tile_t<NSM, false>(st, m[0], l[0], a, c, j0, f, pb);
            if (warp_any(a[0] != 1.f || a[1] != 1.f)) {
#pragma unroll
                for (int j = 0; j < NOT; ++j) {
                    o[0][j][0] *= a[0], o[0][j][2] *= a[0];
                    o[0][j][1] *= a[1], o[0][j][3] *= a[1];
                }
            }
            // O^T += V^T P^T: A = V^T's 16 head columns x 16 keys by ldmatrix.trans of V's rows
#pragma unroll
            for (int n = 0; n < NSM; ++n)
#pragma unroll
                for (int j = 0; j < NOT; ++j) {
                    u32 va[4];
                    const int key = n * 16 + (lane & 7) + (lane >> 4) * 8, col = j * 16 + ((lane >> 3) & 1) * 8;
                    ldsm_x4_t(vb + (u32)(key * LD + col) * 2u, va[0], va[1], va[2], va[3]);
                    mma(o[0][j], va, pb[n][0], pb[n][1]);
                }
        }
#else

        float s[MT][NS][4];
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int n = 0; n < NS; ++n) s[i][n][0] = s[i][n][1] = s[i][n][2] = s[i][n][3] = 0.f;
#pragma unroll
        for (int kc = 0; kc < KC; kc += 2) {
            // this k step's (and the next one's) A fragments of each mma tile
            u32 af[MT][2][4];
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    if (kc + h < KC) {
#if QSMEM
                        ldsm_x4(qs0 + (u32)((warp * 16 * MT + 16 * i + (lane & 15)) * LD + (kc + h) * 16 + (lane >> 4) * 8) * 2u,
                                af[i][h][0], af[i][h][1], af[i][h][2], af[i][h][3]);
#else
                        af[i][h][0] = qf[i][kc + h][0];
                        af[i][h][1] = qf[i][kc + h][1];
                        af[i][h][2] = qf[i][kc + h][2];
                        af[i][h][3] = qf[i][kc + h][3];
#endif
                    }
                }
#pragma unroll
            for (int n = 0; n < NS; ++n) {
                if (kc + 1 < KC) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4(kb + (u32)((n * 8 + (lane & 7)) * LD + kc * 16 + (lane >> 3) * 8) * 2u, b0, b1, b2, b3);
#pragma unroll
                    for (int i = 0; i < MT; ++i) {
                        mma(s[i][n], af[i][0], b0, b1);
                        mma(s[i][n], af[i][1], b2, b3);
                    }
                } else {
                    u32 b0, b1;
                    ldsm_x2(kb + (u32)((n * 8 + (lane & 7)) * LD + kc * 16 + ((lane >> 3) & 1) * 8) * 2u, b0, b1);
#pragma unroll
                    for (int i = 0; i < MT; ++i) mma(s[i][n], af[i][0], b0, b1);
                }
            }
        }

        // masks only where the tile crosses nk or an mma tile's diagonal
        float a[MT][2];      // rescale factors of the old output rows
        u32 pf[MT][NS][2];   // P in the input dtype: (row g, keys 2t..) and (row g+8, keys 2t..) per 8-key tile
        bool rescale = false;
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            const int r0 = wr0 + 16 * i + g;
            const auto emit = [&](int n, const float (&p)[4]) {
#if ATTNKERN_DROPOUT
                // after the row sums: P times dropout's Z (the lse stays the undropped softmax's)
                float z[4];
                dropout_rows(f, r0, j0 + 8 * n, z);
                pf[i][n][0] = pack2(p[0] * z[0], p[1] * z[1]);
                pf[i][n][1] = pack2(p[2] * z[2], p[3] * z[3]);
#else
                pf[i][n][0] = pack2(p[0], p[1]);
                pf[i][n][1] = pack2(p[2], p[3]);
#endif
            };
            softmax_tile_masked_if(TILE_MASKED(i), s[i], m[i], l[i], a[i], c,
                                   j0, f, r0, emit);
            rescale |= a[i][0] != 1.f || a[i][1] != 1.f;
        }
        if (warp_any(rescale)) {
#pragma unroll
            for (int i = 0; i < MT; ++i) scale_rows(o[i], a[i]);
        }

        // O += P V: the A fragment of keys 16 cc.. is the P of 8-key tiles 2 cc and 2 cc + 1
#pragma unroll
        for (int cc = 0; cc < BNW / 16; ++cc) {
#pragma unroll
            for (int j = 0; j < NO; j += 2) {
                u32 b0, b1, b2, b3;
                ldsm_x4_t(vb + (u32)((cc * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + j * 8 + (lane >> 4) * 8) * 2u,
                          b0, b1, b2, b3);
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    const u32 af[4] = {pf[i][2 * cc][0], pf[i][2 * cc][1], pf[i][2 * cc + 1][0], pf[i][2 * cc + 1][1]};
                    mma(o[i][j], af, b0, b1);
                    mma(o[i][j + 1], af, b2, b3);
                }
            }
        }
#endif
    }

    if (ATTNKERN_FEAT) cp_async_wait_all();  // a block whose rows see no key loaded a tile it never waited for
#if ATTNKERN_DECODE
#if KW > 1
    // the key warps' rows merged into key warp 0's (the K/V buffers hold them: every warp is past
    // its last tile and no load is in flight), each lane's values at [warp][value][lane]
    constexpr int VALS = NOT * 4 + 4;  // o, then m and l of the lane's two rows (KEYS_M: columns)
    // the row (KEYS_M: column) of the lane's two that accumulator element e belongs to
#define HALF(e) (KEYS_M ? (e) & 1 : (e) >> 1)
    static_assert((KW - 1) * NW * VALS * 32 * 4 <= 2 * STAGES * BN * LD * 2, "the merge's shared memory");
    float* xs = (float*)smem + (u64)Q_ELEMS / 2;
    __syncthreads();
    if (kw > 0) {
        float* mine = xs + (u64)((kw - 1) * NW + warp) * VALS * 32 + lane;
#pragma unroll
        for (int j = 0; j < NOT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) mine[(j * 4 + e) * 32] = o[0][j][e];
        mine[(NOT * 4) * 32] = m[0][0];
        mine[(NOT * 4 + 1) * 32] = m[0][1];
        mine[(NOT * 4 + 2) * 32] = l[0][0];
        mine[(NOT * 4 + 3) * 32] = l[0][1];
    }
    __syncthreads();
    // key warp 0 merges (the others wait at the fused variant's barriers below, or are done)
    if (kw == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float mx = m[0][h];
            for (int w = 1; w < KW; ++w)
                mx = fmaxf(mx, xs[((u64)((w - 1) * NW + warp) * VALS + NOT * 4 + h) * 32 + lane]);
            // a part that saw no key (max -inf) adds nothing; every factor is 0 where no part saw one
            const float mc = mx == NEG_INF ? 0.f : mx * c;
            const float a0 = m[0][h] == NEG_INF ? 0.f : ex2(m[0][h] * c - mc);
            l[0][h] *= a0;
#pragma unroll
            for (int j = 0; j < NOT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    if (HALF(e) == h) o[0][j][e] *= a0;
            for (int w = 1; w < KW; ++w) {
                const float* theirs = xs + (u64)((w - 1) * NW + warp) * VALS * 32 + lane;
                const float mw = theirs[(NOT * 4 + h) * 32];
                const float aw = mw == NEG_INF ? 0.f : ex2(mw * c - mc);
                l[0][h] = fmaf(theirs[(NOT * 4 + 2 + h) * 32], aw, l[0][h]);
#pragma unroll
                for (int j = 0; j < NOT; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (HALF(e) == h) o[0][j][e] = fmaf(theirs[(j * 4 + e) * 32], aw, o[0][j][e]);
            }
            m[0][h] = mx;
        }
    }
#endif
    // the partial of (k/v row b, split x): rows normalised by their own sums, float32
    const u64 part = b * gridDim.x + blockIdx.x;
#if KEYS_M
    if (kw == 0)
        store_partial_cols<D>((float*)op + part * (u64)nq * D, (float*)lsep + part * (u64)nq, o[0], l[0], m[0], c, nq);
#else
    if (kw == 0)
        store_partial_rows<D>((float*)op + part * (u64)nq * D, (float*)lsep + part * (u64)nq, o[0], l[0], m[0], c,
                              wr0 + g, nq);
#endif
#if ATTNKERN_FUSED
    // The last block of k/v row b to finish merges its chunks' partials into the output rows:
    // each thread's partial stores are made visible device-wide (fence) before the block counts
    // itself done on row b's counter; the block that counts last (gridDim.x - 1 before it) sees
    // every chunk's partial (fence again, then reads at L2) and merges them in chunk order
    // (combine_row: the bits of flash_combine.cu), then sets the counter back to 0 for the
    // next launch (every launch runs on the legacy default stream, one after another).
    __threadfence();
    __syncthreads();
    int* count = (int*)countp + b;
    if (!__syncthreads_or(tid == 0 && atomicAdd(count, 1) == (int)gridDim.x - 1)) return;
    __threadfence();
    for (int r = tid >> 5; r < nq; r += NTHREADS / 32)
        combine_row<D, ATTNKERN_UNROLL, true>((const float*)op + (b * gridDim.x * nq + r) * (u64)D,
                                              (const float*)lsep + b * gridDim.x * nq + r, (int)gridDim.x, nq,
                                              (u16*)outp + (b * nq + r) * (u64)D,
                                              with_lse ? (u16*)olsep + b * nq + r : nullptr);
    if (tid == 0) *count = 0;
#endif
#else  // not the decode variant: the block's rows into out (and lse)
#if ATTNKERN_WIDE
    // float32 rows and log2-domain lse, unrounded (out and lse are float32 arrays; lse given)
#pragma unroll
    for (int i = 0; i < MT; ++i) {
        store_partial_rows<D>((float*)op + b * (u64)nq * D, (float*)lsep + b * (u64)nq, o[i], l[i], m[i], c,
                              wr0 + 16 * i + g, nq);
    }
#else
    u16* out = (u16*)op + qrow * D;
#pragma unroll
    for (int i = 0; i < MT; ++i) {
        store_half_rows<D>(out, with_lse ? (u16*)lsep + qrow : nullptr, o[i], l[i], m[i], c, wr0 + 16 * i + g, nq);
    }
#endif
#endif
}
