"""Ring attention on 1 to 4 local gloo processes against attention on the whole
sequence in one process: every rank's out, lse and gradients, contiguous and
zigzag, causal and not, float32 and float64. The workers below run in the
spawned processes (attnkern.distributed.launch imports this module there)."""

import json
import multiprocessing
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

import attnkern
from attnkern.distributed import LAYOUTS, RankFailed, launch, ring_attention, shard, unshard
from attnkern_bench.accuracy import tolerance

# torch is a test extra, and its CPU builds have gloo: without it the setup is broken
assert dist.is_available() and dist.is_gloo_available(), "torch.distributed with gloo is not available"

# max|error| / max|exact| of out, lse and every gradient, against float64 autograd on
# the whole sequence, within the single-process kernels' bound (attnkern_bench.accuracy,
# 2^7 unit roundoffs): each merge of partial results and each block summed adds a few
# roundings, well inside it
TOL = {np.float32: tolerance(np.float32), np.float64: tolerance(np.float64)}
CASES = [(layout, causal, dtype) for layout in LAYOUTS for causal in (False, True) for dtype in (np.float32, np.float64)]
LEAD, D, DV = (2, 3), 16, 8
DEADLINE = 300  # seconds; a hang fails the test instead of stalling the suite
START = "forkserver"  # ranks forked from one server that has imported torch: seconds less per launch


def _inputs(world_size, seed):
    """Full-sequence q, k, v and the output gradient; N = 6 rows a chunk, 2W chunks."""
    rng = np.random.default_rng(seed)
    n = 12 * world_size
    q, k = (rng.standard_normal((*LEAD, n, D)) for _ in range(2))
    v = rng.standard_normal((*LEAD, n, DV))
    dout = rng.standard_normal((*LEAD, n, DV))
    return q, k, v, dout


def _ring_cases(q, k, v, dout):
    """On each rank: ring attention of every case on this rank's shards, with gradients."""
    results = []
    for layout, causal, dtype in CASES:
        tensors = [torch.tensor(shard(x.astype(dtype), layout), requires_grad=True) for x in (q, k, v)]
        out, lse = ring_attention(*tensors, causal=causal, layout=layout, return_lse=True)
        out.backward(torch.from_numpy(shard(dout.astype(dtype), layout)))
        results.append((out.detach().numpy(), lse.numpy(), [t.grad.numpy() for t in tensors]))
    return results


