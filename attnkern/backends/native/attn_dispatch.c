/* Run-time choice of instruction set, argument checks, and the tables that
 * map (algorithm, ISA) to a kernel. */
#define _GNU_SOURCE /* syscall() under -std=c11: the AMX tile-data permission request */
#include "attn_common.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#endif

/* fork() and the OpenMP thread pool. GNU OpenMP keeps a pool of worker threads per
 * thread that opened a parallel region; fork() copies the pool's bookkeeping but not
 * its threads, so in a child the caller's next parallel region with more than one
 * thread would wait forever for workers that do not exist. Before every fork the
 * prepare handler therefore waits until no kernel runs in this process (kernels hold
 * a count while they run; new ones wait while a fork is under way) and releases the
 * forking thread's pool with omp_pause_resource_all(omp_pause_hard): its workers are
 * joined, and the parent and the child each start a fresh pool at their next parallel
 * region, with the requested thread count. Pools of other threads are idle then; in
 * the child those threads do not exist and their pools are never used again.
 *
 * Where the runtime cannot release its pool (built without omp_pause_resource_all, or
 * the call fails), a child runs the kernels on its calling thread alone, as the only
 * safe choice; results do not depend on the thread count, only the speed does, and
 * attn_fork_state() says so. */
static pthread_mutex_t fork_mutex = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t fork_cond = PTHREAD_COND_INITIALIZER;
static int kernels_running = 0, fork_pending = 0, pool_released = 0;
static volatile int fork_state = ATTN_FORK_NONE;

static void kernels_enter(void)
{
    pthread_mutex_lock(&fork_mutex);
    while (fork_pending)
        pthread_cond_wait(&fork_cond, &fork_mutex);
    kernels_running++;
    pthread_mutex_unlock(&fork_mutex);
}

static void kernels_leave(void)
{
    pthread_mutex_lock(&fork_mutex);
    if (--kernels_running == 0 && fork_pending)
        pthread_cond_broadcast(&fork_cond);
    pthread_mutex_unlock(&fork_mutex);
}

static void before_fork(void)
{
    pthread_mutex_lock(&fork_mutex);
    fork_pending = 1;
    while (kernels_running)
        pthread_cond_wait(&fork_cond, &fork_mutex);
    pthread_mutex_unlock(&fork_mutex);
#ifdef ATTN_HAVE_OMP_PAUSE
    pool_released = omp_pause_resource_all(omp_pause_hard) == 0;
#else
    pool_released = 0;
#endif
}

static void after_fork_in_parent(void)
{
    pthread_mutex_lock(&fork_mutex);
    fork_pending = 0;
    pthread_cond_broadcast(&fork_cond);
    pthread_mutex_unlock(&fork_mutex);
}

/* The child is single-threaded: the lock and condition start afresh (a waiter of the
 * parent's does not exist here). A child of a child keeps the one-thread rule. */
static void after_fork_in_child(void)
{
    pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t c = PTHREAD_COND_INITIALIZER;
    fork_mutex = m;
    fork_cond = c;
    kernels_running = 0;
    fork_pending = 0;
    if (pool_released && fork_state != ATTN_FORK_ONE_THREAD)
        fork_state = ATTN_FORK_FRESH_POOL;
    else
        fork_state = ATTN_FORK_ONE_THREAD;
}

__attribute__((constructor)) static void register_fork_handler(void)
{
    pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);
}

int attn_fork_state(void) { return fork_state; }

/* The team size of the last kernel this thread ran (attn_common.h). */
_Thread_local int attn_team_size = 0;

int attn_last_team(void) { return attn_team_size; }
_Thread_local int attn_split_chunks = 0;
int attn_last_split(void) { return attn_split_chunks; }

