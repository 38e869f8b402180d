"""Times decode attention on the GPU: cuda.flash and triton.flash (their split-K decode
paths, and cuda.flash's regular kernel with split_k=1) against every torch SDPA backend
(cuDNN, flash, memory-efficient, math), at H = 32 query heads over H_kv = 8, Nq = 1,
D = 128, bfloat16, B in --batches, Nk in --nk; and the achieved HBM bandwidth.

    python3 dev/gpu_decode_measure.py [--batches 1 4 8] [--nk 4096 16384 65536 131072] [--nq 1 4]
                                      [--runs 9] [--json decode.json] [--before]
                                      [--decode-configs 32x2 64x2x4+FUSED=0] [--regular] [--rules]
                                      [--host-profile 20]
    ATTNKERN_BENCH_SMOKE=1 python3 dev/gpu_decode_measure.py    # one small shape, 2 runs

--before adds cuda.flash as it ran before 2026-11-26 (every call on the general path,
attnkern.backends.cuda.FAST_PATH = False; a double-buffered decode kernel, cpp.DECODE_STAGES = 2; a
combine reading one partial at a time, cpp.DECODE_COMBINE_UNROLL = 1; the 264-block split,
cpp.DECODE_SPLIT_RULE = "blocks"; 32-key tiles, one warp; two launches, cpp.DECODE_FUSED = False; no
L2 prefetch hint, cpp.DECODE_PREFETCH = 0; no L2 evict-first policy, cpp.DECODE_EVICT_FIRST = 0) and
triton.flash on
the general path, in turns with today's code in one process. --decode-configs TILExSTAGES[xKW][:RULE][+NAME=N...]
adds cuda.flash's decode kernel with other K/V tiles, pipeline depths, key warps and split rules
(cpp.DECODE_TILE, cpp.DECODE_STAGES, cpp.DECODE_KEY_WARPS, 1 unless given, cpp.DECODE_SPLIT_RULE,
today's unless given: 32x3x1:waves is the default before the long chunks; +NAME=N sets
cpp.DECODE_NAME, e.g. 64x2x4+FUSED=0 (two launches), 64x2x4+LONG_MIN_CHUNK=128, 64x2x4+PREFETCH=0; on the general
path, so its call time is the general path's). --host-profile N: where an isolated call's host
time goes (host_profile).

attnkern runs attention(q, k, v, causal="bottom_right", check_finite=False) on torch
tensors; torch runs scaled_dot_product_attention(q, k, v) (Nq = 1: bottom-right causal
masks nothing, and torch's is_causal is top-left) inside sdpa_kernel(backend), with
enable_gqa=True where the backend takes it, else with k and v repeated to H heads
beforehand (outside the timing; the row says "repeated": that backend then reads 4x
the bytes). Every contender's output is first compared with cuda.flash's (max abs
difference, reported).

Two times per contender, each the median of --runs samples taken in turns (one sample
of every contender, then the next round):
- kernel: 10 calls queued behind torch.cuda._sleep (the GPU busy while Python enqueues
  them), between two CUDA events, divided by 10: the GPU time of a call. A sample whose
  enqueueing outlasted the sleep is flagged (cpu_bound), its time then includes Python.
- call: one call between two CUDA events after a synchronize: what one isolated call
  costs, Python's launch overhead included; beside it the host's time in that call (call_host_us).
Bandwidth: bytes of K and V (B H_kv Nk D 2 bytes each) plus q and out, over the kernel
time, and as a fraction of the device-to-device copy bandwidth (a 1 GiB
tensor.copy_, read and write counted, median of 10)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnkern
import attnkern.backends.triton as triton_backend
from attnkern_bench.roofline import cuda_copy_gbs

H, H_KV, D = 32, 8, 128
QUEUED = 10  # calls a kernel-time sample queues


def sleep_cycles_per_s() -> float:
    """The GPU clock as torch.cuda._sleep counts it (cycles a second)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(10_000_000)
    a.record()
    torch.cuda._sleep(20_000_000)
    b.record()
    b.synchronize()
    return 20_000_000 / (a.elapsed_time(b) / 1e3)


def _with(fn, fast_path=True, **constants):
    """fn with cpp's constants set (DECODE_TILE=...) and the prepared launches on or off
    (attnkern.backends.cuda.FAST_PATH) for its call."""
    from attnkern.backends import cuda as backend
    from attnkern.backends.cuda import cpp

    def call():
        saved = {n: getattr(cpp, n) for n in constants}
        was = backend.FAST_PATH
        for n, x in constants.items():
            setattr(cpp, n, x)
        backend.FAST_PATH = fast_path
        try:
            return fn()
        finally:
            for n, x in saved.items():
                setattr(cpp, n, x)
            backend.FAST_PATH = was

    return call