def _exact(q, k, v, dout, causal):
    """out, lse and the gradients of the whole sequence in float64, by torch autograd
    through softmax(q k^T / sqrt(D)) v written out."""
    tq, tk, tv = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    scores = tq @ tk.transpose(-1, -2) / np.sqrt(D)
    if causal:
        n = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ tv
    out.backward(torch.tensor(dout))
    return out.detach().numpy(), lse.detach().numpy(), [t.grad.numpy() for t in (tq, tk, tv)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_rank_matches_attention_on_the_whole_sequence(world_size):
    q, k, v, dout = _inputs(world_size, seed=world_size)
    per_rank = launch(_ring_cases, world_size, q, k, v, dout, deadline=DEADLINE, start_method=START)
    for i, (layout, causal, dtype) in enumerate(CASES):
        exact_out, exact_lse, exact_grads = _exact(q, k, v, dout, causal)
        shards = [r[i] for r in per_rank]
        for rank, (out, lse, grads) in enumerate(shards):
            assert out.dtype == lse.dtype == dtype and all(g.dtype == dtype for g in grads)
            where = f"W={world_size} rank {rank} {layout} causal={causal} {dtype.__name__}"
            ref = shard(exact_out, layout, rank=rank, world_size=world_size)
            tol = TOL[dtype]
            assert np.abs(out - ref).max() <= tol * np.abs(exact_out).max(), where
            ref_lse = shard(exact_lse[..., None], layout, rank=rank, world_size=world_size)[..., 0]
            assert np.abs(lse - ref_lse).max() <= tol * np.abs(exact_lse).max(), where
            for g, exact, name in zip(grads, exact_grads, ("dq", "dk", "dv")):
                ref_g = shard(exact, layout, rank=rank, world_size=world_size)
                assert np.abs(g - ref_g).max() <= tol * np.abs(exact).max(), f"{name} {where}"
        # unshard puts the ranks' shards back in sequence order
        full = unshard([s[0] for s in shards], layout)
        assert np.abs(full - exact_out).max() <= TOL[dtype] * np.abs(exact_out).max()


def _plain_and_ring(q, k, v, dout):
    """W = 1: the ring and plain attention(), forward and backward, bit for bit."""
    results = []
    for layout in LAYOUTS:
        for causal in (False, True):
            ring_in = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
            plain_in = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
            ring_out, ring_lse = ring_attention(*ring_in, causal=causal, layout=layout, return_lse=True)
            plain_out, plain_lse = attnkern.attention(*plain_in, causal=causal, return_lse=True)
            ring_out.backward(torch.tensor(dout))
            plain_out.backward(torch.tensor(dout))
            same = [torch.equal(ring_out, plain_out), torch.equal(ring_lse, plain_lse)]
            same += [torch.equal(a.grad, b.grad) for a, b in zip(ring_in, plain_in)]
            # NumPy arrays in, NumPy arrays out
            np_out = ring_attention(q, k, v, causal=causal, layout=layout)
            same.append(isinstance(np_out, np.ndarray) and np.array_equal(np_out, plain_out.detach().numpy()))
            results.append(same)
    return results


def test_one_rank_equals_plain_attention_exactly():
    q, k, v, dout = (x.astype(np.float32) for x in _inputs(1, seed=5))
    (results,) = launch(_plain_and_ring, 1, q, k, v, dout, deadline=DEADLINE, start_method=START)
    assert all(all(same) for same in results), results


def _bad_call(case):
    """Rank 1 calls differently from rank 0, or fails outright; rank 0 is well behaved."""
    rank = dist.get_rank()
    q = np.ones((2, 8, 4), np.float32)
    if rank == 1 and case == "shape":
        q = np.ones((2, 6, 4), np.float32)
    if rank == 1 and case == "nan":
        q = q.copy()
        q[0, 0, 0] = np.nan
    if rank == 1 and case == "raise":
        raise RuntimeError("rank 1 gave up")
    return ring_attention(q, q, q, causal=True)


@pytest.mark.parametrize("case, message", [
    ("shape", r"every rank must call ring_attention with shards of one shape.*rank [01] has shapes"),
    ("nan", r"rank 1: q contains NaN"),
    ("raise", r"rank 1 of 2 failed:\nRuntimeError: rank 1 gave up"),
])
def test_a_bad_rank_fails_every_rank_with_a_clear_error_and_no_stray_process(case, message):
    """A mismatch or NaN on one rank is an error on all (they compare calls first);
    a rank that raises ends the others, which would otherwise wait for it, within
    seconds rather than the group's timeout."""
    with pytest.raises(RankFailed, match=message):
        launch(_bad_call, 2, case, deadline=DEADLINE, timeout=DEADLINE, start_method=START)
    assert multiprocessing.active_children() == []


def test_shard_and_bad_arguments():
    x = np.arange(24.0).reshape(12, 2)
    assert np.array_equal(shard(x, "zigzag", rank=0, world_size=3)[:, 0], [0, 2, 20, 22])
    assert np.array_equal(shard(x, "contiguous", rank=2, world_size=3)[:, 0], [16, 18, 20, 22])
    parts = [shard(x, "zigzag", rank=r, world_size=3) for r in range(3)]
    assert np.array_equal(unshard(parts, "zigzag"), x)
    with pytest.raises(ValueError, match="sequence length 12 does not split into 8 equal chunks.*multiple of 8, such as 16"):
        shard(x, "zigzag", rank=0, world_size=4)
    with pytest.raises(ValueError, match=r"shard takes an array \(..., N, D\)"):
        shard(np.arange(4.0), rank=0, world_size=2)
    with pytest.raises(ValueError, match="layout must be one of 'contiguous', 'zigzag'"):
        shard(x, "striped", rank=0, world_size=2)
    with pytest.raises(ValueError, match="world_size must be an integer"):
        launch(_bad_call, 0, "shape")
    with pytest.raises(RuntimeError, match="needs torch.distributed initialized"):
        ring_attention(x, x, x)


def test_ring_command_measures_and_writes_json(tmp_path):
    """attnkern ring runs W = 2 local processes, checks them against the
    whole-sequence result and writes the measurements."""
    out = tmp_path / "ring.json"
    proc = subprocess.run(
        [sys.executable, "-m", "attnkern", "ring", "--world-sizes", "2", "--seq", "64", "--heads", "2",
         "--dim", "16", "--repeat", "2", "--backward", "--json", str(out)],
        capture_output=True, text=True, timeout=DEADLINE, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {r["world_size"] for r in rows} == {2}
    for r in rows:
        assert r["max_error"] <= tolerance(np.float32) and r["bytes_per_step"] == r["bytes_model"] * (r["world_size"] > 1)
    assert "overlap" in proc.stdout
    # --replot measures nothing: the saved rows' table and the plot, from the JSON alone
    plot = tmp_path / "ring.png"
    replot = subprocess.run([sys.executable, "-m", "attnkern", "ring", "--replot", str(out), "--plot", str(plot)],
                            capture_output=True, text=True, timeout=DEADLINE)
    assert replot.returncode == 0, replot.stderr
    assert len([line for line in replot.stdout.splitlines() if line.startswith(" 2 ")]) == len(rows)
    assert plot.stat().st_size > 10_000
    bad = subprocess.run([sys.executable, "-m", "attnkern", "ring", "--replot", str(tmp_path / "missing.json")],
                         capture_output=True, text=True, timeout=DEADLINE)
    assert bad.returncode != 0 and "not a file written by attnkern ring --json" in bad.stderr, bad.stderr


HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# (local kernel, dtype, backward) on the CPU: torch.sdpa has no backward kernel in attnkern
HALF_CPU = [(kernel, dtype, kernel == "native.flash") for kernel in ("native.flash", "torch.sdpa") for dtype in HALF]


def _half_rings(q, k, v, dout, cases, device="cpu"):
    """On each rank: zigzag rings of the half inputs, causal and not, for each case;
    out, lse and the gradients widened to float64 for the comparison, and their dtypes."""
    if device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    results = []
    for kernel, dtype, backward in cases:
        for causal in (False, True):
            tensors = [torch.from_numpy(shard(x, "zigzag")).to(device, HALF[dtype]).requires_grad_(backward)
                       for x in (q, k, v)]
            out, lse = ring_attention(*tensors, causal=causal, layout="zigzag", kernel=kernel, return_lse=True)
            grads = []
            if backward:
                out.backward(torch.from_numpy(shard(dout, "zigzag")).to(device, HALF[dtype]))
                grads = [t.grad for t in tensors]
            results.append([x.detach().cpu().double().numpy() for x in (out, lse, *grads)]
                           + [str(x.dtype) for x in (out, lse, *grads)])
    return results


def _check_half_rings(runs, full, cases):
    """runs: {W: every rank's _half_rings}; W = max(runs) against W = 1 and float64."""
    from attnkern_bench.accuracy import UNIT_ROUNDOFF, lse_tolerance, reference_backward, reference_lse

    w = max(runs)
    i = 0
    for kernel, dtype, backward in cases:
        rounded = [torch.from_numpy(x).to(HALF[dtype]) for x in full]
        q, k, v, dout = (x.double().numpy() for x in rounded)
        for causal in (False, True):
            exact = [attnkern.reference(q, k, v, causal=causal), reference_lse(q, k, causal=causal)]
            if backward:
                exact += list(reference_backward(q, k, v, dout, causal=causal))
                theirs = [x.clone().requires_grad_() for x in rounded[:3]]
                torch.nn.functional.scaled_dot_product_attention(*theirs, is_causal=causal).backward(rounded[3])
            errors = {}
            for world, per_rank in runs.items():
                parts = [r[i] for r in per_rank]
                count = len(parts[0]) // 2
                assert all(name == str(HALF[dtype]) for p in parts for name in p[count:]), parts[0][count:]
                got = [unshard([p[j] if j != 1 else p[1][..., None] for p in parts], "zigzag") for j in range(count)]
                got[1] = got[1][..., 0]
                errors[world] = [np.abs(g - e).max() for g, e in zip(got, exact)]
            where = f"{kernel} {dtype} causal={causal}"
            u = UNIT_ROUNDOFF[dtype]
            out_err = errors[w][0]
            assert out_err <= 1.5 * errors[1][0], f"{where}: out error W={w} {out_err:.3g}, W=1 {errors[1][0]:.3g}"
            # one rounding; cuda.flash's half kernel also rounds P to the dtype before P V (twice the bound)
            bound = (2 if kernel == "cuda.flash" else 1) * u * np.abs(exact[0]).max()
            assert out_err <= bound, f"{where}: out error {out_err:.3g} > {bound:.3g}"
            assert errors[w][1] <= lse_tolerance(dtype) * np.abs(exact[1]).max(), where
            for j, name in enumerate(("dq", "dk", "dv")[:len(exact) - 2], start=2):
                ref = exact[j]
                bound = 2 * np.abs(theirs[j - 2].grad.double().numpy() - ref).max() + u * max(1, np.abs(ref).max())
                assert errors[w][j] <= bound, f"{name} {where}: W={w} error {errors[w][j]:.3g} > {bound:.3g}"
                assert errors[w][j] <= 1.5 * errors[1][j], \
                    f"{name} {where}: W={w} {errors[w][j]:.3g}, W=1 {errors[1][j]:.3g}"
            i += 1


def test_half_precision_rings_round_once():
    """bfloat16 and float16 rings on W = 2 ranks are as accurate as on one (every block's
    out and lse merged in float32, gradients summed in float32, one rounding at the end):
    the error against float64 on the whole sequence within 1.5x of W = 1's and within the
    one-rounding bound; gradients also by FlashAttention's rule against torch SDPA's in the
    same dtype. Kernels' half out and lse merged as they are (the lse of a bfloat16 block
    rounded by up to 0.016) give 3x W = 1's error here."""
    rng = np.random.default_rng(21)
    full = [rng.standard_normal((*LEAD, 96, D)) for _ in range(4)]
    runs = {w: launch(_half_rings, w, *full, HALF_CPU, deadline=DEADLINE, start_method=START) for w in (1, 2)}
    _check_half_rings(runs, full, HALF_CPU)


def test_ring_command_takes_half_precision_and_profiles_steps(tmp_path):
    """attnkern ring --dtype bfloat16 checks the half ring against float64 (within the
    one-rounding bound: its blocks merge in float32) and --profile-steps reports each
    step's compute and communication, overlapped and serial, per rank (the backward's
    steps follow with --backward)."""
    out = tmp_path / "ring.json"
    proc = subprocess.run(
        [sys.executable, "-m", "attnkern", "ring", "--world-sizes", "2", "--seq", "64", "--heads", "2", "--dim", "16",
         "--repeat", "1", "--dtype", "bfloat16", "--layout", "zigzag", "--causal", "yes", "--profile-steps",
         "--json", str(out)],
        capture_output=True, text=True, timeout=DEADLINE, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["bytes_per_step"] == row["bytes_model"] == 2 * 32 * 2 * 16 * 2  # bfloat16 shards travel as they are
    assert 0 < row["max_error"] <= tolerance("bfloat16")
    # 2 forward steps per rank, each (compute, communication) in seconds
    assert [len(s) for s in row["steps"]] == [len(s) for s in row["steps_serial"]] == [2, 2]
    assert all(c > 0 and w >= 0 for rank in row["steps_serial"] for c, w in rank)
    assert "speed-up" in proc.stdout and proc.stdout.count("zigzag causal rank") == 2


def _gpu_world() -> int:
    """GPUs the NCCL tests may use: only with ATTNKERN_TEST_GPU=1 (else CUDA is simulated)."""
    if os.environ.get("ATTNKERN_TEST_GPU") != "1" or not torch.cuda.is_available():
        return 0
    return min(torch.cuda.device_count(), 4)


GPU_CASES = [case for case in CASES if case[2] == np.float32]  # float64 is no GPU's use case


def _gpu_cases(q, k, v, dout, kernel):
    """On each rank: the GPU_CASES on this rank's GPU with the local kernel; results to the host."""
    device = torch.device("cuda", torch.cuda.current_device())
    results = []
    for layout, causal, dtype in GPU_CASES:
        tensors = [torch.tensor(shard(x.astype(dtype), layout), device=device, requires_grad=True) for x in (q, k, v)]
        out, lse = ring_attention(*tensors, causal=causal, layout=layout, return_lse=True, kernel=kernel)
        out.backward(torch.from_numpy(shard(dout.astype(dtype), layout)).to(device))
        results.append((out.detach().cpu().numpy(), lse.cpu().numpy(), [t.grad.cpu().numpy() for t in tensors]))
    return results


@pytest.mark.skipif(_gpu_world() == 0, reason="needs a GPU (ATTNKERN_TEST_GPU=1)")
@pytest.mark.parametrize("world_size", sorted({1, 2, _gpu_world()} - {0}))
def test_nccl_ranks_on_gpus_match_attention_on_the_whole_sequence(world_size):
    """The same checks on GPUs over NCCL, cuda.flash as the local kernel, one GPU per rank."""
    if world_size > _gpu_world():
        pytest.skip(f"needs {world_size} GPUs")
    q, k, v, dout = _inputs(world_size, seed=10 + world_size)
    per_rank = launch(_gpu_cases, world_size, q, k, v, dout, "cuda.flash", backend="nccl", pin=False,
                      deadline=DEADLINE)
    for i, (layout, causal, dtype) in enumerate(GPU_CASES):
        exact_out, exact_lse, exact_grads = _exact(q, k, v, dout, causal)
        for rank, (out, lse, grads) in enumerate(r[i] for r in per_rank):
            where = f"W={world_size} rank {rank} {layout} causal={causal} {dtype.__name__}"
            pick = lambda x: shard(x, layout, rank=rank, world_size=world_size)  # noqa: E731
            assert np.abs(out - pick(exact_out)).max() <= TOL[dtype] * np.abs(exact_out).max(), where
            assert np.abs(lse - pick(exact_lse[..., None])[..., 0]).max() <= TOL[dtype] * np.abs(exact_lse).max()
            for g, exact in zip(grads, exact_grads):
                assert np.abs(g - pick(exact)).max() <= TOL[dtype] * np.abs(exact).max(), where


HALF_GPU = [(kernel, dtype, kernel == "cuda.flash") for kernel in ("cuda.flash", "torch.sdpa") for dtype in HALF]


@pytest.mark.skipif(_gpu_world() < 2, reason="needs 2 GPUs (ATTNKERN_TEST_GPU=1)")
def test_nccl_half_precision_rings_round_once():
    """The CPU test's checks on 2 GPUs over NCCL against 1: cuda.flash's half kernel
    writing float32 rows (D = 64, which it takes), torch.sdpa's fused kernel on float32
    copies."""
    rng = np.random.default_rng(22)
    full = [rng.standard_normal((2, 2, 256, 64)) for _ in range(4)]
    runs = {w: launch(_half_rings, w, *full, HALF_GPU, "cuda", backend="nccl", pin=False, deadline=DEADLINE)
            for w in (1, 2)}
    _check_half_rings(runs, full, HALF_GPU)
