"""triton.flash's forward, the pointer-load kernel (flash.TABLE's config) beside configs of its
Hopper variant (TMA loads of K and V in the unmasked stage, flash.HOPPER_TABLE), against every
torch SDPA backend, on one GPU.

    python3 dev/triton_hopper_sweep.py --out OUT.json [--ns 4096,8192,16384] [--dims 64,128]
        [--runs 3] [--reps 15] [--warm-slice i/n]

Per head size D and mask (causal and not), bfloat16, (1, 16, N, D): each config of CONFIGS
(BLOCK_M, BLOCK_N, num_warps, num_stages, warp_specialize; "table": the pointer-load kernel
at flash.TABLE's config) launched straight through flash.launch with flash.OVERRIDE set.
Correctness, at the first N: 512 sampled query rows of every head against float64 (the
largest error, and cuDNN's on the same rows); a config passes with an error within
max(2 x cuDNN's, 4 u) (u = 2^-8). Timing: every kernel first kept busy for 0.1 s
(attnkern_bench.timing.CudaEventClock.busy), then --reps (15) samples, each between CUDA events,
the kernels taking turns sample by sample; medians. The whole sweep --runs times in the same
process (the spread between runs). x_fastest: the fastest torch backend's time over ours.
--warm-slice i/n only compiles slice i of the configs (worker processes that fill Triton's
cache while the tests run).

    python3 dev/triton_hopper_sweep.py --library --out OUT.json [--batches 1,2,4,8]
        [--ns 2048,4096,8192,16384] [--dims 64,128] [--float16-batches 1] [--runs 3] [--reps 10]
        [--busy 0.05] [--warm-slice i/n]

--library: the library call, attnkern.attention(q, k, v, causal=..., kernel="triton.flash") on
(B, 16, N, D) CUDA tensors (the table's config, the Hopper variant where it applies; the
defaults, check_finite included), against every torch SDPA backend, per batch B of --batches,
N, D, mask; bfloat16 at every batch, float16 at --float16-batches. Correctness, at the first N
of each (dtype, D, mask, B): 256 sampled query rows of every head against float64, beside
cuDNN's error on the same rows (passes within max(2 x cuDNN's, 4 u)). Timing as above (--busy s
of each kernel first, --reps samples in turns, medians), the whole grid --runs times.
--diagnose adds to each turn the library call with check_finite=False and the kernel launched
straight (flash.launch at the table's config, as the config sweep above), and the JSON records
flash.HOPPER_FAILED (Hopper-variant compilations that fell back to the pointer-load kernel).
--warm-slice i/n with --library compiles the library call's kernels of slice i at N = 1024.
"""

import argparse
import json
import statistics

import torch

from attnkern.backends.triton import flash
from attnkern_bench.timing import CudaEventClock

# the Hopper variant's candidates per D: those that compile for sm_90 without spills
# (dev/triton_compile_check.py --only BM,BN,W,S,1,WS); warp specialization (last field) compiles
# with Triton 3.6 for sm_90 at 8 warps only (4 warps: the NVGPUWarpSpecialization pass fails)
CONFIGS = {
    64: [(128, 64, 4, 3, 0), (128, 64, 4, 4, 0), (128, 64, 4, 2, 0), (128, 128, 8, 3, 0), (128, 64, 8, 3, 0),
         (128, 32, 4, 3, 0), (64, 64, 4, 3, 0), (128, 64, 8, 3, 1), (128, 128, 8, 3, 1), (128, 64, 8, 2, 1)],
    128: [(128, 64, 8, 3, 0), (128, 64, 8, 4, 0), (128, 64, 8, 2, 0), (128, 128, 8, 3, 0), (128, 128, 8, 2, 0),
          (128, 32, 8, 3, 0), (64, 64, 4, 3, 0), (128, 64, 8, 3, 1), (128, 128, 8, 3, 1), (128, 64, 8, 2, 1)],
}
HEADS = 16


def _name(cfg):
    return "table" if cfg is None else "tma %dx%d w%d s%d%s" % (*cfg[:4], " ws" if cfg[4] else "")


