// cuda.flash's backward for float16 and bfloat16: FlashAttention-2's backward on
// tensor cores (mma.sync m16n8k16, float32 accumulation; sm_80 and later); and with
// ATTNKERN_TF32 1 for float32, each product in 3xTF32 (flash_tf32.cu's split: three
// mma.sync m16n8k8 tf32 products a product, float32 accumulation) with the same two
// kernels, divisions and order of sums.
//
// Compiled like flash_mma.cu (cpp.py, flash_bwd_kernels): flash_common.cuh first,
// then this file, with the constants
//   ATTNKERN_D        the head size (D = Dv), a multiple of 16 up to 128; float16/bfloat16 in parts 1
//                     and 2 up to 256
//   ATTNKERN_BF16     1 for bfloat16, 0 for float16 (half precision)
//   ATTNKERN_TF32     1 for float32 (3xTF32), 0 for the half dtypes
//   ATTNKERN_PART     1: the dQ kernel, 2: the dK/dV kernel; on Hopper (sm_90a, float16/bfloat16,
//                     D = 64 or 128, after flash_wgmma_common.cuh) 4: the dQ kernel and 3: the dK/dV
//                     kernel on wgmma (the same work and order of sums; NW = 4 x warpgroups, MT = 1);
//                     the opt-in fused backward (cpp.BWD_DETERMINISTIC False, D = 64): 5 its first
//                     kernel (delta, the corrected lse), 3 with ATTNKERN_FUSEDQ 1 (dK, dV and dQ
//                     added to a float32 accumulator by bulk reductions), 6 dQ's conversion to the
//                     dtype; ATTNKERN_FUSEDQ_SKIP (timing studies only, dQ then wrong): 1 leaves out
//                     the bulk additions, 2 dQ's product too, 3 dS's stores to shared memory too
//   ATTNKERN_NW       warps per block
//   ATTNKERN_MT       16-row mma tiles a warp (1 or 2): 16 MT query rows (part 1) or keys (part 2);
//                     each B fragment read from shared memory feeds MT mma tiles
//   ATTNKERN_BN       part 1: keys per streamed K/V tile; part 2: query rows per streamed Q/dO tile
//   ATTNKERN_DSPLIT   parts 1 and 2 (default 1): the gradient accumulators' D columns split into DSPLIT
//                     slices of DC = 16 ceil(D / 16 DSPLIT) columns, one a block (the last slice's
//                     columns past D skipped): block x of the grid's first axis takes row or key block
//                     x / DSPLIT and columns (x % DSPLIT) DC...; every slice recomputes S and dP (or
//                     S^T and dP^T) over all D columns, which they need, and accumulates only its own
//                     columns of dQ (or dK and dV), in the same order: the same bits as one block. Part
//                     1's slice 0 alone writes delta and the corrected lse (every slice computes the
//                     same). At D = 256 the dK and dV accumulators of 16 keys x D would take 256
//                     registers a thread: two slices leave each 128, as at D = 128.
//   ATTNKERN_FEAT, ATTNKERN_MASK, ATTNKERN_ALIBI, ATTNKERN_DROPOUT, ATTNKERN_VARLEN, ATTNKERN_NAME,
//                     ATTNKERN_DYNAMIC as in flash_mma.cu (dropout, half dtypes only: dP = Z dO V^T,
//                     dV = (P Z)^T dO, delta = rowsum(dO O) unchanged, the mask regenerated from the same
//                     Philox counters; varlen: part 1's grid (query blocks, heads, sequences), part 2's
//                     (key blocks, k/v heads, sequences))
//
// Two kernels, no atomics, every sum in a fixed order (bit-identical run to run; the opt-in
// fused backward of parts 5, 3 and 6 excepted, whose dQ is not):
//
// Part 1 (grid: query blocks of 16 NW rows x batch rows) runs first. It computes
// delta_i = dO_i . O_i in float32, recomputes S = Q K^T and dP = dO V^T per K/V
// tile (double-buffered with cp.async), P = 2^(s c - lse_i log2 e) from the
// forward's lse, dS = P (dP - delta) and dQ += dS K. The forward's lse of a half
// dtype is rounded to it (a bfloat16 lse would scale a row's P by up to e^(2^-8 |lse|)):
// as triton.flash's backward, the kernel also sums each row's P, corrects the lse
// by the log of that sum within the rounding of its dtype, scales dQ to match, and
// writes the corrected lse in float32 (log2 domain) with delta for part 2 (float32's
// lse, exact to its rounding, is written as it is).
//
// Part 2 (grid: key blocks of 16 NW keys x k/v rows) holds its K and V rows in
// shared memory, streams the query tiles that see its keys (and, under GQA, those
// of every query row of the group, in order), and computes the transposed
// products: S^T = K Q^T and dP^T = V dO^T (keys as the mma's rows, so P^T and dS^T
// are A operands as they stand in the accumulators, with no trip through shared
// memory), dV += P^T dO and dK += dS^T Q.
//
// Tiles or warps that no visible (row, key) pair touches are skipped, and masks
// are applied only on tiles that cross a row's window, length or causal diagonal
// (flash_common.cuh's key_tiles, tile_unseen, tile_masked), so causal costs about half.

#ifndef ATTNKERN_TF32
#define ATTNKERN_TF32 0
#endif
#if ATTNKERN_TF32 && (ATTNKERN_DROPOUT || ATTNKERN_VARLEN)
#error "dropout and varlen are variants of the float16/bfloat16 backward only (their lane layouts are the half one's)"
#endif
#define D ATTNKERN_D
#define NW ATTNKERN_NW
#define BN ATTNKERN_BN
#define MT ATTNKERN_MT
#define NTHREADS (32 * NW)
#define BW (16 * MT * NW)  // rows of this block's own operand: query rows (part 1) or keys (part 2)
#define LD (D + 8)      // shared row stride, in elements: ldmatrix (half) and float2/float reads (float32)
                        // free of bank conflicts
#define TILE (BN * LD)  // elements of one streamed tile
#ifndef ATTNKERN_DSPLIT
#define ATTNKERN_DSPLIT 1
#endif
#define DSPLIT ATTNKERN_DSPLIT
#define DC (16 * ((D / 16 + DSPLIT - 1) / DSPLIT))  // columns of a block's gradient accumulators
#if DSPLIT > 1 && (ATTNKERN_PART > 2 || (ATTNKERN_TF32 && DC * DSPLIT != D))
#error "column slices (DSPLIT) are for the mma.sync kernels (parts 1 and 2) only, in float32 slices that divide D"
#endif
// whether accumulator column j8 (a multiple of 16 from the slice's first, c0) lies within D: a
// constant true without slices
#define LIVE_COLS(c0, j8) (DC * DSPLIT == D || (c0) + (j8) < D)
#if ATTNKERN_TF32
typedef float elem;  // the element of q, k, v, out, dout and the gradients
#define ESZ 4u       // its bytes
// the forward's float32 lse is exact to float32's rounding: part 1 leaves it as it is
// (no correction: LSE_ULP and LSE_MARGIN 0)
#define LSE_ULP 0.f
#define LSE_MARGIN 0.f
// The 8 columns of an m16n8 accumulator tile (keys in part 1, query rows in part 2) are
// streamed rows 0, 4, 1, 5, 2, 6, 3, 7 of their 8: a lane's columns 2t and 2t + 1 are rows
// t and t + 4, which are exactly the k indices t and t + 4 of the m16n8k8 A fragment it
// holds when P or dS multiplies those rows (no shuffle), and whose B reads (rows t, t + 4,
// column g) are free of bank conflicts; products' B rows (column g) are read as row COLROW(g)
#define COLROW(c) (((c) >> 1) + 4 * ((c) & 1))
#else
typedef u16 elem;
#define ESZ 2u
#define LSE_ULP (ATTNKERN_BF16 ? 0.00390625f : 0.00048828125f)  // the relative rounding of the lse
#define LSE_MARGIN 1e-6f  // and the float32 sums' error
#define COLROW(c) (c)
#endif
// the streamed row (key or query row, from the tile's first) of a lane's accumulator element e
// of an 8-column tile
#define ACC_COL(lane, e) COLROW(2 * ((lane) & 3) + ((e) & 1))

// shared memory, in elements: [own A 2 x BW rows] [streamed 2 buffers x 2 tiles] [part 2: lse, delta 2 x 2 x BN floats]
#define OWN_ELEMS (2 * BW * LD)
#define SMEM_ELEMS (OWN_ELEMS + 4 * TILE + (ATTNKERN_PART == 2 ? 16 * BN / ESZ : 0))

struct __align__(16) u32x4 { u32 x, y, z, w; };

#if !ATTNKERN_TF32

static __device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

static __device__ __forceinline__ void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr));
}

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

static __device__ __forceinline__ float half_to_float(u16 h) {
#if ATTNKERN_BF16
    return __uint_as_float((u32)h << 16);
#else
    float x;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(x) : "h"(h));
    return x;
#endif
}

#endif

// rows r0.. r0 + rows - 1 of src (D elements each) into shared memory at dst, rows
// at or past n zero-filled, never read
static __device__ __forceinline__ void load_rows(const elem* src, u32 dst, int r0, int rows, int n, int tid) {
    constexpr int EPC = 16 / ESZ, CPR = D / EPC;  // elements per 16-byte chunk, chunks per row
    for (int c = tid; c < rows * CPR; c += NTHREADS) {
        const int row = c / CPR, col = (c % CPR) * EPC;
        const bool live = r0 + row < n;
        cp_async16(dst + (u32)(row * LD + col) * ESZ, src + (u64)(live ? r0 + row : 0) * D + col, live ? 16 : 0);
    }
}

#if ATTNKERN_TF32
static __device__ __forceinline__ float2 lds2(u32 addr) {
    float2 x;
    asm volatile("ld.shared.v2.f32 {%0,%1}, [%2];\n" : "=f"(x.x), "=f"(x.y) : "r"(addr));
    return x;
}

