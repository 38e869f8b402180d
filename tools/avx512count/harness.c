/* Counting harness of the AVX-512 kernels (tools/avx512_count.py builds and runs it).
 *
 * attn_avx512.c is compiled with -fsanitize-coverage=trace-pc: GCC starts each of its
 * basic blocks with a call to __sanitizer_cov_trace_pc, defined here, which counts the
 * hits of each return address (a block of the instrumented code) in an open-addressing
 * table. Nothing else is instrumented (this file, attn_dispatch.c and attn_generic.c
 * are compiled without it), so the table holds the AVX-512 translation unit's blocks
 * only. The tool weights each block's hits by its instruction count read from
 * `objdump -d` of this executable.
 *
 * usage: harness fwd|bwd BxHxNxD causal threads OUT
 * One configuration per run: fixed inputs (a seeded generator), the kernel called once
 * uncounted (first-call effects), the table cleared, the kernel called once more and
 * the table written to OUT as lines "hex_address hits", the blocks' hits of that call.
 * Exit status 5: this commit's C API has no such pass (no backward).
 *
 * The C API of older commits differs; the tool reads the commit's attn.h and defines
 * ACNT_FORWARD_LSE (attn_forward_f32 takes lse), ACNT_HAS_BACKWARD (attn_backward_f32
 * exists), ACNT_HAS_ISA_REASON (attn_isa_reason exists) and ACNT_HAS_<field> for the
 * attn_problem fields whose neutral value is not 0.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attn.h"

#define SLOTS (1u << 20) /* a power of two, far above the translation unit's blocks */
static uintptr_t slot_pc[SLOTS];
static uint64_t slot_hits[SLOTS];

/* Called at the start of every block of the instrumented code, possibly from several
 * OpenMP threads at once: a slot is claimed by compare-and-swap, hits are atomic adds. */
void __sanitizer_cov_trace_pc(void)
{
    uintptr_t pc = (uintptr_t)__builtin_return_address(0);
    uint32_t i = (uint32_t)((pc * 0x9E3779B97F4A7C15ull) >> 44) & (SLOTS - 1);
    for (;;) {
        uintptr_t cur = __atomic_load_n(&slot_pc[i], __ATOMIC_ACQUIRE);
        if (cur == pc)
            break;
        if (cur == 0) {
            uintptr_t expected = 0;
            if (__atomic_compare_exchange_n(&slot_pc[i], &expected, pc, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)
                || expected == pc)
                break;
        }
        i = (i + 1) & (SLOTS - 1);
    }
    __atomic_fetch_add(&slot_hits[i], 1, __ATOMIC_RELAXED);
}

static void clear_hits(void) { memset(slot_hits, 0, sizeof slot_hits); }

/* Standard normal numbers from a fixed xorshift64* stream (Box-Muller): the same
 * inputs in every run and build. */
static uint64_t rng_state = 0x2545F4914F6CDD1Dull;
static double uniform01(void)
{
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return ((rng_state * 0x2545F4914F6CDD1Dull) >> 11) * 0x1.0p-53;
}
static float *normal_array(int64_t n)
{
    float *x = aligned_alloc(64, (size_t)((n * 4 + 63) / 64 * 64));
    if (!x) {
        fprintf(stderr, "harness: out of memory\n");
        exit(2);
    }
    for (int64_t i = 0; i < n; i++) {
        double u = uniform01(), w = uniform01();
        x[i] = (float)(sqrt(-2.0 * log(u + 0x1.0p-60)) * cos(6.283185307179586 * w));
    }
    return x;
}

int main(int argc, char **argv)
{
    long long b, h, n, d;
    if (argc != 6 || (strcmp(argv[1], "fwd") && strcmp(argv[1], "bwd"))
        || sscanf(argv[2], "%lldx%lldx%lldx%lld", &b, &h, &n, &d) != 4) {
        fprintf(stderr, "usage: harness fwd|bwd BxHxNxD causal threads OUT\n");
        return 2;
    }
    if (!attn_isa_supported(ATTN_ISA_AVX512)) {
#ifdef ACNT_HAS_ISA_REASON
        fprintf(stderr, "harness: no AVX-512 here: %s\n", attn_isa_reason(ATTN_ISA_AVX512));
#else
        fprintf(stderr, "harness: no AVX-512 here\n");
#endif
        return 3;
    }
    int backward = !strcmp(argv[1], "bwd");
#ifndef ACNT_HAS_BACKWARD
    if (backward) {
        fprintf(stderr, "harness: this commit's C API has no attn_backward_f32\n");
        return 5;
    }
#endif
    attn_problem p;
    memset(&p, 0, sizeof p); /* no features: every field the tool does not know stays 0 */
    p.batch = b * h, p.nq = n, p.nk = n, p.d = d, p.dv = d;
    p.causal = atoi(argv[3]);
    p.scale = 1.0 / sqrt((double)d);
    p.block_q = 256, p.block_k = 256, p.num_threads = atoi(argv[4]);
    /* the neutral values of the feature fields this commit's attn.h has (tools/avx512_count.py
     * defines ACNT_HAS_<field> for each one it finds) */
#ifdef ACNT_HAS_kv_group
    p.kv_group = 1;
#endif
#ifdef ACNT_HAS_window_left
    p.window_left = ATTN_UNBOUNDED, p.window_right = ATTN_UNBOUNDED;
#endif
#ifdef ACNT_HAS_heads
    p.heads = 1;
#endif
#ifdef ACNT_HAS_mask_heads
    p.mask_heads = 1;
#endif
    int64_t nq_all = p.batch * n * d;
    float *q = normal_array(nq_all), *k = normal_array(nq_all), *v = normal_array(nq_all);
    float *out = normal_array(nq_all), *lse = normal_array(p.batch * n);
#ifdef ACNT_FORWARD_LSE
#define FORWARD() attn_forward_f32(ATTN_FLASH, ATTN_ISA_AVX512, &p, q, k, v, out, lse)
#else
#define FORWARD() attn_forward_f32(ATTN_FLASH, ATTN_ISA_AVX512, &p, q, k, v, out)
#endif
    int rc = FORWARD();
    if (rc == ATTN_OK && !backward) {
        clear_hits();
        rc = FORWARD();
    }
#ifdef ACNT_HAS_BACKWARD
    else if (rc == ATTN_OK) {
        float *dout = normal_array(nq_all), *dq = normal_array(nq_all), *dk = normal_array(nq_all);
        float *dv = normal_array(nq_all);
        rc = attn_backward_f32(ATTN_ISA_AVX512, &p, q, k, v, out, dout, lse, dq, dk, dv);
        clear_hits();
        if (rc == ATTN_OK)
            rc = attn_backward_f32(ATTN_ISA_AVX512, &p, q, k, v, out, dout, lse, dq, dk, dv);
    }
#endif
    if (rc != ATTN_OK) {
        fprintf(stderr, "harness: the kernel returned status %d\n", rc);
        return 4;
    }
    FILE *f = fopen(argv[5], "w");
    if (!f) {
        perror(argv[5]);
        return 2;
    }
    for (uint32_t i = 0; i < SLOTS; i++)
        if (slot_hits[i])
            fprintf(f, "%llx %llu\n", (unsigned long long)slot_pc[i], (unsigned long long)slot_hits[i]);
    return fclose(f) ? 2 : 0;
}
