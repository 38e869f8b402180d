"""The auto-tuner's search, behind attnkern.tune and attention()'s tuned
parameters: near-best tunables of a kernel for one problem in a small
fraction of the grid, robust to timing noise.

Search: over each tunable's lattice of values (powers of two for blocks and
threads, or the kernel's own lattice where its registry entry has one:
cuda.flash's tiles that run, with and without tensor cores in float32), the
kernel's default first, then trials alternate between exploring,
Optuna's TPE sampler (seeded,
multivariate: a model of where fast configurations lie), one trial in three,
and exploiting, an untried one-step neighbour of the best so far, the step
that led there continued first (timings are smooth in the blocks); the model is
told every result. A configuration is timed in
two steps: `quick` samples, and unless the fastest of them is already `prune`
times slower than the best median so far (clearly worse: stopped early), the
rest of `repeats`. A distinct configuration is one trial; the budget counts trials.
Decision: the configurations whose median is within the measured noise of the
best (the larger of 1% and twice the standard error of the best's median,
estimated from its samples' median absolute deviation) are timed again, taking
turns, up to three rounds while more than one remains within noise; among those still within noise of the fastest,
the default wins, else the one fewest lattice steps from the default, so
re-running picks the same configuration or one measurably as fast.

measure(params, n) -> n samples in seconds is the only contact with a kernel:
live_measure times attnkern.attention; attnkern_bench.tuner replays recorded
grids through the same search, to compare searches over many seeds without
running kernels again. The search needs Optuna: pip install 'attnkern[tune]'.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from . import _registry, _tuned
from ._api import attention, kernel_info
from ._extras import require

@dataclass
class Trial:
    number: int
    params: dict
    samples: list
    pruned: bool

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


@dataclass
class TuneResult:
    kernel: str
    params: dict
    seconds: float
    trials: int
    history: list
    default: dict
    default_seconds: float
    grid_size: int
    budget: int
    seed: int
    problem: dict = field(default_factory=dict)
    machine: dict = field(default_factory=dict)
    wall_seconds: float = 0.0
    cache_key: str | None = None

    @property
    def speedup(self) -> float:
        return self.default_seconds / self.seconds

    def to_json(self) -> dict:
        out = asdict(self)
        out["history"] = [{**asdict(t), "median": t.median} for t in self.history]
        out["speedup"] = self.speedup
        return out


def _own_space(kernel: str, nq: int, nk: int, d: int, dv: int, itemsize: int) -> _registry.SearchSpace | None:
    """The kernel's own search space for this problem, where its registry entry has one."""
    own = _registry.get(kernel).search_space
    return None if own is None else own(nq, nk, d, dv, itemsize)


def space(kernel: str, nq: int, nk: int, d: int, dv: int, itemsize: int) -> dict[str, list[int]]:
    """The lattice of each tunable of `kernel` for this problem: the kernel's own
    (its registry entry's search_space), else powers of two within each tunable's range."""
    own = _own_space(kernel, nq, nk, d, dv, itemsize)
    if own is not None:
        return own.lattice
    info = kernel_info(kernel)["params"]
    lattice = {}
    for name, p in info.items():
        if name == "num_threads":
            values = {v for v in (1 << i for i in range(12)) if v <= p["max"] and v <= p["default"]}
            lattice[name] = sorted(values | {p["default"]})
        elif name == "block_q":
            lattice[name] = [v for v in (16, 32, 64, 128, 256, 512) if p["min"] <= v <= p["max"]]
        elif name == "block_k":
            lattice[name] = [v for v in (32, 64, 128, 256, 512, 1024) if p["min"] <= v <= p["max"]]
        elif name == "fastmath":  # searched only under an error bound the caller gives (tune's max_error)
            continue
        elif "choices" in p:  # 0 is "auto" among tile sizes, but a value of an on/off switch
            lattice[name] = [v for v in p["choices"] if v or set(p["choices"]) == {0, 1}]
    return lattice


def default_params(kernel: str, lattice: dict, nq: int, nk: int, d: int, dv: int, itemsize: int) -> dict:
    """The kernel's built-in defaults, on the lattice: its own search space's (for
    cuda.flash the tile that 0 picks), else each default or its nearest power of two."""
    own = _own_space(kernel, nq, nk, d, dv, itemsize)
    if own is not None:
        return dict(own.default)
    info = kernel_info(kernel)["params"]
    return {name: info[name]["default"] if info[name]["default"] in values
            else min(values, key=lambda v: abs(math.log2(v) - math.log2(max(1, info[name]["default"]))))
            for name, values in lattice.items()}


