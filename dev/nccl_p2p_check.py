"""Checks NCCL point-to-point between the GPUs of one machine, three ways, with plain torch.

    torchrun --nproc-per-node 2 dev/nccl_p2p_check.py plain|batch|a2a [eager]

Each rank sends 5 tensors of 128 MiB to the next rank and receives from the previous one,
then checks the values: `plain` with separate dist.isend/dist.irecv (torch opens a
communicator per pair of ranks for those), `batch` with one dist.batch_isend_irecv per
exchange, `a2a` with all_to_all_single; `eager` passes device_id to init_process_group.
On the nvidia-h200-x2 host (torch 2.11.0+cu130, NCCL 2.28.9) `plain` failed with "an
illegal memory access" (also with NCCL_P2P_DISABLE=1, NCCL_CUMEM_ENABLE=0, or eager) while
`batch` and `a2a` passed: why attnkern's ring batches its transfers on NCCL
(docs/distributed.md).
"""

import os
import sys

import torch
import torch.distributed as dist

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(rank)
mode = sys.argv[1]
if "eager" in sys.argv:
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
else:
    dist.init_process_group("nccl")
n = 16 * 32768 * 64
nxt, prv = (rank + 1) % world, (rank - 1) % world
for it in range(5):
    x = torch.full((n,), float(rank + 1 + it), device="cuda")
    y = torch.empty(n, device="cuda")
    if mode == "plain":
        reqs = [dist.isend(x, nxt), dist.irecv(y, prv)]
    elif mode == "batch":
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, y, prv)])
    elif mode == "a2a":
        ins, outs = [0] * world, [0] * world
        ins[prv], outs[nxt] = n, n
        reqs = [dist.all_to_all_single(y, x, output_split_sizes=ins, input_split_sizes=outs, async_op=True)]
    else:
        raise SystemExit(f"mode {mode!r}: plain, batch or a2a")
    for r in reqs:
        r.wait()
    torch.cuda.synchronize()
    want = float(prv + 1 + it)
    assert torch.all(y == want), (rank, it, y[:4])
print(f"rank {rank}: exchange ok ({' '.join(sys.argv[1:])})", flush=True)
dist.barrier()
dist.destroy_process_group()
