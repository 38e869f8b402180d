"""Check every kernel against the float64 reference, then time them side by side.

A target is where the kernels run: CpuTarget (NumPy arrays, the wall clock, the
kernels of attnkern's registry and its torch.* peers through attnkern.attention)
or CudaTarget (torch CUDA tensors, CUDA events, attnkern's cuda.* kernels beside
torch's SDPA, torch ops and CuPy). Both give rows of the same form."""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np

import attnkern

from .accuracy import HALF, kernel_tolerance, scaled_error
from .ceilings import cuda_sgemm_gflops, sgemm_turn
from .counts import attention_flops
from .inputs import random_qkv, sample_rows
from .machine import blas_threads, cpu_name, thread_params
from .timing import CudaEventClock, WallClock, medians, take_turns

PEERS = ("torch.sdpa", "numpy.naive")  # the kernels every row is compared with, where present
# torch's SDPA with one backend forced (torch.nn.attention.sdpa_kernel), on the GPU: a row's
# speedup_vs_torch.fastest divides by the fastest of these and torch.sdpa (torch's own choice)
SDPA_BACKENDS = {"torch.sdpa[cudnn]": "CUDNN_ATTENTION", "torch.sdpa[flash]": "FLASH_ATTENTION",
                 "torch.sdpa[efficient]": "EFFICIENT_ATTENTION"}
FASTEST = "torch.fastest"


@dataclass
class Candidate:
    name: str
    run: Callable  # (q, k, v, causal, scale) -> out, on the target's arrays


class CpuTarget:
    device = "cpu"
    round_robin = True  # every kernel of a configuration takes turns with the others
    clock = WallClock()

    def __init__(self, threads: int, dtype: str = "float32"):
        self.threads = threads
        self.dtype = dtype  # float16/bfloat16: inputs() rounds them; put() gives the kernels that dtype

    def describe(self) -> str:
        return f"{cpu_name()} ({platform.machine()}), native ISA {attnkern.active_isa()}, {self.threads} threads"

    def _ceiling_op(self) -> tuple[str, float, Callable[[], object]]:
        # bfloat16: torch's bfloat16 matmul (NumPy has none; it uses AVX512_BF16/AMX where present).
        # float16: CPUs without AVX512_FP16 compute it in float32 (torch's float16 matmul is
        # orders of magnitude slower than its float32 one), so the float32 matmul is the ceiling
        if self.dtype == "bfloat16":
            try:
                import torch
            except ImportError:
                pass
            else:
                return (f"torch {self.dtype} matmul 2048^3", *torch_matmul_turn(torch, self.dtype, self.threads))
        flops, call, label = sgemm_turn(2048, self.threads)
        return label, flops, call

    def ceiling(self) -> tuple[str, float]:
        name, flops, call = self._ceiling_op()
        with self.pinned():
            seconds = medians(take_turns({"ceiling": call}, repeat=5))["ceiling"]
        return name, flops / seconds / 1e9

    def ceiling_turn(self) -> tuple[float, Callable[[], object]]:
        """(flops, call) of the ceiling's operation: run() times it in turns with each
        row's kernels, so that a kernel's share of it is a ratio measured side by side."""
        return self._ceiling_op()[1:]

    def pinned(self):
        return blas_threads(self.threads)

    def candidates(self, names, d: int, sweep: bool) -> list[Candidate]:
        out = []
        for name in names:
            if name == "torch.sdpa" and self.dtype in HALF:  # the registry's torch.sdpa takes float32/64
                out.append(Candidate(name, torch_sdpa_half(self.threads)))
                continue
            params = thread_params(name, self.threads)
            out.append(Candidate(name, lambda q, k, v, c, s, name=name, params=params:
                                 attnkern.attention(q, k, v, causal=c, scale=s, kernel=name, **params)))
        return out

    def put(self, x: np.ndarray):
        # half precision: inputs() drew float32 values already rounded to it, so this is exact
        return x.astype(host_dtype(self.dtype)) if self.dtype in HALF else x

    def host(self, x) -> np.ndarray:
        return np.asarray(x)

    def release(self) -> None:
        pass


