"""Timers: a clock for the CPU and one for the GPU, and turn-taking.

Kernels compared side by side take turns: each turn is a pause (thread pools of
the previous kernel spin-wait for a while after a call and would steal this
one's cores on a small machine), untimed warm-up calls, then timed samples back
to back, as a user's loop makes them. Turns go round-robin over several passes,
so slow drifts of a shared machine hit every kernel alike. Medians are reported.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable


class WallClock:
    """time.perf_counter around the calls: for the CPU, where a call returns
    when its work is done."""

    name = "wall clock"

    def seconds(self, fn: Callable[[], object], calls: int = 1) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls


class CudaEventClock:
    """A pair of CUDA events on torch's current stream around the calls: GPU time
    from the first launch to the last kernel's end. With one call per sample the
    GPU idles while Python prepares the launch, so launch overhead counts in full;
    with several, calls queue as in a training loop and overlap it.

    A GPU left idle for a moment (while the host checks a result against float64,
    say) drops its SM clock (an H100: 1980 -> 345 MHz) and takes a while of steady
    work to come back: a handful of warm-up calls of a 0.2 ms kernel is not enough,
    and a kernel timed right after them ran at about half its steady speed. So every turn first
    keeps the GPU busy with the kernel for `warmup_s` seconds (busy())."""

    name = "CUDA events"

    def __init__(self, torch, warmup_s: float = 0.3):
        self.torch = torch
        self.warmup_s = warmup_s

    def busy(self, fn: Callable[[], object]) -> None:
        """Calls fn, waiting for each, until warmup_s seconds have passed."""
        end = time.perf_counter() + self.warmup_s
        while time.perf_counter() < end:
            fn()
            self.torch.cuda.synchronize()

    def seconds(self, fn: Callable[[], object], calls: int = 1) -> float:
        start = self.torch.cuda.Event(enable_timing=True)
        end = self.torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls


def take_turns(fns: dict[str, Callable[[], object]], *, repeat: int, passes: int = 1, warmup: int = 1,
               settle: float = 0.0, calls_per_sample: int = 1, clock=None) -> dict[str, list[float]]:
    """Seconds per call of each fn: `passes` round-robin passes, each giving every fn
    a turn of `settle` seconds of pause, `warmup` untimed calls (then, with a clock
    that has busy(), its untimed seconds of calls) and `repeat` timed samples of
    `calls_per_sample` calls. Returns every sample, by name."""
    clock = clock or WallClock()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(passes):
        for name, fn in fns.items():
            if settle:
                time.sleep(settle)
            for _ in range(warmup):
                fn()
            if hasattr(clock, "busy"):
                clock.busy(fn)
            samples[name] += [clock.seconds(fn, calls_per_sample) for _ in range(repeat)]
    return samples


def medians(samples: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(ts) for name, ts in samples.items()}
