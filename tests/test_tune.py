"""The auto-tuner (attnkern.tuning; replays: attnkern_bench.tuner) on synthetic timings, where the right
answer is known, and the per-machine cache that attention() reads."""

import json
import math

import numpy as np
import pytest

import attnkern
from attnkern import _api, _tuned, tuning
from attnkern_bench import cli, tuner
from conftest import assert_matches_reference


@pytest.fixture(autouse=True)
def tuned_lookups_on(monkeypatch):
    """Importing the asv suite (other tests do) turns lookups off for the process."""
    monkeypatch.delenv("ATTNKERN_NO_TUNED", raising=False)

LATTICE = {"block_q": [16, 32, 64, 128, 256, 512], "block_k": [32, 64, 128, 256, 512, 1024], "num_threads": [1, 2]}
DEFAULT = {"block_q": 256, "block_k": 256, "num_threads": 2}


def landscape(params):
    """A smooth bowl with its floor at (64, 512, 2 threads); one thread twice as slow."""
    dq = math.log2(params["block_q"] / 64)
    dk = math.log2(params["block_k"] / 512)
    return 1e-3 * (1 + 0.04 * dq * dq + 0.03 * dk * dk) * (2 if params["num_threads"] == 1 else 1)


def noisy(seed, noise=0.01):
    rng = np.random.default_rng(seed)
    calls = []

    def measure(params, n):
        calls.append((dict(params), n))
        return list(landscape(params) * (1 + noise * rng.standard_normal(n)))

    measure.calls = calls
    return measure


def test_search_finds_the_floor_in_a_fraction_of_the_grid_and_is_reproducible():
    size = math.prod(len(v) for v in LATTICE.values())
    runs = []
    for _ in range(2):
        chosen, default, history = tuning.search(LATTICE, noisy(0), default=DEFAULT, budget=12, seed=3)
        runs.append((chosen.params, [t.params for t in history]))
        assert len(history) == 12 < 0.2 * size
        assert history[0].params == DEFAULT and default.params == DEFAULT  # the default is tried first
        assert landscape(chosen.params) <= 1.03 * landscape({"block_q": 64, "block_k": 512, "num_threads": 2})
    assert runs[0] == runs[1]  # same seed, same measurements: the same search


def test_clearly_slower_configurations_are_stopped_early():
    measure = noisy(1)
    _, _, history = tuning.search(LATTICE, measure, default=DEFAULT, budget=14, seed=0, repeats=6, quick=2)
    pruned = [t for t in history if t.pruned]
    assert pruned and all(len(t.samples) == 2 for t in pruned)
    assert all(t.params["num_threads"] == 1 or landscape(t.params) > 1.2e-3 for t in pruned)


def test_ties_go_to_the_default():
    """A flat landscape (every configuration within noise): the default is chosen."""
    rng = np.random.default_rng(2)

    def flat(params, n):
        return list(1e-3 * (1 + 0.002 * rng.standard_normal(n)))

    for seed in range(3):
        chosen, _, _ = tuning.search(LATTICE, flat, default=DEFAULT, budget=10, seed=seed)
        assert chosen.params == DEFAULT


def test_replay_against_a_recorded_grid_beats_random_search():
    rng = np.random.default_rng(4)
    recorded = {"lattice": LATTICE, "default": DEFAULT,
                "records": [{"params": c, "samples": list(landscape(c) * (1 + 0.01 * rng.standard_normal(9)))}
                            for c in tuning.grid(LATTICE)]}
    ev = tuner.evaluate(recorded, seeds=range(10))
    assert ev["budget"] == math.ceil(0.15 * 72)
    assert ev["tuner_within"] >= 0.9
    assert ev["tuner_median_ratio"] <= ev["random_median_ratio"]
    assert all(len(r["curve"]) == r["trials"] and r["curve"][-1] >= 1 for r in ev["rows"])


