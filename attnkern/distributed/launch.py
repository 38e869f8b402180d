"""Starting W local processes with torch.distributed initialized, for ring attention
on one machine (gloo between CPU processes, NCCL between GPUs), and ending them
cleanly: a rank that fails ends the others, with its traceback in the error.

torchrun does the same across hosts; attnkern.distributed.init_from_env joins a
group that torchrun (or any launcher setting RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT) describes.
"""

from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.connection
import os
import socket
import time
import traceback

from .._extras import require


def cpu_sets(world_size: int, cpus=None) -> list[list[int]]:
    """The CPUs each of world_size local ranks is pinned to: an equal share of this
    process's CPUs, or, with more ranks than CPUs, one CPU each, shared round-robin."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else list(cpus)
    if world_size <= len(cpus):
        per = len(cpus) // world_size
        return [cpus[r * per:(r + 1) * per] for r in range(world_size)]
    return [[cpus[r % len(cpus)]] for r in range(world_size)]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_from_env(backend: str | None = None, timeout: float = 120.0):
    """Joins the process group a launcher described in the environment (torchrun sets
    RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), with a timeout on every
    collective and transfer so that a lost rank ends the others with an error. backend
    defaults to NCCL when this process has a GPU, else gloo. Returns (rank, world_size)."""
    torch = require("torch", "torch", "attnkern.distributed")
    import torch.distributed as dist

    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not set: start this under torchrun, or use "
                           "attnkern.distributed.launch for local processes")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        bind_gpu(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    return dist.get_rank(), dist.get_world_size()


def bind_gpu(index: int) -> None:
    """Makes GPU index this process's device for torch and for Numba's CUDA kernels
    (attnkern's cuda.* backend), which otherwise keep their own current device: a
    kernel launched on GPU 0 with arrays on GPU 1 reads memory it cannot reach."""
    torch = require("torch", "torch", "attnkern.distributed")

    torch.cuda.set_device(index)
    try:
        from numba import cuda
    except ImportError:
        return
    if cuda.is_available():
        cuda.select_device(index)


def _child(rank, world_size, port, backend, timeout, cpus, fn, args, conn):
    try:
        if cpus:
            os.sched_setaffinity(0, cpus)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import torch
        import torch.distributed as dist

        if cpus:
            torch.set_num_threads(len(cpus))
        if backend == "nccl":
            bind_gpu(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout),
                                init_method=f"tcp://127.0.0.1:{port}")
        result = fn(*args)
        dist.barrier()  # rank 0 hosts the store: nobody leaves while another still uses it
        dist.destroy_process_group()
        conn.send(("ok", result))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}"))
        finally:
            os._exit(1)  # skip atexit handlers that could wait on the other ranks


class RankFailed(RuntimeError):
    """A rank of a launch raised or died; the message holds its traceback."""


def launch(fn, world_size: int, *args, backend: str = "gloo", timeout: float = 120.0, pin: bool = True,
           deadline: float | None = None, start_method: str = "spawn") -> list:
    """Runs fn(*args) in world_size fresh local processes (rank r of a torch.distributed
    group on backend, initialized with timeout seconds on every collective and
    transfer) and returns their results in rank order. fn must be importable (a
    module-level function) and its result picklable; inside it, torch.distributed's
    default group is ready and RANK/WORLD_SIZE are set.

    pin: each rank runs on its share of this process's CPUs (cpu_sets), with torch's
    and attnkern's threads matching. If a rank raises or dies, the others are ended
    and RankFailed says which rank and why; after deadline seconds (None: no limit
    beyond the group's own timeout) all are ended with a TimeoutError. No process
    outlives the call. start_method "forkserver" starts ranks from one process that
    has imported torch and attnkern already (much faster than "spawn" when many small
    launches follow each other); fn's module must be importable there too."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or not 1 <= world_size <= 1024:
        raise ValueError(f"world_size must be an integer in [1, 1024], got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    require("torch", "torch", "attnkern.distributed")  # here, not in each rank
    ctx = multiprocessing.get_context(start_method)
    if start_method == "forkserver":  # the server imports torch once; each rank is a fork of it
        ctx.set_forkserver_preload(["torch", "torch.distributed", "attnkern"])
    port = _free_port()
    sets = cpu_sets(world_size) if pin else [None] * world_size
    procs, conns = [], []
    for rank in range(world_size):
        receive, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, name=f"attnkern-rank{rank}", daemon=True,
                           args=(rank, world_size, port, backend, timeout, sets[rank], fn, args, send))
        proc.start()
        send.close()
        procs.append(proc)
        conns.append(receive)
    results: dict[int, object] = {}
    end = None if deadline is None else time.monotonic() + deadline
    try:
        while len(results) < world_size:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"the {world_size} ranks did not finish within {deadline} s "
                                   f"(finished: {sorted(results) or 'none'}); all were ended")
            waiting = {conns[r]: r for r in range(world_size) if r not in results}
            ready = multiprocessing.connection.wait(list(waiting), timeout=left)
            for conn in ready:
                rank = waiting[conn]
                try:
                    status, value = conn.recv()
                except EOFError:  # died without a word (killed, crashed in C)
                    procs[rank].join(5)
                    raise RankFailed(f"rank {rank} of {world_size} died with exit code {procs[rank].exitcode} "
                                     "before returning a result") from None
                if status == "error":
                    raise RankFailed(f"rank {rank} of {world_size} failed:\n{value}")
                results[rank] = value
        for proc in procs:
            proc.join(30)
    finally:
        _end(procs)
        for conn in conns:
            conn.close()
    return [results[r] for r in range(world_size)]


def _end(procs):
    """Ends every process still running: terminate, then kill what ignores it."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
