"""Tuned parameters, cached per machine: attnkern.tune writes them, attention()
reads them in place of a kernel's built-in defaults when one matches the call.

The cache is one JSON file, tuned.json, in the user cache directory
($ATTNKERN_CACHE_DIR, else $XDG_CACHE_HOME/attnkern or ~/.cache/attnkern on Linux,
~/Library/Caches/attnkern on macOS, %LOCALAPPDATA%/attnkern/Cache on Windows).
An entry is keyed by machine (CPU model, instruction set, CPUs available; the GPU
for cuda.* kernels), attnkern version, kernel, dtype, causal and a shape bucket
(Nq and Nk rounded up to a power of two, D and Dv exact). ATTNKERN_NO_TUNED=1
turns lookups off. A file that cannot be read or is not ours is ignored with a
warning, never an error."""

from __future__ import annotations

import functools
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

from ._registry import cpu_count
from ._version import __version__
from .backends.native import active_isa

FORMAT = 1
FILE = "tuned.json"


def cache_dir() -> Path:
    env = os.environ
    return _cache_dir(env.get("ATTNKERN_CACHE_DIR"), env.get("XDG_CACHE_HOME"), env.get("LOCALAPPDATA"),
                      env.get("HOME"))


@functools.lru_cache(maxsize=8)
def _cache_dir(override, xdg, localappdata, home) -> Path:
    # keyed by the variables it reads: attention() looks the cache up on every call, and
    # building the path costs more than the stat that follows
    if override:
        return Path(override)
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "attnkern"
    if sys.platform == "win32":
        return Path(localappdata or Path.home()) / "attnkern" / "Cache"
    return Path(xdg or Path.home() / ".cache") / "attnkern"


@functools.lru_cache(maxsize=8)
def _cache_file(directory: Path) -> str:
    return str(directory / FILE)


def enabled() -> bool:
    return os.environ.get("ATTNKERN_NO_TUNED", "") in ("", "0")


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine(device: str = "cpu") -> dict:
    """What a tuned result depends on besides the kernel and the problem."""
    info = {"cpu": cpu_model(), "isa": active_isa(), "cpus": cpu_count(), "version": __version__}
    if device == "cuda":
        info["gpu"] = _gpu_name()
    return info


@functools.cache
def _gpu_name() -> str:
    try:
        from numba import cuda

        name = cuda.get_current_device().name
    except Exception:
        return "no GPU"
    return name.decode() if isinstance(name, bytes) else str(name)


def bucket(nq: int, nk: int, d: int, dv: int) -> str:
    def up(n):
        return 1 << max(0, int(n) - 1).bit_length()

    return f"nq{up(nq)}-nk{up(nk)}-d{d}-dv{dv}"


def key(kernel: str, device: str, dtype: str, causal: bool, shape_bucket: str) -> str:
    m = machine(device)
    where = m.get("gpu") if device == "cuda" else f"{m['cpu']}/{m['isa']}/{m['cpus']}cpus"
    return "|".join((where, f"attnkern-{m['version']}", kernel, dtype, "causal" if causal else "full", shape_bucket))


class _Cache:
    path: Path | None = None
    mtime: float | None = None
    entries: dict = {}


def _load() -> dict:
    path = _cache_file(cache_dir())
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        _Cache.path, _Cache.mtime, _Cache.entries = path, None, {}
        return {}
    if _Cache.path == path and _Cache.mtime == mtime:
        return _Cache.entries
    entries = {}
    try:
        with open(path) as f:
            data = json.loads(f.read())
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("entries"), dict):
            raise ValueError("not an attnkern tuning cache of this format")
        entries = {k: e for k, e in data["entries"].items()
                   if isinstance(e, dict) and isinstance(e.get("params"), dict)
                   and all(isinstance(v, int) and not isinstance(v, bool) for v in e["params"].values())}
    except (OSError, ValueError) as exc:
        warnings.warn(f"ignoring the tuning cache {path}: {exc}", RuntimeWarning, stacklevel=3)
    _Cache.path, _Cache.mtime, _Cache.entries = path, mtime, entries
    return entries


def lookup(kernel: str, device: str, dtype, causal: bool, nq: int, nk: int, d: int, dv: int):
    """(params, key) of a cached result for this call, or None."""
    if not enabled():
        return None
    entries = _load()
    if not entries:
        return None
    k = key(kernel, device, str(dtype), bool(causal), bucket(nq, nk, d, dv))
    entry = entries.get(k)
    return (dict(entry["params"]), k) if entry else None


def entries_for(kernel: str) -> list[dict]:
    """This machine's cached results for `kernel` (kernel_info shows them)."""
    if not enabled():
        return []
    out = []
    for k, e in _load().items():
        parts = k.split("|")
        if len(parts) == 6 and parts[2] == kernel:
            out.append({"key": k, "params": e["params"], "seconds": e.get("seconds")})
    return out


def store(kernel: str, device: str, dtype: str, causal: bool, shape_bucket: str, params: dict, record: dict) -> str:
    """Writes one result (atomically: a temporary file renamed over the cache)."""
    path = cache_dir() / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = dict(_load())
    k = key(kernel, device, dtype, causal, shape_bucket)
    entries[k] = {"params": {n: int(v) for n, v in params.items()}, "stored": time.strftime("%Y-%m-%dT%H:%M:%S"),
                  **record}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"format": FORMAT, "entries": entries}, indent=1, sort_keys=True))
    os.replace(tmp, path)
    return k
