# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""Thin wrapper over the C kernels: arguments arrive validated from
attnkern._api; the GIL is released for the whole computation."""

from libc.stdint cimport int64_t, uint16_t, uint64_t

cdef extern from "attn.h" nogil:
    enum:
        ATTN_OK
        ATTN_ENOMEM
        ATTN_EINVAL
        ATTN_EISA
        ATTN_ETOOBIG
        ATTN_EFEATURE
        ATTN_ALIGN_TOP_LEFT
        ATTN_ALIGN_BOTTOM_RIGHT
        ATTN_UNBOUNDED
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
        int64_t kv_group
        int align
        int64_t window_left, window_right
        const int64_t *seqlen_k
        int64_t heads
        double softcap
        const void *mask
        int mask_kind
        int64_t mask_heads
        int64_t mask_stride[4]
        double dropout_p
        uint64_t dropout_seed
        int64_t dropout_i0, dropout_j0
        const int64_t *cu_seqlens_q
        const int64_t *cu_seqlens_k
        int64_t nseq
        const double *alibi
        int64_t alibi_seq_stride
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
    int attn_last_split()
    int attn_check_problem(int algo, int isa, const attn_problem *p)
    const char *attn_problem_error(int algo, int isa, const attn_problem *p)
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
    int attn_backward_half(int isa, int kind, const attn_problem *p, const uint16_t *q, const uint16_t *k,
                           const uint16_t *v, const uint16_t *out, const uint16_t *dout, const float *lse,
                           uint16_t *dq, uint16_t *dk, uint16_t *dv)

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


def last_split():
    """The key chunks the last native forward called from this Python thread split each
    k/v row's keys into on flash's decode path (0: it did not take that path)."""
    return attn_last_split()


STATUS = {ATTN_OK: "ok", ATTN_ENOMEM: "nomem", ATTN_EINVAL: "invalid", ATTN_EISA: "isa",
          ATTN_ETOOBIG: "toobig", ATTN_EFEATURE: "feature"}
# Where the diagonal of causal and window masks lies (attn.h's attn_align): query i's
# own key is i ("top_left") or i + nk - nq ("bottom_right", nk the row's key length).
ALIGNS = {"top_left": ATTN_ALIGN_TOP_LEFT, "bottom_right": ATTN_ALIGN_BOTTOM_RIGHT}
UNBOUNDED = ATTN_UNBOUNDED


cdef int64_t _NO_LENGTHS = 0


cdef int _features(attn_problem *p, int64_t kv_group, str align, int64_t window_left, int64_t window_right,
                   const int64_t[::1] seqlen_k, double softcap, str what) except -1:
    """Fills p's features (attn.h); seqlen_k has batch / heads lengths, so heads
    is batch / len(seqlen_k). The C checks do the rest."""
    if align not in ALIGNS:
        raise ValueError(f"{what}: align must be one of {', '.join(ALIGNS)}, got {align!r}")
    p.kv_group, p.align = kv_group, ALIGNS[align]
    p.window_left, p.window_right = window_left, window_right
    p.seqlen_k, p.heads, p.softcap = NULL, 1, softcap
    if seqlen_k is not None:
        n = seqlen_k.shape[0]
        if n == 0 and p.batch != 0 or n != 0 and p.batch % n != 0:
            raise ValueError(f"{what}: seqlen_k has {n} lengths; it needs one per sequence: a number that "
                             f"divides batch ({p.batch}), such as batch (one per row) or batch / H (one per "
                             "sequence of H heads)")
        # no rows, no lengths: still a problem with key lengths (a valid pointer, never read)
        p.seqlen_k = &seqlen_k[0] if n else &_NO_LENGTHS
        p.heads = p.batch // n if n else 1
    return 0


cdef attn_problem _described(int64_t batch, int64_t nq, int64_t nk, int64_t d, int64_t dv, bint causal,
                              double scale, int block_q, int block_k, int num_threads, int64_t kv_group,
                              str align, int64_t window_left, int64_t window_right,
                              const int64_t[::1] seqlen_k, double softcap, str what) except *:
    cdef attn_problem p
    p.batch, p.nq, p.nk, p.d, p.dv = batch, nq, nk, d, dv
    p.causal, p.scale = causal, scale
    p.block_q, p.block_k, p.num_threads = block_q, block_k, num_threads
    p.nonfinite = NULL
    _features(&p, kv_group, align, window_left, window_right, seqlen_k, softcap, what)
    p.mask, p.mask_kind, p.mask_heads = NULL, 0, 1
    p.mask_stride[0] = p.mask_stride[1] = p.mask_stride[2] = p.mask_stride[3] = 0
    p.dropout_p, p.dropout_seed, p.dropout_i0, p.dropout_j0 = 0, 0, 0, 0
    p.cu_seqlens_q, p.cu_seqlens_k, p.nseq = NULL, NULL, 0
    p.alibi, p.alibi_seq_stride = NULL, 0
    return p


MASK_KINDS = {"bool": 0, "float32": 1, "float64": 2}


cdef int _extras(attn_problem *p, mask, int64_t mask_heads, double dropout_p, uint64_t dropout_seed,
                 int64_t dropout_i0, int64_t dropout_j0, const int64_t[::1] cu_seqlens_q,
                 const int64_t[::1] cu_seqlens_k, const double[::1] alibi, int64_t alibi_seq_stride) except -1:
    """Fills p's attention mask, dropout and varlen offsets (attn.h). mask: None, or a
    4-D NumPy array of bool, float32 or float64 whose dimensions are each 1 (broadcast:
    stride 0 in C) or those of (batch / mask_heads, mask_heads, nq, nk); it must outlive
    the call. cu_seqlens_q/k: None, or nseq + 1 offsets each (the arrays then in the
    varlen layout of attn.h). alibi: None, or one slope per folded query row (with
    varlen and alibi_seq_stride, one row of them per sequence)."""
    if mask is not None:
        if mask.ndim != 4 or mask.dtype.name not in MASK_KINDS:
            raise ValueError("native: mask must be a 4-D bool, float32 or float64 array")
        full = (p.batch // mask_heads if mask_heads else 0, mask_heads, p.nq, p.nk)
        for s in range(4):
            if mask.shape[s] not in (1, full[s]):
                raise ValueError(f"native: mask of shape {mask.shape} does not broadcast to {full}")
            st = mask.strides[s]
            if st < 0 or st % mask.itemsize:
                raise ValueError("native: mask strides must be non-negative multiples of its item size")
            p.mask_stride[s] = 0 if mask.shape[s] == 1 else st // mask.itemsize
        p.mask = <const void *><size_t>mask.__array_interface__["data"][0]
        p.mask_kind = MASK_KINDS[mask.dtype.name]
        p.mask_heads = mask_heads
    p.dropout_p, p.dropout_seed, p.dropout_i0, p.dropout_j0 = dropout_p, dropout_seed, dropout_i0, dropout_j0
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        if cu_seqlens_q is None or cu_seqlens_k is None or cu_seqlens_q.shape[0] != cu_seqlens_k.shape[0] \
                or cu_seqlens_q.shape[0] < 1:
            raise ValueError("native: cu_seqlens_q and cu_seqlens_k must both have nseq + 1 >= 1 offsets")
        p.cu_seqlens_q, p.cu_seqlens_k = &cu_seqlens_q[0], &cu_seqlens_k[0]
        p.nseq = cu_seqlens_q.shape[0] - 1
    if alibi is not None:
        need = p.batch * (p.nseq if alibi_seq_stride and p.nseq else 1)
        if alibi.shape[0] != need or alibi_seq_stride not in (0, p.batch):
            raise ValueError(f"native: alibi needs {need} slopes (one per query row), got {alibi.shape[0]}")
        p.alibi = &alibi[0] if need else NULL
        p.alibi_seq_stride = alibi_seq_stride
    return 0


def _algo_isa(str algo, str isa, str what):
    if algo not in ALGORITHMS:
        raise ValueError(f"{what}: algo must be one of {', '.join(ALGORITHMS)}, got {algo!r}")
    if isa not in ISAS:
        raise ValueError(f"{what}: isa must be one of {', '.join(ISAS)}, got {isa!r}")
    return ALGORITHMS[algo], ISAS.index(isa)


def check_problem(str algo, str isa, int64_t batch, int64_t nq, int64_t nk, int64_t d, int64_t dv,
                  bint causal=False, double scale=1.0, int block_q=64, int block_k=64, int num_threads=1,
                  *, int64_t kv_group=1, str align="top_left", int64_t window_left=-1, int64_t window_right=-1,
                  const int64_t[::1] seqlen_k=None, double softcap=0):
    """The C entry points' own argument checks on a problem description alone
    (no arrays but seqlen_k): "ok", "invalid", "isa", "toobig" or "feature". For
    tests and fuzzing of sizes no machine could hold."""
    a, i = _algo_isa(algo, isa, "check_problem")
    cdef attn_problem p = _described(batch, nq, nk, d, dv, causal, scale, block_q, block_k, num_threads,
                                     kv_group, align, window_left, window_right, seqlen_k, softcap,
                                     "check_problem")
    return STATUS[attn_check_problem(a, i, &p)]


def problem_error(str algo, str isa, int64_t batch, int64_t nq, int64_t nk, int64_t d, int64_t dv,
                  bint causal=False, double scale=1.0, int block_q=64, int block_k=64, int num_threads=1,
                  *, int64_t kv_group=1, str align="top_left", int64_t window_left=-1, int64_t window_right=-1,
                  const int64_t[::1] seqlen_k=None, double softcap=0):
    """What check_problem objects to, in the C checks' words ("" where it says "ok")."""
    a, i = _algo_isa(algo, isa, "problem_error")
    cdef attn_problem p = _described(batch, nq, nk, d, dv, causal, scale, block_q, block_k, num_threads,
                                     kv_group, align, window_left, window_right, seqlen_k, softcap,
                                     "problem_error")
    return attn_problem_error(a, i, &p).decode()