def contenders(q, k, v, splits=(), configs=(), backends=("cudnn", "flash", "efficient", "math"), before=False,
               regular=False, rules=()):
    """name -> (call, note): attnkern's kernels (with before, also as they ran before
    2026-11-26; cuda.flash with each split_k of splits, each (tile, stages) of configs, each
    (name, cpp constants) of rules and with regular its regular kernel) and each torch SDPA
    backend of backends that runs here."""
    def ours(kernel, **params):
        return lambda: attnkern.attention(q, k, v, causal="bottom_right", kernel=kernel, check_finite=False,
                                          **params)

    out = {"cuda.flash": (ours("cuda.flash"), "split-K decode"),
           "triton.flash": (ours("triton.flash"), "split-K decode")}
    if before:
        out["cuda.flash[before]"] = (_with(ours("cuda.flash"), False, DECODE_STAGES=2, DECODE_COMBINE_UNROLL=1,
                                           DECODE_SPLIT_RULE="blocks", DECODE_KEY_WARPS=1, DECODE_TILE=32,
                                           DECODE_FUSED=False, DECODE_PREFETCH=0, DECODE_EVICT_FIRST=0),
                                     "general path, double-buffered decode kernel, serial combine, 264-block split")
        out["triton.flash[before]"] = (_with(ours("triton.flash"), False), "general path")
    if regular:
        out["cuda.flash[split_k=1]"] = (ours("cuda.flash", split_k=1), "regular kernel")
    for n, constants in rules:
        out[f"cuda.flash[{n}]"] = (_with(ours("cuda.flash"), False, **constants), "split rule forced, general path")
    for n in splits:
        out[f"cuda.flash[split_k={n}]"] = (ours("cuda.flash", split_k=n), "split-K decode, forced")
    for tile, stages, kw, rule, extra in configs:
        constants = dict(DECODE_TILE=tile, DECODE_STAGES=stages, DECODE_KEY_WARPS=kw)
        if rule:
            constants["DECODE_SPLIT_RULE"] = rule
        constants.update({f"DECODE_{n}": x for n, x in extra})
        out[f"cuda.flash[{tile}x{stages}x{kw}{':' + rule if rule else ''}{''.join(f'+{n}={x}' for n, x in extra)}]"] = (
            _with(ours("cuda.flash"), False, **constants),
            "split-K decode, K/V tile x stages x key warps (and split rule, constants) forced, general path")
    rep = None
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)):
        if name not in backends:
            continue
        # no mask: at Nq = 1 bottom-right masks nothing (torch's is_causal is top-left); at Nq > 1 it
        # hides at most Nq - 1 of Nk keys from a row, which the difference to cuda.flash then shows
        def gqa(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

        try:
            gqa()
            torch.cuda.synchronize()
            out[f"torch.{name}"] = (gqa, "enable_gqa=True")
            continue
        except RuntimeError:
            pass
        if rep is None:
            rep = (k.repeat_interleave(H // H_KV, dim=1), v.repeat_interleave(H // H_KV, dim=1))

        def repeated(backend=backend, kr=rep[0], vr=rep[1]):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, kr, vr)

        try:
            repeated()
            torch.cuda.synchronize()
            out[f"torch.{name}"] = (repeated, "k, v repeated")
        except RuntimeError as exc:
            print(f"  torch.{name}: does not run: {str(exc).splitlines()[0][:100]}")
    return out


def kernel_sample(fn, sleep_cycles: int, sleep_s: float) -> tuple[float, bool]:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(sleep_cycles)
    t0 = time.perf_counter()
    a.record()
    for _ in range(QUEUED):
        fn()
    b.record()
    host = time.perf_counter() - t0
    b.synchronize()
    gpu = a.elapsed_time(b) / 1e3
    return gpu / QUEUED, host > sleep_s  # the GPU may have waited for Python: the sleep was too short


def call_sample(fn) -> tuple[float, float]:
    """(GPU time of one isolated call, between two events after a synchronize; the host's time
    in the call, until it returned): where the call time passes the kernel time by much more
    than the host's time, the GPU waited on something else than Python (the launches' own cost)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    t0 = time.perf_counter()
    fn()
    host = time.perf_counter() - t0
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3, host


def parse_config(text: str) -> tuple:
    """--decode-configs' TILExSTAGES[xKW][:RULE][+NAME=INT...] as (tile, stages, key warps, rule or
    "", ((NAME, int), ...)): NAME a cpp.DECODE_ constant without its prefix (FUSED=0: two launches;
    LONG_MIN_CHUNK=128)."""
    head, *extra = text.split("+")
    sizes, _, rule = head.partition(":")
    tile, stages, kw = (tuple(int(x) for x in sizes.split("x")) + (1,))[:3]
    pairs = tuple((n.upper(), int(x)) for n, _, x in (e.partition("=") for e in extra))
    return tile, stages, kw, rule, pairs


def host_profile(named: dict, calls: int, top: int, sleep_cycles: int) -> dict:
    """Where an isolated call's host time goes: for each contender, the host's time in one call
    (until it returned) after a synchronize (isolated), after a synchronize that waited for a
    sleep_cycles GPU sleep (after a wait: as call_sample's calls, which follow a kernel sample),
    and with the GPU still busy with the previous call (back to back), medians of `calls`; a
    control (torch.empty and one tiny kernel) likewise; and cProfile's heaviest functions (own
    time) over `calls` isolated calls of each of attnkern's contenders."""
    import cProfile
    import pstats

    def control():
        return torch.empty(1, device="cuda").fill_(1.0)

    result = {}
    for n, fn in [("control: torch.empty + fill_", control)] + [(n, f) for n, (f, _) in named.items()]:
        iso, waited, b2b = [], [], []
        for _ in range(calls):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            iso.append(time.perf_counter() - t0)
            torch.cuda._sleep(sleep_cycles)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            waited.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            b2b.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        result[n] = dict(isolated_host_us=statistics.median(iso) * 1e6, after_wait_host_us=statistics.median(waited) * 1e6,
                         back_to_back_host_us=statistics.median(b2b) * 1e6)
        print(f"  host {n:32s} isolated {result[n]['isolated_host_us']:7.1f} us, after a wait "
              f"{result[n]['after_wait_host_us']:7.1f} us, back to back {result[n]['back_to_back_host_us']:7.1f} us")
    for n in ("cuda.flash", "triton.flash"):
        prof = cProfile.Profile()
        for _ in range(calls):
            torch.cuda.synchronize()
            prof.enable()
            named[n][0]()
            prof.disable()
        torch.cuda.synchronize()
        # (pstats prints seconds to 3 decimals: here microseconds a call, own and cumulative)
        stats = sorted(pstats.Stats(prof).stats.items(), key=lambda item: -item[1][2])[:top]
        lines = [f"{tt / calls * 1e6:8.1f} {ct / calls * 1e6:8.1f} {nc / calls:5.1f}  {os.path.basename(f)}:{line}({fn})"
                 for (f, line, fn), (_, nc, tt, ct, _) in stats]
        result[n]["profile"] = "\n".join(lines)
        print(f"  cProfile of {calls} isolated calls of {n}: us a call own, cumulative, calls a call, function")
        print("\n".join("    " + line for line in lines))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--nk", type=int, nargs="+", default=[4096, 16384, 65536, 131072])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--json", default=None)
    parser.add_argument("--splits", type=int, nargs="*", default=[], help="cuda.flash's split_k values to add")
    parser.add_argument("--decode-configs", nargs="*", default=[],
                        help="cuda.flash decode kernels to add, TILExSTAGES[xKEYWARPS][:RULE][+NAME=N...] "
                             "(cpp.DECODE_TILE 16/32/64, cpp.DECODE_STAGES 2-4, cpp.DECODE_KEY_WARPS 1 (default), "
                             "2 or 4: at least 16 keys a warp; cpp.DECODE_SPLIT_RULE waves, blocks, long or "
                             "long_waves, today's unless given; +NAME=N sets cpp.DECODE_NAME), "
                             "e.g. 32x2 32x3x1:waves 64x2x4:long 64x2x4+FUSED=0 64x2x4+LONG_MIN_CHUNK=128")
    parser.add_argument("--nq", type=int, nargs="+", default=[1], help="query rows a head")
    parser.add_argument("--rules", action="store_true",
                        help="add cuda.flash with the split rule before 2026-11-26 (cpp.DECODE_SPLIT_RULE='blocks') "
                             "and with 64-key chunks allowed (cpp.DECODE_MIN_CHUNK=64)")
    parser.add_argument("--before", action="store_true", help="add cuda.flash and triton.flash as before 2026-11-26")
    parser.add_argument("--regular", action="store_true", help="add cuda.flash's regular kernel (split_k=1)")
    parser.add_argument("--math-max-nk", type=int, default=16384, help="torch's math backend up to this Nk")
    parser.add_argument("--host-profile", type=int, default=0, metavar="CALLS",
                        help="after each shape's timings: the host's time in isolated and back-to-back calls, "
                             "and a cProfile of CALLS isolated calls of cuda.flash and triton.flash")
    parser.add_argument("--torch", nargs="*", default=["cudnn", "flash", "efficient", "math"],
                        help="torch SDPA backends to time")
    args = parser.parse_args()
    if os.environ.get("ATTNKERN_BENCH_SMOKE") == "1":
        args.batches, args.nk, args.runs = [1], [4096], 2
    copy_bw = cuda_copy_gbs(torch, 10) * 1e9  # attnkern roofline's measure: bytes read and written
    hz = sleep_cycles_per_s()
    device = torch.cuda.get_device_name()
    print(f"{device}: device-to-device copy {copy_bw / 1e9:.0f} GB/s; H={H}, H_kv={H_KV}, D={D}, bfloat16")
    configs = [parse_config(c) for c in args.decode_configs]
    rows = []
    for batch, nq, nk in ((b, n, k) for n in args.nq for b in args.batches for k in args.nk):
        g = torch.Generator(device="cuda").manual_seed(batch * nk)
        q = torch.randn(batch, H, nq, D, device="cuda", generator=g, dtype=torch.bfloat16)
        k = torch.randn(batch, H_KV, nk, D, device="cuda", generator=g, dtype=torch.bfloat16)
        v = torch.randn(batch, H_KV, nk, D, device="cuda", generator=g, dtype=torch.bfloat16)
        useful = 2 * (2 * batch * H_KV * nk * D) + 2 * (2 * batch * H * nq * D)
        backends = [b for b in args.torch if b != "math" or nk <= args.math_max_nk]
        rules = ([("blocks", dict(DECODE_SPLIT_RULE="blocks")), ("min64", dict(DECODE_MIN_CHUNK=64))]
                 if args.rules else [])
        named = contenders(q, k, v, args.splits, configs, backends, args.before, args.regular, rules)
        base = named["cuda.flash"][0]().float()
        diffs, splits = {}, {}
        for n, (fn, _) in named.items():  # each output against cuda.flash's, and the chunks it ran
            diffs[n] = float((fn().float() - base).abs().max())
            if n.startswith("cuda.flash"):
                splits[n] = attnkern.backends.cuda.last_split()
            elif n.startswith("triton.flash"):
                splits[n] = triton_backend.last_split()
        # sleep long enough to cover enqueueing QUEUED calls (2 ms each at most) and the GPU work before
        sleep_s = QUEUED * 2e-3
        sleep = int(hz * sleep_s)
        kern = {n: [] for n in named}
        calls = {n: [] for n in named}
        hosts = {n: [] for n in named}
        flagged = {n: 0 for n in named}
        for fn, _ in named.values():  # warm up
            fn()
        for _ in range(args.runs):
            for n, (fn, _) in named.items():
                t, cpu = kernel_sample(fn, sleep, sleep_s)
                kern[n].append(t)
                flagged[n] += cpu
                t, host = call_sample(fn)
                calls[n].append(t)
                hosts[n].append(host)
        for n, (fn, note) in named.items():
            t = statistics.median(kern[n])
            row = dict(device=device, B=batch, H=H, H_kv=H_KV, Nq=nq, Nk=nk, D=D, dtype="bfloat16", kernel=n,
                       note=note, kernel_us=t * 1e6, call_us=statistics.median(calls[n]) * 1e6,
                       call_host_us=statistics.median(hosts[n]) * 1e6,
                       GBps=useful / t / 1e9, of_copy=useful / t / copy_bw, cpu_bound=flagged[n],
                       max_abs_diff_vs_cuda_flash=diffs[n], splits=splits.get(n), runs=args.runs,
                       copy_GBps=copy_bw / 1e9)
            rows.append(row)
            print(f"B={batch} Nq={nq:2d} Nk={nk:6d} {n:24s} kernel {row['kernel_us']:8.1f} us  "
                  f"call {row['call_us']:8.1f} us (host {row['call_host_us']:6.1f})  {row['GBps']:6.0f} GB/s "
                  f"({row['of_copy']:4.0%} of copy)"
                  f"{'  cpu-bound ' + str(flagged[n]) if flagged[n] else ''}  [{note}] chunks {splits.get(n)}"
                  f" diff {diffs[n]:.2g}")
        host = host_profile(named, args.host_profile, 14, sleep) if args.host_profile else {}
        for r in rows[-len(named):]:
            if r["kernel"] in host:
                r["host_profile"] = host[r["kernel"]]
        fastest_torch = min((r for r in rows[-len(named):] if r["kernel"].startswith("torch.")),
                            key=lambda r: r["kernel_us"])
        fastest_call = min((r for r in rows[-len(named):] if r["kernel"].startswith("torch.")),
                           key=lambda r: r["call_us"])
        for mine in ("cuda.flash", "triton.flash"):
            ours = next(r for r in rows[-len(named):] if r["kernel"] == mine)
            print(f"  {mine} vs torch's fastest: kernel {fastest_torch['kernel_us'] / ours['kernel_us']:.2f}x "
                  f"({fastest_torch['kernel']}), call {fastest_call['call_us'] / ours['call_us']:.2f}x "
                  f"({fastest_call['kernel']})")
        del q, k, v, named
        torch.cuda.empty_cache()
        if args.json:  # after each shape: a run cut short keeps what it measured
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
