"""Host (CPU) time per call of attention under torch autograd, and whether the calls make
the CPU wait for the GPU, for attnkern against torch SDPA with each of its backends.

    python3 dev/gpu_call_overhead.py [--out DIR] [--calls N] [--no-autocast] [--cprofile]
                                     [--device cpu] [--kernels auto,triton.flash,...]
                                     [--shapes default,tiny,small] [--quick]

For each shape (batch, heads, seq, head size; k/v heads; causal as the transformers
integration passes it) and each variant (attnkern as the integration calls it, with
check_finite=False; attnkern with check_finite=True; attnkern through the custom op
attnkern::attention where the eager autograd path exists; torch SDPA with one backend
each, its sdpa_kernel context entered once around the measurement: flash, efficient,
cudnn, math), in turns in one process, bf16 inputs under bf16 autocast unless --no-autocast:

- fwd_us, bwd_us: host time per forward (attention on leaves that require grad) and per
  backward (out.backward(dout)), --calls of each back to back (the GPU's queue absorbs
  their kernels): the median over 5 rounds of the mean per call.
- fwd_cold_us, bwd_cold_us: host time of one call timed alone right after a
  synchronisation (median over --calls): includes any wait for the call's own kernels.
- waits: whether a forward + backward queued behind a 50 ms GPU busy-wait
  (torch.cuda._sleep) returned only after the GPU went idle, i.e. waited for it
  (busy_us: that forward + backward's host time).
- step_ms / gpu_ms: wall time per forward + backward in a loop of --calls iterations with
  no synchronisation between them, and the GPU time of that loop (CUDA events).
- syncs: per forward + backward, the runtime calls in a torch.profiler trace that wait for
  the GPU or allocate/free device memory (cudaStreamSynchronize, cudaMemcpy, cudaFree, ...).
  The trace records the CUDA runtime API; the driver calls that Numba and cuda.bindings
  make (cuEventSynchronize, cuMemFree, ...) are not in it: `waits` is the test for those.

--kernels: attnkern's variants once per kernel name (kernel="auto" by default; e.g.
cuda.flash,triton.flash). --shapes: "default" (SHAPES), "tiny" ((1, 8, 16, 64): the host's cost
alone), "small" (SMALL_GRID: N 64-512, batch 1-8, 8 heads, D = 64, causal and not) and "step"
(STEP_SHAPES: (1, 16, 2048-4096, 64), as `attnkern bench --device cuda --backward` times them); --quick
leaves out waits and syncs (the busy-wait and the profiler trace). After each shape a line
gives attnkern's host time per forward + backward (fwd_us + bwd_us) over that of torch SDPA's
backend with the least.

--cprofile prints cProfile's top functions of attnkern's forward (back to back, main
thread) and of its backward (attnkern.attention_backward on the same tensors, called
directly: autograd runs backward on its own thread) at the first shape.
Prints one table, and with --out writes overhead.json there. --device cpu runs the same
on CPU tensors (a smoke test of the script: no GPU, no waits or trace counts)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# (batch, heads, seq, head size, k/v heads, causal)
SHAPES = [(8, 8, 1024, 64, 2, "bottom_right"), (1, 8, 128, 64, 8, True), (4, 16, 2048, 128, 4, "bottom_right")]
SMOKE_SHAPES = [(1, 4, 64, 16, 2, "bottom_right")]
TINY_SHAPES = [(1, 8, 16, 64, 8, False)]
# the rows of `attnkern bench --device cuda --backward` where a step took longer than its kernels
STEP_SHAPES = [(1, 16, 4096, 64, 16, True), (1, 16, 4096, 64, 16, False), (1, 16, 2048, 64, 16, True)]
SMALL_GRID = [(b, 8, n, 64, 8, causal) for causal in (False, True) for n in (64, 128, 256, 512) for b in (1, 2, 4, 8)]
# the names (or name prefixes) of calls that wait for the GPU or manage device memory
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuCtxSynchronize",
         "cuStreamSynchronize", "cuEventSynchronize", "cuEventQuery", "cudaEventQuery", "cuStreamQuery",
         "cudaStreamQuery", "cudaMemcpy", "cuMemcpy", "cuMemFree", "cudaFree", "cuMemAlloc", "cudaMalloc",
         "cuMemHostAlloc", "cudaHostAlloc")


def variants(torch, attnkern, kernels=("auto",)):
    """[(name, forward(q, k, v, causal) -> out, context)]: attnkern's (per kernel name), then
    SDPA's backends; context() is entered around the variant's measurement."""
    import contextlib

    from attnkern.backends import cuda as cuda_backend

    def ours(check_finite, kernel):
        return lambda q, k, v, causal: attnkern.attention(q, k, v, causal=causal, check_finite=check_finite,
                                                          kernel=kernel)

    @contextlib.contextmanager
    def eager(on):
        was = getattr(cuda_backend, "EAGER_AUTOGRAD", None)
        if was is not None:
            cuda_backend.EAGER_AUTOGRAD = on
        try:
            yield
        finally:
            if was is not None:
                cuda_backend.EAGER_AUTOGRAD = was

    found = []
    for kernel in kernels:
        name = "attnkern" if kernel == "auto" else kernel
        found += [(name, ours(False, kernel), lambda: eager(True)),
                  (f"{name} check_finite", ours(True, kernel), lambda: eager(True))]
        if hasattr(cuda_backend, "EAGER_AUTOGRAD"):
            found.append((f"{name} op", ours(False, kernel), lambda: eager(False)))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(q, k, v, causal):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(causal),
                                                                enable_gqa=k.shape[1] != q.shape[1])

    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        backend = getattr(SDPBackend, name, None)
        if backend is not None:
            found.append((f"sdpa {name.lower()}", sdpa, lambda backend=backend: sdpa_kernel(backend)))
    return found


def inputs(torch, shape, device):
    b, h, n, d, hkv, causal = shape
    g = torch.Generator(device="cpu").manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (torch.randn(b, heads, n, d, generator=g).to(device, dtype).requires_grad_()
               for heads in (h, hkv, hkv))
    return q, k, v, torch.randn(b, h, n, d, generator=g).to(device, dtype), causal


def measure(torch, forward, shape, device, autocast, calls, quick=False, trace=None):
    import contextlib

    q, k, v, dout, causal = inputs(torch, shape, device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if autocast and cuda else contextlib.nullcontext

    def fwd():
        with ctx():
            return forward(q, k, v, causal)

    for _ in range(3):  # plans, compilation, autotuning
        fwd().backward(dout)
    sync()
    rounds_f, rounds_b = [], []
    for _ in range(5):  # back to back: the CPU's cost per call, its caches warm
        sync()
        t = time.perf_counter()
        outs = [fwd() for _ in range(calls)]
        rounds_f.append((time.perf_counter() - t) * 1e6 / calls)
        t = time.perf_counter()
        for out in outs:
            out.backward(dout)
        rounds_b.append((time.perf_counter() - t) * 1e6 / calls)
        del outs
    fwd_us, bwd_us = [], []
    for _ in range(calls):  # one call alone after a synchronisation
        sync()
        t = time.perf_counter()
        out = fwd()
        fwd_us.append((time.perf_counter() - t) * 1e6)
        sync()
        t = time.perf_counter()
        out.backward(dout)
        bwd_us.append((time.perf_counter() - t) * 1e6)
    sync()
    start = end = None
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t = time.perf_counter()
    for _ in range(calls):
        fwd().backward(dout)
    if cuda:
        end.record()
    sync()
    result = {"fwd_us": statistics.median(rounds_f), "bwd_us": statistics.median(rounds_b),
              "fwd_cold_us": statistics.median(fwd_us), "bwd_cold_us": statistics.median(bwd_us),
              "step_ms": (time.perf_counter() - t) * 1e3 / calls,
              "gpu_ms": start.elapsed_time(end) / calls if cuda else None}
    if cuda and not quick:
        result.update(busy_check(torch, fwd, dout))
        result["syncs"] = count_waits(torch, fwd, dout, trace=trace)
    return result


SLEEP_CYCLES = 100_000_000  # about 50 ms of GPU clock cycles (H100, H200: up to about 2 GHz)


def busy_check(torch, fwd, dout) -> dict:
    """{waits: whether a forward + backward queued behind a GPU busy-wait returned only once
    the GPU was idle, busy_us: its host time}."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    t = time.perf_counter()
    fwd().backward(dout)
    host = time.perf_counter() - t
    idle = torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    return {"waits": bool(idle), "busy_us": host * 1e6}


