/* AVX-512 with BF16 dot products (AVX512_BF16's vdpbf16ps): everything attn_avx512.c
 * has, under the ISA tag avx512bf16, plus a flash kernel for bfloat16 inputs whose two
 * matmuls run on bfloat16 pairs. vdpbf16ps adds a[2i] b[2i] + a[2i+1] b[2i+1] to each
 * float32 lane i, so one instruction does 32 multiply-adds where vfmadd231ps does 16.
 *
 *   Q Kt: q rows and K panels are read as bfloat16 pairs along d, exactly as stored;
 *         the float32 scores are multiplied by scale * log2(e) afterwards (scaling q
 *         in bfloat16 first would round it a second time).
 *   softmax: float32, as in the other kernels (running max, exp2, running sum).
 *   P V:  the probabilities are rounded to bfloat16 for the dot products, as GPU
 *         flash attention does; the row sum l adds the rounded values, so the output
 *         is an exact convex combination of the rows of V with those weights.
 * Accumulation is float32 throughout; the output is rounded to bfloat16 once. */
#define ISA avx512bf16
#define ATTN_DOT_BF16 /* the float32 backward instantiated with bfloat16 products too */
#include "attn_avx512.c"

#define BMR 8  /* rows of the register tile */
#define BNR 32 /* columns of the register tile: two vectors of 16 float32 lanes */

static ATTN_INLINE int64_t rup(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* The bfloat16 pair (row[2t], row[2t + 1]) as one 32-bit word, 0 past d. */
static ATTN_INLINE uint32_t pair_at(const uint16_t *row, int64_t t, int64_t d)
{
    uint32_t lo = row[2 * t], hi = 2 * t + 1 < d ? row[2 * t + 1] : 0;
    return lo | hi << 16;
}

/* Packs keys [0, kb) of k (row stride d) as Kt panels of BNR keys: panel j holds
 * d2 = ceil(d / 2) rows of BNR pairs (key c, features 2t and 2t + 1); keys past kb
 * are zero. */
static void pack_kt_pairs(const uint16_t *k, int64_t kb, int64_t d, uint32_t *kt)
{
    const int64_t d2 = (d + 1) / 2;
    for (int64_t j0 = 0; j0 < kb; j0 += BNR) {
        uint32_t *panel = kt + j0 * d2;
        int64_t nc = kb - j0 < BNR ? kb - j0 : BNR;
        for (int64_t c = 0; c < BNR; c++)
            for (int64_t t = 0; t < d2; t++)
                panel[t * BNR + c] = c < nc ? pair_at(k + (j0 + c) * d, t, d) : 0;
    }
}

/* Packs keys [0, kb) of v (row stride dv) as panels of BNR columns: panel c0 starts
 * at c0 * kb2 (kb2 = ceil(kb / 2)) and holds kb2 rows of BNR pairs (column c, keys 2t
 * and 2t + 1); columns past dv and the key past an odd kb are zero. */
static void pack_v_pairs(const uint16_t *v, int64_t kb, int64_t dv, uint32_t *vp)
{
    const int64_t kb2 = (kb + 1) / 2;
    for (int64_t c0 = 0; c0 < dv; c0 += BNR) {
        uint32_t *panel = vp + c0 * kb2;
        int64_t nc = dv - c0 < BNR ? dv - c0 : BNR;
        for (int64_t t = 0; t < kb2; t++) {
            const uint16_t *r0 = v + 2 * t * dv + c0, *r1 = r0 + dv;
            int odd = 2 * t + 1 < kb;
            int64_t c = 0;
            for (; c < nc; c++)
                panel[t * BNR + c] = (uint32_t)r0[c] | (odd ? (uint32_t)r1[c] << 16 : 0);
            for (; c < BNR; c++)
                panel[t * BNR + c] = 0;
        }
    }
}

static ATTN_INLINE __m512bh as_bh(__m512i x) { return (__m512bh)x; }

/* s[r][0:BNR) = c * sum_t a[r] pair t . b[t] pair, for r < mr: one register tile
 * of Q Kt from a row block of q pairs (row stride lda) and a packed Kt panel. */
static ATTN_INLINE void dot_tile_qk(int mr, int64_t d2, const uint32_t *a, int64_t lda,
                                     const uint32_t *b, float *s, int64_t lds, __m512 c)
{
    __m512 acc[BMR][2];
    for (int r = 0; r < BMR; r++)
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t t = 0; t < d2; t++) {
        __m512bh b0 = as_bh(_mm512_load_si512(b + t * BNR)), b1 = as_bh(_mm512_load_si512(b + t * BNR + 16));
        for (int r = 0; r < BMR; r++) {
            if (r < mr) {
                __m512bh ar = as_bh(_mm512_set1_epi32((int)a[r * lda + t]));
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], ar, b0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], ar, b1);
            }
        }
    }
    for (int r = 0; r < BMR; r++) {
        if (r < mr) {
            _mm512_store_ps(s + r * lds, _mm512_mul_ps(acc[r][0], c));
            _mm512_store_ps(s + r * lds + 16, _mm512_mul_ps(acc[r][1], c));
        }
    }
}

