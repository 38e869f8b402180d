// cuda.flash for float16 and bfloat16 on Hopper (sm_90a): the FlashAttention-2 forward
// (and, ATTNKERN_WS, a warp-specialized FlashAttention-3-style one, the default)
// on warpgroup MMAs (wgmma), which read Q and K (and V) straight from shared memory,
// so no K or V fragment passes through the registers, and run asynchronously, so a
// warpgroup's softmax overlaps its own products.
//
// A CUDA C++ device function that a numba-cuda kernel calls, like flash_mma.cu
// (kernels.py, flash_mma_kernel): numba-cuda compiles it with NVRTC for the device's
// arch-specific target (sm_90a on an H100), where the wgmma instructions exist.
// kernels.py prepends the constants (kernels.WgmmaConfig):
//   ATTNKERN_D        the head size (D = Dv): 64 or 128; 192 or 256 in the warp-specialized variant
//                     with 64-key tiles (its output takes D / 2 registers a thread: 128 at D = 256)
//   ATTNKERN_BF16     1 for bfloat16, 0 for float16
//   ATTNKERN_NAME     the function's name
//   ATTNKERN_BN       keys per K/V tile: 64 or 128 (the warp-specialized variant also 160, 176, 192, 256)
//   ATTNKERN_NWG      warpgroups (4 warps each) per block: a block owns BM = 64 NWG query rows
//   ATTNKERN_DYNAMIC  1: shared memory is the launch's dynamic shared memory
//   ATTNKERN_WS       1: the warp-specialized variant (below; the library's default), with
//   ATTNKERN_STAGES   its K/V ring's stages (2-6), ATTNKERN_EARLYK 1: K slots freed early,
//   ATTNKERN_PINGPONG 1: its two consumers take turns to issue their products,
//   ATTNKERN_TMA      1: its producer copies K/V tiles with the tensor memory accelerator (TMA):
//                     kp and vp are then the global addresses of K's and V's CUtensorMap
//                     (launch.TensorMap), not of their elements
//   ATTNKERN_PERSIST  1 (with ATTNKERN_TMA, plain kernels): the persistent kernel (persist_tile),
//                     one block an SM walking the (batch row, query block) tiles; its one more
//                     parameter is the batch rows. Bit-identical to the kernel without it; the static
//                     stride (1) is opt-in, the dynamic walk (2) runs plain calls where it was measured
//                     faster (cpp.persist_rule; docs/gpu-forward-grid.md)
// and then flash_common.cuh and flash_wgmma_common.cuh (the wgmma wrappers, descriptors and
// swizzled copies, shared with flash_bwd_mma.cu's Hopper kernels). The grid is (query blocks, batch).
//
// Shared memory holds Q (BM rows, loaded once, Q's sign flipped on the way for a
// negative scale) and two K and two V tiles, each in wgmma's 128-byte-swizzled
// layout: D / 64 blocks of 64 columns, each its rows of 128 bytes, the 16-byte chunk
// c of row r stored at chunk c ^ (r % 8), so that wgmma's reads of 8 rows hit distinct
// banks (its unswizzled layout of 8 x 16-byte core matrices conflicts). Eight lanes copy one row's 128 contiguous bytes (cp.async) into one 128-byte row.
// Q and K are K-major operands (the head size contiguous; a 16-column k step is 32
// bytes along the row, the next 64 columns the next block); V is P V's B operand in
// MN-major order (its columns contiguous) read transposed (imm-trans-b), 16 keys a k
// step; 8-row groups lie 1024 bytes apart in every operand.
//
// Per K/V tile a warpgroup (64 query rows) issues, per 64-key sub-tile, D/16 wgmma
// m64n64k16 for its scores (float32 accumulators, laid out as mma.sync's m16n8
// accumulators: a warp owns 16 rows), one commit group a sub-tile. Then sub-tile by
// sub-tile it waits for those scores, runs the same online softmax as flash_mma.cu
// (flash_common.cuh; masks only on sub-tiles that cross nk or a warp's causal
// diagonal), rescales the output (after the previous sub-tile's P V is in), and issues
// BN/64 x 4 wgmma m64nDk16 that add P V to the output, P rounded to the input dtype and
// held in registers as their A operand: the softmax of one sub-tile runs while the
// tensor cores finish the next one's scores and the previous one's P V. K/V tiles
// stream through shared memory with cp.async, double-buffered (tile j+1 loads while
// tile j is computed, one barrier a tile). With causal masking a block stops at its
// last row, a warpgroup skips tiles entirely above its rows, and the blocks with the
// most tiles go first.
//
// ATTNKERN_FP8 (with ATTNKERN_WS, D = 128; BN = 128 with cp.async copies, 128-192 a multiple of
// 32 with ATTNKERN_TMA): q, k and v in float8 e4m3 (one byte an element; output bfloat16), wgmma's
// k32 e4m3 instructions. Both shared operands of an 8-bit wgmma are K-major, so P V reads V
// transposed: the caller passes V^T (batch rows of D rows of vt_stride keys, a multiple of 128,
// zero past nk; flash_fp8_vt.cu makes it), each 32 keys stored in the order of the 8-bit A
// fragment. A V^T tile is VT_BLOCKS column blocks of 128 keys (D rows of 128 bytes each, as a K
// tile's rows); the TMA producer copies K as boxes of 64 16-bit units (a 128-byte row) and V^T as
// boxes of 128 keys x D rows. A thread's float32 scores of a 32-key step are the keys 2t, 2t + 1 of each
// 8-key tile (t = lane % 4); the A fragment wants its bytes 4t..4t + 3 and 16 + 4t..16 + 4t + 3.
// Calling the keys 2t, 2t + 1, 8 + 2t, 9 + 2t fragment columns 4t..4t + 3 (and 16 more for the
// other half) makes P's fragment the thread's own scores, four to a register with no shuffle,
// if V^T's columns follow that order: key 16h + 8a + 2t + b at column 16h + 4t + 2a + b (the
// caller's transpose does it at no cost). P is scaled by 2^8 before it is rounded to e4m3
// (values in [0, 256], within e4m3's 448; small probabilities keep 3 bits of mantissa down
// to 2^-14 rather than flushing below 2^-9), and the output by out_scale = descale_v / 2^8;
// scale_log2 carries descale_q descale_k. Or, descales nonzero: the address of descale_q,
// descale_k, descale_v (float32, on the device), which the consumers read and multiply in
// (scale_log2 and out_scale then without them), so that a caller's scales need no host read.
//
// ATTNKERN_WS (WgmmaConfig.stages > 0) is FlashAttention-3's design instead (the comment at
// its function has the details): a producer warpgroup copies K/V tiles into a ring of
// stages behind mbarriers, the NWG consumer warpgroups get its registers (setmaxnreg) and
// issue tile j's scores with tile j - 1's P V, running tile j's softmax while P V runs. On
// an H100 it is 1.4-1.7x the variant above (docs/results.md); dev/gpu_flash_versions.py
// compares divisions. With ATTNKERN_TMA (plain kernels; the default's) one producer thread
// copies each K or V tile as D / 64 TMA boxes (cp.async.bulk.tensor, 64 columns x BN keys,
// the 128-byte swizzle written by the copy engine, rows past nk zero-filled) counted on the
// tile's full mbarrier (expect_tx), instead of 128 threads issuing 16-byte cp.async copies:
// 3-8% faster on an H100, and 24 registers for the producer, 240 for each of two consumers.

