"""cuda.flash's CUDA C++ kernels in several work divisions side by side, each checked
against float64 and timed against torch's scaled_dot_product_attention on one GPU:
the tensor-core kernels (flash_wgmma.cu on Hopper and flash_mma.cu for
float16/bfloat16, flash_tf32.cu for float32 in 3xTF32) and the register-blocked
float32 kernel (flash_simt.cu).

    python3 dev/gpu_flash_versions.py OUT.json [--dims 64,128] [--sizes 4096,8192]
        [--dtypes bfloat16,float16,float32] [--configs default,mt2w4k64,64x64t4x8,...]
        [--runs 20] [--library] [--batches 1,2,4,8] [--warmup-s 0.3]

Kernels: one per --configs entry that names a division of the dtype's kernel,
launched directly (prepared once, below Numba's dispatcher): a tensor-core kernel's
cpp.MmaConfig, "mt{mma tiles a warp}w{warps}k{keys a tile}" with "qs" if Q is
reloaded from shared memory; for float16/bfloat16 on Hopper at D = 64 and 128 also
flash_wgmma.cu's cpp.WgmmaConfig, "wg{warpgroups}k{keys a tile}"; for float32 also a cpp.SimtConfig of the
register-blocked kernel, "{query rows}x{keys}t{rows}x{keys}" (a block's tile, then a
thread's). A WgmmaConfig with stages, "wg{consumer warpgroups}k{keys}s{stages}" ("p" after
it: ping-pong, then "e": early K, then "t": K/V copied by the TMA, then "P": persistent, one block an SM
walking the tiles), is the warp-specialized
variant (a producer warpgroup and a ring of K/V stages; keys 64, 128, 160, 176, 192 or 256). "default" is the division the library picks for the head size (marked
*); a division that does not fit the head size or the GPU is reported and skipped. "attention", with
--library: attnkern.attention(..., kernel="cuda.flash", check_finite=False), the
library's whole call on torch tensors.

Checks, per kernel, head size and dtype: odd shapes (partial blocks, nq != nk, a
negative scale) causal and not, output and log-sum-exp against float64 with the
bounds of attnkern_bench.accuracy, and two runs bit-identical; at each timed size,
about 256 sampled query rows of every head against float64 (torch's SDPA's too).

Timing: (B, 16, N, D) for each --batches B (default 1), causal and not; each sample is a pair of CUDA events around
5 back-to-back calls, 3 warm-up samples, the median of --runs samples, the kernels in
turns (sample r of every kernel, then sample r + 1: a load that comes and goes hits
them alike), each kernel first kept busy for --warmup-s seconds; torch's SDPA on the same tensors, its default choice ("torch.sdpa") and
each of its backends forced with torch.nn.attention.sdpa_kernel ("torch.cudnn",
"torch.flash", "torch.efficient"; one that refuses the shape is left out); x_torch is
against the default, x_best against the fastest of them, TF32 off (torch's float32 kernel then runs 3xTF32 on tensor
cores, as flash_tf32.cu does; flash_simt.cu runs float32 FMAs). TFLOP/s count
4 B H N^2 D, half that with causal masking.

--overhead: the host's time per call at (1, 8, 16, 64) bfloat16 (no GPU work to wait for),
the median over 5 rounds of 2000 calls back to back of the mean: attnkern.attention (the
library's fast path, check_finite=False) and the prepared launch alone, once with each
--overhead-configs division as the default at D = 64 (the fast path's plans cleared between
them), and cProfile's top functions of the library's calls.
"""

import argparse
import json
import math
import os
import re
import statistics
import sys
import time

import numpy as np
import torch

from attnkern.backends.cuda import arrays, cpp, launch
from attnkern_bench.accuracy import kernel_tolerance
from attnkern_bench.timing import CudaEventClock

# attnkern_bench.accuracy's bounds for cuda.flash, the tests' and the harness's
TOL = {dtype: kernel_tolerance("cuda.flash", dtype) for dtype in ("float32", "float16", "bfloat16")}
ODD = [(6, 77, 77), (1, 45, 130), (4, 200, 33), (2, 1030, 1030), (1, 1, 5), (2, 129, 129)]
BACK_TO_BACK = 5


def gpu_array(x, *shape):
    """A contiguous torch CUDA tensor as a GpuArray of `shape` over its memory."""
    if x.dtype == torch.bfloat16:
        import ml_dtypes

        dtype = ml_dtypes.bfloat16
    else:
        dtype = getattr(np, str(x.dtype).removeprefix("torch."))
    return arrays.GpuArray(shape, dtype, None, ptr=x.data_ptr(), owner=x)


