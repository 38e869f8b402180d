#!/bin/bash
# The device machine's run for the Hopper backward (flash_bwd_mma.cu parts 3-4) as it ran on an H100 on
# 2026-11-26 (docs/gpu-backward-wgmma.md): test_cuda_backward.py and test_dropout.py -k cuda in parallel
# groups, dev/gpu_bwd_wgmma_check.py, then the divisions side by side and attnkern bench --backward.
# Run from a folder holding whl/ (the attnkern cp312 wheel and NumPy 2.4), tests/ and dev/; results under $OUT.
pip install -q --no-index --no-deps --upgrade --target /tmp/site-gpubwd2 whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site-gpubwd2 PYTHONUNBUFFERED=1
L=/tmp/logs; mkdir -p $L
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
t() { ATTNKERN_TEST_GPU=1 timeout 215 python3 -m pytest tests/$1 -q -p no:cacheprovider -k "$2" > $L/t_$3.log 2>&1; echo "tests $3: $(tail -1 $L/t_$3.log)"; }
t test_cuda_backward.py "half_backward_by_flash and bfloat16" A &
t test_cuda_backward.py "half_backward_by_flash and not bfloat16" B &
t test_cuda_backward.py "wgmma_divisions and bfloat16" C &
t test_cuda_backward.py "wgmma_divisions and not bfloat16" D &
t test_cuda_backward.py "half_backward_features or half_backward_masks or block_shares" E &
t test_cuda_backward.py "not half_backward_by_flash and not wgmma_divisions and not half_backward_features and not half_backward_masks and not block_shares" F &
t test_dropout.py "cuda" G &
(timeout 215 python3 dev/gpu_bwd_wgmma_check.py --sizes 1000 4096 --json $OUT/check.json > $L/check.log 2>&1; echo "check: $(tail -1 $L/check.log)") &
wait
cat $L/t_*.log $L/check.log > $OUT/tests.log
grep -h -aE "^FAILED|^E  " $L/t_*.log | head -24
grep -a FAIL $L/check.log | head -8
cd /tmp
timeout 55 python3 $OLDPWD/dev/gpu_bwd_versions.py --dims 64 --sizes 4096 8192 --runs 5 --json $OUT/versions_64.json \
  --configs q4x64kv4x128 qwg2x64kvwg2x64 qwg1x64kvwg1x64 qwg1x128kvwg1x128 qwg2x128kvwg2x64 2>&1 | grep -v Warn
timeout 55 python3 $OLDPWD/dev/gpu_bwd_versions.py --dims 128 --sizes 4096 8192 --runs 5 --json $OUT/versions_128.json \
  --configs q4x64kv4x64 qwg2x64kvwg2x64 qwg1x64kvwg1x64 qwg1x128kvwg1x64 qwg2x128kvwg2x64 2>&1 | grep -v Warn
for d in 64 128; do
  timeout 50 python3 -m attnkern bench --device cuda --backward --dtype bfloat16 --dim $d --sizes 4096 8192 --repeat 5 \
    --json $OUT/bench_bf16_$d.json 2>&1 | grep -v "Warning\|run_backward"
done
