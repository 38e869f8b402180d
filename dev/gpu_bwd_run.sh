#!/bin/bash
# The device machine's run of cuda.flash's tensor-core backward (flash_bwd_mma.cu): the GPU
# tests, then attnkern bench --backward per dtype and head size. Run from a directory holding
# whl/ (the attnkern cp312 wheel and NumPy 2.4) and tests/ (a copy), results under $OUT.
# Usage: dev/gpu_bwd_run.sh [tests|bench|all] [pytest -k expression]
set -u
what=${1:-all}
pip install -q --no-index --no-deps --upgrade --target /tmp/site whl/*.whl
# src/ (optional): the package's Python and CUDA sources, laid over the wheel's (no rebuild for them)
[ -d src ] && cp -r src/. /tmp/site/
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
if [ "$what" != bench ]; then
    ATTNKERN_TEST_GPU=1 timeout ${TEST_TIMEOUT:-240} python3 -m pytest tests/test_cuda_backward.py -q \
        -p no:cacheprovider -k "${2:-half}" > "$OUT/tests.log" 2>&1
    grep -aE "passed|failed|^FAILED|^E  " "$OUT/tests.log" | head -30
fi
if [ "$what" = versions ]; then
    (cd /tmp && timeout ${BENCH_TIMEOUT:-200} python3 "$OLDPWD/dev/gpu_bwd_versions.py" --json "$OUT/versions.json" \
        ${VERSIONS_ARGS:-})
    exit
fi
if [ "$what" != tests ]; then
    cd /tmp
    for dtype in ${DTYPES:-bfloat16 float16}; do
        for d in ${DIMS:-64 128}; do
            timeout ${BENCH_TIMEOUT:-100} python3 -m attnkern bench --device cuda --backward --dtype $dtype --dim $d \
                --sizes ${SIZES:-2048 4096 8192} --repeat ${REPEAT:-5} --json "$OUT/bwd_${dtype}_${d}.json" 2>&1 \
                | grep -v Warning
        done
    done
fi