def flat3(x):
    """A torch tensor (..., n, d) as a GpuArray (batch, n, d)."""
    return gpu_array(x, math.prod(x.shape[:-2]), *x.shape[-2:])


SIMT_NAME, MMA_NAME = r"(\d+)x(\d+)t(\d+)x(\d+)", r"mt(\d+)w(\d+)k(\d+)(qs)?"
WGMMA_NAME = r"wg(\d+)k(\d+)(?:s(\d+)(p)?(e)?(t)?(P)?(d)?)?"


def parse_config(text, d, dtype):
    """A division of one of the dtype's kernels from its name, or "default" (the
    library's choice); None where the name is a division the dtype has no kernel for."""
    simt, mma, wg = (re.fullmatch(name, text) for name in (SIMT_NAME, MMA_NAME, WGMMA_NAME))
    if text != "default" and not simt and not mma and not wg:
        raise SystemExit(f"--configs: {text!r} is not 'default' nor a division like mt2w4k64qs, wg2k128 or 64x64t4x8")
    if text == "default":
        takes = cpp.half_head_size_ok if dtype in cpp.MMA_DTYPES else cpp.mma_head_size_ok
        if not takes(d, d):
            return cpp.simt_config(d)
        return cpp.tensor_core_config(d, dtype)
    if simt:
        return cpp.SimtConfig(*map(int, simt.groups())) if dtype == "float32" else None
    if wg:
        ok = dtype != "float32" and cpp.wgmma_applies(d, d)
        if not ok:
            return None
        config = cpp.WgmmaConfig.parse(text)
        try:
            config.check(d)
        except ValueError:
            return None
        return config
    return cpp.MmaConfig(mt=int(mma[1]), warps=int(mma[2]), block_k=int(mma[3]), q_smem=bool(mma[4]))


class Kernel:
    """One of the library's CUDA C++ kernels in one work division: a SimtConfig
    names flash_simt.cu's, a WgmmaConfig flash_wgmma.cu's, an MmaConfig the
    tensor-core kernel of the dtype (flash_mma.cu, or flash_tf32.cu for float32)."""

    def __init__(self, config, d, dtype):
        self.config, self.simt = config, isinstance(config, cpp.SimtConfig)
        self.name = str(config) + ("*" if config == parse_config("default", d, dtype) else "")
        self.kernel = cpp.flash_simt_kernel(d, config) if self.simt else cpp.flash_mma_kernel(dtype, d, config)

    def launch(self, q, k, v, out, lse, causal, scale):
        launcher = cpp.flash_simt_launch if self.simt else cpp.flash_mma_launch
        return launcher(q, k, v, out, causal, scale, lse, self.config)

    def __call__(self, q, k, v, causal, scale, with_lse=True):
        """out (and lse) for torch tensors (..., n, d), through launch.launch."""
        lead = q.shape[:-2]
        out = torch.empty(*lead, q.shape[-2], v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.empty(*lead, q.shape[-2], dtype=q.dtype, device=q.device) if with_lse else None
        g = [flat3(x) for x in (q, k, v, out)]
        gl = gpu_array(lse, g[0].shape[0], q.shape[-2]) if with_lse else None
        kernel, grid, block, args = self.launch(*g, gl, causal, scale)
        launch.launch(kernel, grid, block, *args)
        return out, lse

    def prepared(self, q, k, v, out, causal, scale):
        """A launch prepared once."""
        kernel, grid, block, args = self.launch(*[flat3(x) for x in (q, k, v, out)], None, causal, scale)
        return launch.Prepared(launch.raw_kernel(kernel), grid, block, args)

    def resources(self):
        k = self.kernel
        return {"registers": k.get_regs_per_thread(), "local_bytes": k.get_local_mem_per_thread(),
                "static_shared_bytes": k.get_shared_mem_per_block()}


def reference(q, k, v, causal, scale, rows=None):
    """out and lse in float64; rows: only these query rows (of every head)."""
    qd = q.double() if rows is None else q.double()[..., rows, :]
    s = (qd @ k.double().transpose(-1, -2)) * scale
    if causal:
        r = torch.arange(q.shape[-2], device=q.device) if rows is None else rows
        s = s.masked_fill(torch.arange(k.shape[-2], device=q.device)[None, :] > r[:, None], float("-inf"))
    return torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)


def err(x, ref, scale_by):
    return float((x.double() - ref).abs().max() / max(1.0, float(scale_by)))


