"""cuda.flash's CUDA C++ kernels and their configurations: the register-blocked
float32 kernel (flash_simt.cu: SimtConfig), the tensor-core kernels (flash_tf32.cu
in 3xTF32 for float32, flash_mma.cu for float16/bfloat16: MmaConfig; flash_wgmma.cu
on Hopper: WgmmaConfig), each a CUDA C++ device function that numba-cuda compiles
(NVRTC) and links into a kernel launched below Numba's dispatcher (launch.py)."""

from __future__ import annotations

import dataclasses
import functools
import os
import threading

import numpy as np
from numba import config, cuda

from ..._gpuarray import GpuArray
from .._split import DECODE_TARGET_BLOCKS, decode_chunk, decode_splits, rows_refusal

from .launch import (FEAT_TYPES, LOG2E, PLAIN_WORDS, SHARED_BYTES, Addr, RawKernel, TensorMap, dynamic_raw_kernel,
                     launch, register_raw, round_up, shared_limit)

# ---------------------------------------------------------------- cuda.flash, float32 register-blocked

@dataclasses.dataclass(frozen=True)
class SimtConfig:
    """How the float32 CUDA C++ kernel (flash_simt.cu) divides its work: block_q
    query rows and block_k keys a tile per block; each thread holds rows x keys
    scores (and rows x the head size / (block_k / keys) output columns)."""

    block_q: int = 64
    block_k: int = 64
    rows: int = 4
    keys: int = 8

    @property
    def key_groups(self) -> int:
        return self.block_k // self.keys

    @property
    def threads(self) -> int:
        return self.block_q // self.rows * self.key_groups

    def padded_d(self, d: int) -> int:
        """The head size the tiles hold: d rounded up so each key group's output
        columns are whole float4 chunks."""
        return round_up(d, 4 * self.key_groups)

    def shared_bytes(self, d: int) -> int:
        """Q, two K and two V tiles (rows padded by 4 floats) and P (rows padded by 8)."""
        ld = self.padded_d(d) + 4
        return (self.block_q * ld + 4 * self.block_k * ld + self.block_q * (self.block_k + 8)) * 4

    def __str__(self) -> str:
        return f"{self.block_q}x{self.block_k}t{self.rows}x{self.keys}"


SIMT_BLOCK_Q, SIMT_BLOCK_K = (32, 64, 128), (32, 64)  # the float32 kernel's tiles (of up to 64 x 64 area)


def simt_config(d: int, block_q: int = 0, block_k: int = 0) -> SimtConfig | None:
    """The float32 kernel's division for tile block_q x block_k at head size d (0:
    the default's, 64 x 64 up to d = 64, 64 x 32 above), or None where it has no
    such tile or the tile's shared memory exceeds this GPU's limit. Each thread
    holds 4 rows and 8 keys of scores (4 keys in 32-key tiles)."""
    bq, bk = block_q or 64, block_k or (64 if d <= 64 else 32)
    if bq not in SIMT_BLOCK_Q or bk not in SIMT_BLOCK_K or bq * bk > 4096:
        return None
    config = SimtConfig(bq, bk, 4, 8 if bk >= 64 else 4)
    return config if config.shared_bytes(d) <= shared_limit() else None


def simt_applies(d: int, dv: int) -> bool:
    """Whether the float32 kernel takes this head size: D = Dv, a multiple of 4 up to 128."""
    return d == dv and d % 4 == 0 and 4 <= d <= 128


def simt_aligned(*ptrs) -> bool:
    """Whether the float32 kernel can take arrays at these addresses (q, k, v, out[,
    lse]): 16-byte aligned (its float4 reads and writes), lse 4-byte aligned."""
    return not any(p % 16 for p in ptrs[:4]) and not any(p % 4 for p in ptrs[4:])


def flash_simt_kernel(d: int, config: SimtConfig | None = None, featured: bool = False, mask: int = 0,
                      alibi: bool = False, fast: bool = False):
    """cuda.flash's register-blocked float32 kernel for head size d: the CUDA C++
    device function of flash_simt.cu in a numba-cuda kernel, built and launched as
    the tensor-core kernel is (flash_mma_kernel); featured: the variant that takes
    the attention features (ATTNKERN_FEAT); mask: the kind of attention mask the
    featured variant reads (launch.MASK_KINDS, ATTNKERN_MASK; 0: none); alibi: the
    variant that adds ALiBi (ATTNKERN_ALIBI); fast: the fastmath variant (ATTNKERN_FAST)."""
    config = config or simt_config(d)
    return _linked_kernel("flash_simt.cu",
                          f"attnkern_flash_simt_{config.padded_d(d)}_{config}{_suffix(featured, mask, alibi, fast)}",
                          (("DP", config.padded_d(d)), ("BM", config.block_q), ("BN", config.block_k),
                           ("TM", config.rows), ("TN", config.keys), ("FEAT", int(featured)), ("MASK", mask),
                           ("ALIBI", int(alibi)), ("FAST", int(fast))),
                          ("u64",) * 5 + ("i32", "i32", "i32", "f32", "i32", "i32") + FEAT_TYPES, config.threads,
                          config.shared_bytes(d))


