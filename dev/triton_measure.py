"""triton.flash on one GPU against torch's SDPA in the same process: per-call time at a tiny
shape, and forward+backward time at long sequences.

    python3 dev/triton_measure.py [--parts overhead,backward] [--quick]

overhead: attnkern.attention(kernel="triton.flash") on device-resident torch tensors at
    (1, 8, 16, 64), bfloat16 and float32, check_finite True (the default) and False, beside
    torch's SDPA: 30 warm-up calls each, then 20 samples of 5 back-to-back calls each (wall
    clock, one synchronize per sample), the kinds taking turns sample by sample; medians
    per call in microseconds. At N = 16 the GPU work is a few microseconds: this is the
    host's cost of a call.
backward: forward + backward at (B, 16, N, D) bfloat16, causal and not: triton.flash through
    torch autograd (attention with requires_grad, then .backward) against each of torch's SDPA
    backends (cuDNN, FLASH, EFFICIENT; the fastest is the baseline): 3 warm-up steps (the first
    autotunes), then 10 steps timed each between CUDA events, medians; TFLOP/s counting
    4 B H N^2 D for the forward and 2.5 times that for the backward (half with causal).
configs: each candidate config (CANDIDATES below) of each kernel (forward, dq, dkdv) at
    (1, 16, 8192, D), D 64 and 128, causal and not, bfloat16 (--config-dtypes), launched straight
    through flash.launch / launch_backward with flash.OVERRIDE set: 2 warm-up launches, 10 timed
    between CUDA events, medians; the fastest per key is what flash.TABLE should hold.
tables: (1, 16, N, D) N 2048-16384 (--ns), D 64 and 128, causal and not, bfloat16 and float16:
    forward, backward alone and forward+backward of triton.flash's kernels launched straight
    (the table's configs: "new"; with --old PATH a copy of an earlier flash.py, loaded as its own
    module and autotuned as it was: "old"), of attention()+backward through torch autograd
    ("attnkern"), and of each of torch's SDPA backends (cuDNN, FLASH, EFFICIENT); the kinds
    take turns rep by rep (3 warm-up, 10 timed between CUDA events, medians); the forward table
    --repeats times (the spread between runs). x_fastest: the fastest torch backend's time over ours.
warm: compile (launch once at N = 256, which Triton specializes as it does 8192) the candidates of
    --warm-slice i/n, for worker processes that fill Triton's cache before configs times them.
"""

import argparse
import importlib.util
import json
import statistics
import time

import torch

import attnkern


def per_call(fns, warmup=30, samples=20, calls=5):
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = {name: [] for name in fns}
    for _ in range(samples):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / calls)
    return {name: round(statistics.median(t) * 1e6, 1) for name, t in times.items()}


