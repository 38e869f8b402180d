# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""Thin wrapper over the C kernels: arguments arrive validated from
attnkern._api; the GIL is released for the whole computation."""

from libc.stdint cimport int64_t, uint16_t

cdef extern from "attn.h" nogil:
    enum:
        ATTN_OK
        ATTN_ENOMEM
        ATTN_EINVAL
        ATTN_EISA
        ATTN_ETOOBIG
        ATTN_ISA_COUNT
        ATTN_MAX_BLOCK_Q
        ATTN_MAX_BLOCK_K
        ATTN_MAX_THREADS
    ctypedef struct attn_problem:
        int64_t batch, nq, nk, d, dv
        int causal
        double scale
        int block_q, block_k, num_threads
        int *nonfinite
    enum:
        ATTN_NONFINITE_Q
        ATTN_NONFINITE_K
        ATTN_NONFINITE_V
        ATTN_NONFINITE_OUT
    int attn_isa_compiled(int isa)
    int attn_isa_supported(int isa)
    const char *attn_isa_reason(int isa)
    int attn_best_isa()
    const char *attn_isa_name(int isa)
    int attn_max_threads()
    int attn_fork_state()
    int attn_last_team()
    int attn_check_problem(int algo, int isa, const attn_problem *p)
    int attn_fma_peak(int isa, int64_t iters, int num_threads, double *checksum)
    void attn_stream(int op, float *a, const float *b, const float *c, int64_t n, int num_threads)
    int attn_forward_f32(int algo, int isa, const attn_problem *p, const float *q,
                         const float *k, const float *v, float *out, float *lse)
    int attn_forward_f64(int algo, int isa, const attn_problem *p, const double *q,
                         const double *k, const double *v, double *out, double *lse)
    int attn_forward_half(int algo, int isa, int kind, const attn_problem *p, const uint16_t *q,
                          const uint16_t *k, const uint16_t *v, uint16_t *out, uint16_t *lse)
    int attn_convert_half(int isa, int kind, const float *inp, int64_t n, uint16_t *out, float *back)
    int attn_backward_f32(int isa, const attn_problem *p, const float *q, const float *k,
                          const float *v, const float *out, const float *dout, const float *lse,
                          float *dq, float *dk, float *dv)
    int attn_backward_f64(int isa, const attn_problem *p, const double *q, const double *k,
                          const double *v, const double *out, const double *dout, const double *lse,
                          double *dq, double *dk, double *dv)

cdef extern from "attn_common.h" nogil:
    double ATTN_LOG2E
    const double attn_exp2_f32[6]
    const double attn_exp2_f64[14]

ALGORITHMS = {"naive": 0, "tiled": 1, "flash": 2}
# The constants of the exp2-domain softmax, for the Numba kernel to match (its tests compare)
LOG2E = ATTN_LOG2E
EXP2_F32 = tuple(attn_exp2_f32[i] for i in range(6))
EXP2_F64 = tuple(attn_exp2_f64[i] for i in range(14))
ISAS = tuple(attn_isa_name(i).decode() for i in range(ATTN_ISA_COUNT))
MAX_BLOCK_Q = ATTN_MAX_BLOCK_Q
MAX_BLOCK_K = ATTN_MAX_BLOCK_K
MAX_THREADS = ATTN_MAX_THREADS


def isa_compiled(str name):
    return bool(attn_isa_compiled(ISAS.index(name)))


def isa_supported(str name):
    return bool(attn_isa_supported(ISAS.index(name)))


def isa_reason(str name):
    """Why the ISA cannot run here, in words; "" when it can."""
    return attn_isa_reason(ISAS.index(name)).decode()


def best_isa():
    return ISAS[attn_best_isa()]


def max_threads():
    return attn_max_threads()


FORK_STATES = ("none", "fresh_pool", "one_thread")


def fork_state():
    """"none" outside a forked child; "fresh_pool" in a child whose parent released
    its OpenMP pool before the fork (the kernels run with the requested threads);
    "one_thread" in a child whose parent's OpenMP runtime could not release it (the
    kernels then run on the calling thread, which is the only safe choice)."""
    return FORK_STATES[attn_fork_state()]


def last_team():
    """The threads the last native kernel called from this Python thread ran on, as
    its OpenMP teams reported them (0 before the first call)."""
    return attn_last_team()


STATUS = {ATTN_OK: "ok", ATTN_ENOMEM: "nomem", ATTN_EINVAL: "invalid", ATTN_EISA: "isa",
          ATTN_ETOOBIG: "toobig"}


def check_problem(str algo, str isa, int64_t batch, int64_t nq, int64_t nk, int64_t d, int64_t dv,
                  bint causal=False, double scale=1.0, int block_q=64, int block_k=64, int num_threads=1):
    """The C entry points' own argument checks on a problem description alone
    (no arrays): "ok", "invalid", "isa" or "toobig". For tests and fuzzing of
    sizes no machine could hold."""
    if algo not in ALGORITHMS:
        raise ValueError(f"check_problem: algo must be one of {', '.join(ALGORITHMS)}, got {algo!r}")
    if isa not in ISAS:
        raise ValueError(f"check_problem: isa must be one of {', '.join(ISAS)}, got {isa!r}")
    cdef attn_problem p
    p.batch, p.nq, p.nk, p.d, p.dv = batch, nq, nk, d, dv
    p.causal, p.scale = causal, scale
    p.block_q, p.block_k, p.num_threads = block_q, block_k, num_threads
    p.nonfinite = NULL
    return STATUS[attn_check_problem(ALGORITHMS[algo], ISAS.index(isa), &p)]


ctypedef fused real:
    float
    double


cdef attn_problem _problem(q, k, v, bint causal, double scale, int block_q, int block_k,
                           int num_threads, str what) except *:
    cdef attn_problem p
    p.batch, p.nq, p.nk = q.shape[0], q.shape[1], k.shape[1]
    p.d, p.dv = q.shape[2], v.shape[2]
    p.causal, p.scale = causal, scale
    p.block_q, p.block_k, p.num_threads = block_q, block_k, num_threads
    p.nonfinite = NULL
    if k.shape[0] != p.batch or v.shape[0] != p.batch or k.shape[2] != p.d or v.shape[1] != p.nk:
        raise ValueError(f"native {what}: inconsistent shapes")
    return p


cdef _raise(int err, str what, const attn_problem *p, str isa, str hint=""):
    if err == ATTN_ENOMEM:
        raise MemoryError(f"{what}: out of memory for its work buffers{hint}")
    if err == ATTN_ETOOBIG:
        raise ValueError(f"{what}: the arrays are too large for 64-bit index arithmetic "
                         f"(batch {p.batch}, nq {p.nq}, nk {p.nk}, d {p.d}, dv {p.dv})")
    if err == ATTN_EISA:
        raise RuntimeError(f"{what}: instruction set {isa!r} is not supported on this CPU")
    raise ValueError(f"{what}: invalid arguments (error {err})")


def forward(str algo, str isa, const real[:, :, ::1] q, const real[:, :, ::1] k,
            const real[:, :, ::1] v, real[:, :, ::1] out, bint causal, double scale,
            int block_q, int block_k, int num_threads, real[:, ::1] lse=None, bint check_finite=False):
    """out[...] = softmax(q k^T * scale) v on (batch, n, d) arrays; lse (batch, nq),
    if given, gets each row's natural-log log-sum-exp. Returns, with check_finite, the
    names of the arrays that are not finite (of "q", "k", "v", "out"), else ()."""
    cdef int err, a = ALGORITHMS[algo], i = ISAS.index(isa), bad = 0
    cdef attn_problem p = _problem(q, k, v, causal, scale, block_q, block_k, num_threads, f"{algo} forward")
    if check_finite:
        p.nonfinite = &bad
    if out.shape[0] != p.batch or out.shape[1] != p.nq or out.shape[2] != p.dv:
        raise ValueError("native forward: inconsistent shapes")
    if lse is not None and (lse.shape[0] != p.batch or lse.shape[1] != p.nq):
        raise ValueError("native forward: lse must have shape (batch, nq)")
    cdef const real *qp = &q[0, 0, 0] if q.size else NULL
    cdef const real *kp = &k[0, 0, 0] if k.size else NULL
    cdef const real *vp = &v[0, 0, 0] if v.size else NULL
    cdef real *op = &out[0, 0, 0] if out.size else NULL
    cdef real *lp = &lse[0, 0] if lse is not None and lse.size else NULL
    with nogil:
        if real is float:
            err = attn_forward_f32(a, i, &p, qp, kp, vp, op, lp)
        else:
            err = attn_forward_f64(a, i, &p, qp, kp, vp, op, lp)
    if err != ATTN_OK:
        _raise(err, f"native.{algo}", &p, isa, "" if algo == "flash" else "; native.flash needs no N x N buffer")
    return _nonfinite_names(bad)


def _nonfinite_names(int bits):
    return tuple(n for n, b in (("q", ATTN_NONFINITE_Q), ("k", ATTN_NONFINITE_K), ("v", ATTN_NONFINITE_V),
                                ("out", ATTN_NONFINITE_OUT)) if bits & b)


HALF_KINDS = {"bfloat16": 0, "float16": 1}


def forward_half(str algo, str isa, str kind, const uint16_t[:, :, ::1] q, const uint16_t[:, :, ::1] k,
                 const uint16_t[:, :, ::1] v, uint16_t[:, :, ::1] out, bint causal, double scale,
                 int block_q, int block_k, int num_threads, uint16_t[:, ::1] lse=None,
                 bint check_finite=False):
    """forward on the bits of bfloat16 or float16 arrays (kind), passed as uint16 views:
    float32 arithmetic inside, out and lse rounded to kind; returns what forward does."""
    if algo not in ("tiled", "flash"):
        raise ValueError(f"native.{algo} takes float32 and float64 only; native.tiled and native.flash take {kind}")
    cdef int err, a = ALGORITHMS[algo], i = ISAS.index(isa), h = HALF_KINDS[kind], bad = 0
    cdef attn_problem p = _problem(q, k, v, causal, scale, block_q, block_k, num_threads, f"{algo} forward")
    if check_finite:
        p.nonfinite = &bad
    if out.shape[0] != p.batch or out.shape[1] != p.nq or out.shape[2] != p.dv:
        raise ValueError("native forward: inconsistent shapes")
    if lse is not None and (lse.shape[0] != p.batch or lse.shape[1] != p.nq):
        raise ValueError("native forward: lse must have shape (batch, nq)")
    cdef const uint16_t *qp = &q[0, 0, 0] if q.size else NULL
    cdef const uint16_t *kp = &k[0, 0, 0] if k.size else NULL
    cdef const uint16_t *vp = &v[0, 0, 0] if v.size else NULL
    cdef uint16_t *op = &out[0, 0, 0] if out.size else NULL
    cdef uint16_t *lp = &lse[0, 0] if lse is not None and lse.size else NULL
    with nogil:
        err = attn_forward_half(a, i, h, &p, qp, kp, vp, op, lp)
    if err == ATTN_EISA:
        raise RuntimeError(f"native.{algo}: instruction set {isa!r} cannot run {kind} on this CPU (F16C missing)")
    if err != ATTN_OK:
        _raise(err, f"native.{algo}", &p, isa, "" if algo == "flash" else "; native.flash needs no N x N buffer")
    return _nonfinite_names(bad)


def convert_half(str isa, str kind, const float[::1] x):
    """(bits, back): x rounded to kind by the conversion the ISA's unit uses, as uint16
    bits, and those widened back to float32. For the tests."""
    import numpy as np
    cdef int64_t n = x.shape[0]
    bits = np.empty(n, np.uint16)
    back = np.empty(n, np.float32)
    cdef uint16_t[::1] b = bits
    cdef float[::1] f = back
    cdef int err = attn_convert_half(ISAS.index(isa), HALF_KINDS[kind], &x[0] if n else NULL, n,
                                     &b[0] if n else NULL, &f[0] if n else NULL)
    if err != ATTN_OK:
        raise RuntimeError(f"convert_half: {isa!r} cannot convert {kind} here (error {err})")
    return bits, back


def backward(str isa, const real[:, :, ::1] q, const real[:, :, ::1] k, const real[:, :, ::1] v,
             const real[:, :, ::1] out, const real[:, :, ::1] dout, const real[:, ::1] lse,
             real[:, :, ::1] dq, real[:, :, ::1] dk, real[:, :, ::1] dv, bint causal, double scale,
             int block_q, int block_k, int num_threads):
    """dq, dk, dv[...] = the gradients of sum(out * dout), from the forward's out and lse."""
    cdef int err, i = ISAS.index(isa)
    cdef attn_problem p = _problem(q, k, v, causal, scale, block_q, block_k, num_threads, "backward")
    if ((out.shape[0], out.shape[1], out.shape[2]) != (p.batch, p.nq, p.dv)
            or (dout.shape[0], dout.shape[1], dout.shape[2]) != (p.batch, p.nq, p.dv)
            or (lse.shape[0], lse.shape[1]) != (p.batch, p.nq)
            or (dq.shape[0], dq.shape[1], dq.shape[2]) != (p.batch, p.nq, p.d)
            or (dk.shape[0], dk.shape[1], dk.shape[2]) != (p.batch, p.nk, p.d)
            or (dv.shape[0], dv.shape[1], dv.shape[2]) != (p.batch, p.nk, p.dv)):
        raise ValueError("native backward: inconsistent shapes")
    cdef const real *qp = &q[0, 0, 0] if q.size else NULL
    cdef const real *kp = &k[0, 0, 0] if k.size else NULL
    cdef const real *vp = &v[0, 0, 0] if v.size else NULL
    cdef const real *op = &out[0, 0, 0] if out.size else NULL
    cdef const real *dop = &dout[0, 0, 0] if dout.size else NULL
    cdef const real *lp = &lse[0, 0] if lse.size else NULL
    cdef real *dqp = &dq[0, 0, 0] if dq.size else NULL
    cdef real *dkp = &dk[0, 0, 0] if dk.size else NULL
    cdef real *dvp = &dv[0, 0, 0] if dv.size else NULL
    with nogil:
        if real is float:
            err = attn_backward_f32(i, &p, qp, kp, vp, op, dop, lp, dqp, dkp, dvp)
        else:
            err = attn_backward_f64(i, &p, qp, kp, vp, op, dop, lp, dqp, dkp, dvp)
    if err != ATTN_OK:
        _raise(err, "native.flash backward", &p, isa)