def inputs(shape, dtype, seed):
    """q, k, v: standard normal, drawn on the GPU (batch 8 at N = 16384 is 268M numbers a tensor)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g, device="cuda").to(getattr(torch, dtype)) for _ in range(3))


def check_odd(kern, d, dtype):
    worst = 0.0
    identical = True
    for i, (bh, nq, nk) in enumerate(ODD):
        g = torch.Generator().manual_seed(100 + i)
        q, k, v = (torch.randn(bh, n, d, generator=g).to(getattr(torch, dtype)).cuda() for n in (nq, nk, nk))
        scale = -0.7 / d**0.5 if i == 1 else 1 / d**0.5
        for causal in (False, True):
            out, lse = kern(q, k, v, causal, scale)
            out2, lse2 = kern(q, k, v, causal, scale)
            identical &= bool(torch.equal(out, out2) and torch.equal(lse, lse2))
            ref, ref_lse = reference(q, k, v, causal, scale)
            worst = max(worst, err(out, ref, v.abs().max()), err(lse, ref_lse, ref_lse.abs().max()))
    return {"odd_error": worst, "odd_ok": worst <= TOL[dtype], "bit_identical": identical}


def event_times(fns, runs, warmup_s=0.3):
    """Median seconds per call of each fn (a dict by name): 3 warm-up calls each, then
    `runs` rounds in which every fn takes one sample of BACK_TO_BACK calls between CUDA
    events (attnkern_bench.timing.CudaEventClock)."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    clock = CudaEventClock(torch, warmup_s)
    for fn in fns.values():
        clock.busy(fn)
    samples = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            samples[name].append(clock.seconds(fn, BACK_TO_BACK))
    return {name: statistics.median(x) for name, x in samples.items()}


