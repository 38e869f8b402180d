// Hopper's warpgroup MMAs (wgmma, sm_90a) for the float16/bfloat16 kernels that use them:
// flash_wgmma.cu (the forward) and flash_bwd_mma.cu's dK/dV kernel (ATTNKERN_PART 3).
// cpp._linked_kernel puts this file after flash_common.cuh and before the kernel's source
// (ATTNKERN_BF16 and ATTNKERN_D come first). Operands in shared memory lie in wgmma's
// 128-byte-swizzled layout: ATTNKERN_D / 64 blocks of 64 columns, each its rows of 128 bytes,
// the 16-byte chunk c of row r stored at chunk c ^ (r % 8), so that wgmma's reads of 8 rows hit
// distinct banks; 8-row groups lie 1024 bytes apart.

#ifndef ATTNKERN_FP8
#define ATTNKERN_FP8 0
#endif
// WG_SHAPE: the k of one instruction (32 bytes of each operand's row either way); WG_TRANS:
// the transpose immediates, which only the 16-bit types have (8-bit operands are K-major)
#if ATTNKERN_FP8
#define WG_TYPES "e4m3.e4m3"
#define WG_K "k32"
#define WG_TRANS_SS ""
#define WG_TRANS_RS ""
#elif ATTNKERN_BF16
#define WG_TYPES "bf16.bf16"
#else
#define WG_TYPES "f16.f16"
#endif
#if !ATTNKERN_FP8
#define WG_K "k16"
#define WG_TRANS_SS ", 0, 0"
#define WG_TRANS_RS ", 1"
#endif
// a row of an operand in 16-bit units: D elements of 2 bytes, or (FP8) of 1 byte
#if ATTNKERN_FP8
#define ROW16 (ATTNKERN_D / 2)
#else
#define ROW16 ATTNKERN_D
#endif


// ---------------------------------------------------------------- wgmma wrappers
// Accumulators d[n][e]: element e of 8-column tile n, in mma.sync's m16n8 layout
// for the 16 rows of the calling warp. accumulate = 0 overwrites d (scale-d false).

#define ACC8(n) "+f"(d[n][0]), "+f"(d[n][1]), "+f"(d[n][2]), "+f"(d[n][3])
#define ACC64 ACC8(0), ACC8(1), ACC8(2), ACC8(3), ACC8(4), ACC8(5), ACC8(6), ACC8(7)
#define ACC128 ACC64, ACC8(8), ACC8(9), ACC8(10), ACC8(11), ACC8(12), ACC8(13), ACC8(14), ACC8(15)
#define REGS32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
               "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define REGS64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, " \
               "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, "   \
               "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, "   \
               "%56, %57, %58, %59, %60, %61, %62, %63}"

// the wider score tiles of the warp-specialized variant (BN = 160, 176, 192, 256 keys)
#define ACC160 ACC128, ACC8(16), ACC8(17), ACC8(18), ACC8(19)
#define ACC176 ACC160, ACC8(20), ACC8(21)
#define ACC192 ACC176, ACC8(22), ACC8(23)
#define ACC256 ACC192, ACC8(24), ACC8(25), ACC8(26), ACC8(27), ACC8(28), ACC8(29), ACC8(30), ACC8(31)
#define REGS128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "\
                "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "\
                "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "\
                "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "\
                "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "\
                "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "\
                "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "\
                "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"
#define REGS80 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19,  "\
               "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37,  "\
               "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55,  "\
               "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73,  "\
               "%74, %75, %76, %77, %78, %79}"
#define REGS88 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19,  "\
               "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37,  "\
               "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55,  "\
               "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73,  "\
               "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}"
#define REGS96 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19,  "\
               "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37,  "\
               "%38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55,  "\
               "%56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73,  "\
               "%74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91,  "\
               "%92, %93, %94, %95}"

// one wgmma m64nNk16 (FP8: k32) with A and B from shared memory: REGS the accumulators' operands %0...,
// A, B, P the operand numbers of the descriptors and the accumulate flag
#define WGMMA_SS_ASM(N, REGS, ACC, A, B, P)                                                                  \
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #P ", 0;\n"                                         \
                 "wgmma.mma_async.sync.aligned.m64n" #N WG_K ".f32." WG_TYPES " " REGS ", %" #A ", %" #B   \
                 ", p, 1, 1" WG_TRANS_SS ";\n}\n"                                                             \
                 : ACC : "l"(a), "l"(b), "r"(accumulate))

