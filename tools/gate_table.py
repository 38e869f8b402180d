"""What the regression gate (gate.py) and the AVX-512 count (avx512_count.py) share: the
error that stops a comparison, a revision resolved to its commit, and the verdict table."""
from __future__ import annotations

import subprocess
from pathlib import Path


class GateError(Exception):
    """The gate could not compare (a bad revision, a failed build): exit status 2."""


def resolve(repo: Path, rev: str) -> str:
    proc = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=repo,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise GateError(f"{rev!r} is not a commit of {repo}")
    return proc.stdout.strip()


def print_table(rows) -> None:
    head = f"{'benchmark':<36} {'signal':<14} {'baseline':>12} {'candidate':>12} {'ratio':>7} {'95% interval':>17}  verdict"
    print(head)
    print("-" * len(head))
    for r in rows:
        if r["verdict"] == "skipped":
            print(f"{r['benchmark']:<36} {r['signal']:<14} {'':>12} {'':>12} {'':>7} {'':>17}  skipped: {r['note']}")
            continue
        if r.get("unit") == "bytes":
            b, c, iv = f"{r['baseline'] / 1e6:.2f} MB", f"{r['candidate'] / 1e6:.2f} MB", "counted"
        elif r["signal"] != "time":
            b, c = f"{r['baseline'] / 1e6:.3f}M", f"{r['candidate'] / 1e6:.3f}M"
            iv = "exact" if r["signal"] in ("counted", "avx512-counted") else "counted"
        else:
            b, c = f"{r['baseline'] * 1e3:.3f} ms", f"{r['candidate'] * 1e3:.3f} ms"
            iv = f"[{r['interval'][0]:.3f}, {r['interval'][1]:.3f}]"
        mark = {"slower": "SLOWER", "faster": "faster", "same": "same"}[r["verdict"]]
        print(f"{r['benchmark']:<36} {r['signal']:<14} {b:>12} {c:>12} {r['ratio']:>7.3f} {iv:>17}  {mark}")
