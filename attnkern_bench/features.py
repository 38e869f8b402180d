"""attnkern features: native.flash's attention features side by side with torch's
SDPA doing the same work, forward and forward+backward; and the window study
(a sliding window's cost against the sequence length)."""

from __future__ import annotations

import argparse
import csv
import inspect
import json
import platform
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np

import attnkern

from .accuracy import conditioning, tolerance
from .inputs import random_qkv, sample_rows
from .machine import blas_threads, cpu_name, thread_params
from .timing import medians, take_turns

KERNEL = "native.flash"
DIRECTIONS = ("forward", "forward+backward")
CASES = ("gqa", "mqa", "mask-bool", "mask-additive", "key-lengths", "varlen", "window", "decode",
         "decode-gqa", "chunked-prefill", "softcap", "dropout")
# each feature's names in kernel_info's features lists (docs/features.md)
FEATURE_NAMES = {"mask": ("mask", "attn_mask"), "dropout": ("dropout",)}
# the keyword or function attnkern must have for a feature, where older versions lack it
API_NAMES = {"mask": "attn_mask", "dropout": "dropout_p", "varlen": "attention_varlen"}
# needs only its function: attention_varlen runs each sequence as a call of the kernel (plain, or
# with the window, softcap or dropout asked for), so kernel_info lists no feature for it
API_ONLY = ("varlen",)
# what each case needs of native.flash (kernel_info's feature names)
NEEDS = {"gqa": ("gqa",), "mqa": ("gqa",), "mask-bool": ("mask",), "mask-additive": ("mask",),
         "key-lengths": ("key_lengths",), "varlen": ("varlen",), "window": ("window",), "decode": ("bottom_right",),
         "decode-gqa": ("gqa",),
         "chunked-prefill": ("bottom_right",), "softcap": ("softcap",), "dropout": ("dropout",)}

HELP = "native.flash's features (GQA, masks, padding, varlen, windows, KV cache, softcap) against torch"
DESCRIPTION = """\
native.flash with each attention feature beside torch's SDPA doing the same work,
forward and forward+backward (autograd on CPU torch tensors), float32.

Cases, on (B, H, N, D) inputs drawn from a seeded normal distribution:
  gqa, mqa         causal, k and v with --kv-heads (gqa) or 1 (mqa) heads;
                   torch: enable_gqa=True, is_causal=True
  mask-bool        4 right-padded sequences (lengths N, 3N/4, N/2, N/4) as a
                   boolean key-padding mask (4, 1, 1, N); torch: the same mask
  mask-additive    an additive float mask (1, 1, N, N), -|i - j| / 64 (a
                   distance bias); torch: the same mask
  key-lengths      the padded batch of mask-bool as key_lengths=; torch: the
                   boolean key-padding mask
  varlen           4 causal sequences of N/2, N/4, N/8, N/8 tokens packed as
                   (N, H, D) through attention_varlen; torch: the padded batch
                   (4, H, N/2, D) with a causal and key-padding boolean mask,
                   the work torch must do for it
  window           causal=True, window=(W - 1, 0), W = --window; torch: a
                   boolean band mask (N, N)
  decode           1 query over --cache cached keys, causal="bottom_right";
                   torch: no mask (the one query sees every key)
  decode-gqa       1 query over --cache cached keys, k and v with --kv-heads
                   heads (native.flash's decode path); torch: enable_gqa=True
  chunked-prefill  --chunk queries over --cache cached keys,
                   causal="bottom_right"; torch: the boolean bottom-right mask
                   (chunk, cache)
  softcap          causal, softcap=50; torch's SDPA has no softcap: its math
                   path in torch ops (scores, c tanh(s / c), mask, softmax, P V)
  dropout          causal, dropout_p=0.1; torch: SDPA with dropout_p=0.1
A case attnkern cannot run (a feature this version lacks: masks, varlen and
dropout came later) is listed as skipped with the reason.

check   before timing, each side's output on --check-rows sampled query rows
        against the float64 reference of the same problem (attnkern.reference
        with the same features; per sequence for varlen; NumPy for the
        additive mask): error = max|out - ref| / (max(1, max|v|) kappa), ok
        within the float32 bound of attnkern_bench.accuracy. torch's rows are
        checked too (its mask must express the feature), except with dropout
        (its random numbers are not ours). Exit status 1 if a check fails.
time    ours and torch take turns (attnkern bench's timing: --passes
        round-robin passes, each turn a --settle pause, an untimed call and
        --repeat timed calls), both on --threads threads; forward under
        torch.no_grad(), forward+backward as out.backward(grad).
Reported: the median time of each, and ratio = torch / ours (above 1: ours
is faster).

--window-study: instead, native.flash forward with causal=True and
window=(W - 1, 0) (W = --study-window) beside full causal attention at each
N of --study-sizes, paired turns at each N: time / (B H N W) stays about flat
as N grows (a window costs O(N W)) while full causal's time / (B H N^2 / 2)
does (O(N^2)), so their ratio grows about linearly in N.
"""


