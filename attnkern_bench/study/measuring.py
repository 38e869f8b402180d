"""The study's measuring: one row (forward, backward, memory) timed in this
process (cuda) or in a fresh Python process (cpu, so that its resident set says
what that configuration took), every row of the grid (run_study), and the
smallest configuration out of memory, measured and predicted."""

from __future__ import annotations

import gc
import json
import math
import resource
import signal
import subprocess
import sys
from typing import Callable

from ..counts import attention_flops
from ..timing import CudaEventClock, WallClock, medians
from .model import MIB, Settings, backward_flops, has_backward, settings_account

# ---------------------------------------------------------------- measuring one row


class RssMeter:
    """This process's resident set (Linux /proc/self): in use, and the peak since
    the last reset (VmHWM, reset to the current resident set by clear_refs 5)."""

    def in_use(self) -> int:
        return proc_status("VmRSS")

    def reset_peak(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def peak(self) -> int:
        return proc_status("VmHWM")


class CudaMeter:
    """Bytes of live tensors of torch's CUDA allocator, and their peak since the
    last reset."""

    def __init__(self, torch):
        self.torch = torch

    def in_use(self) -> int:
        self.torch.cuda.synchronize()
        return self.torch.cuda.memory_allocated()

    def reset_peak(self) -> None:
        self.torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        self.torch.cuda.synchronize()
        return self.torch.cuda.max_memory_allocated()


def proc_status(key: str) -> int:
    """A size from /proc/self/status (VmRSS, VmHWM, VmSize...), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def attention_fn(kernel: str, device: str, threads: int) -> Callable:
    """(q, k, v, causal) -> out for a study kernel, on torch tensors, differentiable."""
    import torch

    if kernel == "torch.naive":
        from attnkern.backends.torch import naive_attention

        return lambda q, k, v, c: naive_attention(q, k, v, c, q.shape[-1] ** -0.5)
    if kernel == "torch.sdpa":
        return lambda q, k, v, c: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=c,
                                                                                  scale=q.shape[-1] ** -0.5)
    import attnkern

    from ..machine import thread_params

    params = thread_params(kernel, threads) if device == "cpu" else {}
    return lambda q, k, v, c: attnkern.attention(q, k, v, causal=c, scale=q.shape[-1] ** -0.5, kernel=kernel,
                                                 check_finite=False, **params)


def is_oom(exc: BaseException) -> bool:
    """Whether an exception says that memory ran out (torch's CPU and CUDA
    allocators, NumPy, attnkern's native and Numba's CUDA allocations)."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc).lower()
    return any(s in text for s in ("out of memory", "can't allocate memory", "cannot allocate memory",
                                   "cuda_error_out_of_memory"))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def measure(spec: dict, meter, clock, sync: Callable[[], None] = lambda: None,
            after_warmup: Callable[[], None] = lambda: None,
            before_timing: Callable[[], None] = lambda: None) -> dict:
    """Memory and times of one (kernel, configuration) on spec's device: a small
    forward and backward, after_warmup(), the measured forward and backward,
    before_timing(), the timed ones. {status, error, memory_*, forward_ms,
    backward_ms, grad_fn}; never raises: a failure is the row's status."""
    got: dict = {}
    step = {"now": "warm-up"}
    try:
        _measure(spec, meter, clock, sync, after_warmup, before_timing, got, step)
        return {"status": "ok", "error": "", **got}
    except Exception as exc:  # noqa: BLE001 - every failure is a row's result
        where = " (in the timed iterations)" if step["now"] == "time" else ""
        return {**got, "status": "oom" if is_oom(exc) else "error", "error": _first_line(exc) + where}


def _measure(spec, meter, clock, sync, after_warmup, before_timing, got: dict, step: dict) -> None:
    """Fills `got` as results come: the memory ones stay if the timed iterations fail."""
    import torch

    b, h, n, d, causal, device = spec["batch"], spec["heads"], spec["seq"], spec["dim"], spec["causal"], spec["device"]
    fn = attention_fn(spec["kernel"], device, spec["threads"])

    dtype, with_grad = getattr(torch, spec.get("dtype", "float32")), spec.get("backward", True)

    def inputs(rows):
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(b, h, rows, d, device=device, generator=gen).to(dtype).requires_grad_(with_grad)
                   for _ in range(3))
        return q, k, v, torch.randn(b, h, rows, d, device=device, generator=gen).to(dtype)

    def run_backward(out, dout):
        if with_grad:
            out.backward(dout)

    q, k, v, dout = inputs(min(n, 64))  # load code, start threads, make library handles and workspaces
    run_backward(fn(q, k, v, causal), dout)
    del q, k, v, dout
    sync()
    after_warmup()
    step["now"] = "memory"
    base = meter.in_use()
    q, k, v, dout = inputs(n)
    meter.reset_peak()
    out = fn(q, k, v, causal)
    before = meter.in_use() - base
    grad_fn = out.grad_fn.name() if out.grad_fn is not None else ""
    run_backward(out, dout)
    peak = meter.peak() - base
    del out
    got.update(memory_before_backward_mib=before / MIB, peak_memory_mib=peak / MIB, grad_fn=grad_fn)
    step["now"] = "time"
    before_timing()
    state = {}

    def forward():
        state["out"] = fn(q, k, v, causal)

    def backward():
        run_backward(state.pop("out"), dout)

    times: dict[str, list[float]] = {"forward": [], "backward": []}
    if hasattr(clock, "busy") and spec["iters"]:  # a GPU's clocks up from idle first (timing.CudaEventClock)
        clock.busy(lambda: (forward(), backward()))
    for i in range(spec["warmup"] + spec["iters"]):
        q.grad = k.grad = v.grad = None
        tf, tb = clock.seconds(forward), clock.seconds(backward)
        if i >= spec["warmup"]:
            times["forward"].append(tf)
            times["backward"].append(tb)
    med = medians(times) if spec["iters"] else {"forward": math.nan, "backward": math.nan}
    got.update(forward_ms=med["forward"] * 1e3, backward_ms=med["backward"] * 1e3 if with_grad else None)