def validity(kernel: str, nq: int, nk: int, d: int, dv: int, itemsize: int):
    """A predicate on configurations of the lattice that the kernel accepts for this
    problem (its own search space's: for cuda.flash, the tile runs with tensor cores
    or without), or None when all are."""
    own = _own_space(kernel, nq, nk, d, dv, itemsize)
    return None if own is None else own.valid


def grid(lattice: dict, valid=None) -> list[dict]:
    """Every configuration of the lattice (that valid accepts)."""
    configs = [{}]
    for name, values in lattice.items():
        configs = [{**c, name: v} for c in configs for v in values]
    return [c for c in configs if valid is None or valid(c)]


def _untried_neighbours(trial, lattice: dict, seen: dict, order, moves: dict) -> list[tuple[dict, tuple]]:
    """(configuration, move) one lattice step from trial's along one tunable, not yet
    timed: first the step that led to trial, continued (a pattern search), then the
    others in a seeded random order."""
    out = []
    for name, values in lattice.items():
        i = values.index(trial.params[name])
        for step in (-1, 1):
            if 0 <= i + step < len(values):
                p = {**trial.params, name: values[i + step]}
                if tuple(p[n] for n in lattice) not in seen:
                    out.append((p, (name, step)))
    out = [out[i] for i in order.permutation(len(out))]
    last = moves.get(tuple(trial.params[n] for n in lattice))
    return sorted(out, key=lambda pm: pm[1] != last)


def _distance(params: dict, default: dict, lattice: dict) -> int:
    return sum(abs(lattice[n].index(params[n]) - lattice[n].index(default[n])) for n in lattice)


def search(lattice: dict, measure: Callable[[dict, int], list], *, default: dict, budget: int, seed: int = 0,
           repeats: int = 5, quick: int = 2, prune: float = 1.25, progress: Callable[[str], None] | None = None,
           valid=None, allowed=None):
    """(chosen Trial, default Trial, history): the adaptive search described above.
    valid: the configurations the kernel runs (the grid's); allowed: a further test,
    asked only of configurations the search is about to time (tune's error bound on
    fastmath, which runs the kernel)."""
    if allowed is not None:
        structural = valid
        valid_or_all = (lambda p: True) if structural is None else structural

        def usable(p):
            return valid_or_all(p) and allowed(p)
    else:
        structural = usable = valid
    optuna = require("optuna", "tune", "attnkern's tuner")
    from optuna.distributions import IntDistribution

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    names = list(lattice)
    dists = {n: IntDistribution(0, len(lattice[n]) - 1) for n in names}
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(2, budget // 4), multivariate=True)
    study = optuna.create_study(direction="minimize", sampler=sampler)
    study.enqueue_trial({n: lattice[n].index(default[n]) for n in names})
    seen: dict[tuple, Trial] = {}
    history: list[Trial] = []
    budget = min(budget, len(grid(lattice, structural)))
    order = np.random.default_rng(seed)
    moves: dict[tuple, tuple] = {}  # configuration -> (tunable, step) that reached it from the best
    asks = 0
    while len(history) < budget and asks < 50 * budget:
        asks += 1
        best = min((h for h in history if not h.pruned), key=lambda h: h.median, default=None)
        local = _untried_neighbours(best, lattice, seen, order, moves) if best and len(history) % 3 else []
        local = [pm for pm in local if usable is None or usable(pm[0])]
        if local:  # exploit: a lattice step from the best so far (the model learns of it too)
            (params, move), t = local[0], None
            moves[tuple(params[n] for n in names)] = move
        else:      # explore: the model's proposal
            t = study.ask(dists)
            params = {n: lattice[n][t.params[n]] for n in names}
        key = tuple(params[n] for n in names)
        if key in seen:  # the sampler proposed a configuration already timed: its value, no new trial
            study.tell(t, seen[key].median)
            continue
        if usable is not None and not usable(params):  # refused: a failed trial, not a timed one
            study.tell(t, state=optuna.trial.TrialState.FAIL)
            continue
        samples = list(measure(params, quick))
        best_median = best.median if best else math.inf
        pruned = min(samples) > prune * best_median
        if not pruned:
            samples += measure(params, repeats - quick)
        trial = Trial(len(history), params, samples, pruned)
        seen[key] = trial
        history.append(trial)
        if t is None:
            study.add_trial(optuna.trial.create_trial(params={n: lattice[n].index(params[n]) for n in names},
                                                      distributions=dists, value=trial.median))
        else:
            study.tell(t, trial.median)
        if progress:
            progress(f"[{len(history)}/{budget}] {fmt(params)}: {trial.median * 1e3:.3f} ms"
                     + (" (stopped early: clearly slower)" if pruned else ""))
    default_trial = seen[tuple(default[n] for n in names)]
    return _decide(history, default_trial, default, lattice, measure, repeats), default_trial, history


def _decide(history, default_trial, default, lattice, measure, repeats, rounds=3):
    """The configuration to choose: the fastest, unless others are within the noise of
    it; finalists are timed again, in turns, up to `rounds` times `repeats` samples
    each while the decision stays close."""
    finalists = [t for t in history if not t.pruned]
    for _ in range(rounds + 1):
        best = min(finalists, key=lambda t: t.median)
        tie = max(0.01, 2 * _median_error(best))
        finalists = [t for t in finalists if t.median <= best.median * (1 + tie)]
        if len(finalists) == 1 or _ == rounds:
            break
        for _ in range(repeats):  # turns: drift hits every finalist alike
            for t in finalists:
                t.samples += measure(t.params, 1)
    if default_trial in finalists:
        return default_trial
    return min(finalists, key=lambda t: (_distance(t.params, default, lattice), t.median))


def _median_error(trial: Trial) -> float:
    """Relative standard error of a trial's median: 1.4826 MAD estimates the spread
    of its samples, and the median of n of them varies by 1.2533 spread / sqrt(n)."""
    mad = statistics.median(abs(s - trial.median) for s in trial.samples)
    return 1.4826 * 1.2533 * mad / math.sqrt(len(trial.samples)) / trial.median


def fmt(params: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())


def live_measure(kernel: str, q_shape, k_shape=None, *, dtype="float32", causal=False, seed=0, device=None):
    """measure(params, n): n timed calls of attnkern.attention after one untimed one
    (wall clock on the CPU, CUDA events on the GPU), on seeded random inputs
    (standard normal, drawn in float64 and rounded to dtype)."""
    lead, nq, d = tuple(q_shape[:-2]), q_shape[-2], q_shape[-1]
    nk = (k_shape or q_shape)[-2]
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((*lead, n, d)).astype(dtype) for n in (nq, nk, nk))
    seconds = _wall_seconds
    if (device or kernel_info(kernel)["device"]) == "cuda":
        torch = require("torch", "torch", "tuning a GPU kernel")
        q, k, v = (torch.from_numpy(x).cuda() for x in (q, k, v))
        seconds = _cuda_event_seconds(torch)

    def measure(params, n):
        def call():
            return attention(q, k, v, causal=causal, kernel=kernel, check_finite=False, **params)

        call()
        return [seconds(call) for _ in range(n)]

    return measure


