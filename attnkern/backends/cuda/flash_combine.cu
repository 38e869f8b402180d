// cuda.flash's split-K decode, second step: the partials of flash_mma.cu's decode
// variant (ATTNKERN_DECODE) merged by their log-sum-exps into the output rows.
//
// Constants prepended by cpp.py (flash_combine_kernel): ATTNKERN_D (the head size,
// a multiple of 16 up to 128), ATTNKERN_BF16 (1 bfloat16, 0 float16), ATTNKERN_FAST (the
// fastmath variant: flash_common.cuh's recip, lg2), ATTNKERN_NAME;
// then flash_common.cuh. A warp per output row, 4 rows a block of 128 threads; lane t
// holds columns 4t..4t + 3. Output row R (of rows = k/v rows x nq) is row R % nq of
// k/v row R / nq's partials, which lie at ((kv row) splits + s) nq + R % nq (rows of
// D floats; their lse at the same index, log2 domain). The merge of a row is flash_common.cuh's
// combine_row (the splits summed in their order, ATTNKERN_UNROLL partials read at once), which
// flash_mma.cu's fused decode variant (ATTNKERN_FUSED) runs in its last block instead of this
// kernel: the same bits.

#define D ATTNKERN_D
#define U ATTNKERN_UNROLL  // splits whose partials are read at once (1: one after another)

extern "C" __device__ void ATTNKERN_NAME(u64 partp, u64 plsep, u64 op, u64 lsep, int rows, int splits, int nq,
                                         int with_lse) {
    const int row = blockIdx.x * 4 + (threadIdx.x >> 5);
    if (row >= rows) return;
    const u64 kv = (u64)(row / nq), r = (u64)(row % nq);
    // flash_common.cuh's combine_row, reading through the read-only cache: the partials are the
    // previous kernel's
    combine_row<D, U, false>((const float*)partp + (kv * splits * nq + r) * D, (const float*)plsep + kv * splits * nq + r,
                             splits, nq, (u16*)op + (u64)row * D, with_lse ? (u16*)lsep + row : nullptr);
}