def _cpu_main() -> None:
    """A CPU row's process (python -c, spec as JSON in argv[1]): pins torch's
    threads, has malloc map large blocks on their own, caps the address space
    after the small warm-up (at what it spans then plus the cap), measures the
    memory, then (without a cap) gives malloc glibc's steady-state threshold back
    for the timed iterations; prints the result as JSON."""
    import torch

    spec = json.loads(sys.argv[1])
    cap = spec.pop("cap_bytes", None)
    torch.set_num_threads(spec["threads"])
    _mallopt(_M_MMAP_THRESHOLD, 128 * 1024)

    def limit():
        if cap:
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            soft = proc_status("VmSize") + cap
            resource.setrlimit(resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard),
                                                    hard))

    def before_timing():
        if not cap:
            _mallopt(_M_MMAP_THRESHOLD, 32 * 2**20)
            _mallopt(_M_TRIM_THRESHOLD, 64 * 2**20)

    print(json.dumps(measure(spec, RssMeter(), WallClock(), after_warmup=limit, before_timing=before_timing)))


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _mallopt(param: int, value: int) -> None:
    """glibc's mallopt. With M_MMAP_THRESHOLD 128 KiB every block of 128 KiB or
    more gets a mapping of its own, returned at free, and glibc stops raising the
    threshold after frees (by default it does, up to 32 MiB, and then keeps freed
    blocks in its heap, resident): the resident set follows the live tensors, as
    memory_allocated does on the GPU, and under a cap so does the address space.
    32 MiB (trim 64 MiB) is where glibc's own threshold goes once large blocks
    have been freed: the timings run with malloc as a long loop has it."""
    import ctypes

    try:
        ctypes.CDLL(None).mallopt(param, value)
    except (OSError, AttributeError):  # not glibc: freed blocks may stay resident
        pass


def measure_in_fresh_process(spec: dict, cap_bytes: int | None = None) -> dict:
    """measure() of a CPU row in a new Python process (_cpu_main)."""
    code = "from attnkern_bench.study.measuring import _cpu_main; _cpu_main()"
    proc = subprocess.run([sys.executable, "-c", code, json.dumps({**spec, "cap_bytes": cap_bytes})],
                          capture_output=True, text=True, check=False)
    if proc.returncode == 0 and proc.stdout.strip():
        return json.loads(proc.stdout.strip().splitlines()[-1])
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        killed = proc.returncode == -signal.SIGKILL
        return {"status": "oom" if killed else "error",
                "error": f"the process was killed by {name}" + (" (the kernel's OOM killer?)" if killed else "")}
    lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
    return {"status": "oom" if is_oom(RuntimeError(lines[-1])) else "error", "error": lines[-1][:200]}


# ---------------------------------------------------------------- the study