def sdpa_backends():
    """torch's SDPA: its default choice and each backend forced, by name."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def forced(backend):
        def call(q, k, v, causal):
            with sdpa_kernel([backend]):
                return sdpa(q, k, v, is_causal=causal)
        return call

    return {"torch.sdpa": lambda q, k, v, causal: sdpa(q, k, v, is_causal=causal),
            "torch.cudnn": forced(SDPBackend.CUDNN_ATTENTION), "torch.flash": forced(SDPBackend.FLASH_ATTENTION),
            "torch.efficient": forced(SDPBackend.EFFICIENT_ATTENTION)}


def overhead(names):
    """Host microseconds per call at (1, 8, 16, 64) bfloat16 of attnkern.attention and of the
    prepared launch alone, with each named division the default at D = 64, and cProfile's top
    functions of the library's calls (the last division)."""
    import cProfile
    import io
    import pstats

    import attnkern
    from attnkern.backends import cuda

    q, k, v = inputs((1, 8, 16, 64), "bfloat16", 7)
    rows, saved = {}, cpp.WGMMA_DEFAULT[64]

    def per_call(fn, calls=2000):
        means = []
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            means.append((time.perf_counter() - t) / calls * 1e6)
        return statistics.median(means)

    try:
        for name in names:
            config = parse_config(name, 64, "bfloat16")
            if config is None:
                continue
            cpp.WGMMA_DEFAULT[64] = config
            cuda.forget_plans()
            library = lambda: attnkern.attention(q, k, v, kernel="cuda.flash", check_finite=False)  # noqa: E731
            library()
            out = torch.empty_like(q)
            prepared = Kernel(config, 64, "bfloat16").prepared(q, k, v, out, False, 1 / 8)
            rows[str(config)] = {"library_us": per_call(library), "prepared_us": per_call(prepared)}
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(2000):
            library()
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
        rows["profile"] = text.getvalue()[-6000:]
    finally:
        cpp.WGMMA_DEFAULT[64] = saved
        cuda.forget_plans()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--sizes", default="4096,8192")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--configs", default="default",
                    help="work divisions to compare, comma-separated (default, wg3k128, mt2w4k64, mt2w4k32qs, 64x64t4x8, ...)")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--library", action="store_true")
    ap.add_argument("--batches", default="1", help="batch sizes B of the timed (B, 16, N, D) shapes")
    ap.add_argument("--warmup-s", type=float, default=0.3, help="seconds each kernel is kept busy before its turns")
    ap.add_argument("--overhead", action="store_true")
    ap.add_argument("--overhead-configs", default="default")
    ap.add_argument("--after", default="",
                    help="a file whose appearance the timings wait for (up to 10 minutes): the builds and checks "
                         "(all first) may run beside other GPU work (the correctness runs of one device call), "
                         "the timings not")
    a = ap.parse_args()
    import attnkern

    torch.backends.cuda.matmul.allow_tf32 = False
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": a.runs,
              "back_to_back": BACK_TO_BACK, "checks": [], "timings": []}
    # every kernel built and checked first (beside other work, if any), then timed
    if a.overhead:
        result["overhead"] = overhead(a.overhead_configs.split(","))
        print(json.dumps(result["overhead"]), flush=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    blocks = {}
    for dtype in a.dtypes.split(","):
        for d in (int(x) for x in a.dims.split(",")):
            timed_kernels = blocks[dtype, d] = []
            configs = [c for c in dict.fromkeys(parse_config(text, d, dtype) for text in a.configs.split(",")) if c]
            for config in configs:
                name = str(config)
                try:
                    kern = Kernel(config, d, dtype)
                    name = kern.name
                    row = {"kernel": name, "dtype": dtype, "d": d, **check_odd(kern, d, dtype), **kern.resources()}
                except Exception as e:  # a kernel that fails to build or run is reported, not fatal
                    row = {"kernel": name, "dtype": dtype, "d": d, "failed": repr(e)[:500]}
                    kern = None
                print(json.dumps(row), flush=True)
                result["checks"].append(row)
                if kern is not None and row["odd_ok"]:
                    timed_kernels.append(kern)
    for _ in range(600):
        if not a.after or os.path.exists(a.after):
            break
        time.sleep(1)
    for dtype in a.dtypes.split(","):
        for d in (int(x) for x in a.dims.split(",")):
            timed_kernels = blocks[dtype, d]
            for batch, n in ((int(b), int(x)) for b in a.batches.split(",") for x in a.sizes.split(",")):
                q, k, v = inputs((batch, 16, n, d), dtype, n + d)
                out = torch.empty_like(q)
                rows = torch.unique(torch.cat([torch.randint(0, n, (250,), generator=torch.Generator().manual_seed(n)),
                                               torch.tensor([0, 1, 2, n - 3, n - 2, n - 1])])).cuda()
                for causal in (False, True):
                    flops = 4 * batch * 16 * n * n * d / (2 if causal else 1)
                    ref, _ = reference(q, k, v, causal, 1 / d**0.5, rows)
                    base = {"dtype": dtype, "d": d, "batch": batch, "n": n, "causal": causal}
                    fns, errors = {}, {}
                    for name, call in sdpa_backends().items():
                        try:
                            got = call(q, k, v, causal)
                        except RuntimeError:  # a backend that refuses the shape or dtype
                            continue
                        errors[name] = err(got[..., rows, :], ref, v.abs().max())
                        fns[name] = lambda call=call: call(q, k, v, causal)
                    for kern in timed_kernels:
                        fn = kern.prepared(q, k, v, out, causal, 1 / d**0.5)
                        out.zero_()
                        fn()
                        torch.cuda.synchronize()
                        errors[kern.name] = err(out[..., rows, :], ref, v.abs().max())
                        fns[kern.name] = fn
                    if a.library:
                        def library():
                            return attnkern.attention(q, k, v, causal=causal, kernel="cuda.flash", check_finite=False)
                        errors["attention"] = err(library()[..., rows, :], ref, v.abs().max())
                        fns["attention"] = library
                    times = event_times(fns, a.runs, a.warmup_s)
                    best = min(t for name, t in times.items() if name.startswith("torch."))
                    rows_out = [{**base, "kernel": name, "seconds": t, "tflops": flops / t / 1e12,
                                 "error": errors[name],
                                 **({} if name.startswith("torch.") else {"ok": errors[name] <= TOL[dtype]})}
                                for name, t in times.items()]
                    for r in rows_out:
                        r["x_torch"] = times["torch.sdpa"] / r["seconds"]
                        r["x_best"] = best / r["seconds"]
                        print(json.dumps(r), flush=True)
                    result["timings"] += rows_out
            with open(a.out, "w") as f:  # after each head size: a run cut short keeps what it measured
                json.dump(result, f, indent=1)
    print(f"{'dtype':9} {'D':>4} {'B':>2} {'N':>6} {'causal':6} {'kernel':15} {'TFLOP/s':>8} {'x torch':>8} {'x best':>7} "
          f"{'error':>9}")
    for r in result["timings"]:
        print(f"{r['dtype']:9} {r['d']:4} {r['batch']:2} {r['n']:6} {str(r['causal']):6} {r['kernel']:15} {r['tflops']:8.1f} "
              f"{r['x_torch']:8.2f} {r['x_best']:7.2f} {r.get('error', math.nan):9.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