#ifndef ATTNKERN_WS
#define ATTNKERN_WS 0
#endif
#ifndef ATTNKERN_PINGPONG
#define ATTNKERN_PINGPONG 0
#endif
#ifndef ATTNKERN_EARLYK
#define ATTNKERN_EARLYK 0
#endif
#ifndef ATTNKERN_TMA
#define ATTNKERN_TMA 0
#endif
#ifndef ATTNKERN_PERSIST
#define ATTNKERN_PERSIST 0
#endif
#if ATTNKERN_PERSIST && (!ATTNKERN_WS || !ATTNKERN_TMA || ATTNKERN_FEAT || ATTNKERN_FP8)
// the persistent walk maps a tile to its batch row and query block with no features (the plain kernel's)
#error "ATTNKERN_PERSIST: the warp-specialized variant's plain kernel with the TMA producer only (not FP8)"
#endif
#if ATTNKERN_PERSIST == 2
// the dynamic walk's tile counter (two u32 in global memory: tiles taken past the first gridDim.x,
// blocks done; zero before a launch, and zeroed again by its last block)
#define PERSIST_PARAMS , int rows, u64 counters
#elif ATTNKERN_PERSIST
#define PERSIST_PARAMS , int rows
#else
#define PERSIST_PARAMS
#endif
#if ATTNKERN_TMA && ((ATTNKERN_FEAT && !ATTNKERN_FP8) || !ATTNKERN_WS)
// the TMA fills rows past nk with zeros, not those past a sequence's key length: plain calls only
// (and FP8's featured kernel, whose only features, grouped k/v heads and bottom-right masking,
// read every key below nk)
#error "ATTNKERN_TMA: the warp-specialized variant's plain kernel only (FP8: also its featured one)"
#endif
#define D ATTNKERN_D
#if ATTNKERN_D > 128 && (!ATTNKERN_WS || ATTNKERN_BN != 64 || ATTNKERN_FP8)
// the output's D / 2 accumulators a thread leave room for 64 keys' scores only with the consumers'
// 240 registers (setmaxnreg)
#error "D = 192 or 256: the warp-specialized variant with 64-key tiles (float16/bfloat16)"
#endif
#define BN ATTNKERN_BN
#define NWG ATTNKERN_NWG
#define BM (64 * NWG)
#define ESIZE (ATTNKERN_FP8 ? 1 : 2)  // bytes an element
#define Q_BYTES (BM * D * ESIZE)
#define TILE_BYTES (BN * D * ESIZE)   // a K tile, a V tile
#if ATTNKERN_FP8
// a V^T tile: D rows of BN keys, in column blocks of 128 keys (one 128-byte swizzled row each);
// the TMA copies whole blocks, so a 160- or 192-key tile holds 256 keys' room (the last block
// partly used: its keys past BN are the next tile's, copied and never read)
#define VT_BLOCKS ((BN + 127) / 128)
#define VTILE_BYTES (D * 128 * VT_BLOCKS)
#if !ATTNKERN_WS || D != 128 || BN % 32 || (!ATTNKERN_TMA && BN != 128) || BN > 192
#error "the FP8 variant is the warp-specialized one at D = 128: 128-key tiles with cp.async copies, 128-192 (a multiple of 32) with the TMA"
#endif
#define FP8_PARAMS , float out_scale, int vt_stride, u64 descales
#define SIGN_BITS 0x80808080u  // negates the four e4m3 values of a word
#define P_SCALE 256.f          // P's factor before its rounding to e4m3
// the factor P still takes here: none where softmax_tile hands it out scaled (ATTNKERN_FP8_EXP),
// whose row sums are then 2^8 too, undone before the output's store
#define P_MUL (ATTNKERN_FP8_EXP ? 1.f : P_SCALE)
// ATTNKERN_FP8_PACK (with ATTNKERN_FP8_EXP > 0, whose probabilities come out already scaled):
// 0 rounds P to e4m3 after the pending P V is in (its A fragment registers are then free), a
// serial stretch between the softmax and the next turn; 1 rounds each 16 keys' probabilities as
// the softmax makes them (cvt.rn.satfinite.e4m3x2.f32, the same bits as 0) into a second set of
// fragment registers, copied into the fragment once the pending P V is in, so that the
// conversions issue among the softmax's exponentials; 2 as 1, by integer operations instead of
// cvt (pack4_e4m3_int: the same values, ties rounded away from zero rather than to even)
#ifndef ATTNKERN_FP8_PACK
#define ATTNKERN_FP8_PACK 0
#endif
#if ATTNKERN_FP8_PACK && !ATTNKERN_FP8_EXP
#error "ATTNKERN_FP8_PACK: with ATTNKERN_FP8_EXP (probabilities handed out times 2^8)"
#endif
#else
#define FP8_PARAMS
#define SIGN_BITS 0x80008000u  // negates both halves of a pair
#define VTILE_BYTES TILE_BYTES
#endif
#if ATTNKERN_WS
#define STAGES ATTNKERN_STAGES
#define NTHREADS (128 * (NWG + 1))  // NWG consumer warpgroups and one producer warpgroup
// Q, STAGES K and V tiles, room to align to 1024 bytes, and 4 STAGES mbarriers
#define SMEM_BYTES (Q_BYTES + STAGES * (TILE_BYTES + VTILE_BYTES) + 1024 + 32 * STAGES + (ATTNKERN_PERSIST == 2 ? 48 : 0))
#else
#define NTHREADS (128 * NWG)
#define SMEM_BYTES (Q_BYTES + 4 * TILE_BYTES + 1024)  // + room to align to 1024 bytes
#endif

#define NSUB (BN / 64)  // 64-key sub-tiles of a K/V tile

struct __align__(16) u32x4 { u32 x, y, z, w; };

// one K or V tile of BN rows (keys j0...) into shared memory, rows past nk zero-filled,
// by THREADS threads (tid 0...); the warp-specialized producer copies a whole tile at constant
// offsets (load_whole)
template <int THREADS = NTHREADS>
static __device__ __forceinline__ void load_tile(const u16* src, u32 dst, int j0, int nk, int tid) {
    if constexpr (ATTNKERN_WS)
        load_whole<BN, THREADS>(src, dst, j0, nk, tid);
    else
        load_swizzled<BN, THREADS>(src, dst, j0, nk, tid);
}