#define ATTN_TABLE(isa, dt)                                                        \
    { attn_naive_##dt##_##isa, attn_tiled_##dt##_##isa, attn_flash_##dt##_##isa }

static const attn_fn_f32 table_f32[ATTN_ISA_COUNT][3] = {
    ATTN_TABLE(generic, f32),
#ifdef ATTN_HAVE_AVX2
    ATTN_TABLE(avx2, f32),
#else
    {0, 0, 0},
#endif
#ifdef ATTN_HAVE_AVX512
    ATTN_TABLE(avx512, f32),
#else
    {0, 0, 0},
#endif
#ifdef ATTN_HAVE_AVX512BF16
    ATTN_TABLE(avx512bf16, f32),
#else
    {0, 0, 0},
#endif
#ifdef ATTN_HAVE_AMX
    ATTN_TABLE(amx, f32),
#else
    {0, 0, 0},
#endif
};

/* Half precision, [isa][kind][algo]: tiled and flash (no naive). */
typedef int (*attn_fn_half)(const attn_problem *, const uint16_t *, const uint16_t *, const uint16_t *,
                            uint16_t *, uint16_t *);
#define ATTN_HALF_TABLE(isa)                                                          \
    {{0, attn_tiled_bf16_##isa, attn_flash_bf16_##isa}, {0, attn_tiled_f16_##isa, attn_flash_f16_##isa}}
static const attn_fn_half table_half[ATTN_ISA_COUNT][2][3] = {
    ATTN_HALF_TABLE(generic),
#ifdef ATTN_HAVE_AVX2
    ATTN_HALF_TABLE(avx2),
#else
    {{0}},
#endif
#ifdef ATTN_HAVE_AVX512
    ATTN_HALF_TABLE(avx512),
#else
    {{0}},
#endif
#ifdef ATTN_HAVE_AVX512BF16
    /* bfloat16 flash on vdpbf16ps; tiled and float16 widen to float32 */
    {{0, attn_tiled_bf16_avx512bf16, attn_flash_bf16dot_avx512bf16},
     {0, attn_tiled_f16_avx512bf16, attn_flash_f16_avx512bf16}},
#else
    {{0}},
#endif
#ifdef ATTN_HAVE_AMX
    /* bfloat16 flash on AMX tiles; tiled and float16 widen to float32 */
    {{0, attn_tiled_bf16_amx, attn_flash_bf16amx_amx}, {0, attn_tiled_f16_amx, attn_flash_f16_amx}},
#else
    {{0}},
#endif
};

/* The converting bfloat16 flash of the units whose table entry is a kernel of their own. */
static const attn_fn_half converting_flash_bf16[ATTN_ISA_COUNT] = {
#ifdef ATTN_HAVE_AVX512BF16
    [ATTN_ISA_AVX512BF16] = attn_flash_bf16_avx512bf16,
#endif
#ifdef ATTN_HAVE_AMX
    [ATTN_ISA_AMX] = attn_flash_bf16_amx,
#endif
};

typedef void (*attn_cvt_fn)(int, const float *, int64_t, uint16_t *, float *);
static const attn_cvt_fn convert_half[ATTN_ISA_COUNT] = {
    attn_convert_generic,
#ifdef ATTN_HAVE_AVX2
    attn_convert_avx2,
#else
    0,
#endif
#ifdef ATTN_HAVE_AVX512
    attn_convert_avx512,
#else
    0,
#endif
#ifdef ATTN_HAVE_AVX512BF16
    attn_convert_avx512bf16,
#else
    0,
#endif
#ifdef ATTN_HAVE_AMX
    attn_convert_amx,
#else
    0,
#endif
};

#ifdef ATTN_HAVE_AVX2
#define ATTN_BWD_AVX2(dt) attn_flash_backward_##dt##_avx2
#else
#define ATTN_BWD_AVX2(dt) 0
#endif
#ifdef ATTN_HAVE_AVX512
#define ATTN_BWD_AVX512(dt) attn_flash_backward_##dt##_avx512
#else
#define ATTN_BWD_AVX512(dt) 0
#endif
#ifdef ATTN_HAVE_AVX512BF16
#define ATTN_BWD_AVX512BF16(dt) attn_flash_backward_##dt##_avx512bf16
#else
#define ATTN_BWD_AVX512BF16(dt) 0
#endif
#ifdef ATTN_HAVE_AMX
#define ATTN_BWD_AMX(dt) attn_flash_backward_##dt##_amx
#else
#define ATTN_BWD_AMX(dt) 0
#endif
static const attn_bwd_f32 backward_f32[ATTN_ISA_COUNT] = {
    attn_flash_backward_f32_generic, ATTN_BWD_AVX2(f32), ATTN_BWD_AVX512(f32), ATTN_BWD_AVX512BF16(f32),
    ATTN_BWD_AMX(f32)};
static const attn_bwd_f64 backward_f64[ATTN_ISA_COUNT] = {
    attn_flash_backward_f64_generic, ATTN_BWD_AVX2(f64), ATTN_BWD_AVX512(f64), ATTN_BWD_AVX512BF16(f64),
    ATTN_BWD_AMX(f64)};
/* The float32 backward with bfloat16 products (vdpbf16ps), for bfloat16 inputs, on the
 * avx512bf16 unit. The amx unit has no backward of its own on tiles yet: its bfloat16
 * backward keeps float32 products (vdpbf16ps there is unmeasured against them; on
 * an AMX CPU, ATTNKERN_ISA=avx512bf16 selects these products). */
static const attn_bwd_f32 backward_dot_bf16[ATTN_ISA_COUNT] = {
#ifdef ATTN_HAVE_AVX512BF16
    [ATTN_ISA_AVX512BF16] = attn_flash_backward_dot_f32_avx512bf16,
#endif
};

static const attn_fn_f64 table_f64[ATTN_ISA_COUNT][3] = {
    ATTN_TABLE(generic, f64),
#ifdef ATTN_HAVE_AVX2
    ATTN_TABLE(avx2, f64),
#else
    {0, 0, 0},
#endif
#ifdef ATTN_HAVE_AVX512
    ATTN_TABLE(avx512, f64),
#else
    {0, 0, 0},
#endif
#ifdef ATTN_HAVE_AVX512BF16
    ATTN_TABLE(avx512bf16, f64),
#else
    {0, 0, 0},
#endif
#ifdef ATTN_HAVE_AMX
    ATTN_TABLE(amx, f64),
#else
    {0, 0, 0},
#endif
};

const char *attn_isa_name(int isa)
{
    static const char *names[ATTN_ISA_COUNT] = {"generic", "avx2", "avx512", "avx512bf16", "amx"};
    return isa >= 0 && isa < ATTN_ISA_COUNT ? names[isa] : "unknown";
}

int attn_isa_compiled(int isa)
{
    return isa >= 0 && isa < ATTN_ISA_COUNT && table_f32[isa][0] != 0;
}

/* AMX needs, besides the CPU's AMX-TILE and AMX-BF16 (CPUID leaf 7: EDX bits 24
 * and 22), the OS to enable the tile state (XCR0 bits 17 and 18, read with XGETBV
 * where CPUID reports OSXSAVE) and, on Linux, a per-process permission for the
 * tile data (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), requested once;
 * without it the first tile instruction kills the process. amx_state() is 0 when
 * all hold, else why not in amx_why. */
#define ATTN_ARCH_REQ_XCOMP_PERM 0x1023
#define ATTN_XFEATURE_XTILEDATA 18
static int amx_status = -1;
static char amx_why[200];
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

static void amx_probe(void)
{
#if defined(__x86_64__)
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 24 & 1) || !(d >> 22 & 1)) {
        snprintf(amx_why, sizeof amx_why, "this CPU has no AMX-TILE/AMX-BF16 (CPUID leaf 7 EDX bits 24 and 22)");
        amx_status = 1;
        return;
    }
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c >> 27 & 1)) {
        snprintf(amx_why, sizeof amx_why, "the OS has not enabled XSAVE (CPUID OSXSAVE), so no AMX tile state");
        amx_status = 2;
        return;
    }
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) {
        snprintf(amx_why, sizeof amx_why, "the OS does not enable the AMX tile state (XCR0 bits 17 and 18)");
        amx_status = 3;
        return;
    }
