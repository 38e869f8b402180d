#!/bin/bash
# Every GPU test of the suite on one GPU machine, in shards run at once: a pytest plugin keeps
# every Nth collected test (from the Kth on, with a skip count to resume a shard a timeout cut),
# each shard under a timeout, its log in $OUT. The test files of the GPU kernels run in
# SHARDS shards (default 8); the GPU tests of the other files (-k "cuda or triton or gpu") in 3.
# On an H200 (16 cores) one shard of 8 took 2-8 minutes: NVRTC and Triton compile per test.
# Run from a folder holding .whl/ (the attnkern cp312 wheel and NumPy 2.4) and tests/:
#   OUT=out SHARDS=8 TIMEOUT=470 bash dev/gpu_test_shards.sh [SKIPS]
# SKIPS: "0:46 6:48" resumes shard 0 after its first 46 tests and shard 6 after 48.
set -u
: "${OUT:?set OUT}" ; SHARDS=${SHARDS:-8}; TIMEOUT=${TIMEOUT:-470}
export PYTHONUNBUFFERED=1 ATTNKERN_TEST_GPU=1
SITE=/tmp/site-shards; PLUG=/tmp/plug-shards
pip install -q --no-index --no-deps --upgrade --target $SITE .whl/*.whl > /dev/null 2>&1
mkdir -p $PLUG $OUT && cat > $PLUG/shard.py <<'PY'
import os
def pytest_collection_modifyitems(config, items):
    i, n, skip = (int(x) for x in os.environ["SHARD"].split("/"))
    items[:] = [it for j, it in enumerate(items) if j % n == i][skip:]
PY
export PYTHONPATH=$SITE:$PLUG
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/gpu.txt
GPU_FILES="tests/test_cuda.py tests/test_cuda_backward.py tests/test_cuda_decode.py tests/test_cuda_fp8.py
  tests/test_triton.py tests/test_gpu_models.py tests/test_gpu_sync.py"
OTHER="tests/test_dropout.py tests/test_varlen.py tests/test_features.py tests/test_combinations.py
  tests/test_fastmath.py tests/test_extras.py tests/test_staging.py tests/test_torch_compile.py"
declare -A skip=()
for s in "$@"; do skip[${s%%:*}]=${s##*:}; done
for ((i = 0; i < SHARDS; i++)); do
  (SHARD=$i/$SHARDS/${skip[$i]:-0} timeout $TIMEOUT python3 -P -m pytest $GPU_FILES -q -rfE --tb=short -p shard \
     -p no:cacheprovider -m "not slow" > $OUT/shard$i.log 2>&1
   echo "shard $i rc $?: $(tail -1 $OUT/shard$i.log)") &
done
for i in 0 1 2; do
  (SHARD=$i/3/0 timeout $TIMEOUT python3 -P -m pytest $OTHER -q -rfE --tb=short -p shard -p no:cacheprovider \
     -m "not slow" -k "cuda or triton or gpu" > $OUT/other$i.log 2>&1
   echo "other $i rc $?: $(tail -1 $OUT/other$i.log)") &
done
wait
grep -h -aE "^FAILED|^ERROR" $OUT/*.log | head -40