/* o[r][0:BNR) = o[r][0:BNR) * alpha[r] + sum_t p[r] pair t . b[t] pair, for r < mr:
 * one register tile of P V (p: bfloat16 probabilities, row stride ldp pairs; b: a
 * packed V panel), the online-softmax rescale fused in. With half, only o[r][0:16) (a
 * last panel of at most 16 output columns; the others stay as they are, unread). */
static ATTN_INLINE void dot_tile_pv(int mr, int64_t kb2, const uint32_t *p, int64_t ldp,
                                     const uint32_t *b, float *o, int64_t ldo, const float *alpha, int half)
{
    __m512 acc[BMR][2];
    for (int r = 0; r < BMR; r++) {
        if (r < mr) {
            __m512 ar = _mm512_set1_ps(alpha[r]);
            acc[r][0] = _mm512_mul_ps(_mm512_load_ps(o + r * ldo), ar);
            acc[r][1] = half ? acc[r][0] : _mm512_mul_ps(_mm512_load_ps(o + r * ldo + 16), ar);
        } else {
            acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        }
    }
    for (int64_t t = 0; t < kb2; t++) {
        __m512bh b0 = as_bh(_mm512_load_si512(b + t * BNR));
        __m512bh b1 = half ? b0 : as_bh(_mm512_load_si512(b + t * BNR + 16));
        for (int r = 0; r < BMR; r++) {
            if (r < mr) {
                __m512bh pr = as_bh(_mm512_set1_epi32((int)p[r * ldp + t]));
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], pr, b0);
                if (!half)
                    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], pr, b1);
            }
        }
    }
    for (int r = 0; r < BMR; r++) {
        if (r < mr) {
            _mm512_store_ps(o + r * ldo, acc[r][0]);
            if (!half)
                _mm512_store_ps(o + r * ldo + 16, acc[r][1]);
        }
    }
}

/* Full tiles take the constant-BMR path so the compiler keeps the tile in registers. */
static inline void dot_call_qk(int mr, int64_t d2, const uint32_t *a, int64_t lda, const uint32_t *b,
                                float *s, int64_t lds, __m512 c)
{
    if (mr == BMR)
        dot_tile_qk(BMR, d2, a, lda, b, s, lds, c);
    else
        dot_tile_qk(mr, d2, a, lda, b, s, lds, c);
}

static inline void dot_call_pv(int mr, int64_t kb2, const uint32_t *p, int64_t ldp, const uint32_t *b,
                                float *o, int64_t ldo, const float *alpha, int half)
{
    if (half && mr == BMR)
        dot_tile_pv(BMR, kb2, p, ldp, b, o, ldo, alpha, 1);
    else if (half)
        dot_tile_pv(mr, kb2, p, ldp, b, o, ldo, alpha, 1);
    else if (mr == BMR)
        dot_tile_pv(BMR, kb2, p, ldp, b, o, ldo, alpha, 0);
    else
        dot_tile_pv(mr, kb2, p, ldp, b, o, ldo, alpha, 0);
}

/* pb[j] = bfloat16(2^(x[j] - m)) for j < valid, 0 for valid <= j < n (n a multiple
 * of 16); returns the sum of the rounded values. The tail of the last vector is set
 * to -inf first, which vexp2 maps to exactly 0. */
static float dot_row_exp2(float *x, int64_t valid, int64_t n, float m, uint16_t *pb)
{
    __m512 vm = _mm512_set1_ps(m), vs = _mm512_setzero_ps();
    int64_t lim = rup(valid, 16);
    for (int64_t j = valid; j < lim; j++)
        x[j] = -INFINITY;
    for (int64_t j = 0; j < lim; j += 16) {
        __m512 e = vexp2_f32(_mm512_sub_ps(_mm512_load_ps(x + j), vm));
        __m256i eb = (__m256i)_mm512_cvtneps_pbh(e);
        _mm256_storeu_si256((__m256i *)(pb + j), eb);
        vs = _mm512_add_ps(vs, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(eb), 16)));
    }
    for (int64_t j = lim; j < n; j++)
        pb[j] = 0;
    return _mm512_reduce_add_ps(vs);
}

