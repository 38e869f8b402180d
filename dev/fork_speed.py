"""A forked child's speed against its parent's, for the native kernels (and torch's SDPA
beside them): in each pass the parent times --repeat calls, then forks a child that
times --repeat calls of its own and sends back its median and the threads it ran on
(attnkern.threads_used), each after 0.5 s of untimed calls. The ratio child / parent per pass; their median is what to
quote (1.0: the child runs as fast as the parent). Each pass forks a new child from a
parent that has run kernels; pass --cold to fork the first child before any call.

    .venv/bin/python dev/fork_speed.py --shape 1x8x1024x64 --threads 2 --passes 7
"""

import argparse
import os
import statistics
import struct
import time

import numpy as np

import attnkern


def median_ms(kernel, q, k, v, threads, repeat):
    call = lambda: attnkern.attention(q, k, v, kernel=kernel, num_threads=threads)  # noqa: E731
    end = time.perf_counter() + 0.5  # untimed calls first: a fresh child starts its pool, faults in pages
    call()
    while time.perf_counter() < end:
        call()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def in_child(kernel, q, k, v, threads, repeat):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its median and threads, then exit
        ms = median_ms(kernel, q, k, v, threads, repeat)
        os.write(w, struct.pack("di", ms, attnkern.threads_used(kernel) or 0))
        os._exit(0)
    os.close(w)
    data = os.read(r, 12)
    os.close(r)
    os.waitpid(pid, 0)
    return struct.unpack("di", data)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="1x8x1024x64")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--passes", type=int, default=7)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--kernels", nargs="+", default=["native.flash", "native.tiled", "torch.sdpa"])
    p.add_argument("--cold", action="store_true", help="fork the first child before the parent's first call")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal([int(x) for x in args.shape.split("x")]).astype(np.float32) for _ in range(3))
    print(f"# {args.shape}, {args.threads} threads, {args.passes} passes of {args.repeat} calls; "
          f"machine: {attnkern.machine()['cpu']}")
    print(f"{'kernel':<14} {'parent ms':>10} {'child ms':>10} {'child/parent':>13} {'child threads':>14}")
    for kernel in args.kernels:
        ratios, parents, children, used = [], [], [], set()
        if args.cold:
            ms, n = in_child(kernel, q, k, v, args.threads, args.repeat)
        for _ in range(args.passes):
            parent = median_ms(kernel, q, k, v, args.threads, args.repeat)
            child, n = in_child(kernel, q, k, v, args.threads, args.repeat)
            parents.append(parent)
            children.append(child)
            ratios.append(child / parent)
            used.add(n)
        print(f"{kernel:<14} {statistics.median(parents):>10.2f} {statistics.median(children):>10.2f} "
              f"{statistics.median(ratios):>12.2f}x {','.join(map(str, sorted(used))):>14}", flush=True)


if __name__ == "__main__":
    main()