#if defined(__linux__)
    if (syscall(SYS_arch_prctl, ATTN_ARCH_REQ_XCOMP_PERM, ATTN_XFEATURE_XTILEDATA) != 0) {
        snprintf(amx_why, sizeof amx_why,
                 "Linux refused the AMX tile data permission (arch_prctl ARCH_REQ_XCOMP_PERM: %s)", strerror(errno));
        amx_status = 4;
        return;
    }
#endif
    amx_status = 0;
#else
    snprintf(amx_why, sizeof amx_why, "AMX is x86-64 only");
    amx_status = 1;
#endif
}

static int amx_state(void)
{
    pthread_once(&amx_once, amx_probe);
    return amx_status;
}

/* The CPU features each vector unit is built with (F16C is checked per call). */
static int isa_cpu_ok(int isa)
{
    switch (isa) {
    case ATTN_ISA_GENERIC:
        return 1;
#if defined(__x86_64__) || defined(__i386__)
    case ATTN_ISA_AVX2:
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case ATTN_ISA_AVX512:
        return __builtin_cpu_supports("avx512f");
    case ATTN_ISA_AVX512BF16:
    case ATTN_ISA_AMX:
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16") &&
               __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    default:
        return 0;
    }
}

int attn_isa_supported(int isa)
{
    if (!attn_isa_compiled(isa) || !isa_cpu_ok(isa))
        return 0;
    return isa != ATTN_ISA_AMX || amx_state() == 0;
}

const char *attn_isa_reason(int isa)
{
    static const char *needs[ATTN_ISA_COUNT] = {
        "", "this CPU lacks AVX2 or FMA", "this CPU lacks AVX-512F",
        "this CPU lacks AVX-512 F/BW/VL with AVX512_BF16",
        "this CPU lacks AVX-512 F/BW/VL with AVX512_BF16, which the AMX unit also uses"};
    if (isa < 0 || isa >= ATTN_ISA_COUNT)
        return "no such instruction set";
    if (!attn_isa_compiled(isa))
        return isa == ATTN_ISA_AMX ? "not compiled in: the compiler did not accept -mamx-tile -mamx-bf16"
                                   : "not compiled in: the compiler did not accept its flags";
    if (!isa_cpu_ok(isa))
        return needs[isa];
    if (isa == ATTN_ISA_AMX && amx_state() != 0)
        return amx_why;
    return "";
}

int attn_best_isa(void)
{
    for (int isa = ATTN_ISA_COUNT - 1; isa > 0; isa--)
        if (attn_isa_supported(isa))
            return isa;
    return ATTN_ISA_GENERIC;
}

int attn_max_threads(void)
{
#ifdef _OPENMP
    return omp_get_num_procs();
#else
    return 1;
#endif
}

int attn_has_features(const attn_problem *p) { return attn_features_on(p); }

/* The checks of attn_check_problem, in order; *why says what the first failing one
 * objects to. The features are checked here, once a call, so the kernels can trust
 * them (the key lengths are read from the caller's array, O(batch)). */
