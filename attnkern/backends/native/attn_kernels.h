/* The three attention algorithms, written once over a small vector API.
 *
 * This file is a template: each attn_<isa>.c defines the vector API for one
 * instruction set and includes it once per dtype, with
 *   T, DT   element type and its tag (float/f32, double/f64)
 *   ISA     tag of the instruction set (generic, avx2, avx512)
 *   VT, VW  vector type and its width in elements
 *   MR      rows of the register tile in the matmul micro-kernels
 * and functions v<op>_<DT>: load/store (aligned), loadu/storeu, set1 zero fma
 * mul add sub div max round pow2i hsum hmax copysign. It defines attn_{naive,tiled,flash}_<DT>_<ISA>
 * and undefines T, DT, VT and VW at its end, ready for the next dtype.
 * Optional: TRANSPOSE_T(src, lds, dst, ldd), a VW x VW transpose of T in
 * registers (dst[j][i] = src[i][j]), used to pack Kt panels; VEXP2_T(x), the
 * unit's own 2^x for x <= 0 (0 at and below EXP2_LO), instead of vexp2's. The 2^f
 * polynomial for DT comes from attn_common.h (EXP2_COEF, EXP2_DEGREE, EXP2_LO).
 *
 * Half-precision inputs (the converting path): an includer may also define
 *   TIN         element type of the caller's q, k, v, out and lse (uint16_t bits)
 *   LOAD_IN(x)  that element widened to T; STORE_OUT(x) a T rounded back to TIN
 *   TRANSPOSE_IN(src, lds, dst, ldd)  optional: TRANSPOSE_T from TIN rows, widening
 *   ADT         the tag of the vector API to compute with (f32), when DT names
 *               the storage dtype (bf16, f16)
 *   ATTN_HALF_IO  instantiate only tiled and flash (no naive, backward, ceilings)
 * The caller's arrays are read only where blocks are packed or scaled (the
 * widening happens there, once per element and block) and written only where
 * rows are finished, so every product and the softmax run in T exactly as for
 * T inputs. Without TIN, TIN is T and the conversions are the identity.
 *
 * All three work in the log2 domain: q is multiplied by scale * log2(e) once,
 * so probabilities are exp2(s - max) and the softmax needs one FMA-free
 * subtraction per score.
 *
 * Determinism: every output row is produced by one thread, in an order that
 * depends only on the block sizes, never on the thread count.
 */

#ifndef TIN
#define TIN T
#define LOAD_IN(x) (x)
#define STORE_OUT(x) (x)
#define ATTN_SAME_IO /* the caller's arrays are T: K and V blocks are read in place */
#endif
#ifndef ADT
#define ADT DT
#endif

#define ATTN_CAT_(a, b) a##b
#define ATTN_CAT(a, b) ATTN_CAT_(a, b)
#define V_(op, dt) v##op##_##dt
#define V__(op, dt) V_(op, dt)
#define V(op) V__(op, ADT)
#define FN_(name, dt, isa) attn_##name##_##dt##_##isa
#define FN__(name, dt, isa) FN_(name, dt, isa)
#define FN(name) FN__(name, DT, ISA)
/* Static helpers get a dtype suffix so both instantiations live in one file. */
#define ST(name) ATTN_CAT(name##_, DT)
#define EXP2_COEF ATTN_CAT(attn_exp2_, ADT)
#define EXP2_DEGREE ATTN_CAT(ATTN_EXP2_DEGREE_, ADT)
#define EXP2_LO ATTN_CAT(ATTN_EXP2_LO_, ADT)

#define NR (2 * VW) /* columns of the register tile: two vectors */

/* 2^x for x <= 0: split x = n + f with |f| <= 1/2, a polynomial for 2^f,
 * times 2^n built in the exponent bits. x <= EXP2_LO (masked scores are
 * -inf) gives n = EXP2_LO, whose exponent bits are all zero: exactly 0. */
static ATTN_INLINE VT ST(vexp2)(VT x)
{
#ifdef VEXP2_T
    return VEXP2_T(x);
#else
    x = V(max)(x, V(set1)((T)EXP2_LO));
    VT n = V(round)(x);
    VT f = V(sub)(x, n);
    VT p = V(set1)((T)EXP2_COEF[EXP2_DEGREE]);
    for (int i = EXP2_DEGREE - 1; i >= 0; i--)
        p = V(fma)(p, f, V(set1)((T)EXP2_COEF[i]));
    return V(mul)(p, V(pow2i)(n));
#endif
}

/* tanh(x) = (1 - e) / (1 + e) with e = 2^(-2 log2(e) |x|) in (0, 1], given x's sign:
 * an absolute error of a few ulp of 1 (not relative to a small tanh), which the
 * softcap scales by its cap, the error of an uncapped score of that size. */
static ATTN_INLINE VT ST(vtanh)(VT x)
{
    VT one = V(set1)((T)1);
    VT e = ST(vexp2)(V(mul)(V(copysign)(x, one), V(set1)((T)(-2 * ATTN_LOG2E))));
    return V(copysign)(V(div)(V(sub)(one, e), V(add)(one, e)), x);
}

/* x[0:n) = cap2 * tanh(x) (n a multiple of VW): the logit softcap in the log2
 * domain, for scores x = s / c and cap2 = c log2(e); with g, also
 * g[0:n) = 1 - tanh(x)^2 = (1 - tanh)(1 + tanh), its derivative. */
static void ST(softcap_row)(T *x, T *g, int64_t n, T cap2)
{
    VT vc = V(set1)(cap2), one = V(set1)((T)1);
    for (int64_t j = 0; j < n; j += VW) {
        VT t = ST(vtanh)(V(load)(x + j));
        V(store)(x + j, V(mul)(vc, t));
        if (g)
            V(store)(g + j, V(mul)(V(sub)(one, t), V(add)(one, t)));
    }
}

/* The backward's P = e^(x ln 2 - m) for scores x in the forward's log2 domain and the
 * natural-log lse m (m = +inf gives 0), to a few ulp of the result whatever the size of
 * the scores: y = x ln 2 - m is formed in natural-log units by an FMA with ln 2's low
 * part added (x rounded exactly as the forward rounded it, m as precise as stored;
 * lse * log2(e) rounded to T would shift every probability of a row by up to its half
 * ulp of about 10), and e^y = 2^(y log2 e) keeps the change of base's rounding error:
 * y log2(e) = hi + lo to first order (an FMA and log2(e)'s low part), e^y = 2^hi (1 + lo ln 2). */
static ATTN_INLINE VT ST(vexp_sub)(VT xv, VT m)
{
    const VT ln2 = V(set1)((T)ATTN_LN2), ln2_lo = V(set1)((T)(ATTN_LN2 - (double)(T)ATTN_LN2));
    const VT l2e = V(set1)((T)ATTN_LOG2E), l2e_lo = V(set1)((T)(ATTN_LOG2E - (double)(T)ATTN_LOG2E));
    /* y below -1000 (a masked score, x = -inf, or a padding column, m = +inf) gives
     * exactly 0 through vexp2's clamp with every term finite (ln 2's low part times x
     * clamped at -1e30, where it is not what decides); a NaN stays NaN (the max's
     * second operand) */
    const VT floor = V(set1)((T)-1000), xfloor = V(set1)((T)-1e30);
    VT y = V(fma)(V(max)(xfloor, xv), ln2_lo, V(fma)(xv, ln2, V(sub)(V(zero)(), m)));
    y = V(max)(floor, y);
    VT hi = V(mul)(y, l2e);
    VT lo = V(fma)(y, l2e_lo, V(fma)(y, l2e, V(sub)(V(zero)(), hi)));
    VT e = ST(vexp2)(hi);
    return V(fma)(e, V(mul)(lo, ln2), e);
}

/* The factor q (or k) is multiplied by before the scores: scale * log2(e) (scores
 * in the log2 domain), or with a softcap c, scale / c (scores s / c, for the tanh;
 * softcap_row takes them to the log2 domain). */
static T ST(score_factor)(const attn_problem *p)
{
    return (T)(p->softcap > 0 ? p->scale / p->softcap : p->scale * ATTN_LOG2E);
}

/* What tile_qk stores of its sums x: ATTN_QK_STORE, x; ATTN_QK_EXP, the backward's P^T
 * vexp_sub(x, vec[column]) (vec the lse per column); ATTN_QK_DS, the backward's dS^T
 * pp * (x - vec[column]) (pp P^T laid out as s, vec D per column). Fused into the tile, so
 * that the backward's P and dS need no pass of their own over the rows just stored. */
#define ATTN_QK_STORE 0
#define ATTN_QK_EXP 1
#define ATTN_QK_DS 2

/* s[r][0:NR) = sum_d a[r][d] * b[d][0:NR) for r < mr: one register tile of
 * Q Kt, with b a packed panel of Kt (d rows of NR contiguous columns), stored as epi
 * says (vec and pp for the column's first element and the tile's first row). With mx,
 * mx[0:NR) also becomes its maximum with every row of the tile (a column max). */
static ATTN_INLINE void ST(tile_qk)(int mr, int64_t d, const T *a, int64_t lda,
                                    const T *b, T *s, int64_t lds, T *mx, int epi, const T *vec,
                                    const T *pp)
{
    VT acc[MR][2];
    for (int r = 0; r < MR; r++)
        acc[r][0] = acc[r][1] = V(zero)();
#pragma GCC unroll 4 /* fewer loop branches and address updates per tile */
    for (int64_t t = 0; t < d; t++) {
        VT b0 = V(load)(b + t * NR), b1 = V(load)(b + t * NR + VW);
        for (int r = 0; r < MR; r++) {
            if (r < mr) {
                VT ar = V(set1)(a[r * lda + t]);
                acc[r][0] = V(fma)(ar, b0, acc[r][0]);
                acc[r][1] = V(fma)(ar, b1, acc[r][1]);
            }
        }
    }
    if (epi != ATTN_QK_STORE) {
        VT v0 = V(loadu)(vec), v1 = V(loadu)(vec + VW);
        for (int r = 0; r < MR; r++) {
            if (r < mr && epi == ATTN_QK_EXP) {
                V(store)(s + r * lds, ST(vexp_sub)(acc[r][0], v0));
                V(store)(s + r * lds + VW, ST(vexp_sub)(acc[r][1], v1));
            } else if (r < mr) {
                V(store)(s + r * lds, V(mul)(V(load)(pp + r * lds), V(sub)(acc[r][0], v0)));
                V(store)(s + r * lds + VW, V(mul)(V(load)(pp + r * lds + VW), V(sub)(acc[r][1], v1)));
            }
        }
        return;
    }
    for (int r = 0; r < MR; r++) {
        if (r < mr) {
            V(store)(s + r * lds, acc[r][0]);
            V(store)(s + r * lds + VW, acc[r][1]);
        }
    }
    if (mx) {
        VT m0 = V(loadu)(mx), m1 = V(loadu)(mx + VW);
        for (int r = 0; r < MR; r++) {
            if (r < mr) {
                m0 = V(max)(m0, acc[r][0]);
                m1 = V(max)(m1, acc[r][1]);
            }
        }
        V(storeu)(mx, m0);
        V(storeu)(mx + VW, m1);
    }
}

/* o[r][0:NR) = o[r][0:NR) * alpha[r] + sum_k p[r][k] * b[k][0:NR) for r < mr:
 * one register tile of P V with the online-softmax rescale fused in; b holds kb
 * rows of NR contiguous columns, ldb apart: a packed panel of V (ldb = NR), or V's
 * own rows (ldb = dv, the decode path), which need not be vector-aligned. */