def _launcher(q, k, v, out, lse, causal, cfg):
    """A forward launch of config cfg (None: the pointer-load kernel at TABLE's config; "table":
    the configs of the tables, as the library call takes them)."""
    batch, n, d = q.shape

    def fn():
        if cfg != "table":
            flash.OVERRIDE["forward_hopper"] = cfg
        try:
            flash.launch(q, k, v, out, lse, None, batch, batch, n, n, d, d, causal, d ** -0.5, "bfloat16", 1, None)
        finally:
            flash.OVERRIDE.pop("forward_hopper", None)
    return fn


def _inputs(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(HEADS, n, d, generator=g).to(torch.bfloat16).cuda() for _ in range(3)]


def _reference_rows(q, k, v, causal, rows):
    """float64 attention of the query rows `rows` (every head)."""
    q64, k64, v64 = (x.double() for x in (q, k, v))
    s = q64[:, rows] @ k64.transpose(1, 2) * q.shape[2] ** -0.5
    if causal:
        keys = torch.arange(k.shape[1], device=q.device)
        s = s.masked_fill(keys[None, None, :] > rows[None, :, None], float("-inf"))
    return torch.softmax(s, -1) @ v64


def warm(part, parts):
    cases = [(d, causal, cfg) for d in CONFIGS for causal in (False, True) for cfg in [None] + CONFIGS[d]]
    for i, (d, causal, cfg) in enumerate(cases):
        if i % parts != part:
            continue
        # N = 1024: a long-sequence bucket (TABLE's "large" configs), int arguments divisible by 16 as
        # at N = 4096-16384, so that the sweep's calls find these compiled kernels
        q, k, v = _inputs(1024, d, i)
        out, lse = torch.empty_like(q), torch.empty(HEADS, 1024, dtype=q.dtype, device="cuda")
        try:
            _launcher(q, k, v, out, lse, causal, cfg)()
            torch.cuda.synchronize()
        except Exception as exc:  # a config that does not compile: the sweep reports it
            print("warm", d, causal, _name(cfg), repr(exc)[:200], flush=True)


def sweep(ns, dims, reps, checked, result, save):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    backends = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
    clock = CudaEventClock(torch, warmup_s=0.1)
    rows = []
    for d in dims:
        for causal in (False, True):
            for n in ns:
                q, k, v = _inputs(n, d, n + d)
                q4, k4, v4 = (x.view(1, HEADS, n, d) for x in (q, k, v))
                fns = {}
                for cfg in [None] + CONFIGS[d]:
                    out, lse = torch.empty_like(q), torch.empty(HEADS, n, dtype=q.dtype, device="cuda")
                    fn = _launcher(q, k, v, out, lse, causal, cfg)
                    key = (d, causal, _name(cfg))
                    try:
                        fn()
                        torch.cuda.synchronize()
                    except Exception as exc:
                        checked.setdefault(key, {"failed": repr(exc)[:300]})
                        continue
                    if key not in checked:  # correctness, once per (D, mask, config)
                        sample = torch.randperm(n, generator=torch.Generator().manual_seed(n))[:512].cuda()
                        ref = _reference_rows(q, k, v, causal, sample)
                        err = (out[:, sample].double() - ref).abs().max().item()
                        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
                            theirs = sdpa(q4, k4, v4, is_causal=causal)[0]
                        terr = (theirs[:, sample].double() - ref).abs().max().item()
                        checked[key] = {"err": err, "cudnn_err": terr, "n": n,
                                        "passed": err <= max(2 * terr, 4 * 2.0 ** -8)}
                        del ref
                    if checked[key].get("passed"):
                        fns[_name(cfg)] = fn
                for be in backends:
                    def theirs(be=be):
                        with sdpa_kernel(be), torch.no_grad():
                            sdpa(q4, k4, v4, is_causal=causal)
                    try:
                        theirs()
                        torch.cuda.synchronize()
                    except RuntimeError:
                        continue
                    fns[f"torch {be.name}"] = theirs
                for fn in fns.values():
                    clock.busy(fn)
                samples = {name: [] for name in fns}
                for _ in range(reps):
                    for name, fn in fns.items():
                        samples[name].append(clock.seconds(fn))
                ms = {name: statistics.median(t) * 1e3 for name, t in samples.items()}
                best_torch = min(t for name, t in ms.items() if name.startswith("torch"))
                flops = 4 * HEADS * n * n * d * (0.5 if causal else 1)
                row = {"d": d, "causal": causal, "n": n, "ms": {k_: round(t, 4) for k_, t in ms.items()},
                       "x_fastest": {k_: round(best_torch / t, 3) for k_, t in ms.items() if not k_.startswith("torch")},
                       "tflops": {k_: round(flops / t / 1e9, 1) for k_, t in ms.items()}}
                rows.append(row)
                top = sorted(row["x_fastest"].items(), key=lambda x: -x[1])[:3]
                print(d, causal, n, "table", row["x_fastest"].get("table"), "best", top, flush=True)
                result["runs"][-1] = rows
                save()
                del fns, q, k, v
                torch.cuda.empty_cache()
    return rows