def _wall_seconds(call) -> float:
    """One call's time on the wall clock: on the CPU a call returns when its work is done."""
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def _cuda_event_seconds(torch):
    """One call's GPU time between two CUDA events on torch's current stream."""
    def seconds(call) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return seconds


def problem(kernel, q_shape, k_shape, dtype, causal) -> tuple[int, int, int, int, int]:
    nq, d = q_shape[-2], q_shape[-1]
    nk = (k_shape or q_shape)[-2]
    return nq, nk, d, d, np.dtype(dtype).itemsize


def live_error(kernel: str, q_shape, k_shape=None, *, dtype="float32", causal=False, seed=0, device=None):
    """error(params): the largest absolute difference between attnkern.attention with
    these tunables and the float64 reference, on seeded random inputs (standard
    normal, drawn in float64 and rounded to dtype; a different draw from
    live_measure's)."""
    from ._reference import reference

    lead, nq, d = tuple(q_shape[:-2]), q_shape[-2], q_shape[-1]
    nk = (k_shape or q_shape)[-2]
    rng = np.random.default_rng([seed, 1])
    q, k, v = (rng.standard_normal((*lead, n, d)).astype(dtype) for n in (nq, nk, nk))
    expected = reference(q, k, v, causal=causal)
    to_host = np.asarray
    if (device or kernel_info(kernel)["device"]) == "cuda":
        torch = require("torch", "torch", "tuning a GPU kernel")
        q, k, v = (torch.from_numpy(x).cuda() for x in (q, k, v))
        to_host = lambda out: out.float().cpu().numpy()  # noqa: E731 - float: NumPy has no bfloat16

    def error(params) -> float:
        out = attention(q, k, v, causal=causal, kernel=kernel, **params)
        return float(np.max(np.abs(to_host(out).astype(np.float64) - expected)))

    return error


