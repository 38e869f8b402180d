"""Forward and forward+backward time of the attention features (docs/features.md):
native.flash through attnkern.attention's keywords, torch beside it doing the same
work, and numpy.naive (forward only, N <= NAIVE_MAX_N: it materialises the scores).

torch.sdpa here is torch's scaled_dot_product_attention called directly with what
expresses the feature in torch: enable_gqa=True for grouped k/v heads, a boolean
mask for padding, windows and bottom-right causal (none where it would keep every
key), the padded batch with a causal and key-padding mask for packed sequences (the
work torch must do for them), dropout_p; torch has no softcap in SDPA, so for the
softcap it is torch's math path (scores, c tanh(s / c), mask, softmax, P V).

A combination a kernel cannot run is skipped (NotImplementedError in setup): a
feature a commit's kernel_info does not list (masks and dropout came later: their
keyword must exist too; packed sequences need attention_varlen), a backward the
kernel lacks.
In the smoke setting (ATTNKERN_BENCH_SMOKE=1) every class runs at N = 256 or less.
"""

import inspect

import numpy as np

import attnkern

from .common import SMOKE, THREADS, host_dtype, pin_threads, torch

KERNELS = ["native.flash", "torch.sdpa", "numpy.naive"]
DIRECTIONS = ["forward", "forward+backward"]
NAIVE_MAX_N = 2048
H, D = 8, 64
# a feature's names in kernel_info's feature lists, and the keyword or function attnkern
# needs for it (absent in commits before it)
FEATURE_NAMES = {"mask": ("mask", "attn_mask"), "dropout": ("dropout",)}
API_NAMES = {"mask": "attn_mask", "dropout": "dropout_p", "varlen": "attention_varlen"}
# needs only its function: attention_varlen runs each sequence as a call of the kernel (plain, or
# with the window, softcap or dropout asked for), so kernel_info lists no feature for it
API_ONLY = ("varlen",)


def sizes(full: list, smoke):
    """A size axis: all of `full`, or [smoke] in the smoke setting."""
    return [smoke] if SMOKE else full


def _rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _qkv(b, h, nq, nk, h_kv=None):
    return _rand((b, h, nq, D), 0), _rand((b, h_kv or h, nk, D), 1), _rand((b, h_kv or h, nk, D), 2)


