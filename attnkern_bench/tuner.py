"""Studying the auto-tuner (its search lives in the library: attnkern.tuning):
every configuration of a kernel's lattice timed (record_grid), searches replayed
against such a recorded grid over many seeds beside a random search of the same
budget (replay_measure, evaluate), and their plots.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys

import numpy as np

import attnkern
from attnkern.tuning import default_params, fmt, grid, live_measure, problem, search, space, tune, validity

__all__ = ["record_grid", "evaluate", "replay_measure", "draw_grid", "draw_replay", "plot_grid", "plot_replay",
           "stderr", "tune", "fmt", "configure", "command"]


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


# ---------------------------------------------------------------- the command

TUNE_HELP = """\
Searches a kernel's tunables for one problem on this machine and caches the result,
which attnkern.attention then uses for calls of that kernel, dtype, mask and shape
bucket (attnkern.kernel_info(kernel)["tuned"] lists them; ATTNKERN_NO_TUNED=1 ignores them).

The search (attnkern_bench.tuner) starts from the kernel's defaults and alternates
Optuna's TPE sampler with one-step moves from the best so far over a lattice of
powers of two (block_q, block_k, num_threads; cuda.flash: the tiles that fit).
Each configuration is timed with --repeats calls after an untimed one (wall clock;
CUDA events on the GPU) on seeded random inputs; one clearly slower after two calls
is stopped early. Configurations within the noise of the best are timed again in
turns, and a tie goes to the default (else the one nearest it). The budget counts
configurations (default: 15% of the lattice).

--record-grid FILE times every configuration instead (5 passes in a seeded random
order, 2 calls each); --replay FILE replays the tuner and a random search of the
same budget against such a file over --seeds seeds, without running the kernel.
"""


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is like 1x8x1024x64 (B x H x N x D), got {text!r}") from None
    if not 2 <= len(dims) <= 4 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"a shape has 2 to 4 positive sizes, ..., N, D; got {text!r}")
    return dims


HELP = "search a kernel's block sizes and threads; cache the best for attention()"
DESCRIPTION = TUNE_HELP


def configure(p: argparse.ArgumentParser) -> None:
    """The arguments of `attnkern tune`."""
    p.add_argument("--shape", type=_shape, default=(1, 8, 1024, 64), help="q's shape, B x H x N x D (1x8x1024x64)")
    p.add_argument("--k-shape", type=_shape, help="k's shape if not q's")
    p.add_argument("--kernel", default="native.flash")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--budget", type=int, help="configurations to time (default: 15%% of the lattice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=5, help="timed calls per configuration")
    p.add_argument("--no-cache", action="store_true", help="report only; do not store the result")
    p.add_argument("--record-grid", metavar="FILE", help="time the whole lattice into FILE (JSON)")
    p.add_argument("--replay", metavar="FILE", help="replay searches against a recorded grid")
    p.add_argument("--seeds", type=int, default=20, help="seeds of --replay")
    p.add_argument("--plots", metavar="DIR", help="write plots here (a heatmap of a grid, best so far of a replay)")
    p.add_argument("--max-error", type=float, metavar="E",
                   help="also try fastmath=1 where the kernel has it, in configurations whose largest absolute "
                        "error against the float64 reference is at most E (default: fastmath stays 0)")
    p.add_argument("--json", help="write the result to this file")


def command(args) -> int:
    import os

    if args.plots:
        os.makedirs(args.plots, exist_ok=True)
    if args.replay:
        with open(args.replay) as f:
            recorded = json.load(f)
        ev = evaluate(recorded, seeds=range(args.seeds), budget=args.budget, repeats=args.repeats)
        p = recorded["problem"]
        name = f"{recorded['kernel']} {'x'.join(map(str, p['q_shape']))}{' causal' if p['causal'] else ''}"
        print(f"# {name} on {recorded['machine']['cpu']}: grid of {ev['grid_size']}, budget {ev['budget']} "
              f"({ev['budget'] / ev['grid_size']:.0%}), {ev['seeds']} seeds; the default is {ev['default_ratio']:.3f}x "
              "the grid's best")
        print(f"{'search':<14} {'within 3%':>10} {'median time / best':>19}")
        for label, key in (("tuner", "tuner"), ("random search", "random")):
            print(f"{label:<14} {ev[f'{key}_within']:>10.0%} {ev[f'{key}_median_ratio']:>19.3f}")
        if args.plots:
            path = os.path.join(args.plots, f"replay-{os.path.splitext(os.path.basename(args.replay))[0]}.png")
            plot_replay(ev, f"{name}: {ev['seeds']} seeds", path)
            print(f"# plot: {path}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(ev, f, indent=1)
        return 0
    if args.record_grid:
        recorded = record_grid(args.kernel, args.shape, args.k_shape, dtype=args.dtype, causal=args.causal,
                                     seed=args.seed, progress=stderr)
        with open(args.record_grid, "w") as f:
            json.dump(recorded, f, indent=1)
        best = min(recorded["records"], key=lambda r: sorted(r["samples"])[len(r["samples"]) // 2])
        print(f"# {len(recorded['records'])} configurations into {args.record_grid}; fastest {best['params']}")
        if args.plots:
            path = os.path.join(args.plots, f"grid-{os.path.splitext(os.path.basename(args.record_grid))[0]}.png")
            plot_grid(recorded, path)
            print(f"# heatmap: {path}")
        return 0
    result = tune(args.shape, args.k_shape, kernel=args.kernel, dtype=args.dtype, causal=args.causal,
                        budget=args.budget, seed=args.seed, repeats=args.repeats, cache=not args.no_cache,
                        progress=stderr, max_error=args.max_error)
    print(f"# {args.kernel} q {'x'.join(map(str, args.shape))} {args.dtype}{' causal' if args.causal else ''} on "
          f"{result.machine['cpu']} ({result.machine['isa']}, {result.machine['cpus']} CPUs)")
    print(f"# {result.trials} of {result.grid_size} configurations timed in {result.wall_seconds:.1f} s")
    print(f"{'':<9} {'params':<40} {'median ms':>10}")
    print(f"{'default':<9} {fmt(result.default):<40} {result.default_seconds * 1e3:>10.3f}")
    print(f"{'tuned':<9} {fmt(result.params):<40} {result.seconds * 1e3:>10.3f}   "
          f"({result.speedup:.2f}x the default)")
    for e in result.problem.get("fastmath_errors", []):
        verdict = "within" if e["error"] <= result.problem["max_error"] else "over"
        print(f"# fastmath error {e['error']:.3g} ({verdict} --max-error {result.problem['max_error']:g}): "
              f"{fmt(e['params'])}")
    print(f"# cached as {result.cache_key}" if result.cache_key else "# not cached (--no-cache)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_json(), f, indent=1)
    return 0
