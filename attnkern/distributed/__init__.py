"""Attention over sequences split across processes (torch.distributed).

    from attnkern.distributed import launch, ring_attention, shard, unshard

    def work(q, k, v):                        # runs on every rank
        local = [shard(x, "zigzag") for x in (q, k, v)]
        out = ring_attention(*local, causal=True, layout="zigzag")
        return unshard(out, "zigzag")         # the full output, gathered

    outs = launch(work, 4, q, k, v)           # 4 local gloo processes

Under torchrun, call init_from_env() in each process instead of launch. See
docs/distributed.md.
"""

from .launch import RankFailed, cpu_sets, init_from_env, launch
from .layout import LAYOUTS, chunk_count, chunks_of, shard, unshard
from .ring import RingStats, ring_attention

__all__ = ["ring_attention", "shard", "unshard", "launch", "init_from_env", "RankFailed", "RingStats", "cpu_sets",
           "LAYOUTS", "chunk_count", "chunks_of"]
