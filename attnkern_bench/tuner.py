"""Studying the auto-tuner (its search lives in the library: attnkern.tuning):
every configuration of a kernel's lattice timed (record_grid), searches replayed
against such a recorded grid over many seeds beside a random search of the same
budget (replay_measure, evaluate), and their plots.
"""

from __future__ import annotations

import math
import statistics
import sys

import numpy as np

import attnkern
from attnkern.tuning import default_params, fmt, grid, live_measure, problem, search, space, tune, validity

__all__ = ["record_grid", "evaluate", "replay_measure", "draw_grid", "draw_replay", "plot_grid", "plot_replay",
           "stderr", "tune", "fmt"]


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


def record_grid(kernel, q_shape, k_shape=None, *, dtype="float32", causal=False, passes=5, per_pass=2, seed=0,
                progress=None) -> dict:
    """Every configuration of the lattice timed: `passes` passes in a seeded random
    order, `per_pass` samples each (after one untimed call), so drift spreads over all."""
    nq, nk, d, dv, itemsize = problem(kernel, q_shape, k_shape, dtype, causal)
    lattice = space(kernel, nq, nk, d, dv, itemsize)
    configs = grid(lattice, validity(kernel, nq, nk, d, dv, itemsize))
    measure = live_measure(kernel, q_shape, k_shape, dtype=dtype, causal=causal, seed=seed)
    samples = {_key(c): [] for c in configs}
    rng = np.random.default_rng(seed)
    for p in range(passes):
        for i, j in enumerate(rng.permutation(len(configs))):
            c = configs[j]
            samples[_key(c)] += measure(c, per_pass)
            if progress and i % 10 == 0:
                progress(f"pass {p + 1}/{passes}: {i}/{len(configs)} configurations")
    return {"kernel": kernel, "problem": {"q_shape": list(q_shape), "k_shape": list(k_shape or q_shape),
                                          "dtype": dtype, "causal": causal},
            "lattice": lattice, "default": default_params(kernel, lattice, nq, nk, d, dv, itemsize),
            "machine": attnkern.machine(attnkern.kernel_info(kernel)["device"]),
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
    from .plotting import pyplot

    plt = pyplot()

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