def test_tune_live_caches_a_result_that_attention_uses(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNKERN_CACHE_DIR", str(tmp_path))
    result = attnkern.tune((1, 2, 96, 16), budget=6, repeats=3, seed=1)
    assert result.trials == 6 and len(result.history) == 6 and result.seconds > 0
    assert set(result.params) == {"block_q", "block_k", "num_threads"}
    assert result.machine["cpu"] and result.machine["version"] == attnkern.__version__
    cached = attnkern.kernel_info("native.flash")["tuned"]
    assert [c["params"] for c in cached] == [result.params]
    q = np.zeros((1, 2, 90, 16), np.float32)  # the same shape bucket (Nq, Nk <= 128)
    call = _api.validate(q, q, q, causal=False, scale=None, check_finite=False)
    assert _api.choose(call, "auto", {})[1] == result.params
    assert _api.choose(call, "native.flash", {"block_q": 7})[1]["block_q"] == 7  # given beats tuned
    other = _api.validate(q, q, q, causal=True, scale=None, check_finite=False)  # another key: defaults
    assert _api.choose(other, "native.flash", {})[1]["block_q"] == 256
    monkeypatch.setenv("ATTNKERN_NO_TUNED", "1")
    assert _api.choose(call, "native.flash", {})[1]["block_q"] == 256
    assert attnkern.kernel_info("native.flash")["tuned"] == []


@pytest.mark.parametrize("content", ["{not json", json.dumps([1, 2]), json.dumps({"format": 99, "entries": {}})])
def test_a_corrupt_or_foreign_cache_is_ignored_with_a_warning(tmp_path, monkeypatch, content):
    monkeypatch.setenv("ATTNKERN_CACHE_DIR", str(tmp_path))
    (tmp_path / "tuned.json").write_text(content)
    q = np.ones((1, 8, 4), np.float32)
    with pytest.warns(RuntimeWarning, match="ignoring the tuning cache"):
        out = attnkern.attention(q, q, q)
    assert out.shape == (1, 8, 4)


def test_cached_values_out_of_range_fall_back_to_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNKERN_CACHE_DIR", str(tmp_path))
    key = _tuned.key("native.flash", "cpu", "float32", False, _tuned.bucket(8, 8, 4, 4))
    (tmp_path / "tuned.json").write_text(json.dumps({"format": 1, "entries": {key: {"params": {"block_q": 10**6}}}}))
    q = np.ones((1, 8, 4), np.float32)
    call = _api.validate(q, q, q, causal=False, scale=None, check_finite=False)
    with pytest.warns(RuntimeWarning, match="ignoring the tuned parameters"):
        assert _api.choose(call, "native.flash", {})[1]["block_q"] == 256


def test_configurations_the_kernel_refuses_are_never_timed():
    """cuda.flash's tiles must fit shared memory: a lattice with a validity predicate."""
    lattice = {"block_q": [8, 16, 32, 64, 128], "block_k": [8, 16, 32, 64, 128]}
    fits = lambda p: p["block_q"] * p["block_k"] <= 2048  # noqa: E731
    measure = noisy(5)
    chosen, _, history = tuning.search(lattice, lambda p, n: measure({**p, "num_threads": 2}, n),
                                       default={"block_q": 128, "block_k": 16}, budget=8, seed=1, valid=fits)
    assert len(history) == 8 and all(fits(t.params) for t in history) and fits(chosen.params)
    assert len(tuning.grid(lattice, fits)) == 19


@pytest.mark.parametrize("bad", [{"budget": 0}, {"budget": -1}, {"budget": 2.5}, {"repeats": 1}])
def test_absurd_search_settings_are_refused(bad):
    with pytest.raises(ValueError, match="budget must be|repeats must be"):
        attnkern.tune((1, 1, 64, 16), cache=False, **bad)


def test_tune_command_caches_a_result_that_attention_uses(tmp_path, monkeypatch, capsys):
    """`attnkern tune` on a small problem: the configurations it timed are on the lattice,
    it prints and writes its choice, caches it for this machine, and attention() then runs
    with those parameters (and a correct result); --no-cache stores nothing."""
    monkeypatch.setenv("ATTNKERN_CACHE_DIR", str(tmp_path))
    out = tmp_path / "tune.json"
    argv = ["tune", "--shape", "1x2x96x16", "--budget", "4", "--repeats", "2", "--seed", "1", "--json", str(out)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    lattice = tuner.space("native.flash", 96, 96, 16, 16, 4)
    assert result["trials"] == 4 and len(result["history"]) == 4
    assert all(t["params"][n] in lattice[n] for t in result["history"] for n in lattice)
    assert result["params"] in [t["params"] for t in result["history"]]
    assert result["problem"] == {"q_shape": [1, 2, 96, 16], "k_shape": [1, 2, 96, 16], "dtype": "float32",
                                 "causal": False}
    assert f"cached as {result['cache_key']}" in printed and tuner.fmt(result["params"]) in printed
    assert [c["params"] for c in attnkern.kernel_info("native.flash")["tuned"]] == [result["params"]]

    q, k, v = (np.random.default_rng(i).standard_normal((1, 2, 90, 16)).astype(np.float32) for i in range(3))
    used = []
    real = _api.run

    def noting(call, chosen, resolved, **kwargs):
        used.append(resolved)
        return real(call, chosen, resolved, **kwargs)

    monkeypatch.setattr(_api, "run", noting)
    assert_matches_reference(attnkern.attention(q, k, v), q, k, v)  # auto: native.flash, tuned
    assert used == [result["params"]]

    (tmp_path / "tuned.json").unlink()
    assert cli.main([*argv[:-2], "--no-cache"]) == 0
    assert "not cached (--no-cache)" in capsys.readouterr().out
    assert not (tmp_path / "tuned.json").exists() and attnkern.kernel_info("native.flash")["tuned"] == []


def test_tune_command_records_a_grid_and_replays_searches_against_it(tmp_path, capsys):
    grid, replay = tmp_path / "grid.json", tmp_path / "replay.json"
    assert cli.main(["tune", "--shape", "1x1x64x8", "--record-grid", str(grid)]) == 0
    recorded = json.loads(grid.read_text())
    assert len(recorded["records"]) == len(tuner.grid(recorded["lattice"]))
    assert all(len(r["samples"]) >= 2 and min(r["samples"]) > 0 for r in recorded["records"])
    assert cli.main(["tune", "--replay", str(grid), "--seeds", "3", "--json", str(replay)]) == 0
    printed = capsys.readouterr().out
    ev = json.loads(replay.read_text())
    assert ev["seeds"] == 3 and ev["grid_size"] == len(recorded["records"])
    assert "tuner" in printed and "random search" in printed