static int check_problem(int algo, int isa, const attn_problem *p, const char **why)
{
#define ATTN_FAIL(code, text) \
    do {                      \
        *why = (text);        \
        return (code);        \
    } while (0)
    if (algo < ATTN_NAIVE || algo > ATTN_FLASH)
        ATTN_FAIL(ATTN_EINVAL, "the algorithm is not naive, tiled or flash");
    if (!attn_isa_supported(isa))
        ATTN_FAIL(ATTN_EISA, attn_isa_reason(isa));
    if (p->batch < 0 || p->nq < 0 || p->nk < 1 || p->d < 1 || p->dv < 0)
        ATTN_FAIL(ATTN_EINVAL, "batch, nq and dv must be >= 0, nk and d >= 1");
    if (p->block_q < 1 || p->block_q > ATTN_MAX_BLOCK_Q || p->block_k < 1 ||
        p->block_k > ATTN_MAX_BLOCK_K || p->num_threads < 1 || p->num_threads > ATTN_MAX_THREADS)
        ATTN_FAIL(ATTN_EINVAL, "block_q, block_k or num_threads is out of its range");
    if (!isfinite(p->scale))
        ATTN_FAIL(ATTN_EINVAL, "scale must be finite");
    /* Element offsets such as b * nq * d are int64 products in the kernels:
     * every array's element count (and a padded row) must fit int64. */
    int64_t n, width, nk_pad;
    if (__builtin_add_overflow(p->d > p->dv ? p->d : p->dv, 64, &width) ||
        __builtin_add_overflow(p->nk, 64, &nk_pad) ||
        __builtin_mul_overflow(p->batch, p->nq, &n) || __builtin_mul_overflow(n, width, &n) ||
        __builtin_mul_overflow(p->batch, p->nk, &n) || __builtin_mul_overflow(n, width, &n) ||
        __builtin_mul_overflow(p->nq, nk_pad, &n) || n > INT64_MAX / 8)
        ATTN_FAIL(ATTN_ETOOBIG, "the arrays are too large for 64-bit index arithmetic");
    if (p->kv_group < 1 || p->batch % p->kv_group != 0)
        ATTN_FAIL(ATTN_EINVAL, "kv_group must be >= 1 and divide batch (k and v have batch / kv_group rows)");
    if (p->align != ATTN_ALIGN_TOP_LEFT && p->align != ATTN_ALIGN_BOTTOM_RIGHT)
        ATTN_FAIL(ATTN_EINVAL, "align must be top-left (0) or bottom-right (1)");
    if (p->window_left < ATTN_UNBOUNDED || p->window_right < ATTN_UNBOUNDED)
        ATTN_FAIL(ATTN_EINVAL, "window_left and window_right must be -1 (unbounded) or >= 0");
    if (p->causal && p->window_right != 0 && p->window_right != ATTN_UNBOUNDED)
        ATTN_FAIL(ATTN_EINVAL, "causal means window_right 0: pass window_right 0 or -1 (unbounded) with it");
    if (p->seqlen_k) {
        if (p->heads < 1 || p->batch % p->heads != 0)
            ATTN_FAIL(ATTN_EINVAL, "heads must be >= 1 and divide batch (seqlen_k has batch / heads lengths)");
        for (int64_t i = 0; i < p->batch / p->heads; i++)
            if (p->seqlen_k[i] < 0 || p->seqlen_k[i] > p->nk)
                ATTN_FAIL(ATTN_EINVAL, "every length of seqlen_k must lie in [0, nk]");
    }
    if (!(p->softcap >= 0) || !isfinite(p->softcap))
        ATTN_FAIL(ATTN_EINVAL, "softcap must be 0 (none) or a positive finite number");
    if (p->softcap > 0 && !isfinite(p->scale / p->softcap))
        ATTN_FAIL(ATTN_EINVAL, "scale / softcap overflows: softcap is too small for scale");
    if (p->mask) {
        if (p->mask_kind != ATTN_MASK_BOOL && p->mask_kind != ATTN_MASK_F32 && p->mask_kind != ATTN_MASK_F64)
            ATTN_FAIL(ATTN_EINVAL, "mask_kind must be bool (0), float32 (1) or float64 (2)");
        if (p->mask_heads < 1 || p->batch % p->mask_heads != 0)
            ATTN_FAIL(ATTN_EINVAL, "mask_heads must be >= 1 and divide batch");
        for (int s = 0; s < 4; s++)
            if (p->mask_stride[s] < 0 || p->mask_stride[s] > INT64_MAX / 4 / (p->batch + p->nq + p->nk + 1))
                ATTN_FAIL(ATTN_EINVAL, "mask strides must be >= 0 (0 along a broadcast dimension) and bounded");
    }
    if (p->cu_seqlens_q || p->cu_seqlens_k) {
        if (!p->cu_seqlens_q || !p->cu_seqlens_k || p->nseq < 0)
            ATTN_FAIL(ATTN_EINVAL, "varlen needs both cu_seqlens_q and cu_seqlens_k, and nseq >= 0");
        if (p->mask || p->seqlen_k)
            ATTN_FAIL(ATTN_EINVAL, "varlen takes no mask and no key lengths");
        if (p->cu_seqlens_q[0] != 0 || p->cu_seqlens_k[0] != 0 || p->cu_seqlens_q[p->nseq] != p->nq ||
            p->cu_seqlens_k[p->nseq] != p->nk)
            ATTN_FAIL(ATTN_EINVAL, "cu_seqlens must start at 0 and end at nq (queries) and nk (keys)");
        for (int64_t s = 0; s < p->nseq; s++)
            if (p->cu_seqlens_q[s + 1] < p->cu_seqlens_q[s] || p->cu_seqlens_k[s + 1] < p->cu_seqlens_k[s])
                ATTN_FAIL(ATTN_EINVAL, "cu_seqlens must be non-decreasing");
    }
    if (p->alibi) {
        if (p->alibi_seq_stride < 0 || (p->alibi_seq_stride && !p->cu_seqlens_q))
            ATTN_FAIL(ATTN_EINVAL, "alibi_seq_stride must be >= 0, and 0 without varlen");
        for (int64_t b = 0; b < p->batch * (p->alibi_seq_stride && p->nseq ? p->nseq : 1); b++)
            if (!isfinite(p->alibi[b]))
                ATTN_FAIL(ATTN_EINVAL, "ALiBi slopes must be finite");
    }
    if (!(p->dropout_p >= 0 && p->dropout_p < 1))
        ATTN_FAIL(ATTN_EINVAL, "dropout_p must lie in [0, 1)");
    if (p->dropout_i0 < 0 || p->dropout_j0 < 0)
        ATTN_FAIL(ATTN_EINVAL, "dropout_i0 and dropout_j0 must be >= 0");
    if (algo != ATTN_FLASH && attn_has_features(p))
        ATTN_FAIL(ATTN_EFEATURE, "only flash has kv groups, windows, bottom-right alignment, key lengths, softcap, "
                                 "masks, dropout, varlen and ALiBi");
    *why = "";
    return ATTN_OK;
#undef ATTN_FAIL
}