typedef struct {
    uint32_t *qa;   /* the query block as bfloat16 pairs, bq x d2 */
    uint32_t *kt;   /* packed Kt panels, d2 x bk_pad pairs */
    uint32_t *vp;   /* packed V panels, bk2 x dv_pad pairs */
    float *s;       /* scores, then float32 probabilities, bq x lds */
    uint16_t *pb;   /* probabilities rounded to bfloat16, bq x lds */
    float *o;       /* output accumulator, bq x dv_pad */
    float *m, *l, *alpha; /* per row: running max, running sum, rescale */
} bf16_ws;

static void bf16_ws_free(bf16_ws *w)
{
    attn_free(w->qa); attn_free(w->kt); attn_free(w->vp); attn_free(w->s);
    attn_free(w->pb); attn_free(w->o); attn_free(w->m); attn_free(w->l); attn_free(w->alpha);
}

static int bf16_ws_alloc(bf16_ws *w, int64_t bq, int64_t bk, int64_t lds, int64_t d, int64_t dv_pad)
{
    int64_t d2 = (d + 1) / 2, bk2 = (bk + 1) / 2;
    w->qa = attn_alloc(bq, d2, sizeof(uint32_t));
    w->kt = attn_alloc(d2, rup(bk, BNR), sizeof(uint32_t));
    w->vp = attn_alloc(bk2, dv_pad, sizeof(uint32_t));
    w->s = attn_alloc(bq, lds, sizeof(float));
    w->pb = attn_alloc(bq, lds, sizeof(uint16_t));
    w->o = attn_alloc(bq, dv_pad, sizeof(float));
    w->m = attn_alloc(bq, 1, sizeof(float));
    w->l = attn_alloc(bq, 1, sizeof(float));
    w->alpha = attn_alloc(bq, 1, sizeof(float));
    if (w->qa && w->kt && w->vp && w->s && w->pb && w->o && w->m && w->l && w->alpha)
        return 1;
    bf16_ws_free(w);
    return 0;
}

/* One query block, rows [i0, i0 + bq) of batch entry bh: the flash algorithm of
 * attn_kernels.h (flash_block) with both matmuls on bfloat16 pairs. */
