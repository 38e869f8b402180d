"""Host time of one training step's attention (forward + out.backward(dout)) on torch CUDA
tensors, split into its layers, against torch SDPA's backends and a Python
torch.autograd.Function that only allocates (the floor of any Python autograd path).

    python3 dev/gpu_step_host.py [--shape B H N D] [--causal] [--steps 200] [--rounds 7]

Each variant runs --steps steps back to back (no synchronisation inside a round; the
shape is small, so the GPU keeps up and the host's time is what is timed), rounds in
turns, the median round's mean per step reported, in microseconds:

  step        attention(q, k, v) then out.backward(dout) on leaves that require grad
  fwd         the forward alone (leaves that require grad; outputs dropped)
  nograd      the forward under torch.no_grad() (attnkern: the quick path)
  bwd_direct  attnkern.attention_backward on saved tensors (no autograd engine)

Variants: cuda.flash; `floor` (a torch.autograd.Function whose forward allocates out and
lse, saves q, k, v, out, lse and marks lse non-differentiable, and whose backward
allocates dq, dk, dv: what our autograd path costs without its own work); torch SDPA with
each backend forced (cudnn, flash, efficient); with --compiled also cuda.flash (its custom
op) and torch's default SDPA each in a torch.compile(fullgraph=True) function."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import attnkern


def floor_function():
    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, args):
            out = q.new_empty(q.shape)
            lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.args = args
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, _dlse):
            q, k, v, out, lse = ctx.saved_tensors
            dout = dout.contiguous()
            return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), None

    return Floor


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=int, nargs=4, default=[1, 16, 256, 64], metavar=("B", "H", "N", "D"))
    p.add_argument("--causal", action="store_true")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--compiled", action="store_true", help="add cuda.flash and torch's default SDPA each "
                   "inside torch.compile(fullgraph=True)")
    p.add_argument("--trace", metavar="FILE", help="also write a torch.profiler trace (Chrome JSON, Python "
                   "functions of every thread recorded) of 20 cuda.flash steps there")
    args = p.parse_args(argv)
    b, h, n, d = args.shape
    causal = args.causal
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(b, h, n, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = attnkern.attention(q, k, v, causal=causal, kernel="cuda.flash", return_lse=True)
    floor = floor_function()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def ours():
        return attnkern.attention(*leaves, causal=causal, kernel="cuda.flash", check_finite=False)

    variants = {
        "cuda.flash": (ours, lambda: attnkern.attention(q, k, v, causal=causal, kernel="cuda.flash",
                                                        check_finite=False),
                       lambda: attnkern.attention_backward(q, k, v, out, dout, lse, causal=causal,
                                                           kernel="cuda.flash"), None),
        "floor": (lambda: floor.apply(*leaves, (causal,))[0], None, None, None),
    }
    for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
        backend = getattr(SDPBackend, name)
        variants[f"sdpa {name.split('_')[0].lower()}"] = (
            lambda: sdpa(*leaves, is_causal=causal), lambda: sdpa(q, k, v, is_causal=causal), None, backend)
    if args.compiled:  # each forward inside torch.compile(fullgraph=True): what a compiled model's step runs
        mine = torch.compile(lambda a, b_, c: attnkern.attention(a, b_, c, causal=causal, kernel="cuda.flash",
                                                                 check_finite=False), fullgraph=True)
        theirs = torch.compile(lambda a, b_, c: sdpa(a, b_, c, is_causal=causal), fullgraph=True)
        variants["cuda.flash compiled"] = (lambda: mine(*leaves), lambda: mine(q, k, v), None, None)
        variants["sdpa compiled"] = (lambda: theirs(*leaves), lambda: theirs(q, k, v), None, None)

    def timed(fn, steps):
        t = time.perf_counter_ns()
        for _ in range(steps):
            fn()
        return (time.perf_counter_ns() - t) / steps / 1e3

    def parts(fwd, nograd, bwd_direct):
        got = {}
        got["step"] = lambda: fwd().backward(dout)
        got["fwd"] = fwd
        if nograd is not None:
            def ng():
                with torch.no_grad():
                    nograd()
            got["nograd"] = ng
        if bwd_direct is not None:
            got["bwd_direct"] = bwd_direct
        return got

    results: dict = {}
    for _ in range(3):  # warm-up: plans, compilation
        for name, (fwd, nograd, bwd, backend) in variants.items():
            with sdpa_kernel(backend) if backend is not None else _null():
                for part, fn in parts(fwd, nograd, bwd).items():
                    fn()
    torch.cuda.synchronize()
    for _ in range(args.rounds):
        for name, (fwd, nograd, bwd, backend) in variants.items():
            with sdpa_kernel(backend) if backend is not None else _null():
                for part, fn in parts(fwd, nograd, bwd).items():
                    torch.cuda.synchronize()
                    results.setdefault(name, {}).setdefault(part, []).append(timed(fn, args.steps))
    torch.cuda.synchronize()
    if args.trace:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
            for _ in range(20):
                ours().backward(dout)
            torch.cuda.synchronize()
        prof.export_chrome_trace(args.trace)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; shape {tuple(args.shape)} bfloat16 "
          f"causal={causal}; host us per call, median of {args.rounds} rounds of {args.steps} back to back")
    cols = ("step", "fwd", "nograd", "bwd_direct")
    print(f"{'variant':<16}" + "".join(f"{c:>12}" for c in cols))
    for name, got in results.items():
        print(f"{name:<16}" + "".join(f"{statistics.median(got[c]):12.1f}" if c in got else f"{'-':>12}"
                                      for c in cols))
    return 0


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


if __name__ == "__main__":
    sys.exit(main())
