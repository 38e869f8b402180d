"""ptxas's registers and spills (sm_90a) of the fused backward's kernels (cpp.BWD_DETERMINISTIC
False) beside the default wgmma backward's at D = 64: dev/cuda_ptxas.py's list, filtered.

    python3 dev/bwd6_ptxas.py"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import cuda_ptxas as cp  # noqa: E402

cp.KERNELS[:] = [k for k in cp.KERNELS if k[0] == "flash_bwd_mma.cu" and k[2].get("D") == 64
                 and k[2].get("PART", 0) >= 3 and k[2].get("STAGES", 2) == 2 or "fusedq" in k[1] or "bwd6" in k[1]]
sys.argv = [sys.argv[0], "--arch", "sm_90a"]
cp.main()