static __device__ __forceinline__ float lds1(u32 addr) {
    float x;
    asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(x) : "r"(addr));
    return x;
}

// P or dS of one 8-column tile as the A operand of an accumulation: float32, split when multiplied
typedef float AFrag[4];

// S (or dP) += A B^T in 3xTF32 (see the half version below): k steps of 8 over D, in the order
// 2t, 2t + 1 (k indices t, t + 4) of A's and B's rows alike, so each lane reads a float2 of each;
// B's column c is the streamed tile's row COLROW(c)
template <int NC>
static __device__ __forceinline__ void products(float (&s)[MT][NC][4], u32 a, u32 bsm, int lane) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int kc = 0; kc < D / 8; ++kc) {
        u32 ab[MT][4], as[MT][4];
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            const u32 at = a + (u32)((16 * i + g) * LD + kc * 8 + 2 * t) * ESZ;
            split_a(lds2(at), lds2(at + 8 * LD * ESZ), ab[i], as[i]);
        }
#pragma unroll
        for (int n = 0; n < NC; ++n) {
            const float2 x = lds2(bsm + (u32)((n * 8 + COLROW(g)) * LD + kc * 8 + 2 * t) * ESZ);
            u32 bb[2], bs[2];
            split(x.x, bb[0], bs[0]);
            split(x.y, bb[1], bs[1]);
#pragma unroll
            for (int i = 0; i < MT; ++i) mma3(s[i][n], ab[i], as[i], bb, bs);
        }
    }
}

// acc (MT tiles of 16 x D) += A (16 x 8 NC each, float32 in the accumulator layout of NC
// 8-column tiles) times the streamed tile's rows (8 NC x D, at bsm), in 3xTF32: k step n is
// the tile's rows 8 n + t and 8 n + t + 4 (ACC_COL), which the lane's A elements hold. The
// accumulators grow over every key (dQ) or query row (dK, dV), and a tensor core's addition
// to them truncates: three mma.sync into acc a k step lost up to 3 ulp of acc each, always
// toward zero (3e-5 of the largest dK at N = 1030, causal, on an H200). So the tile's products
// go to zeroed fragments first (their truncations are of the tile's own sums, a small part of
// acc's) and acc takes each in one float32 addition (rounded to nearest, errors of either sign):
// one addition a tile instead of one a k step. The partial sums of ACC_PASS 8-column tiles of acc
// are held at once (registers; fewer where ACC_PASS does not divide acc's tiles), A split again
// each pass; a tile of one k step (NC 1) keeps one.
#define ACC_PASS 8
// the most 8-column tiles, up to ACC_PASS, that divide the n tiles of acc into whole passes
__host__ __device__ constexpr int acc_pass(int n) {
    int p = ACC_PASS;
    while (n % p != 0) --p;
    return p;
}
template <int NC>
static __device__ __forceinline__ void accumulate(float (&acc)[MT][DC / 8][4], const AFrag (&pf)[MT][NC], u32 bsm,
                                                  int lane, int c0) {
    const int g = lane >> 2, t = lane & 3;
    constexpr int JP = NC == 1 ? 1 : acc_pass(DC / 8);  // acc's tiles a pass
    constexpr int PASSES = NC == 1 ? 1 : DC / 8 / JP, JN = NC == 1 ? DC / 8 : JP;  // tiles a pass's k step takes
#pragma unroll
    for (int p = 0; p < PASSES; ++p) {
        float part[MT][JP][4];
#pragma unroll
        for (int n = 0; n < NC; ++n) {
            u32 ab[MT][4], as[MT][4];
#pragma unroll
            for (int i = 0; i < MT; ++i)
                split_a(make_float2(pf[i][n][0], pf[i][n][1]), make_float2(pf[i][n][2], pf[i][n][3]), ab[i], as[i]);
            const u32 at = bsm + (u32)((n * 8 + t) * LD + c0 + g) * ESZ;
#pragma unroll
            for (int jj = 0; jj < JN; ++jj) {
                const int j = p * JP + jj, jp = NC == 1 ? 0 : jj;  // acc's tile, its partial sum
                u32 bb[2], bs[2];
                split(lds1(at + j * 8 * ESZ), bb[0], bs[0]);
                split(lds1(at + (4 * LD + j * 8) * ESZ), bb[1], bs[1]);
#pragma unroll
                for (int i = 0; i < MT; ++i) {
                    if (NC == 1 || n == 0) part[i][jp][0] = part[i][jp][1] = part[i][jp][2] = part[i][jp][3] = 0.f;
                    mma3(part[i][jp], ab[i], as[i], bb, bs);
                    if (NC == 1)
                        acc[i][j][0] += part[i][0][0], acc[i][j][1] += part[i][0][1], acc[i][j][2] += part[i][0][2],
                            acc[i][j][3] += part[i][0][3];
                }
            }
        }
        if (NC > 1) {
#pragma unroll
            for (int i = 0; i < MT; ++i)
#pragma unroll
                for (int jj = 0; jj < JP; ++jj)
#pragma unroll
                    for (int e = 0; e < 4; ++e) acc[i][p * JP + jj][e] += part[i][jj][e];
        }
    }
}

static __device__ __forceinline__ void pack_tile(AFrag& out, const float (&x)[4]) {
    out[0] = x[0], out[1] = x[1], out[2] = x[2], out[3] = x[3];
}

// the lane's share (half of D, from column half D / 2) of dO . O of one row, in float32
static __device__ __forceinline__ float row_dot(const elem* orow, const elem* drow) {
    float acc = 0.f;
#pragma unroll
    for (int e = 0; e < D / 2; e += 4) {
        const float4 x = *(const float4*)(orow + e), y = *(const float4*)(drow + e);
        acc = fmaf(x.x, y.x, acc);
        acc = fmaf(x.y, y.y, acc);
        acc = fmaf(x.z, y.z, acc);
        acc = fmaf(x.w, y.w, acc);
    }
    return acc;
}

static __device__ __forceinline__ float load_lse(u64 lsep, u64 at) { return ((const float*)lsep)[at]; }

// two gradient elements stored at dst
static __device__ __forceinline__ void store2(elem* dst, float lo, float hi) { *(float2*)dst = make_float2(lo, hi); }
#else
// P or dS of one 8-column tile as A-fragment registers of the input dtype
typedef u32 AFrag[2];

static __device__ __forceinline__ void pack_tile(AFrag& out, const float (&x)[4]) {
    out[0] = pack2(x[0], x[1]);
    out[1] = pack2(x[2], x[3]);
}

// two gradient elements rounded to the input dtype, stored at dst
static __device__ __forceinline__ void store2(elem* dst, float lo, float hi) { *(u32*)dst = pack2(lo, hi); }

// S (or dP) += A B^T for the warp's MT 16-row mma tiles of A (at a, shared, rows of the
// block's own operand) and NC 8-column tiles of B (at bsm, shared, rows of the streamed
// tile): k steps over D; each B fragment feeds the MT tiles
template <int NC>
static __device__ __forceinline__ void products(float (&s)[MT][NC][4], u32 a, u32 bsm, int lane) {
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) {
        u32 af[MT][4];
#pragma unroll
        for (int i = 0; i < MT; ++i)
            ldsm_x4(a + (u32)((16 * i + (lane & 15)) * LD + kc * 16 + (lane >> 4) * 8) * 2u, af[i][0], af[i][1],
                    af[i][2], af[i][3]);
#pragma unroll
        for (int n = 0; n < NC; n += 2) {
            u32 b0, b1, b2, b3;
            ldsm_x4(bsm + (u32)((n * 8 + (lane & 7) + ((lane >> 4) & 1) * 8) * LD + kc * 16 + ((lane >> 3) & 1) * 8) * 2u,
                    b0, b1, b2, b3);
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                mma(s[i][n], af[i], b0, b1);
                mma(s[i][n + 1], af[i], b2, b3);
            }
        }
    }
}

// acc (MT tiles of 16 x DC) += A (16 x 8 NC each, in the accumulator layout of NC 8-column
// tiles, packed to the input dtype) times columns c0... of the streamed tile's rows (8 NC x DC,
// at bsm; columns past D skipped)
template <int NC>
static __device__ __forceinline__ void accumulate(float (&acc)[MT][DC / 8][4], const AFrag (&pf)[MT][NC], u32 bsm,
                                                  int lane, int c0) {
#pragma unroll
    for (int cc = 0; cc < NC / 2; ++cc) {
#pragma unroll
        for (int j = 0; j < DC / 8; j += 2) {
            if (!LIVE_COLS(c0, j * 8)) continue;
            u32 b0, b1, b2, b3;
            ldsm_x4_t(bsm + (u32)((cc * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + c0 + j * 8 + (lane >> 4) * 8) * 2u,
                      b0, b1, b2, b3);
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                const u32 af[4] = {pf[i][2 * cc][0], pf[i][2 * cc][1], pf[i][2 * cc + 1][0], pf[i][2 * cc + 1][1]};
                mma(acc[i][j], af, b0, b1);
                mma(acc[i][j + 1], af, b2, b3);
            }
        }
    }
}

// the lane's share (half of D, from column half D / 2) of dO . O of one row, in float32
static __device__ __forceinline__ float row_dot(const elem* orow, const elem* drow) {
    float acc = 0.f;
#pragma unroll
    for (int e = 0; e < D / 2; e += 8) {
        const u32x4 x = *(const u32x4*)(orow + e), y = *(const u32x4*)(drow + e);
        const u32 xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
        for (int h = 0; h < 4; ++h) {
            acc = fmaf(half_to_float((u16)xs[h]), half_to_float((u16)ys[h]), acc);
            acc = fmaf(half_to_float((u16)(xs[h] >> 16)), half_to_float((u16)(ys[h] >> 16)), acc);
        }
    }
    return acc;
}

