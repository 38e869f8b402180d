"""Backward wall time of native.flash at one shape for several (block_q, block_k), beside
torch SDPA's: where the backward's block sizes matter (cache footprint grows with D).
Usage: dev/bwd_blocks.py N D [causal]"""
import sys
import time

import torch

import attnkern

n, d = int(sys.argv[1]), int(sys.argv[2])
causal = len(sys.argv) > 3 and sys.argv[3] == "1"
q, k, v, do = (torch.randn(1, 8, n, d) for _ in range(4))


def bwd_ms(f, reps=3):
    best = float("inf")
    for _ in range(reps):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        o = f(*xs)
        t0 = time.perf_counter()
        o.backward(do)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


print("sdpa", f"{bwd_ms(lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=causal)):.1f} ms")
for bq, bk in ((256, 256), (128, 128), (256, 128), (128, 256), (64, 128), (128, 64)):
    f = lambda a, b, c: attnkern.attention(a, b, c, causal=causal, kernel="native.flash", block_q=bq, block_k=bk)  # noqa: E731
    print(bq, bk, f"{bwd_ms(f):.1f} ms", flush=True)