def run_study(cfg: Settings, emit: Callable[[dict], None] = lambda row: None) -> list[dict]:
    """Every (N ascending, d, kernel) of the grid: a row of plain values each,
    emit(row) as each is ready; progress on stderr."""
    cuda = cfg.device == "cuda"
    if cuda:
        import torch

        from ..harness import CudaTarget

        target = CudaTarget()
        meter, clock, sync = CudaMeter(torch), CudaEventClock(torch), torch.cuda.synchronize
        if cfg.memory_cap_gib is not None:
            total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.memory_cap_gib * 2**30 / total))
    cap = int(cfg.memory_cap_gib * 2**30) if cfg.memory_cap_gib is not None and not cuda else None
    grid = [(n, d, kernel) for n in sorted(cfg.seqs) for d in cfg.dims for kernel in cfg.kernels]
    rows: list[dict] = []
    ooms: dict[tuple[str, int], int] = {}  # (kernel, d) -> smallest N out of memory
    for step, (n, d, kernel) in enumerate(grid, 1):
        print(f"[{step}/{len(grid)}] N={n} d={d} {kernel}", file=sys.stderr, flush=True)
        spec = {"kernel": kernel, "batch": cfg.batch, "heads": cfg.heads, "seq": n, "dim": d, "causal": cfg.causal,
                "device": cfg.device, "warmup": cfg.warmup, "iters": cfg.iters, "threads": cfg.threads,
                "dtype": cfg.dtype, "backward": has_backward(kernel, cfg.dtype)}
        row = {"batch": cfg.batch, "heads": cfg.heads, "seq_len": n, "d_model": d, "kernel": kernel,
               "causal": cfg.causal, "device": cfg.device, "dtype": cfg.dtype}
        first_oom = ooms.get((kernel, d))
        if cfg.skip_larger and first_oom is not None and n > first_oom:
            result = {"status": "skipped", "error": f"larger than an OOM configuration (N={first_oom}, d={d})"}
        elif cuda:
            result = measure(spec, meter, clock, sync)
            gc.collect()
            target.release()
        else:
            result = measure_in_fresh_process(spec, cap)
        row.update(result)
        if row["status"] == "ok" and not spec["backward"]:
            row["error"] = f"forward only: no {cfg.dtype} backward"
        if row["status"] == "oom":
            ooms[(kernel, d)] = min(n, ooms.get((kernel, d), n))
        if row["status"] == "ok" and spec["backward"]:
            flops = attention_flops(cfg.batch, cfg.heads, n, n, d, cfg.causal)
            flops += backward_flops(cfg.batch, cfg.heads, n, n, d, cfg.causal)
            row["gflops"] = flops / ((row["forward_ms"] + row["backward_ms"]) / 1e3) / 1e9
        acc = settings_account(cfg, kernel, n, d)
        row["predicted_before_backward_mib"] = acc.before_backward / MIB
        row["predicted_forward_peak_mib"] = acc.peak("forward") / MIB
        row["predicted_peak_mib"] = (acc.peak() if spec["backward"] else acc.peak("forward")) / MIB
        if row.get("peak_memory_mib"):
            row["predicted_over_measured"] = row["predicted_peak_mib"] / row["peak_memory_mib"]
        rows.append(row)
        emit(row)
    return rows


def smallest_oom(rows: list[dict]) -> dict[str, dict | None]:
    """Per kernel, the row of the smallest configuration (N, then d) out of memory, or None."""
    out: dict[str, dict | None] = {}
    for row in rows:
        out.setdefault(row["kernel"], None)
        if row["status"] == "oom":
            best = out[row["kernel"]]
            if best is None or (row["seq_len"], row["d_model"]) < (best["seq_len"], best["d_model"]):
                out[row["kernel"]] = row
    return out


def capacity_bytes(cfg: Settings) -> int | None:
    """The memory a configuration may take: the cap, else the GPU's (None on a CPU without a cap)."""
    if cfg.memory_cap_gib is not None:
        return int(cfg.memory_cap_gib * 2**30)
    if cfg.device == "cuda":
        import torch

        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return None


def predicted_smallest_oom(cfg: Settings, capacity: int) -> dict[str, tuple[int, int] | None]:
    """Per kernel, the smallest (N, d) of the grid whose predicted peak exceeds capacity."""
    out = {}
    for kernel in cfg.kernels:
        over = [(n, d) for n in sorted(cfg.seqs) for d in sorted(cfg.dims)
                if settings_account(cfg, kernel, n, d).peak() > capacity]
        out[kernel] = over[0] if over else None
    return out
