// cuda.flash's split-K decode, second step: the partials of flash_mma.cu's decode
// variant (ATTNKERN_DECODE) merged by their log-sum-exps into the output rows.
//
// Constants prepended by cpp.py (flash_combine_kernel): ATTNKERN_D (the head size,
// a multiple of 16 up to 128), ATTNKERN_BF16 (1 bfloat16, 0 float16), ATTNKERN_FAST (the
// fastmath variant: flash_common.cuh's recip, lg2), ATTNKERN_NAME;
// then flash_common.cuh. A warp per output row, 4 rows a block of 128 threads; lane t
// holds columns 4t..4t + 3. Output row R (of rows = k/v rows x nq) is row R % nq of
// k/v row R / nq's partials, which lie at ((kv row) splits + s) nq + R % nq (rows of
// D floats; their lse at the same index, log2 domain). The splits are summed in their
// order, one after another: the result does not depend on the launch. ATTNKERN_UNROLL
// splits' partials are loaded before they are added (in order: the same bits for every
// UNROLL), so that a warp has that many reads in flight rather than one.

#define D ATTNKERN_D
#define U ATTNKERN_UNROLL  // splits whose partials are read at once (1: one after another)

// a 16-byte global load the compiler keeps where it is written (volatile): not sunk into the
// branch that uses it, so that a loop's loads are all issued before their first use
static __device__ __forceinline__ float4 load4(const float* p) {
    float4 x;
    asm volatile("ld.global.nc.v4.f32 {%0,%1,%2,%3}, [%4];\n" : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w) : "l"(p));
    return x;
}

static __device__ __forceinline__ float load1(const float* p) {
    float x;
    asm volatile("ld.global.nc.f32 %0, [%1];\n" : "=f"(x) : "l"(p));
    return x;
}

extern "C" __device__ void ATTNKERN_NAME(u64 partp, u64 plsep, u64 op, u64 lsep, int rows, int splits, int nq,
                                         int with_lse) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * 4 + (threadIdx.x >> 5);
    if (row >= rows) return;
    const u64 kv = (u64)(row / nq), r = (u64)(row % nq);
    const float* plse = (const float*)plsep + kv * splits * nq + r;
    const float* part = (const float*)partp + (kv * splits * nq + r) * D;
    const float NEG_INF = neg_inf();
    float mx = NEG_INF;
    for (int s = lane; s < splits; s += 32) mx = fmaxf(mx, plse[(u64)s * nq]);
#pragma unroll
    for (int w = 16; w > 0; w >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, w));
    float acc[4] = {0.f, 0.f, 0.f, 0.f}, den = 0.f;
    // adds split s's partial (x, its lse ls) to the row, in split order
    const auto add = [&](float ls, const float4& x) {
        if (ls == NEG_INF) return;  // the split saw no key of this row: its partial is 0
        const float w = ex2(ls - mx);
        den += w;
        acc[0] = fmaf(w, x.x, acc[0]);
        acc[1] = fmaf(w, x.y, acc[1]);
        acc[2] = fmaf(w, x.z, acc[2]);
        acc[3] = fmaf(w, x.w, acc[3]);
    };
    const bool cols = 4 * lane < D;
    if (mx != NEG_INF) {
        int s = 0;
        // U splits' loads issued before any of them is added: U reads in flight, not one
        for (; s + U <= splits; s += U) {
            float ls[U];
            float4 x[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                ls[u] = load1(plse + (u64)(s + u) * nq);
                x[u] = cols ? load4(part + (u64)(s + u) * nq * D + 4 * lane) : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) add(ls[u], x[u]);
        }
        for (; s < splits; ++s)
            add(plse[(u64)s * nq], cols ? *(const float4*)(part + (u64)s * nq * D + 4 * lane)
                                        : make_float4(0.f, 0.f, 0.f, 0.f));
    }
    const float inv = den > 0.f ? recip(den) : 0.f;  // a row that sees no key: 0, lse -inf
    if (4 * lane < D) {
        u16* out = (u16*)op + (u64)row * D + 4 * lane;
        *(uint2*)out = make_uint2(pack2(acc[0] * inv, acc[1] * inv), pack2(acc[2] * inv, acc[3] * inv));
    }
    if (with_lse && lane == 0)
        ((u16*)lsep)[row] = pack1(mx == NEG_INF ? NEG_INF : (mx + lg2(den)) * 0.6931471805599453f);
}
