"""torch's own ring attention (torch.distributed.tensor.experimental.context_parallel)
on the same problems as `attnkern ring --device cuda`, for comparison: one GPU per
rank, NCCL, float32 (TF32 off), the memory-efficient SDPA backend torch uses for
float32. Run under torchrun:

    torchrun --nproc-per-node 2 dev/context_parallel_compare.py --seq 32768 65536 --dim 64 128 --json cp.json

Per (N, D, mask): the median time of --repeat calls (each after a barrier), the
peak GPU memory above the inputs, and the largest error of sampled output rows
against attnkern.reference in float64. Rank 0 prints a table and writes JSON.
"""

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, nargs="+", default=[32768])
    p.add_argument("--dim", type=int, nargs="+", default=[64])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    import attnkern
    from attnkern.distributed import init_from_env

    rank, world = init_from_env("nccl", timeout=300)
    torch.backends.cuda.matmul.allow_tf32 = False
    mesh = init_device_mesh("cuda", (world,))
    device = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for n in args.seq:
        for d in args.dim:
            for causal in (False, True):
                rng = np.random.default_rng(0)
                host = [rng.standard_normal((1, args.heads, n, d)).astype(np.float32) for _ in range(3)]
                q, k, v = (torch.from_numpy(x).to(device) for x in host)
                row = {"world_size": world, "seq": n, "dim": d, "causal": causal}
                try:
                    times = []
                    with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
                        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                        before = torch.cuda.memory_allocated()
                        for _ in range(args.repeat):
                            dist.barrier()
                            start = time.perf_counter()
                            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                            torch.cuda.synchronize()
                            times.append(time.perf_counter() - start)
                        peak = torch.cuda.max_memory_allocated() - before
                        local = out.float().cpu().numpy()
                    # context_parallel shards the sequence in its own order: gather the whole output and
                    # compare sampled rows after undoing it (the buffers hold this rank's rows again)
                    gathered = [None] * world
                    dist.all_gather_object(gathered, local)
                    full = _unshard(gathered, causal, world)
                    rows_checked = np.unique(np.r_[0, n - 1, np.random.default_rng(1).choice(n, 64)])
                    ref = attnkern.reference(*host, causal=causal, rows=rows_checked)
                    err = float(np.abs(full[..., rows_checked, :] - ref).max() / np.abs(ref).max())
                    row.update(time_s=max(_all(statistics.median(times))), peak_bytes=max(_all(peak)), error=err)
                except Exception as exc:  # noqa: BLE001 - record what torch's experimental API refused
                    row["error_message"] = f"{type(exc).__name__}: {exc}"[:300]
                rows.append(row)
                if rank == 0:
                    print(json.dumps(row), flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}, f, indent=1)
    dist.destroy_process_group()


def _all(value):
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _unshard(parts, causal, world):
    """The whole sequence from context_parallel's shards: contiguous without a mask, and
    with one its load-balanced order (rank r holds chunks r and 2W-1-r), as torch shards
    causal problems by default."""
    if not causal:
        return np.concatenate(parts, axis=-2)
    chunks = {}
    for r, part in enumerate(parts):
        half = part.shape[-2] // 2
        chunks[r], chunks[2 * world - 1 - r] = part[..., :half, :], part[..., half:, :]
    return np.concatenate([chunks[c] for c in range(2 * world)], axis=-2)


if __name__ == "__main__":
    main()