def cprofile(torch, attnkern, shape, device, autocast, calls, kernel="auto") -> None:
    """cProfile's top functions of attnkern's forward and backward implementation."""
    import cProfile
    import contextlib
    import pstats

    q, k, v, dout, causal = inputs(torch, shape, device)
    cuda = device.type == "cuda"
    ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if autocast and cuda else contextlib.nullcontext
    with ctx():
        out, lse = attnkern.attention(q, k, v, causal=causal, check_finite=False, return_lse=True, kernel=kernel)
    # the backward's inputs in the forward's output dtype (under autocast: what autograd hands it)
    detached = [x.detach().to(out.dtype) for x in (q, k, v)] + [out.detach(), dout.to(out.dtype), lse.detach()]
    for what, call in (("forward", lambda: attnkern.attention(q, k, v, causal=causal, check_finite=False,
                                                               kernel=kernel)),
                       ("backward (attnkern.attention_backward)",
                        lambda: attnkern.attention_backward(*detached, causal=causal, kernel=kernel))):
        for _ in range(3):
            with ctx():
                call()
        if cuda:
            torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        with ctx():
            for _ in range(calls):
                call()
        prof.disable()
        if cuda:
            torch.cuda.synchronize()
        print(f"# cProfile: attnkern {what}, kernel {kernel}, {calls} calls, shape {shape}", flush=True)
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(18)