static __device__ __forceinline__ float load_lse(u64 lsep, u64 at) { return half_to_float(((const u16*)lsep)[at]); }
#endif

// 16 rows x DC of acc (an m16n8 accumulator layout; columns c0... of the rows, those past D
// skipped) times factor[0] (row g) and factor[1] (row g + 8), stored in the input dtype at rows
// r0, r0 + 8 below n
static __device__ __forceinline__ void store_rows(elem* dst, const float (&acc)[DC / 8][4], const float (&factor)[2],
                                                  int r0, int n, int c0 = 0) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int j = 0; j < DC / 8; ++j) {
        if (!LIVE_COLS(c0, (j & ~1) * 8)) continue;
        const int col = c0 + j * 8 + 2 * t;
        if (r0 < n) store2(dst + (u64)r0 * D + col, acc[j][0] * factor[0], acc[j][1] * factor[0]);
        if (r0 + 8 < n) store2(dst + (u64)(r0 + 8) * D + col, acc[j][2] * factor[1], acc[j][3] * factor[1]);
    }
}

#if ATTNKERN_DROPOUT && ATTNKERN_PART == 2
// Dropout's factors z of a lane's four elements of the dK/dV kernel's transposed tiles: keys
// k0 + g (z[0], z[1]) and k0 + g + 8 (z[2], z[3]), query rows qbase + 2t and + 1 (k0 a
// multiple of 16, g = lane / 4, t = lane % 4). Where dj0 is a multiple of 4 the 4 lanes of
// one t and g / 4 need 4 Philox calls (2 rows x 2 groups of 4 keys): the lane of g % 4 = c
// makes the (row qbase + 2t + c % 2, keys k0 + 4 (g / 4) + 8 (c / 2)) one, and element e
// takes bit g % 4 of lane c = e's; else each element is its own call (flash_common.cuh).
static __device__ __forceinline__ void dropout_cols(const Feat& f, int k0, int qbase, float (&z)[4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, c = g & 3;
    if ((f.dj0 & 3) == 0) {
        const u32 mine = dropout_bits(f, qbase + 2 * t + (c & 1), ((u64)k0 + f.dj0) / 4 + (g >> 2) + 2 * (c >> 1));
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const u32 bits = __shfl_sync(0xffffffffu, mine, (lane & ~12) | (e << 2));
            z[e] = (bits >> c) & 1u ? f.zscale : 0.f;
        }
    } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) z[e] = dropout_one(f, qbase + 2 * t + (e & 1), k0 + g + 8 * (e >> 1));
    }
}
#endif

// P of one score x = q.k (the raw product) of row `row` and key `key`, from the
// row's lse in the log2 domain (+inf for rows that see no key or lie past nq: P
// = 0); slope: the softcap's derivative 1 - tanh^2 (1 without a softcap). As the
// forward: scores in units of |scale| (Q's sign folded in: sgn), capped, then the
// mask and ALiBi in those units, c = |scale| log2 e.
// (MASK: whether the tile needs masks; the callers pass a constant, which inlining folds)
static __device__ __forceinline__ float prob(bool MASK, float x, int key, int row, float lse2, const Feat& f,
                                             float sgn, float c, float& slope) {
    slope = 1.f;
#if ATTNKERN_FEAT
    float s = x * sgn;
    if (f.cap > 0.f) {
        s = capped(f, s);
        const float th = s * (1.f / f.cap);
        slope = 1.f - th * th;
    }
    if (MASK) {
        if (key_hidden(f, key, row)) return 0.f;
        if (ATTNKERN_MASK || ATTNKERN_ALIBI) {
            s = mask_score(f, s, key, row);
            if (s == neg_inf()) return 0.f;
        }
    }
    return ex2(fmaf(s, c, -lse2));
#else
    if (MASK && key_hidden(f, key, row)) return 0.f;
    return ex2(fmaf(x * sgn, c, -lse2));
#endif
}

#if ATTNKERN_PART == 2 || ATTNKERN_PART == 3
// The dK/dV kernels' (parts 2 and 3) query tiles of BN rows whose rows see a key of the block
// k0..k0 + BW - 1 (the same for every row of the group): hi(i) > k0 and lo(i) < k0 + BW
static __device__ __forceinline__ void query_tiles(const Feat& f0, int k0, int nq, int causal, int& it0, int& it1) {
#if ATTNKERN_FEAT
    const int first = f0.wr >= 0 ? max(0, k0 - f0.off - f0.wr) : 0;
    const int end = f0.wl >= 0 ? min(nq, k0 + BW - f0.off + f0.wl) : nq;
    const bool any = end > first && k0 < f0.len;
    it0 = any ? first / BN : 0;
    it1 = any ? (end + BN - 1) / BN : 0;
#else
    it0 = causal ? k0 / BN : 0;
    it1 = (nq + BN - 1) / BN;
#endif
}

// the corrected lse (log2 domain) and delta of a streamed tile's BN rows i0... of the query row
// starting at qb into dst[0, BN) and dst[BN, 2 BN) (rows past nq: +inf, 0: P = 0)
static __device__ __forceinline__ void tile_lse_delta(float* dst, u64 lsefp, u64 deltap, u64 qb, int i0, int nq,
                                                      int tid) {
    for (int i = tid; i < BN; i += NTHREADS) {
        const bool live = i0 + i < nq;
        dst[i] = live ? ((const float*)lsefp)[qb + i0 + i] : -neg_inf();
        dst[BN + i] = live ? ((const float*)deltap)[qb + i0 + i] : 0.f;
    }
}

// P^T and dS^T of the dK/dV kernels' (parts 2 and 3) transposed tiles, keys key0 + g and
// key0 + g + 8 (a warp's 16 rows) by the NQ 8-column tiles of the streamed rows i0...: from S^T
// (s), dP^T (dp) and the rows' lse and delta (tl, tl + BN), packed as A fragments of dV += P^T dO
// and dK += dS^T Q. (MASK: whether the tile needs masks, a constant at each call)
template <int NQ>
static __device__ __forceinline__ void kv_grads(bool MASK, const float (&s)[NQ][4], const float (&dp)[NQ][4],
                                                AFrag (&pf)[NQ], AFrag (&dsf)[NQ], int key0, int i0,
                                                const float* tl, const Feat& f, float sgn, float c) {
    const int lane = threadIdx.x & 31, g = lane >> 2;
#pragma unroll
    for (int n = 0; n < NQ; ++n) {
        float p[4], ds[4];
#if ATTNKERN_DROPOUT
        float z[4];  // dropout's factors: dV takes P Z, dP of the undropped P is Z times V dO^T
        dropout_cols(f, key0, i0 + n * 8, z);
#endif
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int i = n * 8 + ACC_COL(lane, e), key = key0 + g + (e >> 1) * 8;
            float slope;
            p[e] = prob(MASK, s[n][e], key, i0 + i, tl[i], f, sgn, c, slope);
#if ATTNKERN_DROPOUT
            ds[e] = p[e] * (dp[n][e] * z[e] - tl[BN + i]) * slope;
            p[e] *= z[e];
#else
            ds[e] = p[e] * (dp[n][e] - tl[BN + i]) * slope;
#endif
        }
        pack_tile(pf[n], p);
        pack_tile(dsf[n], ds);
    }
}
#endif

#if ATTNKERN_PART == 1 || ATTNKERN_PART == 4 || ATTNKERN_PART == 5
// The dQ kernels' (parts 1 and 4) key tiles of BN keys [jt0, jt1) that the block of rows
// q0..q0 + BW - 1 visits (plain: up to the block's last row with causal masking)
static __device__ __forceinline__ void dq_key_tiles(const Feat& f, int q0, int nq, int nk, int causal, int& jt0,
                                                    int& jt1) {
#if ATTNKERN_FEAT
    key_tiles(f, q0, BW, nq, BN, jt0, jt1);
#else
    jt0 = 0;
    jt1 = ((causal ? min(nk, q0 + BW) : nk) + BN - 1) / BN;
#endif
}

// The dQ kernels' (parts 1 and 4) rows of one 16-row mma tile, first row wr0 (a warp's): delta
// from global memory (dout: the head's first row), two lanes a row (half the columns each),
// written for the dK/dV kernel (by column slice 0 alone: c0 = 0);
// and the lse of the lane's rows wr0 + g and wr0 + g + 8 (log2 domain; +inf where the row sees
// no key or lies past nq: P = 0)
static __device__ __forceinline__ void dq_row_stats(u64 op, const elem* dout, u64 lsep, u64 deltap, u64 qrow, int wr0,
                                                    int nq, float (&delta)[2], float (&lse2)[2], int c0 = 0) {
    const int lane = threadIdx.x & 31, g = lane >> 2;
    const float NEG_INF = neg_inf();
    const int row = wr0 + (lane >> 1);
    float acc = 0.f;
    if (row < nq)
        acc = row_dot((const elem*)op + (qrow + row) * D + (lane & 1) * (D / 2),
                      dout + (u64)row * D + (lane & 1) * (D / 2));
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    if (!(lane & 1) && row < nq && c0 == 0) ((float*)deltap)[qrow + row] = acc;
    delta[0] = __shfl_sync(0xffffffffu, acc, 2 * g);
    delta[1] = __shfl_sync(0xffffffffu, acc, 2 * g + 16);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = wr0 + g + 8 * h;
        const float x = r < nq ? load_lse(lsep, qrow + r) : NEG_INF;
        lse2[h] = x == NEG_INF ? -NEG_INF : x * 1.4426950408889634f;
    }
}

