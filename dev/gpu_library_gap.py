"""Why attnkern.attention reads slower than cuda.flash's kernel launched directly (dev/
gpu_flash_versions.py --library): at (1, 16, N, D) bfloat16, per call shape, the
host's time per call (after 30 calls: the prepared launch made) and the GPU's
(CUDA events, 5 back to back, median of 15, in turns with the prepared kernel), the
library with the fast path off (attnkern.backends.cuda.FAST_PATH), and cProfile's top
functions (cumulative) of 10 calls, which show the path the calls took.
--with-torch: torch's SDPA backends in the turns too, as dev/gpu_flash_versions.py has them
(there the library read 0.79-0.97x the kernel; alone with it, 1.005x).

    python3 dev/gpu_library_gap.py OUT.json [--shapes 16384x128,4096x128] [--with-torch]"""

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import torch

import attnkern
from attnkern.backends import cuda
from attnkern_bench.timing import CudaEventClock
from gpu_flash_versions import Kernel, inputs, parse_config, sdpa_backends


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shapes", default="16384x128,4096x128")
    ap.add_argument("--with-torch", action="store_true")
    a = ap.parse_args()
    rows = []
    for shape in a.shapes.split(","):
        n, d = map(int, shape.split("x"))
        q, k, v = inputs((1, 16, n, d), "bfloat16", n)
        for causal in (False, True):
            def library():
                return attnkern.attention(q, k, v, causal=causal, kernel="cuda.flash", check_finite=False)

            library()
            for _ in range(30):
                library()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(10):
                library()
            host_us = (time.perf_counter() - t) / 10 * 1e6
            torch.cuda.synchronize()
            out = torch.empty_like(q)
            prepared = Kernel(parse_config("default", d, "bfloat16"), d, "bfloat16").prepared(q, k, v, out, causal,
                                                                                            1 / d**0.5)

            def general():
                cuda.FAST_PATH = False
                try:
                    return library()
                finally:
                    cuda.FAST_PATH = True

            fns = {"library": library, "prepared": prepared, "general_path": general}
            if a.with_torch:
                fns = {**{name: (lambda call=call: call(q, k, v, causal)) for name, call in sdpa_backends().items()},
                       **fns}
            clock, samples = CudaEventClock(torch), {name: [] for name in fns}
            for fn in fns.values():
                fn()
            for _ in range(15):
                for name, fn in fns.items():
                    samples[name].append(clock.seconds(fn, 5))
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(10):
                library()
            torch.cuda.synchronize()
            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
            row = {"n": n, "d": d, "causal": causal, "library_host_us": host_us, **{f"{k}_ms": statistics.median(x) * 1e3 for k, x in samples.items()},
                   "profile": text.getvalue()[-5000:]}
            print(json.dumps({k: x for k, x in row.items() if k != "profile"}), flush=True)
            rows.append(row)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
