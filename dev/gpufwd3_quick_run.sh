#!/bin/bash
# gpufwd3's second device call: the quick path. The library call's host steps with and without it
# (quiet machine first), then GPU tests of the fast path beside the timing scripts' builds, then on
# the quiet GPU: the library call against the kernel and torch (B 1, N 4096-16384; B 2 and 8 at
# N 2048/4096) and attnkern bench
cd "$(dirname "$0")"; O=${OUT:-/tmp/out}; mkdir -p $O; T0=$(date +%s); END=$((T0 + ${BUDGET_S:-250}))
left() { echo $((END - $(date +%s))); }
at() { echo "$1 at $(( $(date +%s) - T0 )) s"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $O/gpu.txt
S=/tmp/site-gpufwd3; rm -rf $S; pip install -q --no-index --no-deps --upgrade --target $S whl/*.whl 2>&1 | grep -v WARN
export PYTHONPATH=$S PYTHONUNBUFFERED=1
rm -f /tmp/gf3-*
at installed
timeout 45 python3 dev/gpu_library_host.py $O/host2.json --shapes 4096x128,16384x128 --runs 9 --settings alone,torch,busy 2>&1 | grep -v Warn
at "host steps done"
P="python3 -m pytest -q -p no:cacheprovider -rf"
( export ATTNKERN_TEST_GPU=1
  timeout 100 $P tests/test_cuda.py -k "planned_calls or quick_path or fast_path or torch_and_cupy or bitwise or matches_reference or device_arrays" > $O/t_fast.txt 2>&1 &
  timeout 100 $P tests/test_cuda_backward.py -k "autograd" > $O/t_autograd.txt 2>&1 &
  timeout 100 $P tests/test_torch_compile.py > $O/t_compile.txt 2>&1 &
  wait; touch /tmp/gf3-tests ) &
V="python3 dev/gpu_flash_versions.py"
$V $O/lib2.json --library --dims 128,64 --sizes 4096,8192,16384 --dtypes bfloat16 --runs 10 --configs default \
    --after /tmp/gf3-bench > $O/lib2.txt 2>&1 &
G1=$!
$V $O/lib2b.json --library --dims 128,64 --batches 2,8 --sizes 2048,4096 --dtypes bfloat16 --runs 5 --warmup-s 0.05 \
    --configs default --after /tmp/gf3-lib > $O/lib2b.txt 2>&1 &
G2=$!
while [ ! -e /tmp/gf3-tests ]; do sleep 1; done
at "tests done"; for f in $O/t_*.txt; do echo "== $f"; grep -E "passed|failed|FAILED|Error" $f | tail -4; done
cd /tmp && timeout 35 python3 -m attnkern bench --device cuda --dtype bfloat16 --dim 128 --sizes 4096 8192 --repeat 5 \
    --kernels torch.sdpa "torch.sdpa[cudnn]" "torch.sdpa[flash]" "torch.sdpa[efficient]" cuda.flash --json $O/bench2.json 2>&1 \
    | grep -v "Warn\|^\[" | tail -16; cd - > /dev/null
touch /tmp/gf3-bench; at "bench done"
timeout $(left) tail --pid=$G1 -f /dev/null; kill $G1 2>/dev/null; touch /tmp/gf3-lib; at "lib done"
grep -v "^{" $O/lib2.txt | grep -v Warn | grep -v "torch.flash\|torch.efficient" | tail -40
timeout $(left) tail --pid=$G2 -f /dev/null; kill $G2 2>/dev/null
grep -v "^{" $O/lib2b.txt | grep -v Warn | grep -v "torch.flash\|torch.efficient" | tail -40
(cd $O && tar czf logs2.tgz *.txt && rm -f *.txt)
at "all done"