// dS of one 16-row tile (rows r0 = its first + g, r0 + 8) by the NS 8-key tiles of keys j0...:
// from S (s), dP (dp), the rows' lse and delta, packed as A fragments of dQ += dS K; each row's
// P summed into lsum (the lane's share). (MASK: whether the tile needs masks, a constant at each call)
template <int NS>
static __device__ __forceinline__ void q_grads(bool MASK, const float (&s)[NS][4], const float (&dp)[NS][4],
                                               AFrag (&dsf)[NS], float (&lsum)[2], int r0, int j0,
                                               const float (&lse2)[2], const float (&delta)[2], const Feat& f,
                                               float sgn, float c) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int n = 0; n < NS; ++n) {
        float ds[4];
#if ATTNKERN_DROPOUT
        float z[4];  // dropout's factors: dP of the undropped P is Z times dO V^T
        dropout_rows(f, r0, j0 + 8 * n, z);
#endif
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = j0 + n * 8 + ACC_COL(lane, e), row = r0 + (e >> 1) * 8;
            float slope;
            const float p = prob(MASK, s[n][e], key, row, lse2[e >> 1], f, sgn, c, slope);
            lsum[e >> 1] += p;
#if ATTNKERN_DROPOUT
            ds[e] = p * (dp[n][e] * z[e] - delta[e >> 1]) * slope;
#else
            ds[e] = p * (dp[n][e] - delta[e >> 1]) * slope;
#endif
        }
        pack_tile(dsf[n], ds);
    }
}

// The correction of the saved lse x (log2 domain) of row r by log2 of the row sum of the P
// computed from it (the lane's share: lsum), within the rounding of its dtype (u |x| and a
// float32 margin; dq_store below says why), written corrected for the dK/dV kernel (by the
// quad's first lane, from column slice 0: c0 = 0); returns the correction
static __device__ __forceinline__ float lse_fix(u64 lsefp, u64 qrow, float lsum, float x, int r, int nq, int c0) {
    const float l = quad_sum(lsum);
    const float bound = x == -neg_inf() ? 0.f : fabsf(x) * LSE_ULP + LSE_MARGIN;
    const float fix = fminf(fmaxf(lg2(l > 0.f ? l : 1.f), -bound), bound);
    if ((threadIdx.x & 3) == 0 && r < nq && c0 == 0) ((float*)lsefp)[qrow + r] = x + fix;
    return fix;
}

// The end of a dQ kernel for one 16-row tile (rows r0, r0 + 8). The saved lse corrected by log2
// of the row sum l of the P computed from it, but only within the rounding of its dtype (u |lse|
// and a float32 margin): an exact lse stays as it is, so out and lse of whole rows of which k, v
// hold one block (ring attention) still give that block's share. dQ = scale 2^-fix sum_j dS_ij K_j;
// the lse (log2 domain, +inf where the row sees no key) goes to the dK/dV kernel (from column
// slice 0: c0 = 0); dq holds columns c0... of the rows.
static __device__ __forceinline__ void dq_store(u64 dqp, u64 lsefp, u64 qrow, const float (&dq)[DC / 8][4],
                                                const float (&lsum)[2], const float (&lse2)[2], int r0, int nq,
                                                float scale, int c0 = 0) {
    float factor[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) factor[h] = scale * ex2(-lse_fix(lsefp, qrow, lsum[h], lse2[h], r0 + 8 * h, nq, c0));
    store_rows((elem*)dqp + qrow * D, dq, factor, r0, nq, c0);
}
#endif

#if ATTNKERN_PART >= 3
// The wgmma kernels' gradient math in two phases, so that the second product of a tile (dP, or
// dP^T) still runs on the tensor cores while the first phase exponentiates:
// wg_probs: P of one warp's 16 rows (rows r0 = its first + g and r0 + 8 of the accumulator layout,
// columns col0 + the tile's 8-column tiles; row-major: the rows are query rows, r_is_query) into
// pf (packed, an A operand) and s overwritten with P times the softcap's slope; its P summed into
// lsum (the dQ kernel's row sums; the dK/dV kernel passes a scratch). lse2[...] of query row
// (index into the lane's rows or the tile's columns) via lse_of.
// wg_dscores: dS = s (dP - delta) into dsf (packed).
template <int NT, typename Lse>
static __device__ __forceinline__ void wg_probs(bool MASK, float (&s)[NT][4], AFrag (&pf)[NT], float (&lsum)[2],
                                                int r0, int col0, bool rows_are_queries, const Lse& lse_of,
                                                const Feat& f, float sgn, float c) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        float p[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = r0 + (e >> 1) * 8, col = col0 + n * 8 + ACC_COL(lane, e);
            float slope;
            p[e] = rows_are_queries ? prob(MASK, s[n][e], col, r, lse_of(e >> 1, n, e), f, sgn, c, slope)
                                    : prob(MASK, s[n][e], r, col, lse_of(e >> 1, n, e), f, sgn, c, slope);
            lsum[e >> 1] += p[e];
            s[n][e] = p[e] * slope;
        }
        pack_tile(pf[n], p);
    }
}

template <int NT, typename Delta>
static __device__ __forceinline__ void wg_dscores(const float (&s)[NT][4], const float (&dp)[NT][4],
                                                  AFrag (&dsf)[NT], const Delta& delta_of) {
#pragma unroll
    for (int n = 0; n < NT; ++n) {
        float ds[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) ds[e] = s[n][e] * (dp[n][e] - delta_of(e >> 1, n, e));
        pack_tile(dsf[n], ds);
    }
}
#endif

#if ATTNKERN_PART >= 3
// The streamed tiles' ring (Q/dO tiles in part 3, K/V tiles in part 4): ATTNKERN_STAGES 0 is the
// double buffering of load_swizzled's copies; 2 or more (cpp.BwdConfig.stages) that many buffers,
// STAGES - 1 tiles in flight while one is computed, and whole tiles copied at constant offsets
// (load_whole; tiles that end past the rows' count take load_swizzled's zero fill).
#ifndef ATTNKERN_STAGES
#define ATTNKERN_STAGES 0
#endif
#define STAGES (ATTNKERN_STAGES ? ATTNKERN_STAGES : 2)
static_assert(STAGES >= 2 && STAGES <= 4, "parts 3 and 4: 2 to 4 stages");

// rows r0... of a streamed tile of ROWS rows, n rows in all
template <int ROWS>
static __device__ __forceinline__ void load_stream(const u16* src, u32 dst, int r0, int n, int tid) {
    if constexpr (ATTNKERN_STAGES > 0)
        load_whole<ROWS, NTHREADS>(src, dst, r0, n, tid);
    else
        load_swizzled<ROWS, NTHREADS>(src, dst, r0, n, tid);
}

// A tile's S and dP (the dQ kernel) or S^T and dP^T (the dK/dV kernel), one commit group each, so
// that the exponentials of s run while dp is still on the tensor cores: s = A0 B0^T and dp = A1 B1^T
// over the D columns, A the 64 rows arow... of the BW-row buffers a0, a1 (the block's own operands:
// Q and dO, or K and V), B the BN rows of the streamed tiles b0, b1 (K and V, or Q and dO), all
// K-major in shared memory
template <int NT>
static __device__ __forceinline__ void issue_scores(float (&s)[NT][4], float (&dp)[NT][4], u32 a0, u32 a1, int arow,
                                                    u32 b0, u32 b1) {
    wgmma_fence();
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) wgmma_ss(s, kmajor<BW>(a0, arow, kc), kmajor<BN>(b0, 0, kc), kc);
    wgmma_commit();
#pragma unroll
    for (int kc = 0; kc < D / 16; ++kc) wgmma_ss(dp, kmajor<BW>(a1, arow, kc), kmajor<BN>(b1, 0, kc), kc);
    wgmma_commit();
}

// acc += F B, one commit group: F the register A operand (fr, the packed 8-column tiles of an
// accumulator, 16 columns a k step: tiles 2 cc and 2 cc + 1), B the BN rows of the streamed tile
// at b read transposed (MN-major): the dK/dV kernel's dV += P^T dO and dK += dS^T Q (the dQ kernel
// writes its dQ += dS K out: through this helper ptxas built a different binary, whose speed is unmeasured)
template <int NT>
static __device__ __forceinline__ void issue_rs(float (&acc)[NT][4], AFrag (&fr)[BN / 8], u32 b) {
    pin(fr);
    pin(acc);
    wgmma_fence();
#pragma unroll
    for (int cc = 0; cc < BN / 16; ++cc) {
        const u32 af[4] = {fr[2 * cc][0], fr[2 * cc][1], fr[2 * cc + 1][0], fr[2 * cc + 1][1]};
        wgmma_rs(acc, af, mndesc<BN>(b, cc));
    }
    wgmma_commit();
}
#endif

