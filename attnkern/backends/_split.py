"""The split-K decode paths' choice of key chunks (flash-decoding), shared by the GPU
backends (cuda.flash's flash_mma.cu decode variant, triton.flash's decode kernels):
a call with a few query rows a head over a long cache runs one block per (key chunk,
k/v head), the group's query heads packed into the block's rows, and a log-sum-exp
combine of the chunks in key order. The split is a function of the shape and split_k
only (not of the GPU), so a call's bits do not depend on the device it runs on."""

from __future__ import annotations

DECODE_MAX_NQ = 16  # query rows a head the decode paths take
DECODE_MAX_ROWS = 128  # query rows of a k/v head's group (kv_group nq): a block's rows
DECODE_MIN_NK = 1024  # shorter caches keep the regular kernels (automatic choice)
DECODE_BLOCK_K = 64  # keys a K/V tile; a chunk is a multiple of it
DECODE_MIN_CHUNK = 256  # keys a chunk at least (automatic): its partial (Dv floats a row) is small beside its K/V
# blocks the automatic split aims at (triton.flash's): twice the H100's and H200's 132 SMs (a constant: see above)
DECODE_TARGET_BLOCKS = 264
DECODE_MAX_SPLITS = 1024  # split_k's upper bound
# the features a decode call may have and still take the GPU frontend's prepared launches
# (_torch_cuda): grouped k/v heads and bottom-right causal masking, a KV-cache decode step's
PREPARED_FEATURES = frozenset({"gqa", "bottom_right"})


def rows_refusal(nq: int, kv_group: int) -> str | None:
    """Why a decode path cannot take nq query rows a head in groups of kv_group heads, or None."""
    if nq > DECODE_MAX_NQ or kv_group * nq > DECODE_MAX_ROWS:
        return (f"it takes up to {DECODE_MAX_NQ} query rows a head and {DECODE_MAX_ROWS} a k/v head's group "
                f"(got {nq} rows, {kv_group * nq} a group)")
    return None


def decode_splits(batch_kv: int, nq: int, nk: int, split_k: int, target: int = DECODE_TARGET_BLOCKS,
                  min_chunk: int = DECODE_MIN_CHUNK, max_chunk: int = 0, slots: int = 0) -> int:
    """The number of key chunks a decode path splits nk keys into, 0 for the regular
    kernels: split_k >= 2 as given (at most one chunk a DECODE_BLOCK_K keys); split_k =
    1 never; split_k = 0 (automatic) where nq <= DECODE_MAX_NQ and nk >= DECODE_MIN_NK:
    enough chunks for batch_kv x chunks >= target blocks (by default DECODE_TARGET_BLOCKS)
    and, with max_chunk, chunks of at most about max_chunk keys; or with slots (the blocks
    the GPU runs at once), whole waves: the blocks of chunks of about max_chunk keys
    rounded to a whole number of waves of `slots` blocks (at least one), and as many chunks
    as those waves hold (decode_chunk's rounding may drop a few: never a block more); in
    both, chunks of at least min_chunk keys (1 chunk where batch_kv alone fills the
    target: one K/V read still serves all the query heads of a group)."""
    tiles = -(-nk // DECODE_BLOCK_K)
    if split_k == 1 or tiles == 0:
        return 0
    if split_k > 1:
        return min(split_k, tiles)
    if nq > DECODE_MAX_NQ or nk < DECODE_MIN_NK:
        return 0
    if slots:
        waves = max(1, int(batch_kv * nk / (slots * max_chunk) + 0.5))
        want = waves * slots // batch_kv
    else:
        want = max(-(-target // batch_kv), -(-nk // max_chunk) if max_chunk else 1)
    return max(1, min(want, nk // min_chunk))


def decode_chunk(nk: int, splits: int) -> tuple[int, int]:
    """(keys a chunk, chunks): splits chunks of whole K/V tiles over nk keys (fewer
    where the rounding leaves the last ones empty)."""
    chunk = -(-(-(-nk // splits)) // DECODE_BLOCK_K) * DECODE_BLOCK_K
    return chunk, -(-nk // chunk)
