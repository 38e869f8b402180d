/* The converting path for half-precision inputs: attn_kernels.h instantiated for
 * bfloat16 and float16 storage, computed in float32 with the unit's float32 vector
 * API (K and V are widened as their blocks are packed, Q as its block is scaled,
 * rows are rounded back as they are written). Included by each attn_<isa>.c after
 * its float32 vector API, with
 *   VT_F32, VW_F32         the float32 vector type and width
 *   F16_LOAD(x), F16_STORE(x)  float16 bits to float32 and back (F16C or portable)
 *   VEXP2_F32              optional: the unit's float32 2^x (attn_kernels.h's VEXP2_T)
 *   ATTN_DECODE_DIRECT     optional: the unit has attn_decode.h's decode products
 *   TRANSPOSE_BF16, TRANSPOSE_F16  optional: a VW x VW transpose of bfloat16 or float16
 *                          rows into float32 ones (attn_kernels.h's TRANSPOSE_IN)
 * It also defines attn_convert_<isa>, the unit's conversions, for the tests. */

#define ATTN_HALF_IO
#define T float
#define DT bf16
#define ADT f32
#define VT VT_F32
#define VW VW_F32
#define TIN uint16_t
#define LOAD_IN(x) attn_bf16_to_f32(x)
#ifdef TRANSPOSE_BF16
#define TRANSPOSE_IN TRANSPOSE_BF16
#endif
#ifdef VEXP2_F32
#define VEXP2_T VEXP2_F32
#endif
#define STORE_OUT(x) attn_f32_to_bf16(x)
#ifdef ATTN_DECODE_DIRECT
#define DECODE_KIND DEC_BF16
#endif
#include "attn_kernels.h"

#define ATTN_HALF_IO
#define T float
#define DT f16
#define ADT f32
#define VT VT_F32
#define VW VW_F32
#define TIN uint16_t
#define LOAD_IN(x) F16_LOAD(x)
#ifdef TRANSPOSE_F16
#define TRANSPOSE_IN TRANSPOSE_F16
#endif
#ifdef VEXP2_F32
#define VEXP2_T VEXP2_F32
#endif
#define STORE_OUT(x) F16_STORE(x)
#ifdef ATTN_DECODE_DIRECT
#define DECODE_KIND DEC_F16
#endif
#include "attn_kernels.h"

#define ATTN_CVT_(isa) attn_convert_##isa
#define ATTN_CVT(isa) ATTN_CVT_(isa)
/* kind 0: bfloat16, 1: float16 */
void ATTN_CVT(ISA)(int kind, const float *in, int64_t n, uint16_t *out, float *back)
{
    for (int64_t i = 0; i < n; i++) {
        out[i] = kind ? F16_STORE(in[i]) : attn_f32_to_bf16(in[i]);
        back[i] = kind ? F16_LOAD(out[i]) : attn_bf16_to_f32(out[i]);
    }
}
#undef ATTN_CVT
#undef ATTN_CVT_
