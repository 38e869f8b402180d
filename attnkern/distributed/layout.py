"""How a sequence is split over the ranks of a ring: which chunks of the sequence
each rank holds, and the helpers that cut a full sequence into a rank's shard and
put the shards back together.

    contiguous  W chunks; rank r holds chunk r.
    zigzag      2W chunks; rank r holds chunks r and 2W-1-r, so that under a
                causal mask every rank has the same amount of work (an early chunk,
                which sees few keys, paired with a late one, which sees many).

The sequence is the second-to-last dimension, (..., N, D), as in attention().
"""

from __future__ import annotations

from dataclasses import dataclass

from .._extras import require

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    return layout


def chunk_count(layout: str, world_size: int) -> int:
    """How many equal chunks the full sequence is cut into."""
    return world_size if check_layout(layout) == "contiguous" else 2 * world_size


def chunks_of(layout: str, rank: int, world_size: int) -> tuple[int, ...]:
    """The chunk indices rank holds, in the order they sit in its shard."""
    if check_layout(layout) == "contiguous":
        return (rank,)
    return (rank, 2 * world_size - 1 - rank)


@dataclass(frozen=True)
class Segment:
    """Rows [start, stop) of the full sequence, held at [offset, offset + stop - start) of a shard."""

    start: int
    stop: int
    offset: int

    @property
    def length(self) -> int:
        return self.stop - self.start


def segments(layout: str, rank: int, world_size: int, chunk: int) -> tuple[Segment, ...]:
    """rank's shard as runs of consecutive global rows (adjacent chunks merged, so
    that one rank holding the whole sequence computes it in one call)."""
    runs: list[Segment] = []
    offset = 0
    for c in chunks_of(layout, rank, world_size):
        start = c * chunk
        if runs and runs[-1].stop == start:
            runs[-1] = Segment(runs[-1].start, start + chunk, runs[-1].offset)
        else:
            runs.append(Segment(start, start + chunk, offset))
        offset += chunk
    return tuple(runs)


def check_length(n: int, layout: str, world_size: int) -> int:
    """The chunk length for a full sequence of n rows, or a ValueError saying what to pad to."""
    count = chunk_count(layout, world_size)
    if n % count:
        padded = -(-n // count) * count
        raise ValueError(
            f"the sequence length {n} does not split into {count} equal chunks (layout {layout!r} on "
            f"{world_size} ranks cuts it into {count}); use a length that is a multiple of {count}, such as "
            f"{padded}"
        )
    return n // count


def _rank_and_size(rank, world_size, group):
    if rank is not None and world_size is not None:
        return rank, world_size
    require("torch", "torch", "attnkern.distributed without rank= and world_size=")
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("pass rank= and world_size=, or initialize torch.distributed first")
    return (dist.get_rank(group) if rank is None else rank,
            dist.get_world_size(group) if world_size is None else world_size)


def shard(x, layout: str = "contiguous", *, rank=None, world_size=None, group=None):
    """rank's shard of a full sequence x (..., N, D): a NumPy array or torch tensor
    of the same kind, C-contiguous. rank and world_size default to this process's
    place in group (torch.distributed's default group)."""
    if len(getattr(x, "shape", ())) < 2:
        raise ValueError(f"shard takes an array (..., N, D) with the sequence second to last, got shape "
                         f"{getattr(x, 'shape', None)}")
    rank, world_size = _rank_and_size(rank, world_size, group)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    chunk = check_length(x.shape[-2], layout, world_size)
    parts = [x[..., c * chunk:(c + 1) * chunk, :] for c in chunks_of(layout, rank, world_size)]
    return _concat(parts)


def unshard(shards, layout: str = "contiguous", *, group=None):
    """The full sequence from every rank's shard: given a list of the W shards in
    rank order, puts them together here; given this rank's shard alone, gathers the
    others from group first (a collective: every rank must call it)."""
    if not isinstance(shards, (list, tuple)):
        shards = _all_gather(shards, group)
    world_size = len(shards)
    if world_size == 0:
        raise ValueError("unshard needs at least one shard")
    per_rank = len(chunks_of(layout, 0, world_size))
    n_local = shards[0].shape[-2]
    if any(s.shape != shards[0].shape for s in shards) or n_local % per_rank:
        raise ValueError(f"the shards must have one shape with a sequence length that splits into {per_rank} "
                         f"chunks, got {[tuple(s.shape) for s in shards]}")
    chunk = n_local // per_rank
    placed = {}
    for rank, s in enumerate(shards):
        for i, c in enumerate(chunks_of(layout, rank, world_size)):
            placed[c] = s[..., i * chunk:(i + 1) * chunk, :]
    return _concat([placed[c] for c in range(len(placed))])


def _concat(parts):
    if type(parts[0]).__module__.startswith("torch"):
        import torch

        return torch.cat(parts, dim=-2).contiguous() if len(parts) > 1 else parts[0].contiguous()
    import numpy as np

    return np.ascontiguousarray(np.concatenate(parts, axis=-2))


def _all_gather(x, group):
    import numpy as np
    import torch
    import torch.distributed as dist

    tensor = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return [p.numpy() for p in parts] if isinstance(x, np.ndarray) else parts