int attn_check_problem(int algo, int isa, const attn_problem *p)
{
    const char *why;
    return check_problem(algo, isa, p, &why);
}

const char *attn_problem_error(int algo, int isa, const attn_problem *p)
{
    const char *why;
    check_problem(algo, isa, p, &why);
    return why;
}

/* 1 if one of the n elements at x (bits of width U) has every exponent bit set: NaN or
 * infinity. The scans of p->nonfinite for the kernels that do not check their own arrays. */
#define ATTN_DEFINE_SCAN(name, U, EXP)                                                            \
    static int name(const void *x, int64_t n, int num_threads)                                  \
    {                                                                                           \
        const U *u = x;                                                                         \
        int bad = 0;                                                                            \
        _Pragma("omp parallel for simd schedule(static) reduction(| : bad) num_threads(num_threads) if (n > 65536)") \
        for (int64_t i = 0; i < n; i++)                                                         \
            bad |= (u[i] & (EXP)) == (EXP);                                                     \
        return bad;                                                                             \
    }
ATTN_DEFINE_SCAN(scan_f32, uint32_t, 0x7f800000u)
ATTN_DEFINE_SCAN(scan_f64, uint64_t, 0x7ff0000000000000u)
ATTN_DEFINE_SCAN(scan_bf16, uint16_t, 0x7f80u)
ATTN_DEFINE_SCAN(scan_f16, uint16_t, 0x7c00u)
typedef int (*attn_scan_fn)(const void *, int64_t, int);

/* The nonfinite bits of q, k, v, ORed into *p->nonfinite. */
static int scan_inputs(const attn_problem *p, attn_scan_fn scan, const void *q, const void *k, const void *v)
{
    int bits = (scan(q, p->batch * p->nq * p->d, p->num_threads) ? ATTN_NONFINITE_Q : 0) |
               (scan(k, p->batch * p->nk * p->d, p->num_threads) ? ATTN_NONFINITE_K : 0) |
               (scan(v, p->batch * p->nk * p->dv, p->num_threads) ? ATTN_NONFINITE_V : 0);
    *p->nonfinite |= bits;
    return bits;
}

/* The problem a kernel runs: on one thread in a forked child whose pool could not be
 * released (see before_fork); attn_team_size starts at 1 (a kernel that opens no
 * parallel region runs on the calling thread). */
static attn_problem run_problem(const attn_problem *p)
{
    attn_problem one = *p;
    if (fork_state == ATTN_FORK_ONE_THREAD)
        one.num_threads = 1;
    attn_team_size = 1;
    attn_split_chunks = 0;
    return one;
}

/* Runs a forward while holding the running-kernels count (before_fork waits for it);
 * with p->nonfinite and a kernel that does not check its own arrays (self_checks 0),
 * the inputs are scanned first (no kernel runs on non-finite ones) and the output after. */
