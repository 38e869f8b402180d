"""Run the attnkern command with cuda.flash's Hopper backward divisions (cpp.BWD_WGMMA_DIVISIONS) set
to the fastest of a dev/gpu_bwd_versions.py --json file: per D, the wgmma division (qwg...kvwg...) of
the least geometric mean time over its (N, causal) rows, among those timed in every row whose
gradients were bit-identical to the first division's (max_diff_vs_default 0). Divisions named in
--failed (those of a failed test run) are passed over.

    python3 dev/gpu_bwd_best.py versions.json [--failed NAME ...] -- bench --device cuda --backward ...
"""

import json
import math
import sys


def best(rows, failed=()):
    """{D: division} of the fastest eligible wgmma division per D in rows."""
    chosen = {}
    for d in sorted({r["d"] for r in rows}):
        mine = [r for r in rows if r["d"] == d]
        shapes = {(r["n"], r["causal"]) for r in mine}
        names = {r["config"] for r in mine if r["config"].startswith("qwg") and r["config"] not in failed}
        good = [x for x in names if {(r["n"], r["causal"]) for r in mine if r["config"] == x} == shapes
                and all(r["max_diff_vs_default"] == 0 for r in mine if r["config"] == x)]
        if good:
            chosen[d] = min(good, key=lambda x: sum(math.log(r["ms"]) for r in mine if r["config"] == x))
    return chosen


def main(argv):
    split = argv.index("--")
    own, rest = argv[:split], argv[split + 1:]
    failed = own[own.index("--failed") + 1:] if "--failed" in own else []
    with open(own[0]) as f:
        chosen = best(json.load(f), failed)
    from attnkern.backends.cuda import cpp
    from attnkern_bench.cli import main as cli

    cpp.BWD_WGMMA_DIVISIONS.update(chosen)
    print(f"# cpp.BWD_WGMMA_DIVISIONS = {cpp.BWD_WGMMA_DIVISIONS}", flush=True)
    return cli(rest)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
