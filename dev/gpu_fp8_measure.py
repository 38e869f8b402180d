"""cuda.flash's FP8 (e4m3) forward against its bfloat16 one and torch's SDPA on one Hopper GPU:
error against float64 (FP8 with and without a Hadamard rotation of q and k, on Gaussian inputs
and inputs with outliers) and speed.

    python3 dev/gpu_fp8_measure.py OUT.json [--sizes 4096,8192,16384] [--heads 16]
        [--fp8-configs wg2k128s3e,wg2k192s2pet,...] [--runs 20] [--after FILE] [--profile]
        [--quantized-configs 2]

Error, at (1, 8, --error-n, 128), causal and not: rms(out - ref) / rms(ref) and
max |out - ref| / max |ref| against the float64 answer for the float32 inputs (torch float64 on
the GPU), for our bfloat16 kernel on the inputs rounded to bfloat16, FP8 with per-tensor scales
(quantize_fp8), and FP8 after the Hadamard rotation; inputs "gaussian" (N(0, 1)), "outliers"
(FA3's: N(0, 10^2) added to 0.1% of q's and k's elements) and "channels" (4 of the 128 channels
of q and k 10 times larger).

Speed, at (1, --heads, N, 128), causal and not, CUDA events, the median of --runs samples of
5 back-to-back calls, every kernel in turns (dev/gpu_flash_versions.py's event_times):
- "bf16.kernel": our bfloat16 default division, launched directly; "bf16.attention": the
  library's whole call (attnkern.attention, check_finite=False);
- "torch.sdpa", "torch.cudnn", "torch.flash", "torch.efficient": torch's SDPA in bfloat16, its
  default and each backend forced (one that refuses is left out);
- "fp8.kernel.<division>": the FP8 kernel alone, V^T made beforehand (not counted); divisions
  with a t are on the TMA producer (tensor maps of K and V^T);
- "fp8.vt.kernel": V^T's pre-pass alone by flash_fp8_vt.cu (cpp.FP8_VT_KERNEL), "fp8.vt.torch":
  by fp8_transpose_v's torch copy (the pre-pass before it);
- "fp8.attention.<division>": attnkern.attention on e4m3 tensors (check_finite=False) with that
  division the default and V^T by flash_fp8_vt.cu: V^T's pre-pass counted;
  "fp8.attention.<division>.torchvt": the same with the torch copy (the library as it was, for
  the first division); "fp8.quantize+attention.<division>": quantize_fp8 of the bfloat16 tensors
  (per-tensor amax, a host read of each scale) then attention: everything counted; with
  ".device_scales": quantize_fp8(device_scales=True), the scales kept on the GPU (no host read).
TFLOP/s count 4 B H N^2 D, half with causal masking; x_bf16 is bf16.kernel's time over each.
--after: a file whose appearance the timings wait for (up to 10 minutes), so that they do not
overlap other GPU work of the same device call (the builds and error runs go first)."""

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from gpu_flash_versions import Kernel, event_times, parse_config, sdpa_backends  # noqa: E402

import attnkern  # noqa: E402
from attnkern.backends.cuda import arrays, cpp, launch  # noqa: E402

D = 128


def rel_errors(out, ref):
    diff = out.double() - ref
    return {"rms": float(diff.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()),
            "max": float(diff.abs().max() / ref.abs().max())}


def make_inputs(kind, shape, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=g, device="cuda") for _ in range(3))
    if kind == "outliers":
        q, k = (x + 10 * torch.randn(shape, generator=g, device="cuda")
                * (torch.rand(shape, generator=g, device="cuda") < 1e-3) for x in (q, k))
    elif kind == "channels":
        ch = torch.randperm(D, generator=torch.Generator().manual_seed(seed))[:4].cuda()
        q[..., ch] *= 10
        k[..., ch] *= 10
    return q, k, v


def reference(q, k, v, causal):
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v.double()


