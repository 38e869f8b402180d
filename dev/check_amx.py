"""Checks and times native.flash's AMX path (bfloat16 on AMX tiles) on a machine that has AMX.

    .venv/bin/python dev/check_amx.py [--sizes 1024 2048 4096] [--threads 2] [--repeat 7]

1. Says whether the amx ISA runs here, and if not why (CPU, OS tile state, Linux's
   tile data permission); exits 2 if it does not.
2. For each N and mask, on (1, 8, N, 64) bfloat16 inputs (seeded normal values rounded
   to bfloat16): native.flash with ATTNKERN_ISA=amx against the float64 reference on
   sampled query rows (all heads, all keys, the first and last row included); the
   scaled error max|out - ref| / (max(1, max|v|) kappa) must be at most 4u = 2^-6, the
   bound tests/test_half.py uses for bfloat16. Also the same for avx512bf16 (vdpbf16ps)
   where the CPU has it, for comparison.
3. Times, in turns (round-robin passes, one untimed call each turn, medians): native.flash
   on amx, on avx512bf16, and torch's bfloat16 scaled_dot_product_attention on
   (1, 8, N, 64) tensors, all with --threads threads. Prints a table with GFLOP/s
   (4 B H N^2 D per forward, half with the causal mask) and the speed-up over torch;
   the target is amx >= 1.2x torch at N >= 1024.

--isa avx512bf16 runs the same checks on another ISA (to try the script on a machine without AMX).
--emulate, on any CPU with AVX-512 BF16 and a C compiler: compiles attn_amx.c with
-DATTN_AMX_EMULATE (the tile instructions replaced by portable C) and checks the AMX
kernel's layouts on odd shapes (some with a negative scale) against the float64
reference, the bound above, and the vdpbf16ps kernel.

Exit status: 0 all checks passed, 1 an output outside the bound, 2 AMX not usable here.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np


def cpu_model() -> str:
    import attnkern

    return attnkern.machine()["cpu"]


def emulate() -> int:
    """Builds attn_amx.c with emulated tiles and checks it; see the module docstring."""
    import ctypes
    import itertools
    import subprocess
    import tempfile
    from pathlib import Path

    import ml_dtypes

    import attnkern
    from attnkern_bench.accuracy import kernel_tolerance, scaled_error

    src = Path(__file__).resolve().parents[1] / "attnkern" / "backends" / "native" / "attn_amx.c"
    cc = os.environ.get("CC", "cc")
    flags = ["-O2", "-shared", "-fPIC", "-fopenmp", "-mavx512f", "-mavx2", "-mfma", "-mf16c", "-mavx512bw",
             "-mavx512vl", "-mavx512bf16", "-DATTN_AMX_EMULATE"]
    with tempfile.TemporaryDirectory() as tmp:
        lib_path = Path(tmp) / "attn_amx_emulated.so"
        subprocess.run([cc, *flags, str(src), "-o", str(lib_path), "-lm"], check=True)
        lib = ctypes.CDLL(str(lib_path))

    class Problem(ctypes.Structure):  # attn_problem of attn.h
        _fields_ = [("batch", ctypes.c_int64), ("nq", ctypes.c_int64), ("nk", ctypes.c_int64),
                    ("d", ctypes.c_int64), ("dv", ctypes.c_int64), ("causal", ctypes.c_int),
                    ("scale", ctypes.c_double), ("block_q", ctypes.c_int), ("block_k", ctypes.c_int),
                    ("num_threads", ctypes.c_int)]

    bf16 = np.dtype(ml_dtypes.bfloat16)
    bound = kernel_tolerance("native.flash", "bfloat16", isa="amx")  # attnkern_bench.accuracy's
    rng = np.random.default_rng(0)
    worst = 0.0
    # odd sizes: partial panels and tiles, odd d (a padded pair), dv past one panel, tall blocks
    shapes = [(70, 45, 33, 40, 16, 40), (37, 37, 64, 64, 8, 16), (5, 200, 7, 3, 256, 64),
              (130, 130, 64, 64, 64, 64), (300, 257, 64, 64, 256, 256), (100, 333, 80, 96, 48, 100)]
    print(f"{'nq':>4} {'nk':>4} {'d':>3} {'dv':>3} {'bq':>4} {'bk':>4} {'causal':>6} {'error':>9} {'vs vdpbf16ps':>13}")
    for (nq, nk, d, dv, bq, bk), causal in itertools.product(shapes, (False, True)):
        q, k = (rng.standard_normal((2, n, d)).astype(np.float32).astype(bf16) for n in (nq, nk))
        v = rng.standard_normal((2, nk, dv)).astype(np.float32).astype(bf16)
        out, lse = np.zeros((2, nq, dv), bf16), np.zeros((2, nq), bf16)
        scale = (-0.7 if nq % 2 else 1) / np.sqrt(d)  # a negative scale on the odd nq
        p = Problem(2, nq, nk, d, dv, int(causal), scale, bq, bk, 2)
        ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
        if lib.attn_flash_bf16amx_amx(ctypes.byref(p), ptr(q), ptr(k), ptr(v), ptr(out), ptr(lse)) != 0:
            print("the emulated kernel returned an error")
            return 1
        qf, kf, vf = (x.astype(np.float32) for x in (q, k, v))
        err = scaled_error(out.astype(np.float32), qf, kf, vf, causal=causal, scale=scale)
        worst = max(worst, err)
        versus = "-"
        if "avx512bf16" in attnkern.supported_isas():
            os.environ["ATTNKERN_ISA"] = "avx512bf16"
            try:
                dot = attnkern.attention(q, k, v, causal=causal, scale=scale, kernel="native.flash", block_q=bq,
                                         block_k=bk)
            finally:
                os.environ.pop("ATTNKERN_ISA", None)
            versus = f"{np.abs(out.astype(np.float64) - dot.astype(np.float64)).max():.1e}"
        print(f"{nq:>4} {nk:>4} {d:>3} {dv:>3} {bq:>4} {bk:>4} {causal!s:>6} {err:>9.1e} {versus:>13}")
    print(f"worst scaled error {worst:.2e}, bound {bound:.4g}")
    return 0 if worst <= bound else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=7, help="timed calls per turn")
    ap.add_argument("--passes", type=int, default=3, help="round-robin passes")
    ap.add_argument("--check-rows", type=int, default=64)
    ap.add_argument("--block-q", type=int, default=None)
    ap.add_argument("--block-k", type=int, default=None)
    ap.add_argument("--isa", default="amx", help="the ISA under test (another one only to try this script)")
    ap.add_argument("--emulate", action="store_true", help="check attn_amx.c's layouts with emulated tiles")
    args = ap.parse_args(argv)
    if args.emulate:
        return emulate()

    import ml_dtypes

    import attnkern
    from attnkern import hardware
    from attnkern_bench.accuracy import kernel_tolerance, scaled_error

    os.environ.pop("ATTNKERN_ISA", None)
    print(f"# {cpu_model()} ({platform.machine()}), {os.cpu_count()} CPUs, {args.threads} threads")
    print(f"# ISAs here: {', '.join(attnkern.supported_isas())}; best: {attnkern.active_isa()}")
    if not hardware.isa_supported(args.isa):
        print(f"{args.isa} cannot run here: {hardware.isa_reason(args.isa)}")
        return 2
    isas = [args.isa] + [i for i in ("avx512bf16",) if i != args.isa and hardware.isa_supported(i)]

    try:
        import torch
    except ImportError:
        torch = None
        print("# torch is not installed: no torch SDPA column")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    bound = kernel_tolerance("native.flash", "bfloat16", isa="amx")  # attnkern_bench.accuracy's
    params = {"num_threads": args.threads}
    if args.block_q:
        params["block_q"] = args.block_q
    if args.block_k:
        params["block_k"] = args.block_k
    rng = np.random.default_rng(0)
    failed = False
    rows_out = []
    for n in args.sizes:
        for causal in (False, True):
            shape = (1, args.heads, n, args.dim)
            q32, k32, v32 = (rng.standard_normal(shape).astype(np.float32).astype(bf16) for _ in range(3))
            q, k, v = q32, k32, v32  # bfloat16 arrays
            qf, kf, vf = (x.astype(np.float32) for x in (q, k, v))  # the same values, for the reference
            rows = np.unique(np.concatenate([[0, n - 1], rng.choice(n, size=min(n, args.check_rows), replace=False)]))

            def native(isa):
                def run():
                    os.environ["ATTNKERN_ISA"] = isa
                    try:
                        return attnkern.attention(q, k, v, causal=causal, kernel="native.flash", check_finite=False,
                                                  **params)
                    finally:
                        os.environ.pop("ATTNKERN_ISA", None)
                return run

            fns = {f"native.flash[{isa}]": native(isa) for isa in isas}
            errors = {}
            for name, fn in fns.items():
                out = fn().astype(np.float32)
                errors[name] = scaled_error(out[..., rows, :], qf, kf, vf, causal=causal, rows=rows)
                if not errors[name] <= bound:
                    failed = True
            if torch is not None:
                tq, tk, tv = (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) for x in (q, k, v))

                def sdpa():
                    with torch.no_grad():
                        return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

                torch.set_num_threads(args.threads)
                out = sdpa().float().numpy()
                errors["torch.sdpa"] = scaled_error(out[..., rows, :], qf, kf, vf, causal=causal, rows=rows)
                fns["torch.sdpa"] = sdpa
            samples = {name: [] for name in fns}
            for _ in range(args.passes):
                for name, fn in fns.items():
                    time.sleep(0.2)
                    fn()
                    for _ in range(args.repeat):
                        t0 = time.perf_counter()
                        fn()
                        samples[name].append(time.perf_counter() - t0)
            flops = 4 * args.heads * n * n * args.dim / (2 if causal else 1)
            med = {name: statistics.median(ts) for name, ts in samples.items()}
            for name in fns:
                rows_out.append((n, causal, name, med[name], flops / med[name] / 1e9,
                                 med["torch.sdpa"] / med[name] if "torch.sdpa" in med else float("nan"),
                                 errors[name]))
            print(f"[N={n} causal={causal}] done", file=sys.stderr, flush=True)

    print(f"# (1, {args.heads}, N, {args.dim}) bfloat16; medians of {args.passes} x {args.repeat} calls; "
          f"error bound {bound:.4g}; target: native.flash[{args.isa}] >= 1.2x torch.sdpa at N >= 1024")
    print(f"{'N':>6} {'causal':>6} {'kernel':<24} {'median ms':>10} {'GFLOP/s':>9} {'vs torch':>9} {'error':>9}")
    for n, causal, name, t, gf, sp, err in rows_out:
        flag = "" if name == "torch.sdpa" or err <= bound else "  FAIL"
        print(f"{n:>6} {causal!s:>6} {name:<24} {t * 1e3:>10.3f} {gf:>9.1f} {sp:>8.2f}x {err:>9.1e}{flag}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
