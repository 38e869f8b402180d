"""The kernel registry, the bottom layer: one entry per kernel, with its tunables,
whether it can run here and what it supports (device, dtypes, head sizes, the
log-sum-exp, a backward, the attention features of FEATURES), as data the core reads before it runs one: a kernel
that refuses a call says why (Kernel.not_supported_reasons), and a refusal
lists every kernel's reasons. Kernels receive validated, C-contiguous
(batch, n, d) arrays."""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass, field
from typing import Callable


def cpu_count() -> int:
    """CPUs this process may run on (respects affinity masks and cgroups' cpusets)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


# The features a call may need beyond plain (optionally top-left causal) attention,
# with the words a refusal uses for each; a kernel lists those it has (Kernel.features).
FEATURES = {
    "gqa": "grouped-query attention (k and v with fewer heads than q)",
    "bottom_right": "bottom-right causal alignment (causal='bottom_right' with Nq != Nk or key_lengths)",
    "window": "a sliding window (window=)",
    "key_lengths": "key padding (key_lengths=)",
    "softcap": "a logit softcap (softcap=)",
    "mask": "an attention mask (attn_mask=, boolean or additive)",
    "dropout": "dropout on the probabilities (dropout_p > 0)",
    "alibi": "ALiBi slopes (alibi_slopes=)",
    "varlen": "packed variable-length sequences in one call (attention_varlen; kernels without it run them "
              "one sequence at a time)",
}
ALL_FEATURES = frozenset(FEATURES)


@dataclass(frozen=True)
class Features:
    """What a validated call asks beyond plain attention, in the form kernels take
    (attn.h's attn_problem): k/v rows shared by kv_group query rows; the diagonal of
    the causal and window masks top-left (query i's own key is i) or bottom-right
    (i + len - nq, len the row's key length); window sides as key counts, -1 for
    unbounded (each at most nq + nk, beyond which a bound masks nothing); one key
    length per sequence (int64, None: every key), shared by the batch / len rows of
    a sequence; a softcap c > 0 (0: none); an attention mask (mask: a 4-D array
    (B or 1, H or 1, nq or 1, nk or 1) of bool, True = take part, or of floats
    added to the scores, read through np.broadcast_to; the folded batch row b is
    (b // mask_heads, b % mask_heads)); dropout with probability dropout_p
    (0: none) from the counter-based RNG keyed by dropout_seed (attnkern.philox:
    the counters are (row, query + dropout_offset[0], key + dropout_offset[1]),
    the offsets placing a varlen sequence's block in its packed arrays); packed
    varlen sequences (cu_seqlens_q/k, int64 offsets: the arrays then hold sequence
    after sequence, each a (heads, len, d) block, attn.h's varlen layout); ALiBi
    (alibi: a slope per folded query row, -slope |i + len - nq - j| added to the
    scores, FlashAttention's). The core
    passes one to a kernel's run and backward as features= only where needs() is
    not empty."""

    kv_group: int = 1
    align: str = "top_left"
    window_left: int = -1
    window_right: int = -1
    key_lengths: object = None  # np.ndarray of int64, or None
    softcap: float = 0.0
    mask: object = None  # np.ndarray, 4-D, broadcastable to (batch // mask_heads, mask_heads, nq, nk)
    mask_heads: int = 1
    dropout_p: float = 0.0
    dropout_seed: int = 0
    dropout_offset: tuple = (0, 0)
    cu_seqlens_q: object = None  # varlen: np.ndarray of int64 offsets (attn.h's layout), or None
    cu_seqlens_k: object = None
    alibi: object = None  # np.ndarray of float64: one ALiBi slope per folded query row (varlen: per sequence)
    alibi_seq_stride: int = 0

    def mask_rows(self, rows: slice, nq_sel, dtype) -> "np.ndarray":
        """The additive mask (float, -inf where a bool mask is False) of the folded
        batch rows `rows`, (len(rows), nq, nk) or for selected query positions
        nq_sel (an index array) (len(rows), len(nq_sel), nk), materialised."""
        import numpy as np

        m, heads = self.mask, self.mask_heads
        b = np.arange(rows.start, rows.stop)
        zero = np.zeros_like(b)
        sel = m[b // heads if m.shape[0] > 1 else zero, b % heads if m.shape[1] > 1 else zero]
        if nq_sel is not None and sel.shape[1] > 1:
            sel = sel[:, nq_sel]
        if sel.dtype == np.bool_:
            sel = np.where(sel, 0, -np.inf)
        return sel.astype(dtype, copy=False)

    def sequences(self, batch: int, batch_kv: int, nk: int) -> list[tuple[slice, slice, int]]:
        """(query rows, k/v rows, key length) of each sequence of (batch, n, d) q and
        (batch_kv, nk, d) k: one per key length (the rows of a sequence are
        consecutive), or one spanning every row without key lengths."""
        lengths = [nk] if self.key_lengths is None else [int(n) for n in self.key_lengths]
        rows, kv_rows = batch // max(1, len(lengths)), batch_kv // max(1, len(lengths))
        return [(slice(s * rows, (s + 1) * rows), slice(s * kv_rows, (s + 1) * kv_rows), n)
                for s, n in enumerate(lengths)]

    def needs(self) -> frozenset[str]:
        """The names (FEATURES) of what this asks for."""
        asked = {"gqa": self.kv_group > 1, "bottom_right": self.align == "bottom_right",
                 "window": self.window_left >= 0 or self.window_right >= 0,
                 "key_lengths": self.key_lengths is not None, "softcap": self.softcap > 0,
                 "mask": self.mask is not None, "dropout": self.dropout_p > 0,
                 "varlen": self.cu_seqlens_q is not None, "alibi": self.alibi is not None}
        return frozenset(name for name, on in asked.items() if on)


PLAIN = Features()


def describe_features(names) -> str:
    """Feature names in words, in FEATURES' order."""
    return ", ".join(FEATURES[n] for n in FEATURES if n in names)


@dataclass(frozen=True)
class Param:
    """An integer tunable with an inclusive allowed range, and optionally a set
    of allowed values within it (for kernels compiled per tile shape)."""

    name: str
    default: int | Callable[[], int]
    low: int
    high: int
    doc: str
    choices: tuple[int, ...] | None = None
    # an on/off switch: takes True/False as well as 0/1 (stored as 0/1); other tunables refuse bools
    switch: bool = False

    def default_value(self) -> int:
        return self.default() if callable(self.default) else self.default

    def check(self, kernel: str, value) -> int:
        if self.switch and (isinstance(value, bool) or type(value).__name__ in ("bool", "bool_")):  # NumPy's too
            return int(value)
        try:
            if isinstance(value, bool):
                raise TypeError
            value = operator.index(value)  # ints and NumPy integers, not floats
        except TypeError:
            what = "True/False or 0/1" if self.switch else f"an integer in [{self.low}, {self.high}]"
            raise TypeError(f"{kernel}: {self.name} must be {what}, got {value!r} of type {type(value).__name__}") \
                from None
        if self.choices is not None and value not in self.choices:
            raise ValueError(
                f"{kernel}: {self.name}={value} is not allowed; choose one of "
                f"{', '.join(map(str, self.choices))} ({self.doc})"
            )
        if not self.low <= value <= self.high:
            raise ValueError(
                f"{kernel}: {self.name}={value} is out of range; allowed: "
                f"{self.low} <= {self.name} <= {self.high} ({self.doc})"
            )
        return value


@dataclass(frozen=True)
class SearchSpace:
    """A kernel's own tuning lattice for one problem, where the generic one (powers
    of two within each tunable's range, attnkern.tuning.space) does not fit: the
    values of each tunable, the configuration the kernel runs by default, and which
    combinations it runs (None: all)."""

    lattice: dict
    default: dict
    valid: Callable[[dict], bool] | None = None


@dataclass(frozen=True)
class Kernel:
    name: str
    description: str
    # run(q, k, v, causal, scale, **params) -> out, on (batch, n, d) arrays; device="cuda"
    # kernels also take out=, a (batch, n, dv) GPU array that attention() allocated
    run: Callable
    params: tuple[Param, ...] = ()
    # returns None when the kernel can run here, else the reason it cannot
    unavailable_reason: Callable[[], str | None] = field(default=lambda: None)
    # "cpu": takes NumPy arrays; "cuda": NumPy arrays (copied there and back) or GPU arrays
    device: str = "cpu"
    # run() also takes lse=, a (batch, nq) array of the output's dtype (a GPU array for
    # "cuda" kernels) that it fills with each query row's natural-log log-sum-exp of the
    # scaled, masked scores
    returns_lse: bool = False
    # backward(q, k, v, out, dout, lse, causal, scale, **params) -> (dq, dk, dv) on
    # (batch, n, d) arrays, lse from run(); "cuda" kernels take dq=, dk=, dv= GPU arrays
    # to fill (allocated by the caller) and return them. None: no backward.
    backward: Callable | None = None
    # the input dtypes the backward takes, where there is one (the forward may take more:
    # native.flash and cuda.flash compute float16/bfloat16 forwards, not their gradients)
    backward_dtypes: tuple[str, ...] = ("float32", "float64")
    # the input dtypes it computes in (names as NumPy spells them; "bfloat16" is
    # ml_dtypes.bfloat16 on the host, torch.bfloat16 for tensors)
    dtypes: tuple[str, ...] = ("float32", "float64")
    # run() also takes check_finite=; with it the kernel checks q, k, v and its output
    # itself (as it reads and writes them) and raises nonfinite_input/nonfinite_output,
    # so attention(check_finite=True) does not scan the arrays again
    checks_finite: bool = False
    # () -> the number of threads the last call of this kernel from the calling Python
    # thread ran on, read back from the kernel or its runtime (not the number asked
    # for), or None where it cannot be read
    threads_used: Callable[[], int | None] = field(default=lambda: None)
    # head_sizes(d, dv, dtype) -> None where it takes q/k of feature size d and v of dv in
    # that dtype, else the reason it does not; None: every head size
    head_sizes: Callable[[int, int, str], str | None] | None = None
    # search_space(nq, nk, d, dv, itemsize) -> SearchSpace: the tuner's lattice for this
    # kernel, where the generic one does not fit; None: the generic one
    search_space: Callable[[int, int, int, int, int], SearchSpace] | None = None
    # the names (FEATURES) of the features run() takes, as features= (a Features);
    # backward_features: those its backward takes (None: the same as the forward's)
    features: frozenset[str] = frozenset()
    backward_features: frozenset[str] | None = None
    # feature name -> the only dtypes in which it has that feature (forward and backward);
    # a feature not named here it has in every dtype it takes
    feature_dtypes: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def features_in(self, dtype: str | None) -> frozenset[str]:
        """The features its forward has for inputs of dtype (None: in some dtype)."""
        if dtype is None or not self.feature_dtypes:  # the common case: no per-dtype limits
            return self.features
        return frozenset(f for f in self.features if dtype in self.feature_dtypes.get(f, (dtype,)))

    def features_of_backward(self) -> frozenset[str]:
        """The features its backward takes (none without a backward)."""
        if self.backward is None:
            return frozenset()
        return self.features if self.backward_features is None else self.backward_features

    def not_supported_reasons(self, *, device: bool = False, dtype: str | None = None, d: int | None = None,
                              dv: int | None = None, return_lse: bool = False, backward: bool = False,
                              features: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
        """Why this kernel cannot run a call, as (what, reason) pairs, [] when it can:
        what is one of "device" (GPU arrays to a CPU kernel), "available" (not here),
        "dtype", "head_size", "lse", "backward", "features". device: the inputs are
        GPU arrays; dtype, d, dv: the inputs' (None: not asked); return_lse, backward,
        features (names of FEATURES): what the call needs."""
        reasons = []
        if device and self.device != "cuda":
            reasons.append(("device", "runs on the CPU and q, k, v are GPU arrays"))
        unavailable = self.unavailable_reason()
        if unavailable is not None:
            reasons.append(("available", unavailable))
        if dtype is not None and dtype not in self.dtypes:
            reasons.append(("dtype", f"does not take {dtype} (it takes {', '.join(self.dtypes)})"))
        elif dtype is not None and d is not None and self.head_sizes is not None and unavailable is None:
            why = self.head_sizes(d, dv if dv is not None else d, dtype)
            if why is not None:
                reasons.append(("head_size", why))
        if return_lse and not self.returns_lse:
            reasons.append(("lse", "cannot return the log-sum-exp"))
        if backward and self.backward is None:
            reasons.append(("backward", "has no backward pass"))
        missing = features - self.features
        limited = (features & self.features) - self.features_in(dtype)
        if missing:
            reasons.append(("features", f"does not support {describe_features(missing)}"))
        elif limited:
            only = "; ".join(f"{FEATURES[f]} only in {', '.join(self.feature_dtypes[f])}" for f in FEATURES
                             if f in limited)
            reasons.append(("features", f"does not support {describe_features(limited)} in {dtype} (it has {only})"))
        elif backward and self.backward is not None and features - self.features_of_backward():
            missing = features - self.features_of_backward()
            reasons.append(("features", f"its backward does not support {describe_features(missing)}"))
        return reasons

    def resolve_params(self, given: dict) -> dict:
        known = {p.name: p for p in self.params}
        unknown = sorted(set(given) - set(known))
        if unknown:
            takes = ", ".join(known) if known else "no tunable parameters"
            raise TypeError(f"{self.name} does not take {', '.join(map(repr, unknown))}; it takes {takes}")
        return {
            name: p.check(self.name, given[name]) if name in given else p.default_value()
            for name, p in known.items()
        }


_KERNELS: dict[str, Kernel] = {}


def register(kernel: Kernel) -> Kernel:
    if kernel.name in _KERNELS:
        raise ValueError(f"kernel {kernel.name!r} is registered twice")
    _KERNELS[kernel.name] = kernel
    return kernel


def get(name) -> Kernel:
    if not isinstance(name, str) or name not in _KERNELS:
        raise ValueError(f"unknown kernel {name!r}; choose 'auto' or one of: {', '.join(_KERNELS)}")
    return _KERNELS[name]


def with_feature(feature: str) -> list[str]:
    """Names of the kernels with returns_lse or backward, with a feature of FEATURES,
    or that take dtype feature ("float16", ...), for error messages."""
    if feature in FEATURES:
        has = lambda k: feature in k.features  # noqa: E731
    elif feature == "backward":
        has = lambda k: k.backward is not None  # noqa: E731
    elif feature == "returns_lse":
        has = lambda k: k.returns_lse  # noqa: E731
    else:
        has = lambda k: feature in k.dtypes  # noqa: E731
    return [name for name, k in _KERNELS.items() if has(k)]


def supporting(features: frozenset[str], backward: bool = False, dtype: str | None = None) -> list[str]:
    """Names of the kernels that take all of features (FEATURES' names), forward and,
    with backward, backward too, and with dtype in that dtype; for error messages."""
    return [name for name, k in _KERNELS.items()
            if features <= k.features_in(dtype) and (not backward or features <= k.features_of_backward())
            and (dtype is None or dtype in k.dtypes)]


def kernels() -> tuple[str, ...]:
    """Names of all kernels, available on this machine or not."""
    return tuple(_KERNELS)


def all_kernels() -> tuple[Kernel, ...]:
    """Every registered kernel, in registration order."""
    return tuple(_KERNELS.values())


def threads_used(name: str) -> int | None:
    """The number of threads the last call of kernel `name` from this Python thread
    ran on, as the kernel or its runtime reports it: the native kernels' OpenMP team
    size, torch's intra-op thread count during the call, Numba's thread count during
    the call, the BLAS pool size for numpy.naive. None where it cannot be read (a GPU
    kernel, or no call yet). A measurement that asked for N threads and reads back
    fewer ran slower than it claims."""
    return get(name).threads_used()


def nonfinite_input(name: str) -> ValueError:
    """attention(check_finite=True)'s error for an input holding NaN or infinity."""
    return ValueError(f"{name} contains NaN or infinity; pass finite values (or check_finite=False)")


def nonfinite_output(kernel: str, dtype) -> FloatingPointError:
    """attention(check_finite=True)'s error for finite inputs whose output is not finite."""
    return FloatingPointError(
        f"{kernel} produced non-finite values: q k^T * scale overflows {dtype}; scale the inputs down or use "
        "float64"
    )


def param_info(p: Param) -> dict:
    info = {"default": p.default_value(), "min": p.low, "max": p.high, "doc": p.doc}
    if p.choices is not None:
        info["choices"] = list(p.choices)
    if p.switch:
        info["switch"] = True
    return info


def num_threads_param(high: int) -> Param:
    return Param("num_threads", cpu_count, 1, high, "threads; default: the CPUs this process may use")