def error_table(n, configs):
    """The error rows; FP8's (plain and Hadamard-rotated) for the default division, and for each of
    configs under "fp8.<division>" / "fp8_hadamard.<division>"."""
    rows = []
    for kind in ("gaussian", "outliers", "channels"):
        for causal in (False, True):
            q, k, v = make_inputs(kind, (1, 8, n, D), seed=len(rows))
            ref = reference(q, k, v, causal)
            row = {"inputs": kind, "causal": causal, "n": n}
            row["bf16"] = rel_errors(attnkern.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=causal), ref)
            for had in (False, True):
                r = attnkern.quantize_fp8(q, k, v, hadamard=had)
                out = attnkern.attention(*r[:3], causal=causal, **r.kwargs())
                row["fp8_hadamard" if had else "fp8"] = rel_errors(out, ref)
                again = attnkern.attention(*r[:3], causal=causal, **r.kwargs())
                row.setdefault("bit_identical", True)
                row["bit_identical"] &= bool(torch.equal(out, again))
                for config in configs:
                    run = with_settings(lambda r=r: attnkern.attention(*r[:3], causal=causal, **r.kwargs()),
                                        FP8_DEFAULT=config)
                    out = run()
                    row[f"{'fp8_hadamard' if had else 'fp8'}.{config}"] = rel_errors(out, ref)
                    row["bit_identical"] &= bool(torch.equal(out, run()))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def fp8_division(text):
    try:
        config = cpp.WgmmaConfig.parse(text)
    except ValueError:
        config = None
    if config is None or not config.stages:
        raise SystemExit(f"--fp8-configs: {text!r} is not a warp-specialized division like wg2k128s3e")
    return config


def with_settings(fn, **settings):
    """fn run with cpp's module settings (FP8_DEFAULT, FP8_VT_KERNEL) swapped for the call."""
    def call():
        before = {name: getattr(cpp, name) for name in settings}
        for name, value in settings.items():
            setattr(cpp, name, value)
        try:
            return fn()
        finally:
            for name, value in before.items():
                setattr(cpp, name, value)
    return call


def vt_kernel_prepared(v8, vt):
    """flash_fp8_vt.cu's launch of V (heads, n, D) into vt, prepared once (launched once first)."""
    kernel, grid, block, args = cpp.fp8_vt_launch(arrays.GpuArray(tuple(v8.shape), "uint8", None, ptr=v8.data_ptr(),
                                                                  owner=v8),
                                                  arrays.GpuArray(tuple(vt.shape), "uint8", None, ptr=vt.data_ptr(),
                                                                  owner=vt))
    launch.launch(kernel, grid, block, *args)
    return launch.Prepared(launch.raw_kernel(kernel), grid, block, args)


def fp8_prepared(config, q8, k8, vt, out, causal, scale_log2, out_scale):
    """The FP8 kernel's launch, prepared once (compiled and launched once first)."""
    def view(x, *shape):
        return arrays.GpuArray(shape, "uint8", None, ptr=x.data_ptr(), owner=x)

    bh, n = q8.shape[0] * q8.shape[1], q8.shape[2]
    kernel, grid, block, args = cpp.flash_fp8_launch(view(q8, bh, n, D), view(k8, bh, n, D),
                                                     view(vt, *vt.shape), view(out, bh, n, D), None, causal,
                                                     scale_log2, out_scale, None, config)
    launch.launch(kernel, grid, block, *args)
    return launch.Prepared(launch.raw_kernel(kernel), grid, block, args)