def fma_peak(str isa, int64_t iters, int num_threads):
    """Seconds of attn_fma_peak and the flops it did: 2 * width * 12 * iters a thread."""
    import time
    if isa not in ISAS:
        raise ValueError(f"fma_peak: isa must be one of {', '.join(ISAS)}, got {isa!r}")
    if iters < 0 or not 1 <= num_threads <= ATTN_MAX_THREADS:
        raise ValueError(f"fma_peak: iters >= 0 and 1 <= num_threads <= {ATTN_MAX_THREADS}")
    cdef double checksum = 0
    cdef int width, i = ISAS.index(isa)
    t0 = time.perf_counter()
    with nogil:
        width = attn_fma_peak(i, iters, num_threads, &checksum)
    seconds = time.perf_counter() - t0
    if width == 0:
        raise RuntimeError(f"fma_peak: instruction set {isa!r} is not supported on this CPU")
    return seconds, 2.0 * width * 12 * iters * num_threads


def stream(str op, float[::1] a, const float[::1] b, const float[::1] c, int num_threads):
    """Seconds of one STREAM pass over len(a) floats: op "copy" (a = b) or "triad" (a = b + 3 c)."""
    import time
    if op not in ("copy", "triad"):
        raise ValueError(f"stream: op is 'copy' or 'triad', got {op!r}")
    if not (a.shape[0] == b.shape[0] == c.shape[0]) or not 1 <= num_threads <= ATTN_MAX_THREADS:
        raise ValueError("stream: a, b, c must have one length, and 1 <= num_threads <= the maximum")
    cdef int o = 0 if op == "copy" else 1
    cdef int64_t n = a.shape[0]
    t0 = time.perf_counter()
    with nogil:
        attn_stream(o, &a[0] if n else NULL, &b[0] if n else NULL, &c[0] if n else NULL, n, num_threads)
    return time.perf_counter() - t0