def configure(p: argparse.ArgumentParser) -> None:
    """The arguments of `attnkern features`."""
    p.add_argument("--n", type=int, default=2048, help="sequence length N (default 2048)")
    p.add_argument("--batch", type=int, default=1, help="batch B of the cases without padding (default 1)")
    p.add_argument("--heads", type=int, default=8, help="query heads H (default 8)")
    p.add_argument("--kv-heads", type=int, default=2, help="k/v heads of the gqa case (default 2)")
    p.add_argument("--dim", type=int, default=64, help="head size D (default 64)")
    p.add_argument("--window", type=int, default=256, help="keys W of the window case (default 256)")
    p.add_argument("--chunk", type=int, default=64, help="queries of the chunked-prefill case (default 64)")
    p.add_argument("--cache", type=int, default=4096, help="cached keys of decode and chunked-prefill (default 4096)")
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), metavar="CASE",
                   help="the cases to run (default all: " + " ".join(CASES) + ")")
    p.add_argument("--directions", nargs="+", choices=DIRECTIONS, default=list(DIRECTIONS))
    p.add_argument("--threads", type=int, default=2, help="threads of both sides")
    p.add_argument("--repeat", type=int, default=3, help="timed calls per turn")
    p.add_argument("--passes", type=int, default=2, help="round-robin passes")
    p.add_argument("--settle", type=float, default=1.0, help="seconds of pause before each turn")
    p.add_argument("--check-rows", type=int, default=32, help="query rows per sequence checked against float64")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window-study", action="store_true", help="run the window study instead of the cases")
    p.add_argument("--study-sizes", type=int, nargs="+", default=[2048, 4096, 8192, 16384],
                   help="N of the window study (default 2048 4096 8192 16384)")
    p.add_argument("--study-window", type=int, default=1024, help="W of the window study (default 1024)")
    p.add_argument("--study-heads", type=int, default=8, help="heads of the window study (default 8)")
    p.add_argument("--json", help="write the rows to this JSON file")
    p.add_argument("--csv", help="write the rows to this CSV file")


# ------------------------------------------------------------------ the cases


@dataclass
class Case:
    """One feature problem, expressed twice: attnkern's call and torch's doing the same work."""

    name: str
    shape: str  # the problem, in words
    torch_path: str  # how torch does it
    ours: Callable  # (q, k, v) torch tensors -> out
    ours_in: tuple  # q, k, v as NumPy arrays
    torch: Callable
    torch_in: tuple
    ours_error: Callable  # out (NumPy) -> scaled error against float64
    torch_error: Callable | None  # None: not checkable (dropout)


def _sdpa(**kw) -> Callable:
    import torch

    return lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)


def _err(out_rows, ref_rows, q, k, v, scale) -> float:
    """max|out - ref| / (max(1, max|v|) kappa) (attnkern_bench.accuracy's measure)."""
    out_rows = np.asarray(out_rows, np.float64)
    if not np.isfinite(out_rows).all():
        return float("inf")
    per = max(1.0, float(np.abs(v).max(initial=0.0))) * conditioning(q, k, scale)
    return float(np.abs(out_rows - ref_rows).max(initial=0.0) / per)