// d (64 x 8 NT) (+)= a (64 x 16, shared memory) b (16 x 8 NT, shared memory, K-major); FP8:
// 32 along k
template <int NT>
static __device__ __forceinline__ void wgmma_ss(float (&d)[NT][4], u64 a, u64 b, int accumulate) {
    static_assert(NT == 8 || NT == 16 || NT == 20 || NT == 22 || NT == 24 || NT == 32,
                  "wgmma_ss: N = 64, 128, 160, 176, 192 or 256");
    if constexpr (NT == 8)
        WGMMA_SS_ASM(64, REGS32, ACC64, 32, 33, 34);
    else if constexpr (NT == 16)
        WGMMA_SS_ASM(128, REGS64, ACC128, 64, 65, 66);
    else if constexpr (NT == 20)
        WGMMA_SS_ASM(160, REGS80, ACC160, 80, 81, 82);
    else if constexpr (NT == 22)
        WGMMA_SS_ASM(176, REGS88, ACC176, 88, 89, 90);
    else if constexpr (NT == 24)
        WGMMA_SS_ASM(192, REGS96, ACC192, 96, 97, 98);
    else
        WGMMA_SS_ASM(256, REGS128, ACC256, 128, 129, 130);
}

// d (64 x 8 NT) += a (64 x 16, registers: mma.sync's A fragment of the warp's 16 rows)
// b (16 x 8 NT, shared memory, MN-major: read transposed); FP8: a 64 x 32 (the 8-bit A
// fragment: row g bytes 4t.., row g + 8 bytes 4t.., then both at 16 + 4t..) and b 32 x 8 NT
// K-major (no transpose for 8-bit types)
template <int NT>
static __device__ __forceinline__ void wgmma_rs(float (&d)[NT][4], const u32 (&a)[4], u64 b) {
    static_assert(NT == 8 || NT == 16 || NT == 24 || NT == 32, "wgmma_rs: N = 64, 128, 192 or 256");
    if constexpr (NT == 8)
        asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
                     "wgmma.mma_async.sync.aligned.m64n64" WG_K ".f32." WG_TYPES " " REGS32
                     ", {%32, %33, %34, %35}, %36, p, 1, 1" WG_TRANS_RS ";\n}\n"
                     : ACC64 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    else if constexpr (NT == 16)
        asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
                     "wgmma.mma_async.sync.aligned.m64n128" WG_K ".f32." WG_TYPES " " REGS64
                     ", {%64, %65, %66, %67}, %68, p, 1, 1" WG_TRANS_RS ";\n}\n"
                     : ACC128 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    else if constexpr (NT == 24)  // (the forward's P V at D = 192)
        asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
                     "wgmma.mma_async.sync.aligned.m64n192" WG_K ".f32." WG_TYPES " " REGS96
                     ", {%96, %97, %98, %99}, %100, p, 1, 1" WG_TRANS_RS ";\n}\n"
                     : ACC192 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
    else  // (D = 256)
        asm volatile("{\n.reg .pred p;\nsetp.eq.u32 p, 1, 1;\n"
                     "wgmma.mma_async.sync.aligned.m64n256" WG_K ".f32." WG_TYPES " " REGS128
                     ", {%128, %129, %130, %131}, %132, p, 1, 1" WG_TRANS_RS ";\n}\n"
                     : ACC256 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// before the first wgmma that touches registers written since the last ones
static __device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

static __device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

// until at most N of this warpgroup's committed groups are pending
template <int N>
static __device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }

// The compiler sees a wgmma's accumulators as written when the instruction is
// issued; these empty statements, ordered with the volatile wgmma ones, pin every
// read after the wait and every write before the fence.
template <int N>
static __device__ __forceinline__ void pin(float (&d)[N][4]) {
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[n][e])::"memory");
}

template <int N>
static __device__ __forceinline__ void pin(u32 (&d)[N][2]) {
#pragma unroll
    for (int n = 0; n < N; ++n) asm volatile("" : "+r"(d[n][0]), "+r"(d[n][1])::"memory");
}

// writes of the generic proxy (st.shared, cp.async) made visible to wgmma's reads
static __device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// a shared-memory matrix descriptor: start address, leading-dimension and stride
// offsets in bytes, 128-byte swizzle
static __device__ __forceinline__ u64 descriptor(u32 addr, u32 lead, u32 stride) {
    return (u64)((addr & 0x3ffffu) >> 4) | ((u64)(lead >> 4) << 16) | ((u64)(stride >> 4) << 32) | (1ull << 62);
}