def overhead():
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = (torch.randn(1, 8, 16, 64, device="cuda", dtype=dtype) for _ in range(3))
        fns = {"torch.sdpa": lambda: sdpa(q, k, v),
               "triton.flash": lambda: attnkern.attention(q, k, v, kernel="triton.flash"),
               "triton.flash check_finite=False": lambda: attnkern.attention(q, k, v, kernel="triton.flash",
                                                                             check_finite=False)}
        rows.append({"dtype": str(dtype), "us_per_call": per_call(fns)})
        print(rows[-1], flush=True)
    # forward+backward through torch autograd (requires_grad inputs, .backward), bfloat16, and a
    # cProfile of triton.flash's steps: the host's cost of a training step's attention
    q, k, v, dout = (torch.randn(1, 8, 16, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [x.requires_grad_() for x in (q, k, v)]
    steps = {"torch.sdpa": lambda: sdpa(*leaves).backward(dout),
             "triton.flash": lambda: attnkern.attention(*leaves, kernel="triton.flash",
                                                        check_finite=False).backward(dout)}
    rows.append({"dtype": "torch.bfloat16", "autograd_us_per_step": per_call(steps)})
    print(rows[-1], flush=True)
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        steps["triton.flash"]()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    rows.append({"autograd_profile_200_steps": text.getvalue()[-8000:]})
    print(text.getvalue()[-5000:], flush=True)
    return rows


def events(fn, warmup=3, reps=10):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def backward(shapes):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = []
    for b, h, n, d in shapes:
        for causal in (False, True):
            q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            leaves = [x.requires_grad_() for x in (q, k, v)]

            def ours():
                attnkern.attention(*leaves, causal=causal, kernel="triton.flash", check_finite=False).backward(dout)

            def theirs(backend):
                def step():
                    with sdpa_kernel(backend):
                        sdpa(*leaves, is_causal=causal).backward(dout)
                return step

            flops = 4 * b * h * n * n * d * 3.5 * (0.5 if causal else 1)
            row = {"shape": [b, h, n, d], "causal": causal}
            for name, fn in [("triton.flash", ours)] + [(f"torch {be.name}", theirs(be)) for be in
                                                        (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                                         SDPBackend.EFFICIENT_ATTENTION)]:
                try:
                    row[name] = round(flops / events(fn) / 1e12, 1)
                except RuntimeError as exc:  # a backend that does not take this call
                    row[name] = str(exc).splitlines()[0][:80]
            best = max(x for key, x in row.items() if key.startswith("torch") and isinstance(x, float))
            row["x_fastest_torch"] = round(row["triton.flash"] / best, 2)
            rows.append(row)
            print(row, flush=True)
    return rows


# the configs the sweep times, (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and head size:
# those that compile for sm_90 without register spills (dev/triton_compile_check.py, bfloat16)
CANDIDATES = {
    ("forward", 64): [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 4, 4),
                      (128, 128, 4, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 4), (64, 128, 4, 3)],
    ("forward", 128): [(128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 4),
                       (64, 128, 4, 3), (128, 32, 8, 3), (64, 64, 4, 4)],
    ("dq", 64): [(128, 32, 4, 3), (128, 32, 4, 5), (128, 32, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3),
                 (64, 64, 8, 3), (64, 32, 4, 2), (128, 32, 8, 4)],
    ("dq", 128): [(128, 32, 8, 3), (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3), (64, 64, 8, 3), (64, 32, 4, 2),
                  (128, 32, 8, 4), (128, 32, 8, 2)],
    ("dkdv", 64): [(32, 128, 8, 3), (64, 128, 8, 3), (32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 8, 2), (32, 64, 8, 3),
                   (32, 32, 4, 2), (16, 128, 4, 3), (32, 128, 8, 4), (64, 64, 8, 3)],
    ("dkdv", 128): [(32, 128, 8, 3), (32, 64, 4, 3), (32, 64, 8, 3), (32, 32, 4, 2), (32, 128, 8, 2),
                    (64, 64, 8, 3), (16, 128, 8, 3), (32, 128, 8, 4)],
}
KERNELS = ("forward", "dq", "dkdv")


def _flat(b, h, n, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b * h, n, d, generator=g).to(dtype).cuda() for _ in range(4)]


def _kernels(flash, q, k, v, dout, causal, dtype_name):
    """(forward, backward) launches of a flash module's kernels on (batch, n, d) q, k, v."""
    batch, n, d = q.shape
    out, lse = torch.empty_like(q), torch.empty(batch, n, dtype=q.dtype, device="cuda")
    grads = [torch.empty_like(x) for x in (q, k, v)]
    scratch = torch.empty(2, batch, n, dtype=torch.float32, device="cuda")
    shape = (batch, batch, n, n, d, d, causal, d ** -0.5, dtype_name, 1, None)

    def forward():
        flash.launch(q, k, v, out, lse, None, *shape)

    def backward():
        flash.launch_backward(q, k, v, out, dout, lse, *grads, None, scratch[0], scratch[1], *shape)

    return forward, backward