#if ATTNKERN_PART == 1
// ---------------------------------------------------------------- dQ (and delta, the corrected lse)
extern "C" __device__ void ATTNKERN_NAME(u64 qp, u64 kp, u64 vp, u64 op, u64 dop, u64 lsep, u64 dqp, u64 dkp,
                                         u64 dvp, u64 lsefp, u64 deltap, int nq, int nk, float scale_log2,
                                         float scale, int causal, FEAT_PARAMS) {
    constexpr int NS = BN / 8;  // 8-key tiles of a K/V tile
#if ATTNKERN_DYNAMIC
    extern __shared__ __align__(128) elem smem[];
#else
    __shared__ __align__(128) elem smem[SMEM_ELEMS];
#endif
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2;
    const u64 b = blockIdx.y;
    // the block's column slice and its row block (blockIdx.x without slices)
    const int c0 = ((int)blockIdx.x % DSPLIT) * DC, bx = (int)blockIdx.x / DSPLIT;
#if ATTNKERN_VARLEN
    // grid (query blocks of the longest sequence, heads, sequences): this sequence's blocks only
    u64 seq_q, seq_k;
    varlen_sequence(cuqp, cukp, blockIdx.z, nq, nk, seq_q, seq_k);
    const int nblocks = (nq + BW - 1) / BW;
    if (bx >= nblocks) return;
    const int q0 = (causal ? nblocks - 1 - bx : bx) * BW;
    const u64 qrow = seq_q * gridDim.y + b * (u64)nq;  // this (sequence, head)'s first row of q, dout, out, lse, dq
    Feat f = make_feat(b, nq, nk, causal, FEAT_ARGS);
    varlen_feat(f, b, blockIdx.z, seq_q, seq_k, alibip, seq_rows, alibi_unit);
    const u64 kvrow = seq_k * (gridDim.y / (u64)kv_group) + f.kv_row * (u64)nk;
#else
    // (as block_first_row, over the row blocks: the blocks with the most tiles first)
    const int q0 = (causal ? (int)gridDim.x / DSPLIT - 1 - bx : bx) * BW;
    const Feat f = make_feat(b, nq, nk, causal, FEAT_ARGS);
    const u64 qrow = b * (u64)nq, kvrow = f.kv_row * (u64)nk;
#endif
    const elem* q = (const elem*)qp + qrow * D;
    const elem* dout = (const elem*)dop + qrow * D;
    const elem* k = (const elem*)kp + kvrow * D;
    const elem* v = (const elem*)vp + kvrow * D;
    const u32 qs = smem_u32(smem), dos = qs + BW * LD * ESZ, ks0 = qs + OWN_ELEMS * ESZ, vs0 = ks0 + 2 * TILE * ESZ;
    const float c = fabsf(scale_log2), sgn = scale_log2 < 0.f ? -1.f : 1.f;

    load_rows(q, qs, q0, BW, nq, tid);
    load_rows(dout, dos, q0, BW, nq, tid);
    int jt0, jt1;
    dq_key_tiles(f, q0, nq, nk, causal, jt0, jt1);
#define LOAD_LEN (ATTNKERN_FEAT ? f.len : nk)
    if (jt0 < jt1) {
        load_rows(k, ks0 + (jt0 & 1) * TILE * ESZ, jt0 * BN, BN, LOAD_LEN, tid);
        load_rows(v, vs0 + (jt0 & 1) * TILE * ESZ, jt0 * BN, BN, LOAD_LEN, tid);
    }
    cp_async_commit();

    const int wr0 = q0 + warp * 16 * MT, r0 = wr0 + g;
    float delta[MT][2], lse2[MT][2];
#pragma unroll
    for (int i = 0; i < MT; ++i) dq_row_stats(op, dout, lsep, deltap, qrow, wr0 + 16 * i, nq, delta[i], lse2[i], c0);

    float dq[MT][DC / 8][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < DC / 8; ++j) dq[i][j][0] = dq[i][j][1] = dq[i][j][2] = dq[i][j][3] = 0.f;
    float lsum[MT][2];  // the lane's share of each row's sum of P
#pragma unroll
    for (int i = 0; i < MT; ++i) lsum[i][0] = lsum[i][1] = 0.f;

    for (int jt = jt0; jt < jt1; ++jt) {
        const int j0 = jt * BN;
        const u32 kb = ks0 + (jt & 1) * TILE * ESZ, vb = vs0 + (jt & 1) * TILE * ESZ;
        cp_async_wait_all();
        __syncthreads();  // tile jt (and Q, dO) in; every warp is done with tile jt - 1
        if (jt + 1 < jt1) {
            load_rows(k, ks0 + ((jt + 1) & 1) * TILE * ESZ, j0 + BN, BN, LOAD_LEN, tid);
            load_rows(v, vs0 + ((jt + 1) & 1) * TILE * ESZ, j0 + BN, BN, LOAD_LEN, tid);
            cp_async_commit();
        }
        if (tile_unseen(f, j0, BN, wr0, wr0 + 16 * MT - 1)) continue;
        float s[MT][NS][4], dp[MT][NS][4];
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int n = 0; n < NS; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[i][n][e] = dp[i][n][e] = 0.f;
        products<NS>(s, qs + (u32)(warp * 16 * MT * LD) * ESZ, kb, lane);
        products<NS>(dp, dos + (u32)(warp * 16 * MT * LD) * ESZ, vb, lane);
        AFrag dsf[MT][NS];
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            if (tile_masked(f, j0, BN, wr0 + 16 * i, wr0 + 16 * i + 15))
                q_grads(true, s[i], dp[i], dsf[i], lsum[i], r0 + 16 * i, j0, lse2[i], delta[i], f, sgn, c);
            else
                q_grads(false, s[i], dp[i], dsf[i], lsum[i], r0 + 16 * i, j0, lse2[i], delta[i], f, sgn, c);
        }
        accumulate<NS>(dq, dsf, kb, lane, c0);
    }
    cp_async_wait_all();  // a block whose rows see no key still loaded Q and dO

#pragma unroll
    for (int i = 0; i < MT; ++i) dq_store(dqp, lsefp, qrow, dq[i], lsum[i], lse2[i], r0 + 16 * i, nq, scale, c0);
}
#elif ATTNKERN_PART == 2
// ---------------------------------------------------------------- dK, dV
extern "C" __device__ void ATTNKERN_NAME(u64 qp, u64 kp, u64 vp, u64 op, u64 dop, u64 lsep, u64 dqp, u64 dkp,
                                         u64 dvp, u64 lsefp, u64 deltap, int nq, int nk, float scale_log2,
                                         float scale, int causal, FEAT_PARAMS) {
    constexpr int NQ = BN / 8;  // 8-row tiles of a Q/dO tile
#if ATTNKERN_DYNAMIC
    extern __shared__ __align__(128) elem smem[];
#else
    __shared__ __align__(128) elem smem[SMEM_ELEMS];
#endif
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2;
    const u64 bkv = blockIdx.y;
    // the block's column slice of dK and dV, and its key block (blockIdx.x without slices)
    const int c0 = ((int)blockIdx.x % DSPLIT) * DC;
    const int k0 = ((int)blockIdx.x / DSPLIT) * BW, kw0 = k0 + warp * 16 * MT;  // the block's and the warp's first key
    const int group = ATTNKERN_FEAT ? kv_group : 1;
    const u64 b0 = bkv * (u64)group;  // the group's first query row
#if ATTNKERN_VARLEN
    // grid (key blocks of the longest sequence, k/v heads, sequences): this sequence's blocks only
    u64 seq_q, seq_k;
    varlen_sequence(cuqp, cukp, blockIdx.z, nq, nk, seq_q, seq_k);
    if (k0 >= nk) return;
    const u64 qrow0 = seq_q * gridDim.y * (u64)group, kvrow = seq_k * gridDim.y + bkv * (u64)nk;
    Feat f0 = make_feat(b0, nq, nk, causal, FEAT_ARGS);
    varlen_feat(f0, b0, blockIdx.z, seq_q, seq_k, alibip, seq_rows, alibi_unit);
#else
    const u64 qrow0 = 0, kvrow = bkv * (u64)nk;  // qrow0: the first q row of this sequence
    const Feat f0 = make_feat(b0, nq, nk, causal, FEAT_ARGS);
#endif
    const elem* k = (const elem*)kp + kvrow * D;
    const elem* v = (const elem*)vp + kvrow * D;
    const u32 ks = smem_u32(smem), vs = ks + BW * LD * ESZ, qs0 = ks + OWN_ELEMS * ESZ, dos0 = qs0 + 2 * TILE * ESZ;
    float* sl = (float*)(smem + OWN_ELEMS + 4 * TILE);  // [buffer][lse2 BN, delta BN]
    const float c = fabsf(scale_log2), sgn = scale_log2 < 0.f ? -1.f : 1.f;

    load_rows(k, ks, k0, BW, f0.len, tid);  // keys past the length: zero, never read
    load_rows(v, vs, k0, BW, f0.len, tid);

    int it0, it1;
    query_tiles(f0, k0, nq, causal, it0, it1);
    const int nt = it1 - it0, total = group * nt;  // tiles: query rows of the group in order, then row tiles

    // tile u's Q and dO rows (cp.async) and lse, delta (plain loads) into buffer u & 1
    const auto load = [&](int u) {
        const int h = u / nt, i0 = (it0 + u % nt) * BN, buf = u & 1;
        const u64 qb = qrow0 + (b0 + h) * (u64)nq;
        load_rows((const elem*)qp + qb * D, qs0 + buf * TILE * ESZ, i0, BN, nq, tid);
        load_rows((const elem*)dop + qb * D, dos0 + buf * TILE * ESZ, i0, BN, nq, tid);
        cp_async_commit();
        tile_lse_delta(sl + buf * 2 * BN, lsefp, deltap, qb, i0, nq, tid);
    };
    if (total > 0) load(0);
    cp_async_commit();

    float dk[MT][DC / 8][4], dv[MT][DC / 8][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < DC / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) dk[i][j][e] = dv[i][j][e] = 0.f;

    for (int u = 0; u < total; ++u) {
        const int h = u / nt, i0 = (it0 + u % nt) * BN, buf = u & 1;
        cp_async_wait_all();
        __syncthreads();  // tile u in (and K, V); every warp is done with tile u - 1
        if (u + 1 < total) load(u + 1);
#if ATTNKERN_VARLEN
        Feat f = make_feat(b0 + h, nq, nk, causal, FEAT_ARGS);
        varlen_feat(f, b0 + h, blockIdx.z, seq_q, seq_k, alibip, seq_rows, alibi_unit);
#else
        const Feat f = ATTNKERN_FEAT ? make_feat(b0 + h, nq, nk, causal, FEAT_ARGS) : f0;
#endif
        const int last = min(i0 + BN, nq) - 1;
        if (tile_unseen(f, kw0, 16 * MT, i0, last)) continue;
        const u32 qb = qs0 + buf * TILE * ESZ, dob = dos0 + buf * TILE * ESZ;
        const float* tl = sl + buf * 2 * BN;
        float s[MT][NQ][4], dp[MT][NQ][4];
#pragma unroll
        for (int i = 0; i < MT; ++i)
#pragma unroll
            for (int n = 0; n < NQ; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[i][n][e] = dp[i][n][e] = 0.f;
        products<NQ>(s, ks + (u32)(warp * 16 * MT * LD) * ESZ, qb, lane);
        products<NQ>(dp, vs + (u32)(warp * 16 * MT * LD) * ESZ, dob, lane);
        AFrag pf[MT][NQ], dsf[MT][NQ];
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            if (tile_masked(f, kw0 + 16 * m, 16, i0, last))
                kv_grads(true, s[m], dp[m], pf[m], dsf[m], kw0 + 16 * m, i0, tl, f, sgn, c);
            else
                kv_grads(false, s[m], dp[m], pf[m], dsf[m], kw0 + 16 * m, i0, tl, f, sgn, c);
        }
        accumulate<NQ>(dv, pf, dob, lane, c0);
        accumulate<NQ>(dk, dsf, qb, lane, c0);
    }
    cp_async_wait_all();

    const float one[2] = {1.f, 1.f}, sc[2] = {scale, scale};
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        store_rows((elem*)dkp + kvrow * D, dk[m], sc, kw0 + 16 * m + g, nk, c0);
        store_rows((elem*)dvp + kvrow * D, dv[m], one, kw0 + 16 * m + g, nk, c0);
    }
}
#elif ATTNKERN_PART == 3
// ---------------------------------------------------------------- dK, dV on Hopper's wgmma (sm_90a)
// Part 3: part 2's work (the same grid of key blocks, the same query tiles in the same order,
// the same P^T and dS^T) on warpgroup MMAs for float16/bfloat16 at D = 64 or 128, without
// masks, ALiBi, dropout or packed sequences (cpp.py runs part 2 for those). A block has NW / 4
// warpgroups of 64 keys; its K and V rows stay in shared memory in wgmma's swizzled layout
// (flash_wgmma_common.cuh), the Q/dO tiles of BN = 64 or 128 rows stream through it with cp.async
// in a ring of STAGES stages. Per tile a warpgroup issues S^T = K Q^T and dP^T = V dO^T (m64nBNk16, K and V
// its A operand in shared memory, Q and dO K-major B operands), waits for them, computes P^T and
// dS^T in its registers (kv_grads, as part 2: keys as the rows of the accumulators, laid out as
// mma.sync's, so they are the register A operand as they stand) and issues dV += P^T dO and
// dK += dS^T Q (m64nDk16, dO and Q MN-major B operands read transposed). The other warpgroups'
// products run on the tensor cores meanwhile. Sums in part 2's order, no atomics.
#if ATTNKERN_TF32 || ATTNKERN_MASK || ATTNKERN_ALIBI || ATTNKERN_DROPOUT || ATTNKERN_VARLEN || (D != 64 && D != 128)
#error "the wgmma dK/dV kernel is float16/bfloat16 at D = 64 or 128 without masks, ALiBi, dropout or varlen"
#endif
static_assert((BN == 64 || BN == 128) && MT == 1 && NW % 4 == 0, "part 3: 64- or 128-row Q/dO tiles, warpgroups");
#define KV_BYTES (BW * D * 2)  // K or V of the block
#define QT_BYTES (BN * D * 2)  // one streamed Q or dO tile
#ifndef ATTNKERN_FUSEDQ
#define ATTNKERN_FUSEDQ 0
#endif
// FUSEDQ: dS of a tile (BN query rows x 64 keys) in shared memory, after lse and delta, at a 1024-byte
// boundary; then dQ's float32 partial tiles (BN / 64 of 64 rows x D), each staged for one bulk addition
#define DS_BYTES (ATTNKERN_FUSEDQ ? BN * 128 + 1024 : 0)
#define DQS_BYTES (ATTNKERN_FUSEDQ ? BN * D * 4 : 0)
#define WG_SMEM_BYTES (2 * KV_BYTES + STAGES * (2 * QT_BYTES + 8 * BN) + DS_BYTES + DQS_BYTES + 1024)  // + lse, delta; + room to align to 1024
#if ATTNKERN_FUSEDQ
static_assert(D == 64 && NW == 4, "the fused dQ: D = 64, one warpgroup of 64 keys a block");

