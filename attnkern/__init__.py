"""attnkern: scaled-dot-product attention kernels, softmax(Q K^T * scale) V.

    out = attnkern.attention(q, k, v, causal=False, scale=None, kernel="auto", **params)
    # features: k, v with fewer heads (GQA), causal="bottom_right", window=(left, right),
    # key_lengths=[...], softcap=c (docs/features.md)
    attnkern.attention_backward(q, k, v, out, dout, lse)  # (dq, dk, dv)
    # attn_mask=, dropout_p=/dropout_seed=, alibi_slopes=; packed sequences: attention_varlen(_backward)
    attnkern.reference(q, k, v)   # float64 NumPy oracle; reference_backward: its gradients
    attnkern.kernels()            # every kernel name
    attnkern.kernel_info(name)    # available here? tunables?
    attnkern.threads_used(name)   # threads its last call ran on, read back from it
    attnkern.tune(q_shape)        # search a kernel's tunables on this machine, cached for attention()
    attnkern.sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)   # torch's SDPA, drop-in
    attnkern.flash_attn_func(q, k, v, ...), flash_attn_varlen_func(...)       # FlashAttention's, drop-in
    # torch tensors run through the custom ops torch.ops.attnkern.attention / attention_backward
    # (torch.compile, autocast); attnkern.integrations.transformers.register(): attn_implementation
"""

from . import backends  # noqa: F401  (registers the kernels)
from ._api import attention, attention_backward, attention_varlen, attention_varlen_backward, kernel_info
from ._dropin import flash_attn_func, flash_attn_varlen_func, sdpa
from ._fp8 import Fp8Inputs, hadamard_matrix, quantize_fp8
from ._reference import reference, reference_backward
from ._registry import kernels, threads_used
from ._version import __version__  # noqa: F401  (re-exported)
from .backends.native import active_isa, supported_isas


def machine(device: str = "cpu") -> dict:
    """What measurements on this machine depend on: {cpu (model name), isa (the native
    kernels' instruction set), cpus (available to this process), version}, and for
    device="cuda" also {gpu}. Tuned results are cached under it."""
    from . import _tuned

    return _tuned.machine(device)


def cache_dir():
    """attnkern's directory in the user cache ($ATTNKERN_CACHE_DIR, else the platform's
    convention): tuned parameters, captured inputs."""
    from . import _tuned

    return _tuned.cache_dir()


def tune(q_shape, k_shape=None, *, kernel="native.flash", dtype="float32", causal=False, budget=None, seed=0,
         **options):
    """Searches `kernel`'s tunables (block sizes, threads; cuda.flash's tiles) for
    q of shape q_shape (and k of k_shape) on this machine, and caches the result
    for attention() to use. Returns a result with .params, .seconds, .trials,
    .history, .default_seconds and .speedup. Options of the search: repeats,
    cache (False: only report), measure (a custom measure(params, n)), progress
    (a function taking a line of text), max_error (a bound on the absolute error
    against the float64 reference under which fastmath=1 may be chosen; without
    it fastmath stays 0). Needs Optuna (pip install 'attnkern[tune]').
    See attnkern.tuning."""
    from .tuning import tune as search

    return search(q_shape, k_shape, kernel=kernel, dtype=dtype, causal=causal, budget=budget, seed=seed, **options)


__all__ = ["attention", "attention_backward", "attention_varlen", "attention_varlen_backward", "reference",
           "reference_backward", "kernels", "kernel_info", "active_isa", "supported_isas", "machine", "tune", "cache_dir",
           "threads_used", "sdpa", "flash_attn_func", "flash_attn_varlen_func", "quantize_fp8",
           "hadamard_matrix", "Fp8Inputs"]
