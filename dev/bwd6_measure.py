"""cuda.flash's fused half-precision backward (cpp.BWD_DETERMINISTIC False) against its deterministic
default and every torch SDPA backend, backward alone and forward + backward, in one process.

For each N and causal at (1, 16, N, D): the variants' samples are taken in turns (one sample of each,
then the next round), each sample 5 back-to-back calls between two CUDA events; the median of --runs
samples per call. Ours: the backward is cpp.flash_bwd_mma on the forward's out and lse (the switch set
around each call, so no plan is involved); forward + backward adds attnkern.attention(return_lse=True)
in front. torch: scaled_dot_product_attention under torch.nn.attention.sdpa_kernel with each backend
(cudnn, flash, efficient): backward alone is torch.autograd.grad on a kept graph, forward + backward
both. The gradients of the fused backward are compared with the default's (max |difference|).
JSON rows to --json.

    python3 dev/bwd6_measure.py --sizes 2048 4096 8192 16384 --runs 5 --json out.json
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnkern
from attnkern.backends.cuda import cpp

from gpu_bwd_versions import from_torch, sample_ms

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def ours(q, k, v, dout, causal, fused, forward):
    """A call of our backward (forward: the forward first) with the switch set around it."""
    b, n, d = q.shape[0] * q.shape[1], *q.shape[-2:]  # (GpuArray.reshape takes no -1)
    grads = [torch.empty_like(x) for x in (q, k, v)]
    views = [from_torch(x, "grad").reshape(b, n, d) for x in grads]

    def views_of(out, lse):
        arrays = [from_torch(x, "x").reshape(b, n, d) for x in (q, k, v, out, dout)]
        return arrays + [from_torch(lse, "lse").reshape(b, n)]

    kept = views_of(*attnkern.attention(q, k, v, kernel="cuda.flash", causal=causal, return_lse=True))

    def call():
        arrays = views_of(*attnkern.attention(q, k, v, kernel="cuda.flash", causal=causal, return_lse=True)) \
            if forward else kept
        cpp.BWD_DETERMINISTIC = not fused
        try:
            cpp.flash_bwd_mma(*arrays, *views, causal, d ** -0.5, None)
        finally:
            cpp.BWD_DETERMINISTIC = True

    return call, grads


def theirs(q, k, v, dout, causal, backend, forward):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel(BACKENDS[backend]):
        kept = F.scaled_dot_product_attention(*leaves, is_causal=causal)

    def call():
        if forward:
            with sdpa_kernel(BACKENDS[backend]):
                out = F.scaled_dot_product_attention(*leaves, is_causal=causal)
            torch.autograd.grad(out, leaves, dout)
        else:
            torch.autograd.grad(kept, leaves, dout, retain_graph=True)

    return call


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--json")
    p.add_argument("--wait-for", help="a file: compile first, then wait until it exists before timing")
    a = p.parse_args()
    t, d = getattr(torch, a.dtype), a.dim
    if a.wait_for:  # the kernels compiled (NVRTC) while other GPU work finishes
        q = torch.randn(1, 2, 256, d, device="cuda").to(t)
        for causal in (False, True):
            for fused in (False, True):
                ours(q, q, q, q, causal, fused, True)[0]()
        torch.cuda.synchronize()
        while not os.path.exists(a.wait_for):
            time.sleep(0.5)
    rows = []
    for n in a.sizes:
        for causal in (False, True):
            g = torch.Generator(device="cuda").manual_seed(n + d)
            q, k, v, dout = (torch.randn(1, 16, n, d, device="cuda", generator=g).to(t) for _ in range(4))
            calls, grads = {}, {}
            for forward in (False, True):
                tag = "fwd+bwd" if forward else "bwd"
                for fused in (False, True):
                    name = ("fused" if fused else "default")
                    call, gr = ours(q, k, v, dout, causal, fused, forward)
                    calls[(tag, name)] = call
                    grads[name] = gr
                for backend in BACKENDS:
                    call = theirs(q, k, v, dout, causal, backend, forward)
                    try:
                        call()
                    except RuntimeError as exc:  # a backend that refuses the shape
                        print(f"N={n} causal={causal} {backend} {tag}: {exc}"[:160])
                        continue
                    calls[(tag, "torch." + backend)] = call
            for call in calls.values():  # warm-up (compiles)
                call()
            torch.cuda.synchronize()
            diff = {nm: float((x.float() - y.float()).abs().max())
                    for nm, x, y in zip(("dq", "dk", "dv"), grads["fused"], grads["default"])}
            samples = {key: [] for key in calls}
            for _ in range(a.runs):
                for key, call in calls.items():
                    samples[key].append(sample_ms(call))
            for tag in ("bwd", "fwd+bwd"):
                ms = {name: statistics.median(x) for (tg, name), x in samples.items() if tg == tag}
                torch_best = min(v for nm, v in ms.items() if nm.startswith("torch."))
                flops = (2.5 if tag == "bwd" else 3.5) * 4 * 16 * n * n * d / (2 if causal else 1)
                row = {"dtype": a.dtype, "d": d, "n": n, "causal": causal, "what": tag, "ms": ms,
                       "tflops": {nm: flops / x / 1e9 for nm, x in ms.items()},
                       "vs_fastest_torch": {nm: torch_best / ms[nm] for nm in ("default", "fused")},
                       "fused_speedup": ms["default"] / ms["fused"], "fused_vs_default_diff": diff,
                       "gpu": torch.cuda.get_device_name()}
                rows.append(row)
                print(f"{a.dtype} D={d} N={n:>5} causal={causal!s:>5} {tag:>7}: " + " ".join(
                    f"{nm} {x:.3f}" for nm, x in ms.items()) + f" ms | default {row['vs_fastest_torch']['default']:.2f}x "
                      f"fused {row['vs_fastest_torch']['fused']:.2f}x torch's fastest; fused/default "
                      f"{row['fused_speedup']:.3f}; diff " + " ".join(f"{k} {x:.1e}" for k, x in diff.items()),
                      flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