def _library_cases(a):
    """(dtype, D, causal, batches) of the library grid."""
    dims = [int(x) for x in a.dims.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    half = [int(x) for x in a.float16_batches.split(",") if x]
    return [(dt, d, causal, bs) for dt, bs in (("bfloat16", batches), ("float16", half)) if bs
            for d in dims for causal in (False, True)]


def _library_call(q, k, v, causal):
    import attnkern

    return lambda: attnkern.attention(q, k, v, causal=causal, kernel="triton.flash")


def library_warm(a, part, parts):
    # batch 1 and batch 2 compile apart (Triton specializes an integer argument equal to 1);
    # N = 1024 is in the long-sequence bucket and divisible by 16, as N = 2048-16384
    jobs = [(dt, d, causal, b) for dt, d, causal, bs in _library_cases(a) for b in sorted({min(b, 2) for b in bs})]
    for i, (dt, d, causal, b) in enumerate(jobs):
        if i % parts != part:
            continue
        g = torch.Generator().manual_seed(i)
        q, k, v = (torch.randn(b, HEADS, 1024, d, generator=g).to(getattr(torch, dt)).cuda() for _ in range(3))
        try:
            _library_call(q, k, v, causal)()
            torch.cuda.synchronize()
        except Exception as exc:
            print("warm", dt, d, causal, b, repr(exc)[:200], flush=True)


def library_sweep(a, result, save):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    backends = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
    clock = CudaEventClock(torch, warmup_s=a.busy)
    ns = [int(x) for x in a.ns.split(",")]
    rows = []
    for dt, d, causal, batches in _library_cases(a):
        for b in batches:
            for n in ns:
                g = torch.Generator().manual_seed(n + d + b)
                q, k, v = (torch.randn(b, HEADS, n, d, generator=g).to(getattr(torch, dt)).cuda() for _ in range(3))
                fns = {"triton.flash": _library_call(q, k, v, causal)}
                if a.diagnose:
                    import attnkern

                    fns["triton.flash check_finite=False"] = lambda: attnkern.attention(
                        q, k, v, causal=causal, kernel="triton.flash", check_finite=False)
                    qh, kh, vh = (x.reshape(b * HEADS, n, d) for x in (q, k, v))
                    out_ = torch.empty_like(qh)

                    def straight(qh=qh, kh=kh, vh=vh, out_=out_):
                        flash.launch(qh, kh, vh, out_, None, None, b * HEADS, b * HEADS, n, n, d, d, causal,
                                     d ** -0.5, dt, 1, None)
                    fns["kernel straight"] = straight
                for be in backends:
                    def theirs(be=be):
                        with sdpa_kernel(be), torch.no_grad():
                            return sdpa(q, k, v, is_causal=causal)
                    try:
                        theirs()
                        torch.cuda.synchronize()
                    except RuntimeError:
                        continue
                    fns[f"torch {be.name}"] = theirs
                key = " ".join(map(str, (dt, d, causal, b)))
                if key not in result["checked"]:  # correctness, once per (dtype, D, mask, batch)
                    sample = torch.randperm(n, generator=torch.Generator().manual_seed(n))[:256].cuda()
                    qh, kh, vh = (x.reshape(b * HEADS, n, d) for x in (q, k, v))
                    ref = _reference_rows(qh, kh, vh, causal, sample)
                    ours = fns["triton.flash"]().reshape(b * HEADS, n, d)
                    err = (ours[:, sample].double() - ref).abs().max().item()
                    terr = None
                    if "torch CUDNN_ATTENTION" in fns:
                        theirs = fns["torch CUDNN_ATTENTION"]().reshape(b * HEADS, n, d)
                        terr = (theirs[:, sample].double() - ref).abs().max().item()
                    result["checked"][key] = {"err": err, "cudnn_err": terr, "n": n,
                                              "passed": err <= max(2 * (terr or 0), 4 * 2.0 ** -8)}
                    print("check", key, result["checked"][key], flush=True)
                    del ref, ours
                for fn in fns.values():
                    clock.busy(fn)
                samples = {name: [] for name in fns}
                for _ in range(a.reps):
                    for name, fn in fns.items():
                        samples[name].append(clock.seconds(fn))
                ms = {name: statistics.median(t) * 1e3 for name, t in samples.items()}
                best = min((t, name) for name, t in ms.items() if name.startswith("torch"))
                flops = 4 * b * HEADS * n * n * d * (0.5 if causal else 1)
                row = {"dtype": dt, "batch": b, "d": d, "causal": causal, "n": n,
                       "ms": {k_: round(t, 4) for k_, t in ms.items()}, "fastest_torch": best[1],
                       "x_fastest": round(best[0] / ms["triton.flash"], 3),
                       "tflops": {k_: round(flops / t / 1e9, 1) for k_, t in ms.items()}}
                if a.diagnose:
                    row["x_fastest_all"] = {k_: round(best[0] / t, 3) for k_, t in ms.items()
                                            if not k_.startswith("torch")}
                    result["hopper_failed"] = sorted(map(repr, getattr(flash, "HOPPER_FAILED", ())))
                rows.append(row)
                print(dt, d, causal, b, n, "x_fastest", row["x_fastest"], best[1], row["tflops"], flush=True)
                result["runs"][-1] = rows
                save()
                del fns, q, k, v
                torch.cuda.empty_cache()
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    p.add_argument("--library", action="store_true", help="the library call per batch (see above)")
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--diagnose", action="store_true", help="with --library: see above")
    p.add_argument("--float16-batches", default="1")
    p.add_argument("--busy", type=float, default=0.1)
    p.add_argument("--ns", default=None)
    p.add_argument("--dims", default="64,128")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--warm-slice", default="")
    a = p.parse_args()
    if a.ns is None:
        a.ns = "2048,4096,8192,16384" if a.library else "4096,8192,16384"
    if a.reps is None:
        a.reps = 10 if a.library else 15
    if a.warm_slice:
        part, parts = (int(x) for x in a.warm_slice.split("/"))
        (library_warm(a, part, parts) if a.library else warm(part, parts))
        return
    import triton

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "table": {str(k): v for k, v in flash.TABLE.items() if k[0] == "forward"}, "configs": CONFIGS,
              "runs": [], "checked": {}}
    checked = {}

    def save():
        result["checked"] = {" ".join(map(str, k)): v for k, v in checked.items()}
        if a.out:
            with open(a.out, "w") as f:
                json.dump(result, f, indent=1)

    if a.library:
        result.update(configs=None, hopper_table={str(k): v for k, v in flash.HOPPER_TABLE.items()},
                      mode="library", reps=a.reps, busy_s=a.busy)

        def save_library():
            if a.out:
                with open(a.out, "w") as f:
                    json.dump(result, f, indent=1)
        for _ in range(a.runs):
            result["runs"].append([])
            library_sweep(a, result, save_library)
        save_library()
        return
    ns, dims = [int(x) for x in a.ns.split(",")], [int(x) for x in a.dims.split(",")]
    for _ in range(a.runs):
        result["runs"].append([])
        sweep(ns, dims, a.reps, checked, result, save)
    save()


if __name__ == "__main__":
    main()
