"""triton.flash's kernels run by Triton's interpreter (TRITON_INTERPRET=1: on the CPU, on
torch CPU tensors) against the float64 reference, forward and backward, with every
feature, small blocks so that each of the three stages of every loop runs
(tests/test_triton.py runs this in a subprocess, as the interpreter must be chosen before
the kernels are defined). Prints one line per case; exits 1 on the first error beyond
the bound. float32 and float16 (the interpreter's bfloat16 products are wrong, the GPU
tests cover bfloat16).

    TRITON_INTERPRET=1 python tests/triton_interpreted.py
"""

import os
import sys

import numpy as np
import torch

import attnkern
from attnkern import _api
from attnkern.backends.triton import flash
from attnkern_bench.accuracy import conditioning

# (B, H, H_kv, nq, nk, d, dv, causal, features): partial blocks, GQA, both alignments, windows,
# key lengths (one of them 0: rows that see no key), softcaps
CASES = [(1, 2, 2, 37, 37, 16, 16, False, {}),
         (1, 2, 2, 37, 50, 20, 12, True, {}),
         (1, 4, 2, 40, 33, 16, 16, "bottom_right", {}),
         (2, 2, 1, 45, 70, 16, 32, False, {"window": (10, 5)}),
         (2, 2, 2, 45, 70, 16, 16, True, {"window": (7, None), "key_lengths": [0, 50]}),
         (2, 2, 2, 60, 45, 16, 16, "bottom_right", {"key_lengths": [30, 45], "softcap": 5.0}),
         (1, 2, 2, 70, 70, 16, 16, False, {"softcap": 2.0})]
BOUND_U = {"float32": (2.0 ** -24, 128), "float16": (2.0 ** -11, 4)}  # (u, the bound in u)


def check(dtype, blocks, case, seed):
    b, h, h_kv, nq, nk, d, dv, causal, feats = case
    for kernel in ("forward", "dq", "dkdv"):
        flash.OVERRIDE[kernel] = (blocks[0], blocks[1], 4, 1)
    g = torch.Generator().manual_seed(seed)
    tdtype = getattr(torch, dtype)
    q, k, v, dout = (torch.randn(b, heads, n, e, generator=g).to(tdtype)
                     for heads, n, e in ((h, nq, d), (h_kv, nk, d), (h_kv, nk, dv), (h, nq, dv)))
    host = [x.double().numpy() for x in (q, k, v, dout)]
    call = _api.validate(*host[:3], causal=causal, scale=None, check_finite=False, **feats)
    features = call.features if call.needs else None
    lens = None if features is None or features.key_lengths is None else torch.from_numpy(features.key_lengths)
    batch, batch_kv = b * h, b * h_kv
    flat = (q.reshape(batch, nq, d), k.reshape(batch_kv, nk, d), v.reshape(batch_kv, nk, dv))
    out, lse = torch.empty(batch, nq, dv, dtype=tdtype), torch.empty(batch, nq, dtype=tdtype)
    shape = (batch, batch_kv, nq, nk, d, dv, call.causal, call.scale, dtype, 1, features)
    flash.launch(*flat, out, lse, lens, *shape)
    grads = [torch.empty_like(x) for x in flat]
    scratch = torch.empty(2, batch, nq)
    flash.launch_backward(*flat, out, dout.reshape(batch, nq, dv), lse, *grads, lens, scratch[0], scratch[1], *shape)

    ref, ref_lse = attnkern.reference(*host[:3], causal=causal, return_lse=True, **feats)
    ref_grads = attnkern.reference_backward(*host, causal=causal, **feats)
    u, bound = BOUND_U[dtype]
    kappa = conditioning(host[0], host[1], call.scale)
    lse = lse.double().numpy().reshape(ref_lse.shape)
    seen = np.isfinite(ref_lse)
    errors = {"out": np.abs(out.double().numpy().reshape(ref.shape) - ref).max() / (max(1, np.abs(host[2]).max())
                                                                                   * kappa) / u,
              "lse": np.abs(lse[seen] - ref_lse[seen]).max(initial=0) / max(1, np.abs(ref_lse[seen]).max()) / u}
    if not (np.isneginf(lse[~seen]).all()):
        errors["lse"] = np.inf
    for name, grad, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        errors[name] = np.abs(grad.double().numpy().reshape(r.shape) - r).max() / (max(1, np.abs(r).max()) * kappa) / u
    worst = max(errors.values())
    print(f"{dtype} blocks {blocks} {case}: " + ", ".join(f"{n} {e:.2f}u" for n, e in errors.items()))
    return worst <= bound


def main():
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    runs = [("float32", (16, 16), CASES), ("float32", (32, 16), CASES[2:5]), ("float16", (16, 32), CASES[::2])]
    ok = True
    for dtype, blocks, cases in runs:
        for i, case in enumerate(cases):
            ok = check(dtype, blocks, case, i) and ok
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
