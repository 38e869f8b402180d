#!/bin/bash
# shellcheck disable=SC2086  # P and GRID are lists of words: split on purpose
# The persistent forward's device call (flash_wgmma.cu's ATTNKERN_PERSIST, WgmmaConfig's P suffix), run
# from a folder that holds whl/ (the cp312 wheel and NumPy 2.4's), tests/ and dev/. First, in parallel:
# the GPU tests with the persistent divisions forced as the plain kernel's default
# (dev/pytest_wgmma_default.py), each persistent division against the same division without P bit for
# bit (test_wgmma_persistent_bit_identical), FP8 (whose kernel shares the rewritten function), and
# the grids' builds and odd-shape checks; then, on the quiet GPU, the bfloat16 grid at D = 128 and 64
# (default against the persistent divisions, in turns with every torch SDPA backend).
cd "$(dirname "$0")/.." || exit; O=${OUT:-/tmp/out}; mkdir -p "$O"; T0=$(date +%s); END=$((T0 + ${BUDGET_S:-262}))
left() { echo $((END - $(date +%s))); }
at() { echo "$1 at $(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader > "$O/gpu.txt"; cat "$O/gpu.txt"
S=/tmp/site-persist; rm -rf $S; pip install -q --no-index --no-deps --target $S whl/*.whl 2>&1 | grep -v WARN
export PYTHONPATH=$S PYTHONUNBUFFERED=1
rm -f /tmp/persist-*
at installed
P="python3 -m pytest -q -p no:cacheprovider -rf"
T=tests/test_cuda.py
FORCED="64=wg2k128s3etPd,128=wg2k176s2petPd"
( export ATTNKERN_TEST_GPU=1
  for id in Pd-bfloat16-128-wg2k176s2pet Pd-bfloat16-64-wg2k128s3et Pd-float16-64-wg2k128s2pet Pd-float16-128-wg2k128s3et; do
      timeout 140 $P "$T::test_wgmma_persistent_bit_identical[$id]" > "$O/t_bits_$id.txt" 2>&1 &
  done
  export WGMMA_DEFAULT=$FORCED
  PYTHONPATH=$S:dev timeout 140 $P -p pytest_wgmma_default $T \
      -k "(matches_reference or bitwise or fast_path_matches or unrounded or wgmma or repeated_featured) and not bit_identical" \
      > "$O/t_forced.txt" 2>&1 &
  PYTHONPATH=$S:dev timeout 140 $P -p pytest_wgmma_default $T -k "features_half_cuda_cpp and (64 or 128)" \
      > "$O/t_forced_features.txt" 2>&1 &
  PYTHONPATH=$S:dev timeout 140 $P -p pytest_wgmma_default tests/test_cuda_backward.py \
      -k "half_backward_by_flash_attentions_rule or half_backward_features" > "$O/t_forced_backward.txt" 2>&1 &
  unset WGMMA_DEFAULT
  timeout 140 $P tests/test_cuda_fp8.py -k "(matches_float64 or bit_identical_repeats or negative_scale or empty) and (wg2k192s2petx1 or wg2k128s3e) and not x1h" \
      > "$O/t_fp8.txt" 2>&1 &
  wait; touch /tmp/persist-tests ) &
V="python3 dev/gpu_flash_versions.py"
GRID="--batches 1,2,4,8 --sizes 2048,4096,8192 --dtypes bfloat16 --runs 5 --warmup-s 0.05"
$V "$O/grid-d128.json" --dims 128 $GRID --configs default,wg2k176s2petP,wg2k176s2petPd --after /tmp/persist-tests \
    > "$O/grid-d128.txt" 2>&1 &
G1=$!
$V "$O/grid-d64.json" --dims 64 $GRID --configs default,wg2k128s3etP,wg2k128s3etPd --after /tmp/persist-d128 \
    > "$O/grid-d64.txt" 2>&1 &
G2=$!
while [ ! -e /tmp/persist-tests ] && [ "$(left)" -gt 0 ]; do sleep 1; done
at "tests done"; for f in "$O"/t_*.txt; do echo "== $f"; grep -E "passed|failed|FAILED|Error|error" "$f" | tail -4; done
timeout "$(left)" tail --pid=$G1 -f /dev/null; kill $G1 2>/dev/null; touch /tmp/persist-d128; at "D = 128 grid done"
timeout "$(left)" tail --pid=$G2 -f /dev/null; kill $G2 2>/dev/null; at "D = 64 grid done"
for f in "$O"/grid-d128.txt "$O"/grid-d64.txt; do
    grep -v "^{" "$f" | grep -v Warn | grep -v "torch.sdpa \|torch.flash\|torch.efficient" | tail -80
    grep '"odd_error"\|failed' "$f" | cut -c1-400
done
(cd "$O" && tar czf logs.tgz ./*.txt && rm -f t_*.txt grid-*.txt)
at "all done"
