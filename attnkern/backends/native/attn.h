/* Public C interface of attnkern's native attention kernels.
 *
 * Arrays are C-contiguous: q (batch, nq, d), k (batch, nk, d), v (batch, nk, dv),
 * out (batch, nq, dv), where batch folds all leading dimensions (B * H).
 * The Python layer validates arguments; the C entry points re-check them and
 * return an error code rather than trusting their caller.
 */
#ifndef ATTNKERN_ATTN_H
#define ATTNKERN_ATTN_H

#include <stdint.h>

enum attn_algo { ATTN_NAIVE = 0, ATTN_TILED = 1, ATTN_FLASH = 2 };
/* ATTN_ISA_AVX512BF16: AVX-512 plus AVX512_BF16 dot products (bfloat16 flash); float32
 * and float64 run the AVX-512 code there. ATTN_ISA_AMX: those plus AMX-TILE and AMX-BF16
 * (bfloat16 flash on tiles), where the OS grants the tile data state. */
enum attn_isa { ATTN_ISA_GENERIC = 0, ATTN_ISA_AVX2 = 1, ATTN_ISA_AVX512 = 2, ATTN_ISA_AVX512BF16 = 3,
                ATTN_ISA_AMX = 4, ATTN_ISA_COUNT = 5 };
/* Half-precision storage of attn_forward_half's arrays (uint16_t bits). */
enum attn_half { ATTN_BF16 = 0, ATTN_F16 = 1 };
/* ATTN_ETOOBIG: an array or score-row size overflows 64-bit index arithmetic. */
/* ATTN_EFEATURE: the problem uses a feature (kv_group > 1, a window, bottom-right
 * alignment, key lengths, a softcap, a mask, dropout) that the algorithm does not have: only flash
 * (forward and backward) does; naive and tiled refuse them. */
enum attn_status { ATTN_OK = 0, ATTN_ENOMEM = 1, ATTN_EINVAL = 2, ATTN_EISA = 3, ATTN_ETOOBIG = 4,
                   ATTN_EFEATURE = 5 };
/* Where the diagonal of causal and window masks lies: query i's own key is i
 * (top-left, the causal of a square problem) or i + nk - nq (bottom-right: the last
 * query sees the last key, as in FlashAttention and a decoder's KV cache). */
enum attn_align { ATTN_ALIGN_TOP_LEFT = 0, ATTN_ALIGN_BOTTOM_RIGHT = 1 };
/* window_left / window_right: no bound on that side. */
#define ATTN_UNBOUNDED (-1)

/* Tunable limits, shared with the Python layer through the Cython module. */
#define ATTN_MAX_BLOCK_Q 1024
#define ATTN_MAX_BLOCK_K 4096
#define ATTN_MAX_THREADS 256

