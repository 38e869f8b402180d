"""The auto-tuner: near-best tunables of a kernel for one problem in a small
fraction of the grid, robust to timing noise.

Search: over each tunable's lattice of values (powers of two for blocks and
threads; the tiles that run for cuda.flash, with and without tensor cores in
float32), the kernel's default first, then trials alternate between exploring,
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
live_measure times attnkern.attention; replay_measure draws from a recorded grid
(record_grid), which is how searches are compared over many seeds without
running kernels again.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

import attnkern

from .inputs import random_qkv
from .timing import CudaEventClock, WallClock


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


def space(kernel: str, nq: int, nk: int, d: int, dv: int, itemsize: int) -> dict[str, list[int]]:
    """The lattice of each tunable of `kernel` for this problem."""
    info = attnkern.kernel_info(kernel)["params"]
    if kernel == "cuda.flash":
        from attnkern.backends.cuda import flash_tiles

        tiles = flash_tiles(d, dv, itemsize)
        lattice = {"block_q": sorted({bq for bq, _ in tiles}), "block_k": sorted({bk for _, bk in tiles})}
        if tiles != flash_tiles(d, dv, itemsize, tensor_cores=0):  # float32 with a tensor-core kernel
            lattice["tensor_cores"] = [0, 1]
        return lattice
    lattice = {}
    for name, p in info.items():
        if name == "num_threads":
            values = {v for v in (1 << i for i in range(12)) if v <= p["max"] and v <= p["default"]}
            lattice[name] = sorted(values | {p["default"]})
        elif name == "block_q":
            lattice[name] = [v for v in (16, 32, 64, 128, 256, 512) if p["min"] <= v <= p["max"]]
        elif name == "block_k":
            lattice[name] = [v for v in (32, 64, 128, 256, 512, 1024) if p["min"] <= v <= p["max"]]
        elif "choices" in p:  # 0 is "auto" among tile sizes, but a value of an on/off switch
            lattice[name] = [v for v in p["choices"] if v or set(p["choices"]) == {0, 1}]
    return lattice


def default_params(kernel: str, lattice: dict, d: int, dv: int, itemsize: int) -> dict:
    """The kernel's built-in defaults, on the lattice (cuda.flash's 0 = the tile it picks)."""
    info = attnkern.kernel_info(kernel)["params"]
    if kernel == "cuda.flash":
        from attnkern.backends.cuda import flash_default_tile

        bq, bk = flash_default_tile(d, dv, itemsize)
        return {"block_q": bq, "block_k": bk, **({"tensor_cores": 1} if "tensor_cores" in lattice else {})}
    return {name: info[name]["default"] if info[name]["default"] in values
            else min(values, key=lambda v: abs(math.log2(v) - math.log2(max(1, info[name]["default"]))))
            for name, values in lattice.items()}


def validity(kernel: str, d: int, dv: int, itemsize: int):
    """A predicate on configurations of the lattice that the kernel accepts for this
    problem (cuda.flash: the tile runs, with tensor cores or without), or None when all are."""
    if kernel == "cuda.flash":
        from attnkern.backends.cuda import flash_tiles

        fits = [set(flash_tiles(d, dv, itemsize, tensor_cores=tc)) for tc in (0, 1)]
        return lambda p: (p["block_q"], p["block_k"]) in fits[p.get("tensor_cores", 1)]
    return None


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
           valid=None):
    """(chosen Trial, default Trial, history): the adaptive search described above."""
    import optuna
    from optuna.distributions import IntDistribution

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    names = list(lattice)
    dists = {n: IntDistribution(0, len(lattice[n]) - 1) for n in names}
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(2, budget // 4), multivariate=True)
    study = optuna.create_study(direction="minimize", sampler=sampler)
    study.enqueue_trial({n: lattice[n].index(default[n]) for n in names})
    seen: dict[tuple, Trial] = {}
    history: list[Trial] = []
    budget = min(budget, len(grid(lattice, valid)))
    order = np.random.default_rng(seed)
    moves: dict[tuple, tuple] = {}  # configuration -> (tunable, step) that reached it from the best
    asks = 0
    while len(history) < budget and asks < 50 * budget:
        asks += 1
        best = min((h for h in history if not h.pruned), key=lambda h: h.median, default=None)
        local = _untried_neighbours(best, lattice, seen, order, moves) if best and len(history) % 3 else []
        local = [pm for pm in local if valid is None or valid(pm[0])]
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
        if valid is not None and not valid(params):  # the kernel refuses it: a failed trial, not a timed one
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
    (wall clock on the CPU, CUDA events on the GPU), on seeded random inputs."""
    lead, nq, d = tuple(q_shape[:-2]), q_shape[-2], q_shape[-1]
    nk = (k_shape or q_shape)[-2]
    q, k, v = random_qkv(seed, lead, nq, nk, d, dtype=dtype)
    clock = WallClock()
    if (device or attnkern.kernel_info(kernel)["device"]) == "cuda":
        import torch

        q, k, v = (torch.from_numpy(x).cuda() for x in (q, k, v))
        clock = CudaEventClock(torch)

    def measure(params, n):
        def call():
            return attnkern.attention(q, k, v, causal=causal, kernel=kernel, check_finite=False, **params)

        call()
        return [clock.seconds(call) for _ in range(n)]

    return measure