def _ref_check(q, k, v, rows, scale, **features) -> Callable:
    """out -> its error on `rows` against attnkern.reference with the same features."""
    ref = attnkern.reference(q, k, v, scale=scale, rows=rows, **features)
    return lambda out: _err(np.asarray(out)[..., rows, :], ref, q, k, v, scale)


def _padding(n: int) -> np.ndarray:
    return np.array([n, 3 * n // 4, n // 2, n // 4])


def build(name: str, a, rng) -> Case:
    """The case `name` at the settings of `a` (configure's arguments), inputs from rng."""
    b, h, n, d = a.batch, a.heads, a.n, a.dim
    scale = d**-0.5
    rows = sample_rows(rng, n, a.check_rows)
    ours_kw = thread_params(KERNEL, a.threads)

    def ours(**kw):
        if "attn_mask" in kw:  # beside torch tensors, as a torch tensor (shared memory, no copy)
            import torch

            kw["attn_mask"] = torch.from_numpy(kw["attn_mask"])
        return lambda q, k, v: attnkern.attention(q, k, v, scale=scale, kernel=KERNEL, check_finite=False,
                                                  **kw, **ours_kw)

    def qkv(lead, nq=n, nk=n, kv_lead=None):
        q = random_qkv(rng.integers(2**32), lead, nq, nk, d)[0]
        _, k, v = random_qkv(rng.integers(2**32), kv_lead or lead, nq, nk, d)
        return q, k, v

    if name in ("gqa", "mqa"):
        hkv = a.kv_heads if name == "gqa" else 1
        q, k, v = qkv((b, h), kv_lead=(b, hkv))
        check = _ref_check(q, k, v, rows, scale, causal=True)
        return Case(name, f"({b}, {h}, {n}, {d}), k/v {hkv} heads, causal", "sdpa enable_gqa, is_causal",
                    ours(causal=True), (q, k, v), _sdpa(is_causal=True, enable_gqa=True, scale=scale), (q, k, v),
                    check, check)
    if name in ("mask-bool", "key-lengths"):
        lengths = _padding(n)
        q, k, v = qkv((len(lengths), h))
        keep = np.arange(n)[None, None, None, :] < lengths[:, None, None, None]  # (4, 1, 1, N)
        check = _ref_check(q, k, v, rows, scale, key_lengths=lengths)
        kw = {"attn_mask": keep} if name == "mask-bool" else {"key_lengths": lengths}
        return Case(name, f"({len(lengths)}, {h}, {n}, {d}), key lengths {'/'.join(map(str, lengths))}",
                    "sdpa + boolean key-padding mask", ours(**kw), (q, k, v), _torch_masked(keep, scale), (q, k, v),
                    check, check)
    if name == "mask-additive":
        q, k, v = qkv((b, h))
        pos = np.arange(n, dtype=np.float32)
        bias = -np.abs(pos[:, None] - pos[None, :])[None, None] / np.float32(64)  # (1, 1, N, N)
        ref = _masked_reference(q, k, v, bias, rows, scale)
        check = lambda out: _err(np.asarray(out)[..., rows, :], ref, q, k, v, scale)  # noqa: E731
        return Case(name, f"({b}, {h}, {n}, {d}), additive mask (1, 1, {n}, {n})",
                    "sdpa + the same additive mask", ours(attn_mask=bias), (q, k, v), _torch_masked(bias, scale),
                    (q, k, v), check, check)
    if name == "varlen":
        return _varlen(a, rng, scale, ours_kw)
    if name == "window":
        q, k, v = qkv((b, h))
        w = a.window
        i = np.arange(n)
        band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - w)
        check = _ref_check(q, k, v, rows, scale, causal=True, window=(w - 1, 0))
        return Case(name, f"({b}, {h}, {n}, {d}), causal window of {w} keys", "sdpa + boolean band mask",
                    ours(causal=True, window=(w - 1, 0)), (q, k, v), _torch_masked(band, scale), (q, k, v),
                    check, check)
    if name == "decode-gqa":
        q, _, _ = qkv((b, h), nq=1, nk=a.cache)
        _, k, v = qkv((b, a.kv_heads), nq=1, nk=a.cache)
        check = _ref_check(q, k, v, [0], scale)
        return Case(name, f"({b}, {h}, 1 over {a.cache}, {d}), k/v {a.kv_heads} heads", "sdpa enable_gqa, no mask",
                    ours(), (q, k, v), _sdpa(enable_gqa=True, scale=scale), (q, k, v), check, check)
    if name in ("decode", "chunked-prefill"):
        nq, n = (1 if name == "decode" else a.chunk), a.cache
        q, k, v = qkv((b, h), nq=nq, nk=n)
        r = sample_rows(rng, nq, a.check_rows)
        check = _ref_check(q, k, v, r, scale, causal="bottom_right")
        if nq == 1:  # the one query sees every key: no mask
            path, theirs = "sdpa, no mask (all keys visible)", _sdpa(scale=scale)
        else:
            i, j = np.arange(nq)[:, None], np.arange(n)[None, :]
            path, theirs = "sdpa + boolean bottom-right mask", _torch_masked(j <= i + n - nq, scale)
        return Case(name, f"({b}, {h}, {nq} over {n}, {d}), causal bottom-right", path,
                    ours(causal="bottom_right"), (q, k, v), theirs, (q, k, v), check, check)
    if name == "softcap":
        q, k, v = qkv((b, h))
        check = _ref_check(q, k, v, rows, scale, causal=True, softcap=50.0)
        return Case(name, f"({b}, {h}, {n}, {d}), causal, softcap 50",
                    "torch ops: scores, 50 tanh(s / 50), causal mask, softmax, P V (no softcap in SDPA)",
                    ours(causal=True, softcap=50.0), (q, k, v), _torch_softcap(50.0, scale), (q, k, v), check, check)
    if name == "dropout":
        q, k, v = qkv((b, h))
        drop = {"causal": True, "dropout_p": 0.1, "dropout_seed": a.seed}
        # the reference draws the same random numbers as native.flash where it takes dropout; torch's differ
        check = (_ref_check(q, k, v, rows, scale, **drop) if "dropout_p" in inspect.signature(attnkern.reference)
                 .parameters else lambda out: float("nan"))
        return Case(name, f"({b}, {h}, {n}, {d}), causal, dropout 0.1", "sdpa dropout_p=0.1", ours(**drop),
                    (q, k, v), _sdpa(is_causal=True, dropout_p=0.1, scale=scale), (q, k, v), check, None)
    raise ValueError(f"unknown case {name!r}: one of {', '.join(CASES)}")


def _torch_masked(mask: np.ndarray, scale: float) -> Callable:
    import torch

    m = torch.from_numpy(np.ascontiguousarray(mask))
    return _sdpa(attn_mask=m, scale=scale)


def _torch_softcap(cap: float, scale: float) -> Callable:
    """torch's math path with a softcap: what a model without a fused softcap runs (Gemma 2's eager attention)."""
    import torch

    def run(q, k, v):
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        s = torch.tanh(s / cap) * cap
        n, m = s.shape[-2:]
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool).triu(1), float("-inf"))
        return torch.matmul(torch.softmax(s, dim=-1), v)

    return run


