"""Time flash_bwd_mma.cu's work divisions (cpp.BwdConfig) side by side on the GPU.

For each (dtype, D, N, causal) at (1, 16, N, D): the forward's out and lse once, then each
division's backward (cpp.flash_bwd_mma on the same arrays) timed with CUDA events, the median of
--runs samples of 5 back-to-back calls, the divisions' samples taken in turns (one sample of each,
then the next round), and its gradients compared with the first division's
(every division sums in another order only where its tiles differ: reported as the max difference,
which must be of the dtype's rounding). JSON rows to --json.

    python3 dev/gpu_bwd_versions.py --dims 64 128 --sizes 4096 8192 --json out.json

A --configs name "fused" (or fused=<division>, e.g. fused=qwg1x128s2kvwg1x128s2) times the fused backward
(cpp.BWD_DETERMINISTIC False, cpp.BWD_FUSED_DIVISIONS); its dQ differs from run to run in its last bits.
"fusedonly" (or fusedonly=<division>) times its last two kernels alone (dK/dV/dQ and dQ's conversion),
its first kernel run once before: what the fused backward would take given the forward's lse in
float32 and delta (the first kernel's work; dQ's accumulator is zeroed only by that first run, so
the timed calls add on: the same work, gradients compared from the first call only).
"""

import argparse
import json
import statistics

import numpy as np
import torch
import attnkern
from attnkern.backends.cuda import cpp
from attnkern.backends.cuda.arrays import GpuArray


def from_torch(x, name):
    """A GpuArray over a contiguous torch CUDA tensor's memory (bfloat16 through ml_dtypes)."""
    import ml_dtypes

    assert x.is_cuda and x.is_contiguous(), name
    dtype = {torch.bfloat16: np.dtype(ml_dtypes.bfloat16), torch.float16: np.dtype(np.float16),
             torch.float32: np.dtype(np.float32)}[x.dtype]
    return GpuArray(tuple(x.shape), dtype, None, ptr=x.data_ptr(), owner=x)