#define ATTN_RUN_FORWARD(fn, scan, self_checks, p, q, k, v, out, lse)                            \
    do {                                                                                        \
        attn_problem one_ = run_problem(p);                                                     \
        int scanned_ = one_.nonfinite && !(self_checks);                                        \
        kernels_enter();                                                                        \
        int err_ = ATTN_OK;                                                                     \
        if (!(scanned_ && scan_inputs(&one_, (scan), q, k, v))) {                               \
            err_ = (fn)(&one_, q, k, v, out, lse);                                              \
            if (!err_ && scanned_ && (scan)(out, one_.batch * one_.nq * one_.dv, one_.num_threads)) \
                *one_.nonfinite |= ATTN_NONFINITE_OUT;                                          \
        }                                                                                       \
        kernels_leave();                                                                        \
        return err_;                                                                            \
    } while (0)

/* attn_forward_f32 and attn_forward_f64: check the problem, skip empty work, run
 * (the flash kernels check their own arrays). */
#define ATTN_DEFINE_FORWARD(DT, T)                                                                \
    int attn_forward_##DT(int algo, int isa, const attn_problem *p, const T *q, const T *k,     \
                          const T *v, T *out, T *lse)                                           \
    {                                                                                           \
        int err = attn_check_problem(algo, isa, p);                                             \
        if (err)                                                                                \
            return err;                                                                         \
        if (p->batch == 0 || p->nq == 0 || (p->dv == 0 && !lse))                                \
            return ATTN_OK;                                                                     \
        ATTN_RUN_FORWARD(table_##DT[isa][algo], scan_##DT, algo == ATTN_FLASH, p, q, k, v, out, lse); \
    }

ATTN_DEFINE_FORWARD(f32, float)
ATTN_DEFINE_FORWARD(f64, double)

/* F16C (float16 <-> float32) is used by the float16 code of every vector unit. */
static int half_kind_supported(int isa, int kind)
{
    if (kind == ATTN_BF16 || isa == ATTN_ISA_GENERIC)
        return 1;
#if defined(__x86_64__) || defined(__i386__)
    return __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

int attn_forward_half(int algo, int isa, int kind, const attn_problem *p, const uint16_t *q,
                      const uint16_t *k, const uint16_t *v, uint16_t *out, uint16_t *lse)
{
    int err = attn_check_problem(algo, isa, p);
    if (err)
        return err;
    if ((kind != ATTN_BF16 && kind != ATTN_F16) || !table_half[isa][kind][algo])
        return ATTN_EINVAL;
    if (!half_kind_supported(isa, kind))
        return ATTN_EISA;
    if (p->batch == 0 || p->nq == 0 || (p->dv == 0 && !lse))
        return ATTN_OK;
    attn_fn_half fn = table_half[isa][kind][algo];
    /* bfloat16 flash on avx512bf16 and amx has kernels of its own, without the
     * features or the decode path: a problem with features or a decode shape
     * (attn_decode_chunk) runs the unit's converting flash instead */
    int own_kernel = algo == ATTN_FLASH && kind == ATTN_BF16 && (isa == ATTN_ISA_AVX512BF16 || isa == ATTN_ISA_AMX);
    if (own_kernel && (attn_has_features(p) || attn_decode_chunk(p))) {
        fn = converting_flash_bf16[isa];
        own_kernel = 0;
    }
    /* the flash kernels of attn_kernels.h check their own arrays; the own kernels do not */
    int self_checks = algo == ATTN_FLASH && !own_kernel;
    ATTN_RUN_FORWARD(fn, kind == ATTN_BF16 ? scan_bf16 : scan_f16, self_checks, p, q, k, v, out, lse);
}

int attn_convert_half(int isa, int kind, const float *in, int64_t n, uint16_t *out, float *back)
{
    if (!attn_isa_supported(isa) || !convert_half[isa])
        return ATTN_EISA;
    if ((kind != ATTN_BF16 && kind != ATTN_F16) || n < 0)
        return ATTN_EINVAL;
    if (!half_kind_supported(isa, kind))
        return ATTN_EISA;
    convert_half[isa](kind, in, n, out, back);
    return ATTN_OK;
}

/* attn_backward_f32 and attn_backward_f64: the same checks; with no queries, dk and
 * dv are zero (no query sees any key). backward_with_DT runs the backward fn. */
#define ATTN_DEFINE_BACKWARD(DT, T)                                                               \
    static int backward_with_##DT(attn_bwd_##DT fn, int isa, const attn_problem *p, const T *q,  \
                                  const T *k, const T *v, const T *out, const T *dout,           \
                                  const T *lse, T *dq, T *dk, T *dv)                             \
    {                                                                                           \
        int err = attn_check_problem(ATTN_FLASH, isa, p);                                       \
        if (err)                                                                                \
            return err;                                                                         \
        if (p->batch == 0)                                                                      \
            return ATTN_OK;                                                                     \
        if (p->nq == 0) {                                                                       \
            int64_t rows_kv = p->batch / p->kv_group;                                           \
            if (dk)                                                                             \
                memset(dk, 0, (size_t)(rows_kv * p->nk * p->d) * sizeof(T));                    \
            if (dv)                                                                             \
                memset(dv, 0, (size_t)(rows_kv * p->nk * p->dv) * sizeof(T));                   \
            return ATTN_OK;                                                                     \
        }                                                                                       \
        attn_problem one = run_problem(p);                                                      \
        kernels_enter();                                                                        \
        err = fn(&one, q, k, v, out, dout, lse, dq, dk, dv);                                    \
        kernels_leave();                                                                        \
        return err;                                                                             \
    }                                                                                           \
    int attn_backward_##DT(int isa, const attn_problem *p, const T *q, const T *k, const T *v,  \
                           const T *out, const T *dout, const T *lse, T *dq, T *dk, T *dv)      \
    {                                                                                           \
        if (!attn_isa_supported(isa))                                                           \
            return ATTN_EISA;                                                                   \
        return backward_with_##DT(backward_##DT[isa], isa, p, q, k, v, out, dout, lse, dq, dk, dv); \
    }