static ATTN_INLINE void ST(tile_pv)(int mr, int64_t kb, const T *p, int64_t ldp,
                                    const T *b, int64_t ldb, T *o, int64_t ldo, const T *alpha)
{
    VT acc[MR][2];
    for (int r = 0; r < MR; r++) {
        if (r < mr) {
            VT ar = V(set1)(alpha[r]);
            acc[r][0] = V(mul)(V(load)(o + r * ldo), ar);
            acc[r][1] = V(mul)(V(load)(o + r * ldo + VW), ar);
        } else {  /* never read; set so the compiler can see that */
            acc[r][0] = acc[r][1] = V(zero)();
        }
    }
    for (int64_t t = 0; t < kb; t++) {
        VT b0 = V(loadu)(b + t * ldb), b1 = V(loadu)(b + t * ldb + VW);
        for (int r = 0; r < MR; r++) {
            if (r < mr) {
                VT pr = V(set1)(p[r * ldp + t]);
                acc[r][0] = V(fma)(pr, b0, acc[r][0]);
                acc[r][1] = V(fma)(pr, b1, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < MR; r++) {
        if (r < mr) {
            V(store)(o + r * ldo, acc[r][0]);
            V(store)(o + r * ldo + VW, acc[r][1]);
        }
    }
}

/* Full tiles take the constant-MR path so the compiler keeps the tile in
 * registers; only the last, partial row tile pays for a runtime row count. */
static inline void ST(call_qk)(int mr, int64_t d, const T *a, int64_t lda, const T *b,
                               T *s, int64_t lds, T *mx)
{
    if (mr == MR)
        ST(tile_qk)(MR, d, a, lda, b, s, lds, mx, ATTN_QK_STORE, NULL, NULL);
    else
        ST(tile_qk)(mr, d, a, lda, b, s, lds, mx, ATTN_QK_STORE, NULL, NULL);
}

static inline void ST(call_pv)(int mr, int64_t kb, const T *p, int64_t ldp, const T *b, int64_t ldb,
                               T *o, int64_t ldo, const T *alpha)
{
    if (mr == MR)
        ST(tile_pv)(MR, kb, p, ldp, b, ldb, o, ldo, alpha);
    else
        ST(tile_pv)(mr, kb, p, ldp, b, ldb, o, ldo, alpha);
}

/* Packs rows [0, kb) of k (row stride d) as Kt panels: panel j holds
 * d rows of NR columns, columns past kb are zero; with scaled, each element of k
 * times cf (as scale_rows multiplies it; the zeros stay zeros). Where the includer
 * names an in-register VW x VW transpose for T inputs (TRANSPOSE_T), whole squares of
 * full panels go through it (scaled in its registers by TRANSPOSE_T_SCALED where named,
 * else just after it, while in cache); the rest is copied element by element. */
static ATTN_INLINE void ST(pack_kt_by)(const TIN *k, int64_t kb, int64_t d, T *kt, int scaled, T cf)
{
    for (int64_t j0 = 0; j0 < kb; j0 += NR) {
        T *panel = kt + j0 * d;
        int64_t nc = kb - j0 < NR ? kb - j0 : NR;
        int64_t t0 = 0;
#ifdef TRANSPOSE_T
        if (nc == NR) {
            for (; t0 + VW <= d; t0 += VW)
                for (int64_t c0 = 0; c0 < NR; c0 += VW) {
#ifdef TRANSPOSE_T_SCALED
                    if (scaled) {
                        TRANSPOSE_T_SCALED(k + (j0 + c0) * d + t0, d, panel + t0 * NR + c0, NR, cf);
                        continue;
                    }
#endif
                    TRANSPOSE_T(k + (j0 + c0) * d + t0, d, panel + t0 * NR + c0, NR);
                    for (int64_t t = t0; scaled && t < t0 + VW; t++)  /* no scaled transpose: after it */
                        V(store)(panel + t * NR + c0, V(mul)(V(load)(panel + t * NR + c0), V(set1)(cf)));
                }
        }
#endif
        for (int64_t t = t0; t < d; t++) {
            int64_t c = 0;
            for (; c < nc; c++)
                panel[t * NR + c] = scaled ? LOAD_IN(k[(j0 + c) * d + t]) * cf : LOAD_IN(k[(j0 + c) * d + t]);
            for (; c < NR; c++)
                panel[t * NR + c] = 0;
        }
    }
}

static void ST(pack_kt)(const TIN *k, int64_t kb, int64_t d, T *kt)
{
    ST(pack_kt_by)(k, kb, d, kt, 0, 1);
}

/* Packs rows [0, kb) of v (row stride dv) as panels of NR columns: panel c
 * starts at c * kb * NR and holds kb rows; columns past dv are zero. T inputs with
 * whole panels only (dv a multiple of NR) are copied a row at a time, two vectors
 * into each panel: v read in order, no element loop. */
static void ST(pack_v)(const TIN *v, int64_t kb, int64_t dv, T *vp)
{
#ifdef ATTN_SAME_IO
    if (dv % NR == 0) {
        for (int64_t t = 0; t < kb; t++)
            for (int64_t c0 = 0; c0 < dv; c0 += NR) {
                V(storeu)(vp + c0 * kb + t * NR, V(loadu)(v + t * dv + c0));
                V(storeu)(vp + c0 * kb + t * NR + VW, V(loadu)(v + t * dv + c0 + VW));
            }
        return;
    }
#endif
    for (int64_t c0 = 0; c0 < dv; c0 += NR) {
        T *panel = vp + c0 * kb;
        int64_t nc = dv - c0 < NR ? dv - c0 : NR;
        for (int64_t t = 0; t < kb; t++) {
            int64_t c = 0;
            for (; c < nc; c++)
                panel[t * NR + c] = LOAD_IN(v[t * dv + c0 + c]);
            for (; c < NR; c++)
                panel[t * NR + c] = 0;
        }
    }
}

/* Max of x[0:n), n >= 1. Four independent chains of vector maxes: one chain would
 * wait a max's latency (4 cycles on recent Intel cores) for every vector loaded;
 * the max is exact, so the result does not depend on the order. */
static T ST(row_max)(const T *x, int64_t n)
{
    int64_t j = 0;
    T m = x[0];
    if (n >= VW) {
        VT m0 = V(load)(x), m1 = m0, m2 = m0, m3 = m0;
        for (j = VW; j + 4 * VW <= n; j += 4 * VW) {
            m0 = V(max)(m0, V(load)(x + j));
            m1 = V(max)(m1, V(load)(x + j + VW));
            m2 = V(max)(m2, V(load)(x + j + 2 * VW));
            m3 = V(max)(m3, V(load)(x + j + 3 * VW));
        }
        for (; j + VW <= n; j += VW)
            m0 = V(max)(m0, V(load)(x + j));
        m = V(hmax)(V(max)(V(max)(m0, m1), V(max)(m2, m3)));
    }
    for (; j < n; j++)
        m = x[j] > m ? x[j] : m;
    return m;
}

/* x[j] = 2^(x[j] - m) for j < valid, x[j] = 0 for valid <= j < n (n a
 * multiple of VW); returns the sum. One pass: the tail of the last vector is
 * set to -inf first, which vexp2 maps to exactly 0. */
static T ST(row_exp2_sum)(T *x, int64_t valid, int64_t n, T m)
{
    VT vm = V(set1)(m), vs = V(zero)();
    int64_t lim = (valid + VW - 1) / VW * VW;
    for (int64_t j = valid; j < lim; j++)
        x[j] = -INFINITY;
    for (int64_t j = 0; j < lim; j += VW) {
        VT e = ST(vexp2)(V(sub)(V(load)(x + j), vm));
        V(store)(x + j, e);
        vs = V(add)(vs, e);
    }
    for (int64_t j = lim; j < n; j++)
        x[j] = 0;
    return V(hsum)(vs);
}

/* Scaled copy of q rows [0, rows): a[r][t] = q[r][t] * c, row stride d. */
static void ST(scale_rows)(const TIN *q, int64_t rows, int64_t d, T c, T *a)
{
    for (int64_t i = 0; i < rows * d; i++)
        a[i] = LOAD_IN(q[i]) * c;
}

static int64_t ST(round_up)(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* Keys a causal row i sees within the key block [j0, j0 + kb). */
static int64_t ST(causal_valid)(int causal, int64_t i, int64_t j0, int64_t kb)
{
    if (!causal)
        return kb;
    int64_t n = i - j0 + 1;
    return n < 0 ? 0 : (n > kb ? kb : n);
}

/* Natural-log log-sum-exp of a row from its running max m (log2 domain: scores
 * times scale * log2(e)) and sum l of 2^(s - m). */
static T ST(lse_of)(T m, T l) { return (T)(((double)m + log2((double)l)) * ATTN_LN2); }

/* Writes out[r][:] = o[r][:] / l[r] for r < rows. */
static void ST(write_out)(const T *o, int64_t ldo, const T *l, int64_t rows, int64_t dv, TIN *out)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < dv; c++)
            out[r * dv + c] = STORE_OUT(o[r * ldo + c] / l[r]);
}

#ifndef ATTN_HALF_IO
/* ---------------------------------------------------------------- naive */
/* The baseline: materialise the nq x nk score matrix of one head, softmax
 * each row, then one vectorised axpy per key. Rows are spread over threads. */
int FN(naive)(const attn_problem *p, const T *q, const T *k, const T *v, T *out, T *lse)
{
    const int64_t nq = p->nq, nk = p->nk, d = p->d, dv = p->dv;
    const int64_t lds = ST(round_up)(nk, VW);
    const T c = (T)(p->scale * ATTN_LOG2E);
    T *s = attn_alloc(nq, lds, sizeof(T));
    if (!s)
        return ATTN_ENOMEM;
    for (int64_t b = 0; b < p->batch; b++) {
        const T *qb = q + b * nq * d, *kb = k + b * nk * d, *vb = v + b * nk * dv;
        T *ob = out + b * nq * dv;
#pragma omp parallel num_threads(p->num_threads)
        {
        ATTN_NOTE_TEAM();
#pragma omp for schedule(static)
        for (int64_t i = 0; i < nq; i++) {
            T *si = s + i * lds;
            const T *qi = qb + i * d;
            int64_t valid = ST(causal_valid)(p->causal, i, 0, nk);
            for (int64_t j = 0; j < valid; j++) {
                const T *kj = kb + j * d;
                VT acc = V(zero)();
                int64_t t = 0;
                for (; t + VW <= d; t += VW)
                    acc = V(fma)(V(loadu)(qi + t), V(loadu)(kj + t), acc);
                T dot = V(hsum)(acc);
                for (; t < d; t++)
                    dot += qi[t] * kj[t];
                si[j] = dot * c;
            }
            T m = ST(row_max)(si, valid);
            T l = ST(row_exp2_sum)(si, valid, lds, m);
            T *oi = ob + i * dv;
            for (int64_t t = 0; t < dv; t++)
                oi[t] = 0;
            for (int64_t j = 0; j < valid; j++) {
                const T *vj = vb + j * dv;
                VT pj = V(set1)(si[j]);
                int64_t t = 0;
                for (; t + VW <= dv; t += VW)
                    V(storeu)(oi + t, V(fma)(pj, V(loadu)(vj + t), V(loadu)(oi + t)));
                for (; t < dv; t++)
                    oi[t] += si[j] * vj[t];
            }
            for (int64_t t = 0; t < dv; t++)
                oi[t] /= l;
            if (lse)
                lse[b * nq + i] = ST(lse_of)(m, l);
        }
        }
    }
    attn_free(s);
    return ATTN_OK;
}
#endif /* ATTN_HALF_IO */

/* Per-thread workspace of the blocked algorithms. */
typedef struct {
    T *a;      /* scaled q block, bq x d (flash: its Qt panels) */
    T *kt;     /* packed Kt, d x bk_pad (flash: a K block widened to T, for half inputs) */
    T *vp;     /* packed V, bk x dv_pad (flash: a V block widened to T, for half inputs) */
    T *s;      /* scores / probabilities, srows x lds */
    T *o;      /* output accumulator, bq x dv_pad (flash: its O^T panels) */
    T *m, *l, *alpha; /* per row: running max, running sum, rescale */
} ST(workspace);

static void ST(ws_free)(ST(workspace) *w)
{
    attn_free(w->a); attn_free(w->kt); attn_free(w->vp); attn_free(w->s);
    attn_free(w->o); attn_free(w->m); attn_free(w->l); attn_free(w->alpha);
}

static int ST(ws_alloc)(ST(workspace) *w, int64_t bq, int64_t bk, int64_t srows, int64_t lds,
                        int64_t d, int64_t dv_pad)
{
    int64_t bk_pad = ST(round_up)(bk, NR);
    w->a = attn_alloc(bq, d, sizeof(T));
    w->kt = attn_alloc(d, bk_pad, sizeof(T));
    w->vp = attn_alloc(bk, dv_pad, sizeof(T));
    w->s = attn_alloc(srows, lds, sizeof(T));
    w->o = attn_alloc(bq, dv_pad, sizeof(T));
    w->m = attn_alloc(bq, 1, sizeof(T));
    w->l = attn_alloc(bq, 1, sizeof(T));
    w->alpha = attn_alloc(bq, 1, sizeof(T));
    if (w->a && w->kt && w->vp && w->s && w->o && w->m && w->l && w->alpha)
        return 1;
    ST(ws_free)(w);
    return 0;
}

/* s[:, 0:kb_pad) = a . kt for rows [0, rows) (their first is row i0 of the
 * problem), kt the packed Kt panels of keys [j0, j0 + kb); in a causal block,
 * tiles left of nothing a row can see are skipped (row r sees keys <= i0 + r). */
static void ST(rows_qk)(const T *kt, int64_t kb, int64_t rows, int64_t d, const T *a, T *s,
                        int64_t lds, int causal, int64_t i0, int64_t j0)
{
    for (int64_t jp = 0; jp < kb; jp += NR) {
        const T *panel = kt + jp * d;
        for (int64_t r0 = 0; r0 < rows; r0 += MR) {
            int mr = (int)(rows - r0 < MR ? rows - r0 : MR);
            if (causal && j0 + jp > i0 + r0 + mr - 1)
                continue;
            ST(call_qk)(mr, d, a + r0 * d, d, panel, s + r0 * lds + jp, lds, NULL);
        }
    }
}

/* o = o * alpha + p . V for rows [0, rows) (the first is row i0) and the packed
 * V panels vp of keys [j0, j0 + kb); in a causal block only the keys a row tile
 * can see are visited. */
static void ST(rows_pv)(const T *vp, int64_t kb, int64_t rows, int64_t dv_pad, const T *pr,
                        int64_t ldp, const T *alpha, T *o, int causal, int64_t i0, int64_t j0)
{
    for (int64_t r0 = 0; r0 < rows; r0 += MR) {
        int mr = (int)(rows - r0 < MR ? rows - r0 : MR);
        int64_t kv = ST(causal_valid)(causal, i0 + r0 + mr - 1, j0, kb);
        if (kv == 0)
            continue;  /* all p are zero and alpha is one */
        for (int64_t c0 = 0; c0 < dv_pad; c0 += NR)
            ST(call_pv)(mr, kv, pr + r0 * ldp, ldp, vp + c0 * kb, NR, o + r0 * dv_pad + c0, dv_pad, alpha + r0);
    }
}

/* Both products of tiled for a whole query block: pack the key block, then the rows. */
static void ST(block_qk)(const ST(workspace) *w, const TIN *kblk, int64_t kb, int64_t bq,
                         int64_t d, T *s, int64_t lds, int causal, int64_t i0, int64_t j0)
{
    ST(pack_kt)(kblk, kb, d, w->kt);
    ST(rows_qk)(w->kt, kb, bq, d, w->a, s, lds, causal, i0, j0);
}

static void ST(block_pv)(const ST(workspace) *w, const TIN *vblk, int64_t kb, int64_t bq,
                         int64_t dv, int64_t dv_pad, const T *pr, int64_t ldp,
                         const T *alpha, int causal, int64_t i0, int64_t j0)
{
    ST(pack_v)(vblk, kb, dv, w->vp);
    ST(rows_pv)(w->vp, kb, bq, dv_pad, pr, ldp, alpha, w->o, causal, i0, j0);
}

/* One query block: rows [i0, i0 + bq) of batch entry bh. */
typedef void (*ST(block_fn))(const attn_problem *p, const TIN *q, const TIN *k, const TIN *v, TIN *out,
                             TIN *lse, const ST(workspace) *w, int64_t bh, int64_t i0, int64_t bq,
                             int64_t dv_pad, int64_t lds);

/* Runs body over every (batch entry, query block), heaviest causal blocks
 * first, each block on one thread with that thread's own workspace (a score
 * buffer of srows x lds). */
static int ST(for_each_qblock)(const attn_problem *p, const TIN *q, const TIN *k, const TIN *v, TIN *out,
                               TIN *lse, int64_t bq_alloc, int64_t srows, int64_t lds, ST(block_fn) body,
                               int skip_decode)
{
    const int64_t nqb = (p->nq + p->block_q - 1) / p->block_q;
    /* varlen: (sequence, row, query block) items, prefix[s] the first of sequence s */
    int64_t *prefix = p->cu_seqlens_q ? attn_varlen_items(p, p->batch, p->block_q, 0) : NULL;
    if (p->cu_seqlens_q && !prefix)
        return ATTN_ENOMEM;
    const int64_t ntasks = prefix ? prefix[p->nseq] : nqb * p->batch;
    const int64_t dv_pad = ST(round_up)(p->dv, NR);
    int failed = 0;
#pragma omp parallel num_threads(p->num_threads)
    {
        ATTN_NOTE_TEAM();
        ST(workspace) w = {0};
        int ok = ST(ws_alloc)(&w, bq_alloc, p->block_k, srows, lds, p->d, dv_pad);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < ntasks; t++) {
            if (!ok)
                continue;
            if (prefix) {  /* sequence s's block: a problem of its own at its offsets */
                int64_t s = attn_varlen_seq(prefix, p->nseq, t), u = t - prefix[s], qo, ko;
                attn_problem sp = attn_varlen_sub(p, s, &qo, &ko);
                if (skip_decode && attn_decode_chunk(&sp))
                    continue;  /* the caller runs the sequence's decode path */
                int64_t snqb = (sp.nq + p->block_q - 1) / p->block_q;
                int64_t bh = u % p->batch, i0 = (snqb - 1 - u / p->batch) * p->block_q;
                int64_t bq = sp.nq - i0 < p->block_q ? sp.nq - i0 : p->block_q;
                body(&sp, q + qo * p->d, k + ko * p->d, v + ko * p->dv, out + qo * p->dv, lse ? lse + qo : NULL,
                     &w, bh, i0, bq, dv_pad, lds);
                continue;
            }
            int64_t bh = t % p->batch, i0 = (nqb - 1 - t / p->batch) * p->block_q;
            int64_t bq = p->nq - i0 < p->block_q ? p->nq - i0 : p->block_q;
            body(p, q, k, v, out, lse, &w, bh, i0, bq, dv_pad, lds);
        }
        if (ok)
            ST(ws_free)(&w);
    }
    attn_free(prefix);
    return failed ? ATTN_ENOMEM : ATTN_OK;
}

/* ---------------------------------------------------------------- tiled */
/* Cache-blocked exact softmax: for a block of queries, the whole score row
 * block (bq x nk) is built from packed K blocks, softmaxed in two passes,
 * then multiplied with packed V blocks. O(bq * nk) memory per thread. */
static void ST(tiled_block)(const attn_problem *p, const TIN *q, const TIN *k, const TIN *v, TIN *out,
                            TIN *lse, const ST(workspace) *w, int64_t bh, int64_t i0, int64_t bq,
                            int64_t dv_pad, int64_t lds)
{
    const int64_t d = p->d, dv = p->dv, nk = p->nk, bk = p->block_k;
    const int64_t kend = p->causal ? (i0 + bq < nk ? i0 + bq : nk) : nk;
    const int64_t bk_pad = ST(round_up)(bk, NR);
    const TIN *kh = k + bh * nk * d, *vh = v + bh * nk * dv;
    ST(scale_rows)(q + (bh * p->nq + i0) * d, bq, d, (T)(p->scale * ATTN_LOG2E), w->a);
    /* key block j0 lives at columns [(j0 / bk) * bk_pad, + kb) of s */
    for (int64_t j0 = 0; j0 < kend; j0 += bk) {
        int64_t kb = kend - j0 < bk ? kend - j0 : bk;
        ST(block_qk)(w, kh + j0 * d, kb, bq, d, w->s + (j0 / bk) * bk_pad, lds, p->causal, i0, j0);
    }
    for (int64_t r = 0; r < bq; r++) {
        T *sr = w->s + r * lds;
        T m = -INFINITY, l = 0;
        for (int64_t j0 = 0; j0 < kend; j0 += bk) {
            int64_t kb = kend - j0 < bk ? kend - j0 : bk;
            int64_t valid = ST(causal_valid)(p->causal, i0 + r, j0, kb);
            if (valid > 0) {
                T mb = ST(row_max)(sr + (j0 / bk) * bk_pad, valid);
                m = mb > m ? mb : m;
            }
        }
        for (int64_t j0 = 0; j0 < kend; j0 += bk) {
            int64_t kb = kend - j0 < bk ? kend - j0 : bk;
            int64_t valid = ST(causal_valid)(p->causal, i0 + r, j0, kb);
            l += ST(row_exp2_sum)(sr + (j0 / bk) * bk_pad, valid, ST(round_up)(kb, VW), m);
        }
        w->l[r] = l;
        w->m[r] = m;
        w->alpha[r] = 1;
        for (int64_t c = 0; c < dv_pad; c++)
            w->o[r * dv_pad + c] = 0;
    }
    for (int64_t j0 = 0; j0 < kend; j0 += bk) {
        int64_t kb = kend - j0 < bk ? kend - j0 : bk;
        ST(block_pv)(w, vh + j0 * dv, kb, bq, dv, dv_pad, w->s + (j0 / bk) * bk_pad, lds,
                     w->alpha, p->causal, i0, j0);
    }
    ST(write_out)(w->o, dv_pad, w->l, bq, dv, out + (bh * p->nq + i0) * dv);
    if (lse)
        for (int64_t r = 0; r < bq; r++)
            lse[bh * p->nq + i0 + r] = STORE_OUT(ST(lse_of)(w->m[r], w->l[r]));
}

int FN(tiled)(const attn_problem *p, const TIN *q, const TIN *k, const TIN *v, TIN *out, TIN *lse)
{
    const int64_t nkb = (p->nk + p->block_k - 1) / p->block_k;
    const int64_t lds = nkb * ST(round_up)(p->block_k, NR);
    return ST(for_each_qblock)(p, q, k, v, out, lse, p->block_q, p->block_q, lds, ST(tiled_block), 0);
}

/* ---------------------------------------------------------------- flash */
/* Online softmax (FlashAttention-2 order) computed transposed: for a block of
 * queries, stream K/V blocks, keep a running max and sum per query and rescale
 * the output accumulator; no buffer grows with nk. Causal blocks past the
 * diagonal are never touched.
 *
 * The query block is packed once, as Qt panels of NR queries (scaled), and each
 * panel's scores are computed key-major, S^T = K Q^T: K and V are read where they
 * lie (the broadcast operand of the register tiles), so no K/V block is packed,
 * and a query's scores form a column of the panel, so its max, sum and rescale
 * factor are vector lanes: the column max is taken from the tiles' registers as
 * they are stored, the sums are vector adds, and the output is accumulated as
 * O^T = V^T P^T, transposed when written. Per (panel, key block): scores and their
 * column max, the rescale factors, exp2 and sums, P V. Every query's arithmetic
 * is the same whatever the query block (its column of the panel sees the same key
 * blocks in the same order). */

/* ot[r][0:NR) = ot[r][0:NR) * alpha[0:NR) + sum_t v[t * ldv + r] * pt[t][0:NR) for
 * r < mr: one register tile of O^T = V^T P^T with the rescale fused in; v is read in
 * place (row t of V at v + t * ldv, r the output column), pt is a panel's
 * probabilities, kv rows of NR (queries) contiguous. */
static ATTN_INLINE void ST(tile_pvt)(int mr, int64_t kv, const T *v, int64_t ldv, const T *pt, T *ot,
                                     const T *alpha)
{
    VT acc[MR][2];
    VT a0 = V(loadu)(alpha), a1 = V(loadu)(alpha + VW);
    for (int r = 0; r < MR; r++) {
        if (r < mr) {
            acc[r][0] = V(mul)(V(load)(ot + r * NR), a0);
            acc[r][1] = V(mul)(V(load)(ot + r * NR + VW), a1);
        } else {  /* never read; set so the compiler can see that */
            acc[r][0] = acc[r][1] = V(zero)();
        }
    }
#pragma GCC unroll 4
    for (int64_t t = 0; t < kv; t++) {
        VT b0 = V(load)(pt + t * NR), b1 = V(load)(pt + t * NR + VW);
        for (int r = 0; r < MR; r++) {
            if (r < mr) {
                VT vr = V(set1)(v[t * ldv + r]);
                acc[r][0] = V(fma)(vr, b0, acc[r][0]);
                acc[r][1] = V(fma)(vr, b1, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < MR; r++) {
        if (r < mr) {
            V(store)(ot + r * NR, acc[r][0]);
            V(store)(ot + r * NR + VW, acc[r][1]);
        }
    }
}

static inline void ST(call_pvt)(int mr, int64_t kv, const T *v, int64_t ldv, const T *pt, T *ot,
                                const T *alpha)
{
    if (mr == MR)
        ST(tile_pvt)(MR, kv, v, ldv, pt, ot, alpha);
    else
        ST(tile_pvt)(mr, kv, v, ldv, pt, ot, alpha);
}

/* Rows [0, kb) of a K or V block (row stride d) as T: in place for T inputs,
 * else widened into buf. */
static const T *ST(block_rows)(const TIN *x, int64_t kb, int64_t d, T *buf)
{
#ifdef ATTN_SAME_IO
    (void)kb; (void)d; (void)buf;
    return x;
#else
    for (int64_t i = 0; i < kb * d; i++)
        buf[i] = LOAD_IN(x[i]);
    return buf;
#endif
}

/* 1 if x[0:n) holds NaN or infinity: x * 0 is 0 for every finite x and NaN
 * otherwise, and a NaN survives the sums. Four independent chains: one would wait
 * an FMA's latency for every vector. */
static int ST(nonfinite)(const T *x, int64_t n)
{
    VT a0 = V(zero)(), a1 = a0, a2 = a0, a3 = a0, zero = a0;
    int64_t i = 0;
    for (; i + 4 * VW <= n; i += 4 * VW) {
        a0 = V(fma)(V(loadu)(x + i), zero, a0);
        a1 = V(fma)(V(loadu)(x + i + VW), zero, a1);
        a2 = V(fma)(V(loadu)(x + i + 2 * VW), zero, a2);
        a3 = V(fma)(V(loadu)(x + i + 3 * VW), zero, a3);
    }
    for (; i + VW <= n; i += VW)
        a0 = V(fma)(V(loadu)(x + i), zero, a0);
    T tail = 0;
    for (; i < n; i++)
        tail += x[i] * 0;
    return !(V(hsum)(V(add)(V(add)(a0, a1), V(add)(a2, a3))) + tail == 0);
}

/* The same for the caller's arrays. */
static int ST(nonfinite_in)(const TIN *x, int64_t n)
{
#ifdef ATTN_SAME_IO
    return ST(nonfinite)(x, n);
#else
    T acc = 0;
    for (int64_t i = 0; i < n; i++)
        acc += LOAD_IN(x[i]) * 0;
    return !(acc == 0);
#endif
}

static void ST(report)(const attn_problem *p, int bits)
{
    if (bits) {
#pragma omp atomic update
        *p->nonfinite |= bits;
    }
}

/* x[t * ldx + c] *= Z for the keys j0 + t (t < n) and the queries i0 + c (c < nc) of
 * folded row b: Z = 1 / (1 - p) where dropout keeps the probability, else 0
 * (attn_dropout_keep; key-major rows of queries, as S^T). */
static void ST(dropout_cols)(const attn_problem *p, int64_t b, int64_t i0, int64_t nc, int64_t j0, int64_t n,
                             T *x, int64_t ldx)
{
    const T z = (T)(1.0 / (1.0 - p->dropout_p));
    uint8_t keep[64];
    for (int64_t c = 0; c < nc; c++)
        for (int64_t t0 = 0; t0 < n; t0 += 64) {
            int64_t m = n - t0 < 64 ? n - t0 : 64;
            attn_dropout_keep(p, b, i0 + c + p->dropout_i0, j0 + t0 + p->dropout_j0, m, keep);
            for (int64_t t = 0; t < m; t++)
                x[(t0 + t) * ldx + c] *= keep[t] ? z : 0;
        }
}

/* The call's mask and dropout as one panel sees them: the problem, the folded row bh,
 * the mask's offset of that row, and the number of real queries of the panel (the
 * last panel of a block may have fewer than NR). */
typedef struct {
    const attn_problem *p;
    int64_t bh, mbase, nvalid;
    T alibi2;     /* the row's ALiBi slope times log2(e) (0: none) */
    int64_t off;  /* ALiBi's diagonal offset: the row's key length - nq */
} ST(panel_extra);

/* One query panel (queries q0 + [0, NR)) over the key block [j0, j0 + kv) (kv: the
 * keys some query of the panel sees), K and V rows kr, vr: its state m, l (NR each),
 * Qt panel qt, O^T panel ot (dv rows of NR), probabilities st (kv rows of NR).
 * FEAT is a compile-time constant: 0 instantiates the plain problem's panel (causal
 * the only mask: query q0 + c sees key j iff j <= q0 + c), 1 the featured one: query
 * q0 + c sees key j iff q0 + c + lo <= j <= q0 + c + hi (attn_span; keys past the
 * row's length are never passed), a query may be left without a key so far (its
 * probabilities are 0 rather than 2^(-inf + inf)), with cap2 (not 0) the scores are
 * s / c and become cap2 tanh(s / c) (softcap_row), then x's mask is added and after
 * the sums (the lse is of the undropped softmax) x's dropout applied. */
static ATTN_INLINE void ST(flash_panel_t)(const T *kr, const T *vr, int64_t kv, int64_t d, int64_t dv,
                                          const T *qt, T *st, T *ot, T *m, T *l, T *alpha, int causal,
                                          int64_t q0, int64_t j0, int64_t lo, int64_t hi, T cap2,
                                          const ST(panel_extra) *x, const int FEAT)
{
    T mx[NR], mnew[NR], msub[NR], e[NR];
    for (int c = 0; c < NR; c++)
        mx[c] = -INFINITY;
    const int masked = FEAT && (x->p->mask != NULL || x->alibi2 != 0);
    /* S^T = K Q^T with the column max; a tile that crosses an edge of a query's
     * window (key j is seen by the queries q0 + c with j - hi <= q0 + c <= j - lo)
     * is masked, and a softcapped or attention-masked one capped and masked, before
     * its max */
    for (int64_t k0 = 0; k0 < kv; k0 += MR) {
        int mr = (int)(kv - k0 < MR ? kv - k0 : MR);
        int64_t j = j0 + k0;
        int edge = FEAT ? (j + mr - 1 - hi > q0 || j - lo < q0 + NR - 1) : (causal && j + mr - 1 > q0);
        int rows = FEAT ? (edge || cap2 != 0 || masked) : edge;
        ST(call_qk)(mr, d, kr + k0 * d, d, qt, st + k0 * NR, NR, rows ? NULL : mx);
        for (int r = 0; rows && r < mr; r++) {
            T *sr = st + (k0 + r) * NR;
            if (FEAT) {
                if (cap2 != 0)
                    ST(softcap_row)(sr, NULL, NR, cap2);
                if (masked && x->p->mask) {
                    const attn_problem *p = x->p;
                    int64_t off = x->mbase + (j + r) * p->mask_stride[3] + q0 * p->mask_stride[2];
                    for (int64_t c = 0; c < x->nvalid; c++)
                        sr[c] += (T)attn_mask_log2(p, off + c * p->mask_stride[2]);
                }
                if (masked && x->alibi2 != 0)  /* -slope |i + off - j| */
                    for (int64_t c = 0; c < x->nvalid; c++)
                        sr[c] -= x->alibi2 * (T)llabs(q0 + c + x->off - (j + r));
                int64_t first = edge ? attn_clamp(j + r - hi - q0, NR) : 0;
                int64_t past = edge ? attn_clamp(j + r - lo - q0 + 1, NR) : NR;
                for (int64_t c = 0; c < first; c++)
                    sr[c] = -INFINITY;
                for (int64_t c = past; c < NR; c++)
                    sr[c] = -INFINITY;
            } else {
                for (int64_t c = j + r - q0; c > 0; c--)
                    sr[c - 1] = -INFINITY;
            }
            for (int c = 0; c < NR; c += VW)
                V(storeu)(mx + c, V(max)(V(loadu)(mx + c), V(load)(sr + c)));
        }
    }
    /* rescale factors 2^(m_old - m_new): exactly 1 where the max stays, 0 for a query
     * with no key seen yet (its accumulator is zero) */
    for (int c = 0; c < NR; c += VW) {
        VT vnew = V(max)(V(loadu)(m + c), V(loadu)(mx + c));
        V(storeu)(mnew + c, vnew);
        V(storeu)(e + c, ST(vexp2)(V(sub)(V(loadu)(m + c), vnew)));
    }
    for (int c = 0; c < NR; c++) {
        alpha[c] = m[c] == -INFINITY ? 0 : (m[c] == mnew[c] ? 1 : e[c]);
        m[c] = mnew[c];
        msub[c] = FEAT && mnew[c] == -INFINITY ? 0 : mnew[c];
    }
    /* probabilities 2^(s - m_new) and their column sums */
    VT m0 = V(loadu)(msub), m1 = V(loadu)(msub + VW), s0 = V(zero)(), s1 = V(zero)();
    for (int64_t k = 0; k < kv; k++) {
        T *sr = st + k * NR;
        VT p0 = ST(vexp2)(V(sub)(V(load)(sr), m0)), p1 = ST(vexp2)(V(sub)(V(load)(sr + VW), m1));
        V(store)(sr, p0);
        V(store)(sr + VW, p1);
        s0 = V(add)(s0, p0);
        s1 = V(add)(s1, p1);
    }
    V(storeu)(l, V(fma)(V(loadu)(l), V(loadu)(alpha), s0));
    V(storeu)(l + VW, V(fma)(V(loadu)(l + VW), V(loadu)(alpha + VW), s1));
    if (FEAT && x->p->dropout_p != 0)  /* P * Z, after the sums: the lse stays undropped */
        ST(dropout_cols)(x->p, x->bh, q0, x->nvalid, j0, kv, st, NR);
    /* O^T = O^T * alpha + V^T P^T */
    for (int64_t c0 = 0; c0 < dv; c0 += MR) {
        int mr = (int)(dv - c0 < MR ? dv - c0 : MR);
        ST(call_pvt)(mr, kv, vr + c0, dv, st, ot + c0 * NR, alpha);
    }
}

/* out[r][:] = O^T[:][r] / l[r] for the block's rows r < bq: each panel's O^T is
 * divided in place (column-wise, vectors), then transposed into out. */
static void ST(write_out_t)(T *o, const T *l, int64_t bq, int64_t dv, TIN *out, int check, int *bad)
{
    for (int64_t q0 = 0; q0 < bq; q0 += NR) {
        T *ot = o + q0 * dv;
        TIN *ob = out + q0 * dv;
        int64_t rows = bq - q0 < NR ? bq - q0 : NR;
        for (int64_t c = 0; c < dv; c++)
            for (int j = 0; j < NR; j += VW)
                V(store)(ot + c * NR + j, V(div)(V(load)(ot + c * NR + j), V(loadu)(l + q0 + j)));
        if (check && rows == NR)
            *bad |= ST(nonfinite)(ot, dv * NR);
        else if (check)  /* only the columns of real queries */
            for (int64_t c = 0; c < dv; c++)
                *bad |= ST(nonfinite)(ot + c * NR, rows);
        int64_t r0 = 0;
#if defined(TRANSPOSE_T) && defined(ATTN_SAME_IO)
        if (dv % VW == 0)  /* VW x VW squares of whole rows through registers */
            for (; r0 + VW <= rows; r0 += VW)
                for (int64_t c0 = 0; c0 < dv; c0 += VW)
                    TRANSPOSE_T(ot + c0 * NR + r0, NR, ob + r0 * dv + c0, dv);
#endif
        for (int64_t r = r0; r < rows; r++)
            for (int64_t c = 0; c < dv; c++)
                ob[r * dv + c] = STORE_OUT(ot[c * NR + r]);
    }
}

/* 1 if row i of span sp sees no key. */
static int ST(row_empty)(const attn_span *sp, int64_t i)
{
    return attn_clamp(i + sp->lo, sp->len) >= attn_clamp(i + sp->hi + 1, sp->len);
}

/* One query block of flash; FEAT (a compile-time constant) as for flash_panel_t: 0
 * for the plain problem (no span bookkeeping, no per-tile feature tests), 1 for one
 * with features. */
static ATTN_INLINE void ST(flash_block_t)(const attn_problem *p, const TIN *q, const TIN *k, const TIN *v,
                                          TIN *out, TIN *lse, const ST(workspace) *w, int64_t bh, int64_t i0,
                                          int64_t bq, const int FEAT)
{
    const int64_t d = p->d, dv = p->dv, nk = p->nk, bk = p->block_k, bkv = FEAT ? bh / p->kv_group : bh;
    attn_span sp = {0, 0, nk};
    if (FEAT)
        sp = attn_span_of(p, bh);
    /* the keys some row of the block sees, from the first row's lowest to the last
     * row's highest; key blocks start at multiples of bk, as without a window, so a
     * query meets the same key blocks whatever its query block */
    const int64_t kfirst = FEAT ? attn_clamp(i0 + sp.lo, sp.len) / bk * bk : 0;
    const int64_t kend = FEAT ? attn_clamp(i0 + bq + sp.hi, sp.len) : (p->causal ? (i0 + bq < nk ? i0 + bq : nk) : nk);
    const int64_t bq_pad = ST(round_up)(bq, NR);
    const TIN *kh = k + bkv * nk * d, *vh = v + bkv * nk * dv;
    /* With p->nonfinite: this block's q, its output and, in the head's last query block
     * of the first query row of each k/v row, k and v, each checked where it is read
     * or written anyway (K/V blocks right after their products, from the caches);
     * the keys this block does not read are scanned at the end, up to the longest
     * key length of the k/v row's query rows (padding past it is never read). */
    const int check = p->nonfinite != NULL;
    const int check_kv = check && i0 + bq == p->nq && (!FEAT || bh % p->kv_group == 0);
    int bad = 0;
    /* Qt panels, scaled: panel q0 / NR at w->a + q0 * d, d rows of NR */
    ST(pack_kt)(q + (bh * p->nq + i0) * d, bq, d, w->a);
    if (check && ST(nonfinite)(w->a, bq_pad * d))  /* before scaling, which may overflow */
        bad |= ATTN_NONFINITE_Q;
    const T c = FEAT ? ST(score_factor)(p) : (T)(p->scale * ATTN_LOG2E);
    const T cap2 = FEAT ? (T)(p->softcap * ATTN_LOG2E) : 0;
    for (int64_t i = 0; i < bq_pad * d; i++)
        w->a[i] *= c;
    for (int64_t r = 0; r < bq_pad; r++) {
        w->m[r] = -INFINITY;
        w->l[r] = 0;
    }
    for (int64_t i = 0; i < bq_pad * dv; i++)
        w->o[i] = 0;
    ST(panel_extra) x = {p, bh, FEAT && p->mask ? attn_mask_base(p, bh) : 0, 0,
                         FEAT && p->alibi ? (T)(p->alibi[bh] * ATTN_LOG2E) : 0, sp.len - p->nq};
    for (int64_t j0 = kfirst; j0 < kend; j0 += bk) {
        int64_t kb = kend - j0 < bk ? kend - j0 : bk;
        const T *kr = ST(block_rows)(kh + j0 * d, kb, d, w->kt);
        const T *vr = ST(block_rows)(vh + j0 * dv, kb, dv, w->vp);
        for (int64_t q0 = 0; q0 < bq; q0 += NR) {
            /* the keys of the block the panel sees: from its first query's lowest to
             * its last query's highest */
            int64_t qlast = i0 + (bq - q0 < NR ? bq : q0 + NR) - 1;
            int64_t ks = 0, ke = p->causal ? ST(causal_valid)(1, qlast, j0, kb) : kb;
            if (FEAT) {
                ks = attn_clamp(i0 + q0 + sp.lo - j0, kb);
                ke = attn_clamp(qlast + sp.hi + 1 - j0, kb);
                x.nvalid = qlast + 1 - (i0 + q0);
            }
            if (ks >= ke)
                continue;  /* no query of the panel sees this block: its state stays as it is */
            ST(flash_panel_t)(kr + ks * d, vr + ks * dv, ke - ks, d, dv, w->a + q0 * d, w->s, w->o + q0 * dv,
                              w->m + q0, w->l + q0, w->alpha + q0, p->causal, i0 + q0, j0 + ks, sp.lo, sp.hi,
                              cap2, &x, FEAT);
        }
        if (check_kv) {  /* right after the products read them, while they are in the caches */
            bad |= ST(nonfinite)(kr, kb * d) ? ATTN_NONFINITE_K : 0;
            bad |= ST(nonfinite)(vr, kb * dv) ? ATTN_NONFINITE_V : 0;
        }
    }
    if (check_kv && !FEAT && kend < nk) {
        bad |= ST(nonfinite_in)(kh + kend * d, (nk - kend) * d) ? ATTN_NONFINITE_K : 0;
        bad |= ST(nonfinite_in)(vh + kend * dv, (nk - kend) * dv) ? ATTN_NONFINITE_V : 0;
    }
    if (check_kv && FEAT) {
        int64_t klen = sp.len, past = kend > kfirst ? kend : kfirst;
        for (int64_t g = 1; p->seqlen_k && g < p->kv_group; g++) {
            int64_t len = p->seqlen_k[(bh + g) / p->heads];
            klen = len > klen ? len : klen;
        }
        bad |= ST(nonfinite_in)(kh, kfirst * d) ? ATTN_NONFINITE_K : 0;
        bad |= ST(nonfinite_in)(vh, kfirst * dv) ? ATTN_NONFINITE_V : 0;
        if (klen > past) {
            bad |= ST(nonfinite_in)(kh + past * d, (klen - past) * d) ? ATTN_NONFINITE_K : 0;
            bad |= ST(nonfinite_in)(vh + past * dv, (klen - past) * dv) ? ATTN_NONFINITE_V : 0;
        }
    }
    /* rows that see no key: output 0 (o zeroed over l = 1; o may hold 0 * inf from
     * keys of other rows of their panel) and lse -inf (their m stays -inf); a row
     * that sees keys but has l = 0 (every score overflowed to -inf) keeps 0 / 0, but
     * with an attention mask a row whose every score is -inf counts as seeing none */
    for (int64_t r = 0; FEAT && r < bq; r++) {
        if (w->l[r] == 0 && (ST(row_empty)(&sp, i0 + r) || (p->mask && w->m[r] == -INFINITY))) {
            w->l[r] = 1;
            for (int64_t c = 0; c < dv; c++)
                w->o[(r / NR * NR) * dv + c * NR + r % NR] = 0;
        }
    }
    int bad_out = 0;
    ST(write_out_t)(w->o, w->l, bq, dv, out + (bh * p->nq + i0) * dv, check, &bad_out);
    if (check)
        ST(report)(p, bad | (bad_out ? ATTN_NONFINITE_OUT : 0));
    if (lse)
        for (int64_t r = 0; r < bq; r++)
            lse[bh * p->nq + i0 + r] = STORE_OUT(ST(lse_of)(w->m[r], w->l[r]));
}

static void ST(flash_block_plain)(const attn_problem *p, const TIN *q, const TIN *k, const TIN *v, TIN *out,
                                  TIN *lse, const ST(workspace) *w, int64_t bh, int64_t i0, int64_t bq,
                                  int64_t dv_pad, int64_t lds)
{
    (void)dv_pad; (void)lds;
    ST(flash_block_t)(p, q, k, v, out, lse, w, bh, i0, bq, 0);
}

static void ST(flash_block_feat)(const attn_problem *p, const TIN *q, const TIN *k, const TIN *v, TIN *out,
                                 TIN *lse, const ST(workspace) *w, int64_t bh, int64_t i0, int64_t bq,
                                 int64_t dv_pad, int64_t lds)
{
    (void)dv_pad; (void)lds;
    ST(flash_block_t)(p, q, k, v, out, lse, w, bh, i0, bq, 1);
}

/* ---------------------------------------------------------------- decode */
/* Flash-decoding (attn_decode_chunk): the query rows of one k/v row (its kv_group
 * heads times nq queries, contiguous in q, out and lse: row r is head r / nq, query
 * r % nq) form one block, so each K/V block is read from memory once for the whole
 * group; the keys are split into chunks, one work item per (k/v row, chunk), each
 * leaving a partial (O, m, l) that a second pass combines in chunk order.
 * The products are query-major, as in tiled (S = Q K^T from packed Kt panels, O =
 * O * alpha + P V from packed V panels): the keys fill the register tiles' vector
 * lanes and the few query rows their MR rows, so a decode step costs about d FMAs per
 * key and query row, not the NR-wide query panels of flash_block_t (mostly empty
 * lanes for a handful of rows). Each row carries its own mask: the keys [kmin, kmax)
 * its span and key length let it see, its ALiBi slope and its mask row. */
typedef struct {
    int64_t kmin[ATTN_DECODE_MAX_ROWS], kmax[ATTN_DECODE_MAX_ROWS]; /* row r sees kmin[r] <= j < kmax[r] */
    int64_t ipos[ATTN_DECODE_MAX_ROWS];  /* ALiBi's query position i + len - nq */
    int64_t mrow[ATTN_DECODE_MAX_ROWS];  /* the mask's offset of the row */
    T slope[ATTN_DECODE_MAX_ROWS];       /* ALiBi slope times log2(e) */
    int64_t first, last;                 /* the keys some row sees: [first, last) */
    int64_t klen;                        /* the longest key length of the rows */
} ST(drows);

/* The rows of k/v row bkv (R of them). */
static void ST(decode_rows)(const attn_problem *p, int64_t bkv, int64_t R, ST(drows) *dr)
{
    dr->first = INT64_MAX;
    dr->last = dr->klen = 0;
    for (int64_t r = 0; r < R; r++) {
        int64_t bh = bkv * p->kv_group + r / p->nq, i = r % p->nq;
        attn_span sp = attn_span_of(p, bh);
        dr->kmin[r] = attn_clamp(i + sp.lo, sp.len);
        dr->kmax[r] = attn_clamp(i + sp.hi + 1, sp.len);
        dr->ipos[r] = i + sp.len - p->nq;
        dr->mrow[r] = p->mask ? attn_mask_base(p, bh) + i * p->mask_stride[2] : 0;
        dr->slope[r] = p->alibi ? (T)(p->alibi[bh] * ATTN_LOG2E) : 0;
        dr->klen = sp.len > dr->klen ? sp.len : dr->klen;
        if (dr->kmin[r] < dr->kmax[r]) {
            dr->first = dr->kmin[r] < dr->first ? dr->kmin[r] : dr->first;
            dr->last = dr->kmax[r] > dr->last ? dr->kmax[r] : dr->last;
        }
    }
}

/* The online softmax of row r over its scores sr[0:kb) of the keys [j0, j0 + kb)
 * (padded to kb_pad): softcap, mask and ALiBi, the keys outside the row's to -inf,
 * then the new max, the rescale factor (0 for a row with no key seen yet, exactly 1
 * where the max stays) and the probabilities with their sum. */
static void ST(decode_softmax)(const attn_problem *p, const ST(drows) *dr, int64_t r, T *sr, int64_t j0,
                               int64_t kb, int64_t kb_pad, T cap2, T *m, T *l, T *alpha)
{
    const int64_t lo = attn_clamp(dr->kmin[r] - j0, kb), hi = attn_clamp(dr->kmax[r] - j0, kb);
    if (cap2 != 0)
        ST(softcap_row)(sr, NULL, kb_pad, cap2);
    for (int64_t t = lo; p->mask && t < hi; t++)
        sr[t] += (T)attn_mask_log2(p, dr->mrow[r] + (j0 + t) * p->mask_stride[3]);
    for (int64_t t = lo; p->alibi && t < hi; t++)
        sr[t] -= dr->slope[r] * (T)llabs(dr->ipos[r] - (j0 + t));
    for (int64_t t = 0; t < lo; t++)
        sr[t] = -INFINITY;
    for (int64_t t = hi; t < kb; t++)
        sr[t] = -INFINITY;
    T mb = ST(row_max)(sr, kb), mold = m[r], mnew = mb > mold ? mb : mold;
    alpha[r] = mold == -INFINITY ? 0 : (mold == mnew ? 1 : (T)exp2((double)(mold - mnew)));
    m[r] = mnew;
    l[r] = l[r] * alpha[r] + ST(row_exp2_sum)(sr, kb, kb_pad, mnew == -INFINITY ? 0 : mnew);
}

/* Asks the caches for bytes [0, n) of x, line by line: locality 3 into L1 (a block
 * about to be read), 2 into L2 (one read after the rest of the block's work). */
#ifndef ATTN_DECODE_PREFETCH
#define ATTN_DECODE_PREFETCH
static ATTN_INLINE void attn_prefetch_l1(const void *x, int64_t n)
{
    for (int64_t i = 0; i < n; i += 64)
        __builtin_prefetch((const char *)x + i, 0, 3);
}
static ATTN_INLINE void attn_prefetch_l2(const void *x, int64_t n)
{
    for (int64_t i = 0; i < n; i += 64)
        __builtin_prefetch((const char *)x + i, 0, 2);
}
#endif

/* pack_kt for the decode path, one panel of NR keys at a time: half inputs are first
 * widened row by row into wide (contiguous conversions), then packed from float32
 * rows, whole squares through the unit's in-register float32 transpose where it has
 * one (TRANSPOSE_F32): an element by element pack of half rows would cost more than
 * reading them. The cache is read once, from memory, so each panel first asks for the
 * K rows 2 NR keys ahead (up to `ahead` keys from k: the item's end) and for its own
 * keys' V rows (v, row stride dv), which P V reads after the whole block's scores:
 * the memory streams then overlap the packing and the products instead of waiting
 * on each miss. */
static void ST(decode_pack_k)(const TIN *k, const TIN *v, int64_t kb, int64_t ahead, int64_t d, int64_t dv,
                              T *kt, T *wide)
{
    for (int64_t j0 = 0; j0 < kb; j0 += NR) {
        T *panel = kt + j0 * d;
        int64_t nc = kb - j0 < NR ? kb - j0 : NR, pf = j0 + 2 * NR;
        if (pf < ahead)
            attn_prefetch_l1(k + pf * d, (ahead - pf < NR ? ahead - pf : NR) * d * (int64_t)sizeof(TIN));
        attn_prefetch_l2(v + j0 * dv, nc * dv * (int64_t)sizeof(TIN));
#if defined(ATTN_SAME_IO)
        (void)wide;
        ST(pack_kt)(k + j0 * d, nc, d, panel);
#elif defined(TRANSPOSE_IN)
        (void)wide;  /* whole squares widened in registers, the rest element by element */
        int64_t t0 = 0;
        if (nc == NR)
            for (; t0 + VW <= d; t0 += VW)
                for (int64_t c0 = 0; c0 < NR; c0 += VW)
                    TRANSPOSE_IN(k + (j0 + c0) * d + t0, d, panel + t0 * NR + c0, NR);
        for (int64_t t = t0; t < d; t++)
            for (int64_t c = 0; c < NR; c++)
                panel[t * NR + c] = c < nc ? LOAD_IN(k[(j0 + c) * d + t]) : 0;
#else
        const T *x = ST(block_rows)(k + j0 * d, nc, d, wide);
        int64_t t0 = 0;
#ifdef TRANSPOSE_F32
        if (nc == NR)
            for (; t0 + VW <= d; t0 += VW)
                for (int64_t c0 = 0; c0 < NR; c0 += VW)
                    TRANSPOSE_F32(x + c0 * d + t0, d, panel + t0 * NR + c0, NR);
#endif
        for (int64_t t = t0; t < d; t++)
            for (int64_t c = 0; c < NR; c++)
                panel[t * NR + c] = c < nc ? x[c * d + t] : 0;
#endif
    }
}

/* o = o * alpha + p . V for the R rows of a decode block (o rows of dv, dv a
 * multiple of NR) from V's rows themselves (row stride dv, widened ones for half
 * inputs): no packed copy of V, which would cost a write and a second read of every
 * value the decode path reads once. */
static void ST(decode_pv)(const T *vr, int64_t kb, int64_t R, int64_t dv, const T *pr, int64_t ldp,
                          const T *alpha, T *o)
{
    for (int64_t r0 = 0; r0 < R; r0 += MR) {
        int mr = (int)(R - r0 < MR ? R - r0 : MR);
        for (int64_t c0 = 0; c0 < dv; c0 += NR)
            ST(call_pv)(mr, kb, pr + r0 * ldp, ldp, vr + c0, dv, o + r0 * dv + c0, dv, alpha + r0);
    }
}

/* The most keys a decode block holds: block_k, or the whole cache where it is shorter
 * (the workspace of a short cache is sized by it, not by block_k). */
static int64_t ST(decode_block)(const attn_problem *p) { return p->block_k < p->nk ? p->block_k : p->nk; }

/* 1 where the unit's products read K and V from the cache's own rows (attn_decode.h). */
static int ST(decode_direct)(const attn_problem *p)
{
#ifdef DECODE_KIND
    return attn_dec_direct(DECODE_KIND, p->kv_group * p->nq, p->d, p->dv);
#else
    (void)p;
    return 0;
#endif
}

/* Work item (k/v row bkv, keys [c0, c1)): the partial O (R rows of dv_pad), m and l
 * of the R rows into po, pm, pl; returns nonfinite bits of q (the first chunk only)
 * and of the keys and values of the chunk up to the rows' longest key length (the
 * keys no row sees included, so that the chunks together scan them all). */
static int ST(decode_item)(const attn_problem *p, const TIN *q, const TIN *k, const TIN *v,
                           const ST(workspace) *w, T *wide, const ST(drows) *dr, int64_t bkv, int64_t c0,
                           int64_t c1, int64_t R, T *po, T *pm, T *pl)
{
    const int64_t d = p->d, dv = p->dv, nk = p->nk, bk = p->block_k, dv_pad = ST(round_up)(dv, NR);
    const int64_t lds = ST(round_up)(ST(decode_block)(p), NR);
    const int check = p->nonfinite != NULL;
    int bad = 0;
    const TIN *kh = k + bkv * nk * d, *vh = v + bkv * nk * dv;
    if (check && c0 == 0 && ST(nonfinite_in)(q + bkv * R * d, R * d))  /* before scaling, which may overflow */
        bad |= ATTN_NONFINITE_Q;
    const T cap2 = (T)(p->softcap * ATTN_LOG2E);
    const int direct = ST(decode_direct)(p);  /* q is read as stored there */
    if (!direct)
        ST(scale_rows)(q + bkv * R * d, R, d, ST(score_factor)(p), w->a);
    for (int64_t r = 0; r < R; r++) {
        pm[r] = -INFINITY;
        pl[r] = 0;
    }
    for (int64_t i = 0; i < R * dv_pad; i++)
        po[i] = 0;
    const int64_t ks = dr->first > c0 ? dr->first : c0, ke = dr->last < c1 ? dr->last : c1;
    for (int64_t j0 = ks; j0 < ke; j0 += bk) {
        int64_t kb = ke - j0 < bk ? ke - j0 : bk, kb_pad = ST(round_up)(kb, NR);
#ifdef DECODE_KIND
        if (direct) {
            attn_dec_qk(DECODE_KIND, kh + j0 * d, kb, ke - j0, d, vh + j0 * dv, dv, q + bkv * R * d, R,
                        (float)ST(score_factor)(p), w->s, lds, w->kt);
            for (int64_t r = 0; r < R; r++)
                ST(decode_softmax)(p, dr, r, w->s + r * lds, j0, kb, kb_pad, cap2, pm, pl, w->alpha);
            attn_dec_pv(DECODE_KIND, vh + j0 * dv, kb, R, dv, w->s, lds, w->alpha, po);
            if (check) {  /* the block's rows, while they are in the caches */
                bad |= attn_dec_nonfinite(DECODE_KIND, kh + j0 * d, kb * d) ? ATTN_NONFINITE_K : 0;
                bad |= attn_dec_nonfinite(DECODE_KIND, vh + j0 * dv, kb * dv) ? ATTN_NONFINITE_V : 0;
            }
            continue;
        }
#endif
        ST(decode_pack_k)(kh + j0 * d, vh + j0 * dv, kb, ke - j0, d, dv, w->kt, wide);
        ST(rows_qk)(w->kt, kb, R, d, w->a, w->s, lds, 0, 0, 0);
        for (int64_t r = 0; r < R; r++)
            ST(decode_softmax)(p, dr, r, w->s + r * lds, j0, kb, kb_pad, cap2, pm, pl, w->alpha);
        const T *vb = w->vp;  /* V's rows as T (in place where dv fills whole tiles), else packed */
        if (dv == dv_pad) {
            vb = ST(block_rows)(vh + j0 * dv, kb, dv, w->vp);
            ST(decode_pv)(vb, kb, R, dv, w->s, lds, w->alpha, po);
        } else {
            ST(pack_v)(vh + j0 * dv, kb, dv, w->vp);
            ST(rows_pv)(w->vp, kb, R, dv_pad, w->s, lds, w->alpha, po, 0, 0, 0);
        }
        if (check) {  /* the blocks, while they are in the caches (padding is zero) */
            bad |= ST(nonfinite)(w->kt, kb_pad * d) ? ATTN_NONFINITE_K : 0;
            bad |= ST(nonfinite)(vb, dv_pad * kb) ? ATTN_NONFINITE_V : 0;
        }
    }
#ifdef DECODE_KIND
    if (direct)
        attn_dec_finish(DECODE_KIND, po, R, dv);
#endif
    if (check) {  /* the chunk's keys no row read, up to the longest key length */
        int64_t a = c0, b = ks < ke ? ks : c1;
        for (int pass = 0; pass < 2; pass++) {
            int64_t hi = b < dr->klen ? b : dr->klen;
            if (hi > a) {
                bad |= ST(nonfinite_in)(kh + a * d, (hi - a) * d) ? ATTN_NONFINITE_K : 0;
                bad |= ST(nonfinite_in)(vh + a * dv, (hi - a) * dv) ? ATTN_NONFINITE_V : 0;
            }
            a = ks < ke ? ke : c1;
            b = c1;
        }
    }
    return bad;
}

/* The combine of row r of k/v row bkv from its nch chunks' partials (part: chunk ch's
 * O at part + ch * stride, rows of dv_pad, then m and l), in chunk order:
 * M = max m, L = sum l 2^(m - M), O = sum O 2^(m - M); out = O / L. A row that sees
 * no key (or, with a mask, whose every score is -inf) gets 0 and lse -inf. Returns 1
 * if the row's output is not finite. */
static int ST(decode_combine)(const attn_problem *p, const T *part, int64_t stride, int64_t nch, int64_t bkv,
                              int64_t r, int64_t R, TIN *out, TIN *lse, T *acc)
{
    const int64_t dv = p->dv, mo = R * ST(round_up)(dv, NR);
    T M = -INFINITY, L = 0;
    for (int64_t ch = 0; ch < nch; ch++) {
        T m = part[ch * stride + mo + r];
        M = m > M ? m : M;
    }
    for (int64_t c = 0; c < dv; c++)
        acc[c] = 0;
    for (int64_t ch = 0; M != -INFINITY && ch < nch; ch++) {
        const T *pc = part + ch * stride, *o = pc + r * ST(round_up)(dv, NR);
        T m = pc[mo + r];
        if (m == -INFINITY)
            continue;  /* the chunk holds no key of the row */
        T f = (T)exp2((double)(m - M));
        L += pc[mo + R + r] * f;
        for (int64_t c = 0; c < dv; c++)
            acc[c] += o[c] * f;
    }
    int64_t bh = bkv * p->kv_group + r / p->nq, i = r % p->nq;
    attn_span sp = attn_span_of(p, bh);
    if (L == 0 && (ST(row_empty)(&sp, i) || (p->mask && M == -INFINITY))) {
        L = 1;
        for (int64_t c = 0; c < dv; c++)
            acc[c] = 0;
    }
    TIN *o = out + (bkv * R + r) * dv;
    int bad = 0;
    for (int64_t c = 0; c < dv; c++) {
        T y = acc[c] / L;
        bad |= !(y * 0 == 0);
        o[c] = STORE_OUT(y);
    }
    if (lse)
        lse[bkv * R + r] = STORE_OUT(ST(lse_of)(M, L));
    return bad;
}

static int ST(flash_decode)(const attn_problem *p, const TIN *q, const TIN *k, const TIN *v, TIN *out, TIN *lse,
                            int64_t chunk)
{
    const int64_t R = p->kv_group * p->nq, dv_pad = ST(round_up)(p->dv, NR);
    const int64_t batch_kv = p->batch / p->kv_group, nch = (p->nk + chunk - 1) / chunk;
    /* each item's partial O starts aligned, as the register tiles' loads need */
    const int64_t stride = ST(round_up)(R * dv_pad + 2 * R, NR), nitems = batch_kv * nch;
    T *part = attn_alloc(nitems, stride, sizeof(T));
    if (!part)
        return ATTN_ENOMEM;
    int failed = 0;
#pragma omp parallel num_threads(p->num_threads)
    {
        ATTN_NOTE_TEAM();
        /* the direct products need only the scores of a block and at most one 16-key panel
         * of K pairs (w->kt: d x NR of T): no packed K or V blocks */
        const int64_t bk = ST(decode_block)(p), packs = ST(decode_direct)(p) ? 1 : bk;
        ST(workspace) w = {0};
        int ws_ok = ST(ws_alloc)(&w, R, packs, R, ST(round_up)(bk, NR), p->d, dv_pad);
        T *acc = attn_alloc(p->dv, 1, sizeof(T));
        ST(drows) *dr = attn_alloc(1, 1, sizeof(ST(drows)));
#ifdef ATTN_SAME_IO
        T *wide = NULL;
        int wide_ok = 1;
#else
        T *wide = attn_alloc(packs, p->d, sizeof(T));  /* a K block widened, for decode_pack_k */
        int wide_ok = wide != NULL;
#endif
        int ok = ws_ok && acc && dr && wide_ok;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        int bad = 0;
        int64_t rows_of = -1;  /* the k/v row dr describes */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < nitems; t++) {
            if (!ok)
                continue;
            int64_t bkv = t / nch, c0 = t % nch * chunk, c1 = c0 + chunk < p->nk ? c0 + chunk : p->nk;
            if (bkv != rows_of) {
                ST(decode_rows)(p, bkv, R, dr);
                rows_of = bkv;
            }
            T *pt = part + t * stride;
            bad |= ST(decode_item)(p, q, k, v, &w, wide, dr, bkv, c0, c1, R, pt, pt + R * dv_pad, pt + R * dv_pad + R);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < batch_kv * R; t++) {
            if (!ok)
                continue;
            int64_t bkv = t / R;
            if (ST(decode_combine)(p, part + bkv * nch * stride, stride, nch, bkv, t % R, R, out, lse, acc))
                bad |= ATTN_NONFINITE_OUT;
        }
        if (p->nonfinite)
            ST(report)(p, bad);
        if (ws_ok)  /* a failed ws_alloc freed its buffers itself */
            ST(ws_free)(&w);
        attn_free(acc);
        attn_free(dr);
        attn_free(wide);
    }
    attn_free(part);
    attn_split_chunks = failed ? 0 : (int)nch;
    return failed ? ATTN_ENOMEM : ATTN_OK;
}

int FN(flash)(const attn_problem *p, const TIN *q, const TIN *k, const TIN *v, TIN *out, TIN *lse)
{
    int64_t chunk = attn_decode_chunk(p);
    if (chunk)
        return ST(flash_decode)(p, q, k, v, out, lse, chunk);
    /* the workspace's q-block buffers hold whole panels; s holds one panel's probabilities */
    int err = ST(for_each_qblock)(p, q, k, v, out, lse, ST(round_up)(p->block_q, NR),
                                  ST(round_up)(p->block_k, MR), NR,
                                  attn_features_on(p) ? ST(flash_block_feat) : ST(flash_block_plain), 1);
    /* varlen: a sequence with a decode shape runs the decode path, after the others,
     * so that each sequence's arithmetic is that of a call of its own */
    int split = 0;
    for (int64_t s = 0; err == ATTN_OK && p->cu_seqlens_q && s < p->nseq; s++) {
        int64_t qo, ko;
        attn_problem sp = attn_varlen_sub(p, s, &qo, &ko);
        int64_t c = attn_decode_chunk(&sp);
        if (c) {
            err = ST(flash_decode)(&sp, q + qo * p->d, k + ko * p->d, v + ko * p->dv, out + qo * p->dv,
                                   lse ? lse + qo : NULL, c);
            split = attn_split_chunks;
        }
    }
    attn_split_chunks = split;
    return err;
}

#ifndef ATTN_HALF_IO
/* ------------------------------------------------------------- backward */
/* The gradient of flash attention from the forward's lse in FlashAttention-2's
 * order: five matmuls per (key block, query block) pair and no N x N buffer.
 * One task per (k/v row, key group): a key group is the key blocks jb with
 * jb % G == gamma (G from the problem's sizes only, never from the thread count;
 * strided so that causal groups get equal work). For each of its key blocks, for
 * each of the k/v row's query rows (kv_group of them, in order) and each query
 * block that sees the key block:
 *   S^T = K Q^T, P^T = e^(S^T - lse)             (1)
 *   dV += P^T dO                                 (2)
 *   dP^T = V dO^T, dS^T = P^T (dP^T - D)         (3)
 *   dK += dS^T Q                                 (4)
 *   dQ_gamma += dS K                             (5)
 * where D_i = dO_i . O_i; scores are the forward's own (exp_sub). dK and dV of a key block are
 * written by their task; dQ_gamma is the task's own partial dQ (G of them, each
 * row owned by one task; a row no key block of the group reaches is neither
 * written nor read), and a last pass sums the G partials in the order of gamma:
 * every element of dq, dk and dv is summed in an order fixed by the block sizes,
 * bit-identical for every thread count. Accuracy: S^T is the forward's own (its
 * rounding cancels against the lse's), each matmul sums at most ATTN_BWD_CHAIN
 * products in one FMA chain, and dK and dV add the chains to their running sums
 * with Kahan's compensation, so their rounding does not grow with N. dQ and dK
 * take the scale last. */

/* c[0:rows, 0:round_up(ncols, NR)) = a . (bf b)^T, stored as epi says (tile_qk; vec one
 * element per column of c, round_up(ncols, NR) of them, pp laid out as c): a is rows x
 * kdim (row stride lda), b is ncols x kdim (row stride kdim), packed into pack first
 * (times bf as it is packed, where bf is not 1: each element of b times bf, the bits of
 * scale_rows' copy); c has row stride ldc. */
static void ST(gemm_abt)(T *pack, const T *a, int64_t rows, int64_t lda, const T *b, T bf,
                         int64_t ncols, int64_t kdim, T *c, int64_t ldc, int epi, const T *vec, const T *pp)
{
    if (bf != 1)
        ST(pack_kt_by)(b, ncols, kdim, pack, 1, bf);
    else
        ST(pack_kt)(b, ncols, kdim, pack);
    for (int64_t jp = 0; jp < ncols; jp += NR)
        for (int64_t r0 = 0; r0 < rows; r0 += MR) {
            int mr = (int)(rows - r0 < MR ? rows - r0 : MR);
            const T *ar = a + r0 * lda, *bp = pack + jp * kdim, *vc = vec ? vec + jp : NULL;
            const T *pr = pp ? pp + r0 * ldc + jp : NULL;
            T *cr = c + r0 * ldc + jp;
            if (epi == ATTN_QK_EXP && mr == MR)
                ST(tile_qk)(MR, kdim, ar, lda, bp, cr, ldc, NULL, ATTN_QK_EXP, vc, pr);
            else if (epi == ATTN_QK_DS && mr == MR)
                ST(tile_qk)(MR, kdim, ar, lda, bp, cr, ldc, NULL, ATTN_QK_DS, vc, pr);
            else if (epi == ATTN_QK_STORE && mr == MR)
                ST(tile_qk)(MR, kdim, ar, lda, bp, cr, ldc, NULL, ATTN_QK_STORE, vc, pr);
            else
                ST(tile_qk)(mr, kdim, ar, lda, bp, cr, ldc, NULL, epi, vc, pr);
        }
}

/* How tile_ab adds its register tile x to o: ATTN_EPI_KAHAN, o += x with Kahan's
 * compensation in comp (laid out as o); ATTN_EPI_ROWS, o += x in the rows r whose
 * seen[r] is set, o = x in the others. Fused into the tile, so that no product
 * passes through a buffer of its own between the FMAs and the running sums. */
#ifndef ATTN_EPI_KAHAN
#define ATTN_EPI_KAHAN 0
#define ATTN_EPI_ROWS 1
#endif

/* o[r][0:NR) (+)= sum_t a[r * ars + t * ats] * b[t][0:NR) for r < mr, added as epi
 * says: one register tile of A B, A read with row stride ars and column stride ats
 * (A or A^T of a stored matrix), b a packed panel (kdim rows of NR contiguous columns).
 * With half, only the first VW columns (the panel's valid ones: head sizes up to VW, or
 * a last panel of that many): half the FMAs, the same sums for those columns. */
static ATTN_INLINE void ST(tile_ab)(int mr, int64_t kdim, const T *a, int64_t ars, int64_t ats,
                                    const T *b, T *o, int64_t ldo, T *comp, const uint8_t *seen, int epi, int half)
{
    VT acc[MR][2];
    for (int r = 0; r < MR; r++)
        acc[r][0] = acc[r][1] = V(zero)();
#pragma GCC unroll 4
    for (int64_t t = 0; t < kdim; t++) {
        VT b0 = V(load)(b + t * NR), b1 = half ? b0 : V(load)(b + t * NR + VW);
        for (int r = 0; r < MR; r++) {
            if (r < mr) {
                VT ar = V(set1)(a[r * ars + t * ats]);
                acc[r][0] = V(fma)(ar, b0, acc[r][0]);
                if (!half)
                    acc[r][1] = V(fma)(ar, b1, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < MR; r++) {
        if (r >= mr)
            continue;
        for (int h = 0; h < (half ? 1 : 2); h++) {
            T *op = o + r * ldo + h * VW;
            if (epi == ATTN_EPI_KAHAN) {  /* s += x: y = x - c, t = s + y, c = (t - s) - y, s = t */
                T *cp = comp + r * ldo + h * VW;
                VT sv = V(load)(op), y = V(sub)(acc[r][h], V(load)(cp));
                VT t = V(add)(sv, y);
                V(store)(cp, V(sub)(V(sub)(t, sv), y));
                V(store)(op, t);
            } else {
                V(storeu)(op, seen[r] ? V(add)(V(loadu)(op), acc[r][h]) : acc[r][h]);
            }
        }
    }
}

/* The last panel of gemm_ab where it holds at most VW valid columns (from column c0):
 * MR x VW tiles, half the FMAs. Kept out of gemm_ab's loop so that the full tiles compile
 * as before. */
static __attribute__((noinline)) void ST(gemm_ab_half)(const T *a, int64_t ars, int64_t ats, int64_t rows,
                                                       const T *pack, int64_t kpanel, int64_t kdim, int64_t c0,
                                                       T *o, int64_t ldo, T *comp, const uint8_t *seen, int epi)
{
    for (int64_t r0 = 0; r0 < rows; r0 += MR) {
        int mr = (int)(rows - r0 < MR ? rows - r0 : MR);
        const T *ar = a + r0 * ars, *bp = pack + c0 * kpanel;
        T *op = o + r0 * ldo + c0, *cp = comp ? comp + r0 * ldo + c0 : NULL;
        const uint8_t *sr = seen ? seen + r0 : NULL;
        if (mr == MR && epi == ATTN_EPI_KAHAN)
            ST(tile_ab)(MR, kdim, ar, ars, ats, bp, op, ldo, cp, sr, ATTN_EPI_KAHAN, 1);
        else if (mr == MR)
            ST(tile_ab)(MR, kdim, ar, ars, ats, bp, op, ldo, cp, sr, ATTN_EPI_ROWS, 1);
        else
            ST(tile_ab)(mr, kdim, ar, ars, ats, bp, op, ldo, cp, sr, epi, 1);
    }
}

/* o[0:rows, 0:round_up(ncols, NR)) (+)= A . b, added as epi says (tile_ab), with
 * A[r][t] = a[r * ars + t * ats] (rows x kdim) and b kdim rows of panels packed by
 * pack_v (kpanel rows a panel, ncols columns); o (and comp) have row stride ldo,
 * seen one flag per row of o. Panel by panel, all the row tiles of one panel together:
 * its kdim rows stay in L1 for all of them. A last panel of at most VW valid columns goes
 * through gemm_ab_half, which leaves its columns from VW on unwritten: its callers (dV, dK
 * and dQ of the backward) read only the first ncols. */
static void ST(gemm_ab)(const T *a, int64_t ars, int64_t ats, int64_t rows, const T *pack, int64_t kpanel,
                        int64_t kdim, int64_t ncols, T *o, int64_t ldo, T *comp, const uint8_t *seen, int epi)
{
    const int64_t tail = ncols % NR, full = tail && tail <= VW ? ncols - tail : ncols;
    for (int64_t c0 = 0; c0 < full; c0 += NR) {
        for (int64_t r0 = 0; r0 < rows; r0 += MR) {
            int mr = (int)(rows - r0 < MR ? rows - r0 : MR);
            const T *ar = a + r0 * ars, *bp = pack + c0 * kpanel;
            T *op = o + r0 * ldo + c0, *cp = comp ? comp + r0 * ldo + c0 : NULL;
            const uint8_t *sr = seen ? seen + r0 : NULL;
            if (mr == MR && epi == ATTN_EPI_KAHAN)
                ST(tile_ab)(MR, kdim, ar, ars, ats, bp, op, ldo, cp, sr, ATTN_EPI_KAHAN, 0);
            else if (mr == MR)
                ST(tile_ab)(MR, kdim, ar, ars, ats, bp, op, ldo, cp, sr, ATTN_EPI_ROWS, 0);
            else
                ST(tile_ab)(mr, kdim, ar, ars, ats, bp, op, ldo, cp, sr, epi, 0);
        }
    }
    if (full < ncols)
        ST(gemm_ab_half)(a, ars, ats, rows, pack, kpanel, kdim, full, o, ldo, comp, seen, epi);
}

/* dK and dV sum their products over at most ATTN_BWD_CHAIN queries in one FMA chain,
 * then add the chain to their running sums with Kahan's compensation; dQ sums at most
 * ATTN_BWD_CHAIN keys in one chain before adding it to its partial. */
#define ATTN_BWD_CHAIN 64
/* The bfloat16 products' chains (ATTN_BWD_DOT): 256 terms, whose float32 rounding
 * (256 u at worst, 1.5e-5) stays far below the bfloat16 rounding of P and dS and of
 * the gradients (2^-9); the epilogues' adds come once a block pair. */
#define ATTN_BWD_CHAIN_DOT 256

/* x[0:n) = e^(x ln 2 - m[0:n)) for scores x in the forward's log2 domain (n a multiple
 * of VW): vexp_sub on each vector. */
static void ST(exp_sub)(T *x, const T *m, int64_t n)
{
    for (int64_t j = 0; j < n; j += VW)
        V(store)(x + j, ST(vexp_sub)(V(load)(x + j), V(loadu)(m + j)));
}

/* x[0:n) *= g[0:n) (n a multiple of VW): dS times the softcap's derivative. */
static void ST(mul_row)(T *x, const T *g, int64_t n)
{
    for (int64_t j = 0; j < n; j += VW)
        V(store)(x + j, V(mul)(V(load)(x + j), V(load)(g + j)));
}

/* ds[0:n) = p * (dp - dvec) with D per column. */
static void ST(ds_cols)(const T *p, T *dp, const T *dvec, int64_t n)
{
    for (int64_t j = 0; j < n; j += VW)
        V(store)(dp + j, V(mul)(V(load)(p + j), V(sub)(V(load)(dp + j), V(loadu)(dvec + j))));
}

typedef struct {
    T *pack;     /* packed panels of the query block's operand of each matmul */
    T *packk;    /* the key block's K packed as pack_v panels, for dQ */
    T *s, *dp;   /* P^T and dP^T, then dS^T: keys x ldc (queries) */
    T *acc1, *acc2, *c1, *c2; /* dV and dK of the key block and their Kahan compensations */
    T *m, *dd;   /* per query column: lse and D, padded */
    T *g;        /* with a softcap: its derivative 1 - tanh^2 at each score */
    T *z;        /* with dropout: Z, then P * Z */
#ifdef ATTN_BWD_DOT
    /* the bfloat16 products (attn_bf16dot.h): the key block's K and V rows as pairs, its K as
     * V panels (for dQ); the query block's Qt or dOt panels, its dO or Q as V panels; P^T or
     * dS^T rounded, as rows of pairs; dS rounded, pairs along the keys stored by query */
    uint32_t *ka, *va, *kp, *qt, *bp, *ap, *dsp;
#endif
} ST(bwd_ws);

static void ST(bwd_free)(ST(bwd_ws) *w)
{
    attn_free(w->pack); attn_free(w->packk); attn_free(w->s); attn_free(w->dp);
    attn_free(w->acc1); attn_free(w->acc2); attn_free(w->c1); attn_free(w->c2);
    attn_free(w->m); attn_free(w->dd); attn_free(w->g); attn_free(w->z);
#ifdef ATTN_BWD_DOT
    attn_free(w->ka); attn_free(w->va); attn_free(w->kp); attn_free(w->qt); attn_free(w->bp);
    attn_free(w->ap); attn_free(w->dsp);
#endif
}

static int ST(bwd_alloc)(ST(bwd_ws) *w, int64_t rows, int64_t cols, int64_t d, int64_t dv, int softcap,
                         int dropout, int dot)
{
    int64_t ldc = ST(round_up)(cols, NR), dmax = d > dv ? d : dv;
    int64_t wide = ST(round_up)(dmax, NR), tall = ST(round_up)(rows > cols ? rows : cols, NR);
    w->pack = attn_alloc(wide, tall, sizeof(T));
    w->packk = attn_alloc(wide, rows, sizeof(T));
    w->s = attn_alloc(rows, ldc, sizeof(T));
    w->dp = attn_alloc(rows, ldc, sizeof(T));
    w->acc1 = attn_alloc(rows, wide, sizeof(T));
    w->acc2 = attn_alloc(rows, wide, sizeof(T));
    w->c1 = attn_alloc(rows, wide, sizeof(T));
    w->c2 = attn_alloc(rows, wide, sizeof(T));
    w->m = attn_alloc(tall, 1, sizeof(T));
    w->dd = attn_alloc(tall, 1, sizeof(T));
    w->g = softcap ? attn_alloc(rows, ldc, sizeof(T)) : NULL;
    w->z = dropout ? attn_alloc(rows, ldc, sizeof(T)) : NULL;
    if (!(w->pack && w->packk && w->s && w->dp && w->acc1 && w->acc2 && w->c1 && w->c2 &&
          w->m && w->dd && (w->g || !softcap) && (w->z || !dropout))) {
        ST(bwd_free)(w);
        return 0;
    }
#ifdef ATTN_BWD_DOT
    if (dot) {
        int64_t d2 = (dmax + 1) / 2, r2 = (rows + 1) / 2, c2 = (cols + 1) / 2;
        w->ka = attn_alloc(rows, d2, sizeof(uint32_t));
        w->va = attn_alloc(rows, d2, sizeof(uint32_t));
        w->kp = attn_alloc(r2, wide, sizeof(uint32_t));
        w->qt = attn_alloc(d2, ldc, sizeof(uint32_t));
        w->bp = attn_alloc(c2, wide, sizeof(uint32_t));
        w->ap = attn_alloc(rows, ldc / 2, sizeof(uint32_t));
        w->dsp = attn_alloc(r2, ldc, sizeof(uint32_t));
        if (!(w->ka && w->va && w->kp && w->qt && w->bp && w->ap && w->dsp)) {
            ST(bwd_free)(w);
            return 0;
        }
    }
#else
    (void)dot;
#endif
    return 1;
}

/* dS^T = P^T (dP^T - D) in place of dP^T, times the softcap's derivative with one. */
static void ST(bwd_ds)(ST(bwd_ws) *w, int64_t kbh, int64_t qb_vw, int64_t ldc, T cap2)
{
    for (int64_t j = 0; j < kbh; j++) {
        ST(ds_cols)(w->s + j * ldc, w->dp + j * ldc, w->dd, qb_vw);
        if (cap2 != 0)
            ST(mul_row)(w->dp + j * ldc, w->g + j * ldc, qb_vw);
    }
}

#ifdef ATTN_BWD_DOT
/* Products (2) to (5) of a block pair on bfloat16 pairs (attn_bf16dot.h): dV += P^T dO
 * with P^T (pz) rounded to bfloat16, dS^T, dK += dS^T Q and dQ += dS K with dS rounded;
 * the chains, Kahan sums and partial rows of the float32 products (dq: the query block's
 * first partial row, seen its flags; doq, qq: the block's dO and Q rows). */
static void ST(bwd_dot_rest)(const attn_problem *p, ST(bwd_ws) *w, const T *pz, const T *doq, const T *qq,
                             T *dq, uint8_t *seen, int64_t kbh, int64_t qb, int64_t qb_vw, T cap2)
{
    const int64_t d = p->d, dv = p->dv, ldc = ST(round_up)(p->block_q, NR), qb2 = (qb + 1) / 2;
    const int64_t dp_pad = ST(round_up)(dv, NR), d_pad = ST(round_up)(d, NR);
    dot_round_rows(pz, ldc, kbh, ldc, w->ap, ldc / 2);                                   /* (2) dV */
    dot_pack_v(doq, qb, dv, w->bp);
    for (int64_t c0 = 0; c0 < qb; c0 += ATTN_BWD_CHAIN_DOT) {
        int64_t nc = qb - c0 < ATTN_BWD_CHAIN_DOT ? qb - c0 : ATTN_BWD_CHAIN_DOT;
        dot_gemm(w->ap + c0 / 2, ldc / 2, 1, kbh, w->bp + c0 / 2 * DOT_NR, qb2, (nc + 1) / 2, dv, w->acc1,
                 dp_pad, w->c1, NULL, 1.0f, DOT_EPI_KAHAN);
    }
    ST(bwd_ds)(w, kbh, qb_vw, ldc, cap2);
    dot_round_rows(w->dp, ldc, kbh, ldc, w->ap, ldc / 2);                               /* (4) dK */
    dot_pack_v(qq, qb, d, w->bp);
    for (int64_t c0 = 0; c0 < qb; c0 += ATTN_BWD_CHAIN_DOT) {
        int64_t nc = qb - c0 < ATTN_BWD_CHAIN_DOT ? qb - c0 : ATTN_BWD_CHAIN_DOT;
        dot_gemm(w->ap + c0 / 2, ldc / 2, 1, kbh, w->bp + c0 / 2 * DOT_NR, qb2, (nc + 1) / 2, d, w->acc2,
                 d_pad, w->c2, NULL, 1.0f, DOT_EPI_KAHAN);
    }
    dot_round_cols(w->dp, ldc, kbh, ldc, w->dsp, ldc);                                  /* (5) dQ */
    for (int64_t t0 = 0; t0 < kbh; t0 += ATTN_BWD_CHAIN_DOT) {
        int64_t nt = kbh - t0 < ATTN_BWD_CHAIN_DOT ? kbh - t0 : ATTN_BWD_CHAIN_DOT;
        dot_gemm(w->dsp + t0 / 2 * ldc, 1, ldc, qb, w->kp + t0 / 2 * DOT_NR, (kbh + 1) / 2, (nt + 1) / 2, d, dq,
                 d_pad, NULL, seen, 1.0f, DOT_EPI_ROWS);
        memset(seen, 1, (size_t)qb);
    }
}
#endif

/* dK and dV of keys [j0, j0 + kb) of k/v row bkv, summed over its query rows
 * bkv * kv_group + g in the order of g, and their dS K added to the partial dQ
 * pdq (rows of d_pad, laid out as q's rows): a row whose seen flag is 0 is written
 * (and flagged), so partials need no zeroing and untouched rows no summing. */
static void ST(bwd_kv_block)(const attn_problem *p, const T *q, const T *k, const T *v,
                             const T *dout, const T *lse, const T *dvec, T *dk, T *dv_out, T *pdq,
                             uint8_t *seen, ST(bwd_ws) *w, int64_t bkv, int64_t j0, int64_t kb, int dot)
{
    const int64_t d = p->d, dv = p->dv, nq = p->nq, nk = p->nk, bq = p->block_q;
    const int64_t ldc = ST(round_up)(bq, NR), dp_pad = ST(round_up)(dv, NR), d_pad = ST(round_up)(d, NR);
    const T cap2 = (T)(p->softcap * ATTN_LOG2E);
    const T *kr = k + (bkv * nk + j0) * d, *vr = v + (bkv * nk + j0) * dv;
    /* P^T straight from S^T's register tiles (gemm_abt's epilogue), where nothing changes
     * the scores between the product and the exponential */
    const int exp_fused = !dot && cap2 == 0 && !p->mask && !p->alibi;
    for (int64_t i = 0; i < kb * dp_pad; i++)
        w->acc1[i] = w->c1[i] = 0;
    for (int64_t i = 0; i < kb * d_pad; i++)
        w->acc2[i] = w->c2[i] = 0;
    int packed = 0;
    for (int64_t g = 0; g < p->kv_group; g++) {
        const int64_t bh = bkv * p->kv_group + g;
        const T *qh = q + bh * nq * d, *doh = dout + bh * nq * dv;
        const attn_span sp = attn_span_of(p, bh);
        const int64_t mbase = p->mask ? attn_mask_base(p, bh) : 0;
        /* the keys of the block within the row's length, and the queries that see
         * one of them (key j is seen by the queries j - hi <= i <= j - lo); query
         * blocks start at multiples of bq (causal: those before the first that can
         * see key j0 are skipped) */
        const int64_t kbh = attn_clamp(sp.len - j0, kb);
        const int64_t istart = attn_clamp(j0 - sp.hi, nq), iend = attn_clamp(j0 + kbh - sp.lo, nq);
        if (kbh && istart < iend && packed != kbh) {  /* K for dQ, once per key block and length */
#ifdef ATTN_BWD_DOT
            if (dot) {  /* and K, V as rows of pairs, for S^T and dP^T */
                dot_pack_v(kr, kbh, d, w->kp);
                dot_pairs_rows(kr, d, kbh, d, w->ka, (d + 1) / 2);
                dot_pairs_rows(vr, dv, kbh, dv, w->va, (dv + 1) / 2);
            } else
#endif
                ST(pack_v)(kr, kbh, d, w->packk);
            packed = kbh;
        }
        /* no query sees the block (istart == iend: e.g. keys past the last query under a
         * top-left causal mask): nothing to do, and K was not packed for it above, so a
         * query block here would multiply its zero dS by the workspace's stale K (NaN
         * where the thread's workspace is fresh) */
        for (int64_t i0 = kbh && istart < iend ? istart / bq * bq : nq; i0 < iend; i0 += bq) {
            int64_t qb = iend - i0 < bq ? iend - i0 : bq, qb_vw = ST(round_up)(qb, VW);
            for (int64_t i = 0; i < ldc; i++) {  /* padding columns: P = 0, D = 0 */
                w->m[i] = i < qb ? lse[bh * nq + i0 + i] : (T)INFINITY;
                w->dd[i] = i < qb ? dvec[bh * nq + i0 + i] : 0;
            }
            /* (1) S^T = K (c Q)^T: the forward's scores bit for bit (its Q scaled by c, its
             * register tiles' order), so that the lse's rounding of them cancels in P */
#ifdef ATTN_BWD_DOT
            if (dot) {  /* on pairs, the factor applied to the float32 sums (as the bfloat16 forward does) */
                dot_pack_kt(qh + i0 * d, qb, d, w->qt);
                dot_gemm(w->ka, (d + 1) / 2, 1, kbh, w->qt, (d + 1) / 2, (d + 1) / 2, qb, w->s, ldc, NULL, NULL,
                         ST(score_factor)(p), DOT_EPI_SCALE);
            } else
#endif
            {
                ST(gemm_abt)(w->pack, kr, kbh, d, qh + i0 * d, ST(score_factor)(p), qb, d, w->s, ldc,
                             exp_fused ? ATTN_QK_EXP : ATTN_QK_STORE, w->m, NULL);
            }
            for (int64_t j = 0; j < kbh; j++) {
                T *pj = w->s + j * ldc;
                if (cap2 != 0)
                    ST(softcap_row)(pj, w->g + j * ldc, qb_vw, cap2);
                if (p->mask) {
                    int64_t off = mbase + (j0 + j) * p->mask_stride[3] + i0 * p->mask_stride[2];
                    for (int64_t i = 0; i < qb; i++)
                        pj[i] += (T)attn_mask_log2(p, off + i * p->mask_stride[2]);
                }
                if (p->alibi) {
                    const T a2 = (T)(p->alibi[bh] * ATTN_LOG2E);
                    for (int64_t i = 0; i < qb; i++)
                        pj[i] -= a2 * (T)llabs(i0 + i + sp.len - nq - (j0 + j));
                }
                if (!exp_fused)
                    ST(exp_sub)(pj, w->m, qb_vw);
                /* query i0 + i sees key j0 + j only if j0 + j - hi <= i0 + i <= j0 + j - lo */
                int64_t first = attn_clamp(j0 + j - sp.hi - i0, qb), past = attn_clamp(j0 + j - sp.lo + 1 - i0, qb);
                for (int64_t i = 0; i < first; i++)
                    pj[i] = 0;
                for (int64_t i = past; i < qb; i++)
                    pj[i] = 0;
            }
            T *pz = w->s;  /* P^T, or with dropout P^T * Z^T */
            if (w->z) {
                for (int64_t i = 0; i < kbh * ldc; i++)
                    w->z[i] = 1;
                ST(dropout_cols)(p, bh, i0, qb, j0, kbh, w->z, ldc);
            }
#ifdef ATTN_BWD_DOT
            if (dot) {                                                                    /* (3) dP^T */
                dot_pack_kt(doh + i0 * dv, qb, dv, w->qt);
                dot_gemm(w->va, (dv + 1) / 2, 1, kbh, w->qt, (dv + 1) / 2, (dv + 1) / 2, qb, w->dp, ldc, NULL,
                         NULL, 1.0f, DOT_EPI_SCALE);
            } else
#endif
                ST(gemm_abt)(w->pack, vr, kbh, dv, doh + i0 * dv, 1, qb, dv, w->dp, ldc, /* (3) dP^T, or dS^T */
                             w->z ? ATTN_QK_STORE : ATTN_QK_DS, w->dd, w->s);
            if (w->z) {  /* dP * Z, and P * Z for dV */
                for (int64_t i = 0; i < kbh * ldc; i++) {
                    w->dp[i] *= w->z[i];
                    w->z[i] *= w->s[i];
                }
                pz = w->z;
            }
#ifdef ATTN_BWD_DOT
            if (dot) {
                ST(bwd_dot_rest)(p, w, pz, doh + i0 * dv, qh + i0 * d, pdq + (bh * nq + i0) * d_pad,
                                 seen + bh * nq + i0, kbh, qb, qb_vw, cap2);
                continue;
            }
#endif
            ST(pack_v)(doh + i0 * dv, qb, dv, w->pack);
            for (int64_t c0 = 0; c0 < qb; c0 += ATTN_BWD_CHAIN) {                         /* (2) dV */
                int64_t nc = qb - c0 < ATTN_BWD_CHAIN ? qb - c0 : ATTN_BWD_CHAIN;
                ST(gemm_ab)(pz + c0, ldc, 1, kbh, w->pack + c0 * NR, qb, nc, dv, w->acc1, dp_pad, w->c1, NULL,
                            ATTN_EPI_KAHAN);
            }
            if (w->z)
                ST(bwd_ds)(w, kbh, qb_vw, ldc, cap2);
            else if (cap2 != 0)  /* dS^T from (3), times the softcap's derivative */
                for (int64_t j = 0; j < kbh; j++)
                    ST(mul_row)(w->dp + j * ldc, w->g + j * ldc, qb_vw);
            ST(pack_v)(qh + i0 * d, qb, d, w->pack);
            for (int64_t c0 = 0; c0 < qb; c0 += ATTN_BWD_CHAIN) {                         /* (4) dK */
                int64_t nc = qb - c0 < ATTN_BWD_CHAIN ? qb - c0 : ATTN_BWD_CHAIN;
                ST(gemm_ab)(w->dp + c0, ldc, 1, kbh, w->pack + c0 * NR, qb, nc, d, w->acc2, d_pad, w->c2, NULL,
                            ATTN_EPI_KAHAN);
            }
            for (int64_t t0 = 0; t0 < kbh; t0 += ATTN_BWD_CHAIN) {                        /* (5) dQ */
                int64_t nt = kbh - t0 < ATTN_BWD_CHAIN ? kbh - t0 : ATTN_BWD_CHAIN;
                uint8_t *sr = seen + bh * nq + i0;  /* a row's first chain stores, the later ones add */
                ST(gemm_ab)(w->dp + t0 * ldc, 1, ldc, qb, w->packk + t0 * NR, kbh, nt, d,
                            pdq + (bh * nq + i0) * d_pad, d_pad, NULL, sr, ATTN_EPI_ROWS);
                memset(sr, 1, (size_t)qb);
            }
        }
    }
    const T scale = (T)p->scale;
    for (int64_t j = 0; j < kb; j++) {
        for (int64_t c = 0; c < dv; c++)
            dv_out[(bkv * nk + j0 + j) * dv + c] = w->acc1[j * dp_pad + c];
        for (int64_t c = 0; c < d; c++)
            dk[(bkv * nk + j0 + j) * d + c] = w->acc2[j * d_pad + c] * scale;
    }
}

/* The number of key groups of a (sequence of a) problem: enough (k/v row, group)
 * tasks to balance threads (ATTN_BWD_TASKS), at most one per key block, and partial
 * dQ buffers within ATTN_BWD_PARTIAL_BYTES. A function of the sequence's sizes
 * only, so that a varlen batch sums each sequence as a call of its own would. */
#define ATTN_BWD_TASKS 32
#define ATTN_BWD_PARTIAL_BYTES ((int64_t)1 << 28)
static int64_t ST(bwd_groups)(const attn_problem *p, int64_t nq, int64_t nk)
{
    const int64_t batch_kv = p->batch / p->kv_group, nkb = (nk + p->block_k - 1) / p->block_k;
    const int64_t bytes = p->batch * nq * ST(round_up)(p->d, NR) * (int64_t)sizeof(T);
    int64_t g = (ATTN_BWD_TASKS + batch_kv - 1) / batch_kv;
    if (g > nkb)
        g = nkb;
    if (bytes > 0 && g > ATTN_BWD_PARTIAL_BYTES / bytes)
        g = ATTN_BWD_PARTIAL_BYTES / bytes;
    return g < 1 ? 1 : g;
}

static int ST(flash_backward_run)(const attn_problem *p, const T *q, const T *k, const T *v, const T *out,
                                  const T *dout, const T *lse, T *dq, T *dk, T *dv, int dot)
{
    const int64_t d = p->d, dvn = p->dv, rows = p->batch * p->nq;
    const int64_t batch_kv = p->batch / p->kv_group, d_pad = ST(round_up)(d, NR);
    const int features = attn_features_on(p);
    /* per sequence s (one without varlen): its groups G[s], its tasks from items[s]
     * (batch_kv * G[s]), its first row rstart[s] (of q, dq) and the first row poff[s]
     * of its partials (G[s] blocks of its rows) */
    const int64_t nseq = p->cu_seqlens_q ? p->nseq : 1;
    int64_t *G = attn_alloc(nseq + 1, 4, sizeof(int64_t));
    int64_t *items = G ? G + nseq : NULL, *rstart = G ? G + 2 * nseq + 1 : NULL, *poff = G ? G + 3 * nseq + 2 : NULL;
    if (G) {
        items[0] = rstart[0] = poff[0] = 0;
        for (int64_t s = 0; s < nseq; s++) {
            int64_t nq_s = p->cu_seqlens_q ? p->cu_seqlens_q[s + 1] - p->cu_seqlens_q[s] : p->nq;
            int64_t nk_s = p->cu_seqlens_q ? p->cu_seqlens_k[s + 1] - p->cu_seqlens_k[s] : p->nk;
            G[s] = ST(bwd_groups)(p, nq_s, nk_s);
            items[s + 1] = items[s] + batch_kv * G[s];
            rstart[s + 1] = rstart[s] + p->batch * nq_s;
            poff[s + 1] = poff[s] + G[s] * p->batch * nq_s;
        }
    }
    const int64_t prow = G ? poff[nseq] : 0;
    T *lse_rows = attn_alloc(rows, 1, sizeof(T)), *dvec = attn_alloc(rows, 1, sizeof(T));
    T *pdq = attn_alloc(prow > 0 ? prow : 1, d_pad, sizeof(T));
    uint8_t *seen = attn_alloc(prow > 0 ? prow : 1, 1, 1);  /* per partial row: written yet */
    int failed = !(G && lse_rows && dvec && pdq && seen);
    if (!failed) {
        /* D_i = dO_i . O_i, each row's sum in the order of c, VW rows at a time: where the
         * includer names TRANSPOSE_T, the products of VW rows and VW columns transposed,
         * so that one vector add takes the next term of all VW sums (one lane a row), not
         * one add's latency a term; the rest, term by term */
#pragma omp parallel for schedule(static) num_threads(p->num_threads)
        for (int64_t i0 = 0; i0 < rows; i0 += VW) {
            const int64_t nr = rows - i0 < VW ? rows - i0 : VW;
            int64_t c0 = 0;
            T sums[VW];
            VT acc = V(zero)();
#ifdef TRANSPOSE_T
            T prod[VW * VW], cols[VW * VW];
            for (; nr == VW && c0 + VW <= dvn; c0 += VW) {
                for (int64_t r = 0; r < VW; r++)
                    V(storeu)(prod + r * VW, V(mul)(V(loadu)(dout + (i0 + r) * dvn + c0),
                                                    V(loadu)(out + (i0 + r) * dvn + c0)));
                TRANSPOSE_T(prod, VW, cols, VW);
                for (int64_t c = 0; c < VW; c++)
                    acc = V(add)(acc, V(loadu)(cols + c * VW));
            }
#endif
            V(storeu)(sums, acc);
            for (int64_t r = 0; r < nr; r++) {
                const int64_t i = i0 + r;
                T sum = sums[r];
                for (int64_t c = c0; c < dvn; c++)
                    sum += dout[i * dvn + c] * out[i * dvn + c];
                dvec[i] = sum;
                lse_rows[i] = lse[i];
                /* a row that saw no key (lse -inf): P = e^(s - inf) = 0, zero gradients */
                if (features && lse_rows[i] == -INFINITY)
                    lse_rows[i] = INFINITY;
            }
        }
    }
    if (!failed) {
#pragma omp parallel num_threads(p->num_threads)
        {
            ATTN_NOTE_TEAM();
            ST(bwd_ws) w = {0};
            int ok = ST(bwd_alloc)(&w, p->block_k, p->block_q, d, dvn, p->softcap > 0, p->dropout_p != 0, dot);
            if (!ok) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < items[nseq]; t++) {
                if (!ok)
                    continue;
                /* task t: key group gamma of k/v row bkv of sequence s (with varlen a
                 * problem of its own at its offsets) */
                const int64_t s = attn_varlen_seq(items, nseq, t), u = t - items[s];
                const int64_t gamma = u % G[s], bkv = u / G[s], srows = rstart[s + 1] - rstart[s];
                attn_problem sp = *p;
                int64_t qo = 0, ko = 0;
                if (p->cu_seqlens_q)
                    sp = attn_varlen_sub(p, s, &qo, &ko);
                T *part = pdq + (poff[s] + gamma * srows) * d_pad;
                uint8_t *pseen = seen + poff[s] + gamma * srows;
                memset(pseen + bkv * p->kv_group * sp.nq, 0, (size_t)(p->kv_group * sp.nq));  /* the task's rows */
                for (int64_t j0 = gamma * p->block_k; j0 < sp.nk; j0 += G[s] * p->block_k) {
                    int64_t kb = sp.nk - j0 < p->block_k ? sp.nk - j0 : p->block_k;
                    ST(bwd_kv_block)(&sp, q + qo * d, k + ko * d, v + ko * dvn, dout + qo * dvn, lse_rows + qo,
                                     dvec + qo, dk + ko * d, dv + ko * dvn, part, pseen, &w, bkv, j0, kb, dot);
                }
            }
            if (ok)
                ST(bwd_free)(&w);
        }
    }
    if (!failed) {  /* dq = scale * the partials' sum, in the order of gamma */
        const T scale = (T)p->scale;
#pragma omp parallel for schedule(static) num_threads(p->num_threads)
        for (int64_t i = 0; i < rows; i++) {
            const int64_t s = attn_varlen_seq(rstart, nseq, i), srows = rstart[s + 1] - rstart[s];
            const int64_t r0 = poff[s] + i - rstart[s];  /* row i in the sequence's first partial */
            int64_t first = 0;  /* the first partial that holds row i */
            while (first < G[s] && !seen[r0 + first * srows])
                first++;
            /* whole rows at a time (vector adds along c), each element's sum in the order of gamma */
            T *row = dq + i * d;
            if (first == G[s]) {
                for (int64_t c = 0; c < d; c++)
                    row[c] = (T)0 * scale;
                continue;
            }
            const T *src = pdq + (r0 + first * srows) * d_pad;
            for (int64_t c = 0; c < d; c++)
                row[c] = src[c];
            for (int64_t gm = first + 1; gm < G[s]; gm++)
                if (seen[r0 + gm * srows]) {
                    src = pdq + (r0 + gm * srows) * d_pad;
                    for (int64_t c = 0; c < d; c++)
                        row[c] += src[c];
                }
            for (int64_t c = 0; c < d; c++)
                row[c] *= scale;
        }
    }
    attn_free(G);
    attn_free(lse_rows);
    attn_free(dvec);
    attn_free(pdq);
    attn_free(seen);
    return failed ? ATTN_ENOMEM : ATTN_OK;
}

int FN(flash_backward)(const attn_problem *p, const T *q, const T *k, const T *v, const T *out,
                       const T *dout, const T *lse, T *dq, T *dk, T *dv)
{
    return ST(flash_backward_run)(p, q, k, v, out, dout, lse, dq, dk, dv, 0);
}

#ifdef ATTN_BWD_DOT
/* The same backward for float32 arrays that hold bfloat16 values (q, k, v and dout
 * widened from bfloat16): its five products on bfloat16 pairs (attn_bf16dot.h). */
int FN(flash_backward_dot)(const attn_problem *p, const T *q, const T *k, const T *v, const T *out,
                           const T *dout, const T *lse, T *dq, T *dk, T *dv)
{
    return ST(flash_backward_run)(p, q, k, v, out, dout, lse, dq, dk, dv, 1);
}
#endif

/* ------------------------------------------------------------ ceilings */
/* The ISA's peak FMA throughput: on each of num_threads threads, 12 independent
 * vector accumulators (enough to cover the FMA latency on every port), iters FMAs
 * each, operands in registers. Returns the sum, so the loop is not optimised
 * away; the caller times the call and counts 2 * VW * 12 * iters flops a thread. */
double FN(fma_peak)(int64_t iters, int num_threads)
{
    double total = 0;
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        ATTN_NOTE_TEAM();
        VT b = V(set1)((T)0.999999), c = V(set1)((T)1e-7);
        VT a0 = V(set1)((T)1), a1 = V(set1)((T)2), a2 = V(set1)((T)3), a3 = V(set1)((T)4);
        VT a4 = V(set1)((T)5), a5 = V(set1)((T)6), a6 = V(set1)((T)7), a7 = V(set1)((T)8);
        VT a8 = V(set1)((T)9), a9 = V(set1)((T)10), a10 = V(set1)((T)11), a11 = V(set1)((T)12);
        for (int64_t i = 0; i < iters; i++) {
            a0 = V(fma)(a0, b, c); a1 = V(fma)(a1, b, c); a2 = V(fma)(a2, b, c);
            a3 = V(fma)(a3, b, c); a4 = V(fma)(a4, b, c); a5 = V(fma)(a5, b, c);
            a6 = V(fma)(a6, b, c); a7 = V(fma)(a7, b, c); a8 = V(fma)(a8, b, c);
            a9 = V(fma)(a9, b, c); a10 = V(fma)(a10, b, c); a11 = V(fma)(a11, b, c);
        }
        VT s = V(add)(V(add)(V(add)(a0, a1), V(add)(a2, a3)), V(add)(V(add)(a4, a5), V(add)(a6, a7)));
        s = V(add)(s, V(add)(V(add)(a8, a9), V(add)(a10, a11)));
        total += (double)V(hsum)(s);
    }
    return total;
}

#endif /* ATTN_HALF_IO */

#undef NR
#undef ST
#undef FN
#undef FN__
#undef FN_
#undef V
#undef V__
#undef V_
#undef EXP2_COEF
#undef EXP2_DEGREE
#undef EXP2_LO
#undef T
#undef DT
#undef VT
#undef VW
#undef TIN
#undef LOAD_IN
#undef STORE_OUT
#undef ADT
#undef ATTN_HALF_IO
#undef TRANSPOSE_T
#undef TRANSPOSE_T_SCALED
#undef TRANSPOSE_IN
#undef VEXP2_T
#undef ATTN_SAME_IO
#undef ATTN_BWD_DOT
#undef DECODE_KIND