def sample_ms(call, reps: int = 5) -> float:
    """One timed sample: reps calls back to back between two CUDA events, ms a call."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        call()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / reps

# float32 (3xTF32): shared memory holds half the rows, and the dK/dV kernel spilled with more
# than 32 (D = 64) or 8 (D = 128) streamed rows
CONFIGS_F32 = {
    64: ["q4x64kv4x32", "q4x32kv4x32", "q8x32kv8x32", "q4x64kv8x32", "q8x64kv4x32"],
    128: ["q8x32kv4x16", "q8x32kv8x8", "q8x32kv8x16", "q4x64kv4x8", "q8x32kv4x8", "q4x32kv8x8", "q4x64kv8x8"],
}
# the mma.sync divisions; on Hopper, the wgmma kernels' (qwg / kvwg: warpgroups, e.g. qwg2x64kvwg2x64)
CONFIGS = {
    64: ["q4x64kv4x64", "q4x32m2kv4x32m2", "q4x32m2kv4x64", "q4x64kv4x32m2", "q8x64kv4x64", "q4x64kv8x64",
         "q8x32m2kv8x32m2", "q4x128kv4x64", "q4x64kv4x128"],
    128: ["q4x64kv4x32", "q4x16m2kv4x32", "q8x64kv4x32", "q4x64kv8x32", "q4x64kv4x64", "q8x32kv8x32",
          "q8x16m2kv4x32"],
}


KEEP = []  # fused_steps' scratch memory, alive while timed


def fused_steps(arrays, views, causal, d, division):
    """The fused backward's three launches (cpp.flash_bwd_launches) over scratch of its own."""
    from attnkern.backends.cuda.arrays import workspace

    q = arrays[0]
    rows = q.shape[0] * q.shape[1]
    scratch = workspace(cpp.bwd_scratch_elems(rows, d, True, q.shape[0]), np.float32, q.owner)
    lse32, delta, dq32 = cpp.bwd_scratch_views(scratch.ptr, rows, scratch.owner, d, q.shape[0])
    steps = cpp.flash_bwd_launches(*arrays, *views, lse32, delta, causal, d ** -0.5, None,
                                   cpp.BwdConfig.parse(division), dq32)
    KEEP.append(scratch)
    return steps


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16"])
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--configs", nargs="+", help="divisions to time (default: the lists above), the first the base")
    p.add_argument("--json")
    p.add_argument("--fused-define", action="append", default=[], metavar="KEY=VALUE",
                   help="compile the fused dK/dV/dQ kernel with ATTNKERN_KEY VALUE too (cpp.BWD_FUSED_STUDY: "
                   "timing studies, e.g. FUSEDQ_SKIP=1; see flash_bwd_mma.cu)")
    p.add_argument("--wait-for", help="a file: compile every division (all shapes) first, then wait until it "
                   "exists before timing (so that other GPU work sharing the machine can finish meanwhile)")
    a = p.parse_args()
    if a.fused_define:  # compiled into the fused kernel only (cpp.BWD_FUSED_STUDY)
        cpp.BWD_FUSED_STUDY = tuple(tuple(x.split("=", 1)) for x in a.fused_define)
    if a.wait_for:
        import os
        import time

        for dtype in a.dtypes:
            for d in a.dims:
                for name in a.configs or (CONFIGS_F32 if dtype == "float32" else CONFIGS)[d]:
                    try:
                        if name.startswith("fused"):
                            division = name.partition("=")[2] or cpp.BWD_FUSED_DIVISIONS[d]
                            cpp.flash_bwd_fused_kernels(dtype, d, cpp.BwdConfig.parse(division))
                        else:
                            cpp.flash_bwd_kernels(dtype, d, cpp.BwdConfig.parse(name))
                    except Exception as exc:  # reported again where it is timed
                        print(f"{dtype} D={d} {name}: {type(exc).__name__} {exc}"[:200])
        while not os.path.exists(a.wait_for):
            time.sleep(0.5)
    rows = []
    for dtype in a.dtypes:
        for d in a.dims:
            for n in a.sizes:
                for causal in (False, True):
                    g = torch.Generator(device="cuda").manual_seed(n + d)
                    q, k, v, dout = (torch.randn(1, 16, n, d, device="cuda", generator=g).to(getattr(torch, dtype))
                                     for _ in range(4))
                    out, lse = attnkern.attention(q, k, v, kernel="cuda.flash", causal=causal, return_lse=True)
                    arrays = [from_torch(x, "x").reshape(16, n, d) for x in (q, k, v, out, dout)]
                    arrays.append(from_torch(lse, "lse").reshape(16, n))
                    base, calls = None, {}
                    for name in a.configs or (CONFIGS_F32 if dtype == "float32" else CONFIGS)[d]:
                        grads = [torch.empty_like(x) for x in (q, k, v)]
                        views = [from_torch(x, "grad").reshape(16, n, d) for x in grads]
                        if name.startswith("fusedonly"):  # the fused backward's last two kernels
                            division = name.partition("=")[2] or cpp.BWD_FUSED_DIVISIONS.get(d, "")
                            steps = fused_steps(arrays, views, causal, d, division)

                            def call(steps=steps, first=[True]):
                                for kernel, grid, block, args in (steps if first[0] else steps[1:]):
                                    cpp.launch(kernel, grid, block, *args)
                                first[0] = False
                        elif name.startswith("fused"):  # fused[=division]: cpp.BWD_DETERMINISTIC False
                            division = name.partition("=")[2] or cpp.BWD_FUSED_DIVISIONS.get(d, "")

                            def call(division=division, views=views):
                                saved = cpp.BWD_FUSED_DIVISIONS.get(d)
                                cpp.BWD_DETERMINISTIC, cpp.BWD_FUSED_DIVISIONS[d] = False, division
                                try:
                                    if cpp.bwd_fused_config(d, dtype) is None:
                                        raise ValueError("the fused backward does not take this call")
                                    cpp.flash_bwd_mma(*arrays, *views, causal, d ** -0.5, None)
                                finally:
                                    cpp.BWD_DETERMINISTIC, cpp.BWD_FUSED_DIVISIONS[d] = True, saved
                        else:
                            def call(config=cpp.BwdConfig.parse(name), views=views):
                                cpp.flash_bwd_mma(*arrays, *views, causal, d ** -0.5, None, config)

                        try:
                            call()
                        except Exception as exc:  # a division whose shared memory does not fit
                            print(f"{dtype} D={d} N={n} causal={causal} {name}: {type(exc).__name__} {exc}"[:200])
                            continue
                        torch.cuda.synchronize()
                        if base is None:
                            base = [x.clone() for x in grads]
                        diff = max(float((x.float() - y.float()).abs().max()) for x, y in zip(grads, base))
                        calls[name] = (call, diff, [])
                    for _ in range(a.runs):  # in turns
                        for call, _, samples in calls.values():
                            samples.append(sample_ms(call))
                    for name, (call, diff, samples) in calls.items():
                        ms = statistics.median(samples)
                        tflops = 2.5 * 4 * 16 * n * n * d / (2 if causal else 1) / ms / 1e9
                        rows.append({"dtype": dtype, "d": d, "n": n, "causal": causal, "config": name, "ms": ms,
                                     "tflops": tflops, "max_diff_vs_default": diff,
                                     "gpu": torch.cuda.get_device_name()})
                        print(f"{dtype} D={d:>3} N={n:>5} causal={causal!s:>5} {name:>22}: {ms:7.3f} ms "
                              f"{tflops:6.1f} TFLOP/s  diff {diff:.2e}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
