/* AMX (Advanced Matrix Extensions: AMX-TILE and AMX-BF16, Sapphire Rapids and later):
 * everything attn_avx512.c has, under the ISA tag amx, plus a flash kernel for bfloat16
 * inputs whose two matmuls run on tiles. tdpbf16ps adds to a 16 x 16 float32 tile the
 * product of a 16 x 32 bfloat16 tile and a 32 x 16 one stored as 16 rows of 16 pairs:
 * 8192 multiply-adds per instruction.
 *
 * The numerics are those of the vdpbf16ps kernel (attn_avx512bf16.c) but for where
 * the scale is applied:
 *   Q Kt: q and K as stored, in bfloat16 pairs along d; the float32 scores are
 *         scaled by scale * log2(e) inside the exp2 (one FMA with the row max, which
 *         is taken over the raw scores), not in a pass of their own;
 *   softmax: float32 (running max, exp2 polynomial, running sum);
 *   P V:  probabilities rounded to bfloat16, the row sum l adding the rounded values;
 * float32 accumulation throughout, the output rounded to bfloat16 once.
 *
 * Tiles: 0-3 accumulate a 32 x 32 float32 block (2 x 2 tiles), 4-5 hold the two
 * 16-row halves of the left operand, 6-7 the two 16-column halves of the right one;
 * every tile is 16 rows of 64 bytes, so one configuration serves the whole kernel
 * (each thread loads it). Operands are zero-padded so that every tile is full: the
 * query block to a multiple of 32 rows, d to a multiple of 32 (16 pairs), K panels
 * to that many pair rows, V panels to a multiple of 16 key pairs; the zeros add
 * exact zeros. The query block is walked in strips of AROWS rows per key block, as
 * in attn_kernels.h, so the score buffers stay small.
 *
 * attn_dispatch.c runs this only where CPUID reports AMX-TILE and AMX-BF16, the OS
 * enables the tile state, and Linux grants the process the tile data permission.
 *
 * ATTN_AMX_EMULATE (never set by the build) replaces the tile instructions by
 * portable C, so the layouts can be checked on a CPU without AMX. */
#define ISA amx
#include "attn_avx512.c"

#define ANR 32   /* panel width: keys of a Kt panel, columns of a V panel */
#define AROWS 64 /* rows of a strip: two 32-row tile blocks */

