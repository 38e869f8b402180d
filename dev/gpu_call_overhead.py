"""Host (CPU) time per call of attention under torch autograd, and the driver calls that
make the CPU wait for the GPU, for attnkern against torch SDPA with each of its backends.

    python3 dev/gpu_call_overhead.py [--out DIR] [--calls N] [--no-autocast] [--device cpu]

For each shape (batch, heads, seq, head size; k/v heads; causal as the transformers
integration passes it) and each variant (attnkern as the integration calls it, with
check_finite=False; attnkern with check_finite=True; attnkern through the custom op
attnkern::attention where the eager autograd path exists; torch SDPA with one backend
each: flash, efficient, cudnn, math), in turns in one process, under bf16 autocast
unless --no-autocast:

- fwd_us, bwd_us: host time of one forward (attention on leaves that require grad) and
  of one backward (out.backward(dout)), each timed alone after a synchronisation: the
  median over --calls calls. A call that waits for the GPU counts its wait.
- step_ms: wall time per forward + backward in a loop of --calls iterations with no
  synchronisation between them (the CPU may run ahead of the GPU), and gpu_ms: the GPU
  time of the same loop (CUDA events), per iteration.
- syncs: per forward + backward, the driver and runtime calls in a torch.profiler trace
  that wait for the GPU or allocate/free device memory (cudaStreamSynchronize,
  cudaDeviceSynchronize, cuCtxSynchronize, cu/cudaEventSynchronize, cuEventQuery (a
  polled wait), cudaMemcpy (synchronous), cuMemcpyDtoH, cuMemFree, cuMemAlloc, ...), by name.

Prints one table, and with --out writes overhead.json there. --device cpu runs the same
on CPU tensors (a smoke test of the script: no GPU, no trace counts)."""

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
# the names (or name prefixes) of calls that wait for the GPU or manage device memory
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuCtxSynchronize",
         "cuStreamSynchronize", "cuEventSynchronize", "cuEventQuery", "cudaEventQuery", "cuStreamQuery",
         "cudaStreamQuery", "cudaMemcpy", "cuMemcpy", "cuMemFree", "cudaFree", "cuMemAlloc", "cudaMalloc",
         "cuMemHostAlloc", "cudaHostAlloc")


def variants(torch, attnkern):
    """[(name, forward(q, k, v, causal) -> out, setup, teardown)]: attnkern's, then SDPA's backends."""
    from attnkern import _api

    def ours(check_finite):
        return lambda q, k, v, causal: attnkern.attention(q, k, v, causal=causal, check_finite=check_finite)

    def eager(on):
        def setup():
            if hasattr(_api, "EAGER_AUTOGRAD"):
                _api.EAGER_AUTOGRAD = on
        return setup

    found = [("attnkern", ours(False), eager(True)), ("attnkern check_finite", ours(True), eager(True))]
    if hasattr(_api, "EAGER_AUTOGRAD"):
        found.append(("attnkern op", ours(False), eager(False)))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        backend = getattr(SDPBackend, name, None)
        if backend is None:
            continue

        def sdpa(q, k, v, causal, backend=backend):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(causal),
                                                                        enable_gqa=k.shape[1] != q.shape[1])
        found.append((f"sdpa {name.lower()}", sdpa, eager(True)))
    return found


def measure(torch, forward, shape, device, autocast, calls):
    b, h, n, d, hkv, causal = shape
    g = torch.Generator(device="cpu").manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (torch.randn(b, heads, n, d, generator=g).to(device, dtype).requires_grad_()
               for heads in (h, hkv, hkv))
    dout = torch.randn(b, h, n, d, generator=g).to(device, dtype)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if autocast and cuda else __import__(
        "contextlib").nullcontext

    def fwd():
        with ctx():
            return forward(q, k, v, causal)

    for _ in range(3):  # plans, compilation, autotuning
        fwd().backward(dout)
    sync()
    fwd_us, bwd_us = [], []
    for _ in range(calls):
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
    host = time.perf_counter() - t
    if cuda:
        end.record()
    sync()
    result = {"fwd_us": statistics.median(fwd_us), "bwd_us": statistics.median(bwd_us),
              "step_ms": (time.perf_counter() - t) * 1e3 / calls, "host_loop_ms": host * 1e3 / calls,
              "gpu_ms": start.elapsed_time(end) / calls if cuda else None}
    if cuda:
        result["syncs"] = count_waits(torch, fwd, dout)
    return result


def count_waits(torch, fwd, dout, steps: int = 5) -> dict:
    """{call name: count per forward + backward} of WAITS in a torch.profiler trace."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fwd().backward(dout)
        torch.cuda.synchronize()
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
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = p.parse_args(argv)
    import torch

    import attnkern

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_call_overhead.py needs a CUDA GPU (or --device cpu)")
    smoke = device.type == "cpu" or os.environ.get("ATTNKERN_BENCH_SMOKE") == "1"
    shapes = SMOKE_SHAPES if smoke else SHAPES
    calls = min(args.calls, 5) if smoke else args.calls
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    rows = []
    print(f"# {gpu}, torch {torch.__version__}, attnkern {attnkern.__version__}, "
          f"{'bf16 autocast' if not args.no_autocast else 'bf16'}, median of {calls} calls", flush=True)
    print(f"{'shape (B,H,N,D,Hkv,causal)':<34} {'variant':<24} {'fwd us':>8} {'bwd us':>8} {'step ms':>8} "
          f"{'gpu ms':>7}  waits per fwd+bwd", flush=True)
    for shape in shapes:
        for name, forward, setup in variants(torch, attnkern):
            setup()
            try:
                r = measure(torch, forward, shape, device, not args.no_autocast, calls)
            except Exception as exc:  # e.g. an SDPA backend that does not take this call
                r = {"error": " ".join(str(exc).split())[:200]}
            finally:
                variants_reset(attnkern)
            rows.append({"shape": list(shape), "variant": name, **r})
            if "error" in r:
                print(f"{str(shape):<34} {name:<24} {r['error'][:90]}", flush=True)
                continue
            gpu_ms = f"{r['gpu_ms']:7.2f}" if r["gpu_ms"] is not None else f"{'-':>7}"
            print(f"{str(shape):<34} {name:<24} {r['fwd_us']:8.0f} {r['bwd_us']:8.0f} {r['step_ms']:8.2f} {gpu_ms}  "
                  f"{r.get('syncs', {})}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "overhead.json"), "w") as f:
            json.dump({"gpu": gpu, "autocast": not args.no_autocast, "calls": calls, "rows": rows}, f, indent=1)
    return 0


def variants_reset(attnkern) -> None:
    from attnkern import _api

    if hasattr(_api, "EAGER_AUTOGRAD"):
        _api.EAGER_AUTOGRAD = True


if __name__ == "__main__":
    sys.exit(main())
