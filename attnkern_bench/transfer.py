"""attnkern transfer --device cuda: host-to-device and device-to-host bandwidth from
pageable and pinned memory, and the per-call time of cuda.flash on NumPy arrays
with each."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

HELP = "GPU copies from pageable and pinned host memory, and cuda.flash's per-call time on NumPy arrays"
DESCRIPTION = """\
Measures what a cuda.* kernel called on NumPy arrays spends moving them (needs a
CUDA GPU and numba-cuda).

Bandwidth: host-to-device and device-to-host copies of --sizes MiB, from an
ordinary (pageable) NumPy array with Numba's synchronous copies (cuda.to_device,
copy_to_host: how the kernels copied before staging), and from page-locked
(pinned) memory with the driver's asynchronous copy and one wait (how the
staging buffers copy). Each figure is the median of --repeats timed copies
(wall clock around the copy and its wait, after one untimed copy), in GB/s
(10^9 bytes a second).

Per call: attnkern.attention(q, k, v, kernel="cuda.flash", check_finite=False) on
float32 NumPy arrays of --shapes, wall clock from the call to its NumPy result,
median of --repeats calls after two untimed ones, with the pinned staging buffers
(attnkern.backends.cuda.staging, the default) and with the pageable copies
(staging.STAGING = False). Both give the same bits (checked). The kernel's own
time (CUDA events around a launch on GPU-resident inputs) is shown beside them:
what is left is copies, allocations and Python.

--json FILE writes every figure."""


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["cuda"], default="cuda", help="the GPU (the only device this measures)")
    p.add_argument("--sizes", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 16.0, 256.0],
                   help="copy sizes in MiB, comma-separated (1,16,256)")
    p.add_argument("--shapes", type=lambda s: [tuple(int(n) for n in x.split("x")) for x in s.split(",")],
                   default=[(1, 8, 256, 64), (1, 16, 1024, 64), (4, 16, 4096, 64)],
                   help="attention shapes B x H x N x D, comma-separated (1x8x256x64,1x16x1024x64,4x16x4096x64)")
    p.add_argument("--repeats", type=int, default=10, help="timed copies or calls per figure (10)")
    p.add_argument("--json", metavar="FILE", help="write the results to FILE")


def _median_seconds(fn, repeats: int, warm: int = 1) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bandwidth(mib: float, repeats: int) -> dict:
    """GB/s of each direction from pageable and from pinned memory, for mib MiB."""
    from numba import cuda

    from attnkern.backends.cuda import staging

    nbytes = int(mib * 2**20)
    driver = staging.CudaDriver()
    pageable = np.ones(nbytes, np.uint8)
    pinned = driver.alloc_host(nbytes)
    pinned[...] = 1
    device = cuda.device_array(nbytes, np.uint8)
    dptr = driver.device_ptr(device)

    def pinned_h2d():
        driver.h2d_async(dptr, pinned.ctypes.data, nbytes)
        driver.wait()

    def pinned_d2h():
        driver.d2h_async(pinned.ctypes.data, dptr, nbytes)
        driver.wait()

    seconds = {"h2d_pageable": _median_seconds(lambda: device.copy_to_device(pageable), repeats),
               "h2d_pinned": _median_seconds(pinned_h2d, repeats),
               "d2h_pageable": _median_seconds(lambda: device.copy_to_host(pageable), repeats),
               "d2h_pinned": _median_seconds(pinned_d2h, repeats)}
    return {"mib": mib, **{f"{k}_gbs": nbytes / s / 1e9 for k, s in seconds.items()}}


def per_call(shape: tuple, repeats: int) -> dict:
    """Median seconds of one cuda.flash call on NumPy arrays, pinned and pageable, and the kernel's own."""
    import attnkern
    from attnkern.backends.cuda import staging

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))

    def call():
        return attnkern.attention(q, k, v, kernel="cuda.flash", check_finite=False)

    pinned_out = call()
    pinned = _median_seconds(call, repeats, warm=2)
    staging.STAGING = False
    try:
        pageable_out = call()
        pageable = _median_seconds(call, repeats, warm=2)
    finally:
        staging.STAGING = True
    if not np.array_equal(pinned_out, pageable_out):
        raise AssertionError(f"staged and pageable calls differ at {shape}")
    result = {"shape": list(shape), "bytes_in": 3 * q.nbytes, "bytes_out": q.nbytes,
              "pinned_s": pinned, "pageable_s": pageable, "speedup": pageable / pinned}
    try:
        import torch
    except ImportError:
        return result
    tq, tk, tv = (torch.from_numpy(x).cuda() for x in (q, k, v))
    attnkern.attention(tq, tk, tv, kernel="cuda.flash", check_finite=False)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        attnkern.attention(tq, tk, tv, kernel="cuda.flash", check_finite=False)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    result["kernel_s"] = statistics.median(times)
    return result


def command(args) -> int:
    import attnkern

    info = attnkern.kernel_info("cuda.flash")
    if not info["available"]:
        print(f"attnkern transfer: no GPU to measure: {info['reason']}", file=sys.stderr)
        return 2
    from numba import config, cuda

    if config.ENABLE_CUDASIM:
        print("attnkern transfer: Numba's CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1); it has no pinned memory "
              "or copies to time: run it on a GPU", file=sys.stderr)
        return 2
    name = cuda.get_current_device().name
    name = name.decode() if isinstance(name, bytes) else name
    print(f"# {name}: copies, GB/s (median of {args.repeats})")
    print(f"{'MiB':>8} {'H2D pageable':>13} {'H2D pinned':>11} {'D2H pageable':>13} {'D2H pinned':>11}")
    copies = []
    for mib in args.sizes:
        r = bandwidth(mib, args.repeats)
        copies.append(r)
        print(f"{mib:>8g} {r['h2d_pageable_gbs']:>13.2f} {r['h2d_pinned_gbs']:>11.2f} {r['d2h_pageable_gbs']:>13.2f} "
              f"{r['d2h_pinned_gbs']:>11.2f}", flush=True)
    print(f"# cuda.flash on float32 NumPy arrays, ms a call (median of {args.repeats})")
    print(f"{'shape':>16} {'pageable':>9} {'pinned':>9} {'speedup':>8} {'kernel':>9}")
    calls = []
    for shape in args.shapes:
        r = per_call(shape, args.repeats)
        calls.append(r)
        kernel = f"{r['kernel_s'] * 1e3:>9.3f}" if "kernel_s" in r else f"{'-':>9}"
        print(f"{'x'.join(map(str, shape)):>16} {r['pageable_s'] * 1e3:>9.3f} {r['pinned_s'] * 1e3:>9.3f} "
              f"{r['speedup']:>7.2f}x {kernel}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "repeats": args.repeats, "copies": copies, "calls": calls}, f, indent=1)
    return 0