def turns(fns, warmup=3, reps=10):
    """Median seconds of each fn, timed between CUDA events, the fns taking turns rep by rep."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def _sweep_cases(dtypes):
    return [(kernel, cfg, d, causal, dtype) for dtype in dtypes for d in (64, 128) for causal in (False, True)
            for kernel in KERNELS for cfg in CANDIDATES[kernel, d]]


def warm(dtypes, part, parts, table_dtypes=("float16",), old_path=None):
    """Launch every sweep case (dtypes), the table's configs (table_dtypes) and, with old_path,
    the old module's autotuned kernels (N = 1024: its long-sequence configs), those of slice
    part/parts once at a small N (fills Triton's cache for configs and tables)."""
    from attnkern.backends.triton import flash

    cases = [("sweep", c) for c in _sweep_cases([x for x in dtypes if x])]
    cases += [("table", (None, None, d, causal, dtype)) for dtype in table_dtypes for d in (64, 128)
              for causal in (False, True)]
    if old_path:
        cases += [("old", (None, None, d, causal, dtype)) for dtype in ("bfloat16", "float16") for d in (64, 128)
                  for causal in (False, True)]
    old = _load_old(old_path) if old_path else None
    for i, (what, (kernel, cfg, d, causal, dtype)) in enumerate(cases):
        if i % parts != part:
            continue
        q, k, v, dout = _flat(1, 2, 1024 if what == "old" else 256, d, getattr(torch, dtype), i)
        forward, backward = _kernels(old if what == "old" else flash, q, k, v, dout, causal, dtype)
        flash.OVERRIDE.clear()
        try:
            forward()
            if what == "sweep":
                flash.OVERRIDE[kernel] = cfg
                (forward if kernel == "forward" else backward)()
            else:
                backward()
            torch.cuda.synchronize()
        except Exception as exc:  # out of resources, a compile error: configs reports it
            print(what, kernel, cfg, d, causal, dtype, repr(exc)[:200], flush=True)
    flash.OVERRIDE.clear()


def configs(dtypes, n=8192):
    """Time every candidate of every kernel at (1, 16, n, D); returns rows and the best per key."""
    from attnkern.backends.triton import flash

    rows, best = [], {}
    for dtype in dtypes:
        for d in (64, 128):
            for causal in (False, True):
                q, k, v, dout = _flat(1, 16, n, d, getattr(torch, dtype), d)
                forward, backward = _kernels(flash, q, k, v, dout, causal, dtype)
                flash.OVERRIDE.clear()
                forward()  # out and lse for the backward's candidates
                for kernel in KERNELS:
                    fns = {}
                    for cfg in CANDIDATES[kernel, d]:
                        def step(cfg=cfg, kernel=kernel):
                            flash.OVERRIDE[kernel] = cfg
                            try:
                                (forward if kernel == "forward" else backward)()
                            finally:
                                flash.OVERRIDE.pop(kernel)
                        try:
                            step()
                            torch.cuda.synchronize()
                            fns[cfg] = step
                        except Exception as exc:
                            rows.append({"kernel": kernel, "config": cfg, "d": d, "causal": causal, "dtype": dtype,
                                         "failed": repr(exc)[:200]})
                    # the backward's time is both kernels': the other one runs the table's config
                    times = turns(fns, warmup=2, reps=10)
                    for cfg, t in times.items():
                        rows.append({"kernel": kernel, "config": cfg, "d": d, "causal": causal, "dtype": dtype,
                                     "ms": round(t * 1e3, 4)})
                    if times:
                        top = min(times, key=times.get)
                        best[f"{kernel} {dtype} d={d} causal={causal}"] = {"config": top,
                                                                            "ms": round(times[top] * 1e3, 4)}
                        print(kernel, dtype, d, causal, sorted((round(t * 1e3, 3), c) for c, t in times.items())[:4],
                              flush=True)
    return {"rows": rows, "best": best}


def _load_old(path):
    spec = importlib.util.spec_from_file_location("attnkern_old_triton_flash", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tables(ns, dims, dtypes, repeats, old_path=None, rows=None, save=lambda: None):
    """The tables' rows (appended to rows, save() after each)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attnkern.backends.triton import flash

    old = _load_old(old_path) if old_path else None
    sdpa = torch.nn.functional.scaled_dot_product_attention
    backends = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
    rows = [] if rows is None else rows
    for dtype in dtypes:
        for d in dims:
            for n in ns:
                for causal in (False, True):
                    tdtype = getattr(torch, dtype)
                    q, k, v, dout = _flat(1, 16, n, d, tdtype, n + d)
                    fns = {"fwd": {}, "bwd": {}, "fwd+bwd": {}}
                    mods = [("new", flash)] + ([("old", old)] if old else [])
                    for name, mod in mods:
                        fwd, bwd = _kernels(mod, q, k, v, dout, causal, dtype)
                        fwd()
                        fns["fwd"][name], fns["bwd"][name] = fwd, bwd
                        fns["fwd+bwd"][name] = lambda fwd=fwd, bwd=bwd: (fwd(), bwd())
                    q4, k4, v4, do4 = (x.view(1, 16, n, d) for x in (q, k, v, dout))
                    leaves = [x.detach().clone().requires_grad_() for x in (q4, k4, v4)]

                    def ours_autograd():
                        attnkern.attention(*leaves, causal=causal, kernel="triton.flash",
                                           check_finite=False).backward(do4)
                    fns["fwd+bwd"]["attnkern"] = ours_autograd
                    for be in backends:
                        name = f"torch {be.name}"
                        try:
                            with sdpa_kernel(be):
                                out = sdpa(*leaves, is_causal=causal)
                                torch.autograd.grad(out, leaves, do4)
                        except RuntimeError:
                            continue

                        def fwd(be=be):
                            with sdpa_kernel(be), torch.no_grad():
                                sdpa(q4, k4, v4, is_causal=causal)

                        def both(be=be):
                            with sdpa_kernel(be):
                                torch.autograd.grad(sdpa(*leaves, is_causal=causal), leaves, do4)

                        with sdpa_kernel(be):
                            kept = sdpa(*leaves, is_causal=causal)

                        def bwd(kept=kept):
                            torch.autograd.grad(kept, leaves, do4, retain_graph=True)
                        fns["fwd"][name], fns["bwd"][name], fns["fwd+bwd"][name] = fwd, bwd, both
                    flops = 4 * 16 * n * n * d * (0.5 if causal else 1)
                    row = {"dtype": dtype, "n": n, "d": d, "causal": causal}
                    for what, group in fns.items():
                        runs = repeats if what == "fwd" else 1
                        per = [turns(group) for _ in range(runs)]
                        mult = {"fwd": 1, "bwd": 2.5, "fwd+bwd": 3.5}[what]
                        for name in group:
                            ms = [round(p[name] * 1e3, 4) for p in per]
                            row[f"{what} {name} ms"] = ms if runs > 1 else ms[0]
                            row[f"{what} {name} TFLOPs"] = round(flops * mult / statistics.median(
                                [p[name] for p in per]) / 1e12, 1)
                        torch_best = [statistics.median([p[x] for p in per]) for x in group if x.startswith("torch")]
                        for name in ("new", "old", "attnkern"):
                            if name in group and torch_best:
                                ratios = [round(min(p[x] for x in group if x.startswith("torch")) / p[name], 3)
                                          for p in per]
                                row[f"{what} {name} x_fastest"] = ratios if runs > 1 else ratios[0]
                    rows.append(row)
                    save()
                    brief = {key: value for key, value in row.items()
                             if "x_fastest" in key or key in ("dtype", "n", "d", "causal")}
                    print(brief, flush=True)
                    del fns, leaves
                    torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="overhead,backward")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--config-dtypes", default="bfloat16")
    parser.add_argument("--ns", default="2048,4096,8192,16384")
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--old", help="an earlier flash.py to time beside the current one (tables)")
    parser.add_argument("--warm-slice", default="0/1")
    parser.add_argument("--table-dtypes", default="float16", help="warm: the dtypes whose table configs to compile "
                        "(--config-dtypes '' leaves the sweep's out)")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton

    result["triton"] = triton.__version__
    parts = args.parts.split(",")

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    if "warm" in parts:
        part, total = (int(x) for x in args.warm_slice.split("/"))
        warm(args.config_dtypes.split(","), part, total, args.table_dtypes.split(","), args.old)
    if "configs" in parts:
        result["configs"] = configs(args.config_dtypes.split(","))
        save()
    if "overhead" in parts:
        result["overhead"] = overhead()
        save()
    if "tables" in parts:
        result["tables"] = []
        tables([int(x) for x in args.ns.split(",")], [int(x) for x in args.dims.split(",")], args.dtypes.split(","),
               args.repeats, args.old, result["tables"], save)
    if "backward" in parts:
        shapes = ([(4, 16, 2048, 64), (1, 16, 8192, 64), (2, 16, 4096, 128)] if args.quick else
                  [(b, 16, n, d) for d in (64, 128) for n in (2048, 4096, 8192) for b in (1, 8) if b * n <= 16384])
        result["backward"] = backward(shapes)
        save()


if __name__ == "__main__":
    main()