def summary(shape, done) -> None:
    """Prints each attnkern variant's host time per forward + backward over the least of
    torch SDPA's backends at this shape."""
    sdpa = [r for r in done if r["variant"].startswith("sdpa ")]
    if not sdpa:
        return
    best = min(sdpa, key=lambda r: r["fwd_us"] + r["bwd_us"])
    base = best["fwd_us"] + best["bwd_us"]
    for r in done:
        if not r["variant"].startswith("sdpa "):
            host = r["fwd_us"] + r["bwd_us"]
            print(f"# {shape}: {r['variant']} fwd+bwd host {host:.0f} us = {host / base:.2f}x "
                  f"{best['variant']}'s {base:.0f} us", flush=True)


def count_waits(torch, fwd, dout, steps: int = 5, trace: str | None = None) -> dict:
    """{call name: count per forward + backward} of WAITS in a torch.profiler trace (also
    written as a Chrome trace to the path trace, when given)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fwd().backward(dout)
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    counts: dict = {}
    for event in prof.events():
        name = event.name
        if name.startswith(WAITS):
            counts[name] = counts.get(name, 0) + 1
    counts["cudaDeviceSynchronize"] = counts.get("cudaDeviceSynchronize", 0) - 1  # the trace's own, at its end
    return {name: round(c / steps, 2) for name, c in sorted(counts.items()) if c}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for overhead.json")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--no-autocast", action="store_true", help="bf16 tensors without an autocast region")
    p.add_argument("--cprofile", action="store_true", help="also print cProfile's top functions of attnkern's calls")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--kernels", default="auto", help="attnkern's kernels, comma-separated (default: auto)")
    p.add_argument("--shapes", default="default", help="default, tiny, small, step: comma-separated")
    p.add_argument("--quick", action="store_true", help="no busy-wait check and no profiler trace")
    p.add_argument("--trace", metavar="DIR", help="write each variant's profiler trace at the first shape "
                   "there (Chrome trace JSON, 5 forward + backward steps)")
    args = p.parse_args(argv)
    import torch

    import attnkern

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_call_overhead.py needs a CUDA GPU (or --device cpu)")
    smoke = device.type == "cpu" or os.environ.get("ATTNKERN_BENCH_SMOKE") == "1"
    sets = {"default": SHAPES, "tiny": TINY_SHAPES, "small": SMALL_GRID, "step": STEP_SHAPES}
    unknown = set(args.shapes.split(",")) - set(sets)
    if unknown:
        raise SystemExit(f"--shapes: unknown {', '.join(sorted(unknown))}; choose from {', '.join(sets)}")
    shapes = SMOKE_SHAPES if smoke else [s for name in args.shapes.split(",") for s in sets[name]]
    kernels = args.kernels.split(",")
    calls = min(args.calls, 5) if smoke else args.calls
    autocast = not args.no_autocast
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    rows = []
    print(f"# {gpu}, torch {torch.__version__}, attnkern {attnkern.__version__}, "
          f"{'bf16 autocast' if autocast else 'bf16'}, {calls} calls", flush=True)
    print(f"{'shape (B,H,N,D,Hkv,causal)':<38} {'variant':<26} {'fwd us':>7} {'bwd us':>7} {'fwd1 us':>7} "
          f"{'bwd1 us':>7} {'step ms':>7} {'gpu ms':>6} {'waits':>5}  syncs per fwd+bwd", flush=True)
    for shape in shapes:
        done = []
        for name, forward, context in variants(torch, attnkern, kernels):
            try:
                trace = None
                if args.trace and shape == shapes[0]:
                    os.makedirs(args.trace, exist_ok=True)
                    trace = os.path.join(args.trace, name.replace(" ", "_") + ".json")
                with context():
                    r = measure(torch, forward, shape, device, autocast, calls, args.quick, trace)
            except Exception as exc:  # e.g. an SDPA backend that does not take this call
                r = {"error": " ".join(str(exc).split())[:200]}
            rows.append({"shape": list(shape), "variant": name, **r})
            if "error" in r:
                print(f"{str(shape):<38} {name:<26} {r['error'][:90]}", flush=True)
                continue
            done.append(rows[-1])
            gpu_ms = f"{r['gpu_ms']:6.2f}" if r["gpu_ms"] is not None else f"{'-':>6}"
            print(f"{str(shape):<38} {name:<26} {r['fwd_us']:7.0f} {r['bwd_us']:7.0f} {r['fwd_cold_us']:7.0f} "
                  f"{r['bwd_cold_us']:7.0f} {r['step_ms']:7.2f} {gpu_ms} {str(r.get('waits', '-')):>5}  "
                  f"{r.get('syncs', {})}", flush=True)
        summary(shape, done)
    if args.cprofile:
        for kernel in kernels:
            cprofile(torch, attnkern, shapes[0], device, autocast, calls, kernel)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "overhead.json"), "w") as f:
            json.dump({"gpu": gpu, "autocast": autocast, "calls": calls, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