// chunk i (16 bytes) of the rows r0...r0 + ROWS - 1 of Q's block rows q0... (zero past nq), the sign
// applied (load_q)
template <int ROWS>
static __device__ __forceinline__ u32x4 q_chunk(const u16* q, int q0, int r0, int nq, u32 sign, int i) {
    const int r = r0 + chunk_row<ROWS>(i), row = q0 + r;
    u32x4 x = {0u, 0u, 0u, 0u};
    if (row < nq) {
        x = *(const u32x4*)(q + (u64)row * ROW16 + chunk_col<ROWS>(i));
        x.x ^= sign; x.y ^= sign; x.z ^= sign; x.w ^= sign;
    }
    return x;
}

// chunk i of those rows into the swizzled BM-row Q buffer at qs
template <int ROWS>
static __device__ __forceinline__ void store_q_chunk(u32 qs, int r0, int i, const u32x4& x) {
    const int r = r0 + chunk_row<ROWS>(i), ch = i & 7;
    const u32 at = qs + (u32)((i / (ROWS * 8)) * BM * 128 + r * 128 + ((ch ^ (r & 7)) << 4));
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(at), "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w));
}

// Q's rows r0...r0 + ROWS - 1 of the block's BM (block rows q0...; rows past nq zero) into
// the swizzled BM-row Q buffer at qs, Q's sign flipped on the way (sign: SIGN_BITS or 0),
// by THREADS threads (tid 0...)
template <int ROWS, int THREADS>
static __device__ __forceinline__ void load_q(const u16* q, u32 qs, int q0, int r0, int nq, u32 sign, int tid) {
    for (int i = tid; i < ROWS * ROW16 / 8; i += THREADS) store_q_chunk<ROWS>(qs, r0, i, q_chunk<ROWS>(q, q0, r0, nq, sign, i));
}

// a lane's output rows r0 and r0 + 8 of batch row b (and their lse) into out (and lse)
static __device__ __forceinline__ void store_rows(u64 op, u64 lsep, u64 b, int nq, int with_lse,
                                                  const float (&o)[D / 8][4], const float (&l)[2],
                                                  const float (&m)[2], float c, int r0) {
#if ATTNKERN_WIDE
    // float32 rows and log2-domain lse, unrounded (out and lse are float32 arrays; lse given)
    store_partial_rows<D>((float*)op + b * (u64)nq * D, (float*)lsep + b * (u64)nq, o, l, m, c, r0, nq);
#else
    u16* out = (u16*)op + b * (u64)nq * D;
    store_half_rows<D>(out, with_lse ? (u16*)lsep + b * (u64)nq : nullptr, o, l, m, c, r0, nq);
#endif
}

#if !ATTNKERN_WS
extern "C" __device__ void ATTNKERN_NAME(u64 qp, u64 kp, u64 vp, u64 op, u64 lsep, int nq, int nk,
                                         float scale_log2, int causal, int with_lse, FEAT_PARAMS) {
    constexpr int NO = D / 8;  // 8-column tiles of the output
#if ATTNKERN_DYNAMIC
    extern __shared__ __align__(1024) u16 smem[];
#else
    __shared__ __align__(1024) u16 smem[SMEM_BYTES / 2];
#endif

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2;
    const int wg = warp >> 2;  // this thread's warpgroup
    const u64 b = blockIdx.y;
    const int q0 = block_first_row(causal, BM);
    const u16* q = (const u16*)qp + b * (u64)nq * D;
    const Feat f = make_feat(b, nq, nk, causal, FEAT_ARGS);
    const u16* k = (const u16*)kp + f.kv_row * (u64)nk * D;
    const u16* v = (const u16*)vp + f.kv_row * (u64)nk * D;
    const int g0 = q0 + 64 * wg;          // the warpgroup's first row
    const int wr0 = g0 + 16 * (warp & 3);  // the warp's first row: it owns rows wr0 + g and wr0 + g + 8
    const float c = fabsf(scale_log2);
    const u32 sign = scale_log2 < 0.f ? SIGN_BITS : 0u;  // negates Q
    const u32 qs0 = (smem_u32(smem) + 1023u) & ~1023u, ks0 = qs0 + Q_BYTES, vs0 = ks0 + 2 * TILE_BYTES;

    // Q's BM rows (rows past nq zero), the sign applied on the way; the first tile's
    // proxy fence and barrier make them visible to wgmma
    load_q<BM, NTHREADS>(q, qs0, q0, 0, nq, sign, tid);

    float o[NO][4];
#pragma unroll
    for (int j = 0; j < NO; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};  // running max of the raw scores; this lane's partial row sums

    // the key tiles [jt0, jt1) some row of the block sees; keys past the row's length are
    // zero-filled, never read
    int jt0, jt1;
    key_tiles(f, q0, BM, nq, BN, jt0, jt1);

    load_tile(k, ks0 + (jt0 & 1) * TILE_BYTES, jt0 * BN, f.len, tid);
    load_tile(v, vs0 + (jt0 & 1) * TILE_BYTES, jt0 * BN, f.len, tid);
    cp_async_commit();
    for (int jt = jt0; jt < jt1; ++jt) {
        const int j0 = jt * BN;
        const u32 kb = ks0 + (jt & 1) * TILE_BYTES, vb = vs0 + (jt & 1) * TILE_BYTES;
        cp_async_wait_all();
        fence_async_shared();
        __syncthreads();  // tile jt is in; every warpgroup is done with tile jt - 1, whose buffers refill now
        if (jt + 1 < jt1) {
            load_tile(k, ks0 + ((jt + 1) & 1) * TILE_BYTES, j0 + BN, f.len, tid);
            load_tile(v, vs0 + ((jt + 1) & 1) * TILE_BYTES, j0 + BN, f.len, tid);
            cp_async_commit();
        }
        // a warpgroup none of whose rows sees a key of the tile has nothing to add
        if (tile_unseen(f, j0, BN, g0, g0 + 63)) continue;

        // S = Q K^T, one commit group per 64-key sub-tile: D/16 steps of 16 along the head size
        float s[NSUB][8][4];
        wgmma_fence();
#pragma unroll
        for (int u = 0; u < NSUB; ++u) {
#pragma unroll
            for (int kc = 0; kc < D / 16; ++kc)
                wgmma_ss(s[u], kmajor<BM>(qs0, 64 * wg, kc), kmajor<BN>(kb, 64 * u, kc), kc);
            wgmma_commit();
        }
        // sub-tile by sub-tile: its softmax runs while the tensor cores still compute the
        // next sub-tile's scores and the previous one's P V
        u32 pf[NSUB][8][2];  // P in the input dtype: (row g, keys 2t..) and (row g+8, keys 2t..) per 8-key tile
#pragma unroll
        for (int u = 0; u < NSUB; ++u) {
            // pending behind sub-tile u's scores: the later sub-tiles' scores and sub-tile u - 1's
            // P V, NSUB - 1 groups for either sub-tile of a 128-key tile
            static_assert(NSUB == 1 || NSUB == 2, "BN = 64 or 128");
            wgmma_wait<NSUB - 1>();
            pin(s[u]);
            const int ju = j0 + 64 * u;
            float a[2];  // rescale factors of the old output rows
            const auto emit = [&](int n, const float (&p)[4]) {
                pf[u][n][0] = pack2(p[0], p[1]);
                pf[u][n][1] = pack2(p[2], p[3]);
            };
            softmax_tile_masked_if(tile_masked(f, ju, 64, wr0, wr0 + 15), s[u], m, l, a, c, ju, f, wr0 + g, emit);
            if (u > 0) wgmma_wait<0>();  // sub-tile u - 1's P V is in o
            pin(o);
            if (warp_any(a[0] != 1.f || a[1] != 1.f)) scale_rows(o, a);
            // O += P V: the A fragment of keys 16 cc.. is the P of 8-key tiles 2 cc and 2 cc + 1
            pin(o);
            pin(pf[u]);
            wgmma_fence();
#pragma unroll
            for (int cc = 0; cc < 4; ++cc) {
                const u32 af[4] = {pf[u][2 * cc][0], pf[u][2 * cc][1], pf[u][2 * cc + 1][0], pf[u][2 * cc + 1][1]};
                wgmma_rs(o, af, mndesc<BN>(vb, 4 * u + cc));
            }
            wgmma_commit();
        }
        wgmma_wait<0>();  // every warpgroup is done with this tile's V before the next barrier
        pin(o);
    }

    if (ATTNKERN_FEAT) cp_async_wait_all();  // a block whose rows see no key loaded a tile it never waited for
    store_rows(op, lsep, b, nq, with_lse, o, l, m, c, wr0 + g);
}
#else  // ATTNKERN_WS

