"""attnkern bench --device cuda --backward: cuda.flash's backward timed against
every torch SDPA backend (cuDNN, flash, efficient, math, forced in turn with
torch.nn.attention.sdpa_kernel) on torch CUDA tensors.

Per (N, causal): forward + backward (out = attention(q, k, v); out.backward(dout),
autograd through each) and the backward alone (attnkern.attention_backward from
a saved out and lse; torch: out.backward(dout, retain_graph=True) on a saved
graph). Each is timed with CUDA events (timing.CudaEventClock) in round-robin
turns over --passes passes (3 by default), medians over every pass's samples
reported, with the ratio to the fastest torch backend, that ratio's range over the
passes (the host's speed drifts over seconds: a row whose steps are host-bound,
N = 2048 at batch 1, swings, and its range says so) and the
backward's TFLOP/s: 2.5 times the forward's 4 B H N^2 D FLOPs (five N x N x D
products against two), halved for causal. In float32 cuda.flash also runs with
tensor_cores=0 (float32 FMAs; the backward's Numba kernels). A backend that refuses the call (its
dtype, head size or GPU) is reported as skipped. Before timing, cuda.flash's
gradients are checked against torch's math backend in float64 on the same inputs
(up to N = 4096).
"""

from __future__ import annotations

import json
import statistics

from .timing import CudaEventClock, medians, take_turns

BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def backward_flops(batch: int, heads: int, n: int, d: int, causal: bool) -> float:
    """The backward's FLOPs: 2.5 x the forward's 4 B H N^2 D, halved for causal."""
    return 2.5 * 4 * batch * heads * n * n * d / (2 if causal else 1)