def _check_max_error(max_error) -> float | None:
    if max_error is None:
        return None
    if isinstance(max_error, bool) or not isinstance(max_error, (int, float)) or not 0 < max_error < math.inf:
        raise ValueError(f"max_error must be a positive finite number (the largest absolute error against the "
                         f"float64 reference a fastmath configuration may have), got {max_error!r}")
    return float(max_error)


def _with_fastmath(lattice: dict, kernel: str, max_error: float | None, error):
    """The lattice with the fastmath switch, and the test the search asks of a
    configuration before timing it: fastmath is absent (the kernel's accurate
    default, 0) unless the caller allowed an error bound; with one, a fastmath=1
    configuration is timed only where its measured error (`error`, once per
    configuration) is within it. Returns (lattice, allowed or None, errors measured)."""
    errors: dict[tuple, float] = {}
    lattice = {name: values for name, values in lattice.items() if name != "fastmath"}
    if max_error is None or "fastmath" not in kernel_info(kernel)["params"]:
        return lattice, None, errors
    lattice["fastmath"] = [0, 1]

    def allowed(p):
        if not p["fastmath"]:
            return True
        key = tuple(sorted(p.items()))
        if key not in errors:
            errors[key] = error(p)
        return errors[key] <= max_error

    return lattice, allowed, errors


def tune(q_shape, k_shape=None, *, kernel="native.flash", dtype="float32", causal=False, budget=None, seed=0,
         repeats=5, cache=True, measure=None, progress=None, max_error=None, error=None) -> TuneResult:
    """Searches `kernel`'s tunables for this problem (see the module docstring); with
    cache, stores the result for attention() to use on this machine. fastmath (an
    approximate variant of some kernels) is searched only when the caller passes
    max_error, the largest absolute error against the float64 reference it accepts:
    each fastmath configuration's error is measured (error(params), default
    live_error) and the configuration is tried only where it is within max_error.
    Without max_error the result never has fastmath=1."""
    info = kernel_info(kernel)
    if not info["available"]:
        raise RuntimeError(f"cannot tune {kernel}: {info['reason']}")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ValueError(f"budget must be a positive number of configurations (or None), got {budget!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 2:
        raise ValueError(f"repeats must be an integer >= 2 (two calls decide an early stop), got {repeats!r}")
    q_shape, k_shape = tuple(q_shape), tuple(k_shape) if k_shape else None
    if len(q_shape) < 2 or (k_shape and (len(k_shape) != len(q_shape) or k_shape[-1] != q_shape[-1])):
        raise ValueError(f"q_shape must be (..., N, D) and k_shape like it, got {q_shape} and {k_shape}")
    max_error = _check_max_error(max_error)
    nq, nk, d, dv, itemsize = problem(kernel, q_shape, k_shape, dtype, causal)
    lattice = space(kernel, nq, nk, d, dv, itemsize)
    error = error or (live_error(kernel, q_shape, k_shape, dtype=dtype, causal=causal, seed=seed)
                      if max_error is not None else None)
    valid = validity(kernel, nq, nk, d, dv, itemsize)
    lattice, allowed, errors = _with_fastmath(lattice, kernel, max_error, error)
    if not lattice:
        raise ValueError(f"{kernel} has no tunables to search")
    size = len(grid(lattice, valid))
    budget = budget or max(6, math.ceil(0.15 * size))
    default = {**default_params(kernel, {n: v for n, v in lattice.items() if n != "fastmath"}, nq, nk, d, dv,
                                itemsize), **({"fastmath": 0} if "fastmath" in lattice else {})}
    measure = measure or live_measure(kernel, q_shape, k_shape, dtype=dtype, causal=causal, seed=seed)
    start = time.perf_counter()
    chosen, default_trial, history = search(lattice, measure, default=default, budget=budget, seed=seed,
                                            repeats=repeats, progress=progress, valid=valid, allowed=allowed)
    result = TuneResult(kernel, chosen.params, chosen.median, len(history), history, default, default_trial.median,
                        size, budget, seed, {"q_shape": list(q_shape), "k_shape": list(k_shape or q_shape),
                                             "dtype": str(np.dtype(dtype)), "causal": bool(causal),
                                             **({"max_error": max_error, "fastmath_errors": [
                                                 {"params": dict(key), "error": e} for key, e in errors.items()]}
                                                if max_error is not None else {})},
                        _tuned.machine(info["device"]), time.perf_counter() - start)
    if cache:
        result.cache_key = _tuned.store(kernel, info["device"], str(np.dtype(dtype)), bool(causal),
                                        _tuned.bucket(nq, nk, d, dv), chosen.params,
                                        {"seconds": chosen.median, "default_seconds": default_trial.median,
                                         "trials": len(history), "seed": seed, "machine": result.machine})
    return result