ctypedef fused real:
    float
    double


cdef attn_problem _problem(q, k, v, bint causal, double scale, int block_q, int block_k, int num_threads,
                           str what, str align, int64_t window_left, int64_t window_right,
                           const int64_t[::1] seqlen_k, double softcap) except *:
    """The problem of (batch, n, d) arrays; k and v may have batch / kv_group rows
    (grouped-query attention: query row b reads k/v row b / kv_group)."""
    cdef int64_t batch_kv = k.shape[0]
    if v.shape[0] != batch_kv or k.shape[2] != q.shape[2] or v.shape[1] != k.shape[1]:
        raise ValueError(f"native {what}: inconsistent shapes")
    if batch_kv == 0 and q.shape[0] != 0 or batch_kv != 0 and q.shape[0] % batch_kv != 0:
        raise ValueError(f"native {what}: k and v have {batch_kv} rows, which must divide q's {q.shape[0]} "
                         "(grouped-query attention: query row b reads k/v row b // (q rows / k rows))")
    return _described(q.shape[0], q.shape[1], k.shape[1], q.shape[2], v.shape[2], causal, scale, block_q,
                      block_k, num_threads, q.shape[0] // batch_kv if batch_kv else 1, align, window_left,
                      window_right, seqlen_k, softcap, f"native {what}")


