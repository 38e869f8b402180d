"""What per-block FP8 scales would buy in accuracy, emulated on the CPU (no kernel has them yet):
attention of e4m3-quantized q, k, v against the float64 answer for the unquantized inputs, with one
scale a tensor (attnkern.quantize_fp8's amax / 448) and with one scale a block of BLOCK rows of each
head (amax of the block / 448), with and without the Hadamard rotation of q and k.

    python dev/fp8_block_scales_error.py [OUT.json] [--n 1024] [--heads 4] [--block 128]

The arithmetic is the FP8 kernel's, as tests/test_cuda_fp8.py's emulate() has it, in float64:
exact scores of the dequantized q and k, P against the row's global max times 2^8 rounded to e4m3,
row sums of the unrounded P. With per-block v scales, P's entries are also multiplied by
dv_block / dv_max before their rounding (so that one e4m3 P V product serves every block, the way a
kernel would fold them in) and the output by dv_max. Inputs: "gaussian" N(0, 1); "outliers" (FA3's:
N(0, 10^2) added to 0.1% of q's and k's elements); "channels" (4 of 128 channels of q and k 10x);
"tokens" (each row of q, k and v scaled by 2^u, u uniform in [-6, 6]: tokens of very different
norms); "v_blocks" (each block of BLOCK rows of v scaled by 2^u, u uniform in [-10, 0]: where a
per-tensor scale leaves the small blocks in e4m3's subnormals). Columns: "tensor" (per-tensor
scales), "block_qk" (q and k per block, v per tensor), "block" (all per block); "_hadamard" with
the rotation. Error: rms(out - ref) / rms(ref)."""

import argparse
import json
import math

import torch

import attnkern

E4M3_MAX = 448.0


def make_inputs(kind, shape, seed, block):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(3))
    if kind == "outliers":
        q, k = (x + 10 * torch.randn(shape, generator=g, dtype=torch.float64)
                * (torch.rand(shape, generator=g, dtype=torch.float64) < 1e-3) for x in (q, k))
    elif kind == "channels":
        ch = torch.randperm(shape[-1], generator=g)[:4]
        q[..., ch] *= 10
        k[..., ch] *= 10
    elif kind == "tokens":
        q, k, v = (x * 2.0 ** (12 * torch.rand(shape[:-1] + (1,), generator=g, dtype=torch.float64) - 6)
                   for x in (q, k, v))
    elif kind == "v_blocks":
        u = -10 * torch.rand(shape[:-2] + (shape[-2] // block, 1, 1), generator=g, dtype=torch.float64)
        v = (v.reshape(*shape[:-2], -1, block, shape[-1]) * 2.0 ** u).reshape(shape)
    return q, k, v


def quantize(x, block):
    """(x rounded to e4m3 and back, the scale of each row): one scale a tensor (block 0) or one a
    block of `block` rows of each head, amax / 448."""
    if block:
        rows = x.shape[-2]
        blocks = x.reshape(*x.shape[:-2], -1, block, x.shape[-1]) if rows % block == 0 else None
        if blocks is None:
            raise SystemExit(f"--block {block} must divide N {rows}")
        scale = (blocks.abs().amax(dim=(-1, -2), keepdim=True) / E4M3_MAX).clamp_min(1e-30)
        back = ((blocks / scale).float().to(torch.float8_e4m3fn).double() * scale).reshape(x.shape)
        return back, scale.expand(*blocks.shape[:-1], 1).reshape(*x.shape[:-1], 1)
    scale = max(float(x.abs().max()) / E4M3_MAX, 1e-30)
    return (x / scale).float().to(torch.float8_e4m3fn).double() * scale, torch.full(x.shape[:-1] + (1,), scale,
                                                                                  dtype=torch.float64)


def fp8_attention(q, k, v, causal, block, hadamard, block_v=True):
    """The emulated FP8 kernel's output for float64 q, k, v, scales per tensor (block 0) or per block
    (v's per tensor unless block_v)."""
    if hadamard:
        h = attnkern.hadamard_matrix(q.shape[-1], dtype=torch.float64)
        q, k = q @ h, k @ h
    (q8, _), (k8, _), (v8, dv) = (quantize(x, b) for x, b in ((q, block), (k, block), (v, block if block_v else 0)))
    s = (q8 @ k8.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    p = torch.exp(s - s.amax(-1, keepdim=True))
    dv_max = dv.amax(dim=-2, keepdim=True)  # (..., 1, 1)
    ratio = (dv / dv_max).transpose(-1, -2)  # (..., 1, nk): each key's dv_block / dv_max
    p8 = (p * ratio * 256).float().to(torch.float8_e4m3fn).double() / 256
    return (p8 @ (v8 / dv)) * dv_max / p.sum(-1, keepdim=True)


def reference(q, k, v, causal):
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(s, -1) @ v


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default="")
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--block", type=int, default=128)
    a = ap.parse_args()
    rows = []
    for kind in ("gaussian", "outliers", "channels", "tokens", "v_blocks"):
        for causal in (False, True):
            q, k, v = make_inputs(kind, (1, a.heads, a.n, 128), seed=len(rows), block=a.block)
            ref = reference(q, k, v, causal)
            row = {"inputs": kind, "causal": causal}
            for name, block, had, block_v in (("tensor", 0, False, True), ("tensor_hadamard", 0, True, True),
                                              ("block_qk", a.block, False, False), ("block", a.block, False, True),
                                              ("block_hadamard", a.block, True, True)):
                out = fp8_attention(q, k, v, causal, block, had, block_v)
                row[name] = float((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"n": a.n, "heads": a.heads, "block": a.block, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