// The fused backward's dQ (FUSEDQ, not deterministic), in two steps. store_ds: this tile's dS (the
// warpgroup's dS^T in the register A layout dsf: keys as rows) into shared memory at dss as a
// K-major A operand (query rows as rows, the 64 keys along k, the 128-byte swizzle); called
// before dK += dS^T Q is issued, since a wgmma's A registers may not be accessed until it is
// waited for. fused_dq: per 64 query rows dQ_tile = dS K (an SS wgmma m64n64k16, K at ks read
// transposed), staged in shared memory at dqs in the accumulators' own order (dq_tile_at: thread
// t's pair (j, h) at 8 ((2 j + h) 128 + t) bytes, so that the stores are conflict-free) and added
// to that 64-row tile of the float32 accumulator dq32 (the same order in global memory: part 6
// reads it back) by one cp.reduce.async.bulk of 64 D floats, issued by thread 0 and left running;
// the next tile's staging waits until it has read its source. The order of the additions over
// key blocks is the scheduler's, so dQ's bits vary from run to run. Tile t of query head b is
// tile b ceil(nq / 64) + t of dq32 (rows past nq: zero, as their dS). It waits for every wgmma of
// the tile (dK's too).
static __device__ __forceinline__ void store_ds(u32 dss, const AFrag (&dsf)[BN / 8]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
#pragma unroll
    for (int n = 0; n < BN / 8; ++n)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int key = warp * 16 + g + 8 * hh;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int qr = n * 8 + ACC_COL(lane, e);
                const u32 at = dss + qr * 128 + (((key >> 3) ^ (qr & 7)) << 4) + (key & 7) * 2;
                asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(at), "h"((u16)(dsf[n][hh] >> (16 * e))) : "memory");
            }
        }
}

static __device__ __forceinline__ u32 dq_tile_at(int j, int h, int t) { return (u32)(((2 * j + h) * 128 + t) * 8); }

#ifndef ATTNKERN_FUSEDQ_SKIP
#define ATTNKERN_FUSEDQ_SKIP 0  // timing studies only (dQ then wrong): 1 no bulk additions, 2 nor dQ's product, 3 nor dS's stores
#endif

static __device__ __forceinline__ void fused_dq(u64 dq32, u32 dss, u32 ks, u32 dqs, u64 tile0, int i0, int nq) {
    if (ATTNKERN_FUSEDQ_SKIP >= 2) return;
    const int tid = threadIdx.x;
    if (tid == 0) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");  // dqs free again
    fence_async_shared();  // the dS stores visible to wgmma
    asm volatile("bar.sync 1, 128;\n" ::: "memory");
#pragma unroll 1
    for (int hq = 0; hq < BN / 64; ++hq) {
        float d[D / 8][4];  // (ACC64 names it d)
        wgmma_fence();
#pragma unroll
        for (int kc = 0; kc < 4; ++kc)  // A K-major (tnspA 0), B MN-major (tnspB 1)
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                         "wgmma.mma_async.sync.aligned.m64n64k16.f32." WG_TYPES " " REGS32 ", %32, %33, p, 1, 1, 0, 1;\n}\n"
                         : ACC64 : "l"(kmajor<BN>(dss, 64 * hq, kc)), "l"(mndesc<64>(ks, kc)), "r"(kc));
        wgmma_commit();
        wgmma_wait<0>();
        pin(d);
        const u32 at = dqs + hq * (64 * D * 4);
#pragma unroll
        for (int j = 0; j < D / 8; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(at + dq_tile_at(j, h, tid)), "f"(d[j][2 * h]),
                             "f"(d[j][2 * h + 1]) : "memory");
    }
    fence_async_shared();  // the staged tiles visible to the bulk copy
    asm volatile("bar.sync 1, 128;\n" ::: "memory");
    if (tid == 0 && ATTNKERN_FUSEDQ_SKIP == 0) {
#pragma unroll 1
        for (int hq = 0; hq < BN / 64 && i0 + 64 * hq < nq; ++hq)
            asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                         ::"l"((float*)dq32 + (tile0 + (u64)(i0 / 64 + hq)) * (64 * D)), "r"(dqs + hq * (64 * D * 4)),
                         "n"(64 * D * 4) : "memory");
        asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
    }
}
#endif

