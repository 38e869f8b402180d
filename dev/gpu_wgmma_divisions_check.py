"""flash_wgmma.cu's divisions (each made the default in turn: cpp.WGMMA_DEFAULT) on
attention features through the library's whole call, against the float64 reference
from the rounded inputs, bit-identical run to run; float16 and bfloat16, D 64 and 128.

    python3 dev/gpu_wgmma_divisions_check.py OUT.json [--divisions wg3k128,wg2k128s3e,...]

Cases: GQA causal, bottom-right with a window, key lengths, softcap and a negative
scale, a sliding window (a consumer warpgroup of the warp-specialized variant sees
none of a block's first tiles), a boolean and an additive mask, ALiBi, and a long
(many tiles: every stage of the ring reused) causal and non-causal call with lse.
Each case's scaled error must be within attnkern_bench.accuracy's bound for rounded P
(the tests' check_features_forward), lse within 10 times it."""

import argparse
import json
import sys

import numpy as np
import torch

import attnkern
from attnkern.backends.cuda import cpp
from attnkern_bench.accuracy import conditioning, tolerance

CASES = {
    "gqa-causal": ((2, 4), 2, 300, 300, dict(causal=True)),
    "everything": ((2, 4), 2, 130, 700, dict(causal="bottom_right", window=(200, 0), key_lengths=[700, 77],
                                             softcap=3.0, scale=-0.3)),
    "sliding-causal-softcap": ((1, 4), 2, 900, 900, dict(causal=True, window=(63, None), softcap=20.0)),
    "window-both": ((1, 2), 1, 600, 640, dict(window=(140, 30))),
    "bool-mask": ((1, 2), 2, 260, 520, dict(mask="bool")),
    "additive-mask": ((2, 2), 2, 200, 333, dict(mask="float", causal=True)),
    "alibi": ((1, 4), 4, 300, 300, dict(alibi=True, causal=True)),
    "long": ((1, 2), 2, 2600, 2600, dict()),
    "long-causal": ((1, 2), 2, 2600, 2600, dict(causal=True)),
}


def inputs(case, d, seed):
    (b, h), hkv, nq, nk, kw = case
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s) for s in ((b, h, nq, d), (b, hkv, nk, d), (b, hkv, nk, d)))
    kw = dict(kw)
    for b_, n in enumerate(kw.get("key_lengths") or []):
        k[b_, :, n:] = v[b_, :, n:] = np.nan
    mask = kw.pop("mask", None)
    if mask == "bool":
        kw["attn_mask"] = rng.random((1, h, nq, nk)) < 0.8
        kw["attn_mask"][..., 0] = True
    elif mask == "float":
        kw["attn_mask"] = rng.standard_normal((b, 1, nq, nk))
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = 2.0 ** -np.arange(1, h + 1)
    return (q, k, v), kw


def check(out, lse, q, k, v, kw, tol):
    ref, ref_lse = attnkern.reference(q, k, v, return_lse=True, **kw)
    empty = np.isneginf(ref_lse)
    if not (np.isfinite(out).all() and np.array_equal(np.isneginf(lse), empty) and (out[empty] == 0).all()):
        return float("inf"), float("inf")
    lengths = kw.get("key_lengths") or [k.shape[-2]] * k.shape[0]
    vmax = max(1.0, max(np.abs(v[b_, :, :n]).max(initial=0) for b_, n in enumerate(lengths)))
    per = vmax * conditioning(np.nan_to_num(q), np.nan_to_num(k), kw.get("scale"))
    err = np.abs(out - ref).max(initial=0) / per
    lse_err = np.abs(lse[~empty] - ref_lse[~empty]).max(initial=0) / max(1.0, np.abs(ref_lse[~empty]).max(initial=0))
    return float(err), float(lse_err)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--divisions", default="wg3k128,wg2k128s3,wg2k128s3e,wg2k64s6e,wg3k64s4e")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    a = ap.parse_args()
    rows, failed = [], 0
    for name in a.divisions.split(","):
        division = cpp.WgmmaConfig.parse(name)
        for d in map(int, a.dims.split(",")):
            try:
                division.check(d)
            except ValueError:
                continue
            if not cpp.wgmma_applies(d, d):
                raise SystemExit("flash_wgmma.cu does not run on this GPU")
            # the featured kernels run WGMMA_OTHER: the division's cp.async form (the TMA is for plain calls)
            before = cpp.WGMMA_DEFAULT[d], cpp.WGMMA_OTHER[d]
            cpp.WGMMA_DEFAULT[d], cpp.WGMMA_OTHER[d] = division, division.tma_off()
            for dtype in a.dtypes.split(","):
                tdtype, tol = getattr(torch, dtype), tolerance(dtype, rounds_p=True)
                for i, (case_name, case) in enumerate(CASES.items()):
                    (q, k, v), kw = inputs(case, d, seed=i)
                    tq, tk, tv = (torch.from_numpy(x).cuda().to(tdtype) for x in (q, k, v))
                    tkw, rkw = dict(kw), dict(kw)
                    mask = kw.get("attn_mask")
                    if mask is not None:  # an additive one in q's dtype, the reference's from its rounded values
                        tkw["attn_mask"] = torch.from_numpy(mask).cuda()
                        if mask.dtype != np.bool_:
                            tkw["attn_mask"] = tkw["attn_mask"].to(tdtype)
                            rkw["attn_mask"] = tkw["attn_mask"].double().cpu().numpy()
                    if "alibi_slopes" in kw:  # on the GPU, as the tests pass them
                        tkw["alibi_slopes"] = torch.from_numpy(kw["alibi_slopes"]).cuda()
                    row = {"division": name, "d": d, "dtype": dtype, "case": case_name}
                    try:
                        out, lse = attnkern.attention(tq, tk, tv, kernel="cuda.flash", return_lse=True,
                                                      check_finite=False, **tkw)
                        again = attnkern.attention(tq, tk, tv, kernel="cuda.flash", check_finite=False, **tkw)
                        rounded = [x.double().cpu().numpy() for x in (tq, tk, tv)]
                        err, lse_err = check(out.double().cpu().numpy(), lse.double().cpu().numpy(), *rounded, rkw, tol)
                        row.update(error=err, lse_error=lse_err, identical=bool(torch.equal(out, again)),
                                   ok=bool(err <= tol and lse_err <= 10 * tol and torch.equal(out, again)))
                    except Exception as e:  # reported, and the run goes on
                        row.update(ok=False, failed=repr(e)[:400])
                    failed += not row["ok"]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            cpp.WGMMA_DEFAULT[d], cpp.WGMMA_OTHER[d] = before
            with open(a.out, "w") as f:
                json.dump(rows, f, indent=1)
    print(f"{len(rows) - failed} of {len(rows)} ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