ATTN_DEFINE_BACKWARD(f32, float)
ATTN_DEFINE_BACKWARD(f64, double)

/* n elements of bfloat16 or float16 bits (kind) widened to float32, and back, over
 * the problem's threads (element by element: the same for every thread count), each
 * a running kernel for the fork rules. */
static void widen_half(int kind, const uint16_t *x, int64_t n, float *y, int num_threads)
{
    kernels_enter();
    if (kind == ATTN_BF16) {
#pragma omp parallel for simd schedule(static) num_threads(num_threads)
        for (int64_t i = 0; i < n; i++)
            y[i] = attn_bf16_to_f32(x[i]);
    } else {
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int64_t i = 0; i < n; i++)
            y[i] = attn_f16_to_f32(x[i]);
    }
    kernels_leave();
}
static void round_half(int kind, const float *x, int64_t n, uint16_t *y, int num_threads)
{
    kernels_enter();
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t i = 0; i < n; i++)
        y[i] = kind == ATTN_BF16 ? attn_f32_to_bf16(x[i]) : attn_f32_to_f16(x[i]);
    kernels_leave();
}

/* The lse a row uses: own (computed here in float32) where given (the caller's) lies
 * within half an ulp of kind of it, plus float32 slack: given is then the same row's
 * lse rounded to kind, off by up to 0.016 near 8 in bfloat16 (1.6% on every
 * probability of the row). Else given stays: the lse of longer rows (out and lse
 * of a whole row, k and v one block of its keys), or a row without keys. */
static float refined_lse(int kind, float given, float own)
{
    if (!isfinite(given) || !isfinite(own))
        return given;
    int e;
    frexpf(fabsf(given), &e);  /* |given| in [2^(e-1), 2^e): an ulp of kind is 2^(e - bits) */
    float tol = 0.5f * ldexpf(1.0f, e - (kind == ATTN_BF16 ? 8 : 11)) + 1e-5f * fmaxf(1.0f, fabsf(given));
    return fabsf(own - given) <= tol ? own : given;
}