static void flash_block_bf16dot(const attn_problem *p, const uint16_t *q, const uint16_t *k,
                                const uint16_t *v, uint16_t *out, uint16_t *lse, float *lse32, const bf16_ws *w,
                                int64_t bh, int64_t i0, int64_t bq, int64_t dv_pad, int64_t lds)
{
    const int64_t d = p->d, d2 = (d + 1) / 2, dv = p->dv, nk = p->nk, bk = p->block_k;
    const int64_t kend = p->causal ? (i0 + bq < nk ? i0 + bq : nk) : nk;
    const int64_t ldp = lds / 2; /* a row of pb in pairs */
    const uint16_t *kh = k + bh * nk * d, *vh = v + bh * nk * dv, *qb = q + (bh * p->nq + i0) * d;
    const __m512 c = _mm512_set1_ps((float)(p->scale * ATTN_LOG2E));
    const uint32_t *pb32 = (const uint32_t *)w->pb;
    for (int64_t r = 0; r < bq; r++) {
        for (int64_t t = 0; t < d2; t++)
            w->qa[r * d2 + t] = pair_at(qb + r * d, t, d);
        w->m[r] = -INFINITY;
        w->l[r] = 0;
    }
    for (int64_t i = 0; i < bq * dv_pad; i++)
        w->o[i] = 0;
    for (int64_t j0 = 0; j0 < kend; j0 += bk) {
        int64_t kb = kend - j0 < bk ? kend - j0 : bk, kb_vw = rup(kb, 16), kb2 = (kb + 1) / 2;
        pack_kt_pairs(kh + j0 * d, kb, d, w->kt);
        for (int64_t jp = 0; jp < kb; jp += BNR) {
            const uint32_t *panel = w->kt + jp * d2;
            for (int64_t r0 = 0; r0 < bq; r0 += BMR) {
                int mr = (int)(bq - r0 < BMR ? bq - r0 : BMR);
                if (p->causal && j0 + jp > i0 + r0 + mr - 1)
                    continue; /* right of everything these rows see */
                dot_call_qk(mr, d2, w->qa + r0 * d2, d2, panel, w->s + r0 * lds + jp, lds, c);
            }
        }
        for (int64_t r = 0; r < bq; r++) {
            float *sr = w->s + r * lds;
            uint16_t *pr = w->pb + r * lds;
            int64_t valid = causal_valid_f32(p->causal, i0 + r, j0, kb);
            if (valid == 0) { /* row sees none of this block */
                memset(pr, 0, (size_t)kb_vw * sizeof *pr);
                w->alpha[r] = 1;
                continue;
            }
            float mb = row_max_f32(sr, valid);
            float mnew = mb > w->m[r] ? mb : w->m[r];
            /* first block: m = -inf and the accumulator is zero, alpha = 0 */
            w->alpha[r] = w->m[r] == -INFINITY ? 0 : (float)exp2((double)(w->m[r] - mnew));
            w->l[r] = w->l[r] * w->alpha[r] + dot_row_exp2(sr, valid, kb_vw, mnew, pr);
            w->m[r] = mnew;
        }
        pack_v_pairs(vh + j0 * dv, kb, dv, w->vp);
        for (int64_t r0 = 0; r0 < bq; r0 += BMR) {
            int mr = (int)(bq - r0 < BMR ? bq - r0 : BMR);
            int64_t kv = causal_valid_f32(p->causal, i0 + r0 + mr - 1, j0, kb);
            if (kv == 0)
                continue; /* all p are zero and alpha is one */
            for (int64_t c0 = 0; c0 < dv_pad; c0 += BNR)
                dot_call_pv(mr, (kv + 1) / 2, pb32 + r0 * ldp, ldp, w->vp + c0 * kb2,
                             w->o + r0 * dv_pad + c0, dv_pad, w->alpha + r0, dv - c0 <= 16);
        }
    }
    for (int64_t r = 0; r < bq; r++) {
        for (int64_t col = 0; col < dv; col++)
            out[(bh * p->nq + i0 + r) * dv + col] = attn_f32_to_bf16(w->o[r * dv_pad + col] / w->l[r]);
        if (lse)
            lse[bh * p->nq + i0 + r] = attn_f32_to_bf16(lse_of_f32(w->m[r], w->l[r]));
        if (lse32)
            lse32[bh * p->nq + i0 + r] = lse_of_f32(w->m[r], w->l[r]);
    }
}

/* The flash forward on bfloat16 pairs over query blocks, out and lse (bfloat16) and lse32
 * (float32) written where not NULL. */
static int flash_bf16dot(const attn_problem *p, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                         uint16_t *out, uint16_t *lse, float *lse32)
{
    const int64_t nqb = (p->nq + p->block_q - 1) / p->block_q, ntasks = nqb * p->batch;
    const int64_t dv_pad = rup(p->dv, BNR), lds = rup(p->block_k, BNR);
    int failed = 0;
#pragma omp parallel num_threads(p->num_threads)
    {
        ATTN_NOTE_TEAM();
        bf16_ws w = {0};
        int ok = bf16_ws_alloc(&w, p->block_q, p->block_k, lds, p->d, dv_pad);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        /* heaviest causal blocks first; each block on one thread: the result does not
         * depend on the thread count */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < ntasks; t++) {
            if (!ok)
                continue;
            int64_t bh = t % p->batch, i0 = (nqb - 1 - t / p->batch) * p->block_q;
            int64_t bq = p->nq - i0 < p->block_q ? p->nq - i0 : p->block_q;
            flash_block_bf16dot(p, q, k, v, out, lse, lse32, &w, bh, i0, bq, dv_pad, lds);
        }
        if (ok)
            bf16_ws_free(&w);
    }
    return failed ? ATTN_ENOMEM : ATTN_OK;
}

int attn_flash_bf16dot_avx512bf16(const attn_problem *p, const uint16_t *q, const uint16_t *k,
                                  const uint16_t *v, uint16_t *out, uint16_t *lse)
{
    return flash_bf16dot(p, q, k, v, out, lse, NULL);
}

/* The rows' lse in float32 (p->dv == 0: no output), for the bfloat16 backward: the
 * forward's own, before its rounding to bfloat16, and its scores are those that the
 * backward's products recompute, bit for bit (the same pairs in the same order). */
int attn_flash_bf16dot_lse_avx512bf16(const attn_problem *p, const uint16_t *q, const uint16_t *k, float *lse)
{
    return flash_bf16dot(p, q, k, k, NULL, NULL, lse);
}