typedef struct {
    int64_t batch, nq, nk, d, dv;
    int causal;        /* query i sees no key right of its diagonal (window_right 0) */
    double scale;      /* multiplies q . k before the softmax */
    int block_q, block_k, num_threads;
    /* Not NULL: a forward ORs into it the attn_nonfinite bits of each of q, k, v that
     * holds NaN or infinity, and of an output that is not finite (scores overflowing).
     * The flash kernels check the arrays as they read and write them; the dispatch
     * scans them for the others (and then runs no kernel on non-finite inputs). */
    int *nonfinite;

    /* Features (flash only; a plain problem has kv_group 1, align top-left, both
     * window sides unbounded, seqlen_k NULL, softcap 0). attn_check_problem checks them all.
     *
     * Grouped-query attention (GQA; MQA when kv_group = batch / B): k and v have
     * batch / kv_group rows, and query row b reads k/v row b / kv_group. With
     * batch = B * H folded and H = H_kv * kv_group, row b = b_ * H + h reads
     * b_ * H_kv + h / kv_group, its head's k/v head. The backward's dk and dv have
     * batch / kv_group rows, each the sum over its group's query rows, added in
     * the rows' order by one thread. kv_group >= 1 must divide batch. */
    int64_t kv_group;
    /* Causal alignment and sliding window, one mask: with diag = i + off, where off
     * is 0 (ATTN_ALIGN_TOP_LEFT) or len - nq (ATTN_ALIGN_BOTTOM_RIGHT; len is the
     * row's key length, below), query i sees key j iff
     *     diag - window_left <= j <= diag + window_right   (and j < len).
     * Each side is ATTN_UNBOUNDED (-1) or >= 0; causal is window_right 0 (with
     * causal, window_right must be 0 or ATTN_UNBOUNDED). Key blocks outside every
     * query's window are skipped: a window of W keys costs O(nq * (W + blocks)). */
    int align;
    int64_t window_left, window_right;
    /* Key padding: NULL, or batch / heads lengths in [0, nk]: query row b sees only
     * keys j < seqlen_k[b / heads] (heads = H: one length per sequence of H
     * query heads; 1: one per row). Keys at or past a length are never read. A row
     * that sees no key (a length of 0, a window that misses every key, bottom-right
     * with nq > len) gets out = 0 and lse = -inf, and zero gradients. heads >= 1
     * must divide batch; it is read only with seqlen_k. */
    const int64_t *seqlen_k;
    int64_t heads;
    /* Logit softcap: 0 (none), or a positive cap c: each score s = scale q . k
     * becomes c * tanh(s / c) before the mask and the softmax (as in Gemma 2); the
     * backward multiplies dS by its derivative 1 - tanh^2(s / c). */
    double softcap;
    /* Attention mask: NULL, or elements of kind mask_kind (enum attn_mask_kind) read
     * at mask_stride (element strides of the (B, H, nq, nk) view the caller's mask
     * broadcasts to: 0 along a broadcast dimension; >= 0) for folded row
     * b = b_ * mask_heads + h: (b_, h, i, j) is mask[b_ * s0 + h * s1 + i * s2 + j * s3].
     * A bool (uint8) mask's 0 hides the key; a float mask is added to the (capped)
     * score, -inf hiding the key. mask_heads >= 1 must divide batch. The kernels read
     * it where a tile of scores is made; it is never materialised. */
    const void *mask;
    int mask_kind;
    int64_t mask_heads;
    int64_t mask_stride[4];
    /* Dropout: probability dropout_p in [0, 1) (0: none). Query i of folded row b and
     * key j are kept iff word (j + j0) % 4 of Philox4x32-10 with counter
     * ((j + j0) / 4, i + i0, b, 0) and key (seed mod 2^32, seed / 2^32) is >=
     * round(dropout_p * 2^32), i0 and j0 being dropout_i0 and dropout_j0 (offsets of a
     * block of a packed varlen batch); kept probabilities are scaled by 1 / (1 - p).
     * The lse is that of the undropped softmax; the backward regenerates the mask. */
    double dropout_p;
    uint64_t dropout_seed;
    int64_t dropout_i0, dropout_j0;
    /* Packed variable-length sequences (FlashAttention's varlen): NULL, or nseq + 1
     * offsets each of queries (cu_seqlens_q, from 0, non-decreasing, ending at nq) and
     * keys (cu_seqlens_k, ending at nk): sequence s has the queries [cu_q[s], cu_q[s+1])
     * and keys [cu_k[s], cu_k[s+1]], laid out sequence after sequence, each sequence a
     * C-contiguous (heads, len, d) block: q's block of sequence s starts at element
     * cu_q[s] * batch * d (batch = H, the query heads), k's and v's at cu_k[s] *
     * (batch / kv_group) * d (and dv), out's and lse's likewise. Each sequence is
     * the problem (batch, len_q, len_k) with the others' features (causal alignment
     * per sequence; dropout counters offset by cu_q[s] and cu_k[s]: packed indices);
     * the kernels schedule (sequence, head, block) work items in one parallel region,
     * so no block spans two sequences and no work is spent on padding. No mask or
     * key lengths with it. */
    const int64_t *cu_seqlens_q, *cu_seqlens_k;
    int64_t nseq;
    /* ALiBi (FlashAttention's): NULL, or one slope per folded query row b (of batch);
     * -alibi[b] * |i + len - nq - j| is added to the (capped) score of query i and key j,
     * len the row's key length (nk without key lengths). With varlen, sequence s reads
     * alibi + s * alibi_seq_stride (0: the same slopes for every sequence). */
    const double *alibi;
    int64_t alibi_seq_stride;
} attn_problem;

enum attn_mask_kind { ATTN_MASK_BOOL = 0, ATTN_MASK_F32 = 1, ATTN_MASK_F64 = 2 };

enum attn_nonfinite { ATTN_NONFINITE_Q = 1, ATTN_NONFINITE_K = 2, ATTN_NONFINITE_V = 4, ATTN_NONFINITE_OUT = 8 };

/* Per-ISA entry points (generated from attn_kernels.h): forward(p, q, k, v, out, lse)
 * and backward(p, q, k, v, out, dout, lse, dq, dk, dv). */
typedef int (*attn_fn_f32)(const attn_problem *, const float *, const float *, const float *, float *,
                           float *);
typedef int (*attn_fn_f64)(const attn_problem *, const double *, const double *, const double *,
                           double *, double *);
typedef int (*attn_bwd_f32)(const attn_problem *, const float *, const float *, const float *,
                            const float *, const float *, const float *, float *, float *, float *);
typedef int (*attn_bwd_f64)(const attn_problem *, const double *, const double *, const double *,
                            const double *, const double *, const double *, double *, double *,
                            double *);

int attn_isa_compiled(int isa);
int attn_isa_supported(int isa);  /* compiled in and the CPU has it */
/* Why attn_isa_supported(isa) is 0, in words ("" when it is 1). */
const char *attn_isa_reason(int isa);
int attn_best_isa(void);
const char *attn_isa_name(int isa);
int attn_max_threads(void);
/* This process and fork(): ATTN_FORK_NONE (not a forked child), ATTN_FORK_FRESH_POOL
 * (a forked child whose parent released its OpenMP pool before the fork: the kernels
 * run with the requested threads), ATTN_FORK_ONE_THREAD (a forked child whose parent's
 * OpenMP runtime could not release its pool: the kernels run on the calling thread). */