cdef _raise(int err, str what, const attn_problem *p, int algo, str isa, str hint=""):
    if err == ATTN_ENOMEM:
        raise MemoryError(f"{what}: out of memory for its work buffers{hint}")
    if err == ATTN_ETOOBIG:
        raise ValueError(f"{what}: the arrays are too large for 64-bit index arithmetic "
                         f"(batch {p.batch}, nq {p.nq}, nk {p.nk}, d {p.d}, dv {p.dv})")
    if err == ATTN_EISA:
        raise RuntimeError(f"{what}: instruction set {isa!r} is not supported on this CPU")
    why = attn_problem_error(algo, ISAS.index(isa), p).decode()
    if err == ATTN_EFEATURE:
        raise ValueError(f"{what}: {why}; use native.flash")
    if why:
        raise ValueError(f"{what}: {why} (batch {p.batch}, nq {p.nq}, nk {p.nk}, kv_group {p.kv_group}, "
                         f"window_left {p.window_left}, window_right {p.window_right}, causal {bool(p.causal)}, "
                         f"scale {p.scale}, softcap {p.softcap})")
    raise ValueError(f"{what}: invalid arguments (error {err})")


def forward(str algo, str isa, const real[:, :, ::1] q, const real[:, :, ::1] k,
            const real[:, :, ::1] v, real[:, :, ::1] out, bint causal, double scale,
            int block_q, int block_k, int num_threads, real[:, ::1] lse=None, bint check_finite=False,
            *, str align="top_left", int64_t window_left=-1, int64_t window_right=-1,
            const int64_t[::1] seqlen_k=None, double softcap=0, mask=None, int64_t mask_heads=1,
            double dropout_p=0, uint64_t dropout_seed=0, int64_t dropout_i0=0, int64_t dropout_j0=0,
            const int64_t[::1] cu_seqlens_q=None, const int64_t[::1] cu_seqlens_k=None,
            const double[::1] alibi=None, int64_t alibi_seq_stride=0):
    """out[...] = softmax(q k^T * scale) v on (batch, n, d) arrays; lse (batch, nq),
    if given, gets each row's natural-log log-sum-exp. Returns, with check_finite, the
    names of the arrays that are not finite (of "q", "k", "v", "out"), else ().

    Features (flash only; attn.h's attn_problem says each in full):
    - k and v with batch / G rows (G dividing batch): grouped-query attention, query
      row b reads k/v row b // G (with batch = B * H folded, its head's k/v head);
    - align "top_left" or "bottom_right", window_left, window_right (-1: unbounded):
      query i sees key j iff i + off - window_left <= j <= i + off + window_right,
      off 0 or (the row's key length) - nq; causal is window_right 0;
    - seqlen_k, int64, batch / H lengths in [0, nk]: query row b sees only keys
      j < seqlen_k[b // H] (H = batch / len(seqlen_k): one length per row or per
      sequence of H heads);
    - softcap c > 0: scores s = scale q . k become c * tanh(s / c) before the mask;
    - mask (4-D, bool or q's float dtype, broadcast dimensions of size 1) and
      mask_heads: _extras; dropout_p, dropout_seed, dropout_i0/j0: attn.h's dropout.
    A row that sees no key gets out 0 and lse -inf."""
    cdef int err, a = ALGORITHMS[algo], i = ISAS.index(isa), bad = 0
    cdef attn_problem p = _problem(q, k, v, causal, scale, block_q, block_k, num_threads, f"{algo} forward",
                                   align, window_left, window_right, seqlen_k, softcap)
    _extras(&p, mask, mask_heads, dropout_p, dropout_seed, dropout_i0, dropout_j0, cu_seqlens_q, cu_seqlens_k, alibi,
            alibi_seq_stride)
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
        _raise(err, f"native.{algo}", &p, a, isa, "" if algo == "flash" else "; native.flash needs no N x N buffer")
    return _nonfinite_names(bad)