def _padding(n):
    """Key lengths of a right-padded batch of 4 sequences of at most n tokens."""
    return np.array([n, 3 * n // 4, n // 2, n // 4])


def _check_kernel(kernel, needs, backward):
    """NotImplementedError (asv's skip) where attnkern's `kernel` cannot run these features."""
    if kernel not in attnkern.kernels():
        raise NotImplementedError(f"{kernel} does not exist in this commit")
    info = attnkern.kernel_info(kernel)
    if not info["available"]:
        raise NotImplementedError(f"{kernel} is not available here: {info['reason']}")
    if backward and not info.get("backward"):
        raise NotImplementedError(f"{kernel} has no backward")
    params = inspect.signature(attnkern.attention).parameters
    have = set(info.get("backward_features" if backward else "features", []))
    for need in needs:
        api = API_NAMES.get(need)
        if api is not None and api not in params and not hasattr(attnkern, api):
            raise NotImplementedError(f"attnkern has no {api} in this commit")
        if need not in API_ONLY and not have & set(FEATURE_NAMES.get(need, (need,))):
            raise NotImplementedError(f"{kernel} does not list {need} in this commit")


class _Feature:
    """setup builds the problem (problem(): inputs and both sides' calls) and the timed
    call; each subclass is one feature, its params [kernel, direction, *its axes]."""

    param_names = ["kernel", "direction"]
    rounds = 2
    repeat = (2, 10, 2.0)
    warmup_time = 0.2
    timeout = 300
    needs = ()

    def problem(self, *args) -> dict:
        """{n: the size the naive limit applies to, ours: (q, k, v) NumPy, kw: attention()'s
        keywords, torch: (q, k, v) NumPy in torch's layout, torch_fn: (q, k, v) -> out,
        and optionally fn: attnkern's function (attention_varlen)}."""
        raise NotImplementedError

    def setup(self, kernel, direction, *args):
        if torch is None:
            raise NotImplementedError("torch is not installed")
        backward = direction == "forward+backward"
        if kernel != "torch.sdpa":
            _check_kernel(kernel, self.needs, backward)
        p = self.problem(*args)
        if kernel == "torch.sdpa":
            fn, host = p["torch_fn"], p["torch"]
        else:
            if kernel == "numpy.naive" and p["n"] > NAIVE_MAX_N:
                raise NotImplementedError(f"numpy.naive only up to N={NAIVE_MAX_N}")
            kw = dict(p["kw"], kernel=kernel)
            if "fn" not in p:  # attention()'s keyword (torch checks nothing either)
                kw["check_finite"] = False
            if "num_threads" in attnkern.kernel_info(kernel)["params"]:
                kw["num_threads"] = THREADS
            if "attn_mask" in kw:
                kw["attn_mask"] = torch.from_numpy(kw["attn_mask"]) if backward else kw["attn_mask"]
            call = p.get("fn", attnkern.attention)
            fn, host = (lambda q, k, v: call(q, k, v, **kw)), p["ours"]
        pin_threads()
        if backward:
            tensors = [torch.from_numpy(x).requires_grad_() for x in host]
            grad = torch.from_numpy(_rand(tuple(fn(*tensors).shape), 3))

            def run():
                for x in tensors:
                    x.grad = None
                fn(*tensors).backward(grad)
        elif kernel == "torch.sdpa":
            tensors = [torch.from_numpy(x) for x in host]

            def run():
                with torch.no_grad():
                    fn(*tensors)
        else:
            def run():
                fn(*host)
        run()  # outside the samples: a failure here is the benchmark's, before any timing
        self.run = run

    def time_features(self, kernel, direction, *args):
        self.run()


def _sdpa(**kw):
    return lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)


def _masked(mask, **kw):
    return _sdpa(attn_mask=torch.from_numpy(np.ascontiguousarray(mask)), **kw)


class GroupedHeads(_Feature):
    """Causal GQA, 8 query heads over kv_heads k/v heads (1: MQA); torch with enable_gqa=True."""

    params = [KERNELS, DIRECTIONS, sizes([2048], 256), [2, 1]]
    param_names = _Feature.param_names + ["n", "kv_heads"]
    needs = ("gqa",)

    def problem(self, n, kv_heads):
        qkv = _qkv(1, H, n, n, kv_heads)
        return {"n": n, "ours": qkv, "kw": {"causal": True}, "torch": qkv,
                "torch_fn": _sdpa(is_causal=True, enable_gqa=True)}


class Masks(_Feature):
    """attn_mask: a boolean key-padding mask (4, 1, 1, N) of 4 sequences of N..N/4 keys, or an
    additive distance bias (1, 1, N, N), -|i - j| / 64; torch with the same mask."""

    params = [KERNELS, DIRECTIONS, sizes([2048], 256), ["bool-padding", "additive"]]
    param_names = _Feature.param_names + ["n", "mask"]
    needs = ("mask",)

    def problem(self, n, mask):
        if mask == "bool-padding":
            lengths = _padding(n)
            qkv = _qkv(len(lengths), H, n, n)
            m = np.arange(n)[None, None, None, :] < lengths[:, None, None, None]
        else:
            qkv = _qkv(1, H, n, n)
            pos = np.arange(n, dtype=np.float32)
            m = -np.abs(pos[:, None] - pos[None, :])[None, None] / np.float32(64)
        return {"n": n, "ours": qkv, "kw": {"attn_mask": m}, "torch": qkv, "torch_fn": _masked(m)}


class KeyLengths(_Feature):
    """key_lengths: 4 right-padded sequences of N, 3N/4, N/2, N/4 keys; torch with the
    boolean key-padding mask."""

    params = [KERNELS, DIRECTIONS, sizes([2048], 256)]
    param_names = _Feature.param_names + ["n"]
    needs = ("key_lengths",)

    def problem(self, n):
        lengths = _padding(n)
        qkv = _qkv(len(lengths), H, n, n)
        keep = np.arange(n)[None, None, None, :] < lengths[:, None, None, None]
        return {"n": n, "ours": qkv, "kw": {"key_lengths": lengths}, "torch": qkv, "torch_fn": _masked(keep)}


class Varlen(_Feature):
    """attention_varlen: 4 sequences of N/2, N/4, N/8, N/8 tokens packed as (N, H, D); torch
    with the padded batch (4, H, N/2, D) and a key-padding (and causal) boolean mask."""

    params = [KERNELS, DIRECTIONS, sizes([2048], 256), [False, True]]
    param_names = _Feature.param_names + ["n", "causal"]
    needs = ("varlen",)

    def problem(self, n, causal):
        lengths = [n // 2, n // 4, n // 8, n - n // 2 - n // 4 - n // 8]
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        packed = tuple(_rand((n, H, D), seed) for seed in range(3))
        longest = max(lengths)
        padded = tuple(np.zeros((len(lengths), H, longest, D), np.float32) for _ in range(3))
        for s, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
            for x, p in zip(packed, padded):
                p[s, :, : hi - lo] = x[lo:hi].transpose(1, 0, 2)
        i = np.arange(longest)
        keep = i[None, None, None, :] < np.array(lengths)[:, None, None, None]
        if causal:
            keep = keep & (i[None, :] <= i[:, None])
        fn = getattr(attnkern, "attention_varlen", None)
        return {"n": n, "ours": packed, "fn": lambda q, k, v, **kw: fn(q, k, v, cu, cu, longest, longest, **kw),
                "kw": {"causal": causal}, "torch": padded, "torch_fn": _masked(keep)}


class SlidingWindow(_Feature):
    """causal=True, window=(W - 1, 0) at (N, W) = (4096, 256), 4 heads (N = 16384 is the
    window study's, attnkern features --window-study);
    torch with a boolean band mask (N x N: all of its scores are computed)."""

    params = [KERNELS, DIRECTIONS, sizes(["4096:256"], "256:64")]
    param_names = _Feature.param_names + ["n_window"]
    needs = ("window",)
    rounds = 1
    repeat = (1, 5, 10.0)  # torch's forward+backward at N = 16384 takes tens of seconds on 2 cores
    timeout = 900

    def problem(self, n_window):
        n, w = (int(x) for x in n_window.split(":"))
        qkv = _qkv(1, 4, n, n)
        i = np.arange(n)
        band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - w)
        return {"n": n, "ours": qkv, "kw": {"causal": True, "window": (w - 1, 0)}, "torch": qkv,
                "torch_fn": _masked(band)}


class KvCache(_Feature):
    """causal="bottom_right": decode (1 query) and chunked prefill (8, 64 queries) over 4096
    cached keys; torch with the boolean bottom-right mask (none for one query)."""

    params = [KERNELS, DIRECTIONS, [1, 8, 64]]
    param_names = _Feature.param_names + ["nq"]
    needs = ("bottom_right",)
    nk = 256 if SMOKE else 4096

    def problem(self, nq):
        qkv = _qkv(1, H, nq, self.nk)
        i, j = np.arange(nq)[:, None], np.arange(self.nk)[None, :]
        theirs = _sdpa() if nq == 1 else _masked(j <= i + self.nk - nq)
        return {"n": self.nk, "ours": qkv, "kw": {"causal": "bottom_right"}, "torch": qkv, "torch_fn": theirs}



class Decode(_Feature):
    """One decode step of a GQA model: 32 query heads, 1 query, over a KV cache of nk keys in
    8 k/v heads, D = 128, float32 or bfloat16 (native.flash's decode path: flash-decoding,
    docs/kernels.md); torch's SDPA with enable_gqa=True in the same dtype. Forward only."""

    params = [KERNELS, DIRECTIONS, sizes([4096, 65536], 256), ["float32", "bfloat16"]]
    param_names = _Feature.param_names + ["nk", "dtype"]
    needs = ("gqa",)

    def setup(self, kernel, direction, nk, dtype):
        if direction != "forward":
            raise NotImplementedError("decode is timed forward only (inference)")
        if kernel != "torch.sdpa" and kernel in attnkern.kernels() and \
                dtype not in attnkern.kernel_info(kernel).get("dtypes", ["float32"]):
            raise NotImplementedError(f"{kernel} has no {dtype}")
        super().setup(kernel, direction, nk, dtype)

    def problem(self, nk, dtype):
        q, k, v = _rand((1, 32, 1, 128), 0), _rand((1, 8, nk, 128), 1), _rand((1, 8, nk, 128), 2)
        tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
        if dtype == "bfloat16":
            q, k, v = (x.astype(host_dtype(dtype)) for x in (q, k, v))
            tq, tk, tv = (x.to(torch.bfloat16) for x in (tq, tk, tv))
        # torch's tensors are made here (NumPy has no bfloat16 torch takes); its call ignores setup's copies
        return {"n": nk, "ours": (q, k, v), "kw": {}, "torch": (np.zeros(1, np.float32),) * 3,
                "torch_fn": lambda *_: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)}

class Softcap(_Feature):
    """causal, softcap=50; torch's math path with the cap (SDPA has none)."""

    params = [KERNELS, DIRECTIONS, sizes([2048], 256)]
    param_names = _Feature.param_names + ["n"]
    needs = ("softcap",)

    def problem(self, n):
        def capped(q, k, v, cap=50.0):
            s = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 / cap)) * cap
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            return torch.matmul(torch.softmax(s, dim=-1), v)

        qkv = _qkv(1, H, n, n)
        return {"n": n, "ours": qkv, "kw": {"causal": True, "softcap": 50.0}, "torch": qkv, "torch_fn": capped}


class Dropout(_Feature):
    """causal, dropout_p=0.1 (a fixed seed); torch's SDPA with dropout_p=0.1."""

    params = [KERNELS, DIRECTIONS, sizes([2048], 256)]
    param_names = _Feature.param_names + ["n"]
    needs = ("dropout",)

    def problem(self, n):
        qkv = _qkv(1, H, n, n)
        return {"n": n, "ours": qkv, "kw": {"causal": True, "dropout_p": 0.1, "dropout_seed": 0}, "torch": qkv,
                "torch_fn": _sdpa(is_causal=True, dropout_p=0.1)}
