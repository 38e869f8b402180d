#!/bin/bash
# shellcheck disable=SC2086  # P is a list of words: split on purpose
# flash_wgmma.cu at head sizes 192 and 256 (the warp-specialized variant with 64-key tiles) on one
# device call, from the repository's root with .whl/ (the cp312 wheel and NumPy 2.4's): its GPU tests
# (divisions against float64 and bit for bit, features, masks, the float32 rows, the large-head
# backward whose forward now runs it), then on the quiet GPU each division against flash_mma.cu's
# (the default before) and every torch SDPA backend, in turns (dev/gpu_flash_versions.py).
cd "$(dirname "$0")/.." || exit; O=${OUT:-/tmp/out}; mkdir -p "$O"; T0=$(date +%s)
at() { echo "$1 at $(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
S=/tmp/site-heads; rm -rf $S; pip install -q --no-index --no-deps --upgrade --target $S .whl/*.whl 2>&1 | grep -v WARN
export PYTHONPATH=$S PYTHONUNBUFFERED=1
at installed
P="python3 -m pytest -q -p no:cacheprovider -rf"
( export ATTNKERN_TEST_GPU=1
  timeout ${TEST_S:-300} $P tests/test_cuda.py -k "large_head or unrounded" > /tmp/t_large.txt 2>&1 &
  timeout ${TEST_S:-300} $P tests/test_cuda.py -k "features_half_cuda_cpp and (192 or 256) or mask_cuda_cpp" \
      > /tmp/t_feat.txt 2>&1 &
  timeout ${TEST_S:-300} $P tests/test_cuda_backward.py -k "large_head" > /tmp/t_bwd.txt 2>&1 &
  wait )
for f in /tmp/t_large.txt /tmp/t_feat.txt /tmp/t_bwd.txt; do echo "== $f"; tail -25 $f; done > "$O/tests.txt"
cat "$O/tests.txt"
at tests
V="python3 dev/gpu_flash_versions.py"
A="--sizes ${SIZES:-4096,8192} --dtypes bfloat16 --runs ${RUNS:-5} --library --warmup-s 0.1"
timeout 200 $V "$O/d256.json" --dims 256 $A --configs ${D256:-default,wg2k64s2pet,mt1w4k32qs} > "$O/d256.txt" 2>&1
at d256
timeout 160 $V "$O/d192.json" --dims 192 $A --configs ${D192:-default,wg2k64s3pet,mt1w4k32qs} > "$O/d192.txt" 2>&1
at d192