// Chunk index i of a buffer of ROWS rows (a thread's copy) is (column block, row,
// chunk): its row, its first column, and its byte offset in the swizzled layout.
template <int ROWS>
static __device__ __forceinline__ int chunk_row(int i) { return i % (ROWS * 8) >> 3; }
template <int ROWS>
static __device__ __forceinline__ int chunk_col(int i) { return i / (ROWS * 8) * 64 + (i & 7) * 8; }
template <int ROWS>
static __device__ __forceinline__ u32 chunk_at(int i) {
    const int r = chunk_row<ROWS>(i);
    return (u32)((i / (ROWS * 8)) * ROWS * 128 + r * 128 + (((i & 7) ^ (r & 7)) << 4));
}

// the descriptor of a K-major operand (rows from row0 of a ROWS-row buffer: Q or a K
// tile) at k step kc (columns 16 kc...): the leading offset is unused with this swizzle
template <int ROWS>
static __device__ __forceinline__ u64 kmajor(u32 base, int row0, int kc) {
    return descriptor(base + (u32)((kc >> 2) * ROWS * 128 + row0 * 128 + (kc & 3) * 32), 16u, 1024u);
}

// the descriptor of an MN-major B operand (rows of a ROWS-row buffer, its columns contiguous,
// read transposed: V in P V, dO and Q in the backward's dV and dK) at the rows 16 cc...: the
// leading offset steps along its columns (the next block of 64), the stride offset along its
// rows (8 rows)
template <int ROWS>
static __device__ __forceinline__ u64 mndesc(u32 base, int cc) {
    return descriptor(base + (u32)(cc * 2048), ROWS * 128, 1024u);
}

// rows r0... of a ROWS-row buffer of ATTNKERN_D columns (ROW16 16-bit units) (K/V tiles, the backward's Q/dO tiles
// and its K, V rows) into shared memory at dst in the swizzled layout by cp.async, NT threads,
// rows at or past n zero-filled, never read
template <int ROWS, int NT>
static __device__ __forceinline__ void load_swizzled(const u16* src, u32 dst, int r0, int n, int tid) {
#pragma unroll
    for (int i = tid; i < ROWS * ROW16 / 8; i += NT) {
        const int row = r0 + chunk_row<ROWS>(i);
        const bool live = row < n;
        cp_async16(dst + chunk_at<ROWS>(i), src + (u64)(live ? row : 0) * ROW16 + chunk_col<ROWS>(i),
                   live ? 16 : 0);
    }
}

// the same copy of a whole buffer (rows r0...r0 + ROWS - 1 all below n) at constant offsets:
// with NT / 8 rows a pass of the threads (a multiple of 8 rows), a thread's chunk, its row
// within the pass and so its swizzle are the same in every pass, so each copy is one instruction
// at a constant offset from two base addresses (no per-copy index arithmetic to take issue slots
// from the products); a buffer that ends past n (or a division whose passes do not fit) takes
// load_swizzled's zero-filling copy
template <int ROWS, int NT>
static __device__ __forceinline__ void load_whole(const u16* src, u32 dst, int r0, int n, int tid) {
    constexpr int RPP = NT / 8;  // rows a pass of the threads copies, eight 16-byte chunks a row
    if constexpr (ROWS % RPP == 0 && RPP % 8 == 0) {
        if (r0 + ROWS <= n) {
            const int rt = tid >> 3, ch = tid & 7;
            const u16* s0 = src + (u64)(r0 + rt) * ROW16 + ch * 8;
            const u32 d0 = dst + rt * 128 + ((ch ^ (rt & 7)) << 4);
#pragma unroll
            for (int cb = 0; cb < ROW16 / 64; ++cb)
#pragma unroll
                for (int p = 0; p < ROWS / RPP; ++p)
                    cp_async16(d0 + (cb * ROWS + p * RPP) * 128, s0 + p * RPP * ROW16 + cb * 64, 16);
            return;
        }
    }
    load_swizzled<ROWS, NT>(src, dst, r0, n, tid);
}

// 4 bytes from global memory at src into shared memory at dst by cp.async (cache at all levels)
static __device__ __forceinline__ void cp_async4(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