def host_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a dtype name; bfloat16 is ml_dtypes.bfloat16."""
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError:
            raise SystemExit("bfloat16 on the CPU needs ml_dtypes: pip install 'attnkern[bfloat16]'") from None
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def torch_sdpa_half(threads: int) -> Callable:
    """torch's SDPA on float16/bfloat16 host arrays, in their dtype (the registry's
    torch.sdpa takes float32 and float64): viewed, not copied, as (1, B*H, N, D) tensors
    (torch's fused CPU kernels take 4-D inputs), the output back as a NumPy array."""
    import torch

    from attnkern.hardware import torch_threads

    def as_torch(x):
        x = np.ascontiguousarray(x)
        t = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) if x.dtype.name == "bfloat16" \
            else torch.from_numpy(x)
        return t.reshape(1, -1, *x.shape[-2:])

    def run(q, k, v, causal, scale):
        with torch_threads(threads), torch.no_grad():
            out = torch.nn.functional.scaled_dot_product_attention(as_torch(q), as_torch(k), as_torch(v),
                                                                   is_causal=causal, scale=scale)
        out = out.reshape(*q.shape[:-1], out.shape[-1])
        return out.view(torch.int16).numpy().view(q.dtype) if q.dtype.name == "bfloat16" else out.numpy()

    return run


def torch_matmul_turn(torch, dtype: str, threads: int, n: int = 2048) -> tuple[float, Callable[[], object]]:
    """(flops, call): one torch n^3 matmul in dtype on the CPU with `threads` threads."""
    from attnkern.hardware import torch_threads

    a = torch.randn(n, n, dtype=getattr(torch, dtype))

    def call():
        with torch_threads(threads), torch.no_grad():
            return a @ a

    return 2.0 * n**3, call


class CudaTarget:
    device = "cuda"
    round_robin = False  # one kernel at a time, memory released between: the naive ones take GBs

    def __init__(self, dtype: str = "float32"):
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda needs a CUDA GPU (torch.cuda.is_available() is False)")
        # no kernel here then rounds float32 operands to one-pass TF32 (torch's float32
        # SDPA and cuda.flash's default still use tensor cores, in 3xTF32)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        self.torch = torch
        self.clock = CudaEventClock(torch)
        self.dtype = getattr(torch, dtype)  # inputs are drawn in float32 and rounded to it (inputs())

    def describe(self) -> str:
        return f"{self.torch.cuda.get_device_name()}, torch {self.torch.__version__}, TF32 off"

    def ceiling(self) -> tuple[str, float]:
        return "torch float32 matmul 8192^3", cuda_sgemm_gflops(self.torch)

    def pinned(self):
        import contextlib

        return contextlib.nullcontext()

    def candidates(self, names, d: int, sweep: bool) -> list[Candidate]:
        from attnkern.backends.torch import naive_attention

        torch = self.torch
        peers = {
            "torch.sdpa": lambda q, k, v, c, s: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=c, scale=s),
            "torch.naive": naive_attention,
        }
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def forced(backend):
            def call(q, k, v, c, s):
                with sdpa_kernel(getattr(SDPBackend, backend)):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=c, scale=s)
            return call

        peers.update({name: forced(backend) for name, backend in SDPA_BACKENDS.items()})
        try:
            import cupy
        except ImportError:
            cupy = None
        if cupy is not None:
            def cupy_naive(q, k, v, c, s):  # the naive algorithm in CuPy, on the same memory
                cq, ck, cv = (cupy.asarray(x) for x in (q, k, v))
                sc = cq @ ck.swapaxes(-1, -2) * cq.dtype.type(s)
                if c:
                    n, m = sc.shape[-2:]
                    sc = cupy.where(cupy.triu(cupy.ones((n, m), dtype=bool), 1), cq.dtype.type(-np.inf), sc)
                sc = cupy.exp(sc - sc.max(axis=-1, keepdims=True))
                sc /= sc.sum(axis=-1, keepdims=True)
                return torch.as_tensor(sc @ cv, device=q.device)

            peers["cupy.naive"] = cupy_naive

        def ours(name, **params):
            return lambda q, k, v, c, s: attnkern.attention(q, k, v, causal=c, scale=s, kernel=name,
                                                           check_finite=False, **params)

        out = []
        for name in names:
            if name in peers:
                out.append(Candidate(name, peers[name]))
            elif name.startswith(("cuda.", "triton.")):
                out.append(Candidate(name, ours(name)))
            else:
                print(f"# skipping {name}: not a GPU kernel or peer", file=sys.stderr)
        if sweep:
            from attnkern.backends.cuda import flash_tiles

            if self.dtype == torch.float32:  # the half-precision kernel's tiles are fixed
                out += [Candidate(f"cuda.flash[{bq}x{bk}]", ours("cuda.flash", block_q=bq, block_k=bk))
                        for bq, bk in flash_tiles(d, d, 4)]
        return out

    def put(self, x: np.ndarray):
        return self.torch.from_numpy(np.ascontiguousarray(x, np.float32)).cuda().to(self.dtype)

    def host(self, x) -> np.ndarray:
        return x.float().cpu().numpy()

    def release(self) -> None:
        """Hands cached blocks back to the driver, so one library's cache does not
        starve the next kernel of memory."""
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()
        try:
            from numba import cuda

            cuda.current_context().deallocations.clear()
        except Exception:
            pass
        try:
            import cupy

            cupy.get_default_memory_pool().free_all_blocks()
        except ImportError:
            pass