def flash_simt_launch(q, k, v, out, causal: bool, scale: float, lse=None, config: SimtConfig | None = None,
                      feat=None, fast: bool = False):
    """(kernel, grid, block, args) of the float32 kernel: launch() takes them, or
    Prepared; feat: a launch.KernelFeatures, or None (the plain kernel); fast: the
    fastmath variant."""
    batch, nq, d = q.shape
    config = config or simt_config(d)
    # its scores are in the log2 domain: the cap is c log2(e) there
    words = PLAIN_WORDS if feat is None else feat.words(1 / LOG2E)
    return (flash_simt_kernel(d, config, feat is not None,
                              mask=0 if feat is None else feat.mask_kind,
                              alibi=feat is not None and feat.alibi is not None, fast=fast),
            (-(-nq // config.block_q), batch), config.threads,
            (Addr(q), Addr(k), Addr(v), Addr(out), Addr(out if lse is None else lse), np.int32(nq),
             np.int32(k.shape[1]), np.int32(d), np.float32(scale * LOG2E), np.int32(bool(causal)),
             np.int32(lse is not None), *words))


def flash_simt(q, k, v, out, causal: bool, scale: float, lse=None, config: SimtConfig | None = None,
               feat=None, fast: bool = False) -> None:
    """out = softmax(q k^T * scale) v on float32 GpuArrays (batch, n, d), d = dv a
    multiple of 4 up to 128, at simt_aligned addresses; lse: None, or a GpuArray
    (batch, nq) to fill; feat: a launch.KernelFeatures or None."""
    kernel, grid, block, args = flash_simt_launch(q, k, v, out, causal, scale, lse, config, feat, fast)
    launch(kernel, grid, block, *args)


def source_headers(source: str, defines: dict) -> tuple:
    """The headers a CUDA C++ source takes before it, in order: flash_common.cuh always, and
    flash_wgmma_common.cuh (the wgmma wrappers) for flash_wgmma.cu and flash_bwd_mma.cu's wgmma
    kernels (PART 3: dK/dV, 4: dQ; 5 and 6: the fused backward's first and last kernels)."""
    wgmma = source == "flash_wgmma.cu" or (source == "flash_bwd_mma.cu" and defines.get("PART", 0) >= 3)
    return ("flash_common.cuh",) + (("flash_wgmma_common.cuh",) if wgmma else ())


@functools.cache
def _linked_kernel(source: str, name: str, defines: tuple, params: tuple, threads: int, shared: int):
    """A numba-cuda kernel whose body calls the CUDA C++ device function `name` of
    `source` (a file beside this one, after flash_common.cuh), compiled by numba-cuda (NVRTC) with the
    constants ATTNKERN_<key> of `defines` ((key, value) pairs; and NAME, DYNAMIC) prepended, linked into
    the kernel and compiled here for its one signature (params: "u64", "i32",
    "f32"); registered for launch() below the dispatcher, with `shared` bytes of
    dynamic shared memory where they exceed the static limit."""
    from numba.cuda import types as nbtypes

    dynamic = shared > SHARED_BYTES
    here = os.path.dirname(__file__)
    body = ""
    for part in (*source_headers(source, dict(defines)), source):  # NVRTC has no include path here
        with open(os.path.join(here, part)) as f:
            body += f.read() + "\n"
    defines = {**dict(defines), "NAME": name, "DYNAMIC": int(dynamic)}
    text = "".join(f"#define ATTNKERN_{key} {value}\n" for key, value in defines.items())
    types = {"u64": nbtypes.uint64, "i32": nbtypes.int32, "f32": nbtypes.float32}
    sig = nbtypes.void(*(types[p] for p in params))
    attend = cuda.declare_device(name, sig, link=[cuda.CUSource(text + body)], abi="c")
    args = ", ".join(f"a{i}" for i in range(len(params)))
    # a kernel of len(params) parameters that passes them on (Numba needs the names)
    scope = {"attend": attend}
    exec(f"def kernel({args}):\n    attend({args})\n", scope)
    # flash_wgmma.cu's warp-specialized variant moves registers between its warpgroups (setmaxnreg),
    # which needs the kernel to hold the most the bounds allow: one block an SM asks ptxas for that
    bounds = (threads, 1) if defines.get("WS") else threads
    kernel = cuda.jit(sig, launch_bounds=bounds)(scope["kernel"])
    compiled = next(iter(kernel.overloads.values()))
    raw = dynamic_raw_kernel(compiled, shared) if dynamic else RawKernel(compiled)
    register_raw(kernel, raw)
    return kernel


# ---------------------------------------------------------------- cuda.flash on tensor cores

MMA_DTYPES = ("float16", "bfloat16")  # the input dtypes of flash_mma.cu; float32 runs flash_tf32.cu


@dataclasses.dataclass(frozen=True)
class MmaConfig:
    """How a tensor-core kernel (flash_mma.cu for float16/bfloat16, flash_tf32.cu
    for float32) divides its work: `mt` 16-row mma tiles a warp (each K and V
    fragment read from shared memory feeds mt of them), `warps` warps a block,
    `block_k` keys a K/V tile, and whether Q's fragments are reloaded from shared
    memory every tile (`q_smem`, which frees the registers they would hold) or kept
    in registers."""

    mt: int = 1
    warps: int = 8
    block_k: int = 64
    q_smem: bool = False

    @property
    def block_q(self) -> int:
        return 16 * self.mt * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def shared_bytes(self, d: int, itemsize: int = 2) -> int:
        """Shared memory of one block at head size d: Q (if q_smem) and two K and two
        V tiles; 2-byte rows padded to d + 8 elements, float32 Q and K rows to d + 8
        and V rows to d + 4 (flash_tf32.cu)."""
        q_rows = self.block_q if self.q_smem else 0
        if itemsize == 2:
            return (q_rows + 4 * self.block_k) * (d + 8) * 2
        return ((q_rows + 2 * self.block_k) * (d + 8) + 2 * self.block_k * (d + 4)) * 4

    def __str__(self) -> str:
        return f"mt{self.mt}w{self.warps}k{self.block_k}{'qs' if self.q_smem else ''}"


def mma_config(d: int, dtype: str = "bfloat16") -> MmaConfig:
    """A tensor-core kernel's default work division at head size d. float16/bfloat16:
    FlashAttention-2's (4 warps of 32 query rows, 64-key tiles), with Q's fragments
    in registers up to d = 64 and reloaded from shared memory above, where the output
    accumulators of 32 rows leave no registers for them. float32 (3xTF32): 128 query
    rows and 64-key tiles, Q in shared memory, up to d = 64 in the same 4 warps,
    above it in 8 warps of 16 rows, as its registers allow (tf32_division).
    dev/gpu_flash_versions.py compares divisions. float16/bfloat16 above d = 128 (to
    HALF_MAX_HEAD): 4 warps of one mma tile (64 query rows; the output accumulators of 16
    rows x d take d / 2 registers a thread, 128 at d = 256), Q in shared memory, 32-key tiles
    (99 KB at d = 256, within the A100's 163 KB; ptxas, sm_90a and sm_80: at most 255 registers,
    no spills, every variant). On an H100 at d = 256, N = 4096 (bfloat16, 2026-11-26,
    docs/gpu-large-heads.md) they ran 1.20x (causal 1.10x) as fast as 64-key tiles, whose
    dropout and packed-sequence variants also spilled."""
    if dtype == "float32":
        return tf32_division(d, *TF32_DEFAULT_TILE)
    if d > 128:
        return MmaConfig(mt=1, warps=4, block_k=32, q_smem=True)
    return MmaConfig(mt=2, warps=4, block_k=64, q_smem=d > 64)


# flash_tf32.cu's tiles (block_q, block_k), and its default tile
TF32_BLOCK_Q, TF32_BLOCK_K = (64, 128), (32, 64)
TF32_DEFAULT_TILE = (128, 64)


def tf32_division(d: int, block_q: int, block_k: int) -> MmaConfig:
    """flash_tf32.cu's division for a tile: Q reloaded from shared memory (its split
    fragments and the output's two accumulators leave no registers for it), 4 warps
    of 16 rows for 64 query rows; for 128, up to d = 64 FlashAttention-2's 4 warps of
    2 mma tiles (each K and V fragment feeds two), above that 8 warps of one (two
    would spill). dev/gpu_flash_versions.py compares divisions."""
    mt = 2 if block_q == 128 and d <= 64 else 1
    return MmaConfig(mt=mt, warps=block_q // (16 * mt), block_k=block_k, q_smem=True)


def tf32_config(d: int, dv: int, block_q: int = 0, block_k: int = 0) -> MmaConfig | None:
    """The float32 tensor-core kernel's division for tile block_q x block_k (0: the
    default's) at head sizes d, dv, or None where it does not take them (D = Dv a
    multiple of 16 up to 128; tiles 64 or 128 x 32 or 64) or the tile's shared
    memory exceeds this GPU's limit."""
    if not mma_head_size_ok(d, dv):
        return None
    bq, bk = block_q or TF32_DEFAULT_TILE[0], block_k or TF32_DEFAULT_TILE[1]
    if bq not in TF32_BLOCK_Q or bk not in TF32_BLOCK_K:
        return None
    config = tf32_division(d, bq, bk)
    return config if config.shared_bytes(d, 4) <= shared_limit() else None


def tf32_aligned(*ptrs) -> bool:
    """Whether the float32 tensor-core kernel can take arrays at these addresses (q,
    k, v, out[, lse]): 16-byte aligned inputs, 8-byte aligned out (float2 writes)."""
    return not any(p % 16 for p in ptrs[:3]) and not ptrs[3] % 8 and not any(p % 4 for p in ptrs[4:])


def mma_head_size_ok(d: int, dv: int) -> bool:
    """Whether the float32 tensor-core kernels (3xTF32) and the split-K decode path take this
    head size: D = Dv, a multiple of 16 up to 128."""
    return d == dv and d % 16 == 0 and 16 <= d <= 128


HALF_MAX_HEAD = 256  # the largest head size of flash_mma.cu and flash_bwd_mma.cu's parts 1 and 2


def half_head_size_ok(d: int, dv: int) -> bool:
    """Whether the float16/bfloat16 kernels (flash_mma.cu forward, flash_bwd_mma.cu backward)
    take this head size: D = Dv, a multiple of 16 up to HALF_MAX_HEAD (256). Above 128 they run
    flash_mma.cu and flash_bwd_mma.cu's mma.sync parts 1 and 2 (on Hopper the forward at 192 and 256 runs
    flash_wgmma.cu: WGMMA_HEAD_SIZES; the backward's wgmma kernels take 64 and 128 only)."""
    return d == dv and d % 16 == 0 and 16 <= d <= HALF_MAX_HEAD


@dataclasses.dataclass(frozen=True)
class WgmmaConfig:
    """How flash_wgmma.cu (float16/bfloat16 on Hopper's warpgroup MMAs) divides its
    work: `warpgroups` of 4 warps and 64 query rows a block, `block_k` keys a K/V tile;
    `stages` 0: every warpgroup computes and copies, K/V tiles double-buffered behind
    block barriers; 2-6: the warp-specialized variant (ATTNKERN_WS), one more producer
    warpgroup copying K/V tiles into a ring of that many stages behind mbarriers, the
    `warpgroups` consumers pipelining each tile's scores with the previous tile's P V;
    `pingpong` (with stages and two consumers): the consumers take turns to issue their
    products (ATTNKERN_PINGPONG), one's softmax overlapping the other's products; `early_k`
    (with stages): a tile's K slot freed once its scores are in and K copied a tile ahead of V
    (ATTNKERN_EARLYK), else K and V freed together once its P V is in; `tma` (with stages): the
    producer is one thread copying whole tiles with the tensor memory accelerator (ATTNKERN_TMA,
    launch.TensorMap descriptors of K and V), plain calls only (a featured call runs the same
    division with cp.async copies: tma_off); `fp8_exp` (FP8 only, ATTNKERN_FP8_EXP): k > 0 scales
    P by 2^8 in its exponent instead of a multiply, k > 1 also computes the probabilities of every
    k-th 8-key tile on the FMA pipes (flash_common.cuh's exp2_fma) beside the ex2 unit; `half_exp`
    (FP8 with fp8_exp 1 only, ATTNKERN_FP8_EXP_H): the exponentials two at a time in half precision
    (ex2.approx.f16x2, which ptxas makes two MUFU.EX2 on sm_90a), their arguments formed in float32; `fp8_pack` (FP8 with fp8_exp > 0 and not
    half_exp, ATTNKERN_FP8_PACK): P rounded to e4m3 during the softmax into a second set of fragment
    registers rather than after the pending P V, 1 (c) by cvt (the same bits), 2 (i) by integer
    operations (ties rounded away from zero); `persistent` (with tma, float16/bfloat16,
    ATTNKERN_PERSIST; named by a P suffix): one block an SM (at most one a tile) that walks the
    (batch row, query block) tiles, its producer copying the next tile's first K/V tiles and its
    consumers loading the next Q rows while this tile's output is stored (persistent_grid); each tile's
    arithmetic is the other kernel's, so the results are bit-identical to the same division without P."""

    warpgroups: int = 3
    block_k: int = 128
    stages: int = 0
    pingpong: bool = False
    early_k: bool = False
    tma: bool = False
    fp8_exp: int = 0
    half_exp: bool = False
    fp8_pack: int = 0
    persistent: bool = False
    dynamic: bool = False  # (with persistent; named Pd) the walk takes tiles from a counter (ATTNKERN_PERSIST 2)

    def check(self, d: int, itemsize: int = 2) -> None:
        """ValueError unless flash_wgmma.cu has this division and head size (itemsize 1: FP8)."""
        ok = (self.block_k in (64, 128) or (self.stages and self.block_k in WS_WIDE_TILES)) and d in WGMMA_HEAD_SIZES
        # above D = 128 the output's D / 2 accumulators a thread leave room for 64 keys' scores only in the
        # warp-specialized consumers' 240 registers (float16/bfloat16)
        ok = ok and (d <= 128 or (self.stages > 0 and self.block_k == 64 and itemsize == 2))
        if self.stages:
            ok = ok and self.warpgroups in (2, 3) and 2 <= self.stages <= 6 and \
                self.shared_bytes(d, itemsize) <= WGMMA_SHARED_LIMIT
        else:
            ok = ok and self.warpgroups in (1, 2, 3)
        if self.pingpong or self.early_k or self.tma:
            ok = ok and self.stages > 0 and (self.warpgroups == 2 or not self.pingpong)
        ok = ok and (self.fp8_exp == 0 or (itemsize == 1 and 0 < self.fp8_exp <= self.block_k // 8))
        ok = ok and (not self.half_exp or self.fp8_exp == 1)
        ok = ok and (self.fp8_pack == 0 or (self.fp8_pack in (1, 2) and self.fp8_exp > 0 and not self.half_exp))
        ok = ok and (self.block_k != 256 or itemsize == 2)  # 256-key tiles: float16/bfloat16 only (FP8 untried)
        ok = ok and (not self.persistent or (self.tma and itemsize == 2)) and (not self.dynamic or self.persistent)
        if not ok:
            raise ValueError(f"flash_wgmma.cu has 1-3 warpgroups (2-3 with 2-6 stages, up to {WGMMA_SHARED_LIMIT} "
                             "bytes of shared memory; ping-pong with stages and 2, early K and TMA with stages, "
                             "an FP8 exponent variant x1... in FP8 only, h with x1 only, c or i with an x and no h, "
                             "256-key tiles not in FP8, persistent (P) with the TMA, not in FP8), "
                             f"64- or 128-key tiles (also {WS_WIDE_TILES} with stages) and D = 64 or 128 (192 or "
                             f"256: stages and 64-key tiles), not {self} "
                             f"at D = {d}")

    @property
    def block_q(self) -> int:
        return 64 * self.warpgroups

    @property
    def threads(self) -> int:
        return 128 * (self.warpgroups + (self.stages > 0))

    def shared_bytes(self, d: int, itemsize: int = 2) -> int:
        """Shared memory of one block at head size d: Q, two K and two V tiles (or `stages`
        of each, and their 4 mbarriers a stage), unpadded, and 1 KB to align them to the
        1024 bytes of the swizzle pattern."""
        if self.stages and itemsize == 1:  # FP8: a V^T tile is D rows of whole 128-key blocks (fp8_vt_blocks)
            return (self.block_q + self.stages * self.block_k) * d + self.stages * d * 128 * fp8_vt_blocks(
                self.block_k) + 1024 + 32 * self.stages
        if self.stages:  # (the dynamic walk: its two tile slots and their mbarriers)
            return (self.block_q + 2 * self.stages * self.block_k) * d * itemsize + 1024 + 32 * self.stages \
                + 48 * self.dynamic
        return (self.block_q + 4 * self.block_k) * d * itemsize + 1024

    def __str__(self) -> str:
        return (f"wg{self.warpgroups}k{self.block_k}" + (f"s{self.stages}" if self.stages else "")
                + ("p" if self.pingpong else "") + ("e" if self.early_k else "") + ("t" if self.tma else "")
                + (f"x{self.fp8_exp}" if self.fp8_exp else "") + ("h" if self.half_exp else "")
                + {0: "", 1: "c", 2: "i"}.get(self.fp8_pack, f"pack{self.fp8_pack}")
                + ("P" if self.persistent else "") + ("d" if self.dynamic else ""))

    @classmethod
    def parse(cls, name: str) -> "WgmmaConfig":
        """The division str() names: wg{warpgroups}k{keys}[s{stages}[p][e][t][x{k}][h][c|i][P]] (wg2k176s2petP:
        2 consumers, 176-key tiles, 2 stages, ping-pong, early K, the TMA, persistent); ValueError for
        another name (check() tells whether flash_wgmma.cu has it at a head size)."""
        import re

        found = re.fullmatch(r"wg(\d+)k(\d+)(?:s(\d+)(p)?(e)?(t)?(?:x(\d+))?(h)?([ci])?(P)?(d)?)?", name)
        if found is None:
            raise ValueError(f"not a flash_wgmma.cu division: {name!r} (e.g. wg2k128, wg2k128s3et, wg2k176s2petP)")
        wg, bk, stages, pingpong, early, tma, x, half, pack, persistent, dynamic = found.groups()
        return cls(int(wg), int(bk), int(stages or 0), bool(pingpong), bool(early), bool(tma), int(x or 0),
                   bool(half), " ci".index(pack or " "), bool(persistent), bool(dynamic))

    def tma_off(self) -> "WgmmaConfig":
        """This division with cp.async copies: the featured kernels' (the TMA fills K/V rows past nk
        with zeros, not those past a sequence's key length), not persistent (the persistent walk is the
        TMA kernel's)."""
        return dataclasses.replace(self, tma=False, persistent=False, dynamic=False)

    def grid(self, blocks: int, rows: int) -> tuple:
        """The launch's grid for `blocks` query blocks of `rows` batch rows: (blocks, rows), or, persistent, one
        block an SM up to one a tile (persistent_grid)."""
        return persistent_grid(blocks * rows) if self.persistent else (blocks, rows)


WS_WIDE_TILES = (160, 176, 192, 256)  # the warp-specialized variant's wider K/V tiles (wgmma_ss's N)
# flash_wgmma.cu's head sizes (the N of its P V products is D; 192 and 256 in the warp-specialized variant
# with 64-key tiles only: WgmmaConfig.check)
WGMMA_HEAD_SIZES = (64, 128, 192, 256)
WGMMA_CAPABILITY = (9, 0)  # wgmma is sm_90a's: Hopper only
WGMMA_SHARED_LIMIT = 227 * 1024  # a block's shared memory on the H100 and H200 (opt-in)


def persistent_grid(tiles: int) -> tuple:
    """A persistent flash_wgmma.cu kernel's grid (WgmmaConfig.persistent): min(tiles, this GPU's SMs) blocks,
    one an SM (its warp-specialized blocks hold all of an SM's registers: one fits), at least one."""
    return (max(1, min(tiles, sm_count())), 1)


def sm_count() -> int:
    """The current GPU's multiprocessors (SMs)."""
    return _sm_count(cuda.get_current_device().id)


@functools.cache
def _sm_count(device_id: int) -> int:
    return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def tile_counters() -> int:
    """The address of the dynamic persistent walk's counter on the current GPU (WgmmaConfig.dynamic): two
    uint32, zero between launches (each launch's last block zeroes them). One buffer for every launch:
    launches that overlap (other streams) would share it, so they must not."""
    return _tile_counters(cuda.get_current_device().id).device_ctypes_pointer.value


@functools.cache
def _tile_counters(device_id: int):
    return cuda.to_device(np.zeros(2, np.uint32))


def wgmma_applies(d: int, dv: int) -> bool:
    """Whether float16/bfloat16 at these head sizes run flash_wgmma.cu on this GPU."""
    if config.ENABLE_CUDASIM or d != dv or d not in WGMMA_HEAD_SIZES:
        return False
    return _capability(cuda.get_current_device().id) == WGMMA_CAPABILITY


@functools.cache
def _capability(device_id: int) -> tuple:
    return tuple(cuda.get_current_device().compute_capability)


def tensor_core_config(d: int, dtype: str, plain: bool = True) -> "MmaConfig | WgmmaConfig":
    """The default division of the dtype's tensor-core kernel at head size d (plain: for the
    plain kernel, else for the featured and float32-rows variants: half_config)."""
    return mma_config(d, dtype) if dtype == "float32" else half_config(d, dtype, plain)


# flash_wgmma.cu's default division per head size (half_config), read at each call: a
# module-level table so that a measurement can swap it (dev/gpu_flash_versions.py compares them,
# dev/pytest_wgmma_default.py runs the tests with another). The warp-specialized variant, consumers
# of 64 rows, K freed early, K/V copied by the TMA; at D = 64 128-key tiles in 3 stages (three
# consumers since, below), at D = 128 176-key tiles in 2 stages with ping-pong (FlashAttention-3's tile). On an
# H100 (docs/results.md, 2026-11-26, two runs of 12 bfloat16 rows) 1.03-1.05x (D = 64) and
# 0.99-1.18x (D = 128, 11 of 12 rows faster) the previous default wg2k128s3e, which has cp.async
# copies, itself 1.4-1.7x the double-buffered wg3k128. Their persistent forms (wg2k128s3etP,
# wg2k176s2petP: one block an SM walking the tiles by a static stride) were bit-identical but 0.80-1.10x
# as fast on an H100 (docs/gpu-forward-grid.md, 2026-11-27: slower causal and at N = 8192, level at
# N = 2048 without causal masking): opt-in divisions. Their dynamic form (Pd: each block takes its next
# tile from a counter, as the hardware's block scheduler hands out blocks) was bit-identical and at least
# as fast as the default in all 24 rows measured (bfloat16 (B, 16, N, D), B 2-8, N 2048-4096, causal and
# not: D = 128 1.00-1.14x on an H200, D = 64 1.03-1.24x on an H100; docs/gpu-forward-grid.md,
# 2026-11-27), unmeasured at batch 1 and N >= 8192: the plain call takes it in that range (persist_rule).
# At D = 64 three consumers (192-row blocks; 128 registers a thread, 160 for a consumer): on an H200
# (bfloat16 (B, 16, N, 64), B 1-8, N 1024-16384, causal and not, two runs, 2026-11-27;
# docs/gpu-forward-grid.md) wg3k128s3et ran 1.00-1.25x wg2k128s3et's speed in 64 of 72 rows, slower
# only where its blocks leave the last wave short (N 1024-2048 at batch 1-2: 0.80-0.96x; narrow_rule
# takes wg2k128s3et there without causal masking); 3 stages ran 0.98-1.12x 2 stages' speed (faster in
# 26 of 32 rows).
# At D = 192 and 256 64-key tiles are the only ones whose scores fit beside the output's D / 2
# accumulators a thread: two consumers of 64 rows, 2 stages at D = 256 (Q and the ring take 193 KB),
# 3 at D = 192, no ping-pong: on an H200 (bfloat16 (1, 16, N, D), N 4096/8192, causal and not;
# docs/gpu-large-heads.md, 2026-11-27) 1.01-1.10x cuDNN at D = 256 and 0.98-1.03x at D = 192, 2-4%
# faster than the same tiles with ping-pong in all 8 rows, and 3.0-3.5x flash_mma.cu's 32-key division
# (the default there before).
WGMMA_DEFAULT = {64: WgmmaConfig(3, 128, 3, early_k=True, tma=True),
                 128: WgmmaConfig(2, 176, 2, pingpong=True, early_k=True, tma=True),
                 192: WgmmaConfig(2, 64, 3, early_k=True, tma=True),
                 256: WgmmaConfig(2, 64, 2, early_k=True, tma=True)}
# The featured kernels' and the float32-rows (ATTNKERN_WIDE) variant's: the previous default,
# whose every feature the GPU tests have checked (the TMA is for plain calls: WgmmaConfig.tma);
# above D = 128 the plain default's with cp.async copies
WGMMA_OTHER = {**{d: WgmmaConfig(2, 128, 3, early_k=True) for d in (64, 128)},
               192: WgmmaConfig(2, 64, 3, early_k=True), 256: WgmmaConfig(2, 64, 2, early_k=True)}
WGMMA_FALLBACK = WgmmaConfig()  # where a GPU's shared memory is short of the default's (225 KB at D = 128)
# Where a plain call of the TMA default runs its dynamic persistent walk instead (persist_rule): per head
# size and causal masking (False, True), query lengths in [first, last] with at least `rows` folded batch
# rows (batch x heads), (first, last, rows) the range measured at least as fast. On an H200 (bfloat16 (B,
# 16, N, D), B 1-8, docs/gpu-forward-grid.md, 2026-11-27): D = 64, wg3k128s3etPd against wg3k128s3et,
# 1.01-1.09x without causal masking at N 1024-4096 (0.96-1.04x at 8192, 0.93-1.00x at 16384), 1.02-1.30x
# with it up to 8192 (0.95-1.05x at 16384); D = 128, wg2k176s2petPd against wg2k176s2pet, causal
# 1.01-1.34x at N 2048-8192 and batch 1-4 (one batch: 1.11-1.29x), 0.94-1.04x without (the walk was
# measured at least as fast at N 2048-4096 with >= 32 rows in an earlier run); D = 256, wg2k64s2etPd
# against wg2k64s2et, B 1-8, N 2048-8192: causal 1.02-1.38x at N 2048-4096 (0.90-1.10x at 8192),
# without causal masking 0.88-1.03x, so causal calls only (a range None: never). At D = 192 it was
# 0.89-1.09x either way: not taken. None turns the rule off.
PERSIST_NQ = {64: {False: (1024, 4096, 16), True: (1024, 8192, 16)},
              128: {False: (2048, 4096, 32), True: (2048, 8192, 16)},
              256: {False: None, True: (2048, 4096, 16)}}
# Where a plain call runs the persistent walk of WGMMA_SHORT[d] instead (persist_rule, before PERSIST_NQ):
# short rows (SHORT_NQ[d][causal]: (first, last, rows) as PERSIST_NQ's). At D = 128 on an H200 (bfloat16
# (B, 16, N, 128), two runs, 2026-11-27; docs/gpu-forward-grid.md) wg2k128s3etPd (128-key tiles in 3
# stages, no ping-pong, walked) was the fastest of the default wg2k176s2pet, its walk and five other
# divisions at N 1024-2048 and B 4-8 in all 16 rows of the two runs (1.02-1.09x the default's walk,
# 1.04-1.14x the default); at B 1-2 (second run) 1.01-1.03x the default's walk without causal masking,
# causal 1.03x at (2, 2048), 0.99x at (2, 1024) and (1, 1024), 1.00x at (1, 2048): causal from 32 rows.
# At N 4096 (B 4-8) 0.95-1.03x against the default's 0.98-1.04x: not taken there. At D = 64 the three
# consumers' 192-row blocks leave a third of each row's last block empty at N = 1024, and with causal
# masking that block is the row's heaviest: at (8, 16, 1024, 64) causal wg2k128s3etPd ran 1.05x and
# 1.07x wg3k128s3etPd's speed in two runs (H200, 2026-11-27), but 0.97x at batch 4 and 0.93x at
# (8, 2048): so there only, from 128 rows.
WGMMA_SHORT = {d: WgmmaConfig(2, 128, 3, early_k=True, tma=True) for d in (64, 128)}
SHORT_NQ = {64: {False: None, True: (1024, 1024, 128)},
            128: {False: (1024, 2048, 16), True: (1024, 2048, 32)}}
# Where a plain call without causal masking runs WGMMA_NARROW[d] instead of the default (narrow_rule): the
# default's query blocks fill less than NARROW_FILL of the SMs' last wave (one block an SM) and the
# narrower blocks fill more. At D = 64 the default's 192-row blocks leave 1.33 waves at (1, 16, 2048, 64)
# (176 blocks on 132 SMs), where wg2k128s3et's 128-row ones ran 1.23x as fast (1.08x against 0.88x
# cuDNN; H200, 2026-11-27); causal calls take the walk, which balances them (1.32x cuDNN there).
WGMMA_NARROW = {64: WgmmaConfig(2, 128, 3, early_k=True, tma=True)}
NARROW_FILL = 0.75


def wave_fill(blocks: int) -> float:
    """The share of the SMs' slots that `blocks` blocks of one an SM fill in their waves on this GPU."""
    sms = sm_count()
    return blocks / (-(-blocks // sms) * sms)


def narrow_rule(config: "MmaConfig | WgmmaConfig", rows: int, nq: int, d: int,
                causal: bool) -> "MmaConfig | WgmmaConfig":
    """config, or WGMMA_NARROW[d] where config is the plain default at head size d, the call is not
    causal and the default's query blocks fill less than NARROW_FILL of their last wave where the
    narrower ones fill more."""
    narrow = WGMMA_NARROW.get(d)
    if causal or narrow is None or config is not WGMMA_DEFAULT.get(d) or narrow.shared_bytes(d) > shared_limit():
        return config
    fill, narrow_fill = (wave_fill(-(-nq // c.block_q) * rows) for c in (config, narrow))
    return narrow if fill < NARROW_FILL <= narrow_fill else config


def persist_rule(config: "MmaConfig | WgmmaConfig", rows: int, nq: int, d: int,
                 causal: bool = False) -> "MmaConfig | WgmmaConfig":
    """config, or a dynamic persistent walk where a plain call of `rows` folded batch rows of nq
    queries at head size d, causal or not, lies in a measured range: WGMMA_SHORT[d]'s where config is
    the default and the call lies in SHORT_NQ's range, else config's own in PERSIST_NQ's (config the TMA
    kernel's); each where the GPU's shared memory a block holds the walk's 48 more bytes."""
    short = (SHORT_NQ or {}).get(d, {}).get(bool(causal))
    if short is not None and config is WGMMA_DEFAULT.get(d) and short[0] <= nq <= short[1] and rows >= short[2]:
        walk = dataclasses.replace(WGMMA_SHORT[d], persistent=True, dynamic=True)
        if walk.shared_bytes(d) <= shared_limit():
            return walk
    if PERSIST_NQ is None or not isinstance(config, WgmmaConfig) or not config.tma or config.persistent \
            or d not in PERSIST_NQ:
        return config
    measured = PERSIST_NQ[d][bool(causal)]
    if measured is None or not measured[0] <= nq <= measured[1] or rows < measured[2]:
        return config
    walk = dataclasses.replace(config, persistent=True, dynamic=True)
    return walk if walk.shared_bytes(d) <= shared_limit() else config


def half_config(d: int, dtype: str = "bfloat16", plain: bool = True) -> "MmaConfig | WgmmaConfig":
    """The float16/bfloat16 kernel's default division at head size d: flash_wgmma.cu's
    WGMMA_DEFAULT[d] (plain: the plain kernel's; else WGMMA_OTHER[d], the featured and
    float32-rows variants') where it applies (Hopper, D = 64, 128, 192 or 256; WGMMA_FALLBACK where
    this GPU's shared memory a block is short of it, flash_mma.cu's above D = 128), else flash_mma.cu's
    (mma_config). dev/gpu_flash_versions.py compares them."""
    if not wgmma_applies(d, d):
        return mma_config(d, dtype)
    division = (WGMMA_DEFAULT if plain else WGMMA_OTHER)[d]
    if division.shared_bytes(d) <= shared_limit():
        return division
    return WGMMA_FALLBACK if d <= 128 else mma_config(d, dtype)


def _suffix(featured: bool, mask: int, alibi: bool, fast: bool = False, dropout: bool = False,
            varlen: bool = False) -> str:
    """A kernel name's tail for its variant: plain, featured (_f), with a mask (m<kind>), with ALiBi (a),
    with dropout (d), packed sequences (v), fastmath (_fm)."""
    return (("_f" if featured else "") + (f"m{mask}" if mask else "") + ("a" if alibi else "")
            + ("d" if dropout else "") + ("v" if varlen else "") + ("_fm" if fast else ""))


def _dropout_of(feat) -> bool:
    """Whether a launch.KernelFeatures (or None) has dropout."""
    return feat is not None and feat.dropout_p > 0


def _varlen_of(feat) -> bool:
    """Whether a launch.KernelFeatures (or None) packs varlen sequences."""
    return feat is not None and feat.cu_q is not None


def _variant(dropout: bool, varlen: bool) -> tuple:
    """The defines of the dropout and varlen variants (none for the others: their kernels compile as before)."""
    return ((("DROPOUT", 1),) if dropout else ()) + ((("VARLEN", 1),) if varlen else ())


def _grid(blocks: int, rows: int, feat) -> tuple:
    """A launch's grid: (blocks, rows), or for packed sequences (blocks of the longest, rows, sequences)."""
    return (blocks, rows, feat.sequences) if _varlen_of(feat) else (blocks, rows)


def flash_mma_kernel(dtype: str, d: int, config: MmaConfig | WgmmaConfig | None = None, featured: bool = False,
                     mask: int = 0, alibi: bool = False, fast: bool = False, wide: bool = False,
                     dropout: bool = False, varlen: bool = False):
    """cuda.flash's tensor-core kernel for float16, bfloat16 (flash_wgmma.cu for a
    WgmmaConfig, flash_mma.cu for an MmaConfig) or float32 (flash_tf32.cu, 3xTF32),
    head size d and a work division (default half_config(d, dtype), or mma_config(d,
    dtype) for float32): a numba-cuda kernel whose body calls the CUDA C++ device
    function of the source, compiled by numba-cuda (NVRTC, for the GPU's
    arch-specific target: sm_90a on Hopper) with the constants for this dtype, head
    size and division and linked into the kernel. The C++ holds the tensor-core
    (wgmma, mma.sync, ldmatrix) and asynchronous-copy instructions as inline PTX:
    Numba's Python kernels reach neither, while numba-cuda still
    compiles and caches the kernel. It is compiled here, for its one signature, and
    launched below the dispatcher (RawKernel, registered for launch()); shared
    memory above the 48 KB a kernel gets without asking is dynamic, the kernel's
    limit raised to it. featured: the variant that takes the attention features
    (ATTNKERN_FEAT; the plain one compiles without them); mask: the kind of
    attention mask the featured variant reads (launch.MASK_KINDS; 0: none); alibi:
    the variant that adds ALiBi (ATTNKERN_ALIBI); fast: the fastmath variant
    (ATTNKERN_FAST: the approximate ex2, lg2 and reciprocal, flushing denormals);
    wide: the half kernels' variant that writes float32 rows and a log2-domain lse
    before any rounding (ATTNKERN_WIDE; the other variants compile without it); dropout: the
    featured flash_mma.cu variant that multiplies P by dropout's Philox mask (ATTNKERN_DROPOUT;
    flash_tf32.cu and flash_wgmma.cu have none: a ValueError); varlen: likewise, the variant over
    packed sequences (ATTNKERN_VARLEN, a grid of (query blocks, heads, sequences))."""
    config = config or tensor_core_config(d, dtype, plain=not featured and not wide)
    params = ("u64",) * 5 + ("i32", "i32", "f32", "i32", "i32") + FEAT_TYPES
    suffix = _suffix(featured, mask, alibi, fast, dropout, varlen) + ("_w" if wide else "")
    widen = (("WIDE", 1),) if wide else ()
    if (dropout or varlen) and (dtype == "float32" or not featured or wide or isinstance(config, WgmmaConfig)):
        raise ValueError("cuda.flash: dropout and packed sequences run on flash_mma.cu's featured float16/bfloat16 "
                         "kernels only")
    drop = _variant(dropout, varlen)
    if isinstance(config, WgmmaConfig):
        config = config.tma_off() if featured else config
        config.check(d)
        # the persistent kernel takes the batch rows (ATTNKERN_PERSIST's one more parameter)
        persist = (("PERSIST", 1 + config.dynamic),) if config.persistent else ()
        return _linked_kernel("flash_wgmma.cu", f"attnkern_flash_wgmma_{dtype}_{d}_{config}{suffix}",
                              (("D", d), ("BF16", int(dtype == "bfloat16")), ("BN", config.block_k),
                               ("NWG", config.warpgroups), ("FEAT", int(featured)), ("MASK", mask),
                               ("ALIBI", int(alibi)), ("FAST", int(fast)), *widen,
                               *((("WS", 1), ("STAGES", config.stages), ("PINGPONG", int(config.pingpong)),
                                  ("EARLYK", int(config.early_k)), ("TMA", int(config.tma)))
                                 if config.stages else ()), *persist),
                              params + ("i32",) * len(persist) + ("u64",) * config.dynamic, config.threads,
                              config.shared_bytes(d))
    division = (("BN", config.block_k), ("MT", config.mt), ("NW", config.warps), ("QSMEM", int(config.q_smem)),
                ("FEAT", int(featured)), ("MASK", mask), ("ALIBI", int(alibi)), ("FAST", int(fast)))
    if dtype == "float32":
        source, defines, itemsize = "flash_tf32.cu", (("D", d), *division), 4
    else:
        source, defines, itemsize = "flash_mma.cu", (("D", d), ("BF16", int(dtype == "bfloat16")), *division,
                                                     *widen, *drop), 2
    return _linked_kernel(source, f"attnkern_flash_mma_{dtype}_{d}_{config}{suffix}", defines, params,
                          config.threads, config.shared_bytes(d, itemsize))


# ---------------------------------------------------------------- cuda.flash in FP8 (e4m3) on Hopper

# flash_wgmma.cu's FP8 variant (ATTNKERN_FP8) at D = 128: its default division, read at each call
# (dev/gpu_fp8_measure.py swaps it to compare). FP8_CP_ASYNC: the division before the TMA one,
# 128-key tiles copied by a producer warpgroup's cp.async, no ping-pong (wg2k128s3e); the TMA
# divisions (one producer thread, K and V^T by tensor maps, ping-pong) take 128-192 keys a tile.
# wg2k192s2pet (192-key tiles in 2 stages, ping-pong, TMA) was the fastest of five divisions in all 6
# rows on an H100 (docs/gpu-fp8.md, 2026-11-26): 1.21-1.28x our bfloat16 kernel, where wg2k128s3e was
# 1.02-1.09x; the default, its x1 variant (P's 2^8 in the exponent: one multiply a score less), was
# 1-5% faster than it in all 6 rows of a second run (1.24-1.38x bfloat16); x4, x6, x8 (a share of the
# exps on the FMA pipes) were slower than x1 in every row. The GPU tests passed for each. x1c and x1i
# (P rounded during the softmax, by cvt and by integer operations) and x8i ran at 4-9%, 12-18% and
# 10-17% less than x1's speed in every row (H100, 2026-11-27), so x1 stays.
FP8_CP_ASYNC = WgmmaConfig(2, 128, 3, early_k=True)
FP8_DEFAULT = WgmmaConfig(2, 192, 2, pingpong=True, early_k=True, tma=True, fp8_exp=1)
FP8_HEAD_SIZES = (128,)
FP8_P_SCALE = 256.0  # the kernel's factor on P before its rounding to e4m3 (P_SCALE), undone in out_scale
FP8_VT_KEYS = 128  # V^T's rows are padded to a multiple of 128 keys (the TMA's box, the cp.async tile)
FP8_TMA_TILES = (128, 160, 192)  # the TMA divisions' key tiles: multiples of e4m3's 32-key k step
# True: V^T made by flash_fp8_vt.cu (one pass, on the legacy default stream); False: fp8_transpose_v's
# torch copy (the reference). The same bytes. Read at each call.
FP8_VT_KERNEL = True


def fp8_vt_blocks(block_k: int) -> int:
    """The 128-key column blocks of an FP8 V^T tile of block_k keys (flash_wgmma.cu's VT_BLOCKS)."""
    return -(-block_k // 128)


def fp8_config_check(config: WgmmaConfig) -> None:
    """ValueError unless flash_wgmma.cu's FP8 variant has this division: warp-specialized, 128-key
    tiles with cp.async copies, or 128, 160 or 192 with the TMA (ping-pong with two consumers)."""
    tiles = FP8_TMA_TILES if config.tma else (FP8_VT_KEYS,)
    if not config.stages or config.block_k not in tiles:
        raise ValueError(f"cuda.flash FP8 runs the warp-specialized divisions: {FP8_VT_KEYS}-key tiles with cp.async "
                         f"copies, or {FP8_TMA_TILES} keys with the TMA (t); not {config}")
    config.check(128, 1)


def flash_fp8_kernel(config: WgmmaConfig | None = None, featured: bool = False):
    """flash_wgmma.cu's FP8 variant at D = 128 for a division (default FP8_DEFAULT; fp8_config_check):
    e4m3 q, k and V^T (fp8_transpose_v's layout), bfloat16 out and lse; featured: the variant that
    takes grouped k/v heads and bottom-right causal masking (ATTNKERN_FEAT; no other feature has an
    FP8 kernel; with the TMA too, as both read every key below nk)."""
    config = config or FP8_DEFAULT
    fp8_config_check(config)
    params = ("u64",) * 5 + ("i32", "i32", "f32", "i32", "i32") + FEAT_TYPES + ("f32", "i32", "u64")
    return _linked_kernel("flash_wgmma.cu", f"attnkern_flash_wgmma_fp8_128_{config}{_suffix(featured, 0, False)}",
                          (("D", 128), ("BF16", 1), ("FP8", 1), ("BN", config.block_k), ("NWG", config.warpgroups),
                           ("FEAT", int(featured)), ("MASK", 0), ("ALIBI", 0), ("FAST", 0), ("WS", 1),
                           ("STAGES", config.stages), ("PINGPONG", int(config.pingpong)),
                           ("EARLYK", int(config.early_k)), ("TMA", int(config.tma)), ("FP8_EXP", config.fp8_exp),
                           ("FP8_EXP_H", int(config.half_exp)), ("FP8_PACK", config.fp8_pack)),
                          params, config.threads, config.shared_bytes(128, 1))


def fp8_transpose_v(v, keys: int):
    """V (rows, nk, D), a torch tensor of e4m3, as flash_fp8_launch's V^T: (rows, D, nk rounded up to `keys`) bytes, zero past
    nk, the keys of every 32 in the order of the 8-bit A fragment (flash_wgmma.cu's ATTNKERN_FP8
    comment): key 16h + 8a + 2t + b at column 16h + 4t + 2a + b. One copy (and a padding copy where
    nk is not a multiple of `keys`). The reference of fp8_vt (flash_fp8_vt.cu: the same bytes)."""
    import torch

    rows, nk, d = v.shape
    nkp = -(-nk // keys) * keys
    x = v.view(torch.uint8)
    if nkp != nk:
        x = torch.nn.functional.pad(x, (0, 0, 0, nkp - nk))
    # (rows, chunk, h, a, t, b, d) -> (rows, d, chunk, h, t, a, b)
    return x.view(rows, nkp // 32, 2, 2, 4, 2, d).permute(0, 6, 1, 2, 4, 3, 5).reshape(rows, d, nkp)


def fp8_vt_kernel():
    """flash_fp8_vt.cu: V (rows, nk, 128) e4m3 into fp8_transpose_v's V^T, 128 keys a block of 256 threads."""
    return _linked_kernel("flash_fp8_vt.cu", "attnkern_flash_fp8_vt_128", (), ("u64", "u64", "i32", "i32"), 256, 0)


def fp8_vt_launch(v, vt):
    """(kernel, grid, block, args) of flash_fp8_vt.cu: v (rows, nk, 128) and vt (rows, 128, vt_stride),
    vt_stride a multiple of FP8_VT_KEYS (GpuArrays of bytes at 16-byte aligned addresses)."""
    rows, nk, d = v.shape
    if d != 128 or vt.shape != (rows, 128, vt.shape[2]) or vt.shape[2] % FP8_VT_KEYS or vt.shape[2] < nk \
            or v.ptr % 16 or vt.ptr % 16:
        raise ValueError(f"cuda.flash FP8: V^T {vt.shape} does not fit V {v.shape} (rows, 128 rows of a multiple "
                         f"of {FP8_VT_KEYS} keys at least nk, 16-byte aligned)")
    return (fp8_vt_kernel(), (vt.shape[2] // FP8_VT_KEYS, rows), 256,
            (Addr(v), Addr(vt), np.int32(nk), np.int32(vt.shape[2])))


def _bytes_as_pairs(x, shape: tuple):
    """A GpuArray of bytes seen as 16-bit units of `shape` (a TensorMap's (batch, n, d) of 2-byte elements)."""
    return GpuArray(shape, np.uint16, None, ptr=x.ptr, owner=x)


def flash_fp8_launch(q, k, vt, out, lse, causal: bool, scale_log2: float, out_scale: float, feat=None,
                     config: WgmmaConfig | None = None, descales=None):
    """(kernel, grid, block, args) of the FP8 forward: q (batch, nq, 128) and k (batch_kv, nk, 128)
    e4m3, vt (batch_kv, 128, vt_stride) e4m3 (fp8_transpose_v's), out (batch, nq, 128) and lse
    (batch, nq) or None bfloat16 (GpuArrays: only their addresses and shapes are read); scale_log2:
    the softmax scale times descale_q descale_k times log2(e); out_scale: descale_v / FP8_P_SCALE;
    feat: a launch.KernelFeatures of grouped k/v heads and bottom-right masking only, or None;
    descales: None, or a GpuArray of 3 float32 (descale_q, descale_k, descale_v) that the kernel
    reads and multiplies in (scale_log2 and out_scale then without them; a descale that is not
    positive and finite makes the output NaN). A TMA
    division takes tensor maps where the other takes addresses: K's rows of 128 bytes as 64 16-bit
    units in boxes of block_k rows, V^T's D rows of vt_stride bytes in boxes of 128 keys (64 units)
    x 128 rows."""
    config = config or FP8_DEFAULT
    batch, nq, _ = q.shape
    words = PLAIN_WORDS if feat is None else feat.words(1.0)
    if config.tma:
        rows_kv, nk, d = k.shape
        kv = (TensorMap(_bytes_as_pairs(k, (rows_kv, nk, d // 2)), config.block_k),
              TensorMap(_bytes_as_pairs(vt, (rows_kv, d, vt.shape[2] // 2)), 128))
    else:
        kv = (Addr(k), Addr(vt))
    return (flash_fp8_kernel(config, feat is not None), (-(-nq // config.block_q), batch), config.threads,
            (Addr(q), *kv, Addr(out), Addr(out if lse is None else lse), np.int32(nq),
             np.int32(k.shape[1]), np.float32(scale_log2), np.int32(bool(causal)), np.int32(lse is not None),
             *words, np.float32(out_scale), np.int32(vt.shape[2]),
             np.uint64(0) if descales is None else Addr(descales)))


def mma_aligned(*ptrs) -> bool:
    """Whether the tensor-core kernel can take arrays at these addresses (q, k, v,
    out[, lse]): 16-byte aligned inputs, 4-byte aligned outputs."""
    return not any(p % 16 for p in ptrs[:3]) and not any(p % 4 for p in ptrs[3:])


def flash_mma_launch(q, k, v, out, causal: bool, scale: float, lse=None,
                     config: MmaConfig | WgmmaConfig | None = None, feat=None, fast: bool = False,
                     wide: bool = False):
    """(kernel, grid, block, args) of flash_mma(): launch() takes them, or Prepared.
    The grid is (query blocks, batch); config: the work division (default
    half_config(d), or mma_config(d) for float32); feat: a launch.KernelFeatures,
    or None (the plain kernel); fast: the fastmath variant; wide: the float32-rows
    variant (out and lse float32, lse in the log2 domain). Dropout runs flash_mma.cu (mma.sync)
    also on Hopper: flash_wgmma.cu has no Philox mask; so do packed sequences (feat.cu_q: the grid
    (query blocks of the longest sequence, heads, sequences))."""
    batch, nq, d = q.shape
    dtype = q.dtype.name
    dropout, varlen = _dropout_of(feat), _varlen_of(feat)
    if config is None:
        config = (mma_config(d, dtype) if dropout or varlen
                  else tensor_core_config(d, dtype, plain=feat is None and not wide))
        if feat is None and not wide:
            narrow = narrow_rule(config, batch, nq, d, bool(causal))
            config = narrow if narrow is not config else persist_rule(config, batch, nq, d, bool(causal))
    # its scores are q.k (Q's sign flipped for a negative scale): the cap is c / |scale| there
    if feat is not None and (feat.mask_kind > 1 or feat.alibi is not None) and scale == 0:
        raise ValueError("cuda.flash: an additive attn_mask or ALiBi with scale=0 is not supported on its tensor-core "
                         "kernels (float16/bfloat16, float32 with tensor_cores=1); pass tensor_cores=0 in float32")
    words = PLAIN_WORDS if feat is None else feat.words(abs(scale) or 1.0)
    # flash_wgmma.cu's TMA producer takes K's and V's tensor maps where the others take their addresses
    tma = isinstance(config, WgmmaConfig) and config.tma and feat is None
    kv = (TensorMap(k, config.block_k), TensorMap(v, config.block_k)) if tma else (Addr(k), Addr(v))
    blocks = -(-(feat.max_q if varlen else nq) // config.block_q)
    # its persistent kernel (plain calls only, as the TMA) walks the tiles from one block an SM
    persistent = tma and config.persistent
    return (flash_mma_kernel(dtype, d, config, feat is not None,
                              mask=0 if feat is None else feat.mask_kind,
                              alibi=feat is not None and feat.alibi is not None, fast=fast, wide=wide,
                              dropout=dropout, varlen=varlen),
            config.grid(blocks, batch) if persistent else _grid(blocks, batch, feat), config.threads,
            (Addr(q), *kv, Addr(out), Addr(out if lse is None else lse), np.int32(nq),
             np.int32(k.shape[1]), np.float32(scale * LOG2E), np.int32(bool(causal)), np.int32(lse is not None),
             *words, *((np.int32(batch),) if persistent else ()),
             *((np.uint64(tile_counters()),) if persistent and config.dynamic else ())))


def flash_mma(q, k, v, out, causal: bool, scale: float, lse=None, feat=None, fast: bool = False) -> None:
    """out = softmax(q k^T * scale) v on float16 or bfloat16 GpuArrays (batch, n, d)
    on tensor cores; lse: None, or a GpuArray (batch, nq) of out's dtype to fill;
    or out and lse both float32: the rows before their rounding to q's dtype and
    their lse in the log2 domain (the ATTNKERN_WIDE variant); feat: a
    launch.KernelFeatures or None; fast: the fastmath variant."""
    wide = out.dtype == np.float32
    if wide and (lse is None or lse.dtype != np.float32 or feat is not None):
        raise ValueError("cuda.flash: a float32 out of half inputs needs a float32 lse and no features")
    if not wide and (out.dtype != q.dtype or (lse is not None and lse.dtype != q.dtype)):
        raise ValueError(f"cuda.flash: out and lse must be of q's dtype {q.dtype}, or both float32")
    if not mma_aligned(*(a.ptr for a in ((q, k, v, out) if lse is None else (q, k, v, out, lse)))) \
            or (wide and out.ptr % 8):
        raise ValueError("cuda.flash: float16/bfloat16 inputs must start at 16-byte aligned addresses, "
                         "a float32 out at an 8-byte aligned one "
                         "(pass a fresh contiguous tensor: .contiguous() or .clone())")
    kernel, grid, block, args = flash_mma_launch(q, k, v, out, causal, scale, lse, feat=feat, fast=fast, wide=wide)
    launch(kernel, grid, block, *args)


# ---------------------------------------------------------------- cuda.flash's backward on tensor cores

@dataclasses.dataclass(frozen=True)
class BwdConfig:
    """How flash_bwd_mma.cu divides its work: the dQ kernel's `dq_warps` warps of
    `dq_mt` 16-row mma tiles of query rows each, streaming K/V tiles of `dq_keys` keys;
    the dK/dV kernel's `kv_warps` warps of `kv_mt` 16-key mma tiles each, streaming Q/dO
    tiles of `kv_rows` query rows (each B fragment read from shared memory feeds the
    warp's mt tiles). kv_wg > 0: the dK/dV kernel on Hopper's wgmma instead (flash_bwd_mma.cu's
    part 3: kv_wg warpgroups of 64 keys a block, Q/dO tiles of kv_rows = 64 or 128), and dq_wg > 0
    the dQ kernel (part 4: dq_wg warpgroups of 64 query rows, K/V tiles of dq_keys = 64 or 128); float16/bfloat16, D = 64 or
    128, no masks, ALiBi, dropout or packed sequences; kv_warps (dq_warps) is then 4 kv_wg (dq_wg).
    kv_stages / dq_stages (wgmma kernels only; named by an s suffix, qwg1x128s3kvwg1x128s3): 0 streams
    the tiles double-buffered with load_swizzled's copies, 2-4 through a ring of that many stages with
    whole tiles copied at constant offsets (flash_bwd_mma.cu's ATTNKERN_STAGES). dq_split / kv_split
    (mma.sync kernels only; named by a c suffix, q4x32kv4x32c2): the dQ (dK and dV) accumulators'
    columns split over that many blocks (flash_bwd_mma.cu's ATTNKERN_DSPLIT), each recomputing the
    scores and dP for its slice: the accumulators of D columns would not fit registers above 128."""

    dq_warps: int = 4
    dq_keys: int = 64
    kv_warps: int = 4
    kv_rows: int = 64
    dq_mt: int = 1
    kv_mt: int = 1
    kv_wg: int = 0
    dq_wg: int = 0
    kv_stages: int = 0
    dq_stages: int = 0
    dq_split: int = 1
    kv_split: int = 1

    def split(self, part: int) -> int:
        """The ATTNKERN_DSPLIT of part 1 (dQ) or 2 (dK/dV): column slices of its accumulators."""
        return self.dq_split if part == 1 else self.kv_split

    def part(self, part: int) -> tuple[int, int, int]:
        """(warps, mma tiles a warp, streamed rows) of part 1 (dQ) or 2 (dK/dV)."""
        return (self.dq_warps, self.dq_mt, self.dq_keys) if part == 1 else (self.kv_warps, self.kv_mt, self.kv_rows)

    def kernel_part(self, part: int) -> int:
        """The ATTNKERN_PART of part 1 (dQ: 1 on mma.sync, 4 on wgmma) or 2 (dK/dV: 2, or 3 on wgmma)."""
        return (4 if self.dq_wg else 1) if part == 1 else (3 if self.kv_wg else 2)

    def stages(self, part: int) -> int:
        """The ATTNKERN_STAGES of part 1 (dQ) or 2 (dK/dV): 0 for double buffering by load_swizzled."""
        return self.dq_stages if part == 1 else self.kv_stages

    def shared_bytes(self, d: int, part: int, itemsize: int = 2) -> int:
        """Shared memory of one block of part 1 (dQ) or 2 (dK/dV) at head size d: its
        own two operands of 16 mt warps rows, two buffers of two streamed tiles (rows
        padded to d + 8 elements of itemsize bytes: 2 for the half dtypes, 4 for float32),
        and for part 2 the streamed rows' lse and delta; the wgmma kernels' rows are
        unpadded (their swizzled layout), with 1 KB to align them to 1024 bytes, and their
        streamed tiles (and lse, delta) in stages(part) buffers (2 for 0)."""
        warps, mt, rows = self.part(part)
        if self.kernel_part(part) > 2:
            st = self.stages(part) or 2
            return (2 * 64 * warps // 4 + 2 * st * rows) * d * itemsize + (8 * st * rows if part == 2 else 0) + 1024
        return (2 * 16 * mt * warps + 4 * rows) * (d + 8) * itemsize + (16 * rows if part == 2 else 0)

    def part_name(self, part: int) -> str:
        """The name of part 1's (dQ) or 2's (dK/dV) half of the division (str() joins them): a
        kernel's name has only its own, so that divisions that share a kernel compile it once."""
        m = lambda mt: f"m{mt}" if mt != 1 else ""  # noqa: E731
        st = lambda n: f"s{n}" if n else ""  # noqa: E731
        c = lambda n: f"c{n}" if n != 1 else ""  # noqa: E731
        if part == 1:
            return (f"qwg{self.dq_wg}x{self.dq_keys}{st(self.dq_stages)}" if self.dq_wg
                    else f"q{self.dq_warps}x{self.dq_keys}{m(self.dq_mt)}{c(self.dq_split)}")
        return (f"kvwg{self.kv_wg}x{self.kv_rows}{st(self.kv_stages)}" if self.kv_wg
                else f"kv{self.kv_warps}x{self.kv_rows}{m(self.kv_mt)}{c(self.kv_split)}")

    def __str__(self) -> str:
        return self.part_name(1) + self.part_name(2)

    @classmethod
    def parse(cls, name: str) -> "BwdConfig":
        """The division str() names (q4x64kv4x32m2: 4 warps x 64 keys, then 4 warps of 2 tiles x 32 rows;
        qwg2x64kvwg2x64: both kernels on wgmma, 2 warpgroups each, 64-key and 64-row tiles;
        qwg1x128s3kvwg1x128s3: on wgmma with 3-stage rings; q4x32kv4x32c2: dK and dV's columns in 2 slices)."""
        import re

        half = r"(wg)?(\d+)x(\d+)(?:m(\d))?(?:s(\d))?(?:c(\d))?"
        found = re.fullmatch(f"q{half}kv{half}", name)
        # per half (wg, warps, rows, m, s, c): m and c on mma.sync only, s on wgmma only
        halves = (found.groups()[:6], found.groups()[6:]) if found else ()
        if found is None or any((wg and (m or c)) or (s and not wg) for wg, _, _, m, s, c in halves):
            raise ValueError(f"not a flash_bwd_mma.cu division: {name!r} (e.g. q4x64kv4x32m2, qwg2x64kvwg2x64, "
                             "qwg1x128s3kvwg1x128s3: stages on wgmma kernels only; q4x32kv4x32c2: column slices on "
                             "mma.sync kernels only)")
        (qwg, w1, k1, m1, s1, c1), (kvwg, w2, r2, m2, s2, c2) = halves
        w1, w2 = int(w1), int(w2)
        return cls(4 * w1 if qwg else w1, int(k1), 4 * w2 if kvwg else w2, int(r2), int(m1 or 1), int(m2 or 1),
                   w2 if kvwg else 0, w1 if qwg else 0, int(s2 or 0), int(s1 or 0), int(c1 or 1), int(c2 or 1))


def bwd_config(d: int, dtype: str = "bfloat16", wgmma: bool = True, varlen: bool = False) -> BwdConfig:
    """flash_bwd_mma.cu's default division at head size d. float32 (3xTF32), whose
    accumulations sum a tile in zeroed fragments (flash_bwd_mma.cu, accumulate): up to
    d = 64, 64 query rows a dQ block (4 warps) against 64-key tiles and 64 keys a dK/dV
    block against 32-row Q/dO tiles (ptxas, sm_90a: 165-168 registers, featured variants
    included; 64-row tiles spilled with the accumulation before); above, dQ blocks of 8 warps
    (128 rows; 4 warps a block, one block an SM, as shared memory allows, left half the warps of
    255-register threads idle) against 32-key tiles, and dK/dV blocks of 8 warps against 8-row
    Q/dO tiles, but at d = 128 of 4 warps (64 keys, two blocks an SM) against 16-row tiles: 254
    registers, no spills (they spilled before the tile sums), 1.10-1.13x the 8-row division's
    speed on an H100 (docs/gpu-backward.md); 16-row tiles spill 8-24 bytes at d = 80 and 112.
    float16/bfloat16: 64 query rows a dQ block
    (4 warps of one mma tile) against 64-key tiles; 64 keys a dK/dV block against
    Q/dO tiles of 128 rows up to d = 64, 64 above (the dK and dV accumulators of 16
    keys x d take d registers a thread; ptxas: 251-255 registers, no spills, for
    sm_80 and sm_90a). The fastest of dev/gpu_bwd_versions.py's divisions on an H200
    (bfloat16, N 4096 and 8192): two mma tiles a warp and 8 warps were slower. On Hopper at
    d = 64 or 128 (BWD_WGMMA_DIVISIONS, where wgmma_applies) both kernels run on wgmma unless wgmma or
    BWD_WGMMA is False. Above d = 128 (to HALF_MAX_HEAD; float16/bfloat16 only): 32-row Q/dO
    tiles, and dK and dV's columns split over two blocks (kv_split 2: 16 keys x d / 2 columns of
    each, as at d = 128); dQ's whole (16 rows x d: 128 registers at d = 256) against 32-key tiles,
    64-key ones up to d = 160 (ptxas capped the plain d = 160 kernel at 168 registers with 32-key
    tiles and spilled 8 bytes), but for packed sequences (varlen) in two slices too (whole, its
    variant spilled 8 bytes on sm_80 at d = 256); ptxas, sm_90a and sm_80: at most 255 registers, no
    spills, every variant; shared memory 132-133 KB a block at d = 256, within the A100's 163 KB."""
    if dtype == "float32":
        return BwdConfig(kv_rows=32) if d <= 64 else BwdConfig(8, 32, 4, 16) if d == 128 else BwdConfig(8, 32, 8, 8)
    if wgmma and BWD_WGMMA and d in BWD_WGMMA_DIVISIONS and wgmma_applies(d, d):
        return BwdConfig.parse(BWD_WGMMA_DIVISIONS[d])
    if d > 128:
        return BwdConfig(dq_keys=64 if d <= 160 else 32, kv_rows=32, kv_split=2, dq_split=2 if varlen else 1)
    return BwdConfig(kv_rows=128 if d <= 64 else 64)


# The half dtypes' backward on Hopper (sm_90a, D = 64 or 128): True runs flash_bwd_mma.cu's wgmma
# kernels (parts 4 and 3: dQ, dK/dV) in the divisions BWD_WGMMA_DIVISIONS names, False the mma.sync
# ones (parts 1 and 2) everywhere. Read whenever a call's kernels are chosen (the torch fast path
# keeps a shape's plan, its kernels, once made). Calls with a mask, ALiBi, dropout or packed
# sequences run parts 1 and 2 (bwd_wgmma_covers). The divisions: the fastest of
# dev/gpu_bwd_versions.py's on an H100 (bfloat16, N 4096 and 8192, causal and not;
# docs/gpu-backward-wgmma.md): at D = 64 one warpgroup a block and 128-key / 128-row tiles (two blocks
# an SM); at D = 128 two warpgroups and 128-key tiles for dQ, one warpgroup of 64 keys with 64-row
# Q/dO tiles for dK/dV (128-row ones spill there; 2.1-4.4% faster than two warpgroups of 64 keys in 3
# stages, with the same bits); streamed tiles copied whole at constant offsets (the s suffix: 1.26-1.33x
# the plain double buffering at D = 64, 1.13-1.17x at D = 128), in 2 stages (3 leave one block an SM at
# D = 64).
BWD_WGMMA = True
BWD_WGMMA_DIVISIONS = {64: "qwg1x128s2kvwg1x128s2", 128: "qwg2x128s2kvwg1x64s2"}
# True (the default): the backward is deterministic, bit-identical run to run (dQ in its own kernel,
# every sum in a fixed order). False: on Hopper at D = 64 (BWD_FUSED_DIVISIONS), float16/bfloat16
# without masks, ALiBi, dropout or packed sequences (bwd_wgmma_covers), FlashAttention-3's fused
# backward runs instead: a first kernel of S = Q K^T alone for delta and the corrected lse
# (flash_bwd_mma.cu's part 5), then one kernel for dK, dV and dQ (part 3 with FUSEDQ: dS through
# shared memory, each 64-row tile of dQ += dS K staged there and added to a float32 accumulator by a
# bulk reduction, in the order the blocks happen to run), then dQ's conversion (part 6): 6 N x N x D
# products (5 fused, S once more in the first kernel) and the exponentials twice, instead of 7. dK and
# dV stay bit-identical run to run; dQ does not (its float32 additions' order varies), though it is
# within FlashAttention's error rule. Measured slower: 1.38-1.48x the default's time on an H200
# (bfloat16, N 4096-16384), and 1.12-1.20x without its first kernel (docs/gpu-backward-wgmma.md: the
# additions, dQ's product and dS's stores cost more than the two products saved), so it stays an
# opt-in. Read whenever a call's kernels are chosen: the torch fast path keeps a call shape's plan, so
# call attnkern.backends.cuda.forget_plans() after changing it. The division names the first kernel's
# half (qwg..., the dQ kernel's grid and key tiles) and the fused kernel's (kvwg1x...: one warpgroup of
# 64 keys; ptxas, sm_90a: 223 registers with 64-row Q/dO tiles, 245 featured, no spills; 128-row tiles
# spill featured). The environment variable ATTNKERN_BWD_DETERMINISTIC sets it at import ("0": False,
# "1" or unset: True), so that a whole process (a test run, `attnkern bench`) takes the fused backward
# from its start.
def _deterministic_from_env() -> bool:
    """ATTNKERN_BWD_DETERMINISTIC as BWD_DETERMINISTIC: unset or empty True, "1" True, "0" False."""
    text = os.environ.get("ATTNKERN_BWD_DETERMINISTIC", "").strip()
    if text not in ("", "0", "1"):
        raise ValueError(f"ATTNKERN_BWD_DETERMINISTIC must be 0 (the fused, non-deterministic backward where it "
                         f"applies) or 1 (deterministic, the default), not {text!r}")
    return text != "0"


BWD_DETERMINISTIC = _deterministic_from_env()
BWD_FUSED_DIVISIONS = {64: "qwg1x128s2kvwg1x64s2"}
# Timing studies of the fused kernel only: (KEY, VALUE) pairs compiled into it as ATTNKERN_KEY
# (flash_bwd_mma.cu's FUSEDQ_SKIP leaves parts of its work out, so dQ is then wrong; read when the
# kernel is compiled, named into it). dev/gpu_bwd_versions.py --fused-define sets it.
BWD_FUSED_STUDY = ()


def bwd_wgmma_covers(feat) -> bool:
    """Whether flash_bwd_mma.cu's wgmma kernels (parts 3, 4) have this call's features (a
    launch.KernelFeatures or None): GQA, causal alignments, windows, key lengths and the softcap;
    masks, ALiBi, dropout and packed sequences run the mma.sync kernels (parts 1, 2)."""
    return feat is None or not (feat.mask_kind or feat.alibi is not None or _dropout_of(feat) or _varlen_of(feat))


BWD_PARAMS = ("u64",) * 11 + ("i32", "i32", "f32", "f32", "i32")
CONVERT_PARAMS = ("u64", "u64", "u64", "f32", "i32")  # part 6: dq32, dq, pairs of elements, scale, nq
CONVERT_THREADS = 256


def bwd_fused_config(d: int, dtype: str, feat=None) -> "BwdConfig | None":
    """The fused backward's division (BWD_FUSED_DIVISIONS) where it runs this call (BWD_DETERMINISTIC
    False, float16/bfloat16 at a head size it has on Hopper's wgmma, features bwd_wgmma_covers takes),
    else None (the deterministic kernels run)."""
    if (BWD_DETERMINISTIC or dtype not in MMA_DTYPES or d not in BWD_FUSED_DIVISIONS or not BWD_WGMMA
            or not wgmma_applies(d, d) or not bwd_wgmma_covers(feat)):
        return None
    return BwdConfig.parse(BWD_FUSED_DIVISIONS[d])


def flash_bwd_fused_kernels(dtype: str, d: int, config: BwdConfig, featured: bool = False):
    """(first kernel, dK/dV/dQ kernel, dQ's conversion) of the fused backward (BWD_DETERMINISTIC
    False; flash_bwd_mma.cu's parts 5, 3 with FUSEDQ, and 6) for float16/bfloat16 at D = 64 in
    the division config (qwg{n}x{keys}s{st}: the first kernel's; kvwg1x{64,128}s{st}: the fused one's)."""
    if (dtype not in MMA_DTYPES or d != 64 or not config.dq_wg or config.dq_keys not in (64, 128)
            or config.kv_wg != 1 or config.kv_rows not in (64, 128)
            or any(s not in (0, 2, 3, 4) for s in (config.dq_stages, config.kv_stages))):
        raise ValueError(f"the fused backward takes float16/bfloat16 at D = 64 in a division qwg<n>x<64|128>[s<st>]"
                         f"kvwg1x<64|128>[s<st>] (one warpgroup of 64 keys), not {dtype} at D = {d} in {config}")
    if not all(isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str) and pair[0].isidentifier()
               and str(pair[1]).lstrip("-").isdigit() for pair in BWD_FUSED_STUDY):
        raise ValueError(f"cpp.BWD_FUSED_STUDY must be (NAME, integer) pairs, e.g. (('FUSEDQ_SKIP', 1),), "
                         f"not {BWD_FUSED_STUDY!r}")
    suffix = _suffix(featured, 0, False)
    common = (("D", d), ("BF16", int(dtype == "bfloat16")), ("TF32", 0), ("FEAT", int(featured)), ("MASK", 0),
              ("ALIBI", 0))
    params = BWD_PARAMS + FEAT_TYPES
    first_shared = (64 * config.dq_wg + (config.dq_stages or 2) * config.dq_keys) * d * 2 + 1024
    fused_shared = config.shared_bytes(d, 2) + config.kv_rows * (128 + 4 * d) + 1024  # + dS, aligned to 1024; dQ staged
    first = _linked_kernel("flash_bwd_mma.cu", f"attnkern_flash_bwd5_{dtype}_{d}_{config.part_name(1)}{suffix}",
                           (*common, ("PART", 5), ("NW", config.dq_warps), ("MT", 1), ("BN", config.dq_keys),
                            ("STAGES", config.dq_stages)), params, 32 * config.dq_warps, first_shared)
    study = "".join(f"_{key.lower()}{value}" for key, value in BWD_FUSED_STUDY)
    fused = _linked_kernel("flash_bwd_mma.cu", f"attnkern_flash_bwd3q_{dtype}_{d}_{config.part_name(2)}{suffix}{study}",
                           (*common, ("PART", 3), ("NW", 4), ("MT", 1), ("BN", config.kv_rows),
                            ("STAGES", config.kv_stages), ("FUSEDQ", 1), *BWD_FUSED_STUDY), params, 128, fused_shared)
    convert = _linked_kernel("flash_bwd_mma.cu", f"attnkern_flash_bwd6_{dtype}_{d}",
                             (*common[:3], ("FEAT", 0), ("MASK", 0), ("ALIBI", 0), ("PART", 6), ("NW", 4),
                              ("MT", 1), ("BN", 64)), CONVERT_PARAMS,
                             CONVERT_THREADS, 0)
    return first, fused, convert


def flash_bwd_kernels(dtype: str, d: int, config: BwdConfig | None = None, featured: bool = False, mask: int = 0,
                      alibi: bool = False, dropout: bool = False, varlen: bool = False):
    """(dQ kernel, dK/dV kernel) of flash_bwd_mma.cu for float16/bfloat16, or float32 in
    3xTF32, at head size d (D = Dv a multiple of 16 up to 256 in float16/bfloat16, 128 in
    float32), compiled as
    flash_mma_kernel compiles the forward (_linked_kernel); featured, mask, alibi, dropout,
    varlen: the variant (as the forward's; dropout and varlen in float16/bfloat16 only)."""
    config = config or bwd_config(d, dtype)
    wgmma = config.kv_wg or config.dq_wg
    if wgmma and (dtype == "float32" or d not in BWD_WGMMA_DIVISIONS or mask or alibi or dropout or varlen
                  or (config.kv_wg and (config.kv_rows not in (64, 128) or config.kv_warps != 4 * config.kv_wg
                                        or (config.kv_rows == 128 and d > 64)))  # 128-row tiles spill above 64
                  or (config.dq_wg and (config.dq_keys not in (64, 128) or config.dq_warps != 4 * config.dq_wg))
                  or any(config.shared_bytes(d, p) > WGMMA_SHARED_LIMIT for p in (1, 2) if config.kernel_part(p) > 2)):
        raise ValueError(f"flash_bwd_mma.cu's wgmma dQ and dK/dV kernels ({config}) take float16/bfloat16 at D = 64 "
                         f"or 128, 64- or 128-key and -row tiles (128-row Q/dO tiles at D = 64), a block's shared "
                         f"memory within {WGMMA_SHARED_LIMIT} bytes and no masks, ALiBi, dropout or packed sequences, "
                         f"not {dtype} at D = {d}")
    if (config.dq_stages and not config.dq_wg) or (config.kv_stages and not config.kv_wg) or not all(
            s in (0, 2, 3, 4) for s in (config.dq_stages, config.kv_stages)):
        raise ValueError(f"flash_bwd_mma.cu division {config}: stages (2 to 4) are for the wgmma kernels only")
    if not (half_head_size_ok(d, d) if dtype in MMA_DTYPES else mma_head_size_ok(d, d)):
        raise ValueError(f"flash_bwd_mma.cu takes float16/bfloat16 at D a multiple of 16 up to {HALF_MAX_HEAD}, "
                         f"float32 up to 128, not {dtype} at D = {d}")
    if any(not 1 <= config.split(p) <= d // 16 or (config.split(p) > 1 and (
            (dtype == "float32" and (d // 16) % config.split(p)) or config.kernel_part(p) > 2)) for p in (1, 2)):
        raise ValueError(f"flash_bwd_mma.cu division {config}: column slices (1 to D / 16) are for the "
                         f"mma.sync kernels only, in float32 slices of whole 16-column blocks that divide D, "
                         f"not {dtype} at D = {d}")
    suffix = _suffix(featured, mask, alibi, dropout=dropout, varlen=varlen)
    common = (("D", d), ("BF16", int(dtype == "bfloat16")), ("TF32", int(dtype == "float32")),
              ("FEAT", int(featured)), ("MASK", mask), ("ALIBI", int(alibi)), *_variant(dropout, varlen))
    params = BWD_PARAMS + FEAT_TYPES
    return tuple(
        _linked_kernel("flash_bwd_mma.cu", f"attnkern_flash_bwd{part}_{dtype}_{d}_{config.part_name(part)}{suffix}",
                       (*common, ("PART", kernel_part), ("NW", warps), ("MT", mt), ("BN", rows),
                        *((("STAGES", config.stages(part)),) if kernel_part > 2 else ()),
                        *((("DSPLIT", config.split(part)),) if config.split(part) > 1 else ())), params, 32 * warps,
                       config.shared_bytes(d, part, 4 if dtype == "float32" else 2))
        for part, kernel_part, (warps, mt, rows) in ((p, config.kernel_part(p), config.part(p)) for p in (1, 2)))


def bwd_refusal(q, k, v, out, dout, dq, dk, dv, scale: float, feat=None) -> str | None:
    """Why flash_bwd_mma cannot run this call (GpuArrays), or None: q, k, v, out and dout
    are read 16 bytes at a time, dq, dk, dv written 4 (half) or 8 (float32) bytes at a time; an
    additive mask or ALiBi needs a scale other than 0 (the kernels' scores are in units of
    |scale|); float32 dropout and varlen run the Numba kernels (the float16/bfloat16 kernels
    have both). Head sizes: half_head_size_ok (float16/bfloat16), mma_head_size_ok (float32)."""
    step = 2 * q.dtype.itemsize  # bytes of a gradient store
    if any(a.ptr % 16 for a in (q, k, v, out, dout)) or any(a.ptr % step for a in (dq, dk, dv)):
        return (f"q, k, v, out and dout must start at 16-byte aligned addresses, dq, dk, dv at {step}-byte aligned "
                "ones (pass fresh contiguous tensors: .contiguous() or .clone())")
    if feat is not None and (feat.mask_kind > 1 or feat.alibi is not None) and scale == 0:
        return "an additive attn_mask or ALiBi with scale=0 is not supported on its tensor-core kernels"
    if q.dtype == np.float32 and feat is not None and (getattr(feat, "dropout_p", 0) > 0
                                                       or getattr(feat, "cu_q", None) is not None):
        return "float32 dropout and packed sequences run the Numba kernels"
    return None


def flash_bwd_mma(q, k, v, out, dout, lse, dq, dk, dv, causal: bool, scale: float, feat=None,
                  config: BwdConfig | None = None) -> None:
    """dq, dk, dv (GpuArrays to fill, the input dtype) of cuda.flash on float16,
    bfloat16 or float32 GpuArrays (batch, n, d) on tensor cores (flash_bwd_mma.cu;
    float32 in 3xTF32): the dQ kernel, which also writes delta = rowsum(dO O) and the
    lse corrected in float32, then the dK/dV kernel (BWD_DETERMINISTIC False: the fused
    backward where bwd_fused_config takes the call and no config is given); k, v, dk, dv have batch / kv_group
    rows. lse: the forward's, of the input dtype; feat: a launch.KernelFeatures or None.
    A call bwd_refusal refuses is a ValueError."""
    from .arrays import workspace

    why = bwd_refusal(q, k, v, out, dout, dq, dk, dv, scale, feat)
    if why is not None:
        raise ValueError(f"cuda.flash backward ({q.dtype.name}): {why}")
    rows = q.shape[0] * q.shape[1]
    fused = config is None and bwd_fused_config(q.shape[2], q.dtype.name, feat) is not None
    # the corrected lse, delta (and the fused backward's float32 dQ)
    scratch = workspace(bwd_scratch_elems(rows, q.shape[2], fused, q.shape[0]), np.float32, q.owner)
    lse32, delta, dq32 = bwd_scratch_views(scratch.ptr, rows, scratch.owner, q.shape[2] if fused else 0, q.shape[0])
    for kernel, grid, block, args in flash_bwd_launches(q, k, v, out, dout, lse, dq, dk, dv, lse32, delta, causal,
                                                        scale, feat, config, dq32):
        launch(kernel, grid, block, *args)


def bwd_scratch_elems(rows: int, d: int, fused: bool, batch: int = 1) -> int:
    """float32 elements of flash_bwd_mma's scratch memory (bwd_scratch_views): two per row, and
    for the fused backward its float32 dQ after them, from a 16-byte boundary: whole tiles of 64
    rows x d per query head (rows / batch rows each), at most (rows + 63 batch) d floats."""
    return 2 * (rows + rows % 2) + (rows + 63 * batch) * d if fused else 2 * max(rows, 1)


def bwd_scratch_views(base: int, rows: int, owner=None, d: int = 0, batch: int = 1) -> tuple:
    """The float32 arrays of flash_bwd_mma's scratch memory at address base (bwd_scratch_elems
    floats): the corrected lse and delta (rows,), and with d > 0 (the fused backward) its dQ
    accumulator ((rows + 63 batch) d floats, 16-byte aligned where base is), else None."""
    dq32 = (GpuArray(((rows + 63 * batch) * d,), np.float32, None, ptr=base + 8 * (rows + rows % 2), owner=owner)
            if d else None)
    return (GpuArray((rows,), np.float32, None, ptr=base, owner=owner),
            GpuArray((rows,), np.float32, None, ptr=base + 4 * rows, owner=owner), dq32)


def bwd_aligned(step: int):
    """The address test of flash_bwd_mma (bwd_refusal's) for the addresses of q, k, v, out,
    dout, lse, dq, dk, dv, gradients written `step` bytes at a time (2 x the itemsize)."""
    def aligned(*ptrs) -> bool:
        return not any(p % 16 for p in ptrs[:5]) and not any(p % step for p in ptrs[6:9])

    return aligned


def flash_bwd_launches(q, k, v, out, dout, lse, dq, dk, dv, lse32, delta, causal: bool, scale: float, feat=None,
                       config: BwdConfig | None = None, dq32=None) -> list:
    """[(kernel, grid, block, args)] of flash_bwd_mma's two launches (the dQ kernel, then
    the dK/dV kernel): launch() takes them, or Prepared; lse32 and delta: the float32
    scratch arrays (bwd_scratch_views). dq32 (that scratch's float32 dQ): the fused backward's
    three launches instead (flash_bwd_fused_kernels), in config or BWD_FUSED_DIVISIONS' division."""
    batch, nq, d = q.shape
    nk = k.shape[1]
    if dq32 is not None:
        return _fused_launches(q, k, v, out, dout, lse, dq, dk, dv, lse32, delta, dq32, causal, scale, feat,
                               config or BwdConfig.parse(BWD_FUSED_DIVISIONS.get(d, "")))
    config = config or bwd_config(d, q.dtype.name, varlen=_varlen_of(feat))
    if (config.kv_wg or config.dq_wg) and not bwd_wgmma_covers(feat):  # masks, ALiBi, dropout, varlen: mma.sync
        config = bwd_config(d, q.dtype.name, wgmma=False, varlen=_varlen_of(feat))
    dq_kernel, kv_kernel = flash_bwd_kernels(q.dtype.name, d, config, feat is not None,
                                             0 if feat is None else feat.mask_kind,
                                             feat is not None and feat.alibi is not None, _dropout_of(feat),
                                             _varlen_of(feat))
    words = PLAIN_WORDS if feat is None else feat.words(abs(scale) or 1.0)
    args = (Addr(q), Addr(k), Addr(v), Addr(out), Addr(dout), Addr(lse), Addr(dq), Addr(dk), Addr(dv),
            Addr(lse32), Addr(delta), np.int32(nq), np.int32(nk), np.float32(scale * LOG2E), np.float32(scale),
            np.int32(bool(causal)), *words)
    # packed sequences: grids over the longest sequence's rows and keys, and the sequences
    rows, keys = (feat.max_q, feat.max_k) if _varlen_of(feat) else (nq, nk)
    # the first axis: row (key) blocks times their column slices
    return [(dq_kernel, _grid(-(-rows // (16 * config.dq_mt * config.dq_warps)) * config.dq_split, batch, feat),
             32 * config.dq_warps, args),
            (kv_kernel, _grid(-(-keys // (16 * config.kv_mt * config.kv_warps)) * config.kv_split, k.shape[0], feat),
             32 * config.kv_warps, args)]


def _fused_launches(q, k, v, out, dout, lse, dq, dk, dv, lse32, delta, dq32, causal, scale, feat, config) -> list:
    """flash_bwd_launches' fused backward: the first kernel (delta, the corrected lse, dq32 zeroed)
    over query blocks, the dK/dV/dQ kernel over key blocks, dQ's conversion."""
    batch, nq, d = q.shape
    first, fused, convert = flash_bwd_fused_kernels(q.dtype.name, d, config, feat is not None)
    words = PLAIN_WORDS if feat is None else feat.words(abs(scale) or 1.0)
    args = (Addr(q), Addr(k), Addr(v), Addr(out), Addr(dout), Addr(lse), Addr(dq32), Addr(dk), Addr(dv),
            Addr(lse32), Addr(delta), np.int32(nq), np.int32(k.shape[1]), np.float32(scale * LOG2E),
            np.float32(scale), np.int32(bool(causal)), *words)
    pairs = batch * -(-nq // 64) * 32 * d  # dq32's 64-row tiles (bwd_scratch_elems)
    return [(first, _grid(-(-nq // (64 * config.dq_wg)), batch, feat), 32 * config.dq_warps, args),
            (fused, _grid(-(-k.shape[1] // 64), k.shape[0], feat), 128, args),
            (convert, (max(-(-pairs // CONVERT_THREADS), 1),), CONVERT_THREADS,
             (Addr(dq32), Addr(dq), np.uint64(pairs), np.float32(scale), np.int32(nq)))]


# ---------------------------------------------------------------- cuda.flash's split-K decode

# The decode variant's K/V tile (DECODE_TILE keys: a block takes 2 STAGES x TILE x (D + 8) x 2
# bytes of shared memory) and its pipeline depth: STAGES K/V buffers, STAGES - 1 tiles loading
# while one is computed. Both are read at each call (dev/gpu_decode_measure.py --decode-configs
# compares them; 32 keys in 3 buffers, one warp, was the default until the 64-key tiles shared by
# 4 warps in 2 buffers measured faster on an H100, docs/gpu-decode.md). The automatic split
# (decode_auto_splits, DECODE_SPLIT_RULE below) fills whole waves of blocks with chunks of about
# DECODE_CHUNK_KEYS keys where fewer, longer chunks would not fit one round of two blocks an SM:
# on an H200 a block count just above a wave left a tail. DECODE_COMBINE_UNROLL: the combine's
# partials read at once per warp (1: one after another, as before 2026-11-26; the same bits). DECODE_KEY_WARPS: warps sharing each
# K/V tile's keys (flash_mma.cu's ATTNKERN_KW; DECODE_TILE / DECODE_KEY_WARPS keys a warp, a
# multiple of 16; fewer where the block would pass 4 warps: decode_key_warps): more warps an SM
# for the same shared memory and bytes in flight. Other values than 1 give other bits (the order
# of the sums over keys changes). On an H100 (docs/gpu-decode.md) 2 warps on 32-key tiles ran as
# fast as 1, and 4 warps on 64-key tiles in 2 buffers (64x2x4: 166 registers, no spills at
# D = 128) were 1-7% faster at 11 of 12 shapes and 2% slower at one.
DECODE_TILE = 64
DECODE_STAGES = 2
DECODE_KEY_WARPS = 4
DECODE_CHUNK_KEYS = 1280
DECODE_COMBINE_UNROLL = 8
# The automatic split's rule: "waves" (whole waves of the blocks resident at once: decode_slots;
# chunks of at least DECODE_MIN_CHUNK keys) or "blocks" (at least 264 blocks, chunks of at least
# 256 keys: the rule before 2026-11-26, which left a wave part-filled, e.g. 824 blocks on 528
# slots at B = 1, H_kv = 8, Nk = 128k) or "long" (triton.flash's rule: at least 264 blocks, chunks
# of at least 256 keys and no cap on their length, e.g. 33 chunks of 4k keys at B = 1, H_kv = 8,
# Nk = 128k against the waves rule's 128 of 1k: fewer chunks, so less of the per-chunk prologue
# and the partials' writes and combine) or "long_waves" (the default: "long" where its blocks,
# after decode_chunk's rounding, are at most DECODE_TARGET_BLOCKS, two an SM, all in one round;
# else "waves"). On an H100 (docs/gpu-decode.md) "long" was 4-12% faster than "waves" at B = 1,
# H_kv = 8 (256-264 blocks), but 3-6% slower at B = 4 from 16k keys (288 blocks: 24 SMs ran a
# third block while the others idled), where "waves" was the fastest. Read at each call, as the
# constants above.
DECODE_SPLIT_RULES = ("waves", "blocks", "long", "long_waves")
DECODE_SPLIT_RULE = "long_waves"
DECODE_MIN_CHUNK = 128
# the "long" rule's (and "long_waves"'s) shortest chunk, in keys: _split.DECODE_MIN_CHUNK (256) by
# default; 128 splits a short cache finer (B = 1, H_kv = 8, Nk = 4096: 32 chunks, 256 blocks, not 16)
DECODE_LONG_MIN_CHUNK = 256
DECODE_SMS = 132  # the H100's and H200's SMs: a constant, so that the split depends on the shape only
DECODE_SM_SHARED = 228 * 1024  # shared memory of an SM (H100, H200), 1 KB of it reserved a block
DECODE_SM_REGISTERS = 65536  # 32-bit registers of an SM
DECODE_REGISTERS = 168  # a decode thread's registers at D = 128 (ptxas, sm_90a: 164-172; fewer at D = 64)
# True: one launch a decode call (flash_mma.cu's ATTNKERN_FUSED: the last block of a k/v row to
# finish merges its chunks, in chunk order, found by a per-row counter: decode_counters); False:
# the partials' kernel, then flash_combine.cu's. The same bits either way. Read at each call.
DECODE_FUSED = True
# the decode kernel's K/V loads' L2 prefetch size in bytes (flash_mma.cu's ATTNKERN_PREFETCH: 0, 64,
# 128 or 256; 0: no hint). 128 by default: 0.7-1.7% faster than no hint at 11 of 12 decode shapes
# on an H100 (docs/gpu-decode-h100.md), 64 no faster. The same bits at every size. Read at each call
# (a prepared call keeps the size of its first call); the environment variable
# ATTNKERN_DECODE_PREFETCH sets it at import, so a whole process (a test run, a measurement) takes
# another size from its start.
DECODE_PREFETCHES = (0, 64, 128, 256)
DECODE_PREFETCH_DEFAULT = 128


def _prefetch_from_env() -> int:
    """ATTNKERN_DECODE_PREFETCH as one of DECODE_PREFETCHES (DECODE_PREFETCH_DEFAULT where unset or empty)."""
    text = os.environ.get("ATTNKERN_DECODE_PREFETCH", "").strip()
    if not text:
        return DECODE_PREFETCH_DEFAULT
    try:
        size = int(text)
    except ValueError:
        size = None
    if size not in DECODE_PREFETCHES:
        raise ValueError(f"ATTNKERN_DECODE_PREFETCH must be one of {DECODE_PREFETCHES} (bytes), not {text!r}")
    return size


DECODE_PREFETCH = _prefetch_from_env()
# the decode's K/V copies with an L2 evict-first cache policy (flash_mma.cu's ATTNKERN_EVICT_FIRST):
# each line is read once. On an H100 the decode kernel took 0.4-1.2% less time with it at B 1-8,
# Nk 64k-128k (two runs; identical code differed by up to 0.7% at B 1, 0.15% at B 4-8); 0 turns it off
DECODE_EVICT_FIRST = 1
# the decode kernel with the keys on the mma's M dimension for groups of at most 8 query rows
# (flash_mma.cu's ATTNKERN_KEYS_M: S^T = K Q^T, 16 keys x 8 rows an mma, where the row layout fills
# 4 of an mma's 16 rows with a group of 4: half the mma and softmax work a key). Its row sums add in
# another order, so its bits differ from the row layout's (each is deterministic).
DECODE_KEYS_M = 1
DECODE_KEYS_M_ROWS = 8  # the most query rows of a group the keys-on-M layout takes (an mma's N)
_COUNTERS: dict = {}  # device id -> the fused decode's int32 counters, the largest last (decode_counters)
_COUNTERS_LOCK = threading.Lock()


def decode_key_warps(warps: int) -> int:
    """The key warps (DECODE_KEY_WARPS) of a decode block of `warps` row warps: halved until
    the block has at most 4 warps (blocks of more rows keep the warps they had: more would
    cost blocks an SM, at 168 registers a thread) and each warp's share of a tile
    (DECODE_TILE keys) is a multiple of 16 keys."""
    kw = DECODE_KEY_WARPS
    while kw > 1 and (warps * kw > 4 or DECODE_TILE % (16 * kw)):
        kw //= 2
    return max(1, kw)


def decode_slots(d: int, warps: int = 1) -> int:
    """The decode blocks of `warps` warps that DECODE_SMS SMs hold at once at head size d: as
    many as their shared memory (DECODE_STAGES K and V tiles of DECODE_TILE keys, rows of
    d + 8 elements), their registers (DECODE_REGISTERS a thread) and 64 warps an SM allow,
    at most 32 an SM."""
    shared = 2 * DECODE_STAGES * DECODE_TILE * (d + 8) * 2
    warps *= decode_key_warps(warps)
    per_sm = min(32, DECODE_SM_SHARED // (shared + 1024), DECODE_SM_REGISTERS // (DECODE_REGISTERS * 32 * warps),
                 64 // warps)
    return DECODE_SMS * max(1, per_sm)


def decode_auto_splits(batch_kv: int, nq: int, nk: int, d: int, split_k: int, kv_group: int = 1) -> int:
    """The chunks cuda.flash's decode path asks for (_split.decode_splits) under DECODE_SPLIT_RULE,
    for kv_group query heads a k/v head (a block's rows: kv_group nq, a warp per 16)."""
    if DECODE_SPLIT_RULE not in DECODE_SPLIT_RULES:
        raise ValueError(f"cuda.flash decode: cpp.DECODE_SPLIT_RULE must be one of {DECODE_SPLIT_RULES}, "
                         f"not {DECODE_SPLIT_RULE!r}")
    if DECODE_SPLIT_RULE in ("long", "long_waves"):
        splits = decode_splits(batch_kv, nq, nk, split_k, min_chunk=DECODE_LONG_MIN_CHUNK)
        if DECODE_SPLIT_RULE == "long" or split_k or splits == 0 or \
                batch_kv * decode_chunk(nk, splits)[1] <= DECODE_TARGET_BLOCKS:
            return splits
    if DECODE_SPLIT_RULE in ("waves", "long_waves"):
        return decode_splits(batch_kv, nq, nk, split_k, min_chunk=DECODE_MIN_CHUNK, max_chunk=DECODE_CHUNK_KEYS,
                             slots=decode_slots(d, -(-kv_group * nq // 16)))
    return decode_splits(batch_kv, nq, nk, split_k, max_chunk=DECODE_CHUNK_KEYS)


def decode_refusal(dtype: str, nq: int, kv_group: int, d: int, dv: int, feat) -> str | None:
    """Why the decode path cannot run this call, or None: it takes float16 and bfloat16
    at D = Dv a multiple of 16 up to 128, _split.rows_refusal's query rows, and the
    features GQA, bottom-right, window, key lengths and softcap (feat: its mask, alibi
    and dropout_p are read; masks, ALiBi, dropout and packed sequences run the regular kernels)."""
    if dtype not in MMA_DTYPES:
        return f"it takes float16 and bfloat16, not {dtype}"
    if not mma_head_size_ok(d, dv):
        return f"it needs D = Dv, a multiple of 16 up to 128 (got D={d}, Dv={dv})"
    why = rows_refusal(nq, kv_group)
    if why is None and feat is not None and (feat.mask is not None or feat.alibi is not None
                                             or getattr(feat, "dropout_p", 0) > 0
                                             or getattr(feat, "cu_seqlens_q", None) is not None):
        why = "it has no attention mask, ALiBi or dropout (nor packed sequences)"
    return why


def flash_decode_kernel(dtype: str, d: int, warps: int, block_k: int, fast: bool = False, stages: int = 2,
                        key_warps: int = 1, fused_unroll: int = 0, prefetch: int = 0, keys_m: bool = False):
    """The decode variant of flash_mma.cu (ATTNKERN_DECODE) for warps 16-row mma tiles
    of a group's query rows, K/V tiles of block_k keys in `stages` buffers, each tile's
    keys shared by key_warps warps (warps key_warps threads' warps a block): Q's fragments
    in registers, one mma tile a warp, the features compiled in (PLAIN_WORDS for a plain
    call), two more parameters (query rows a head, keys a chunk); fast: the fastmath variant;
    fused_unroll > 0: the fused variant (ATTNKERN_FUSED, its merge reading that many partials
    at once; three more parameters: the output rows, their lse, the counters); prefetch: the K/V
    loads' L2 prefetch size in bytes (DECODE_PREFETCHES; 0: none); keys_m: the keys on the mma's M
    (ATTNKERN_KEYS_M; one warp of rows, a group of at most DECODE_KEYS_M_ROWS rows)."""
    if prefetch not in DECODE_PREFETCHES:
        raise ValueError(f"cuda.flash decode: cpp.DECODE_PREFETCH must be one of {DECODE_PREFETCHES} (bytes), "
                         f"not {prefetch!r}")
    if block_k % (16 * key_warps):
        raise ValueError(f"cuda.flash decode: a K/V tile of {block_k} keys cannot be shared by {key_warps} warps "
                         "(16 keys a warp at least, a multiple of 16)")
    if keys_m and warps != 1:
        raise ValueError(f"cuda.flash decode: the keys-on-M layout takes one warp of rows, not {warps}")
    shared = 2 * stages * block_k * (d + 8) * 2
    fused = ((("KEYS_M", 1),) if keys_m else ()) + (
        (("FUSED", 1), ("UNROLL", fused_unroll)) if fused_unroll else ()) + (
        (("PREFETCH", prefetch),) if prefetch else ()) + ((("EVICT_FIRST", 1),) if DECODE_EVICT_FIRST else ())
    return _linked_kernel("flash_mma.cu",
                          f"attnkern_flash_decode_{dtype}_{d}_w{warps}k{block_k}s{stages}kw{key_warps}"
                          f"{f'_f{fused_unroll}' if fused_unroll else ''}{f'_p{prefetch}' if prefetch else ''}"
                          f"{'_ef' if DECODE_EVICT_FIRST else ''}{'_km' if keys_m else ''}"
                          f"{'_fm' if fast else ''}",
                          (("D", d), ("BF16", int(dtype == "bfloat16")), ("BN", block_k), ("STAGES", stages),
                           ("MT", 1), ("NW", warps), ("KW", key_warps), ("QSMEM", 0), ("FEAT", 1), ("MASK", 0),
                           ("ALIBI", 0), ("DECODE", 1), ("FAST", int(fast)), *fused),
                          ("u64",) * 5 + ("i32", "i32", "f32", "i32", "i32") + FEAT_TYPES + ("i32", "i32")
                          + ("u64",) * (3 if fused_unroll else 0),
                          32 * warps * key_warps, shared)


def decode_counters(rows: int) -> GpuArray:
    """The fused decode's counters on the current device: at least `rows` int32, zero (each
    launch's last block of a k/v row sets its counter back to zero). Made once per device (grown
    by doubling; the smaller ones stay allocated, as prepared launches may hold their address).
    Every decode launch runs on the legacy default stream, so launches never share them at once."""
    device = getattr(cuda.get_current_device(), "id", 0)  # (the simulator's device has none)
    with _COUNTERS_LOCK:
        have = _COUNTERS.setdefault(device, [])
        if not have or have[-1].shape[0] < rows:
            from .arrays import from_host

            have.append(from_host(np.zeros(max(4096, 2 * rows), np.int32)))
        return have[-1]


def flash_combine_kernel(dtype: str, d: int, fast: bool = False, unroll: int = 1):
    """flash_combine.cu: the decode partials merged into the output rows (and lse), `unroll`
    splits' partials read at once; fast: the fastmath variant."""
    return _linked_kernel("flash_combine.cu", f"attnkern_flash_combine_{dtype}_{d}_u{unroll}{'_fm' if fast else ''}",
                          (("D", d), ("BF16", int(dtype == "bfloat16")), ("FAST", int(fast)), ("UNROLL", unroll)),
                          ("u64",) * 4 + ("i32",) * 4, 128, 0)


def decode_aligned(*ptrs) -> bool:
    """Whether the decode path can take arrays at these addresses (q, k, v, out[, lse]):
    16-byte aligned inputs, out 8-byte aligned (the combine's 4-element stores)."""
    return mma_aligned(*ptrs) and not ptrs[3] % 8


def decode_scratch(batch: int, batch_kv: int, nq: int, nk: int, d: int, splits: int) -> tuple[int, int, int]:
    """(keys a chunk, chunks, float32 elements of scratch) of a decode call asking for
    `splits` chunks (decode_chunk): the partials (D floats a row) then their lse."""
    chunk, splits = decode_chunk(nk, splits)
    parts = batch_kv * splits * (batch // batch_kv * nq)
    return chunk, splits, parts * (d + 1)


def flash_decode_launches(q, k, v, out, lse, part_o, part_lse, causal: bool, scale: float, feat, splits: int,
                          chunk: int, fast: bool = False) -> list:
    """The decode path's launches, (kernel, grid, block, args) each (launch() takes them,
    or Prepared): the partials of `splits` chunks of `chunk` keys into part_o and part_lse
    (decode_scratch's float32 scratch: parts x D, then parts), then their combine into out
    (and lse unless None): with DECODE_FUSED one launch that does both (its last block of each
    k/v row merges, decode_counters), else two. With the tile, stages, key warps and unroll of
    DECODE_TILE, DECODE_STAGES, DECODE_KEY_WARPS and DECODE_COMBINE_UNROLL as they are now."""
    batch, nq, d = q.shape
    batch_kv, nk = k.shape[0], k.shape[1]
    rows = batch // batch_kv * nq  # a group's query rows
    warps = -(-rows // 16)
    kw = decode_key_warps(warps)
    keys_m = bool(DECODE_KEYS_M) and rows <= DECODE_KEYS_M_ROWS
    words = PLAIN_WORDS if feat is None else feat.words(abs(scale) or 1.0)
    dtype = q.dtype.name
    if DECODE_FUSED:
        return [(flash_decode_kernel(dtype, d, warps, DECODE_TILE, fast, DECODE_STAGES, kw, DECODE_COMBINE_UNROLL,
                                     DECODE_PREFETCH, keys_m=keys_m),
                 (splits, batch_kv), 32 * warps * kw,
                 (Addr(q), Addr(k), Addr(v), Addr(part_o), Addr(part_lse), np.int32(rows), np.int32(nk),
                  np.float32(scale * LOG2E), np.int32(bool(causal)), np.int32(lse is not None), *words, np.int32(nq),
                  np.int32(chunk), Addr(out), Addr(out if lse is None else lse), Addr(decode_counters(batch_kv))))]
    return [
        (flash_decode_kernel(dtype, d, warps, DECODE_TILE, fast, DECODE_STAGES, kw, prefetch=DECODE_PREFETCH,
                             keys_m=keys_m),
         (splits, batch_kv),
         32 * warps * kw,
         (Addr(q), Addr(k), Addr(v), Addr(part_o), Addr(part_lse), np.int32(rows), np.int32(nk),
          np.float32(scale * LOG2E), np.int32(bool(causal)), np.int32(0), *words, np.int32(nq), np.int32(chunk))),
        (flash_combine_kernel(dtype, d, fast, DECODE_COMBINE_UNROLL), -(-(batch * nq) // 4), 128,
         (Addr(part_o), Addr(part_lse), Addr(out), Addr(out if lse is None else lse), np.int32(batch * nq),
          np.int32(splits), np.int32(rows), np.int32(lse is not None))),
    ]


def scratch_views(base: GpuArray, parts_elems: int, d: int) -> tuple[GpuArray, GpuArray]:
    """(part_o, part_lse): the two float32 arrays of a decode call's scratch (decode_scratch)."""
    parts = parts_elems // (d + 1)
    return (GpuArray((parts * d,), np.float32, None, ptr=base.ptr, owner=base),
            GpuArray((parts,), np.float32, None, ptr=base.ptr + parts * d * 4, owner=base))


def flash_decode(q, k, v, out, causal: bool, scale: float, lse, feat, splits: int, fast: bool = False) -> int:
    """cuda.flash's split-K decode on float16/bfloat16 GpuArrays (decode_refusal None,
    decode_aligned addresses): the keys in `splits` chunks (decode_chunk), one block
    per (chunk, k/v row) holding the group's kv_group nq query rows, each writing a
    float32 partial and its lse to scratch memory (arrays.workspace), then the
    combine (flash_combine.cu, or the fused variant's last block: DECODE_FUSED) in split
    order; fast: their fastmath variants (flash_decode_launches). Returns the chunks run."""
    from .arrays import workspace

    batch, nq, d = q.shape
    chunk, splits, elems = decode_scratch(batch, k.shape[0], nq, k.shape[1], d, splits)
    part_o, part_lse = scratch_views(workspace(elems, np.float32, q.owner), elems, d)
    for kernel, grid, block, args in flash_decode_launches(q, k, v, out, lse, part_o, part_lse, causal, scale, feat,
                                                           splits, chunk, fast):
        launch(kernel, grid, block, *args)
    return splits