def _masked_reference(q, k, v, mask, rows, scale) -> np.ndarray:
    """float64 attention of `rows` with an additive mask broadcast to (B, H, Nq, Nk)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = scale * q[..., rows, :] @ k.swapaxes(-1, -2) + np.asarray(mask, np.float64)[..., rows, :]
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


def _varlen(a, rng, scale, ours_kw) -> Case:
    """Packed sequences through attention_varlen, and torch's padded batch with a boolean mask."""
    h, n, d = a.heads, a.n, a.dim
    lengths = [n // 2, n // 4, n // 8, n - n // 2 - n // 4 - n // 8]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v = (rng.standard_normal((n, h, d)).astype(np.float32) for _ in range(3))  # packed (N, H, D)
    longest = max(lengths)
    padded = [np.zeros((len(lengths), h, longest, d), np.float32) for _ in range(3)]
    for s, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
        for x, p in zip((q, k, v), padded):
            p[s, :, : hi - lo] = x[lo:hi].transpose(1, 0, 2)
    i = np.arange(longest)
    keep = (i[None, None, None, :] <= i[None, None, :, None]) & (
        i[None, None, None, :] < np.array(lengths)[:, None, None, None])  # (4, 1, L, L)
    checks = []
    for s, (lo, hi) in enumerate(zip(cu[:-1], cu[1:])):
        qs, ks, vs = (x[lo:hi].transpose(1, 0, 2) for x in (q, k, v))
        r = sample_rows(rng, hi - lo, a.check_rows)
        checks.append((s, lo, r, attnkern.reference(qs, ks, vs, causal=True, scale=scale, rows=r), qs, ks, vs))

    def ours_error(out):  # out (N, H, D)
        out = np.asarray(out)
        return max(_err(out[lo + r].transpose(1, 0, 2), ref, qs, ks, vs, scale) for _, lo, r, ref, qs, ks, vs in checks)

    def torch_error(out):  # out (4, H, L, D); the padded query rows are not compared
        out = np.asarray(out)
        return max(_err(out[s][:, r], ref, qs, ks, vs, scale) for s, _, r, ref, qs, ks, vs in checks)

    def ours(qt, kt, vt):
        import torch

        c = torch.from_numpy(cu)  # beside torch tensors, as FlashAttention's varlen function takes them
        return attnkern.attention_varlen(qt, kt, vt, c, c, longest, longest, causal=True, scale=scale,
                                         kernel=KERNEL, **ours_kw)

    return Case("varlen", f"{len(lengths)} causal sequences {'+'.join(map(str, lengths))} = {n}, "
                f"{h} heads, D {d}", f"sdpa on the padded batch ({len(lengths)}, {h}, {longest}, {d}) + boolean "
                "causal and key-padding mask", ours, (q, k, v), _torch_masked(keep, scale), tuple(padded),
                ours_error, torch_error)


def missing(needs: tuple[str, ...], backward: bool) -> str | None:
    """Why native.flash cannot run a case needing these features (None: it can)."""
    params = inspect.signature(attnkern.attention).parameters
    info = attnkern.kernel_info(KERNEL)
    have = set(info["backward_features" if backward else "features"])
    for need in needs:
        api = API_NAMES.get(need)
        if api is not None and api not in params and not hasattr(attnkern, api):
            return f"this attnkern has no {api}"
        if need not in API_ONLY and not have & set(FEATURE_NAMES.get(need, (need,))):
            return f"{KERNEL}'s {'backward' if backward else 'forward'} does not list {need} in kernel_info"
    return None


# ------------------------------------------------------------------ running


def _fns(case: Case, backward: bool) -> dict[str, Callable[[], object]]:
    """The two timed calls of a case: {"ours": ..., "torch": ...}."""
    import torch

    out = {}
    for side, fn, host in (("ours", case.ours, case.ours_in), ("torch", case.torch, case.torch_in)):
        tensors = [torch.from_numpy(x).requires_grad_(backward) for x in host]
        if not backward:
            def call(fn=fn, t=tensors):
                with torch.no_grad():
                    return fn(*t)
        else:
            grad = torch.from_numpy(np.random.default_rng(1).standard_normal(
                tuple(fn(*tensors).shape)).astype(np.float32))

            def call(fn=fn, t=tensors, grad=grad):
                for x in t:
                    x.grad = None
                fn(*t).backward(grad)
        out[side] = call
    return out


def run_cases(a, emit: Callable[[dict], None] = lambda row: None) -> list[dict]:
    """Every case of a.cases in every direction of a.directions: rows of times, ratio and errors
    (forward outputs checked; the gradients are the tests' to check: tests/test_features.py)."""
    from attnkern.hardware import torch_threads

    rng = np.random.default_rng(a.seed)
    rows = []
    for step, name in enumerate(a.cases, 1):
        print(f"[{step}/{len(a.cases)}] {name}", file=sys.stderr, flush=True)
        why = missing(NEEDS[name], backward=False)
        case = failed = None
        if why is None:
            try:
                case = build(name, a, rng)
            except Exception as exc:  # noqa: BLE001 - reported as the case's failure
                failed = _first_line(exc)
        for direction in a.directions:
            row = {"case": name, "direction": direction}
            reason = why or (None if failed else missing(NEEDS[name], backward=direction != "forward"))
            if reason is not None or failed is not None:
                row.update({"skipped": reason} if reason is not None else {"failed": failed})
                rows.append(row)
                emit(row)
                continue
            row.update(shape=case.shape, torch_path=case.torch_path)
            try:
                with blas_threads(a.threads), torch_threads(a.threads):
                    if direction == "forward":
                        row.update(_check(case))
                    fns = _fns(case, backward=direction != "forward")
                    times = medians(take_turns(fns, repeat=a.repeat, passes=a.passes, warmup=1, settle=a.settle))
                row.update(ours_s=times["ours"], torch_s=times["torch"], ratio=times["torch"] / times["ours"])
            except Exception as exc:  # noqa: BLE001 - e.g. out of memory in torch's mask
                row["failed"] = _first_line(exc)
            rows.append(row)
            emit(row)
        del case
    return rows


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160] if text else ''}"


