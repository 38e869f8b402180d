"""Peak memory of one attention call beyond its inputs and output, measured in a
fresh process (Linux: VmHWM reset through /proc/self/clear_refs)."""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = """
import json, sys, numpy as np, attnkern
from attnkern_bench.inputs import random_qkv
from attnkern_bench.machine import thread_params
kernel, n, d, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def status(key):
    with open('/proc/self/status') as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ':'))
q, k, v = random_qkv(0, (1, 1), n, n, d)
params = thread_params(kernel, threads)
attnkern.attention(q[..., :64, :], k[..., :64, :], v[..., :64, :], kernel=kernel, **params)  # load code, start threads
before = status('VmRSS')
with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')  # reset the peak (VmHWM) to the current RSS
out = attnkern.attention(q, k, v, kernel=kernel, **params)
print(json.dumps({'extra_bytes': status('VmHWM') - before - out.nbytes, 'io_bytes': 4 * q.nbytes}))
"""


def measure_memory(kernel: str, n: int, d: int, threads: int) -> dict:
    """{kernel, n, d, extra_bytes, io_bytes} of a float32 (1, 1, n, d) forward,
    or {kernel, error} if the probe failed."""
    proc = subprocess.run([sys.executable, "-c", _PROBE, kernel, str(n), str(d), str(threads)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
        return {"kernel": kernel, "error": lines[-1]}
    return {"kernel": kernel, "n": n, "d": d, **json.loads(proc.stdout)}
