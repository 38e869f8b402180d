"""Where the library call's time goes when it is timed as dev/gpu_flash_versions.py times it
(a sample: a CUDA event, 5 calls back to back, an event, a wait for it; the functions in
turns): per call of a sample, the host's time of each step of attnkern.attention's fast path
(perf_counter_ns: the call's entry, the cuLaunchKernel call and its return, the call's return;
the frontend's own entries were stamped too when the quick path was found, by patching private
functions, which the measurement no longer does: it uses attnkern's public names only) and the GPU's time from the sample's start event to an event
recorded after each call (so the GPU's wait for the first launch shows). The same for the
prepared launch alone, for a torch control (torch.empty_like + the prepared launch) and for
the library call without its quick path (library_whole: attention()'s checks first, then the plan).

Settings, each in turns with the prepared kernel at (1, 16, N, D) bfloat16:
  alone      the library and the prepared launch only
  torch      with torch's SDPA backends forced one by one in the turns (gpu_flash_versions.py)
  torch_gc   as torch, with Python's garbage collector off
  torch_pin  as torch, the process pinned to one CPU
  busy       as torch, without the wait at a sample's end (the GPU drains once a round of all the
             functions: the host's time a call while the GPU is busy)

    python3 dev/gpu_library_host.py OUT.json [--shapes 4096x128,16384x128] [--runs 15]
        [--settings alone,torch,torch_gc,torch_pin,busy]"""

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

import attnkern
from attnkern.backends import cuda
from attnkern.backends.cuda import launch
from gpu_flash_versions import Kernel, inputs, parse_config, sdpa_backends

CALLS = 5
NS = time.perf_counter_ns
STAMPS: list = []  # (label, ns) of the current call


def instrument():
    """Stamps around every cuLaunchKernel."""
    real_launch = launch.RawKernel.__call__

    def raw_call(self, grid, block, params):
        STAMPS.append(("launch", NS()))
        real_launch(self, grid, block, params)
        STAMPS.append(("launched", NS()))

    launch.RawKernel.__call__ = raw_call


def sample(fn, wait=True):
    """One sample of CALLS calls: per call its stamps relative to its start (µs), and a function
    that adds the GPU's µs from the start event to the event after each call (once they are in).
    wait: wait for the last event (as the timing does), else leave the GPU busy."""
    start = torch.cuda.Event(enable_timing=True)
    after = [torch.cuda.Event(enable_timing=True) for _ in range(CALLS)]
    calls = []
    start.record()
    for i in range(CALLS):
        STAMPS.clear()
        t0 = NS()
        fn()
        t1 = NS()
        after[i].record()
        calls.append({"host_us": (t1 - t0) / 1e3, **{k: (t - t0) / 1e3 for k, t in STAMPS}})
    if wait:
        after[-1].synchronize()

    def finish():
        for i, c in enumerate(calls):
            c["gpu_us"] = start.elapsed_time(after[i]) * 1e3
        return calls

    return finish


def summary(samples):
    """Medians over samples, per call index: host_us, the step stamps, gpu_us."""
    out = []
    for i in range(CALLS):
        keys = samples[0][i].keys()
        out.append({k: round(statistics.median(s[i].get(k, float("nan")) for s in samples), 2) for k in keys})
    return out


def run(fns, runs, wait=True):
    for fn in fns.values():  # warm: 0.1 s of calls each, as CudaEventClock.busy
        end = time.perf_counter() + 0.1
        while time.perf_counter() < end:
            fn()
            torch.cuda.synchronize()
    got = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            got[name].append(sample(fn, wait))
        torch.cuda.synchronize()  # (without wait: the queue drains once a round, not once a sample)
    return {name: summary([finish() for finish in s]) for name, s in got.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shapes", default="4096x128,16384x128")
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--settings", default="alone,torch,torch_gc,torch_pin,busy")
    a = ap.parse_args()
    instrument()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "calls": CALLS, "rows": []}
    for shape in a.shapes.split(","):
        n, d = map(int, shape.split("x"))
        q, k, v = inputs((1, 16, n, d), "bfloat16", n)
        out = torch.empty_like(q)

        def library():
            return attnkern.attention(q, k, v, kernel="cuda.flash", check_finite=False)

        library()  # compiles the default division's kernel, which the prepared launch then takes
        torch.cuda.synchronize()
        prepared = Kernel(parse_config("default", d, "bfloat16"), d, "bfloat16").prepared(q, k, v, out, False,
                                                                                        1 / d**0.5)

        def control():  # a torch allocation and the prepared launch: the library's bare minimum
            torch.empty_like(q)
            prepared()

        def library_whole():  # attention()'s whole way: its checks, then the plan (before the quick path)
            cuda.QUICK_PATH = False
            try:
                return library()
            finally:
                cuda.QUICK_PATH = True

        ours = {"library": library, "library_whole": library_whole, "prepared": prepared, "control": control}
        torch_fns = {name: (lambda call=call: call(q, k, v, False)) for name, call in sdpa_backends().items()}
        settings, wanted = {}, a.settings.split(",")
        if "alone" in wanted:
            settings["alone"] = run(ours, a.runs)
        if "torch" in wanted:
            settings["torch"] = run({**torch_fns, **ours}, a.runs)
        if "torch_gc" in wanted:
            gc.disable()
            try:
                settings["torch_gc"] = run({**torch_fns, **ours}, a.runs)
            finally:
                gc.enable()
        if "torch_pin" in wanted:
            cpus = os.sched_getaffinity(0)
            os.sched_setaffinity(0, {min(cpus)})
            try:
                settings["torch_pin"] = run({**torch_fns, **ours}, a.runs)
            finally:
                os.sched_setaffinity(0, cpus)
        if "busy" in wanted:
            settings["busy"] = run({**torch_fns, **ours}, a.runs, wait=False)
        for name, got in settings.items():
            for fn, calls in got.items():
                row = {"n": n, "d": d, "setting": name, "fn": fn, "calls": calls}
                result["rows"].append(row)
                if fn in ours or fn == "torch.cudnn":
                    print(json.dumps({"n": n, "setting": name, "fn": fn,
                                      "host_us": [c["host_us"] for c in calls],
                                      "gpu_us": [c["gpu_us"] for c in calls],
                                      **({"first": calls[0]} if fn.startswith("library") else {})}), flush=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