def _sdpa_fns(torch, backend, q, k, v, dout, causal):
    """(forward + backward, backward alone) of SDPA forced to one backend, or None where it refuses."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    which = getattr(SDPBackend, backend)

    def both():
        with sdpa_kernel(which):
            sdpa(*leaves, is_causal=causal).backward(dout)

    try:
        both()
        with sdpa_kernel(which):
            saved = sdpa(*leaves, is_causal=causal)
        saved.backward(dout, retain_graph=True)
        torch.cuda.synchronize()
    except RuntimeError:
        return None
    return both, lambda: saved.backward(dout, retain_graph=True)


def _attnkern_fns(attnkern, q, k, v, dout, causal, **tunables):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out, lse = attnkern.attention(q, k, v, kernel="cuda.flash", causal=causal, return_lse=True, **tunables)

    def both():
        attnkern.attention(*leaves, kernel="cuda.flash", causal=causal, check_finite=False,
                           **tunables).backward(dout)

    def alone():
        attnkern.attention_backward(q, k, v, out, dout, lse, kernel="cuda.flash", causal=causal, **tunables)

    return both, alone


def timed(fns: dict, repeat: int, calls: int, clock, passes: int) -> tuple[dict, list[dict]]:
    """(median seconds per call of each fn over all samples, [each pass's medians]): `passes`
    rounds of take_turns, each fn's turn `repeat` samples of `calls` calls."""
    pooled: dict = {name: [] for name in fns}
    per_pass = []
    for _ in range(passes):
        samples = take_turns(fns, repeat=repeat, warmup=3, calls_per_sample=calls, clock=clock)
        per_pass.append(medians(samples))
        for name, ts in samples.items():
            pooled[name] += ts
    return {name: statistics.median(ts) for name, ts in pooled.items()}, per_pass


def ratio_range(per_pass: list[dict], name: str, torch_names: list[str]) -> tuple[float, float]:
    """The least and greatest over the passes of (the fastest torch backend's median in that
    pass) / (name's median in that pass)."""
    ratios = [min(m[x] for x in torch_names) / m[name] for m in per_pass] if torch_names else [float("nan")]
    return min(ratios), max(ratios)


def check(torch, attnkern, q, k, v, dout, causal) -> float:
    """The largest error of cuda.flash's gradients against float64 (torch math), relative to
    max(1, the largest gradient): a wrong term shows as 0.1 or more."""
    out, lse = attnkern.attention(q, k, v, kernel="cuda.flash", causal=causal, return_lse=True)
    mine = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="cuda.flash", causal=causal)
    wide = [x.detach().double().requires_grad_() for x in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*wide, is_causal=causal).backward(dout.double())
    return max(float((m.double() - w.grad).abs().max()) / max(1.0, float(w.grad.abs().max()))
               for m, w in zip(mine, wide))


def run(sizes, batch: int, heads: int, dim: int, dtype: str, causal_modes, repeat: int, calls: int = 1,
        json_path: str | None = None, passes: int = 3) -> list[dict]:
    """Time and print the rows; returns them (and writes them as JSON to json_path)."""
    import torch

    import attnkern

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    tdtype = getattr(torch, dtype)
    clock, rows = CudaEventClock(torch), []
    print(f"# backward: ({batch}, {heads}, N, {dim}) {dtype} on {torch.cuda.get_device_name()}; median of "
          f"{passes} passes x {repeat} samples of {calls} call(s), CUDA events; ratio: the fastest torch backend's "
          "time / this one's (range: over the passes)")
    print(f"{'N':>6} {'causal':>6} {'kernel':>22} {'fwd+bwd ms':>11} {'bwd ms':>9} {'bwd TFLOP/s':>11} "
          f"{'fwd+bwd ratio':>13} {'range':>9} {'bwd ratio':>9} {'range':>9}")
    for n in sizes:
        for causal in causal_modes:
            g = torch.Generator(device="cuda").manual_seed(n)
            q, k, v, dout = (torch.randn(batch, heads, n, dim, device="cuda", generator=g).to(tdtype)
                             for _ in range(4))
            # float64 N x N buffers of torch's math backend: checked up to N = 4096
            error = check(torch, attnkern, q, k, v, dout, causal) if n <= 4096 else float("nan")
            fns = {"cuda.flash": _attnkern_fns(attnkern, q, k, v, dout, causal)}
            if dtype == "float32":  # float32 FMAs: the forward's, and the backward's Numba kernels
                fns["cuda.flash tc=0"] = _attnkern_fns(attnkern, q, k, v, dout, causal, tensor_cores=0)
            for backend in BACKENDS:
                if backend == "MATH" and n > 8192:
                    continue  # its N x N buffers
                pair = _sdpa_fns(torch, backend, q, k, v, dout, causal)
                if pair is not None:
                    fns[f"torch.{backend.lower()}"] = pair
            both, both_passes = timed({name: f[0] for name, f in fns.items()}, repeat, calls, clock, passes)
            alone, alone_passes = timed({name: f[1] for name, f in fns.items()}, repeat, calls, clock, passes)
            torch_names = [name for name in fns if name.startswith("torch.")]
            best_both = min((both[x] for x in torch_names), default=float("nan"))
            best_alone = min((alone[x] for x in torch_names), default=float("nan"))
            for name in fns:
                row = {"n": n, "causal": bool(causal), "dtype": dtype, "dim": dim, "kernel": name,
                       "fwd_bwd_s": both[name], "bwd_s": alone[name],
                       "bwd_tflops": backward_flops(batch, heads, n, dim, causal) / alone[name] / 1e12,
                       "fwd_bwd_ratio": best_both / both[name], "bwd_ratio": best_alone / alone[name],
                       "fwd_bwd_ratio_range": ratio_range(both_passes, name, torch_names),
                       "bwd_ratio_range": ratio_range(alone_passes, name, torch_names),
                       "cuda_flash_grad_error": error}
                rows.append(row)
                spans = ["{:.2f}-{:.2f}".format(*row[key]) for key in ("fwd_bwd_ratio_range", "bwd_ratio_range")]
                print(f"{n:>6} {str(bool(causal)):>6} {name:>22} {both[name] * 1e3:>11.3f} {alone[name] * 1e3:>9.3f} "
                      f"{row['bwd_tflops']:>11.1f} {row['fwd_bwd_ratio']:>13.2f} {spans[0]:>9} "
                      f"{row['bwd_ratio']:>9.2f} {spans[1]:>9}")
            print(f"#   cuda.flash gradients vs float64: max relative error {error:.2e}" if n <= 4096 else
                  "#   cuda.flash gradients not checked above N = 4096 (torch's float64 math backend's N x N buffers)")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return rows