def _check(case: Case) -> dict:
    """Both sides' forward outputs against the float64 reference."""
    import torch

    bound = tolerance("float32")
    with torch.no_grad():
        ours = case.ours(*(torch.from_numpy(x) for x in case.ours_in)).numpy()
        theirs = case.torch(*(torch.from_numpy(x) for x in case.torch_in)).numpy()
    out = {"ours_error": case.ours_error(ours)}
    if case.torch_error is not None:
        out["torch_error"] = case.torch_error(theirs)
    out["ok"] = all(not e > bound for e in out.values())  # NaN: not checked (dropout)
    return out


# ------------------------------------------------------------------ the window study


def window_study(a, emit: Callable[[dict], None] = lambda row: None) -> list[dict]:
    """native.flash forward with a causal window of a.study_window keys and with full causal
    attention, paired turns at each N: times, time per B H N W and per B H N^2 / 2."""
    w, h, d = a.study_window, a.study_heads, a.dim
    rng = np.random.default_rng(a.seed)
    params = thread_params(KERNEL, a.threads)
    rows = []
    for n in sorted(a.study_sizes):
        print(f"[window study] N={n}", file=sys.stderr, flush=True)
        q, k, v = random_qkv(rng.integers(2**32), (a.batch, h), n, n, d)
        scale = d**-0.5

        def call(**kw):
            return lambda: attnkern.attention(q, k, v, scale=scale, kernel=KERNEL, check_finite=False, **kw,
                                              **params)

        r = sample_rows(rng, n, a.check_rows)
        error = _ref_check(q, k, v, r, scale, causal=True, window=(w - 1, 0))(call(causal=True, window=(w - 1, 0))())
        with blas_threads(a.threads):
            t = medians(take_turns({"window": call(causal=True, window=(w - 1, 0)), "causal": call(causal=True)},
                                   repeat=a.repeat, passes=a.passes, warmup=1, settle=a.settle))
        lanes = a.batch * h * n
        row = {"n": n, "window": w, "window_s": t["window"], "causal_s": t["causal"],
               "window_ns_per_nw": t["window"] / (lanes * min(w, n)) * 1e9,
               "causal_ns_per_n2": t["causal"] / (lanes * n / 2) * 1e9,
               "speedup": t["causal"] / t["window"], "error": error, "ok": error <= tolerance("float32")}
        rows.append(row)
        emit(row)
    return rows


