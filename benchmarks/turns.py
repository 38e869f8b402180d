"""Timing in paired, alternating turns, each contender in its own process.

Two things compared in one process disturb each other: the OpenMP, TBB or BLAS
thread pools one of them leaves behind keep running (or keep the shared
runtime in a state) that slows the other. Measured here: after one call of
numba.flash (Numba's `omp` threading layer, sharing libgomp with PyTorch),
torch's SDPA ran 4-7x slower for the rest of the process, so an in-process
"numba.flash / torch.sdpa" ratio read 0.2-0.5 where separate processes give
about 2.6. So every contender gets a worker process of its own, and the workers
take turns: a pause (the previous worker's threads stop spinning), an untimed
call, then back-to-back timed calls (by default one: the finer the alternation,
the less drift fits between the two sides). Paired per round, the ratio of the
two turns cancels the machine's slow drift, which hits both alike.

The workers run OpenMP with OMP_WAIT_POLICY=PASSIVE: an idle worker's threads
sleep instead of spinning. With libgomp's default spinning, the waiting worker's
threads took cores from the running one and the paired intervals of identical
builds were about ten times wider (native.flash, 2 threads on 2 cores: +/-10-20%
against +/-1%). It adds the same thread wake-up to every call of both sides.

Used by the asv suite (`bench_tracks.TimeVsTorch`) and by `tools/gate.py` (two
builds of attnkern, each worker importing its own). The workers use attnkern's
public API only, so old commits run too. For the GPU gate (setup's device="cuda")
the inputs are torch CUDA tensors and a turn's calls are timed with CUDA events.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import time


class Worker:
    """A process that builds inputs and times attnkern calls on request.
    `python`: the interpreter command; `env`: its environment (None: ours)."""

    def __init__(self, python=(sys.executable,), env=None, threads: int = 2):
        env = dict(os.environ if env is None else env)
        env.update(OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                   NUMBA_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE", ATTNKERN_NO_TUNED="1")
        self.proc = subprocess.Popen([*python, os.path.abspath(__file__), str(threads)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def ask(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"timing worker died (exit {self.proc.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def setup(self, kernel: str, shape: str, causal: bool, dtype: str = "float32", key: str = "",
              device: str = "cpu", **params) -> dict:
        """Inputs for (kernel, shape, causal) built, kept under `key`, and one
        call made; returns {"seconds": time of a second call, "file": attnkern's
        path} or {"skip": why} where the kernel is missing or cannot run here.
        device "cuda": the inputs are torch CUDA tensors and turns are timed with
        CUDA events (see _serve)."""
        return self.ask(op="setup", key=key, kernel=kernel, shape=shape, causal=bool(causal), dtype=dtype,
                        device=device, params=params)

    def turn(self, calls: int, key: str = "") -> list[float]:
        """An untimed call, then `calls` timed ones of configuration `key`."""
        return self.ask(op="time", key=key, calls=calls)["times"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()


def paired_turns(workers: dict, rounds: int, calls: int = 1, settle: float = 0.0, rng=None,
                 key: str = "") -> dict[str, list[float]]:
    """`rounds` rounds in which every worker (configuration `key` set up) takes
    one turn, in a random order per round; returns each worker's median per round."""
    rng = rng or random.Random(0)
    names = list(workers)
    meds = {name: [] for name in names}
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            if settle:
                time.sleep(settle)
            meds[name].append(statistics.median(workers[name].turn(calls, key)))
    return meds


def bootstrap_median_ci(values, level=0.95, resamples=4000, seed=0) -> tuple[float, float]:
    """Percentile bootstrap interval of the median of `values`: a flat list, or
    a list of groups (one per worker process), in which case the groups are
    resampled first and then the values within each, so that differences
    between processes widen the interval as they should. Seeded: the same
    data give the same interval."""
    groups = values if values and isinstance(values[0], (list, tuple)) else [values]
    groups = [g for g in groups if g]
    rng = random.Random(seed)
    meds = []
    for _ in range(resamples):
        sample = []
        for g in rng.choices(groups, k=len(groups)):
            sample += rng.choices(g, k=len(g))
        meds.append(statistics.median(sample))
    meds.sort()
    return meds[int((1 - level) / 2 * resamples)], meds[min(resamples - 1, int((1 + level) / 2 * resamples))]


# ---------------------------------------------------------------- the worker side
def _cpu_turn(call, calls: int) -> list[float]:
    """An untimed call, then `calls` calls each timed by the wall clock."""
    call()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times


def _cuda_inputs(rng, shape, dtype: str):
    """q, k, v as torch CUDA tensors of `dtype` from the same seeded float32
    values as the CPU inputs (bfloat16 and float16 rounded from them)."""
    import torch

    return tuple(torch.from_numpy(rng.standard_normal(shape).astype("float32")).to("cuda", getattr(torch, dtype))
                 for _ in range(3))


def _cuda_turn(call, calls: int) -> list[float]:
    """An untimed call and a synchronisation (the other worker's kernels are
    done, this worker's clocks and caches warm), then `calls` calls queued back
    to back with a CUDA event between each two: each time is one call's span on
    the GPU (launch gaps included only where the GPU waited for the next launch).
    One synchronisation at the end, so the host does not pace the calls."""
    import torch

    call()
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(calls + 1)]
    events[0].record()
    for i in range(calls):
        call()
        events[i + 1].record()
    events[-1].synchronize()
    return [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(calls)]


def _serve(threads: int) -> None:
    import numpy as np

    import attnkern

    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        threadpool_limits = None
    if threadpool_limits is not None:  # NumPy's BLAS; torch's kernels take num_threads per call
        threadpool_limits(limits=threads)

    def reply(**kw):
        print(json.dumps(kw), flush=True)

    calls, timers = {}, {}
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "quit":
                return
            if req["op"] == "setup":
                kernel = req["kernel"]
                if kernel not in attnkern.kernels():
                    reply(skip=f"{kernel} does not exist in this build")
                    continue
                info = attnkern.kernel_info(kernel)
                if not info["available"]:
                    reply(skip=f"{kernel} is not available here: {info['reason']}")
                    continue
                params = dict(req["params"])
                if "num_threads" in info["params"]:
                    params.setdefault("num_threads", threads)
                rng = np.random.default_rng(0)
                shape = tuple(int(x) for x in req["shape"].split("x"))
                if req.get("device", "cpu") == "cuda":
                    args, params["check_finite"] = _cuda_inputs(rng, shape, req["dtype"]), False
                    timers[req["key"]] = _cuda_turn
                else:
                    args = tuple(rng.standard_normal(shape).astype(req["dtype"]) for _ in range(3))
                    timers[req["key"]] = _cpu_turn

                def call(kernel=kernel, causal=req["causal"], params=params, args=args):
                    return attnkern.attention(*args, causal=causal, kernel=kernel, **params)

                calls[req["key"]] = call
                call()  # compile or load caches, start thread pools
                reply(seconds=timers[req["key"]](call, 1)[0], file=attnkern.__file__)
            elif req["op"] == "time":
                reply(times=timers[req["key"]](calls[req["key"]], req["calls"]))
        except Exception as exc:  # reported to the driver
            reply(error=f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