extern "C" __device__ void ATTNKERN_NAME(u64 qp, u64 kp, u64 vp, u64 op, u64 dop, u64 lsep, u64 dqp, u64 dkp,
                                         u64 dvp, u64 lsefp, u64 deltap, int nq, int nk, float scale_log2,
                                         float scale, int causal, FEAT_PARAMS) {
    constexpr int NQ = BN / 8;  // 8-row tiles of a Q/dO tile: the N of S^T and dP^T is BN
#if ATTNKERN_DYNAMIC
    extern __shared__ __align__(1024) u16 smem[];
#else
    __shared__ __align__(1024) u16 smem[WG_SMEM_BYTES / 2];
#endif
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, wg = warp >> 2;
    const u64 bkv = blockIdx.y;
    // the block's, the warpgroup's and the warp's first key
    const int k0 = blockIdx.x * BW, kg0 = k0 + 64 * wg, kw0 = k0 + warp * 16;
    const int group = ATTNKERN_FEAT ? kv_group : 1;
    const u64 b0 = bkv * (u64)group, kvrow = bkv * (u64)nk;  // the group's first query row; the k/v row
    const Feat f0 = make_feat(b0, nq, nk, causal, FEAT_ARGS);
    const u16* k = (const u16*)kp + kvrow * D;
    const u16* v = (const u16*)vp + kvrow * D;
    const u32 base = smem_u32(smem), ks = (base + 1023u) & ~1023u, vs = ks + KV_BYTES, qs0 = vs + KV_BYTES,
              dos0 = qs0 + STAGES * QT_BYTES, sl0 = dos0 + STAGES * QT_BYTES;
    float* sl = (float*)((char*)smem + (sl0 - base));  // [stage][lse2 BN, delta BN]
#if ATTNKERN_FUSEDQ
    const u32 dss = (sl0 + STAGES * 8 * BN + 1023u) & ~1023u, dqs = dss + BN * 128;
    const u64 ntiles = (u64)((nq + 63) / 64);  // 64-row tiles of dq32 a query head
#endif
    const float c = fabsf(scale_log2), sgn = scale_log2 < 0.f ? -1.f : 1.f;

    load_swizzled<BW, NTHREADS>(k, ks, k0, f0.len, tid);  // keys past the length: zero, never read
    load_swizzled<BW, NTHREADS>(v, vs, k0, f0.len, tid);
    int it0, it1;
    query_tiles(f0, k0, nq, causal, it0, it1);
    const int nt = it1 - it0, total = group * nt;  // tiles: query rows of the group in order, then row tiles

    // tile u's Q and dO rows (cp.async) and lse, delta into stage u % STAGES (the caller commits):
    // lse and delta by cp.async too where the staged ring copies a whole tile, else plain loads
    const auto load = [&](int u) {
        const int h = u / nt, i0 = (it0 + u % nt) * BN, buf = u % STAGES;
        const u64 qb = (b0 + h) * (u64)nq;
        load_stream<BN>((const u16*)qp + qb * D, qs0 + buf * QT_BYTES, i0, nq, tid);
        load_stream<BN>((const u16*)dop + qb * D, dos0 + buf * QT_BYTES, i0, nq, tid);
        if (ATTNKERN_STAGES > 0 && i0 + BN <= nq) {
            for (int i = tid; i < 2 * BN; i += NTHREADS)
                cp_async4(sl0 + (u32)(buf * 2 * BN + i) * 4u,
                          (const float*)(i < BN ? lsefp : deltap) + qb + i0 + (i < BN ? i : i - BN));
        } else {
            tile_lse_delta(sl + buf * 2 * BN, lsefp, deltap, qb, i0, nq, tid);
        }
    };
    // tiles 0...STAGES - 2 in flight, one commit group each (empty ones past the last tile)
#pragma unroll
    for (int u = 0; u < STAGES - 1; ++u) {
        if (u < total) load(u);
        cp_async_commit();
    }

    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[j][e] = dv[j][e] = 0.f;

    for (int u = 0; u < total; ++u) {
        const int h = u / nt, i0 = (it0 + u % nt) * BN, buf = u % STAGES;
        cp_async_wait_group<STAGES - 2>();  // tile u's group in; the later tiles' may still be in flight
        fence_async_shared();  // the cp.async writes (and K, V) visible to wgmma
        __syncthreads();       // tile u in; every warpgroup is done with tile u - 1, whose stage refills now
        if (u + STAGES - 1 < total) load(u + STAGES - 1);
        cp_async_commit();
        const Feat f = ATTNKERN_FEAT ? make_feat(b0 + h, nq, nk, causal, FEAT_ARGS) : f0;
        const int last = min(i0 + BN, nq) - 1;
        if (tile_unseen(f, kg0, 64, i0, last)) continue;  // the warpgroup's 64 keys: wgmma is collective
        const u32 qb = qs0 + buf * QT_BYTES, dob = dos0 + buf * QT_BYTES;
        const float* tl = sl + buf * 2 * BN;
        // S^T and dP^T, one commit group each: P^T is computed while dP^T is still on the tensor cores
        float s[NQ][4], dp[NQ][4];
        issue_scores(s, dp, ks, vs, 64 * wg, qb, dob);
        wgmma_wait<1>();
        pin(s);
        AFrag pf[NQ], dsf[NQ];
        float unused[2] = {0.f, 0.f};  // the dK/dV kernel needs no row sums of P
        const auto lse_of = [&](int, int n, int e) { return tl[n * 8 + ACC_COL(lane, e)]; };
        if (tile_masked(f, kw0, 16, i0, last))
            wg_probs(true, s, pf, unused, kw0 + g, i0, false, lse_of, f, sgn, c);
        else
            wg_probs(false, s, pf, unused, kw0 + g, i0, false, lse_of, f, sgn, c);
        // dV += P^T dO, then dK += dS^T Q: dS^T is computed while dV's products run
        issue_rs(dv, pf, dob);
        wgmma_wait<1>();  // dP^T in (dV's products may still run)
        pin(dp);
        wg_dscores(s, dp, dsf, [&](int, int n, int e) { return tl[BN + n * 8 + ACC_COL(lane, e)]; });
#if ATTNKERN_FUSEDQ
        if (ATTNKERN_FUSEDQ_SKIP < 3) store_ds(dss, dsf);
#endif
        issue_rs(dk, dsf, qb);
#if ATTNKERN_FUSEDQ
        fused_dq(dqp, dss, ks, dqs, (b0 + h) * ntiles, i0, nq);
#endif
        wgmma_wait<0>();  // this tile's Q and dO read before the next barrier refills their buffers
        pin(dv);
        pin(dk);
    }
    cp_async_wait_all();
#if ATTNKERN_FUSEDQ
    if (tid == 0) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");  // the last additions done
#endif

    const float one[2] = {1.f, 1.f}, sc[2] = {scale, scale};
    store_rows((u16*)dkp + kvrow * D, dk, sc, kw0 + g, nk);
    store_rows((u16*)dvp + kvrow * D, dv, one, kw0 + g, nk);
}
#elif ATTNKERN_PART == 4
// ---------------------------------------------------------------- dQ on Hopper's wgmma (sm_90a)
// Part 4: part 1's work (the same grid of query blocks, key tiles, P, dS, lse correction, delta)
// on warpgroup MMAs for float16/bfloat16 at D = 64 or 128, without masks, ALiBi, dropout or
// packed sequences (cpp.py runs part 1 for those). A block has NW / 4 warpgroups of 64 query
// rows; Q and dO stay in shared memory, K/V tiles of BN = 64 or 128 keys stream through it (cp.async,
// a ring of STAGES stages), all in wgmma's swizzled layout. Per tile a warpgroup issues S = Q K^T and
// dP = dO V^T (m64nBNk16, Q and dO the A operand in shared memory, K and V K-major B operands),
// waits, computes dS in its registers (q_grads, as part 1) and issues dQ += dS K (m64nDk16, dS
// the register A operand, K an MN-major B operand read transposed), the flash_wgmma.cu forward's
// P V. Sums in part 1's order per row, no atomics.
#if ATTNKERN_TF32 || ATTNKERN_MASK || ATTNKERN_ALIBI || ATTNKERN_DROPOUT || ATTNKERN_VARLEN || (D != 64 && D != 128)
#error "the wgmma dQ kernel is float16/bfloat16 at D = 64 or 128 without masks, ALiBi, dropout or varlen"
#endif
static_assert((BN == 64 || BN == 128) && MT == 1 && NW % 4 == 0, "part 4: 64- or 128-key K/V tiles, warpgroups");
#define OWN_BYTES (BW * D * 2)  // Q or dO of the block
#define KT_BYTES (BN * D * 2)   // one streamed K or V tile
#define WG_SMEM_BYTES (2 * OWN_BYTES + 2 * STAGES * KT_BYTES + 1024)  // + room to align to 1024

extern "C" __device__ void ATTNKERN_NAME(u64 qp, u64 kp, u64 vp, u64 op, u64 dop, u64 lsep, u64 dqp, u64 dkp,
                                         u64 dvp, u64 lsefp, u64 deltap, int nq, int nk, float scale_log2,
                                         float scale, int causal, FEAT_PARAMS) {
    constexpr int NS = BN / 8;  // 8-key tiles of a K/V tile: the N of S and dP is BN
#if ATTNKERN_DYNAMIC
    extern __shared__ __align__(1024) u16 smem[];
#else
    __shared__ __align__(1024) u16 smem[WG_SMEM_BYTES / 2];
#endif
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, wg = warp >> 2;
    const u64 b = blockIdx.y;
    const int q0 = block_first_row(causal, BW);
    const Feat f = make_feat(b, nq, nk, causal, FEAT_ARGS);
    const u64 qrow = b * (u64)nq, kvrow = f.kv_row * (u64)nk;
    const u16* k = (const u16*)kp + kvrow * D;
    const u16* v = (const u16*)vp + kvrow * D;
    const u32 qs = ((smem_u32(smem) + 1023u) & ~1023u), dos = qs + OWN_BYTES, ks0 = dos + OWN_BYTES,
              vs0 = ks0 + STAGES * KT_BYTES;
    const float c = fabsf(scale_log2), sgn = scale_log2 < 0.f ? -1.f : 1.f;
    const int load_len = ATTNKERN_FEAT ? f.len : nk;

    load_swizzled<BW, NTHREADS>((const u16*)qp + qrow * D, qs, q0, nq, tid);
    load_swizzled<BW, NTHREADS>((const u16*)dop + qrow * D, dos, q0, nq, tid);
    int jt0, jt1;
    dq_key_tiles(f, q0, nq, nk, causal, jt0, jt1);
    // key tile jt's K and V into stage (jt - jt0) % STAGES (the caller commits)
    const auto load = [&](int jt) {
        const u32 at = ((jt - jt0) % STAGES) * KT_BYTES;
        load_stream<BN>(k, ks0 + at, jt * BN, load_len, tid);
        load_stream<BN>(v, vs0 + at, jt * BN, load_len, tid);
    };
    // tiles jt0...jt0 + STAGES - 2 in flight, one commit group each (empty ones past the last
    // tile); Q and dO in the first
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (jt0 + i < jt1) load(jt0 + i);
        cp_async_commit();
    }

    const int g0 = q0 + 64 * wg, wr0 = q0 + warp * 16, r0 = wr0 + g;  // the warpgroup's, the warp's, the lane's first row
    float delta[2], lse2[2];
    dq_row_stats(op, (const elem*)dop + qrow * D, lsep, deltap, qrow, wr0, nq, delta, lse2);
    float dq[D / 8][4];
