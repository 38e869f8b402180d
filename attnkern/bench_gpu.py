"""Check and time the GPU kernels side by side (needs a CUDA GPU).

    python -m attnkern.bench_gpu                        # the standard table
    python -m attnkern.bench_gpu --sizes 4096 --sweep   # also every cuda.flash tile that fits

For (B, H, N, D) = (1, 16, N, 64) float32, every kernel is first checked
against the float64 reference on a sample of query rows (all heads, all keys:
the full reference at N = 16384 would need 34 GB), then timed with CUDA events
after warm-up: the median of --repeat samples, each a pair of events on the
default stream around --back-to-back calls (default 1: isolated calls, where
Python launch overhead counts in full; 5 or so: queued calls, as in a loop). Peers: torch.nn.functional.scaled_dot_product_attention
(float32; TF32 off, so every kernel here does float32 FMAs), torch.naive
(materialised scores) and the same naive algorithm in CuPy. attnkern's kernels
are called through attnkern.attention on torch CUDA tensors (no copies) with
check_finite=False, so they are timed like the peers, without the input scans.
TFLOP/s counts 4*B*H*N^2*D per forward (half for causal).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import numpy as np

import attnkern
from attnkern.bench import attention_flops


def _torch():
    import torch

    if not torch.cuda.is_available():
        sys.exit("attnkern.bench_gpu needs a CUDA GPU (torch.cuda.is_available() is False)")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch


def peers(torch) -> dict:
    """name -> f(q, k, v, causal, scale) on torch CUDA tensors (B, H, N, D)."""

    def sdpa(q, k, v, causal, scale):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)

    def torch_naive(q, k, v, causal, scale):
        s = (q @ k.transpose(-1, -2)) * scale
        if causal:
            n, m = s.shape[-2:]
            s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    out = {"torch.sdpa": sdpa, "torch.naive": torch_naive}
    try:
        import cupy
    except ImportError:
        return out

    def cupy_naive(q, k, v, causal, scale):
        cq, ck, cv = (cupy.asarray(x) for x in (q, k, v))
        s = cq @ ck.swapaxes(-1, -2) * cq.dtype.type(scale)
        if causal:
            n, m = s.shape[-2:]
            s = cupy.where(cupy.triu(cupy.ones((n, m), dtype=bool), 1), cupy.float32(-cupy.inf), s)
        s = cupy.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        return torch.as_tensor(s @ cv, device=q.device)

    out["cupy.naive"] = cupy_naive
    return out


def ours(name: str, **params):
    def run(q, k, v, causal, scale):
        return attnkern.attention(q, k, v, causal=causal, scale=scale, kernel=name, check_finite=False, **params)

    return run


def sampled_error(out, q, k, v, causal: bool, scale: float, rows: np.ndarray) -> float:
    """max |out - reference| / (max|v| * kappa) over the sampled query rows (conftest's
    bound is 1e-5 in float32), with the float64 reference computed on the host."""
    qh, kh, vh = (x.double().cpu().numpy() for x in (q, k, v))
    o = out.double().cpu().numpy()[..., rows, :]
    s = np.einsum("bhid,bhjd->bhij", qh[..., rows, :], kh) * scale
    if causal:
        s = np.where(np.arange(kh.shape[-2])[None, :] > rows[:, None], -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("bhij,bhjd->bhid", p / p.sum(-1, keepdims=True), vh)
    qn = np.linalg.norm(qh, axis=-1).max()
    kn = np.linalg.norm(kh, axis=-1).max()
    kappa = max(1.0, abs(scale) * qn * kn / np.sqrt(qh.shape[-1]))
    return float(np.abs(o - ref).max() / (np.abs(vh).max() * kappa))


def time_call(torch, fn, args, repeat: int, back_to_back: int, warmup: int = 3) -> float:
    """Median milliseconds per call over `repeat` samples; each sample is a pair of
    CUDA events around `back_to_back` consecutive calls, divided by their number.
    With 1, a sample is one isolated call: the GPU idles while Python prepares the
    launch, so launch overhead counts in full. With more, calls queue as in a
    training loop and a call's overhead overlaps the previous call's kernel."""
    for _ in range(warmup):
        fn(*args)
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(back_to_back):
            fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / back_to_back)
    return statistics.median(times)


def release_memory(torch) -> None:
    """Hand cached blocks back to the driver, so one library's cache does not
    starve the next kernel of memory (the naive ones take 17 GB at N = 16384)."""
    from numba import cuda

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    cuda.current_context().deallocations.clear()
    try:
        import cupy
    except ImportError:
        return
    cupy.get_default_memory_pool().free_all_blocks()


def measure(torch, kernels: dict, n: int, args, rng) -> list[dict]:
    b, h, d = 1, args.heads, args.dim
    q, k, v = (torch.from_numpy(rng.standard_normal((b, h, n, d), dtype=np.float32)).cuda() for _ in range(3))
    scale = 1 / np.sqrt(d)
    rows = np.unique(np.concatenate([[0, n - 1], rng.choice(n, size=min(n, args.check_rows), replace=False)]))
    results = []
    for causal in args.causal:
        flops = attention_flops(b, h, n, n, d, causal)
        for name, fn in kernels.items():
            row = {"n": n, "causal": causal, "kernel": name}
            try:
                out = fn(q, k, v, causal, scale)
                torch.cuda.synchronize()
                row["error"] = sampled_error(out, q, k, v, causal, scale, rows)
                del out
                row["ms"] = time_call(torch, fn, (q, k, v, causal, scale), args.repeat, args.back_to_back)
                row["tflops"] = flops / row["ms"] / 1e9
            except Exception as exc:  # e.g. out of memory for the naive kernels at N = 16384
                row["failed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
            release_memory(torch)
            results.append(row)
        base = next((r for r in results if r["causal"] == causal and r["kernel"] == "torch.sdpa" and "ms" in r), None)
        for r in results:
            if r["causal"] == causal and base and "ms" in r:
                r["vs_torch"] = base["ms"] / r["ms"]
    return results


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        line = f"{r['n']:>6} {str(r['causal']):>6} {r['kernel']:<28}"
        if "failed" in r:
            print(f"{line} {r['failed']}", flush=True)
            continue
        ok = "ok" if r["error"] <= 1e-5 else "FAIL"
        print(f"{line} {r['ms']:>9.3f} {r['tflops']:>8.2f} {r.get('vs_torch', float('nan')):>9.2f}x"
              f" {r['error']:>9.1e} {ok}", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m attnkern.bench_gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--back-to-back", type=int, default=1,
                        help="calls per timed sample (1: isolated calls, launch overhead in full)")
    parser.add_argument("--check-rows", type=int, default=64, help="query rows per head checked against float64")
    parser.add_argument("--sweep", action="store_true", help="also time every cuda.flash tile that fits")
    parser.add_argument("--json", help="write the measurements to this file")
    args = parser.parse_args(argv)
    args.causal = {"both": [False, True], "yes": [True], "no": [False]}[args.causal]
    torch = _torch()
    for name in ("cuda.naive", "cuda.flash"):
        info = attnkern.kernel_info(name)
        if not info["available"]:
            sys.exit(f"{name} is not available: {info['reason']}")
    others = peers(torch)
    kernels = {"torch.sdpa": others.pop("torch.sdpa"), "cuda.flash": ours("cuda.flash"),
               "cuda.naive": ours("cuda.naive"), **others}
    if args.sweep:
        from attnkern.jit import _FLASH_TILES, cuda_kernels

        for bq, bk in _FLASH_TILES:
            if cuda_kernels.flash_shared_bytes(bq, bk, args.dim, args.dim, 4) <= cuda_kernels.SHARED_BYTES:
                kernels[f"cuda.flash[{bq}x{bk}]"] = ours("cuda.flash", block_q=bq, block_k=bk)
    print(f"# {torch.cuda.get_device_name()}; float32 (1, {args.heads}, N, {args.dim}); median of {args.repeat} "
          f"samples of {args.back_to_back} back-to-back call(s), CUDA events; "
          "error = max|out - ref| / (max|v| kappa), bound 1e-5")
    print(f"{'N':>6} {'causal':>6} {'kernel':<28} {'ms':>9} {'TFLOP/s':>8} {'vs torch':>10} {'error':>9}")
    rng = np.random.default_rng(0)
    everything = []
    for n in args.sizes:
        rows = measure(torch, kernels, n, args, rng)
        print_rows(rows)
        everything += rows
    if args.json:
        with open(args.json, "w") as f:
            json.dump(everything, f, indent=2)
    return 0 if all(r.get("error", 0) <= 1e-5 for r in everything) else 1


if __name__ == "__main__":
    raise SystemExit(main())
