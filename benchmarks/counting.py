"""Deterministic cost of a kernel call: instructions executed (and simulated
cache misses) counted by Valgrind's callgrind, instead of wall time.

Run as a script under Valgrind (the asv suite's `bench_counted` and
`tools/gate.py` do it through `count()`):

    valgrind --tool=callgrind --collect-atstart=no --toggle-collect=_operator_call \
        --dump-after=_operator_call python counting.py kernel:shape:causal ...

For every configuration the script builds seeded inputs, makes one untimed call
(imports, Numba's compilation or cache load, lazy initialisation and OpenMP's
thread start all happen there), then makes the counted call through `operator.call` (Python 3.11+), whose C
function `_operator_call` marks the region: nothing else in the process calls it
(a common function would not do: LLVM, inside Numba, calls libc's `qsort`
thousands of times). Callgrind collects only while `_operator_call` is on the stack and writes
one dump when it returns, so dump i holds exactly configuration i's call plus
a constant few hundred instructions of call overhead. The region marker needs
nothing from attnkern, so the same script counts any commit's kernels through
the public API.

Single-threaded on purpose: the kernels' `num_threads=1`, one BLAS and one
Numba thread. Valgrind runs threads one at a time anyway, and instruction
counts of a serial run do not depend on scheduling.

Valgrind emulates the x86 instruction sets up to AVX2 (not AVX-512), and reports
to the program a CPU without AVX-512: the native kernels' dispatch picks their
`avx2` path under Valgrind (NumPy's BLAS and Numba's code generation likewise
see an AVX2 CPU). A change confined to the avx512 path is invisible to these
counts; the timed benchmarks see it.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile

# Events written by callgrind with --cache-sim=yes, in the order of its "events:" line.
EVENTS = ("Ir", "Dr", "Dw", "I1mr", "D1mr", "D1mw", "ILmr", "DLmr", "DLmw")


# Numba compiles for the CPU it sees, and keys its on-disk cache by it; Valgrind
# shows the program a different CPU (no AVX-512) from the real one. Pinning one
# AVX2 target for counting makes the code the same in and out of Valgrind.
NUMBA_TARGET = {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "+avx2,+fma"}


def estimated_cycles(c: dict) -> float:
    """A cycle estimate from counts (the weights CodSpeed and iai-callgrind use):
    an instruction costs 1, a first-level miss that hits the last level 10, a
    last-level miss 100. Not a prediction of real time, a stable proxy for it."""
    l1 = c["I1mr"] + c["D1mr"] + c["D1mw"]
    ll = c["ILmr"] + c["DLmr"] + c["DLmw"]
    return c["Ir"] + 10 * (l1 - ll) + 100 * ll


def config_key(kernel: str, shape: str, causal: bool) -> str:
    return f"{kernel}:{shape}:{int(bool(causal))}"


def valgrind_missing() -> str | None:
    """None if Valgrind can run here, else why not."""
    if shutil.which("valgrind") is None:
        return "valgrind is not installed (make setup installs Debian's valgrind)"
    return None


def count(configs, python=(sys.executable,), env: dict | None = None, cache_sim: bool = True,
          timeout: float = 1800) -> dict[str, dict]:
    """Counts of one call of each (kernel, shape, causal) in `configs`, measured
    in one Valgrind run of this file with the interpreter command `python` (a
    sequence: the executable and its options), whose attnkern is counted.
    Returns {config_key: {event: count}}; a configuration that fails (a kernel
    this commit lacks, or not available here) maps to {"error": message}."""
    keys = [config_key(*c) for c in configs]
    run_env = dict(os.environ if env is None else env)
    # one thread everywhere; a fixed hash seed so dict and set orders repeat
    run_env.update(ATTNKERN_NO_TUNED="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   NUMBA_NUM_THREADS="1", PYTHONHASHSEED="0", **NUMBA_TARGET)
    with tempfile.TemporaryDirectory(prefix="attnkern-count-") as tmp:
        out = os.path.join(tmp, "callgrind.out")
        status = os.path.join(tmp, "status.txt")
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", "--collect-atstart=no",
               "--toggle-collect=_operator_call", "--dump-after=_operator_call", "--dump-instr=no", "--compress-strings=no",
               *(["--cache-sim=yes"] if cache_sim else []),
               *python, os.path.abspath(__file__), "--status", status, *keys]
        # The same script natively first: it fills Numba's on-disk cache for the
        # pinned target, so the run under Valgrind loads machine code instead of
        # compiling it (minutes under Valgrind).
        warm = subprocess.run([*python, os.path.abspath(__file__), "--status", status, *keys], env=run_env,
                              capture_output=True, text=True, timeout=timeout)
        if warm.returncode != 0:
            raise RuntimeError(f"counting script failed natively ({warm.returncode}):\n{warm.stderr[-3000:]}")
        proc = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"valgrind run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(status) as f:
            outcomes = [line.rstrip("\n").split("\t", 1) for line in f]
        dumps = sorted(glob.glob(out + ".*"), key=lambda p: int(p.rsplit(".", 1)[1]))
        counted = [k for k, s in outcomes if s == "ok"]
        if len(dumps) != len(counted):
            raise RuntimeError(f"{len(dumps)} callgrind dumps for {len(counted)} counted calls: "
                               "something else called operator.call")
        results = {k: {"error": s} for k, s in outcomes if s != "ok"}
        for key, path in zip(counted, dumps):
            results[key] = _read_dump(path)
    return results


def _read_dump(path: str) -> dict:
    events, totals = None, None
    with open(path) as f:
        for line in f:
            if line.startswith("events:"):
                events = line.split()[1:]
            elif line.startswith("summary:") or line.startswith("totals:"):
                totals = [int(x) for x in line.split()[1:]]
    if events is None or totals is None:
        raise RuntimeError(f"no totals in callgrind dump {path}")
    counts = dict.fromkeys(EVENTS, 0)
    counts.update(zip(events, totals))
    return counts


# ---------------------------------------------------------------- under Valgrind
def _run(keys, status_path):
    import operator

    import numpy as np

    import attnkern

    with open(status_path, "w") as status:
        for key in keys:
            kernel, shape, causal = key.split(":")
            b, h, n, d = (int(x) for x in shape.split("x"))
            causal = bool(int(causal))
            if kernel not in attnkern.kernels():
                status.write(f"{key}\t{kernel} does not exist in this commit\n")
                continue
            info = attnkern.kernel_info(kernel)
            if not info["available"]:
                status.write(f"{key}\t{kernel} is not available here: {info['reason']}\n")
                continue
            params = {"num_threads": 1} if "num_threads" in info["params"] else {}
            rng = np.random.default_rng(0)
            q, k, v = (rng.standard_normal((b, h, n, d)).astype(np.float32) for _ in range(3))
            attnkern.attention(q, k, v, causal=causal, kernel=kernel, **params)  # warm-up, not counted

            operator.call(attnkern.attention, q, k, v, causal=causal, kernel=kernel, **params)  # counted
            status.write(f"{key}\tok\n")
            status.flush()


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "--status":
        sys.exit("usage (under valgrind, see the module docstring): counting.py --status FILE kernel:shape:causal ...")
    _run(sys.argv[3:], sys.argv[2])
