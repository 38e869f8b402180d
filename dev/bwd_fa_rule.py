"""native.flash's gradients by FlashAttention's rule against torch SDPA: for each case
(N, D, causal, seed) on (1, 2, N, D) standard normal inputs, the max error of dq, dk, dv
against the float64 gradient (attnkern_bench.accuracy.reference_backward) of the same
rounded inputs; a case breaks the rule where native.flash's error > 2x SDPA's + atol
(atol: one unit roundoff of the dtype times max(1, max|ref|)). Prints each case's ratios
and the count of breaks per gradient. Usage: dev/bwd_fa_rule.py [float32|bfloat16|float16]"""

import itertools
import sys

import numpy as np
import torch

import attnkern
from attnkern_bench.accuracy import UNIT_ROUNDOFF, reference_backward

dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
tdt = getattr(torch, dtype)
breaks = {"dq": 0, "dk": 0, "dv": 0}
cases = list(itertools.product((128, 512, 1024), (16, 64, 128), (False, True), (0, 1)))
for n, d, causal, seed in cases:
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn((1, 2, n, d), generator=gen, dtype=torch.float64).to(tdt) for _ in range(4))
    ref = reference_backward(*(x.double().numpy() for x in (q, k, v, dout)), causal=causal)
    ours = [x.clone().requires_grad_() for x in (q, k, v)]
    attnkern.attention(*ours, causal=causal, kernel="native.flash").backward(dout)
    theirs = [x.clone().requires_grad_() for x in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*theirs, is_causal=causal).backward(dout)
    row = []
    for name, a, t, r in zip(("dq", "dk", "dv"), ours, theirs, ref):
        ea, et = (np.abs(x.grad.double().numpy() - r).max() for x in (a, t))
        breaks[name] += ea > 2 * et + UNIT_ROUNDOFF[dtype] * max(1, np.abs(r).max())
        row.append(f"{name} {ea / et:.2f}")
    print(n, d, causal, seed, "  ".join(row), flush=True)
print(f"{dtype}: {len(cases)} cases; breaks of the rule:", breaks)
