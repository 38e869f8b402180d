"""triton.flash's forward on Hopper across batches, against every torch SDPA backend, with the
finite scan's cost and candidate configs of the Hopper variant, in one process.

    python3 dev/trihop_sweep.py --out OUT.json [--batches 1,2,4,8] [--ns 2048,4096,8192,16384]
        [--dims 64,128] [--runs 3] [--reps 8] [--busy 0.01] [--deadline S] [--warm-slice i/n]

Per row ((B, 16, N, D) bfloat16, causal and not), in turns sample by sample, the order rotated
each sample, the scans' turns after the others' (CUDA events, one call per sample, every
function first kept busy --busy s; medians):
  lib            attnkern.attention(q, k, v, causal=..., kernel="triton.flash", check_finite=False)
  lib checked    the same with check_finite=True (the default: the finite scan of q, k, v and the
                 output, and the wait for its flags, in the call)
  straight       flash.launch at the table's config (the kernel launched directly)
  cand ...       flash.launch with flash.OVERRIDE["forward_hopper"] = a candidate of CANDIDATES
  scan           the finite scan alone (launch.scan_launch's kernel on q, k, v and the output,
                 prepared as the fast path launches it)
  scan old       the scan before 64-bit words (OLD_SCAN: 2-byte loads, a branch each), likewise
  torch ...      SDPA under sdpa_kernel: CUDNN_ATTENTION, FLASH_ATTENTION, EFFICIENT_ATTENTION
x: the fastest torch backend's time over each function's. Correctness, at the first N of each
(D, mask, B): 256 sampled query rows of every head of lib and of each candidate against float64 beside cuDNN's error on the same rows (passes within max(2 x cuDNN's, 4 u));
lib checked's output equal to lib's bit for bit. The grid --runs times; --deadline stops
between rows (the JSON says where). --warm-slice i/n compiles slice i of the kernels (worker
processes that fill Triton's cache while the tests run).

    python3 dev/trihop_sweep.py --summary OUT.json

prints the tables of docs/triton.md from a sweep's JSON: per row the ratios over the runs
(min-max (median)), the candidates' gain over the table's config by the table config's time,
and the finite scan's times and bandwidth.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_hopper_sweep import HEADS, _launcher, _reference_rows  # noqa: E402

import attnkern  # noqa: E402
from attnkern.backends.triton import flash  # noqa: E402
from attnkern_bench.timing import CudaEventClock  # noqa: E402

# the Hopper variant's candidates per (D, causal) beside the table's entry: configs of
# dev/triton_hopper_sweep.py's CONFIGS (they compile for sm_90 without spills) that came
# closest to the table's at batch 1 there
CANDIDATES = {
    (64, False): [(128, 64, 8, 3, 0), (128, 128, 8, 3, 1), (128, 64, 4, 4, 0)],
    (64, True): [(128, 64, 8, 3, 1), (128, 64, 8, 3, 0), (128, 64, 4, 4, 0)],
    (128, False): [(128, 128, 8, 3, 0), (128, 64, 8, 3, 1), (128, 64, 8, 4, 0)],
    (128, True): [(128, 128, 8, 3, 0), (128, 64, 8, 3, 1), (128, 64, 8, 4, 0)],
}


def _name(cfg):
    return "cand %dx%d w%d s%d%s" % (*cfg[:4], " ws" if cfg[4] else "")


def _straight(q, k, v, out, causal, cfg=None):
    """flash.launch on (B H, N, D) views at the table's config, or a candidate's."""
    return _launcher(q, k, v, out, None, causal, cfg or "table")


def _old_scan_kernel():
    """The finite scan before 64-bit words: one element a step, a return on the first hit."""
    from numba import cuda

    @cuda.jit(device=True)
    def seen(a, n, mask, start, stride):
        for i in range(start, n, stride):
            if (a[i] & mask) == mask:
                return True
        return False

    @cuda.jit
    def scan(a0, a1, a2, a3, n0, n1, n2, n3, mask0, mask1, mask2, mask3, flags):
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        if seen(a0, n0, mask0, start, stride):
            flags[0] = 1
        if seen(a1, n1, mask1, start, stride):
            flags[1] = 1
        if seen(a2, n2, mask2, start, stride):
            flags[2] = 1
        if seen(a3, n3, mask3, start, stride):
            flags[3] = 1
    return scan


OLD_SCAN = []


def _scans(tensors):
    """(new, old): the finite scan of the four tensors prepared as the fast path launches it,
    and the scan before 64-bit words, each a function that launches it (no wait)."""
    import ml_dtypes

    from attnkern.backends.cuda import launch
    from attnkern.backends.cuda.arrays import GpuArray

    arrays = [GpuArray((t.numel(),), np.dtype(ml_dtypes.bfloat16), None, ptr=t.data_ptr(), owner=t) for t in tensors]
    kernel, grid, block, args = launch.scan_launch(arrays)
    flags = args[-1]
    launch.launch(kernel, grid, block, *args)  # compiled, and its raw kernel kept
    new = launch.Prepared(launch.raw_kernel(kernel), grid, block, args)
    if not OLD_SCAN:
        OLD_SCAN.append(_old_scan_kernel())
    ints = [GpuArray((a.size,), np.uint16, None, ptr=a.ptr, owner=a.owner) for a in arrays]
    blocks = max(1, min(launch.SCAN_BLOCKS, -(-max(a.size for a in ints) // launch.SCAN_THREADS)))
    old_args = (*ints, *(a.size for a in ints), *([np.uint16(0x7F80)] * 4), flags)
    launch.launch(OLD_SCAN[0], blocks, launch.SCAN_THREADS, *old_args)
    old = launch.Prepared(launch.raw_kernel(OLD_SCAN[0]), blocks, launch.SCAN_THREADS, old_args)
    return new, old


def _inputs(b, n, d, seed):
    g = torch.Generator("cuda").manual_seed(seed)  # drawn on the GPU: (8, 16, 16384, 128) on the host takes seconds
    return [torch.randn(b, HEADS, n, d, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3)]


def _errors(q, k, v, causal, outs):
    """The largest error of each output in outs (name -> tensor) on 256 sampled query rows of
    every head against float64."""
    b, _, n, d = q.shape
    sample = torch.randperm(n, generator=torch.Generator().manual_seed(n))[:256].cuda()
    qh, kh, vh = (x.reshape(b * HEADS, n, d) for x in (q, k, v))
    ref = _reference_rows(qh, kh, vh, causal, sample)
    return {name: (out.reshape(b * HEADS, n, d)[:, sample].double() - ref).abs().max().item()
            for name, out in outs.items()}


def warm(a, part, parts):
    jobs = [(d, causal, cfg) for d in a.dims for causal in (False, True)
            for cfg in [None, "lib"] + CANDIDATES[d, causal]]
    for i, (d, causal, cfg) in enumerate(jobs):
        if i % parts != part:
            continue
        # N = 1024: the long-sequence class, int arguments divisible by 16 as at N = 2048-16384
        q, k, v = _inputs(2, 1024, d, i)
        try:
            if cfg == "lib":
                for check in (False, True):
                    attnkern.attention(q, k, v, causal=causal, kernel="triton.flash", check_finite=check)
            else:
                qh, kh, vh = (x.reshape(2 * HEADS, 1024, d) for x in (q, k, v))
                _straight(qh, kh, vh, torch.empty_like(qh), causal, cfg)()
            torch.cuda.synchronize()
        except Exception as exc:  # a config that does not compile: the sweep reports it
            print("warm", d, causal, cfg, repr(exc)[:300], flush=True)


def row(a, b, n, d, causal, result, clock):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    q, k, v = _inputs(b, n, d, n + d + b)
    qh, kh, vh = (x.reshape(b * HEADS, n, d) for x in (q, k, v))
    outs = {}
    fns = {"lib": lambda: attnkern.attention(q, k, v, causal=causal, kernel="triton.flash", check_finite=False),
           "lib checked": lambda: attnkern.attention(q, k, v, causal=causal, kernel="triton.flash")}
    outs["straight"] = torch.empty_like(qh)
    fns["straight"] = _straight(qh, kh, vh, outs["straight"], causal)
    for cfg in CANDIDATES[d, causal]:
        outs[_name(cfg)] = torch.empty_like(qh)
        fns[_name(cfg)] = _straight(qh, kh, vh, outs[_name(cfg)], causal, cfg)
    for be in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        def theirs(be=be):
            with sdpa_kernel(be), torch.no_grad():
                return sdpa(q, k, v, is_causal=causal)
        fns[f"torch {be.name}"] = theirs
    failed = {}
    for name, fn in list(fns.items()):
        try:
            fn()
            torch.cuda.synchronize()
        except Exception as exc:
            failed[name] = repr(exc)[:300]
            del fns[name]
    ours = fns["lib"]()
    new, old = _scans((q, k, v, ours))
    fns["scan"], fns["scan old"] = new, old
    checked = result["checked"]
    key = f"{d} {causal} {b}"
    if key not in checked and "torch CUDNN_ATTENTION" in fns:  # correctness, once per (D, mask, B)
        got = {"lib": ours, "torch": fns["torch CUDNN_ATTENTION"]()}
        got.update((name, outs[name]) for name in outs if name.startswith("cand") and name in fns)
        errs = _errors(q, k, v, causal, got)
        bound = max(2 * errs["torch"], 4 * 2.0 ** -8)
        checked[key] = {"n": n, "cudnn_err": errs.pop("torch"), "bound": bound,
                        "err": errs, "passed": {name: e <= bound for name, e in errs.items()},
                        "checked_equals_unchecked": torch.equal(fns["lib checked"](), ours),
                        "straight_equals_lib": torch.equal(outs["straight"], ours.reshape(b * HEADS, n, d))}
        print("check", key, checked[key], flush=True)
    passed = checked.get(key, {}).get("passed", {})
    for name in list(fns):  # a candidate that failed its check is not timed
        if name.startswith("cand") and not passed.get(name, True):
            del fns[name]
    for fn in fns.values():
        clock.busy(fn)
    samples = {name: [] for name in fns}
    # the attention calls in turns, the order rotated each sample: at the heaviest rows (10-30 ms a
    # call) the first call of a fixed order, after the light scans, ran up to 18% faster than the
    # same kernel later in the turn (the GPU's clock drops under sustained power); the scans after
    heavy = [name for name in fns if not name.startswith("scan")]
    for rep in range(a.reps):
        for name in heavy[rep % len(heavy):] + heavy[:rep % len(heavy)]:
            samples[name].append(clock.seconds(fns[name]))
    for _ in range(a.reps):
        for name in ("scan", "scan old"):
            samples[name].append(clock.seconds(fns[name]))
    ms = {name: statistics.median(t) * 1e3 for name, t in samples.items()}
    best = min((t, name) for name, t in ms.items() if name.startswith("torch"))
    flops = 4 * b * HEADS * n * n * d * (0.5 if causal else 1)
    return {"batch": b, "d": d, "causal": causal, "n": n, "ms": {k_: round(t, 4) for k_, t in ms.items()},
            "fastest_torch": best[1],
            "x": {k_: round(best[0] / t, 3) for k_, t in ms.items() if not k_.startswith(("torch", "scan"))},
            "tflops": {k_: round(flops / t / 1e9, 1) for k_, t in ms.items() if not k_.startswith("scan")},
            "failed": failed}


def _band(ms):
    return next(name for top, name in ((0.4, "< 0.4 ms"), (1, "0.4-1 ms"), (2.5, "1-2.5 ms"), (5, "2.5-5 ms"),
                                       (1e9, "> 5 ms")) if ms < top)


def summary(path):
    r = json.load(open(path))
    rows = {}
    for run in r["runs"]:
        for x in run:
            if "error" not in x:
                rows.setdefault((x["d"], x["causal"], x["batch"]), {}).setdefault(x["n"], []).append(x)
    ns = sorted({n for per in rows.values() for n in per})

    def cell(xs, name):
        v = [x["x"][name] for x in xs]
        return "%.2f-%.2f (%.2f)" % (min(v), max(v), statistics.median(v)) if len(v) > 1 else "%.2f" % v[0]

    print("| D | mask | B | " + " | ".join(f"N {n}" for n in ns) + " | default, N " + " / ".join(map(str, ns)) +
          f" | TFLOP/s at {ns[-1]} (lib / torch's fastest) |")
    print("|---" * (4 + len(ns)) + "|---|")
    for (d, causal, b), per in sorted(rows.items()):
        last = per[ns[-1]]
        tf = statistics.median(x["tflops"]["lib"] for x in last), \
            statistics.median(x["tflops"][x["fastest_torch"]] for x in last)
        default = " / ".join("%.2f" % statistics.median(x["x"]["lib checked"] for x in per[n]) for n in ns)
        print(f"| {d} | {'causal' if causal else 'none'} | {b} | " + " | ".join(cell(per[n], "lib") for n in ns) +
              f" | {default} | {tf[0]:.0f} / {tf[1]:.0f} |")
    print()
    gains = {}
    for (d, causal, b), per in rows.items():
        for xs in per.values():
            for x in xs:
                for name, t in x["ms"].items():
                    if name.startswith("cand"):
                        gains.setdefault((d, causal, name), {}).setdefault(_band(x["ms"]["straight"]), []).append(
                            x["ms"]["straight"] / t)
    bands = ["< 0.4 ms", "0.4-1 ms", "1-2.5 ms", "2.5-5 ms", "> 5 ms"]
    print("| D | mask | candidate | " + " | ".join(bands) + " |")
    print("|---" * (3 + len(bands)) + "|")
    for (d, causal, name), per in sorted(gains.items()):
        print(f"| {d} | {'causal' if causal else 'none'} | {name[5:]} | " + " | ".join(
            "%.3f (%.2f-%.2f)" % (statistics.median(per[k]), min(per[k]), max(per[k])) if k in per else "-"
            for k in bands) + " |")
    print()
    print("| B x 16 x N x D | scan, ms (GB/s) | before, ms (GB/s) |")
    print("|---|---|---|")
    seen = set()
    for (d, causal, b), per in sorted(rows.items()):
        for n, xs in sorted(per.items()):
            size = 4 * b * HEADS * n * d * 2
            if size in seen or causal:
                continue
            seen.add(size)
            new = statistics.median(x["ms"]["scan"] for x in xs)
            old = statistics.median(x["ms"]["scan old"] for x in xs)
            print(f"| {b} x 16 x {n} x {d} | {new:.3f} ({size / new / 1e6:.0f}) | {old:.3f} ({size / old / 1e6:.0f}) |")


def main():
    if sys.argv[1:2] == ["--summary"]:
        summary(sys.argv[2])
        return
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--ns", default="2048,4096,8192,16384")
    p.add_argument("--dims", default="64,128")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--busy", type=float, default=0.01)
    p.add_argument("--deadline", type=float, default=1e9, help="seconds: no row starts after this")
    p.add_argument("--warm-slice", default="")
    a = p.parse_args()
    a.batches, a.ns, a.dims = ([int(x) for x in s.split(",")] for s in (a.batches, a.ns, a.dims))
    if a.warm_slice:
        part, parts = (int(x) for x in a.warm_slice.split("/"))
        warm(a, part, parts)
        return
    import triton

    start = time.perf_counter()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "hopper_table": {str(k): v for k, v in flash.HOPPER_TABLE.items()},
              "candidates": {f"{d} {c}": v for (d, c), v in CANDIDATES.items()}, "reps": a.reps, "busy_s": a.busy,
              "runs": [], "checked": {}, "stopped": None}

    def save():
        result["hopper_failed"] = sorted(map(repr, flash.HOPPER_FAILED))
        if a.out:
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)

    clock = CudaEventClock(torch, warmup_s=a.busy)
    for run in range(a.runs):
        result["runs"].append([])
        for d in a.dims:
            for causal in (False, True):
                for b in a.batches:
                    for n in a.ns:
                        if time.perf_counter() - start > a.deadline:
                            result["stopped"] = f"deadline before run {run} row {(d, causal, b, n)}"
                            save()
                            return
                        try:
                            r = row(a, b, n, d, causal, result, clock)
                        except Exception as exc:  # recorded; the other rows still run
                            r = {"batch": b, "d": d, "causal": causal, "n": n, "error": repr(exc)[:500], "x": {},
                                 "ms": {}, "fastest_torch": None}
                        result["runs"][-1].append(r)
                        print(run, d, causal, b, n, r["x"], r["fastest_torch"], "scan ms",
                              r["ms"].get("scan"), r["ms"].get("scan old"), flush=True)
                        save()
                        torch.cuda.empty_cache()
    save()


if __name__ == "__main__":
    main()