# ------------------------------------------------------------------ the command


def command(args) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise SystemExit("attnkern features needs PyTorch (its side of the comparison): pip install "
                         "'attnkern[torch]'") from None
    if min(args.n, args.batch, args.heads, args.kv_heads, args.dim, args.window, args.chunk, args.cache,
           args.threads, args.repeat, args.passes, args.check_rows, args.study_window, args.study_heads,
           *args.study_sizes) < 1:
        raise SystemExit("sizes, counts and --threads must be positive")
    if args.n < 8:
        raise SystemExit("--n must be at least 8 (varlen packs 4 sequences of N/2, N/4, N/8 and N/8 tokens)")
    if args.heads % args.kv_heads:
        raise SystemExit(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    device = f"{cpu_name()} ({platform.machine()}), native ISA {attnkern.active_isa()}, {args.threads} threads"
    print(f"# {device}; float32, D={args.dim}; median of {args.passes} x {args.repeat} samples (wall clock)")
    result = {"device": device, "settings": {k: v for k, v in vars(args).items() if k != "func"}}
    if args.window_study:
        print(f"# native.flash forward: causal window of {args.study_window} keys vs full causal, "
              f"({args.batch}, {args.study_heads}, N, {args.dim})")
        print(f"{'N':>6} {'window ms':>10} {'causal ms':>10} {'ns/(B H N W)':>13} {'ns/(B H N^2/2)':>15} "
              f"{'causal/window':>14} {'error':>9}")

        def emit(r):
            print(f"{r['n']:>6} {r['window_s'] * 1e3:>10.3f} {r['causal_s'] * 1e3:>10.3f} "
                  f"{r['window_ns_per_nw']:>13.4f} {r['causal_ns_per_n2']:>15.4f} {r['speedup']:>13.2f}x {r['error']:>9.1e}"
                  + ("" if r["ok"] else " FAIL"), flush=True)

        rows = result["study"] = window_study(args, emit)
        if len(rows) > 1:
            first, last = rows[0], rows[-1]
            result["study_summary"] = summary = {
                "window_per_nw_growth": last["window_ns_per_nw"] / first["window_ns_per_nw"],
                "causal_per_n2_growth": last["causal_ns_per_n2"] / first["causal_ns_per_n2"],
                "n_growth": last["n"] / first["n"]}
            print(f"# N x{summary['n_growth']:g}: window time / (B H N W) x{summary['window_per_nw_growth']:.2f} "
                  f"(O(N W): about 1), causal time / (B H N^2 / 2) x{summary['causal_per_n2_growth']:.2f}, "
                  f"causal / window {first['speedup']:.2f}x -> {last['speedup']:.2f}x")
    else:
        print(f"{'case':<16} {'direction':<16} {'ours ms':>10} {'torch ms':>10} {'torch/ours':>10} "
              f"{'ours err':>9} {'torch err':>9}  torch does")

        def emit(r):
            head = f"{r['case']:<16} {r['direction']:<16}"
            if "skipped" in r or "failed" in r:
                print(f"{head} {'skipped' if 'skipped' in r else 'failed'}: {r.get('skipped') or r['failed']}",
                      flush=True)
                return
            errs = "".join(f" {r[e]:>9.1e}" if e in r else f" {'':>9}" for e in ("ours_error", "torch_error"))
            print(f"{head} {r['ours_s'] * 1e3:>10.3f} {r['torch_s'] * 1e3:>10.3f} {r['ratio']:>9.2f}x{errs}  "
                  f"{r['torch_path']}" + ("" if r.get("ok", True) else " FAIL"), flush=True)

        rows = result["rows"] = run_cases(args, emit)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.csv:
        fields = list(dict.fromkeys(key for row in rows for key in row))
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
    bad = [r for r in rows if r.get("ok") is False or "failed" in r]
    for r in bad:
        what = r.get("case", f"window study N={r.get('n')}")
        print(f"# FAIL: {what} {r.get('direction', '')}: {r.get('failed') or 'error above the float32 bound'}",
              file=sys.stderr)
    return 1 if bad else 0

