"""cuda.flash's float16/bfloat16 dropout beside torch SDPA's backends with the same
dropout (one GPU): each sample is a pair of CUDA events around 5 back-to-back calls
(check_finite=False, after 5 untimed ones); the kernels are timed in turns (one sample
each per round), the figure is the median of --runs rounds, in ms per call. Rows:
cuda.flash without dropout (on Hopper at D = 64 and 128 its wgmma kernel), with
dropout_p (its mma.sync kernel with the Philox mask: flash_wgmma.cu has none), and each
torch.nn.attention.sdpa_kernel backend with dropout_p (a backend that refuses the
call is reported as such). --backward times forward plus backward through torch
autograd instead. Prints one JSON object; ATTNKERN_BENCH_SMOKE=1 runs a tiny shape
with 2 rounds (a check that the script runs, not a measurement).

    python3 dev/gpu_dropout_measure.py [--runs 15] [--dtype bfloat16] [--dim 128] [--n 4096] [--heads 16]
                                       [--causal] [--p 0.1] [--backward]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnkern

BACKENDS = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH")


def sample_ms(call, back_to_back: int = 5) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(back_to_back):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / back_to_back


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--p", type=float, default=0.1)
    parser.add_argument("--backward", action="store_true")
    args = parser.parse_args()
    smoke = os.environ.get("ATTNKERN_BENCH_SMOKE") == "1"
    n, runs = (256, 2) if smoke else (args.n, args.runs)
    dtype = getattr(torch, args.dtype)
    grad = args.backward
    q, k, v = (torch.randn(1, args.heads, n, args.dim, device="cuda", dtype=dtype, requires_grad=grad)
               for _ in range(3))
    dout = torch.randn_like(q)

    def timed(forward):
        if not grad:
            return lambda: forward()
        return lambda: forward().backward(dout)

    calls = {
        "cuda.flash": timed(lambda: attnkern.attention(q, k, v, kernel="cuda.flash", causal=args.causal,
                                                       check_finite=False)),
        f"cuda.flash dropout {args.p}": timed(lambda: attnkern.attention(
            q, k, v, kernel="cuda.flash", causal=args.causal, dropout_p=args.p, dropout_seed=1, check_finite=False)),
    }
    for name in BACKENDS:
        backend = getattr(SDPBackend, name)

        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=args.p, is_causal=args.causal)

        calls[f"sdpa {name.lower()} dropout {args.p}"] = timed(sdpa)
    result, refused = {}, {}
    for name, call in list(calls.items()):
        try:
            for _ in range(5):
                call()
            torch.cuda.synchronize()
        except Exception as e:  # a backend that does not take this call
            refused[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            del calls[name]
    samples = {name: [] for name in calls}
    for _ in range(runs):
        for name, call in calls.items():
            samples[name].append(sample_ms(call))
    result = {name: round(statistics.median(s), 4) for name, s in samples.items()}
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "dtype": args.dtype, "n": n, "heads": args.heads,
                      "dim": args.dim, "causal": args.causal, "p": args.p, "backward": grad, "ms": result,
                      "refused": refused}))


if __name__ == "__main__":
    main()