static ATTN_INLINE int64_t amx_rup(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

#ifdef ATTN_AMX_EMULATE
static __thread uint8_t amx_tile[8][16][64];
static float amx_bf(uint32_t pair, int hi) { return attn_bf16_to_f32((uint16_t)(hi ? pair >> 16 : pair)); }
#define AMX_LOADCFG(cfg) ((void)(cfg))
#define AMX_RELEASE() ((void)0)
#define AMX_ZERO(t) memset(amx_tile[t], 0, sizeof amx_tile[t])
#define AMX_LOAD(t, base, stride)                                                  \
    for (int r_ = 0; r_ < 16; r_++)                                                \
    memcpy(amx_tile[t][r_], (const char *)(base) + r_ * (int64_t)(stride), 64)
#define AMX_STORE(t, base, stride)                                                 \
    for (int r_ = 0; r_ < 16; r_++)                                                \
    memcpy((char *)(base) + r_ * (int64_t)(stride), amx_tile[t][r_], 64)
#define AMX_DP(c, a, b)                                                            \
    for (int m_ = 0; m_ < 16; m_++)                                                \
        for (int n_ = 0; n_ < 16; n_++) {                                          \
            float *c_ = (float *)amx_tile[c][m_] + n_;                             \
            for (int k_ = 0; k_ < 16; k_++) {                                      \
                uint32_t a_ = ((uint32_t *)amx_tile[a][m_])[k_];                   \
                uint32_t b_ = ((uint32_t *)amx_tile[b][k_])[n_];                   \
                *c_ += amx_bf(a_, 0) * amx_bf(b_, 0) + amx_bf(a_, 1) * amx_bf(b_, 1); \
            }                                                                      \
        }
#else
#define AMX_LOADCFG(cfg) _tile_loadconfig(cfg)
#define AMX_RELEASE() _tile_release()
#define AMX_ZERO(t) _tile_zero(t)
#define AMX_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define AMX_STORE(t, base, stride) _tile_stored(t, base, stride)
#define AMX_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#endif

/* The 64-byte tile configuration of LDTILECFG, palette 1. */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

static void amx_configure(void)
{
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    AMX_LOADCFG(&cfg);
}

/* The bfloat16 pair (row[2t], row[2t + 1]) as one 32-bit word, 0 past d. */
static ATTN_INLINE uint32_t amx_pair(const uint16_t *row, int64_t t, int64_t d)
{
    uint32_t lo = 2 * t < d ? row[2 * t] : 0, hi = 2 * t + 1 < d ? row[2 * t + 1] : 0;
    return lo | hi << 16;
}

/* Kt panels of ANR keys for keys [0, kb) of k (row stride d): panel j0 starts at
 * j0 * d2p and holds d2p rows of ANR pairs (key c, features 2t and 2t + 1); pairs
 * past d and keys past kb are zero. */
static void amx_pack_kt(const uint16_t *k, int64_t kb, int64_t d, int64_t d2p, uint32_t *kt)
{
    /* an even d: a key's pairs are its row read as 32-bit words (little-endian) */
    const int64_t whole = d % 2 ? 0 : d / 2;
    for (int64_t j0 = 0; j0 < kb; j0 += ANR) {
        uint32_t *panel = kt + j0 * d2p;
        int64_t nc = kb - j0 < ANR ? kb - j0 : ANR;
        for (int64_t c = 0; c < ANR; c++) {
            const uint16_t *row = k + (j0 + c) * d;
            int64_t t = 0;
            if (c < nc)
                for (; t < whole; t++)
                    memcpy(panel + t * ANR + c, row + 2 * t, sizeof(uint32_t));
            for (; t < d2p; t++)
                panel[t * ANR + c] = c < nc ? amx_pair(row, t, d) : 0;
        }
    }
}

/* V panels of ANR columns for keys [0, kb) of v (row stride dv): panel c0 starts at
 * c0 * kb2p and holds kb2p rows of ANR pairs (column c, keys 2t and 2t + 1); columns
 * past dv and keys past kb are zero. */
static void amx_pack_v(const uint16_t *v, int64_t kb, int64_t dv, int64_t kb2p, uint32_t *vp)
{
    for (int64_t c0 = 0; c0 < dv; c0 += ANR) {
        uint32_t *panel = vp + c0 * kb2p;
        int64_t nc = dv - c0 < ANR ? dv - c0 : ANR;
        for (int64_t t = 0; t < kb2p; t++) {
            int64_t c = 0;
            if (2 * t + 1 < kb) {
                const uint16_t *r0 = v + 2 * t * dv + c0, *r1 = r0 + dv;
                for (; c < nc; c++)
                    panel[t * ANR + c] = (uint32_t)r0[c] | (uint32_t)r1[c] << 16;
            } else if (2 * t < kb) { /* the last key of an odd count: paired with a zero */
                const uint16_t *r0 = v + 2 * t * dv + c0;
                for (; c < nc; c++)
                    panel[t * ANR + c] = r0[c];
            }
            for (; c < ANR; c++)
                panel[t * ANR + c] = 0;
        }
    }
}

/* 2^x for probabilities that are rounded to bfloat16 next (relative rounding error up
 * to 2^-9): x = n + f with |f| <= 1/2, a degree-4 Chebyshev interpolant of 2^f
 * (relative error 3.5e-6; the float32 kernels' degree 5 gives 1e-7), times 2^n by
 * vscalefps, which gives 0 for x far below the smallest float32 (no clamp needed:
 * x - n is exact). */
static ATTN_INLINE __m512 amx_exp2(__m512 x)
{
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(0.009666368515338686f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.05592197584225338f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24022349038021354f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931210452034274f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* pb[j] = bfloat16(2^(x[j] c - m)) for j < valid, 0 for valid <= j < n (n a multiple
 * of 32, x readable up to n): x holds raw scores, c = scale * log2(e), m the row's max
 * of x c; returns the sum of the rounded values. 32 scores a step: two exp2 vectors,
 * one vcvtne2ps2bf16 for both, and their sum by one vdpbf16ps against ones (pairs of
 * them in each float32 lane). Lanes past valid are set to 0. */
static float amx_row_exp2(const float *x, int64_t valid, int64_t n, float c, float m, uint16_t *pb)
{
    const __m512 vc = _mm512_set1_ps(c), vm = _mm512_set1_ps(-m);
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3f80);
    __m512 vs = _mm512_setzero_ps();
    int64_t lim = amx_rup(valid, 32);
    for (int64_t j = 0; j < lim; j += 32) {
        __m512 e0 = amx_exp2(_mm512_fmadd_ps(_mm512_load_ps(x + j), vc, vm));
        __m512 e1 = amx_exp2(_mm512_fmadd_ps(_mm512_load_ps(x + j + 16), vc, vm));
        if (j + 32 > valid) {
            int64_t r = valid - j; /* 1 to 31 */
            e0 = _mm512_maskz_mov_ps((__mmask16)(r >= 16 ? 0xffffu : (1u << r) - 1), e0);
            e1 = _mm512_maskz_mov_ps((__mmask16)(r <= 16 ? 0u : (1u << (r - 16)) - 1), e1);
        }
        __m512bh eb = _mm512_cvtne2ps_pbh(e1, e0); /* e0's 16 in the low half */
        _mm512_storeu_si512((void *)(pb + j), (__m512i)eb);
        vs = _mm512_dpbf16_ps(vs, eb, ones);
    }
    for (int64_t j = lim; j < n; j++)
        pb[j] = 0;
    return _mm512_reduce_add_ps(vs);
}

/* The max over the first valid raw scores of x of x c (c = scale * log2(e)): c times
 * their max, or their min where c < 0 (rounding is monotonic, so this is the max of
 * the rounded products exactly), the min taken as minus the max of -x. Four
 * independent chains, as in row_max: one would wait a max's latency per vector. */
static float amx_row_max(const float *x, int64_t valid, float c)
{
    const __m512i flip = _mm512_set1_epi32(c < 0 ? (int32_t)0x80000000u : 0);
#define AMX_LOADX(j) _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(_mm512_load_ps(x + (j))), flip))
    __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    int64_t j = 0;
    for (; j + 64 <= valid; j += 64) {
        m0 = _mm512_max_ps(m0, AMX_LOADX(j));
        m1 = _mm512_max_ps(m1, AMX_LOADX(j + 16));
        m2 = _mm512_max_ps(m2, AMX_LOADX(j + 32));
        m3 = _mm512_max_ps(m3, AMX_LOADX(j + 48));
    }
    for (; j + 16 <= valid; j += 16)
        m0 = _mm512_max_ps(m0, AMX_LOADX(j));
    if (j < valid)
        m0 = _mm512_mask_max_ps(m0, (__mmask16)((1u << (valid - j)) - 1), m0, AMX_LOADX(j));
#undef AMX_LOADX
    float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
    return (c < 0 ? -mx : mx) * c;
}

/* attn_f32_to_bf16 of 16 floats, in the low 16 bits of each lane: round to nearest
 * even, a NaN kept quiet (its top bits with the quiet bit set, never rounded to infinity). */
static ATTN_INLINE __m512i amx_bf16_bits(__m512 x)
{
    const __m512i u = _mm512_castps_si512(x), one = _mm512_set1_epi32(1);
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_srli_epi32(r, 16);
}

typedef struct {
    uint32_t *qa;   /* the query block as bfloat16 pairs, bqp x d2p */
    float *s;       /* a strip's scores, AROWS x lds */
    uint16_t *pb;   /* a strip's probabilities in bfloat16, AROWS x lds */
    float *o;       /* output accumulator, bqp x dv_pad */
    float *m, *l;   /* per row: running max, running sum */
} amx_ws;

static void amx_ws_free(amx_ws *w)
{
    attn_free(w->qa); attn_free(w->s);
    attn_free(w->pb); attn_free(w->o); attn_free(w->m); attn_free(w->l);
}

static int amx_ws_alloc(amx_ws *w, int64_t bq, int64_t lds, int64_t d2p, int64_t dv_pad)
{
    int64_t bqp = amx_rup(bq, 32);
    w->qa = attn_alloc(bqp, d2p, sizeof(uint32_t));
    w->s = attn_alloc(AROWS, lds, sizeof(float));
    w->pb = attn_alloc(AROWS, lds, sizeof(uint16_t));
    w->o = attn_alloc(bqp, dv_pad, sizeof(float));
    w->m = attn_alloc(bqp, 1, sizeof(float));
    w->l = attn_alloc(bqp, 1, sizeof(float));
    if (!(w->qa && w->s && w->pb && w->o && w->m && w->l)) {
        amx_ws_free(w);
        return 0;
    }
    /* padding rows of the strip buffers are read by full tiles: keep them finite */
    memset(w->s, 0, (size_t)(AROWS * lds) * sizeof(float));
    memset(w->pb, 0, (size_t)(AROWS * lds) * sizeof(uint16_t));
    return 1;
}

/* Where key block jb of batch entry bh has its packed panels: all of K and V are packed
 * once per call (amx_pack_all), not once per query block that reads them. */
typedef struct {
    uint32_t *kt, *vp;       /* all key blocks' Kt and V panels */
    int64_t nkb, kt_blk, vp_blk; /* key blocks per batch entry; uint32 words a block takes in kt, vp */
} amx_packed;

static ATTN_INLINE int64_t amx_block_keys(const attn_problem *p, int64_t j0)
{
    return p->nk - j0 < p->block_k ? p->nk - j0 : p->block_k;
}

/* One query block, rows [i0, i0 + bq) of batch entry bh. */
static void flash_block_amx(const attn_problem *p, const uint16_t *q, uint16_t *out, uint16_t *lse,
                            const amx_ws *w, const amx_packed *pk, int64_t bh, int64_t i0, int64_t bq,
                            int64_t dv_pad, int64_t lds)
{
    const int64_t d = p->d, d2p = amx_rup((d + 1) / 2, 16), dv = p->dv, nk = p->nk, bk = p->block_k;
    const int64_t bqp = amx_rup(bq, 32), ldp = lds / 2; /* a row of pb in pairs */
    const int64_t kend = p->causal ? (i0 + bq < nk ? i0 + bq : nk) : nk;
    const uint16_t *qb = q + (bh * p->nq + i0) * d;
    const float cs = (float)(p->scale * ATTN_LOG2E);
    const uint32_t *pb32 = (const uint32_t *)w->pb;
    for (int64_t r = 0; r < bqp; r++) {
        uint32_t *qr = w->qa + r * d2p;
        int64_t t = 0;
        if (r < bq && d % 2 == 0) { /* the row's pairs are its 32-bit words (little-endian) */
            memcpy(qr, qb + r * d, (size_t)d * sizeof(uint16_t));
            t = d / 2;
        }
        for (; t < d2p; t++)
            qr[t] = r < bq ? amx_pair(qb + r * d, t, d) : 0;
        w->m[r] = -INFINITY;
        w->l[r] = 0;
    }
    for (int64_t i = 0; i < bqp * dv_pad; i++)
        w->o[i] = 0;
    for (int64_t j0 = 0; j0 < kend; j0 += bk) {
        /* kb: the keys of this block the query block can see; the panels hold the whole
         * block (its V panels are kb2p pairs apart); keys past kb get probability 0 */
        const int64_t kb = kend - j0 < bk ? kend - j0 : bk, kbp = amx_rup(kb, ANR);
        const int64_t kb2p = amx_rup((amx_block_keys(p, j0) + 1) / 2, 16);
        const uint32_t *kt = pk->kt + (bh * pk->nkb + j0 / bk) * pk->kt_blk;
        const uint32_t *vp = pk->vp + (bh * pk->nkb + j0 / bk) * pk->vp_blk;
        for (int64_t r0 = 0; r0 < bq; r0 += AROWS) {
            const int64_t rows = bq - r0 < AROWS ? bq - r0 : AROWS;
            if (p->causal && j0 > i0 + r0 + rows - 1)
                continue; /* no row of the strip sees this block */
            /* S = Q Kt, 32 x 32 blocks; blocks right of everything their rows see are skipped */
            for (int64_t jp = 0; jp < kb; jp += ANR) {
                for (int64_t rb = 0; rb < rows; rb += 32) {
                    if (p->causal && j0 + jp > i0 + r0 + rb + 31)
                        continue;
                    const uint32_t *a = w->qa + (r0 + rb) * d2p, *b = kt + jp * d2p;
                    AMX_ZERO(0); AMX_ZERO(1); AMX_ZERO(2); AMX_ZERO(3);
                    for (int64_t t0 = 0; t0 < d2p; t0 += 16) {
                        AMX_LOAD(4, a + t0, d2p * 4);
                        AMX_LOAD(5, a + 16 * d2p + t0, d2p * 4);
                        AMX_LOAD(6, b + t0 * ANR, ANR * 4);
                        AMX_LOAD(7, b + t0 * ANR + 16, ANR * 4);
                        AMX_DP(0, 4, 6); AMX_DP(1, 4, 7); AMX_DP(2, 5, 6); AMX_DP(3, 5, 7);
                    }
                    float *s = w->s + rb * lds + jp;
                    AMX_STORE(0, s, lds * 4);
                    AMX_STORE(1, s + 16, lds * 4);
                    AMX_STORE(2, s + 16 * lds, lds * 4);
                    AMX_STORE(3, s + 16 * lds + 16, lds * 4);
                }
            }
            /* online softmax of the strip's rows, in three passes over them so that the
             * rows' dependency chains (a max's reduction, the exp2 of the rescale factor)
             * overlap: the maxes; the rescale factors of 16 rows a vector; the exp2 and
             * sums, the rescale applied to o */
            float mnew[AROWS], alpha[AROWS];
            int64_t nvalid[AROWS];
            for (int64_t r = 0; r < rows; r++) {
                int64_t row = r0 + r;
                nvalid[r] = causal_valid_f32(p->causal, i0 + row, j0, kb);
                /* the max of the scores in the log2 domain; the exp2 pass scales them */
                float mb = nvalid[r] ? amx_row_max(w->s + r * lds, nvalid[r], cs) : -INFINITY;
                mnew[r] = mb > w->m[row] ? mb : w->m[row];
            }
            for (int64_t r = 0; r < rows; r += 16) {
                __mmask16 k = (__mmask16)(rows - r >= 16 ? 0xffffu : (1u << (rows - r)) - 1);
                __m512 mold = _mm512_maskz_loadu_ps(k, w->m + r0 + r), mn = _mm512_maskz_loadu_ps(k, mnew + r);
                /* exactly 1 where the max stays (the polynomial's 2^0 is 1 + 2^-23); 0 for a
                 * row with no key seen yet (m = -inf), whose accumulator is zero */
                __mmask16 none = _mm512_cmp_ps_mask(mold, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
                __mmask16 same = _mm512_cmp_ps_mask(mold, mn, _CMP_EQ_OQ);
                __m512 a = _mm512_mask_blend_ps(same, vexp2_f32(_mm512_sub_ps(mold, mn)), _mm512_set1_ps(1));
                a = _mm512_mask_blend_ps(none, a, _mm512_setzero_ps());
                _mm512_mask_storeu_ps(alpha + r, k, a);
            }
            for (int64_t r = 0; r < rows; r++) {
                int64_t row = r0 + r;
                uint16_t *pr = w->pb + r * lds;
                if (nvalid[r] == 0) { /* row sees none of this block */
                    memset(pr, 0, (size_t)kbp * sizeof *pr);
                    continue;
                }
                w->l[row] = w->l[row] * alpha[r] + amx_row_exp2(w->s + r * lds, nvalid[r], kbp, cs, mnew[r], pr);
                w->m[row] = mnew[r];
                if (alpha[r] != 1) {
                    __m512 va = _mm512_set1_ps(alpha[r]);
                    float *orow = w->o + row * dv_pad;
                    for (int64_t col = 0; col < dv_pad; col += 16)
                        _mm512_store_ps(orow + col, _mm512_mul_ps(_mm512_load_ps(orow + col), va));
                }
            }
            /* O += P V, 32 x 32 blocks, only up to the keys the block's last row sees */
            for (int64_t rb = 0; rb < rows; rb += 32) {
                int64_t last = rb + 31 < rows - 1 ? rb + 31 : rows - 1;
                int64_t kv = causal_valid_f32(p->causal, i0 + r0 + last, j0, kb);
                if (kv == 0)
                    continue;
                const int64_t kvp = amx_rup((kv + 1) / 2, 16);
                const uint32_t *a = pb32 + rb * ldp;
                for (int64_t c0 = 0; c0 < dv_pad; c0 += ANR) {
                    float *o = w->o + (r0 + rb) * dv_pad + c0;
                    const uint32_t *b = vp + c0 * kb2p;
                    AMX_LOAD(0, o, dv_pad * 4);
                    AMX_LOAD(1, o + 16, dv_pad * 4);
                    AMX_LOAD(2, o + 16 * dv_pad, dv_pad * 4);
                    AMX_LOAD(3, o + 16 * dv_pad + 16, dv_pad * 4);
                    for (int64_t t0 = 0; t0 < kvp; t0 += 16) {
                        AMX_LOAD(4, a + t0, ldp * 4);
                        AMX_LOAD(5, a + 16 * ldp + t0, ldp * 4);
                        AMX_LOAD(6, b + t0 * ANR, ANR * 4);
                        AMX_LOAD(7, b + t0 * ANR + 16, ANR * 4);
                        AMX_DP(0, 4, 6); AMX_DP(1, 4, 7); AMX_DP(2, 5, 6); AMX_DP(3, 5, 7);
                    }
                    AMX_STORE(0, o, dv_pad * 4);
                    AMX_STORE(1, o + 16, dv_pad * 4);
                    AMX_STORE(2, o + 16 * dv_pad, dv_pad * 4);
                    AMX_STORE(3, o + 16 * dv_pad + 16, dv_pad * 4);
                }
            }
        }
    }
    uint16_t *ob = out + (bh * p->nq + i0) * dv;
    for (int64_t r = 0; r < bq; r++) {
        const __m512 vl = _mm512_set1_ps(w->l[r]);
        for (int64_t col = 0; col < dv; col += 16) {
            __mmask16 k = (__mmask16)(dv - col >= 16 ? 0xffffu : (1u << (dv - col)) - 1);
            __m512 x = _mm512_div_ps(_mm512_maskz_loadu_ps(k, w->o + r * dv_pad + col), vl);
            _mm256_mask_storeu_epi16(ob + r * dv + col, k, _mm512_cvtepi32_epi16(amx_bf16_bits(x)));
        }
        if (lse)
            lse[bh * p->nq + i0 + r] = attn_f32_to_bf16(lse_of_f32(w->m[r], w->l[r]));
    }
}

int attn_flash_bf16amx_amx(const attn_problem *p, const uint16_t *q, const uint16_t *k, const uint16_t *v,
                           uint16_t *out, uint16_t *lse)
{
    const int64_t nqb = (p->nq + p->block_q - 1) / p->block_q, ntasks = nqb * p->batch;
    const int64_t dv_pad = amx_rup(p->dv, ANR), lds = amx_rup(p->block_k, ANR);
    const int64_t d2p = amx_rup((p->d + 1) / 2, 16), bk = p->block_k;
    amx_packed pk;
    pk.nkb = (p->nk + bk - 1) / bk;
    pk.kt_blk = amx_rup(bk, ANR) * d2p;
    pk.vp_blk = dv_pad * amx_rup((bk + 1) / 2, 16);
    pk.kt = attn_alloc(p->batch * pk.nkb, pk.kt_blk, sizeof(uint32_t));
    pk.vp = attn_alloc(p->batch * pk.nkb, pk.vp_blk, sizeof(uint32_t));
    if (!pk.kt || !pk.vp) {
        attn_free(pk.kt);
        attn_free(pk.vp);
        return ATTN_ENOMEM;
    }
    int failed = 0;
#pragma omp parallel num_threads(p->num_threads)
    {
        ATTN_NOTE_TEAM();
        /* every key block's panels, once: each query block of its batch entry reads them */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < p->batch * pk.nkb; t++) {
            int64_t bh = t / pk.nkb, j0 = t % pk.nkb * bk, kb = amx_block_keys(p, j0);
            amx_pack_kt(k + (bh * p->nk + j0) * p->d, kb, p->d, d2p, pk.kt + t * pk.kt_blk);
            amx_pack_v(v + (bh * p->nk + j0) * p->dv, kb, p->dv, amx_rup((kb + 1) / 2, 16), pk.vp + t * pk.vp_blk);
        }
        amx_ws w = {0};
        int ok = amx_ws_alloc(&w, p->block_q, lds, d2p, dv_pad);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        } else {
            amx_configure();
        }
        /* heaviest causal blocks first; each block on one thread: the result does not
         * depend on the thread count */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < ntasks; t++) {
            if (!ok)
                continue;
            int64_t bh = t % p->batch, i0 = (nqb - 1 - t / p->batch) * p->block_q;
            int64_t bq = p->nq - i0 < p->block_q ? p->nq - i0 : p->block_q;
            flash_block_amx(p, q, out, lse, &w, &pk, bh, i0, bq, dv_pad, lds);
        }
        if (ok) {
            AMX_RELEASE();
            amx_ws_free(&w);
        }
    }
    attn_free(pk.kt);
    attn_free(pk.vp);
    return failed ? ATTN_ENOMEM : ATTN_OK;
}

#undef ANR
#undef AROWS