def causal_modes(value: str) -> tuple[bool, ...]:
    """The causal settings a --causal choice (both, yes, no) measures."""
    return {"both": (False, True), "yes": (True,), "no": (False,)}[value]


@dataclass
class Settings:
    sizes: list[int]
    batch: int = 1
    heads: int = 8
    dim: int = 64
    dtype: str = "float32"
    causal: tuple[bool, ...] = (False, True)
    repeat: int = 5
    passes: int = 2
    warmup: int = 1
    settle: float = 1.0
    calls_per_sample: int = 1
    check_rows: int = 64
    seed: int = 0
    inputs: str = "random"  # or "minilm": q, k, v of all-MiniLM-L6-v2's layers on real text (realistic.py)


_CEILING = " ceiling"  # the ceiling's turn among the kernels' (no kernel name starts with a space)


def run(target, candidates: list[Candidate], cfg: Settings, ceiling_gflops: float | None,
        emit: Callable[[dict], None] = lambda row: None) -> list[dict]:
    """For each size and mask: every candidate's output on sampled query rows against
    the float64 reference, then its median time; emit(row) as each row is ready. A
    target with ceiling_turn() has its ceiling operation timed in the same turns as
    each row's kernels (row["ceiling_gflops"]); otherwise it is ceiling_gflops. None: no
    ceiling (no ceiling_gflops in the rows, no ceiling turns)."""
    rng = np.random.default_rng(cfg.seed)
    turn = target.ceiling_turn() if hasattr(target, "ceiling_turn") and ceiling_gflops is not None else None
    rows_out = []
    configs = [(n, c) for n in cfg.sizes for c in cfg.causal]
    for step, (n, causal) in enumerate(configs, 1):
        print(f"[{step}/{len(configs)}] N={n} causal={causal}: checking and timing {len(candidates)} kernels",
              file=sys.stderr, flush=True)
        host = inputs(cfg, n, rng)
        rows = sample_rows(rng, n, cfg.check_rows)
        scale = 1 / np.sqrt(host[0].shape[-1])
        q, k, v = (target.put(x) for x in host)
        flops = attention_flops(*host[0].shape[:2], n, n, host[0].shape[-1], causal)
        results, ready = {}, {}
        for cand in candidates:
            row = {"n": n, "causal": causal, "kernel": cand.name, "device": target.device, "dtype": cfg.dtype}
            try:
                out = cand.run(q, k, v, causal, scale)
                row["error"] = scaled_error(target.host(out)[..., rows, :], *host, causal=causal, scale=scale,
                                            rows=rows)
                # the bound of attnkern_bench.accuracy for this kernel and dtype (on the CPU, the native
                # kernels' active instruction set decides whether bfloat16 probabilities are rounded)
                row["ok"] = row["error"] <= kernel_tolerance(cand.name.partition("[")[0], cfg.dtype)
                del out
                ready[cand.name] = lambda cand=cand: cand.run(q, k, v, causal, scale)
                if not target.round_robin:
                    row.update(_times(target, {cand.name: ready.pop(cand.name)}, cfg)[cand.name])
            except Exception as exc:  # e.g. out of memory for a naive kernel at large N
                row["failed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
            target.release()
            results[cand.name] = row
        ceiling_now = ceiling_gflops
        if ready:
            if turn is not None:
                ready[_CEILING] = turn[1]
            times = _times(target, ready, cfg)
            if turn is not None:
                ceiling_now = turn[0] / times.pop(_CEILING)["median_s"] / 1e9
            for name, t in times.items():
                results[name].update(t)
        for row in results.values():
            if "median_s" in row:
                row["gflops"] = flops / row["median_s"] / 1e9
                if ceiling_now is not None:
                    row["ceiling_gflops"] = ceiling_now
                for peer in PEERS:
                    if "median_s" in results.get(peer, {}):
                        row[f"speedup_vs_{peer}"] = results[peer]["median_s"] / row["median_s"]
                fastest = fastest_torch(results)
                if fastest is not None:
                    row[f"speedup_vs_{FASTEST}"] = results[fastest]["median_s"] / row["median_s"]
                    row["fastest_torch"] = fastest
            rows_out.append(row)
            emit(row)
    return rows_out


def fastest_torch(results: dict) -> str | None:
    """The name of the fastest torch SDPA row among results ({kernel: row}): torch.sdpa and
    its forced backends (SDPA_BACKENDS) that ran and passed the check; None where no
    backend was forced (the comparison with torch.sdpa alone is speedup_vs_torch.sdpa)."""
    timed = {name: row["median_s"] for name, row in results.items()
             if (name == "torch.sdpa" or name in SDPA_BACKENDS) and "median_s" in row and row.get("ok", True)}
    if not any(name in SDPA_BACKENDS for name in timed):
        return None
    return min(timed, key=timed.get)


def inputs(cfg: Settings, n: int, rng) -> tuple:
    """q, k, v on the host for sequence length n: seeded random (B, H, n, D), or with
    cfg.inputs == "minilm" the (layers, heads, n, 32) tensors captured from all-MiniLM-L6-v2."""
    if cfg.inputs == "minilm":
        from .realistic import capture

        captured = capture(n)
        return tuple(np.ascontiguousarray(captured[x], dtype=cfg.dtype) for x in "qkv")
    if cfg.dtype in HALF:  # float32 values already rounded to the dtype: the reference sees the same inputs
        import torch

        drawn = random_qkv(rng.integers(2**32), (cfg.batch, cfg.heads), n, n, cfg.dim, dtype=np.float32)
        return tuple(torch.from_numpy(x).to(getattr(torch, cfg.dtype)).float().numpy() for x in drawn)
    return random_qkv(rng.integers(2**32), (cfg.batch, cfg.heads), n, n, cfg.dim, dtype=cfg.dtype)


def _times(target, fns: dict, cfg: Settings) -> dict[str, dict]:
    with target.pinned():
        samples = take_turns(fns, repeat=cfg.repeat, passes=cfg.passes, warmup=cfg.warmup, settle=cfg.settle,
                             calls_per_sample=cfg.calls_per_sample, clock=target.clock)
    return {name: {"median_s": med, "samples": len(samples[name])} for name, med in medians(samples).items()}