int attn_backward_half(int isa, int kind, const attn_problem *p, const uint16_t *q, const uint16_t *k,
                       const uint16_t *v, const uint16_t *out, const uint16_t *dout, const float *lse,
                       uint16_t *dq, uint16_t *dk, uint16_t *dv)
{
    if (kind != ATTN_BF16 && kind != ATTN_F16)
        return ATTN_EINVAL;
    int err = attn_check_problem(ATTN_FLASH, isa, p);
    if (err)
        return err;
    const int64_t rows = p->batch * p->nq, rows_kv = p->batch / p->kv_group * p->nk;
    const int64_t n[8] = {rows * p->d, rows_kv * p->d, rows_kv * p->dv, rows * p->dv, rows * p->dv,
                          rows * p->d, rows_kv * p->d, rows_kv * p->dv};
    const uint16_t *in[5] = {q, k, v, out, dout};
    uint16_t *grad[3] = {dq, dk, dv};
    float *w[8] = {0}, *own_lse = NULL;
    int failed = 0, nt = run_problem(p).num_threads;
    for (int a = 0; a < 8; a++) {
        w[a] = attn_alloc(n[a] > 0 ? n[a] : 1, 1, sizeof(float));
        failed |= !w[a];
    }
    if (!failed) {
        for (int a = 0; a < 5; a++)
            widen_half(kind, in[a], n[a], w[a], nt);
        /* the rows' lse in float32: the forward's scores alone (no output columns) */
        attn_problem scores = *p;
        scores.dv = 0;
        scores.nonfinite = NULL;
        own_lse = attn_alloc(rows > 0 ? rows : 1, 1, sizeof(float));
        err = own_lse ? ATTN_OK : ATTN_ENOMEM;
        /* bfloat16 on the products' unit: the bfloat16 forward's own lse (plain problems,
         * which it takes), its scores those the backward's products recompute */
        int dot_lse = kind == ATTN_BF16 && backward_dot_bf16[isa] && !attn_has_features(p);
#ifdef ATTN_HAVE_AVX512BF16
        if (own_lse && dot_lse) {
            attn_problem one = run_problem(&scores);
            kernels_enter();
            err = attn_flash_bf16dot_lse_avx512bf16(&one, q, k, own_lse);
            kernels_leave();
        }
#else
        dot_lse = 0;
#endif
        if (own_lse && !dot_lse)
            err = attn_forward_f32(ATTN_FLASH, isa, &scores, w[0], w[1], w[2], NULL, own_lse);
        if (err == ATTN_OK && lse)
            for (int64_t i = 0; i < rows; i++)
                own_lse[i] = refined_lse(kind, lse[i], own_lse[i]);
        lse = own_lse;
        /* bfloat16 on a unit with vdpbf16ps: the products on bfloat16 pairs (w[0..4] hold
         * bfloat16 values exactly); else float32 products */
        attn_bwd_f32 fn = kind == ATTN_BF16 && backward_dot_bf16[isa] ? backward_dot_bf16[isa] : backward_f32[isa];
        if (err == ATTN_OK)
            err = backward_with_f32(fn, isa, p, w[0], w[1], w[2], w[3], w[4], lse, w[5], w[6], w[7]);
        if (err == ATTN_OK)
            for (int a = 0; a < 3; a++)
                round_half(kind, w[5 + a], n[5 + a], grad[a], nt);
    }
    for (int a = 0; a < 8; a++)
        attn_free(w[a]);
    attn_free(own_lse);
    return failed ? ATTN_ENOMEM : err;
}

static int fma_peak(int isa, int64_t iters, int num_threads, double *checksum)
{
    switch (isa) {
#ifdef ATTN_HAVE_AMX
    case ATTN_ISA_AMX:  /* the float32 FMAs are AVX-512's */
        *checksum = attn_fma_peak_f32_amx(iters, num_threads);
        return 16;
#endif
#ifdef ATTN_HAVE_AVX512BF16
    case ATTN_ISA_AVX512BF16:  /* the float32 FMAs are AVX-512's */
        *checksum = attn_fma_peak_f32_avx512bf16(iters, num_threads);
        return 16;
#endif
#ifdef ATTN_HAVE_AVX512
    case ATTN_ISA_AVX512:
        *checksum = attn_fma_peak_f32_avx512(iters, num_threads);
        return 16;
#endif
#ifdef ATTN_HAVE_AVX2
    case ATTN_ISA_AVX2:
        *checksum = attn_fma_peak_f32_avx2(iters, num_threads);
        return 8;
#endif
    default:
        *checksum = attn_fma_peak_f32_generic(iters, num_threads);
        return 8;
    }
}

/* The ceilings run under the same fork rules as the kernels. */
int attn_fma_peak(int isa, int64_t iters, int num_threads, double *checksum)
{
    if (!attn_isa_supported(isa) || iters < 0 || num_threads < 1 || num_threads > ATTN_MAX_THREADS)
        return 0;
    if (fork_state == ATTN_FORK_ONE_THREAD)
        num_threads = 1;
    attn_team_size = 1;
    kernels_enter();
    int width = fma_peak(isa, iters, num_threads, checksum);
    kernels_leave();
    return width;
}

static void stream(int op, float *a, const float *b, const float *c, int64_t n, int num_threads)
{
#pragma omp parallel num_threads(num_threads)
    {
        ATTN_NOTE_TEAM();
        if (op == 0) {
#pragma omp for simd schedule(static)
            for (int64_t i = 0; i < n; i++)
                a[i] = b[i];
        } else if (op == 2) {
            /* read: b summed (each thread's sum in a[thread], so that the loads are not dropped) */
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t lo = n * t / nt, hi = n * (t + 1) / nt;
            /* 64 partial sums (four 16-lane vectors): the adds' latency off the loads' way */
            float part[64] = {0.0f}, sum = 0.0f;
            int64_t i = lo;
            for (; i + 64 <= hi; i += 64) {
#pragma omp simd
                for (int j = 0; j < 64; j++)
                    part[j] += b[i + j];
            }
            for (; i < hi; i++)
                sum += b[i];
            for (int j = 0; j < 64; j++)
                sum += part[j];
            if (t < n)
                a[t] = sum;
        } else {
#pragma omp for simd schedule(static)
            for (int64_t i = 0; i < n; i++)
                a[i] = b[i] + 3.0f * c[i];
        }
    }
}

void attn_stream(int op, float *a, const float *b, const float *c, int64_t n, int num_threads)
{
    if (fork_state == ATTN_FORK_ONE_THREAD)
        num_threads = 1;
    attn_team_size = 1;
    kernels_enter();
    stream(op, a, b, c, n, num_threads);
    kernels_leave();
}