def replay_measure(records: dict, seed: int):
    """measure(params, n) drawing n of the samples recorded for params (with
    replacement, seeded): a search replayed against a recorded grid."""
    rng = np.random.default_rng(seed)
    table = {_key(r["params"]): r["samples"] for r in records}

    def measure(params, n):
        samples = table[_key(params)]
        return [float(samples[i]) for i in rng.integers(0, len(samples), n)]

    return measure


def _key(params: dict) -> tuple:
    return tuple(sorted(params.items()))


def problem(kernel, q_shape, k_shape, dtype, causal) -> tuple[int, int, int, int, int]:
    nq, d = q_shape[-2], q_shape[-1]
    nk = (k_shape or q_shape)[-2]
    return nq, nk, d, d, np.dtype(dtype).itemsize


def tune(q_shape, k_shape=None, *, kernel="native.flash", dtype="float32", causal=False, budget=None, seed=0,
         repeats=5, cache=True, measure=None, progress=None) -> TuneResult:
    """Searches `kernel`'s tunables for this problem (see the module docstring); with
    cache, stores the result for attention() to use on this machine."""
    from attnkern import _tuned

    info = attnkern.kernel_info(kernel)
    if not info["available"]:
        raise RuntimeError(f"cannot tune {kernel}: {info['reason']}")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise ValueError(f"budget must be a positive number of configurations (or None), got {budget!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 2:
        raise ValueError(f"repeats must be an integer >= 2 (two calls decide an early stop), got {repeats!r}")
    q_shape, k_shape = tuple(q_shape), tuple(k_shape) if k_shape else None
    if len(q_shape) < 2 or (k_shape and (len(k_shape) != len(q_shape) or k_shape[-1] != q_shape[-1])):
        raise ValueError(f"q_shape must be (..., N, D) and k_shape like it, got {q_shape} and {k_shape}")
    nq, nk, d, dv, itemsize = problem(kernel, q_shape, k_shape, dtype, causal)
    lattice = space(kernel, nq, nk, d, dv, itemsize)
    if not lattice:
        raise ValueError(f"{kernel} has no tunables to search")
    valid = validity(kernel, d, dv, itemsize)
    size = len(grid(lattice, valid))
    budget = budget or max(6, math.ceil(0.15 * size))
    default = default_params(kernel, lattice, d, dv, itemsize)
    measure = measure or live_measure(kernel, q_shape, k_shape, dtype=dtype, causal=causal, seed=seed)
    start = time.perf_counter()
    chosen, default_trial, history = search(lattice, measure, default=default, budget=budget, seed=seed,
                                            repeats=repeats, progress=progress, valid=valid)
    result = TuneResult(kernel, chosen.params, chosen.median, len(history), history, default, default_trial.median,
                        size, budget, seed, {"q_shape": list(q_shape), "k_shape": list(k_shape or q_shape),
                                             "dtype": str(np.dtype(dtype)), "causal": bool(causal)},
                        _tuned.machine(info["device"]), time.perf_counter() - start)
    if cache:
        result.cache_key = _tuned.store(kernel, info["device"], str(np.dtype(dtype)), bool(causal),
                                        _tuned.bucket(nq, nk, d, dv), chosen.params,
                                        {"seconds": chosen.median, "default_seconds": default_trial.median,
                                         "trials": len(history), "seed": seed, "machine": result.machine})
    return result


def record_grid(kernel, q_shape, k_shape=None, *, dtype="float32", causal=False, passes=5, per_pass=2, seed=0,
                progress=None) -> dict:
    """Every configuration of the lattice timed: `passes` passes in a seeded random
    order, `per_pass` samples each (after one untimed call), so drift spreads over all."""
    nq, nk, d, dv, itemsize = problem(kernel, q_shape, k_shape, dtype, causal)
    lattice = space(kernel, nq, nk, d, dv, itemsize)
    configs = grid(lattice, validity(kernel, d, dv, itemsize))
    measure = live_measure(kernel, q_shape, k_shape, dtype=dtype, causal=causal, seed=seed)
    samples = {_key(c): [] for c in configs}
    rng = np.random.default_rng(seed)
    for p in range(passes):
        for i, j in enumerate(rng.permutation(len(configs))):
            c = configs[j]
            samples[_key(c)] += measure(c, per_pass)
            if progress and i % 10 == 0:
                progress(f"pass {p + 1}/{passes}: {i}/{len(configs)} configurations")
    from attnkern import _tuned

    return {"kernel": kernel, "problem": {"q_shape": list(q_shape), "k_shape": list(k_shape or q_shape),
                                          "dtype": dtype, "causal": causal},
            "lattice": lattice, "default": default_params(kernel, lattice, d, dv, itemsize),
            "machine": _tuned.machine(attnkern.kernel_info(kernel)["device"]),
            "records": [{"params": c, "samples": samples[_key(c)]} for c in configs]}


def evaluate(recorded: dict, seeds=range(20), budget=None, within=0.03, repeats=5) -> dict:
    """Replays the tuner and a random search of the same budget over `seeds` against a
    recorded grid: how often each lands within `within` of the grid's best."""
    records, lattice, default = recorded["records"], recorded["lattice"], recorded["default"]
    truth = {_key(r["params"]): statistics.median(r["samples"]) for r in records}
    best = min(truth.values())
    size = len(records)
    budget = budget or max(6, math.ceil(0.15 * size))
    rows = []
    for seed in seeds:
        chosen, _, history = search(lattice, replay_measure(records, seed), default=default, budget=budget, seed=seed,
                                    repeats=repeats, valid=lambda p: _key(p) in truth)
        rng = np.random.default_rng(10_000 + seed)
        picks = [records[i]["params"] for i in rng.choice(size, size=min(budget, size), replace=False)]
        rand = replay_measure(records, seed)
        random_best = min(picks, key=lambda p: statistics.median(rand(p, repeats)))
        rows.append({"seed": seed, "trials": len(history), "tuner": truth[_key(chosen.params)] / best,
                     "random": truth[_key(random_best)] / best, "chosen": chosen.params,
                     "curve": _best_so_far([truth[_key(t.params)] for t in history], best),
                     "random_curve": _best_so_far([truth[_key(p)] for p in picks], best)})
    ok = sum(r["tuner"] <= 1 + within for r in rows)
    return {"grid_size": size, "budget": budget, "grid_best_s": best, "seeds": len(rows),
            "tuner_within": ok / len(rows), "random_within": sum(r["random"] <= 1 + within for r in rows) / len(rows),
            "tuner_median_ratio": statistics.median(r["tuner"] for r in rows),
            "random_median_ratio": statistics.median(r["random"] for r in rows),
            "default_ratio": truth[_key(default)] / best, "rows": rows}


def _best_so_far(values, best):
    out, so_far = [], math.inf
    for v in values:
        so_far = min(so_far, v)
        out.append(so_far / best)
    return out


def draw_grid(ax, recorded: dict):
    """Heatmap of median time over block_q x block_k (at the most threads), relative to
    the best, on a matplotlib axis; returns the image (for a colour bar)."""
    lat = recorded["lattice"]
    top = {n: max(v) for n, v in lat.items() if n not in ("block_q", "block_k")}
    cell = {(r["params"]["block_q"], r["params"]["block_k"]): statistics.median(r["samples"])
            for r in recorded["records"] if all(r["params"][n] == v for n, v in top.items())}
    best = min(cell.values())
    z = np.array([[cell.get((bq, bk), np.nan) / best for bk in lat["block_k"]] for bq in lat["block_q"]])
    im = ax.imshow(z, cmap="viridis_r", origin="lower")
    ax.set_xticks(range(len(lat["block_k"])), lat["block_k"], fontsize=7)
    ax.set_yticks(range(len(lat["block_q"])), lat["block_q"], fontsize=7)
    for i in range(z.shape[0]):
        for j in range(z.shape[1]):
            if np.isfinite(z[i, j]):
                ax.text(j, i, f"{z[i, j]:.2f}", ha="center", va="center", fontsize=6,
                        color="w" if z[i, j] > 1.3 else "k")
    ax.set_xlabel("block_k")
    ax.set_ylabel("block_q")
    p = recorded["problem"]
    ax.set_title(f"{recorded['kernel']} {'x'.join(map(str, p['q_shape']))} {'causal' if p['causal'] else ''}: "
                 f"time / best ({', '.join(f'{n}={v}' for n, v in top.items()) or 'all'})", fontsize=8)
    return im


def draw_replay(ax, evaluation: dict, title: str) -> None:
    """Best-so-far (true time / grid best) against trials: the tuner's and a random
    search's median over seeds, and the grid's best, on a matplotlib axis."""
    for key, label in (("curve", "tuner"), ("random_curve", "random search")):
        curves = [r[key] for r in evaluation["rows"]]
        n = min(len(c) for c in curves)
        ax.plot(range(1, n + 1), np.median([c[:n] for c in curves], axis=0), marker="o", label=f"{label} (median)")
    ax.axhline(1.0, color="k", lw=0.8, label="grid best")
    ax.axhline(1.03, color="k", lw=0.8, ls=":", label="within 3%")
    ax.set_xlabel("configurations timed")
    ax.set_ylabel("best so far / grid best")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def _save(draw, path, size) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    im = draw(ax)
    if im is not None:
        fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_grid(recorded: dict, path) -> None:
    _save(lambda ax: draw_grid(ax, recorded), path, (6, 4.5))


def plot_replay(evaluation: dict, title: str, path) -> None:
    _save(lambda ax: draw_replay(ax, evaluation, title), path, (6, 4))


def stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
