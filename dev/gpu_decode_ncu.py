"""Decode calls for Nsight Compute: cuda.flash's split-K decode and torch SDPA's cuDNN backend at
(B, 32, 1, D = 128) over (B, 8, Nk, 128) bfloat16 (GQA), each --calls times after a warm-up, the
timed calls between torch.cuda.profiler.start() and stop(), so that

    ncu --profile-from-start off --set full -o decode python3 dev/gpu_decode_ncu.py --batch 1 --nk 65536

profiles only them (each kernel's DRAM throughput, occupancy, waves and stall reasons side by side).
Without ncu it prints each contender's CUDA-event time per call (median of 20) and its
achieved bandwidth (K + V bytes / time)."""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import attnkern


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--nk", type=int, default=65536)
    p.add_argument("--calls", type=int, default=2)
    args = p.parse_args(argv)
    g = torch.Generator(device="cuda").manual_seed(0)
    b, nk = args.batch, args.nk
    q = torch.randn(b, 32, 1, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(b, 8, nk, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))

    def ours():
        return attnkern.attention(q, k, v, causal="bottom_right", check_finite=False, kernel="cuda.flash")

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(q, k, v, enable_gqa=True)

    contenders = {"cuda.flash": ours, "torch.cudnn": cudnn}
    for name, fn in contenders.items():
        diff = float((fn().float() - ours().float()).abs().max())
        for _ in range(5):
            fn()
        print(f"# {name}: max |difference| from cuda.flash {diff:.2e}")
    torch.cuda.synchronize()
    byte_count = 2 * k.numel() * k.element_size()
    for name, fn in contenders.items():
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(2_000_000)  # the GPU busy while the call is queued: its kernel time alone
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        t = statistics.median(times)
        print(f"{name:<12} B {b} Nk {nk}: {t * 1e6:8.1f} us  {byte_count / t / 1e9:7.0f} GB/s")
    torch.cuda.profiler.start()
    for name, fn in contenders.items():
        for _ in range(args.calls):
            fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
