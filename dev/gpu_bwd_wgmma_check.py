"""cuda.flash's half-precision backward at benchmark sizes against float64 autograd, under
FlashAttention's rule: each of dq, dk, dv within twice the error of torch's SDPA (its default
backend) in the same dtype plus two roundings of the largest gradient; repeated calls
bit-identical. Runs the default kernels (cpp.BWD_WGMMA True: wgmma on Hopper) and the mma.sync ones
(cpp.BWD_WGMMA False) on the same inputs, and with --configs each division named (D=division, e.g.
64=qwg1x64s3kvwg1x64s3) as the default at its D; with --fused the fused backward (cpp.BWD_DETERMINISTIC
False: dQ added atomically, so only dK and dV must repeat bit for bit). One GPU; prints a line per case,
JSON rows to --json.

    python3 dev/gpu_bwd_wgmma_check.py --sizes 1024 4096 --configs 128=qwg2x64s3kvwg2x64s3 --json out.json
"""

import argparse
import json

import torch
import torch.nn.functional as F

import attnkern
import attnkern.backends.cuda
from attnkern.backends.cuda import cpp

U = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


def grads_of(fn, q, k, v, dout):
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    fn(*leaves).backward(dout)
    return [x.grad for x in leaves]


def main():
    # the torch fast path keeps a plan (its kernels) per shape, made under the first
    # cpp.BWD_WGMMA it saw: the general path chooses the kernels on every call
    attnkern.backends.cuda.FAST_PATH = False
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--json")
    p.add_argument("--configs", nargs="*", default=[], help="D=division: also run it as D's wgmma default")
    p.add_argument("--fused", action="store_true", help="also the fused backward (cpp.BWD_DETERMINISTIC False) "
                   "at the head sizes it has (cpp.BWD_FUSED_DIVISIONS): dK and dV must repeat bit for bit, dQ need not")
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    p.add_argument("--only-fused", action="store_true", help="with --fused: skip the deterministic kernels")
    a = p.parse_args()
    extra = {}
    for spec in a.configs:
        d, name = spec.split("=")
        extra.setdefault(int(d), []).append(str(cpp.BwdConfig.parse(name)))
    rows, failures = [], 0
    for dtype in a.dtypes:
        for d in a.dims:
            for n in a.sizes:
                for causal in (False, True):
                    for h_kv in (8, 2):  # MHA and GQA (4 query heads a k/v head)
                        t = getattr(torch, dtype)
                        g = torch.Generator(device="cuda").manual_seed(n + d + causal + h_kv)
                        q = torch.randn(2, 8, n, d, device="cuda", generator=g).to(t)
                        k, v = (torch.randn(2, h_kv, n, d, device="cuda", generator=g).to(t) for _ in range(2))
                        dout = torch.randn(2, 8, n, d, device="cuda", generator=g).to(t)
                        rep = lambda x: x.repeat_interleave(8 // h_kv, 1)  # noqa: E731
                        ref = grads_of(lambda q, k, v: F.scaled_dot_product_attention(q, rep(k), rep(v), is_causal=causal),
                                       q.double(), k.double(), v.double(), dout.double())
                        theirs = grads_of(lambda q, k, v: F.scaled_dot_product_attention(
                            q, rep(k), rep(v), is_causal=causal), q, k, v, dout)
                        variants = [] if a.only_fused else [(True, None), (False, None),
                                                            *((True, x) for x in extra.get(d, []))]
                        if a.fused and d in cpp.BWD_FUSED_DIVISIONS:
                            variants.append((True, "fused"))
                        for wg, division in variants:
                            saved, cpp.BWD_WGMMA = cpp.BWD_WGMMA, wg
                            default = cpp.BWD_WGMMA_DIVISIONS[d]
                            fused = division == "fused"
                            cpp.BWD_WGMMA_DIVISIONS[d] = default if fused else division or default
                            cpp.BWD_DETERMINISTIC = not fused
                            try:
                                out, lse = attnkern.attention(q, k, v, kernel="cuda.flash", causal=causal,
                                                              return_lse=True)
                                ours = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="cuda.flash",
                                                                   causal=causal)
                                again = attnkern.attention_backward(q, k, v, out, dout, lse, kernel="cuda.flash",
                                                                    causal=causal)
                            finally:
                                cpp.BWD_WGMMA = saved
                                cpp.BWD_WGMMA_DIVISIONS[d] = default
                                cpp.BWD_DETERMINISTIC = True
                            if fused:
                                division = "fused " + cpp.BWD_FUSED_DIVISIONS[d]
                            same = [torch.equal(x, y) for x, y in zip(ours, again)]
                            row = {"dtype": dtype, "d": d, "n": n, "causal": causal, "h_kv": h_kv, "wgmma": wg,
                                   "division": division or (default if wg else "mma.sync"),
                                   "deterministic": all(same), "dq_repeats": same[0]}
                            # the fused backward adds dQ atomically: only dK and dV must repeat bit for bit
                            ok = all(same[1:]) if fused else row["deterministic"]
                            for name, x, y, r in zip(("dq", "dk", "dv"), ours, theirs, ref):
                                err = float((x.double() - r).abs().max())
                                terr = float((y.double() - r).abs().max())
                                limit = 2 * terr + 2 * U[dtype] * max(1.0, float(r.abs().max()))
                                row[name] = [err, terr, limit]
                                ok = ok and err <= limit
                            row["ok"] = ok
                            failures += not ok
                            rows.append(row)
                            print(f"{'ok  ' if ok else 'FAIL'} {dtype} D={d} N={n} causal={causal} h_kv={h_kv} "
                                  f"{row['division']} det={row['deterministic']} " + " ".join(
                                      f"{nm} {row[nm][0]:.2e}/{row[nm][2]:.2e}" for nm in ("dq", "dk", "dv")),
                                  flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"{failures} failures of {len(rows)}")


if __name__ == "__main__":
    main()