enum attn_fork { ATTN_FORK_NONE = 0, ATTN_FORK_FRESH_POOL = 1, ATTN_FORK_ONE_THREAD = 2 };
int attn_fork_state(void);
/* The number of threads the last kernel (forward, backward or ceiling loop) called from
 * this thread ran on, as its parallel regions' teams reported it; 0 before the first. */
int attn_last_team(void);
/* The number of key chunks the last forward called from this thread split each k/v row's
 * keys into on flash's decode path (attn_decode_chunk in attn_common.h); 0: it did not
 * take that path. */
int attn_last_split(void);

/* The argument checks of attn_forward_*, alone: ATTN_OK or the error code. */
int attn_check_problem(int algo, int isa, const attn_problem *p);
/* What attn_check_problem objects to, in words ("" when it returns ATTN_OK). */
const char *attn_problem_error(int algo, int isa, const attn_problem *p);
/* 1 if p uses a feature beyond the plain problem (see attn_problem). */
int attn_has_features(const attn_problem *p);

/* out = softmax(q k^T * scale) v; lse (batch, nq), when not NULL, gets each query
 * row's natural-log log-sum-exp of its scaled, masked scores. */
int attn_forward_f32(int algo, int isa, const attn_problem *p,
                     const float *q, const float *k, const float *v, float *out, float *lse);
int attn_forward_f64(int algo, int isa, const attn_problem *p,
                     const double *q, const double *k, const double *v, double *out, double *lse);

/* The same for bfloat16 or float16 arrays (kind: enum attn_half), tiled and flash only
 * (naive is ATTN_EINVAL): float32 products, softmax and accumulators, out and lse
 * rounded to the input's dtype. ISA avx512bf16 runs bfloat16 flash on vdpbf16ps dot
 * products, ISA amx on AMX tiles; every other (ISA, kind) pair widens blocks to float32 as they are packed
 * (float16 through F16C on the AVX2 and AVX-512 units, which then need it). */
int attn_forward_half(int algo, int isa, int kind, const attn_problem *p, const uint16_t *q,
                      const uint16_t *k, const uint16_t *v, uint16_t *out, uint16_t *lse);
/* The conversions an ISA's unit uses, for the tests: out[i] = in[i] rounded to kind,
 * back[i] = out[i] widened to float32. ATTN_EISA or ATTN_EINVAL on bad arguments. */
int attn_convert_half(int isa, int kind, const float *in, int64_t n, uint16_t *out, float *back);

/* dq, dk, dv: the gradients of sum(out * dout) for the forward's q, k, v, out and
 * lse (flash attention's recomputation: no N x N buffer; every algorithm computes
 * the same function, so one backward serves). Bit-identical for every thread count. */
int attn_backward_f32(int isa, const attn_problem *p, const float *q, const float *k,
                      const float *v, const float *out, const float *dout, const float *lse,
                      float *dq, float *dk, float *dv);
int attn_backward_f64(int isa, const attn_problem *p, const double *q, const double *k,
                      const double *v, const double *out, const double *dout, const double *lse,
                      double *dq, double *dk, double *dv);
/* The same for bfloat16 or float16 arrays (kind: enum attn_half), with the caller's
 * lse widened to float32 (or NULL: out is q, k, v's own output). The backward first
 * computes the rows' lse in float32 from q and k (one more Q K^T) and uses it for each
 * row where the caller's lies within half an ulp of kind of it (the same lse, rounded
 * to kind, as a half forward returns it), else the caller's (that of longer rows, of
 * which k, v hold a block). Every array is widened to float32 once, the float32
 * backward of the ISA runs (float32 accumulators; float32 products, but bfloat16 on
 * avx512bf16: vdpbf16ps products with P and dS rounded to bfloat16, and the rows' lse
 * from the bfloat16 forward's kernel on plain problems), dq, dk and dv are rounded to kind. */
int attn_backward_half(int isa, int kind, const attn_problem *p, const uint16_t *q, const uint16_t *k,
                       const uint16_t *v, const uint16_t *out, const uint16_t *dout, const float *lse,
                       uint16_t *dq, uint16_t *dk, uint16_t *dv);

/* Machine ceilings for the roofline (attnkern roofline). attn_fma_peak: iters
 * register-only FMAs on 12 float32 vectors of the ISA, on each of num_threads
 * threads; returns the vector width in floats (0: ISA not supported) and writes
 * a checksum. attn_stream: op 0 copies b to a, op 1 is STREAM's triad
 * a = b + 3 c, over n floats, on num_threads threads. */
int attn_fma_peak(int isa, int64_t iters, int num_threads, double *checksum);
void attn_stream(int op, float *a, const float *b, const float *c, int64_t n, int num_threads);

#endif
