#!/bin/bash
# The GPU side of pinned staging, fastmath and attnkern profile, in one run on a GPU
# machine: their GPU tests, attnkern transfer, dev/gpu_fastmath.py and attnkern
# profile. Results go to $OUT (default ./gpu-infra): one log per part and the JSON
# (and ncu CSV) each writes. Needs attnkern installed with its CUDA backend, torch,
# Triton and Nsight Compute's ncu (for the profile); run from the repository root.
set -u
OUT=${OUT:-gpu-infra}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
echo "== tests"
rm -rf /tmp/gpu-infra-tests && cp -r tests /tmp/gpu-infra-tests
(cd /tmp/gpu-infra-tests && ATTNKERN_TEST_GPU=1 timeout 300 python3 -m pytest -q -p no:cacheprovider \
    test_fastmath.py test_staging.py -k "gpu or numpy_inputs or staged" 2>&1 | tail -5) | tee "$OUT/tests.txt"
echo "== attnkern transfer"
(cd /tmp && timeout 120 python3 -m attnkern transfer --device cuda --json "$OUT/transfer.json") 2>&1 \
    | tee "$OUT/transfer.txt"
echo "== fastmath"
timeout 300 python3 dev/gpu_fastmath.py "$OUT/fastmath.json" --runs 15 2>&1 | tail -3 | tee "$OUT/fastmath.txt"
echo "== attnkern profile"
(cd /tmp && timeout 300 python3 -m attnkern profile --device cuda --shape 1x16x4096x64 --csv "$OUT/ncu.csv" \
    --json "$OUT/profile.json") 2>&1 | tee "$OUT/profile.txt"