def _nonfinite_names(int bits):
    return tuple(n for n, b in (("q", ATTN_NONFINITE_Q), ("k", ATTN_NONFINITE_K), ("v", ATTN_NONFINITE_V),
                                ("out", ATTN_NONFINITE_OUT)) if bits & b)


HALF_KINDS = {"bfloat16": 0, "float16": 1}


def forward_half(str algo, str isa, str kind, const uint16_t[:, :, ::1] q, const uint16_t[:, :, ::1] k,
                 const uint16_t[:, :, ::1] v, uint16_t[:, :, ::1] out, bint causal, double scale,
                 int block_q, int block_k, int num_threads, uint16_t[:, ::1] lse=None,
                 bint check_finite=False, *, str align="top_left", int64_t window_left=-1,
                 int64_t window_right=-1, const int64_t[::1] seqlen_k=None, double softcap=0, mask=None,
                 int64_t mask_heads=1, double dropout_p=0, uint64_t dropout_seed=0, int64_t dropout_i0=0,
                 int64_t dropout_j0=0, const int64_t[::1] cu_seqlens_q=None,
                 const int64_t[::1] cu_seqlens_k=None, const double[::1] alibi=None,
                 int64_t alibi_seq_stride=0):
    """forward on the bits of bfloat16 or float16 arrays (kind), passed as uint16 views:
    float32 arithmetic inside, out and lse rounded to kind; returns what forward does.
    The features as for forward (flash only; bfloat16 with features runs the
    converting flash on avx512bf16 and amx, not their own kernels)."""
    if algo not in ("tiled", "flash"):
        raise ValueError(f"native.{algo} takes float32 and float64 only; native.tiled and native.flash take {kind}")
    cdef int err, a = ALGORITHMS[algo], i = ISAS.index(isa), h = HALF_KINDS[kind], bad = 0
    cdef attn_problem p = _problem(q, k, v, causal, scale, block_q, block_k, num_threads, f"{algo} forward",
                                   align, window_left, window_right, seqlen_k, softcap)
    _extras(&p, mask, mask_heads, dropout_p, dropout_seed, dropout_i0, dropout_j0, cu_seqlens_q, cu_seqlens_k, alibi,
            alibi_seq_stride)
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
        _raise(err, f"native.{algo}", &p, a, isa, "" if algo == "flash" else "; native.flash needs no N x N buffer")
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
             int block_q, int block_k, int num_threads, *, str align="top_left", int64_t window_left=-1,
             int64_t window_right=-1, const int64_t[::1] seqlen_k=None, double softcap=0, mask=None,
             int64_t mask_heads=1, double dropout_p=0, uint64_t dropout_seed=0, int64_t dropout_i0=0,
             int64_t dropout_j0=0, const int64_t[::1] cu_seqlens_q=None,
             const int64_t[::1] cu_seqlens_k=None, const double[::1] alibi=None,
             int64_t alibi_seq_stride=0):
    """dq, dk, dv[...] = the gradients of sum(out * dout), from the forward's out and lse,
    for the problem forward ran (the same features); dk and dv have k's rows, each
    the sum over its query rows (in their order, on one thread)."""
    cdef int err, i = ISAS.index(isa)
    cdef attn_problem p = _problem(q, k, v, causal, scale, block_q, block_k, num_threads, "backward",
                                   align, window_left, window_right, seqlen_k, softcap)
    _extras(&p, mask, mask_heads, dropout_p, dropout_seed, dropout_i0, dropout_j0, cu_seqlens_q, cu_seqlens_k, alibi,
            alibi_seq_stride)
    cdef int64_t batch_kv = k.shape[0]
    if ((out.shape[0], out.shape[1], out.shape[2]) != (p.batch, p.nq, p.dv)
            or (dout.shape[0], dout.shape[1], dout.shape[2]) != (p.batch, p.nq, p.dv)
            or (lse.shape[0], lse.shape[1]) != (p.batch, p.nq)
            or (dq.shape[0], dq.shape[1], dq.shape[2]) != (p.batch, p.nq, p.d)
            or (dk.shape[0], dk.shape[1], dk.shape[2]) != (batch_kv, p.nk, p.d)
            or (dv.shape[0], dv.shape[1], dv.shape[2]) != (batch_kv, p.nk, p.dv)):
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
        _raise(err, "native.flash backward", &p, ALGORITHMS["flash"], isa)