// ---------------------------------------------------------------- mbarriers, register reallocation

static __device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

static __device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// the arrival of this thread on bar once its cp.async copies issued so far have landed
// (noinc: the arrival counts as one of the phase's expected ones)
static __device__ __forceinline__ void mbar_arrive_cp_async(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// until the phase of parity `parity` of bar has completed
static __device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    asm volatile("{\n.reg .pred done;\nwait_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra wait_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}

// a barrier of the `threads` threads (whole warps) that name barrier `id` (1...15; 0 is __syncthreads')
static __device__ __forceinline__ void named_barrier(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

template <int N>
static __device__ __forceinline__ void regs_down() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
static __device__ __forceinline__ void regs_up() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }

// Registers a thread after the reallocation: the producer warpgroup gives its registers to the
// consumers' accumulators (the SM's 64K registers: 128 PRODUCER_REGS + 128 NWG CONSUMER_REGS); a
// TMA producer (one thread issuing whole tiles) needs the fewest setmaxnreg allows
#if ATTNKERN_TMA
#define PRODUCER_REGS 24
#define CONSUMER_REGS (NWG == 2 ? 240 : 160)
#else
#define PRODUCER_REGS 40
#define CONSUMER_REGS (NWG == 2 ? 232 : 152)
#endif

// ---------------------------------------------------------------- the tensor memory accelerator (TMA)

// one arrival on bar that also expects `bytes` more bytes of asynchronous copies (complete_tx)
// before the phase completes
static __device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// the box at coordinates (c0, c1, c2) of the 3-D tensor map at global address map into shared
// memory at dst (the map's 128-byte swizzle applied), its bytes counted on bar when they land
static __device__ __forceinline__ void tma_load_3d(u32 dst, u64 map, int c0, int c1, int c2, u32 bar) {
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
                 "[%0], [%1, {%2, %3, %4}], [%5];\n"
                 ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}

// the host's writes of the tensor map at map (a copy into global memory before the launch)
// ordered before this thread's TMA reads of it
static __device__ __forceinline__ void tma_map_acquire(u64 map) {
    asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(map) : "memory");
}

// The warp-specialized variant (ATTNKERN_WS, FlashAttention-3's design): warpgroup 0 is the
// producer, which only copies K and V tiles (cp.async, 16 bytes a thread) into a ring of STAGES
// stages, announcing each tile's K and V on their own mbarriers (full_k, full_v: the copies'
// arrivals, 128 a phase) and waiting for the consumers to free a K or V slot (empty_k, empty_v:
// 128 NWG arrivals) before it refills it; no block-wide barrier after the start. ATTNKERN_EARLYK:
// a consumer frees tile j's K as soon as S_j is in, and the producer copies K_{j+1} before V_j
// (the order the consumers need them in), so that K is copied a tile ahead of V; else both
// slots are freed once P_j V_j is in and K_j, V_j are copied in turn. Warpgroups 1..NWG are consumers
// of 64 query rows each (Q loaded by themselves, sign flipped), with the producer's registers
// (setmaxnreg). Each consumer pipelines across tiles: it issues S_j = Q K_j^T, then P_{j-1} V_{j-1}
// (P of the tile before, held in registers), waits for S_j only, runs its softmax while the
// tensor cores still add P_{j-1} V_{j-1}, then waits for that, frees tile j - 1's stage,
// rescales the output and rounds P_j. The softmax is the same as the other variant's
// (flash_common.cuh), over BN keys at once.
#if ATTNKERN_FP8
// the D rows of V^T's BN keys j0... (columns of rows of vt_stride bytes, all inside) into the
// swizzled tile at dst: a row of 128 bytes, 8 chunks, by the producer's 128 threads
static __device__ __forceinline__ void load_vt(const unsigned char* vt, u32 dst, int j0, int vt_stride, int tid) {
    const int ch = tid & 7;
#pragma unroll
    for (int r = tid >> 3; r < D; r += 16)
        cp_async16(dst + r * 128 + ((ch ^ (r & 7)) << 4), vt + (u64)r * vt_stride + j0 + ch * 16, 16);
}

// four float32 values as e4m3 (round to nearest, saturating), the first in the lowest byte
static __device__ __forceinline__ u32 pack4_e4m3(float a, float b, float c, float d) {
    u32 r;
    asm("{\n.reg .b16 lo, hi;\ncvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\ncvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n"
        "mov.b32 %0, {lo, hi};\n}\n" : "=r"(r) : "f"(a), "f"(b), "f"(c), "f"(d));
    return r;
}

// x in [0, 448) as an e4m3 code by integer operations (ATTNKERN_FP8_PACK 2): x 2^-120 (mul.rn
// without ftz, exact) puts e4m3's smallest normal 2^-6 on float32's 2^-126, so that the bits above
// the low 20 are e4m3's exponent and 3 mantissa bits, and e4m3's subnormals float32's; adding
// 2^19 rounds to nearest (ties away from zero, where cvt's go to even). The softmax's probabilities
// times 2^8 are at most 256 (0x78); a NaN (a bad device descale) gives a wrong code, but its row
// sum is NaN too, so the output is NaN as with cvt.
static __device__ __forceinline__ u32 e4m3_code(float x) {
    float y;
    asm("mul.rn.f32 %0, %1, 0f03800000;\n" : "=f"(y) : "f"(x));  // 2^-120
    return (__float_as_uint(y) + 0x80000u) >> 20;
}

static __device__ __forceinline__ u32 pack4_e4m3_int(float a, float b, float c, float d) {
    return e4m3_code(a) | e4m3_code(b) << 8 | e4m3_code(c) << 16 | e4m3_code(d) << 24;
}

// P's four e4m3 values of a fragment register, the variant's way (ATTNKERN_FP8_PACK)
static __device__ __forceinline__ u32 pack4_p(float a, float b, float c, float d) {
    return ATTNKERN_FP8_PACK == 2 ? pack4_e4m3_int(a, b, c, d) : pack4_e4m3(a, b, c, d);
}
#endif

// a tile's features f and the key tiles [jt0, jt1) some row of its block sees, in this order
// through the ring (b and q0 its batch row and first query row)
#if ATTNKERN_FP8
#define TILE_V const unsigned char* v = (const unsigned char*)vp + f.kv_row * (u64)D * vt_stride;
#else
#define TILE_V const u16* v = (const u16*)vp + f.kv_row * (u64)nk * D;
#endif
// (k and v: its K and V rows, for cp.async copies)
#define TILE_FEAT                                               \
    const Feat f = make_feat(b, nq, nk, causal, FEAT_ARGS);     \
    const u16* k = (const u16*)kp + f.kv_row * (u64)nk * ROW16; \
    TILE_V
#define TILE_KEYS \
    int jt0, jt1; \
    key_tiles(f, q0, BM, nq, BN, jt0, jt1);
#if ATTNKERN_PERSIST
// The persistent kernel (ATTNKERN_PERSIST; the host launches one block an SM, at most one a tile):
// block x computes the (batch row, query block) tiles t = x, x + gridDim.x, ... of the nqb rows
// query blocks (a static stride), one after the other in the same warpgroups, its K/V ring and
// ping-pong turns running on from tile to tile: the producer copies the next tile's first K/V tiles
// while the consumers finish this one, and a consumer loads its next Q rows while it stores its
// output. A tile's arithmetic is the other kernel's for the same block, so the results are
// bit-identical. Without causal masking tile t is query block t % nqb of row t / nqb (a row's blocks
// run side by side, sharing K/V's reads in L2). With it, the rows go in groups of about 16 MB of K and
// V and within a group the blocks with the most keys (the last) come first, every row's in turn,
// so that the walk ends on the shortest blocks and the SMs finish together.
static __device__ __forceinline__ void persist_tile(int t, int nqb, int rows, int nk, int causal, u64& b, int& q0) {
    if (!causal) {
        b = (u64)(t / nqb);
        q0 = (t % nqb) * BM;
        return;
    }
    const int group = (int)max((u64)1, (16ull << 20) / ((u64)max(nk, 1) * D * 4));  // rows of ~16 MB of K and V
    const int first = t / (group * nqb) * group, n = min(group, rows - first), i = t - first * nqb;
    b = (u64)(first + i % n);
    q0 = (nqb - 1 - i / n) * BM;
}
// TILES_BEGIN { the body of one tile } TILES_END: the tiles of this block, each with its batch row b,
// first query row q0, its features f, the key tiles [jt0, jt1) some row of the block sees (in this
// order through the ring), ring (the ring index of its first K/V tile), first_tile and more (a tile
// follows). TILE (the other kernel's one tile, the grid's (query block, batch row)) declares them
// at the start.
#define TILE_ROW
#define TILE
#define TILES_BEGIN                                                                    \
    for (int tile = blockIdx.x, ring = 0; tile < nqb * rows; tile += gridDim.x) {      \
        u64 b;                                                                         \
        int q0;                                                                        \
        persist_tile(tile, nqb, rows, nk, causal, b, q0);                              \
        const bool first_tile = tile == (int)blockIdx.x, more = tile + (int)gridDim.x < nqb * rows; \
        TILE_FEAT                                                                      \
        TILE_KEYS
#define TILES_END \
    ring += jt1 - jt0; \
    }
#define NEXT_TILE (tile + (int)gridDim.x)
#define FETCH_NEXT
#if ATTNKERN_PERSIST == 2
// The dynamic walk (ATTNKERN_PERSIST 2): a block takes its next tile from the counter (atomicAdd) once
// its producer has issued a tile's copies (STAGES K/V tiles before its consumers finish it, which
// hides the atomic's latency), so that the blocks take tiles in order as they free up (the
// hardware's block order: causal blocks of unequal length balance, and the blocks at work stay on
// neighbouring tiles, whose K/V rows L2 holds). The producer hands each tile's index to the consumers
// through a slot of shared memory behind an mbarrier (tile_full; tile_empty: the consumers have read
// it), two slots; the consumers read the next tile's index at the end of a tile (FETCH_NEXT: `more`,
// and the next Q rows).
#undef TILES_BEGIN
#undef TILES_END
#undef NEXT_TILE
#undef FETCH_NEXT
#define PRODUCER_TILES_BEGIN                                                           \
    for (int n = 0, tile = blockIdx.x, ring = 0;; ++n) {                               \
        publish(n, tile);                                                              \
        if (tile >= nqb * rows) break;                                                 \
        u64 b;                                                                         \
        int q0;                                                                        \
        persist_tile(tile, nqb, rows, nk, causal, b, q0);                              \
        TILE_FEAT                                                                      \
        TILE_KEYS
#define PRODUCER_TILES_END                                 \
    ring += jt1 - jt0;                                     \
    tile = gridDim.x + atomicAdd((unsigned*)counters, 1u); \
    }
#define TILES_BEGIN                                                                    \
    for (int n = 0, tile = take(0), ring = 0, next = 0; tile < nqb * rows; ++n) {      \
        u64 b;                                                                         \
        int q0;                                                                        \
        persist_tile(tile, nqb, rows, nk, causal, b, q0);                              \
        const bool first_tile = n == 0;                                                \
        bool more = false;                                                             \
        TILE_FEAT                                                                      \
        TILE_KEYS
#define TILES_END      \
    ring += jt1 - jt0; \
    tile = next;       \
    }
#define NEXT_TILE next
#define FETCH_NEXT              \
    next = take(n + 1);         \
    more = next < nqb * rows;
#else
#define PRODUCER_TILES_BEGIN TILES_BEGIN
#define PRODUCER_TILES_END TILES_END
#endif
#else
#define TILE_ROW                                \
    const u64 b = blockIdx.y;                   \
    const int q0 = block_first_row(causal, BM); \
    TILE_FEAT
#define TILE                \
    TILE_KEYS               \
    constexpr int ring = 0; \
    constexpr bool first_tile = true, more = false;
#define TILES_BEGIN {
#define TILES_END }
#define PRODUCER_TILES_BEGIN {
#define PRODUCER_TILES_END }
#define FETCH_NEXT
#endif

extern "C" __device__ void ATTNKERN_NAME(u64 qp, u64 kp, u64 vp, u64 op, u64 lsep, int nq, int nk,
                                         float scale_log2, int causal, int with_lse,
                                         FEAT_PARAMS FP8_PARAMS PERSIST_PARAMS) {
    constexpr int NO = D / 8, NS = BN / 8;  // 8-column tiles of the output and of a tile's scores
    constexpr int NP = ATTNKERN_FP8 ? NS / 2 : NS;  // pairs of P words: 8 keys (16-bit), 16 keys (FP8)
    extern __shared__ __align__(1024) u16 smem[];

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2;
    // 0: the producer, 1..NWG: the consumers; broadcast from lane 0, so that the compiler knows it
    // uniform across the warp (else it serializes the wgmma in the consumers' branch)
    const int wg = __shfl_sync(0xffffffffu, warp >> 2, 0);
#if ATTNKERN_PERSIST
    const int nqb = (nq + BM - 1) / BM;  // query blocks a batch row
#endif
    TILE_ROW
    const u32 qs0 = (smem_u32(smem) + 1023u) & ~1023u, ks0 = qs0 + Q_BYTES, vs0 = ks0 + STAGES * TILE_BYTES;
    const u32 full_k = vs0 + STAGES * VTILE_BYTES, full_v = full_k + 8 * STAGES, empty_k = full_v + 8 * STAGES,
              empty_v = empty_k + 8 * STAGES;
#if ATTNKERN_PERSIST == 2
    // the dynamic walk's two tile slots: their mbarriers (the index written; read by the consumers) and indices
    const u32 tile_full = empty_v + 8 * STAGES, tile_empty = tile_full + 16, tile_slot = tile_empty + 16;
    // tile index n of this block into its slot, once the consumers have read the one before in it
    const auto publish = [&](int n, int t) {
        mbar_wait(tile_empty + 8 * (n & 1), ((n >> 1) & 1) ^ 1);
        asm volatile("st.shared.s32 [%0], %1;\n" ::"r"(tile_slot + 4 * (n & 1)), "r"(t) : "memory");
        mbar_arrive(tile_full + 8 * (n & 1));
    };
    // tile index n, read by a consumer thread (which then frees the slot)
    const auto take = [&](int n) {
        mbar_wait(tile_full + 8 * (n & 1), (n >> 1) & 1);
        int t;
        asm volatile("ld.shared.s32 %0, [%1];\n" : "=r"(t) : "r"(tile_slot + 4 * (n & 1)) : "memory");
        mbar_arrive(tile_empty + 8 * (n & 1));
        return t;
    };
#endif

    if (tid == 0) {
        for (int s = 0; s < STAGES; ++s) {
            // the producer's copies arrive: 128 threads' cp.async, or one thread's expect_tx
            mbar_init(full_k + 8 * s, ATTNKERN_TMA ? 1 : 128);
            mbar_init(full_v + 8 * s, ATTNKERN_TMA ? 1 : 128);
            mbar_init(empty_k + 8 * s, 128 * NWG);
            mbar_init(empty_v + 8 * s, 128 * NWG);
        }
#if ATTNKERN_PERSIST == 2
        for (int s = 0; s < 2; ++s) {
            mbar_init(tile_full + 8 * s, 1);
            mbar_init(tile_empty + 8 * s, 128 * NWG);
        }
#endif
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    TILE

    if (wg == 0) {
        regs_down<PRODUCER_REGS>();
        // tile jt's K (V) into its stage once the slot's last tile is freed (a fresh one passes)
#if ATTNKERN_TMA
        // by one thread: per tile and stage one expect_tx arrival (the tile's bytes) and D / 64 boxes
        // of 64 columns x BN keys of the tensor map (head size, keys, batch rows), which the TMA
        // writes in the wgmma layout (its 128-byte swizzle) and zero-fills past nk
        if (tid != 0) return;
        tma_map_acquire(kp);
        tma_map_acquire(vp);
#endif
        PRODUCER_TILES_BEGIN
#if ATTNKERN_TMA
        const int kv_row = (int)f.kv_row;
        const u64 ksrc = kp, vsrc = vp;
        const auto load = [&](u64 map, u32 buf, u32 empty, u32 full, int jt) {
            const int i = ring + jt - jt0, s = i % STAGES;
            mbar_wait(empty + 8 * s, ((i / STAGES) & 1) ^ 1);
#if ATTNKERN_FP8
            if (buf == vs0) {  // V^T (known at each inlined call): VT_BLOCKS boxes of 128 keys x D rows,
                // the map's columns 16-bit pairs of keys (fp8_vt_map), zeros past its padded length
                mbar_arrive_expect_tx(full + 8 * s, VTILE_BYTES);
#pragma unroll
                for (int cb = 0; cb < VT_BLOCKS; ++cb)
                    tma_load_3d(buf + s * VTILE_BYTES + cb * D * 128, map, (jt * BN) / 2 + 64 * cb, 0, kv_row,
                                full + 8 * s);
                return;
            }
#endif
            mbar_arrive_expect_tx(full + 8 * s, TILE_BYTES);
#pragma unroll
            for (int cb = 0; cb < ROW16 / 64; ++cb)  // a K row of FP8 is one box of 64 16-bit units
                tma_load_3d(buf + s * TILE_BYTES + cb * BN * 128, map, 64 * cb, jt * BN, kv_row, full + 8 * s);
        };
#else
        // by the warpgroup's 128 threads, whose copies' completions arrive on the full mbarrier
        // (no generic lambda: NVRTC's JIT mode takes their templated call operators for host functions)
        const void *ksrc = k, *vsrc = v;
        const auto load = [&](const void* src, u32 buf, u32 empty, u32 full, int jt) {
            const int i = ring + jt - jt0, s = i % STAGES;
            mbar_wait(empty + 8 * s, ((i / STAGES) & 1) ^ 1);
#if ATTNKERN_FP8
            if (buf == vs0)  // V^T (FP8); known at each inlined call
                load_vt((const unsigned char*)src, buf + s * VTILE_BYTES, jt * BN, vt_stride, tid);
            else
#endif
                load_tile<128>((const u16*)src, buf + s * TILE_BYTES, jt * BN, f.len, tid);
            mbar_arrive_cp_async(full + 8 * s);
        };
#endif
        if (ATTNKERN_EARLYK && jt0 < jt1) load(ksrc, ks0, empty_k, full_k, jt0);
        for (int jt = jt0; jt < jt1; ++jt) {
            if (!ATTNKERN_EARLYK)
                load(ksrc, ks0, empty_k, full_k, jt);
            else if (jt + 1 < jt1)
                load(ksrc, ks0, empty_k, full_k, jt + 1);
            load(vsrc, vs0, empty_v, full_v, jt);
        }
        PRODUCER_TILES_END
#if ATTNKERN_PERSIST == 2
        // every tile this block took is taken: the last block done zeroes the counter for the next launch
        __threadfence();
        if (atomicAdd((unsigned*)counters + 1, 1u) == gridDim.x - 1) {
            atomicExch((unsigned*)counters, 0u);
            atomicExch((unsigned*)counters + 1, 0u);
        }
#endif
        if (!ATTNKERN_TMA) cp_async_wait_all();  // tiles the consumers skip are never waited for
        return;
    }
    regs_up<CONSUMER_REGS>();

    const int cw = wg - 1, ct = tid - 128 * wg;  // the consumer's index and its thread's
    float c = fabsf(scale_log2);
    const u32 sign = scale_log2 < 0.f ? SIGN_BITS : 0u;  // negates Q
#if ATTNKERN_FP8
    if (descales) {  // descale_q, descale_k, descale_v as 3 float32 in device memory (no host read)
        const float* ds = (const float*)descales;
        const float dq = ds[0], dk = ds[1], dv = ds[2];
        // a descale that is not positive and finite makes every output NaN, which check_finite reports
        const float inf = -neg_inf();
        const bool ok = dq > 0.f && dk > 0.f && dv > 0.f && dq * dk < inf && dv < inf;  // (NaN fails each)
        c = ok ? c * (dq * dk) : __int_as_float(0x7fffffff);
        out_scale *= dv;
    }
#endif

    TILES_BEGIN
    const int g0 = q0 + 64 * cw;          // the consumer's first row
    const int wr0 = g0 + 16 * (warp & 3);  // the warp's first row: it owns rows wr0 + g and wr0 + g + 8
    if (first_tile) {  // (a later tile's Q rows were loaded during the tile before's store)
        load_q<64, 128>((const u16*)qp + b * (u64)nq * ROW16, qs0, q0, 64 * cw, nq, sign, ct);
        fence_async_shared();
        named_barrier(1 + cw, 128);  // the consumer's Q rows are in, visible to its wgmma
    }

    float o[NO][4];
#pragma unroll
    for (int j = 0; j < NO; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};  // running max of raw scores; lane's partial row sums

    // P of the pending tile in the input dtype: (row g, keys 2t..) and (row g+8, keys 2t..) per 8
    // keys; FP8: per 16 keys 8i.. (row g, keys 8i + 2t, 8i + 2t + 1, 8i + 8 + 2t, 8i + 9 + 2t), row g + 8's
    u32 pf[NP][2];
#if ATTNKERN_FP8 && ATTNKERN_FP8_PACK
    u32 pn[NP][2];  // the new tile's P, rounded during its softmax while P V still reads pf
#endif
    int pend;       // the ring index of the tile whose P V is pending
    // S = Q K^T of the K tile at kb: steps of 32 bytes along the head size (16 elements, FP8 32),
    // one commit group
    const auto issue_s = [&](float (&sc)[NS][4], u32 kb) {
#pragma unroll
        for (int kc = 0; kc < D * ESIZE / 32; ++kc) wgmma_ss(sc, kmajor<BM>(qs0, 64 * cw, kc), kmajor<BN>(kb, 0, kc), kc);
        wgmma_commit();
    };
    // O += P V of the pending tile, one commit group (its V waited for: wait_v)
    const auto wait_v = [&]() { mbar_wait(full_v + 8 * (pend % STAGES), (pend / STAGES) & 1); };
    const auto issue_pv = [&]() {
        const u32 vb = vs0 + (pend % STAGES) * VTILE_BYTES;
#pragma unroll
        for (int cc = 0; cc < BN * ESIZE / 32; ++cc) {  // k steps of 16 keys (FP8 32)
            const u32 af[4] = {pf[2 * cc][0], pf[2 * cc][1], pf[2 * cc + 1][0], pf[2 * cc + 1][1]};
#if ATTNKERN_FP8
            wgmma_rs(o, af, kmajor<D>(vb, 0, cc));  // V^T: D rows of keys, K-major
#else
            wgmma_rs(o, af, mndesc<BN>(vb, cc));
#endif
        }
        wgmma_commit();
    };
    // the online softmax of tile j0's scores (pinned after their wait), the probabilities back
    // into sc in float32; a: the rescale factors of the old output rows
    const auto softmax = [&](float (&sc)[NS][4], int j0, float (&a)[2]) {
        pin(sc);
        const auto emit = [&](int n, const float (&p)[4]) {
#if ATTNKERN_FP8 && ATTNKERN_FP8_PACK
            if (n & 1) {  // the second 8-key tile of a 16-key pair (n is constant once unrolled)
                const float (&x)[4] = sc[n - 1];
                pn[n / 2][0] = pack4_p(x[0], x[1], p[0], p[1]);
                pn[n / 2][1] = pack4_p(x[2], x[3], p[2], p[3]);
                return;
            }
#endif
            sc[n][0] = p[0]; sc[n][1] = p[1]; sc[n][2] = p[2]; sc[n][3] = p[3];
        };
        softmax_tile_masked_if(tile_masked(f, j0, BN, wr0, wr0 + 15), sc, m, l, a, c, j0, f, wr0 + g, emit);
    };
    // once the pending P V is in o: its rows rescaled, the new P rounded to the input dtype
    const auto rescale_round = [&](const float (&sc)[NS][4], const float (&a)[2]) {
        pin(o);
        if (warp_any(a[0] != 1.f || a[1] != 1.f)) scale_rows(o, a);
#pragma unroll
        for (int n = 0; n < NP; ++n) {
#if ATTNKERN_FP8 && ATTNKERN_FP8_PACK
            // by a mov the compiler keeps: where it let a P V read pn's registers directly, they are
            // written by the softmax while an earlier P V is in flight, and ptxas (C7513) then
            // serializes every wgmma of the kernel
            asm volatile("mov.b32 %0, %1;\n" : "=r"(pf[n][0]) : "r"(pn[n][0]));
            asm volatile("mov.b32 %0, %1;\n" : "=r"(pf[n][1]) : "r"(pn[n][1]));
#elif ATTNKERN_FP8
            const float (&x)[4] = sc[2 * n], (&y)[4] = sc[2 * n + 1];
            pf[n][0] = pack4_e4m3(x[0] * P_MUL, x[1] * P_MUL, y[0] * P_MUL, y[1] * P_MUL);
            pf[n][1] = pack4_e4m3(x[2] * P_MUL, x[3] * P_MUL, y[2] * P_MUL, y[3] * P_MUL);
#else
            pf[n][0] = pack2(sc[n][0], sc[n][1]);
            pf[n][1] = pack2(sc[n][2], sc[n][3]);
#endif
        }
    };

#if ATTNKERN_PINGPONG
    // Ping-pong (two consumers): they take turns to issue their products, named barrier
    // 1 + NWG + cw being consumer cw's turn, so that one's softmax runs while the other's
    // products keep the tensor cores busy. A consumer's turns are its seen tiles and one for
    // the last P V; the one with fewer takes empty turns at the end, so that they stay paired.
    static_assert(NWG == 2, "ping-pong takes two consumers");
    const auto turns = [&](int first) {
        int n = 0;
        for (int t = jt0; t < jt1; ++t) n += !tile_unseen(f, t * BN, BN, first, first + 63);
        return n ? n + 1 : 0;
    };
    int turns_left = max(turns(q0), turns(q0 + 64));
    const auto take_turn = [&]() { named_barrier(1 + NWG + cw, 256); };
    // consumer 1's last one opens consumer 0's first turn of the next tile (with none, it would
    // open nothing), so that the turns alternate from tile to tile as within one
    const auto pass_turn = [&]() {
        if (cw == 0 || turns_left > 1 || more) asm volatile("bar.arrive %0, 256;\n" ::"r"(1 + NWG + (cw ^ 1)) : "memory");
        --turns_left;
    };
    if (cw == 1 && first_tile) asm volatile("bar.arrive %0, 256;\n" ::"r"(1 + NWG) : "memory");  // consumer 0 goes first
#else
    const auto take_turn = [&]() {};
    const auto pass_turn = [&]() {};
#endif

    // tile i's K or V slot freed
    const auto free_k = [&](int i) { mbar_arrive(empty_k + 8 * (i % STAGES)); };
    const auto free_v = [&](int i) { mbar_arrive(empty_v + 8 * (i % STAGES)); };
    // a tile none of this consumer's rows sees, freed once it is in: the producer has then
    // waited for both consumers to free the slots' tiles before, so that the arrivals of two
    // tiles never mix in one phase
    const auto skip = [&](int i) {
        mbar_wait(full_k + 8 * (i % STAGES), (i / STAGES) & 1);
        mbar_wait(full_v + 8 * (i % STAGES), (i / STAGES) & 1);
        free_k(i);
        free_v(i);
    };

    // The tiles this consumer's rows see are a contiguous run of [jt0, jt1): the ones before and
    // after it are skipped.
    int jt = jt0;
    for (; jt < jt1 && tile_unseen(f, jt * BN, BN, g0, g0 + 63); ++jt) skip(ring + jt - jt0);
    if (jt < jt1) {
        {  // the first tile: its scores alone
            const int i = ring + jt - jt0;
            float sc[NS][4], a[2];
            mbar_wait(full_k + 8 * (i % STAGES), (i / STAGES) & 1);
            fence_async_shared();
            take_turn();
            wgmma_fence();
            issue_s(sc, ks0 + (i % STAGES) * TILE_BYTES);
            pass_turn();
            wgmma_wait<0>();
            if (ATTNKERN_EARLYK) free_k(i);
            softmax(sc, jt * BN, a);
            rescale_round(sc, a);
            pend = i;
        }
        // then per tile: its S and the pending tile's P V issued together; the softmax while P V runs
        for (++jt; jt < jt1; ++jt) {
            const int i = ring + jt - jt0, s = i % STAGES, j0 = jt * BN;
            if (tile_unseen(f, j0, BN, g0, g0 + 63)) break;
            mbar_wait(full_k + 8 * s, (i / STAGES) & 1);
            wait_v();
            fence_async_shared();
            pin(o);
            pin(pf);
            float sc[NS][4], a[2];
            take_turn();
            wgmma_fence();
            issue_s(sc, ks0 + s * TILE_BYTES);
            issue_pv();
            pass_turn();
            wgmma_wait<1>();  // S is in; the pending P V may still run
            if (ATTNKERN_EARLYK) free_k(i);
            softmax(sc, j0, a);
            wgmma_wait<0>();  // the pending P V is in o: its slots are free
            pin(o);
#if ATTNKERN_FP8 && ATTNKERN_FP8_PACK
            pin(pf);  // read by that P V until here: pn must not take its registers before
#endif
            if (!ATTNKERN_EARLYK) free_k(pend);
            free_v(pend);
            rescale_round(sc, a);
            pend = i;
        }
        // the last P V
        wait_v();
        fence_async_shared();
        pin(o);
        pin(pf);
        take_turn();
        wgmma_fence();
        issue_pv();
        pass_turn();
        wgmma_wait<0>();
        pin(o);
        if (!ATTNKERN_EARLYK) free_k(pend);
        free_v(pend);
        for (; jt < jt1; ++jt) skip(ring + jt - jt0);
    }
#if ATTNKERN_PINGPONG
    while (turns_left > 0) {  // the empty turns that pair this consumer's with the other's
        take_turn();
        pass_turn();
    }
#endif
    // The dynamic walk reads the next tile's index once this consumer has freed every slot of this
    // tile (the producer hands it over after this tile's last copies); consumer 1's last turn
    // (more still false) opened nothing: it opens consumer 0's first turn of the next tile now.
    FETCH_NEXT
#if ATTNKERN_PERSIST == 2 && ATTNKERN_PINGPONG
    if (cw == 1 && more) asm volatile("bar.arrive %0, 256;\n" ::"r"(1 + NWG) : "memory");
#endif
#if ATTNKERN_FP8
#pragma unroll
    for (int j = 0; j < NO; ++j) o[j][0] *= out_scale, o[j][1] *= out_scale, o[j][2] *= out_scale, o[j][3] *= out_scale;
    if (ATTNKERN_FP8_EXP) l[0] *= 1.f / P_SCALE, l[1] *= 1.f / P_SCALE;  // the sums of 2^8 p (exact)
#endif
#if ATTNKERN_PERSIST
    if (more) {  // the next tile's Q rows: loaded into registers before this tile's output is stored
        u64 nb;
        int nq0;
        persist_tile(NEXT_TILE, nqb, rows, nk, causal, nb, nq0);
        const u16* qn = (const u16*)qp + nb * (u64)nq * ROW16;
#if ATTNKERN_D > 128
        // (the output's D / 2 accumulators leave no room for D / 4 more registers of Q rows: the
        // output is stored first, then the rows are copied)
        store_rows(op, lsep, b, nq, with_lse, o, l, m, c, wr0 + g);
        load_q<64, 128>(qn, qs0, nq0, 64 * cw, nq, sign, ct);
#else
        constexpr int NQC = 64 * ROW16 / 8 / 128;  // 16-byte chunks of the consumer's 64 rows a thread
        u32x4 x[NQC];
#pragma unroll
        for (int n = 0; n < NQC; ++n) x[n] = q_chunk<64>(qn, nq0, 64 * cw, nq, sign, ct + 128 * n);
        store_rows(op, lsep, b, nq, with_lse, o, l, m, c, wr0 + g);
#pragma unroll
        for (int n = 0; n < NQC; ++n) store_q_chunk<64>(qs0, 64 * cw, ct + 128 * n, x[n]);
#endif
        fence_async_shared();
        named_barrier(1 + cw, 128);  // the consumer's Q rows are in, visible to its wgmma
    } else
#endif
    store_rows(op, lsep, b, nq, with_lse, o, l, m, c, wr0 + g);
    TILES_END
}
#undef TILE_V
#undef TILE_FEAT
#undef TILE_KEYS
#undef TILE_ROW
#undef TILE
#undef TILES_BEGIN
#undef TILES_END
#undef PRODUCER_TILES_BEGIN
#undef PRODUCER_TILES_END
#undef NEXT_TILE
#undef FETCH_NEXT
#endif  // ATTNKERN_WS
