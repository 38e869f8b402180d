// cuda.flash FP8's V^T pre-pass: V (rows, nk, 128) e4m3 into V^T (rows, 128, vt_stride) bytes,
// zero past nk, the keys of every 32 in the order of the 8-bit wgmma A fragment (flash_wgmma.cu's
// ATTNKERN_FP8 comment): key 16h + 8a + 2t + b at column 16h + 4t + 2a + b. The layout of
// cpp.fp8_transpose_v (a torch permute, the reference of the tests), in one pass of 16-byte
// loads and stores on the legacy default stream, where the FP8 kernel runs next (no wait).
//
// A block of 256 threads takes 128 keys (k0...) of one row (grid: (vt_stride / 128, rows)):
// - in: thread i copies the 16 bytes of chunk i % 8 of key i / 8 (and of key 32 + i / 8, ...)
//   into shared memory t[key][d] (rows of 132 bytes: a warp's 4-byte stores, 4 keys x 8 chunks,
//   hit 32 distinct banks);
// - out: thread (dq = i % 32, j = i / 32) reads the words t[16 j + kk][4 dq...4 dq + 3] of its 16
//   keys (a warp's reads: 32 consecutive words, no conflict) and writes 16 bytes, columns
//   16 j... of V^T rows 4 dq...4 dq + 3: byte 4t + 2a + b of them is key 16 j + 8a + 2t + b.
// ATTNKERN_NAME is the function's name (cpp.fp8_vt_kernel).

#define VT_PITCH 33  // words a row of t: 128 bytes and 4 of padding

extern "C" __device__ void ATTNKERN_NAME(u64 vp, u64 vtp, int nk, int vt_stride) {
    __shared__ u32 t[128 * VT_PITCH];
    const int tid = threadIdx.x, k0 = blockIdx.x * 128;
    const u64 row = blockIdx.y;
    const unsigned char* v = (const unsigned char*)vp + row * (u64)nk * 128;
    unsigned char* vt = (unsigned char*)vtp + row * 128 * (u64)vt_stride;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const int key = p * 32 + (tid >> 3), ch = tid & 7;
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (k0 + key < nk) x = *(const uint4*)(v + (u64)(k0 + key) * 128 + ch * 16);
        u32* at = t + key * VT_PITCH + ch * 4;
        at[0] = x.x, at[1] = x.y, at[2] = x.z, at[3] = x.w;
    }
    __syncthreads();
    const int dq = tid & 31, j = tid >> 5;
    u32 w[16];
#pragma unroll
    for (int kk = 0; kk < 16; ++kk) w[kk] = t[(16 * j + kk) * VT_PITCH + dq];
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // row 4 dq + e: byte e of each word
        u32 o[4];
#pragma unroll
        for (int tt = 0; tt < 4; ++tt) {
            const u32 b0 = (w[2 * tt] >> (8 * e)) & 0xffu, b1 = (w[2 * tt + 1] >> (8 * e)) & 0xffu;
            const u32 b2 = (w[8 + 2 * tt] >> (8 * e)) & 0xffu, b3 = (w[9 + 2 * tt] >> (8 * e)) & 0xffu;
            o[tt] = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24);
        }
        *(uint4*)(vt + (u64)(4 * dq + e) * vt_stride + k0 + 16 * j) = make_uint4(o[0], o[1], o[2], o[3]);
    }
}