def backward_half(str isa, str kind, const uint16_t[:, :, ::1] q, const uint16_t[:, :, ::1] k,
                  const uint16_t[:, :, ::1] v, const uint16_t[:, :, ::1] out, const uint16_t[:, :, ::1] dout,
                  const float[:, ::1] lse, uint16_t[:, :, ::1] dq, uint16_t[:, :, ::1] dk, uint16_t[:, :, ::1] dv,
                  bint causal, double scale, int block_q, int block_k, int num_threads, *, str align="top_left",
                  int64_t window_left=-1, int64_t window_right=-1, const int64_t[::1] seqlen_k=None,
                  double softcap=0, mask=None, int64_t mask_heads=1, double dropout_p=0, uint64_t dropout_seed=0,
                  int64_t dropout_i0=0, int64_t dropout_j0=0, const int64_t[::1] cu_seqlens_q=None,
                  const int64_t[::1] cu_seqlens_k=None, const double[::1] alibi=None,
                  int64_t alibi_seq_stride=0):
    """backward on the bits of bfloat16 or float16 arrays (kind), passed as uint16 views,
    with a float32 lse (None: out is q, k, v's own output): float32 arithmetic inside, the
    rows' lse recomputed in float32 where the given one is it rounded to kind (attn.h),
    dq, dk, dv rounded to kind."""
    cdef int err, i = ISAS.index(isa), h = HALF_KINDS[kind]
    cdef attn_problem p = _problem(q, k, v, causal, scale, block_q, block_k, num_threads, "backward",
                                   align, window_left, window_right, seqlen_k, softcap)
    _extras(&p, mask, mask_heads, dropout_p, dropout_seed, dropout_i0, dropout_j0, cu_seqlens_q, cu_seqlens_k, alibi,
            alibi_seq_stride)
    cdef int64_t batch_kv = k.shape[0]
    if ((out.shape[0], out.shape[1], out.shape[2]) != (p.batch, p.nq, p.dv)
            or (dout.shape[0], dout.shape[1], dout.shape[2]) != (p.batch, p.nq, p.dv)
            or (lse is not None and (lse.shape[0], lse.shape[1]) != (p.batch, p.nq))
            or (dq.shape[0], dq.shape[1], dq.shape[2]) != (p.batch, p.nq, p.d)
            or (dk.shape[0], dk.shape[1], dk.shape[2]) != (batch_kv, p.nk, p.d)
            or (dv.shape[0], dv.shape[1], dv.shape[2]) != (batch_kv, p.nk, p.dv)):
        raise ValueError("native backward: inconsistent shapes")
    cdef const uint16_t *qp = &q[0, 0, 0] if q.size else NULL
    cdef const uint16_t *kp = &k[0, 0, 0] if k.size else NULL
    cdef const uint16_t *vp = &v[0, 0, 0] if v.size else NULL
    cdef const uint16_t *op = &out[0, 0, 0] if out.size else NULL
    cdef const uint16_t *dop = &dout[0, 0, 0] if dout.size else NULL
    cdef float dummy = 0
    cdef const float *lp = NULL if lse is None else (&lse[0, 0] if lse.size else &dummy)
    cdef uint16_t *dqp = &dq[0, 0, 0] if dq.size else NULL
    cdef uint16_t *dkp = &dk[0, 0, 0] if dk.size else NULL
    cdef uint16_t *dvp = &dv[0, 0, 0] if dv.size else NULL
    with nogil:
        err = attn_backward_half(i, h, &p, qp, kp, vp, op, dop, lp, dqp, dkp, dvp)
    if err != ATTN_OK:
        _raise(err, "native.flash backward", &p, ALGORITHMS["flash"], isa)


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
    """Seconds of one STREAM pass over len(a) floats: op "copy" (a = b), "triad" (a = b + 3 c) or
    "read" (b summed, each thread's sum in a[thread]: the read-only stream a decode makes)."""
    import time
    if op not in ("copy", "triad", "read"):
        raise ValueError(f"stream: op is 'copy', 'triad' or 'read', got {op!r}")
    if not (a.shape[0] == b.shape[0] == c.shape[0]) or not 1 <= num_threads <= ATTN_MAX_THREADS:
        raise ValueError("stream: a, b, c must have one length, and 1 <= num_threads <= the maximum")
    cdef int o = {"copy": 0, "triad": 1, "read": 2}[op]
    cdef int64_t n = a.shape[0]
    t0 = time.perf_counter()
    with nogil:
        attn_stream(o, &a[0] if n else NULL, &b[0] if n else NULL, &c[0] if n else NULL, n, num_threads)
    return time.perf_counter() - t0
