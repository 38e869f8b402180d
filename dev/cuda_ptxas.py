"""Compile cuda.flash's CUDA C++ sources here, without a GPU, and print ptxas's
registers, spills and shared memory per kernel (nvcc or the pip ptxas/NVRTC on PATH).

    python dev/cuda_ptxas.py [--arch sm_90a] [--arch sm_80] [--only NAME] [--sass DIR]

Each source is built as cpp._linked_kernel builds it (the ATTNKERN_* constants,
flash_common.cuh, the source) with a __global__ wrapper that passes its parameters
on, so the numbers are those of the device function inlined into a kernel (numba-cuda
links it into its own wrapper; registers can differ by a few). --sass DIR keeps each kernel's
cubin and, with cuobjdump and nvdisasm on PATH (pip wheels nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm), its SASS as DIR/<arch>_<name>.sass, to read a loop's instructions before a
device run."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile

HERE = os.path.join(os.path.dirname(__file__), "..", "attnkern", "backends", "cuda")
FEAT = ("int", "u64", "int", "int", "int", "int", "float", "u64", "int", "int", "u64", "u64", "u64", "u64", "float",
        "u64", "float", "u64", "u64", "float", "u64", "u64", "u64", "u64")
MMA = ("u64",) * 5 + ("int", "int", "float", "int", "int") + FEAT
BWD = ("u64",) * 11 + ("int", "int", "float", "float", "int") + FEAT

# (source, name, defines, parameter types): the decode kernels and their combine, at D = 128 and 64; the backward
KERNELS = [
    *(("flash_mma.cu", f"decode_bf16_d{d}_w{w}_k{bk}_s{st}",
       dict(D=d, BF16=1, BN=bk, STAGES=st, MT=1, NW=w, QSMEM=0, FEAT=1, MASK=0, ALIBI=0, DECODE=1, FAST=0),
       MMA + ("int", "int"))
      for d in (128, 64) for w in (1, 2, 4, 8) for bk in (64, 32, 16) for st in (2, 3, 4)),
    # decode kernels whose key warps share each K/V tile (ATTNKERN_KW)
    *(("flash_mma.cu", f"decode_bf16_d{d}_w{w}_k{bk}_s{st}_kw{kw}",
       dict(D=d, BF16=1, BN=bk, STAGES=st, MT=1, NW=w, KW=kw, QSMEM=0, FEAT=1, MASK=0, ALIBI=0, DECODE=1, FAST=0),
       MMA + ("int", "int"))
      for d in (128, 64) for w in (1, 2) for bk, kw in ((32, 2), (64, 2), (64, 4)) for st in (2, 3)),
    # the fused decode (one launch: the last block of a k/v row merges, ATTNKERN_FUSED), as cpp builds it
    *(("flash_mma.cu", f"decode_bf16_d{d}_w{w}_k{bk}_s{st}_kw{kw}_fused",
       dict(D=d, BF16=1, BN=bk, STAGES=st, MT=1, NW=w, KW=kw, QSMEM=0, FEAT=1, MASK=0, ALIBI=0, DECODE=1, FAST=0,
            FUSED=1, UNROLL=8, THREADS=32 * w * kw), MMA + ("int", "int", "u64", "u64", "u64"))
      for d in (128, 64) for w, bk, st, kw in ((1, 64, 2, 4), (1, 32, 3, 1), (2, 64, 2, 2), (8, 64, 2, 1))),
    # ... with the K/V loads' L2 prefetch hint (ATTNKERN_PREFETCH)
    *(("flash_mma.cu", f"decode_bf16_d128_w1_k64_s{st}_kw4_fused_p{p}",
       dict(D=128, BF16=1, BN=64, STAGES=st, MT=1, NW=1, KW=4, QSMEM=0, FEAT=1, MASK=0, ALIBI=0, DECODE=1, FAST=0,
            FUSED=1, UNROLL=8, PREFETCH=p, THREADS=128), MMA + ("int", "int", "u64", "u64", "u64"))
      for st in (2, 3) for p in (64, 128, 256)),
    # ... with an L2 evict-first policy on those loads (ATTNKERN_EVICT_FIRST, cpp.DECODE_EVICT_FIRST)
    ("flash_mma.cu", "decode_bf16_d128_w1_k64_s2_kw4_fused_p128_ef",
     dict(D=128, BF16=1, BN=64, STAGES=2, MT=1, NW=1, KW=4, QSMEM=0, FEAT=1, MASK=0, ALIBI=0, DECODE=1, FAST=0,
          FUSED=1, UNROLL=8, PREFETCH=128, EVICT_FIRST=1, THREADS=128), MMA + ("int", "int", "u64", "u64", "u64")),
    # ... with the keys on the mma's M (ATTNKERN_KEYS_M, cpp.DECODE_KEYS_M: groups of at most 8 rows)
    *(("flash_mma.cu", f"decode_{t}_d{d}_w1_k64_s2_kw{kw}_fused_p128_ef_km",
       dict(D=d, BF16=int(t == "bf16"), BN=64, STAGES=2, MT=1, NW=1, KW=kw, QSMEM=0, FEAT=1, MASK=0, ALIBI=0,
            DECODE=1, FAST=0, FUSED=1, UNROLL=8, PREFETCH=128, EVICT_FIRST=1, KEYS_M=1, THREADS=32 * kw),
       MMA + ("int", "int", "u64", "u64", "u64")) for t in ("bf16", "f16") for d in (128, 64, 32) for kw in (4, 2, 1)),
    *(("flash_combine.cu", f"combine_bf16_d{d}_u{u}", dict(D=d, BF16=1, FAST=0, UNROLL=u),
       ("u64",) * 4 + ("int",) * 4) for d in (128, 64) for u in (1, 8)),
    *(("flash_mma.cu", f"mma_bf16_d128_{name}",
       dict(D=128, BF16=1, BN=64, MT=2, NW=4, QSMEM=1, FEAT=feat, MASK=0, ALIBI=0, FAST=0), MMA)
      for name, feat in (("plain", 0), ("feat", 1))),
    # the backward (flash_bwd_mma.cu) in float32 (3xTF32) at the default divisions (cpp.bwd_config)
    *(("flash_bwd_mma.cu", f"bwd{part}_tf32_d{d}{'_feat' if feat else ''}",
       dict(D=d, BF16=0, TF32=1, PART=part, NW=nw, MT=1, BN=bn, FEAT=feat, MASK=4 * feat, ALIBI=feat), BWD)
      for d, parts in ((64, ((4, 64), (4, 32))), (128, ((8, 32), (4, 16))), (32, ((4, 64), (4, 32))),
                       (48, ((4, 64), (4, 32))), (80, ((8, 32), (8, 8))), (112, ((8, 32), (8, 8))))
      for part, (nw, bn) in zip((1, 2), parts) for feat in (0, 1)),
    # ... with dK and dV's columns in two slices at D = 128 (ATTNKERN_DSPLIT; cpp.BwdConfig's c suffix)
    *(("flash_bwd_mma.cu", f"bwd2_tf32_d128_w{nw}_n{bn}_c2{'_feat' if feat else ''}",
       dict(D=128, BF16=0, TF32=1, PART=2, NW=nw, MT=1, BN=bn, DSPLIT=2, FEAT=feat, MASK=4 * feat, ALIBI=feat), BWD)
      for nw in (4, 8) for bn in (16, 32) for feat in (0, 1)),
    *(("flash_bwd_mma.cu", f"bwd{part}_bf16_d{d}",
       dict(D=d, BF16=1, TF32=0, PART=part, NW=4, MT=1, BN=bn, FEAT=0, MASK=0, ALIBI=0), BWD)
      for d, bns in ((64, (64, 128)), (128, (64, 64))) for part, bn in zip((1, 2), bns)),
    # the dK/dV and dQ kernels on wgmma (PART 3 and 4, Hopper only: run with --arch sm_90a), plain and featured
    *(("flash_bwd_mma.cu", f"bwd{part}_bf16_d{d}_w{nw}_n{bn}{'_feat' if feat else ''}",
       dict(D=d, BF16=1, TF32=0, PART=part, NW=nw, MT=1, BN=bn, FEAT=feat, MASK=0, ALIBI=0), BWD)
      for part in (3, 4) for d in (64, 128) for nw in (4, 8) for bn in (64, 128) for feat in (0, 1)),
    # the same with a ring of STAGES streamed tiles copied whole at constant offsets (cpp.BwdConfig's s suffix)
    *(("flash_bwd_mma.cu", f"bwd{part}_bf16_d{d}_w{nw}_n{bn}_s{st}{'_feat' if feat else ''}",
       dict(D=d, BF16=1, TF32=0, PART=part, NW=nw, MT=1, BN=bn, FEAT=feat, MASK=0, ALIBI=0, STAGES=st), BWD)
      for part in (3, 4) for d, nw, bn, st in ((64, 4, 128, 2), (64, 4, 128, 3), (64, 4, 64, 3), (64, 8, 128, 3),
                                               (128, 8, 64, 3), (128, 8, 128, 2), (128, 8, 64, 4))
      for feat in (0, 1)),
    # the fused backward (cpp.BWD_DETERMINISTIC False, D = 64): its first kernel (part 5: S alone, the
    # corrected lse, delta), the dK/dV kernel with dQ added by bulk reductions (part 3, FUSEDQ) and dQ's conversion
    *(("flash_bwd_mma.cu", f"bwd5_bf16_d64_w{nw}_n{bn}_s2{'_feat' if feat else ''}",
       dict(D=64, BF16=1, TF32=0, PART=5, NW=nw, MT=1, BN=bn, FEAT=feat, MASK=0, ALIBI=0, STAGES=2), BWD)
      for nw, bn in ((4, 128), (8, 128)) for feat in (0, 1)),
    *(("flash_bwd_mma.cu", f"bwd3_bf16_d64_w4_n{bn}_s{st}_fusedq{'_feat' if feat else ''}",
       dict(D=64, BF16=1, TF32=0, PART=3, NW=4, MT=1, BN=bn, FEAT=feat, MASK=0, ALIBI=0, STAGES=st, FUSEDQ=1), BWD)
      for bn, st in ((64, 2), (64, 3), (128, 2)) for feat in (0, 1)),
    ("flash_bwd_mma.cu", "bwd6_bf16_d64", dict(D=64, BF16=1, TF32=0, PART=6, NW=4, MT=1, BN=64, FEAT=0, MASK=0, ALIBI=0),
     ("u64", "u64", "u64", "float", "int")),
    # the dropout variants (forward on mma.sync, both backward kernels) beside the backward's featured ones
    *(("flash_mma.cu", f"mma_bf16_d{d}_feat_dropout",
       dict(D=d, BF16=1, BN=64, MT=2, NW=4, QSMEM=int(d > 64), FEAT=1, MASK=0, ALIBI=0, FAST=0, DROPOUT=1), MMA)
      for d in (64, 128)),
    *(("flash_bwd_mma.cu", f"bwd{part}_bf16_d{d}_feat{'_dropout' * drop}",
       dict(D=d, BF16=1, TF32=0, PART=part, NW=4, MT=1, BN=128 if part == 2 and d <= 64 else 64, FEAT=1, MASK=0,
            ALIBI=0, DROPOUT=drop), BWD)
      for d in (64, 128) for part in (1, 2) for drop in (0, 1)),
    # flash_wgmma.cu: the default and its warp-specialized variant (a producer warpgroup, THREADS
    # threads; the consumers' registers after setmaxnreg are what the spills tell)
    *(("flash_wgmma.cu", f"wgmma_bf16_d{d}_wg{nwg}k{bn}" + (f"s{st}{'p' * pp}" if st else "") + "_feat" * feat,
       dict(D=d, BF16=1, BN=bn, NWG=nwg, FEAT=feat, MASK=0, ALIBI=0, FAST=0, WIDE=0,
            **(dict(WS=1, STAGES=st, PINGPONG=pp) if st else {}), THREADS=128 * (nwg + bool(st))), MMA)
      for d in (64, 128) for nwg, bn, st, pp in ((3, 128, 0, 0), (2, 128, 2, 0), (2, 128, 3, 1), (3, 64, 3, 0))
      for feat in (0, 1)),
    # its TMA producer (plain kernels only; K freed early, as the default)
    *(("flash_wgmma.cu", f"wgmma_bf16_d{d}_wg{nwg}k{bn}s{st}{'p' * pp}et{'_wide' * wide}",
       dict(D=d, BF16=1, BN=bn, NWG=nwg, FEAT=0, MASK=0, ALIBI=0, FAST=0, WIDE=wide, WS=1, STAGES=st, PINGPONG=pp,
            EARLYK=1, TMA=1, THREADS=128 * (nwg + 1)), MMA)
      for d in (64, 128) for nwg, bn, st, pp, wide in ((2, 128, 3, 0, 0), (2, 128, 2, 1, 0), (2, 128, 3, 0, 1))),
    # its persistent form (ATTNKERN_PERSIST, cpp.WgmmaConfig's P: one block an SM walking the tiles; one more
    # parameter, the batch rows), as the divisions dev/persist_run.sh measured
    *(("flash_wgmma.cu", f"wgmma_bf16_d{d}_wg2k{bn}s{st}{'p' * pp}etP",
       dict(D=d, BF16=1, BN=bn, NWG=2, FEAT=0, MASK=0, ALIBI=0, FAST=0, WIDE=0, WS=1, STAGES=st, PINGPONG=pp,
            EARLYK=1, TMA=1, PERSIST=1, THREADS=384), MMA + ("int",))
      for d, bn, st, pp in ((128, 176, 2, 1), (64, 128, 3, 0), (64, 128, 2, 1))),
    # ... with the dynamic walk (ATTNKERN_PERSIST 2, Pd: tiles taken from a counter; its address one more parameter)
    *(("flash_wgmma.cu", f"wgmma_bf16_d{d}_wg2k{bn}s{st}{'p' * pp}etPd",
       dict(D=d, BF16=1, BN=bn, NWG=2, FEAT=0, MASK=0, ALIBI=0, FAST=0, WIDE=0, WS=1, STAGES=st, PINGPONG=pp,
            EARLYK=1, TMA=1, PERSIST=2, THREADS=384), MMA + ("int", "u64"))
      for d, bn, st, pp in ((128, 176, 2, 1), (64, 128, 3, 0))),
    # its wider K/V tiles (FlashAttention-3's 128 x 176 at D = 128), with the TMA producer and without
    *(("flash_wgmma.cu", f"wgmma_bf16_d{d}_wg2k{bn}s{st}{'p' * pp}e{'t' * tma}",
       dict(D=d, BF16=1, BN=bn, NWG=2, FEAT=0, MASK=0, ALIBI=0, FAST=0, WIDE=0, WS=1, STAGES=st, PINGPONG=pp,
            EARLYK=1, TMA=tma, THREADS=384), MMA)
      for d, bn, st, pp, tma in ((128, 176, 2, 0, 1), (128, 176, 2, 1, 1), (128, 160, 2, 0, 1), (128, 176, 2, 0, 0),
                                 (64, 192, 3, 0, 1), (64, 192, 3, 1, 1), (64, 176, 3, 0, 1),
                                 (64, 256, 2, 0, 1), (64, 256, 2, 1, 1), (64, 256, 3, 1, 1))),
    # head sizes 192 and 256 on it (64-key tiles, 2-3 stages; TMA producer, plain, and the cp.async featured form)
    *(("flash_wgmma.cu", f"wgmma_bf16_d{d}_wg2k64s{st}{'p' * pp}e{'t' * tma}" + "_feat" * feat,
       dict(D=d, BF16=1, BN=64, NWG=2, FEAT=feat, MASK=0, ALIBI=0, FAST=0, WIDE=0, WS=1, STAGES=st, PINGPONG=pp,
            EARLYK=1, TMA=tma, THREADS=384), MMA)
      for d, st in ((256, 2), (192, 2), (192, 3)) for pp in (0, 1) for tma, feat in ((1, 0), (0, 1))),
    *(("flash_wgmma.cu", f"wgmma_bf16_d{d}_wg2k64s{st}e_wide", dict(D=d, BF16=1, BN=64, NWG=2, FEAT=0, MASK=0,
       ALIBI=0, FAST=0, WIDE=1, WS=1, STAGES=st, PINGPONG=0, EARLYK=1, TMA=0, THREADS=384), MMA)
      for d, st in ((192, 3), (256, 2))),
    *(("flash_wgmma.cu", f"wgmma_bf16_d{d}_wg2k64s{st}etPd", dict(D=d, BF16=1, BN=64, NWG=2, FEAT=0, MASK=0,
       ALIBI=0, FAST=0, WIDE=0, WS=1, STAGES=st, PINGPONG=0, EARLYK=1, TMA=1, PERSIST=2, THREADS=384), MMA + ("int", "u64"))
      for d, st in ((256, 2), (192, 3))),
    # three consumers at D = 64 (the default there), plain and its walk
    *(("flash_wgmma.cu", f"wgmma_bf16_d64_wg3k128s3et{walk}", dict(D=64, BF16=1, BN=128, NWG=3, FEAT=0, MASK=0, ALIBI=0,
       FAST=0, WIDE=0, WS=1, STAGES=3, PINGPONG=0, EARLYK=1, TMA=1, THREADS=512, **({"PERSIST": 2} if walk else {})),
       MMA + (("int", "u64") if walk else ())) for walk in ("", "Pd")),
    # its FP8 variant (e4m3 q, k, V^T; the kernel's three more parameters: out_scale, vt_stride,
    # descales), plain and featured (grouped k/v heads, bottom-right causal)
    *(("flash_wgmma.cu", f"wgmma_fp8_d128_wg2k128s{st}{'p' * pp}e" + "_feat" * feat,
       dict(D=128, BF16=1, FP8=1, BN=128, NWG=2, FEAT=feat, MASK=0, ALIBI=0, FAST=0, WIDE=0, WS=1, STAGES=st,
            PINGPONG=pp, EARLYK=1, THREADS=384), MMA + ("float", "int", "u64"))
      for st, pp in ((3, 0), (4, 0), (4, 1)) for feat in (0, 1)),
    # ... and on the TMA producer (one thread, K and V^T by tensor maps), 128-192 keys a tile, with ping-pong
    *(("flash_wgmma.cu", f"wgmma_fp8_d128_wg2k{bn}s{st}{'p' * pp}et" + "_feat" * feat,
       dict(D=128, BF16=1, FP8=1, BN=bn, NWG=2, FEAT=feat, MASK=0, ALIBI=0, FAST=0, WIDE=0, WS=1, STAGES=st,
            PINGPONG=pp, EARLYK=1, TMA=1, THREADS=384), MMA + ("float", "int", "u64"))
      for bn, st, pp in ((128, 3, 1), (128, 4, 1), (160, 3, 1), (192, 2, 1), (192, 3, 1), (192, 3, 0))
      for feat in (0, 1)),
    # the default's exponent variants (cpp.WgmmaConfig.fp8_exp: x1 P's 2^8 in the exponent, xk also
    # every k-th 8-key tile's probabilities on the FMA pipes; x1h the exponentials two at a time in half
    # precision, ex2.approx.f16x2)
    *(("flash_wgmma.cu", f"wgmma_fp8_d128_wg2k192s2petx{x}{'h' * h}" + "_feat" * feat,
       dict(D=128, BF16=1, FP8=1, BN=192, NWG=2, FEAT=feat, MASK=0, ALIBI=0, FAST=0, WIDE=0, WS=1, STAGES=2,
            PINGPONG=1, EARLYK=1, TMA=1, FP8_EXP=x, FP8_EXP_H=h, THREADS=384), MMA + ("float", "int", "u64"))
      for x, h in ((1, 0), (4, 0), (6, 0), (8, 0), (1, 1)) for feat in (0, 1)),
    # ... x1 (and x8) with P rounded during the softmax (cpp.WgmmaConfig.fp8_pack: c by cvt, i by integer operations)
    *(("flash_wgmma.cu", f"wgmma_fp8_d128_wg2k192s2petx{x}{'ci'[pk - 1]}" + "_feat" * feat,
       dict(D=128, BF16=1, FP8=1, BN=192, NWG=2, FEAT=feat, MASK=0, ALIBI=0, FAST=0, WIDE=0, WS=1, STAGES=2,
            PINGPONG=1, EARLYK=1, TMA=1, FP8_EXP=x, FP8_PACK=pk, THREADS=384), MMA + ("float", "int", "u64"))
      for x, pk in ((1, 1), (1, 2), (8, 2)) for feat in (0, 1)),
    # FP8's V^T pre-pass (cpp.fp8_vt_kernel)
    ("flash_fp8_vt.cu", "fp8_vt_128", dict(THREADS=256), ("u64", "u64", "int", "int")),
    # the packed-sequence variants (varlen), with dropout as attention_varlen may ask
    ("flash_mma.cu", "mma_bf16_d128_feat_varlen",
     dict(D=128, BF16=1, BN=64, MT=2, NW=4, QSMEM=1, FEAT=1, MASK=0, ALIBI=0, FAST=0, VARLEN=1, DROPOUT=1), MMA),
    # head sizes above 128 (float16/bfloat16 on mma.sync, cpp.mma_config and cpp.bwd_config): the forward
    # in 64-row blocks, 32-key tiles (64 beside them: slower on an H100); the backward's dQ kernel whole
    # (two column slices for packed sequences) and its dK/dV kernel in two column slices (DSPLIT), 32-row
    # and 32-key tiles (64-key dQ tiles up to 160); plain and with every feature; D = 208: the second
    # slice's columns past D skipped
    *(("flash_mma.cu", f"mma_bf16_d{d}_k{bn}{tag}",
       {**dict(D=d, BF16=1, BN=bn, MT=1, NW=4, QSMEM=1, FAST=0, FEAT=0, MASK=0, ALIBI=0), **extra}, MMA)
      for d in (144, 160, 176, 208, 224, 256) for bn, tag, extra in (
          (64, "", {}), (64, "_feat", dict(FEAT=1, MASK=4, ALIBI=1)),
          (32, "_feat_dropout_varlen", dict(FEAT=1, MASK=4, ALIBI=1, DROPOUT=1, VARLEN=1)))),
    *(("flash_bwd_mma.cu", f"bwd{part}_bf16_d{d}_c{split}{tag}",
       {**dict(D=d, BF16=1, TF32=0, PART=part, NW=4, MT=1, BN=64 if part == 1 and d <= 160 else 32, DSPLIT=split,
               FEAT=0, MASK=0, ALIBI=0), **extra}, BWD)
      for d in (144, 160, 176, 208, 224, 256) for part, split, tag, extra in (
          (1, 1, "", {}), (1, 1, "_feat_dropout", dict(FEAT=1, MASK=4, ALIBI=1, DROPOUT=1)),
          (1, 2, "_feat_dropout_varlen", dict(FEAT=1, MASK=4, ALIBI=1, DROPOUT=1, VARLEN=1)),
          (2, 2, "", {}), (2, 2, "_feat_dropout_varlen", dict(FEAT=1, MASK=4, ALIBI=1, DROPOUT=1, VARLEN=1)))),
    *(("flash_bwd_mma.cu", f"bwd{part}_bf16_d128_feat_varlen",
       dict(D=128, BF16=1, TF32=0, PART=part, NW=4, MT=1, BN=64, FEAT=1, MASK=0, ALIBI=1, VARLEN=1, DROPOUT=1), BWD)
      for part in (1, 2)),
]


def source(path: str, name: str, defines: dict, params: tuple) -> str:
    text = "".join(f"#define ATTNKERN_{k} {v}\n" for k, v in {**defines, "NAME": name, "DYNAMIC": 1}.items())
    wgmma = path == "flash_wgmma.cu" or defines.get("PART", 0) >= 3  # as cpp.source_headers
    for part in ("flash_common.cuh", *(("flash_wgmma_common.cuh",) if wgmma else ()), path):
        with open(os.path.join(HERE, part)) as f:
            text += f.read() + "\n"
    args = ", ".join(f"{t} a{i}" for i, t in enumerate(params))
    names = ", ".join(f"a{i}" for i in range(len(params)))
    # as numba-cuda's launch_bounds
    threads = defines.get("THREADS") or (32 * defines["NW"] if "NW" in defines else 0)
    # (one block an SM for the warp-specialized variant, as cpp._linked_kernel asks)
    bounds = f"__launch_bounds__({threads}{', 1' if defines.get('WS') else ''}) " if threads else ""
    return text + f'extern "C" __global__ void {bounds}k_{name}({args}) {{ {name}({names}); }}\n'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", help="e.g. sm_90a (default: sm_90a and sm_80)")
    parser.add_argument("--only", default="", help="a substring of the kernels' names")
    parser.add_argument("--sass", metavar="DIR", help="keep the cubins and their SASS (cuobjdump) in DIR")
    args = parser.parse_args()
    if args.sass:
        missing = [tool for tool in ("cuobjdump", "nvdisasm") if shutil.which(tool) is None]
        if missing:
            parser.error(f"--sass needs {' and '.join(missing)} on PATH (pip install nvidia-cuda-cuobjdump "
                         "nvidia-cuda-nvdisasm; their bin folders under site-packages/nvidia/cu*/bin)")
        os.makedirs(args.sass, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.arch or ["sm_90a", "sm_80"]:
            for path, name, defines, params in KERNELS:
                if args.only not in name:
                    continue
                cu = os.path.join(tmp, name + ".cu")
                with open(cu, "w") as f:
                    f.write(source(path, name, defines, params))
                run = subprocess.run(["nvcc", "-cubin", f"-arch={arch}", "-O3", "-Xptxas", "-v", "-o",
                                      os.path.join(tmp, name + ".cubin"), cu], capture_output=True, text=True)
                if run.returncode:
                    print(f"{arch} {name}: FAILED\n{run.stderr}")
                    continue
                if args.sass:
                    keep = os.path.join(args.sass, f"{arch}_{name}")
                    shutil.copy(os.path.join(tmp, name + ".cubin"), keep + ".cubin")
                    sass = subprocess.run(["cuobjdump", "-sass", keep + ".cubin"], capture_output=True, text=True)
                    with open(keep + ".sass", "w") as f:
                        f.write(sass.stdout if sass.returncode == 0 else sass.stderr)
                regs = re.search(r"Used (\d+) registers", run.stderr)
                spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", run.stderr)
                print(f"{arch} {name}: {regs.group(1) if regs else '?'} registers, "
                      f"spills {spill.group(1) if spill else '?'}/{spill.group(2) if spill else '?'} bytes")


if __name__ == "__main__":
    main()
