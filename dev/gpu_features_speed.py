"""cuda.flash's time on torch CUDA tensors, plain and with the attention features
(one GPU): each sample is a pair of CUDA events around 5 back-to-back calls
(check_finite=False, after 10 untimed ones); the figure is the median of --runs
samples, in ms per call. The plain rows are what the featured kernels must not
slow down: run this script once with the tree before the features and once after,
in the same device session, and compare the rows of the same name. Two rows show
dropout's cost: the same featured call without and with dropout_p=0.1 (float32
without dropout runs the CUDA C++ kernels, with it the Numba kernel; float16/bfloat16
with it flash_mma.cu's dropout variant, on Hopper instead of flash_wgmma.cu).
--backward times attention_backward instead (out and lse computed once).

    python3 dev/gpu_features_speed.py [--runs 20] [--dtype bfloat16] [--dim 128] [--n 4096] [--plain-only]
                                      [--backward]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import attnkern


def median_ms(call, runs: int, back_to_back: int = 5) -> float:
    for _ in range(10):
        call()
    samples = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(back_to_back):
            call()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / back_to_back)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--plain-only", action="store_true")
    parser.add_argument("--backward", action="store_true", help="time attention_backward (float32, float64)")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    h, n, d = args.heads, args.n, args.dim
    q = torch.randn(1, h, n, d, device="cuda", dtype=dtype)
    kv = torch.randn(1, h, n, d, device="cuda", dtype=dtype)
    kv_gqa = kv[:, : h // 4].contiguous()
    rows = {
        "plain": dict(),
        "plain causal": dict(causal=True),
    }
    if not args.plain_only:
        rows.update({
            "gqa (H_kv = H/4)": dict(k=kv_gqa, v=kv_gqa),
            "gqa causal": dict(k=kv_gqa, v=kv_gqa, causal=True),
            "causal window (1023, 0)": dict(causal=True, window=(1023, 0)),
            "causal softcap 50": dict(causal=True, softcap=50.0),
            "key_lengths n/2": dict(key_lengths=[n // 2]),
        })
        rows.update({
            "causal key_lengths n": dict(causal=True, key_lengths=[n]),
            "causal key_lengths n dropout 0.1": dict(causal=True, key_lengths=[n], dropout_p=0.1, dropout_seed=1),
        })
    result = {}
    for name, kw in rows.items():
        k, v = kw.pop("k", kv), kw.pop("v", kv)
        if args.backward:
            out, lse = attnkern.attention(q, k, v, return_lse=True, check_finite=False, **kw)
            dout = torch.randn_like(out)
            result[name] = median_ms(lambda: attnkern.attention_backward(q, k, v, out, dout, lse, **kw), args.runs)
        else:
            result[name] = median_ms(lambda: attnkern.attention(q, k, v, check_finite=False, **kw), args.runs)
        print(f"{name:28s} {result[name]:.4f} ms", flush=True)
    print(json.dumps({"attnkern": attnkern.__file__, "device": torch.cuda.get_device_name(), "shape": [1, h, n, d], "dtype": args.dtype,
                      "backward": args.backward, "ms": result}))


if __name__ == "__main__":
    main()