def timings(sizes, heads, configs, runs, done=lambda rows: None, quantized_configs=2):
    """The speed rows; done(rows) after each (the caller saves what is measured so far); quantize_fp8
    + attention for the first quantized_configs divisions only."""
    rows = []
    bf16 = Kernel(parse_config("default", D, "bfloat16"), D, "bfloat16")
    sdpa = sdpa_backends()
    for n in sizes:
        for causal in (False, True):
            q, k, v = (x.bfloat16() for x in make_inputs("gaussian", (1, heads, n, D), seed=n))
            out = torch.empty_like(q)
            r = attnkern.quantize_fp8(q, k, v)
            vt = cpp.fp8_transpose_v(r.v.reshape(heads, n, D), cpp.FP8_VT_KEYS)
            out8 = torch.empty(q.shape, dtype=torch.bfloat16, device="cuda")
            scale_log2 = r.descale_q * r.descale_k / math.sqrt(D) * launch.LOG2E
            fns = {"bf16.kernel": bf16.prepared(q, k, v, out, causal, 1 / math.sqrt(D)),
                   "bf16.attention": lambda: attnkern.attention(q, k, v, causal=causal, check_finite=False)}
            for name, fn in sdpa.items():
                try:
                    fn(q, k, v, causal)
                except RuntimeError:
                    continue
                fns[name] = lambda fn=fn: fn(q, k, v, causal)
            for config in configs:
                fns[f"fp8.kernel.{config}"] = fp8_prepared(config, r.q, r.k, vt, out8, causal, scale_log2,
                                                           r.descale_v / cpp.FP8_P_SCALE)
            vt2 = torch.empty_like(vt)
            fns["fp8.vt.kernel"] = vt_kernel_prepared(r.v.reshape(heads, n, D), vt2)
            assert torch.equal(vt2, vt), "flash_fp8_vt.cu's V^T differs from the torch copy's"
            fns["fp8.vt.torch"] = lambda: cpp.fp8_transpose_v(r.v.reshape(heads, n, D), cpp.FP8_VT_KEYS)

            def library(r=r, causal=causal):
                return attnkern.attention(*r[:3], causal=causal, check_finite=False, **r.kwargs())

            def quantized(q=q, k=k, v=v, causal=causal):
                x = attnkern.quantize_fp8(q, k, v)
                return attnkern.attention(*x[:3], causal=causal, check_finite=False, **x.kwargs())

            for i, config in enumerate(configs):
                fns[f"fp8.attention.{config}"] = with_settings(library, FP8_DEFAULT=config, FP8_VT_KERNEL=True)
                if i == 0:
                    fns[f"fp8.attention.{config}.torchvt"] = with_settings(library, FP8_DEFAULT=config,
                                                                           FP8_VT_KERNEL=False)
                if i >= quantized_configs:
                    continue
                fns[f"fp8.quantize+attention.{config}"] = with_settings(quantized, FP8_DEFAULT=config,
                                                                        FP8_VT_KERNEL=True)
                fns[f"fp8.quantize+attention.{config}.device_scales"] = with_settings(
                    lambda q=q, k=k, v=v, causal=causal: attnkern.attention(
                        *(x := attnkern.quantize_fp8(q, k, v, device_scales=True))[:3], causal=causal,
                        check_finite=False, **x.kwargs()), FP8_DEFAULT=config, FP8_VT_KERNEL=True)
            times = event_times(fns, runs)
            flops = 4 * heads * n * n * D / (2 if causal else 1)
            row = {"n": n, "causal": causal, "heads": heads, "kernels": {
                name: {"ms": t * 1e3, "tflops": flops / t / 1e12, "x_bf16": times["bf16.kernel"] / t}
                for name, t in times.items()}}
            rows.append(row)
            print(json.dumps(row), flush=True)
            done(rows)
    return rows


def host_profile(config, calls=300):
    """cProfile's top functions (by own time) of `calls` FP8 attention() calls at (1, 16, 4096, 128),
    check_finite=False, with that division the default: where the host's time a call goes."""
    import cProfile
    import io
    import pstats

    q, k, v = (x.bfloat16() for x in make_inputs("gaussian", (1, 16, 4096, D), seed=1))
    r = attnkern.quantize_fp8(q, k, v)
    call = with_settings(lambda: attnkern.attention(*r[:3], check_finite=False, **r.kwargs()), FP8_DEFAULT=config)
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    host = (time.perf_counter() - t0) / calls  # the host's time a call, the GPU queue not yet full
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
    return {"config": str(config), "host_us_per_call": host * 1e6, "top": out.getvalue()[-6000:]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--sizes", default="4096,8192,16384")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--fp8-configs", default="wg2k128s3e,wg2k192s2pet,wg2k192s2petx1,wg2k192s2petx4,wg2k192s2petx6,"
                                             "wg2k192s2petx8,wg2k160s3pet")
    ap.add_argument("--error-n", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--after", default="")
    ap.add_argument("--quantized-configs", type=int, default=2, help="divisions (the first) timed with quantize_fp8")
    ap.add_argument("--profile", action="store_true", help="cProfile of the host's part of attention() first")
    a = ap.parse_args()
    configs = [fp8_division(c) for c in a.fp8_configs.split(",")]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": a.runs,
              "fp8_default": str(cpp.FP8_DEFAULT)}
    result["failed"] = {}
    for config in list(configs):  # compiled before the timings wait (NVRTC takes seconds a kernel)
        try:
            cpp.flash_fp8_kernel(config)
            cpp.flash_fp8_kernel(config, featured=True)
        except Exception as exc:  # noqa: BLE001  (reported, the others measured)
            result["failed"][str(config)] = repr(exc)[-2000:]
            configs.remove(config)
    result["errors"] = error_table(a.error_n, configs)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    if a.after:
        until = time.monotonic() + 600
        while not os.path.exists(a.after) and time.monotonic() < until:
            time.sleep(1)
    def save(rows):
        result["timings"] = rows
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)

    if a.profile:
        result["host_profile"] = host_profile(configs[min(1, len(configs) - 1)])
        print(result["host_profile"]["top"], flush=True)
    save(timings([int(x) for x in a.sizes.split(",")], a.heads, configs, a.runs, save, a.quantized_configs))


if __name__ == "__main__":
    main()
