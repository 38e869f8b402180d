"""The counted cost of a GPU kernel call: SASS instructions executed and DRAM
bytes moved by one call, read from the GPU's hardware counters through CUPTI's
profiling API, with Nsight Compute's command line (`ncu`) as the front end.

    ncu --profile-from-start off --csv --page raw --metrics smsp__sass_inst_executed.sum,... \\
        python gpu_counting.py --status FILE kernel:dtype:shape:causal ...

For every configuration the script builds seeded torch CUDA inputs, makes one
untimed call (NVRTC and Triton compilation, numba-cuda's launch caches, torch's
allocator), synchronises, then opens the profiled range
(`torch.cuda.profiler.start`, i.e. cudaProfilerStart: ncu profiles only inside
it), launches a delimiter (torch's `spin_kernel`, from `torch.cuda._sleep`),
makes the counted call, synchronises and closes the range. Every kernel ncu
reports after a delimiter, up to the next one, belongs to that configuration's
call (cuda.naive launches three kernels, the others one); their counts add up.

ncu replays each kernel as often as its metrics need, restoring the memory it
writes, with the caches flushed before each pass (`--cache-control all`) and the
clocks at base (`--clock-control base`): DRAM bytes are those of a cold L2, and
the same kernel on the same inputs gives the same SASS instruction count (what
varies run to run is measured: docs/regression-gate.md#the-gpu-gate). The
metrics are per call, independent of the clock and of other processes; like
Valgrind's counts they are no time: a slower instruction mix with the same
count shows only in the timed signal.

Where the driver restricts the counters to administrators
(NVreg_RestrictProfilingOnlyAdminUsers=1), ncu prints ERR_NVGPUCTRPERM: count()
then raises CountersRestricted, and the gate goes on with the timed signal alone.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import subprocess
import sys
import tempfile

METRICS = {"sass": "smsp__sass_inst_executed.sum", "dram_read": "dram__bytes_read.sum",
           "dram_write": "dram__bytes_write.sum", "gpu_ns": "gpu__time_duration.sum"}
DELIMITER = "spin_kernel"  # the kernel of torch.cuda._sleep


class CountersRestricted(RuntimeError):
    """The GPU's performance counters are not open to this user."""


def ncu_path() -> str | None:
    return shutil.which("ncu") or next((p for p in ("/usr/local/cuda/bin/ncu",) if os.path.exists(p)), None)


def ncu_missing() -> str | None:
    """None if Nsight Compute's ncu can be run here, else why not."""
    if ncu_path() is None:
        return "Nsight Compute's ncu is not installed (it comes with the CUDA toolkit); pass --no-count to time only"
    return None


def gpu_key(kernel: str, dtype: str, shape: str, causal: bool) -> str:
    return f"{kernel}:{dtype}:{shape}:{int(bool(causal))}"


def count(keys, python=(sys.executable,), env: dict | None = None, timeout: float = 900) -> dict[str, dict]:
    """Counts of one call of each configuration in `keys` (kernel:dtype:shape:causal),
    in one ncu run of this file with the interpreter command `python`. Returns
    {key: {"sass": .., "dram_read": .., "dram_write": .., "gpu_ns": .., "kernels": n}};
    a configuration that cannot run maps to {"error": message}."""
    run_env = dict(os.environ if env is None else env)
    run_env.update(ATTNKERN_NO_TUNED="1", PYTHONHASHSEED="0")
    with tempfile.TemporaryDirectory(prefix="attnkern-gpucount-") as tmp:
        status = os.path.join(tmp, "status.txt")
        cmd = [ncu_path(), "--profile-from-start", "off", "--csv", "--page", "raw",
               "--metrics", ",".join(METRICS.values()), *python, os.path.abspath(__file__), "--status", status, *keys]
        proc = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=timeout)
        text = proc.stdout + proc.stderr
        if "ERR_NVGPUCTRPERM" in text:
            line = next(x for x in text.splitlines() if "ERR_NVGPUCTRPERM" in x)
            raise CountersRestricted(f"the GPU's counters are restricted to administrators: {line.strip()}")
        if proc.returncode != 0 or not os.path.exists(status):
            raise RuntimeError(f"ncu run failed ({proc.returncode}):\n{text[-3000:]}")
        with open(status) as f:
            outcomes = [line.rstrip("\n").split("\t", 1) for line in f]
        return attribute(proc.stdout, outcomes)


def parse_raw(stdout: str) -> list[dict]:
    """ncu's `--csv --page raw` output: one dict per profiled kernel, in launch
    order (a header row, a units row, then a row per kernel; numbers have
    thousands separators). Lines before the header (ncu's ==PROF== notes, the
    program's own output) are skipped."""
    lines = stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        return []
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, data = rows[0], [r for r in rows[2:] if len(r) == len(rows[0])]
    return [dict(zip(header, r)) for r in data]


def attribute(stdout: str, outcomes) -> dict[str, dict]:
    """Each configuration whose status is "ok" gets the sum of the kernels
    between its delimiter and the next."""
    kernels = parse_raw(stdout)
    groups, current = [], None
    for k in kernels:
        if DELIMITER in k.get("Kernel Name", ""):
            current = []
            groups.append(current)
        elif current is not None:
            current.append(k)
    counted = [key for key, s in outcomes if s == "ok"]
    if len(groups) != len(counted):
        raise RuntimeError(f"ncu reported {len(groups)} delimited calls for {len(counted)} counted configurations")
    results = {key: {"error": s} for key, s in outcomes if s != "ok"}
    for key, group in zip(counted, groups):
        if not group:
            results[key] = {"error": "no kernel was profiled in the call"}
            continue
        totals = {name: sum(float(k[metric].replace(",", "")) for k in group) for name, metric in METRICS.items()}
        totals["kernels"] = len(group)
        totals["names"] = sorted({k.get("Kernel Name", "")[:80] for k in group})
        results[key] = totals
    return results


# ---------------------------------------------------------------- under ncu
def _run(keys, status_path):
    import numpy as np
    import torch
    import turns  # beside this file

    import attnkern

    site = os.environ.get("ATTNKERN_GATE_SITE")
    if site and not os.path.realpath(attnkern.__file__).startswith(os.path.realpath(site)):
        sys.exit(f"gpu_counting.py imported {attnkern.__file__}, not the build in {site}")
    with open(status_path, "w") as status:
        for key in keys:
            kernel, dtype, shape, causal = key.split(":")
            if kernel not in attnkern.kernels():
                status.write(f"{key}\t{kernel} does not exist in this commit\n")
                continue
            info = attnkern.kernel_info(kernel)
            if not info["available"]:
                status.write(f"{key}\t{kernel} is not available here: {info['reason']}\n")
                continue
            dims = tuple(int(x) for x in shape.split("x"))
            q, k, v = turns._cuda_inputs(np.random.default_rng(0), dims, dtype)  # the timed signal's inputs
            try:
                attnkern.attention(q, k, v, causal=bool(int(causal)), kernel=kernel, check_finite=False)  # warm-up
            except (ValueError, TypeError, RuntimeError) as exc:
                status.write(f"{key}\t{type(exc).__name__}: {exc}\n")
                continue
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            torch.cuda._sleep(1)  # the delimiter
            attnkern.attention(q, k, v, causal=bool(int(causal)), kernel=kernel, check_finite=False)  # counted
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            status.write(f"{key}\tok\n")
            status.flush()


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] != "--status":
        sys.exit("usage (under ncu, see the module docstring): gpu_counting.py --status FILE kernel:dtype:shape:causal ...")
    _run(sys.argv[3:], sys.argv[2])
