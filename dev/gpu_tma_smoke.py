"""A first run of flash_wgmma.cu divisions on a GPU before they are timed: each named division
(dev/gpu_flash_versions.py's names) built and checked against float64 on odd shapes (partial
tiles, nq != nk, a negative scale, causal and not) and run to run, at D = 64 and 128, bfloat16.

    python3 dev/gpu_tma_smoke.py wg2k128s3et,wg2k176s2et

Exit status 0 when every division that fits passed; a hang is the caller's timeout."""

import json
import sys

from gpu_flash_versions import Kernel, check_odd, parse_config


def main() -> int:
    ok = True
    for d in (64, 128):
        for name in sys.argv[1].split(","):
            config = parse_config(name, d, "bfloat16")
            if config is None:
                continue
            row = {"kernel": name, "d": d, **check_odd(Kernel(config, d, "bfloat16"), d, "bfloat16")}
            print(json.dumps(row), flush=True)
            ok &= row["odd_ok"] and row["bit_identical"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
