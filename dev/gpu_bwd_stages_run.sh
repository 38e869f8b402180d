#!/bin/bash
# The device machine's run for the Hopper backward's staged divisions (flash_bwd_mma.cu parts 3-4 with
# ATTNKERN_STAGES, cpp.BwdConfig's s suffix; docs/gpu-backward-wgmma.md), one call: the divisions test
# (4 processes: dtype x D) and the other wgmma backward tests, dev/gpu_bwd_wgmma_check.py with candidate
# divisions against float64, while dev/gpu_bwd_versions.py compiles its divisions; once those are done,
# the divisions timed in turns (D = 64, then 128), then attnkern bench --backward with the fastest
# bit-identical divisions (dev/gpu_bwd_best.py). Run from a folder holding whl/ (the attnkern cp312 wheel
# and NumPy 2.4), tests/ and dev/; 8 files under $OUT.
pip install -q --no-index --no-deps --upgrade --target /tmp/site-gpubwd3 whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site-gpubwd3 PYTHONUNBUFFERED=1
L=/tmp/logs; mkdir -p $L; rm -f /tmp/phase1_done /tmp/v64_done
here=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $L/gpu.txt
V64="qwg1x128kvwg1x128 q4x64kv4x128 qwg1x128s2kvwg1x128s2 qwg1x128s3kvwg1x128s3 qwg1x64s3kvwg1x64s3 qwg1x64s4kvwg1x64s4
     qwg2x128s3kvwg2x128s3 qwg1x128s2kvwg1x64s4"
V128="qwg2x128kvwg2x64 q4x64kv4x64 qwg2x128s2kvwg2x64s2 qwg2x64s3kvwg2x64s3 qwg2x128s2kvwg2x64s3 qwg2x64s4kvwg2x64s4
      qwg2x128s2kvwg2x64s4"
v() { cd /tmp && timeout 300 python3 $here/dev/gpu_bwd_versions.py --dims $1 --sizes 4096 8192 --runs 7 \
        --json $OUT/versions_$1.json --wait-for $2 --configs $3 > $L/v$1.log 2>&1; touch /tmp/v$1_done; }
v 64 /tmp/phase1_done "$V64" & vp1=$!
v 128 /tmp/v64_done "$V128" & vp2=$!
t() { ATTNKERN_TEST_GPU=1 timeout 170 python3 -m pytest tests/$1 -q -p no:cacheprovider -k "$2" > $L/t_$3.log 2>&1
      echo "tests $3: $(tail -1 $L/t_$3.log)"; }
pids=()
t test_cuda_backward.py "wgmma_divisions and bfloat16 and 64]" A & pids+=($!)
t test_cuda_backward.py "wgmma_divisions and bfloat16 and 128]" B & pids+=($!)
t test_cuda_backward.py "wgmma_divisions and not bfloat16 and 64]" C & pids+=($!)
t test_cuda_backward.py "wgmma_divisions and not bfloat16 and 128]" D & pids+=($!)
t test_cuda_backward.py "registered or wgmma_backward_routing or block_shares or half_backward_features" E & pids+=($!)
t test_cuda_backward.py "half_backward_by_flash and bfloat16" F & pids+=($!)
t test_cuda.py "features_half_cuda_cpp or half_kernel_writes" G & pids+=($!)
(timeout 170 python3 dev/gpu_bwd_wgmma_check.py --sizes 1000 4096 --json $OUT/check.json \
   --configs 64=qwg1x64s3kvwg1x64s3 64=qwg1x128s2kvwg1x128s2 128=qwg2x64s3kvwg2x64s3 128=qwg2x128s2kvwg2x64s3 \
   > $L/check.log 2>&1; echo "check: $(tail -1 $L/check.log)") & pids+=($!)
wait "${pids[@]}"
touch /tmp/phase1_done
cat $L/gpu.txt $L/t_*.log $L/check.log > $OUT/tests.log
grep -h -aE "^FAILED|^E  " $L/t_*.log | head -30
grep -a FAIL $L/check.log | head -8
wait $vp1 $vp2
cat $L/gpu.txt $L/v64.log $L/v128.log | grep -v Warn > $L/run.log
grep -v "^ *$" $L/run.log
# not chosen: every division of a D whose divisions test did not pass, and those that failed the check
ok() { tail -1 $L/t_$1.log | grep -q passed && ! tail -1 $L/t_$1.log | grep -qE "failed|error"; }
failed="$(grep -a FAIL $L/check.log | grep -o "qwg[0-9a-z]*kvwg[0-9a-z]*")"
{ ok A && ok C; } || failed="$failed $V64"
{ ok B && ok D; } || failed="$failed $V128"
echo "not chosen: $failed" | tee -a $L/run.log
cd /tmp
python3 -c "import json; print(json.dumps(sum((json.load(open(f'$OUT/versions_{d}.json')) for d in (64, 128)), [])))" \
   > /tmp/versions.json
b() { timeout $1 python3 $here/dev/gpu_bwd_best.py /tmp/versions.json --failed $failed -- bench --device cuda --backward \
      --dtype $2 --dim $3 --sizes ${@:4} --repeat 5 --json $OUT/bench_$2_$3.json 2>&1 | grep -v "Warning\|run_backward" \
      | tee -a $L/run.log; }
b 70 bfloat16 128 2048 4096 8192 16384
b 55 bfloat16 64 2048 4096 8192 16384
b 35 float16 128 4096 8192
cp $L/run.log $OUT/run.log