#pragma unroll
    for (int j = 0; j < D / 8; ++j) dq[j][0] = dq[j][1] = dq[j][2] = dq[j][3] = 0.f;
    float lsum[2] = {0.f, 0.f};  // the lane's share of each row's sum of P

    for (int jt = jt0; jt < jt1; ++jt) {
        const int j0 = jt * BN;
        const u32 kb = ks0 + ((jt - jt0) % STAGES) * KT_BYTES, vb = vs0 + ((jt - jt0) % STAGES) * KT_BYTES;
        cp_async_wait_group<STAGES - 2>();  // tile jt's group in; the later tiles' may still be in flight
        fence_async_shared();  // the cp.async writes visible to wgmma
        __syncthreads();       // tile jt (and Q, dO) in; every warpgroup is done with tile jt - 1
        if (jt + STAGES - 1 < jt1) load(jt + STAGES - 1);
        cp_async_commit();
        if (tile_unseen(f, j0, BN, g0, g0 + 63)) continue;  // the warpgroup's 64 rows: wgmma is collective
        // S and dP, one commit group each: P is computed while dP is still on the tensor cores
        float s[NS][4], dp[NS][4];
        issue_scores(s, dp, qs, dos, 64 * wg, kb, vb);
        wgmma_wait<1>();
        pin(s);
        AFrag pf[NS], dsf[NS];  // pf: P in the input dtype, unused here (the compiler drops it)
        const auto lse_of = [&](int h, int, int) { return lse2[h]; };
        if (tile_masked(f, j0, BN, wr0, wr0 + 15))
            wg_probs(true, s, pf, lsum, r0, j0, true, lse_of, f, sgn, c);
        else
            wg_probs(false, s, pf, lsum, r0, j0, true, lse_of, f, sgn, c);
        wgmma_wait<0>();
        pin(dp);
        wg_dscores(s, dp, dsf, [&](int h, int, int) { return delta[h]; });
        // dQ += dS K: the A fragment of keys 16 cc... is the 8-key tiles 2 cc, 2 cc + 1
        pin(dsf);
        pin(dq);
        wgmma_fence();
#pragma unroll
        for (int cc = 0; cc < BN / 16; ++cc) {
            const u32 af[4] = {dsf[2 * cc][0], dsf[2 * cc][1], dsf[2 * cc + 1][0], dsf[2 * cc + 1][1]};
            wgmma_rs(dq, af, mndesc<BN>(kb, cc));
        }
        wgmma_commit();
        wgmma_wait<0>();  // this tile's K read before the next barrier refills its buffer
        pin(dq);
    }
    cp_async_wait_all();  // a block whose rows see no key still loaded Q and dO
    dq_store(dqp, lsefp, qrow, dq, lsum, lse2, r0, nq, scale);
}
#elif ATTNKERN_PART == 5
// ---------------------------------------------------------------- the fused backward's first kernel
// Part 5 (cpp.BWD_DETERMINISTIC False; sm_90a, float16/bfloat16, D = 64): part 4's grid, rows and
// key tiles, with S = Q K^T alone: delta, and the lse corrected by the row sums of P exactly as
// part 4 corrects it (the same products, tiles and order of sums: the same bits), for the fused
// dK/dV/dQ kernel (part 3 with FUSEDQ), whose P needs the corrected lse from its first tile; and
// the block's rows of dQ's float32 accumulator (dqp) zeroed. One product instead of part 4's three.
#if ATTNKERN_TF32 || ATTNKERN_MASK || ATTNKERN_ALIBI || ATTNKERN_DROPOUT || ATTNKERN_VARLEN || (D != 64 && D != 128)
#error "the fused backward's first kernel is float16/bfloat16 at D = 64 or 128 without masks, ALiBi, dropout or varlen"
#endif
static_assert((BN == 64 || BN == 128) && MT == 1 && NW % 4 == 0, "part 5: 64- or 128-key K tiles, warpgroups");
#define OWN_BYTES (BW * D * 2)  // Q of the block
#define KT_BYTES (BN * D * 2)   // one streamed K tile
#define WG_SMEM_BYTES (OWN_BYTES + STAGES * KT_BYTES + 1024)  // + room to align to 1024

extern "C" __device__ void ATTNKERN_NAME(u64 qp, u64 kp, u64 vp, u64 op, u64 dop, u64 lsep, u64 dqp, u64 dkp,
                                         u64 dvp, u64 lsefp, u64 deltap, int nq, int nk, float scale_log2,
                                         float scale, int causal, FEAT_PARAMS) {
    constexpr int NS = BN / 8;
#if ATTNKERN_DYNAMIC
    extern __shared__ __align__(1024) u16 smem[];
#else
    __shared__ __align__(1024) u16 smem[WG_SMEM_BYTES / 2];
#endif
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, wg = warp >> 2;
    const u64 b = blockIdx.y;
    const int q0 = block_first_row(causal, BW);
    const Feat f = make_feat(b, nq, nk, causal, FEAT_ARGS);
    const u64 qrow = b * (u64)nq, kvrow = f.kv_row * (u64)nk;
    const u16* k = (const u16*)kp + kvrow * D;
    const u32 qs = ((smem_u32(smem) + 1023u) & ~1023u), ks0 = qs + OWN_BYTES;
    const float c = fabsf(scale_log2), sgn = scale_log2 < 0.f ? -1.f : 1.f;
    const int load_len = ATTNKERN_FEAT ? f.len : nk;

    load_swizzled<BW, NTHREADS>((const u16*)qp + qrow * D, qs, q0, nq, tid);
    int jt0, jt1;
    dq_key_tiles(f, q0, nq, nk, causal, jt0, jt1);
    const auto load = [&](int jt) { load_stream<BN>(k, ks0 + ((jt - jt0) % STAGES) * KT_BYTES, jt * BN, load_len, tid); };
#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (jt0 + i < jt1) load(jt0 + i);
        cp_async_commit();
    }

    const int g0 = q0 + 64 * wg, wr0 = q0 + warp * 16, r0 = wr0 + g;
    float delta[2], lse2[2];
    dq_row_stats(op, (const elem*)dop + qrow * D, lsep, deltap, qrow, wr0, nq, delta, lse2);
    float lsum[2] = {0.f, 0.f};

    for (int jt = jt0; jt < jt1; ++jt) {
        const int j0 = jt * BN;
        const u32 kb = ks0 + ((jt - jt0) % STAGES) * KT_BYTES;
        cp_async_wait_group<STAGES - 2>();
        fence_async_shared();
        __syncthreads();  // tile jt (and Q) in; every warpgroup is done with tile jt - 1
        if (jt + STAGES - 1 < jt1) load(jt + STAGES - 1);
        cp_async_commit();
        if (tile_unseen(f, j0, BN, g0, g0 + 63)) continue;
        float s[NS][4];
        wgmma_fence();
#pragma unroll
        for (int kc = 0; kc < D / 16; ++kc) wgmma_ss(s, kmajor<BW>(qs, 64 * wg, kc), kmajor<BN>(kb, 0, kc), kc);
        wgmma_commit();
        wgmma_wait<0>();
        pin(s);
        AFrag pf[NS];  // unused (the compiler drops it)
        const auto lse_of = [&](int h, int, int) { return lse2[h]; };
        if (tile_masked(f, j0, BN, wr0, wr0 + 15))
            wg_probs(true, s, pf, lsum, r0, j0, true, lse_of, f, sgn, c);
        else
            wg_probs(false, s, pf, lsum, r0, j0, true, lse_of, f, sgn, c);
    }
    cp_async_wait_all();
#pragma unroll
    for (int h = 0; h < 2; ++h) lse_fix(lsefp, qrow, lsum[h], lse2[h], r0 + 8 * h, nq, 0);
    // the block's 64-row tiles of dQ's float32 accumulator zeroed (part 3's layout: tile t of row b
    // at b ceil(nq / 64) + t, 64 D floats each, rows past nq included)
    const int ntiles = (nq + 63) / 64, t0 = q0 / 64, nt = min(BW / 64, ntiles - t0);
    float4* dq32 = (float4*)dqp + (b * (u64)ntiles + t0) * (64 * D / 4);
    for (int i = tid; i < nt * 64 * D / 4; i += NTHREADS) dq32[i] = make_float4(0.f, 0.f, 0.f, 0.f);
}
#elif ATTNKERN_PART == 6
// ---------------------------------------------------------------- the fused backward's last kernel
// dQ = scale x dQ's float32 accumulator (part 3 with FUSEDQ), rounded to the input dtype: two
// elements a thread, n2 pairs in all, read in the accumulator's order (part 3's fused_dq: in each
// 64-row tile of a query head, thread t's pair (j, h) at pair (2 j + h) 128 + t, of row
// 16 (t / 32) + (t % 32) / 4 + 8 h and columns 8 j + 2 (t % 4)...) and written to dQ's rows below nq
extern "C" __device__ void ATTNKERN_NAME(u64 dq32p, u64 dqp, u64 n2, float scale, int nq) {
    const u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (i >= n2) return;
    constexpr int PAIRS = 32 * D;  // a tile's
    const int ntiles = (nq + 63) / 64, in = (int)(i % PAIRS), jh = in / 128, t = in % 128;
    const u64 tile = i / PAIRS, b = tile / ntiles;
    const int row = (int)(tile % ntiles) * 64 + 16 * (t >> 5) + ((t & 31) >> 2) + 8 * (jh & 1);
    if (row >= nq) return;
    const float2 x = ((const float2*)dq32p)[i];
    ((u32*)dqp)[((b * nq + row) * D + 8 * (jh >> 1) + 2 * (t & 3)) / 2] = pack2(x.x * scale, x.y * scale);
}
#endif
