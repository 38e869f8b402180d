"""Compile triton.flash's kernels for sm_90 on a machine without a GPU and print each config's
registers, local memory (spills) and shared memory, so that configs that spill or do not fit
are dropped before device time is spent.

    python dev/triton_compile_check.py [--dims 64,128] [--kernels forward,dq,dkdv] [--configs ...]

Uses Triton's bundled ptxas and cuobjdump (-res-usage); bfloat16, D = Dv, every int argument
divisible by 16 (as at N = 2048..16384), plain calls (no features), causal and not.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_measure import CANDIDATES  # noqa: E402

from attnkern.backends.triton import flash  # noqa: E402

POINTERS = {"forward": dict(Q="*bf16", K="*bf16", V="*bf16", O="*bf16", LSE="*bf16", LENS="*bf16"),
            "dq": dict(Q="*bf16", K="*bf16", V="*bf16", O="*bf16", DO="*bf16", LSE="*bf16", DQ="*bf16",
                       DELTA="*fp32", LSE2="*fp32", LENS="*bf16"),
            "dkdv": dict(Q="*bf16", K="*bf16", V="*bf16", DO="*bf16", DELTA="*fp32", LSE2="*fp32", DK="*bf16",
                         DV="*bf16", LENS="*bf16")}
FLOATS = {"qk_scale", "cap_in", "cap_out", "scale", "LSE_ROUNDING"}
JITS = {"forward": flash.flash_forward, "dq": flash.flash_backward_dq, "dkdv": flash.flash_backward_dkdv}


def compile_one(kernel, cfg, d, causal):
    fn = JITS[kernel]
    bm, bn, warps, stages, *hopper = cfg  # forward: (..., TMA, warp_specialize) for its Hopper variant
    tma, ws = hopper or (False, False)
    consts = dict(TMA=bool(tma), WARP_SPECIALIZE=bool(ws), HEAD_DIM=d, HEAD_DV=d, HAS_LEFT=False, HAS_RIGHT=causal, HAS_LENS=False, SOFTCAP=False,
                  GROUP_GT1=False, WITH_LSE=True, EVEN_D=True, EVEN_DV=True, PRECISION="tf32", BLOCK_M=bm,
                  BLOCK_N=bn)
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            signature[name] = "constexpr"
            constexprs[name] = consts[name]
        elif name in POINTERS[kernel]:
            signature[name] = POINTERS[kernel][name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in FLOATS:
            signature[name] = "fp32"
        elif name in ("GROUP", "ROWS_PER_SEQ"):  # 1 in a plain call: Triton specializes it
            signature[name] = "constexpr"
            constexprs[name] = 1
        elif name in ("left", "right", "bottom_right"):
            signature[name] = "i32"
        else:
            signature[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, signature, constexprs, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    res = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res)
    return dict(reg=int(m[1]), stack=int(m[2]), local=int(m[4]), shared=compiled.metadata.shared)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dims", default="64,128")
    p.add_argument("--kernels", default="forward,dq,dkdv")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--only", default="", help="BM,BN,W,S[,TMA,WS];... instead of triton_measure's candidates")
    a = p.parse_args()
    if a.only:
        only = [tuple(int(x) for x in c.split(",")) for c in a.only.split(";")]
        for key in CANDIDATES:
            CANDIDATES[key] = only
    for kernel in a.kernels.split(","):
        for d in (int(x) for x in a.dims.split(",")):
            for causal in (bool(int(x)) for x in a.causal.split(",")):
                for cfg in CANDIDATES[kernel, d]:
                    try:
                        r = compile_one(kernel, cfg, d, causal)
                        flag = " SPILLS" if r["stack"] or r["local"] else ""
                        flag += " SMEM>227K" if r["shared"] > 232448 else ""
                        print(kernel, d, "causal" if causal else "full", cfg, r, flag, flush=True)
                    except Exception as exc:
                        print(kernel, d, causal, cfg, "FAILED", repr(exc)[:300], flush=True)


if __name__ == "__main__":
    main()
