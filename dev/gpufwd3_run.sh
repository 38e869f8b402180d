#!/bin/bash
# gpufwd3's first device call (run from a folder that holds whl/: the cp312 wheel and NumPy 2.4's, tests/ and dev/). On the quiet machine first: the library call's host steps
# (dev/gpu_library_host.py). Then GPU tests (the 256-key division forced at D = 64; head sizes
# 96/192/256) beside the timing scripts' builds and checks; then on the quiet GPU one after
# another: attnkern bench, the bfloat16 grid, head sizes, the float16 grid (as long as time lasts)
cd "$(dirname "$0")"; O=${OUT:-/tmp/out}; mkdir -p $O; T0=$(date +%s); END=$((T0 + ${BUDGET_S:-290}))
left() { echo $((END - $(date +%s))); }
at() { echo "$1 at $(( $(date +%s) - T0 )) s"; }
{ nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)|MHz"; } > $O/gpu.txt
cat $O/gpu.txt
S=/tmp/site-gpufwd3; rm -rf $S; pip install -q --no-index --no-deps --target $S whl/*.whl 2>&1 | grep -v WARN
export PYTHONPATH=$S PYTHONUNBUFFERED=1
rm -f /tmp/gf3-*
at installed
timeout 50 python3 dev/gpu_library_host.py $O/host.json --shapes 4096x128,16384x128 --runs 9 2>&1 | grep -v Warn
at "host steps done"
P="python3 -m pytest -q -p no:cacheprovider -rf"
( export ATTNKERN_TEST_GPU=1
  WGMMA_DEFAULT="64=wg2k256s2pet" PYTHONPATH=$S:dev timeout 100 $P -p pytest_wgmma_default tests/test_cuda.py \
      -k "matches_reference or bitwise or fast_path_matches or unrounded or (features_half_cuda_cpp and 64)" > $O/t_k256.txt 2>&1 &
  timeout 100 $P tests/test_cuda.py -k "features_half_cuda_cpp and (96 or 192 or 256)" > $O/t_heads.txt 2>&1 &
  timeout 100 $P tests/test_cuda_backward.py -k "half_large_head_sizes" > $O/t_heads_bwd.txt 2>&1 &
  wait; touch /tmp/gf3-tests ) &
V="python3 dev/gpu_flash_versions.py"
$V $O/grid-bf16.json --library --dims 128,64 --batches 1,2,4,8 --sizes 2048,4096,8192,16384 --dtypes bfloat16 \
    --runs 5 --warmup-s 0.05 --configs default,wg2k256s2pet --after /tmp/gf3-bench > $O/grid-bf16.txt 2>&1 &
G1=$!
$V $O/heads.json --library --dims 96,192,256 --sizes 4096 --dtypes bfloat16 --runs 5 --configs default \
    --after /tmp/gf3-grid > $O/heads.txt 2>&1 &
G2=$!
$V $O/grid-fp16.json --library --dims 128,64 --batches 1,2,4,8 --sizes 2048,4096 --dtypes float16 \
    --runs 5 --warmup-s 0.05 --configs default --after /tmp/gf3-heads > $O/grid-fp16.txt 2>&1 &
G3=$!
while [ ! -e /tmp/gf3-tests ]; do sleep 1; done
at "tests done"; for f in $O/t_*.txt; do echo "== $f"; grep -E "passed|failed|FAILED|Error" $f | tail -4; done
cd /tmp && timeout 35 python3 -m attnkern bench --device cuda --dtype bfloat16 --dim 128 --sizes 4096 8192 --repeat 5 \
    --kernels torch.sdpa "torch.sdpa[cudnn]" "torch.sdpa[flash]" "torch.sdpa[efficient]" cuda.flash --json $O/bench.json 2>&1 \
    | grep -v "Warn\|^\[" | tail -24; cd - > /dev/null
touch /tmp/gf3-bench; at "bench done"
timeout $(left) tail --pid=$G1 -f /dev/null; kill $G1 2>/dev/null; touch /tmp/gf3-grid; at "grid done"
grep -v "^{" $O/grid-bf16.txt | grep -v Warn | grep -v "torch.sdpa \|torch.flash\|torch.efficient" | tail -120
timeout $(left) tail --pid=$G2 -f /dev/null; kill $G2 2>/dev/null; touch /tmp/gf3-heads
grep -v "^{" $O/heads.txt | grep -v Warn | tail -20
timeout $(left) tail --pid=$G3 -f /dev/null; kill $G3 2>/dev/null
grep -v "^{" $O/grid-fp16.txt | grep -v Warn | grep -v "torch.sdpa \|torch.flash\|torch.efficient" | tail -40
(cd $O && tar czf logs.tgz *.txt && rm -f *.txt)
at "all done"
