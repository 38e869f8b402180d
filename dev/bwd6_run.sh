#!/bin/bash
# The device machine's one call for the fused half-precision backward (cpp.BWD_DETERMINISTIC False;
# docs/gpu-backward-wgmma.md, "Fifth session"). Phase 1, in parallel: the fused backward's tests
# (tests/test_cuda_backward.py, the opt-in forced by the tests themselves), the deterministic
# kernels' half-precision tests, and dev/gpu_bwd_wgmma_check.py --fused at D = 64 against float64
# autograd, while the timing scripts compile their kernels. Phase 2, one after the other on the
# then idle GPU: dev/bwd6_measure.py (fused vs default vs every torch SDPA backend, backward alone and
# forward + backward, in turns), dev/gpu_bwd_versions.py (the fused backward's two dK/dV tile sizes
# beside the default division), then attnkern bench --backward, default and with
# ATTNKERN_BWD_DETERMINISTIC=0, as long as the call's time lasts. Run from a folder holding whl/
# (the attnkern cp312 wheel and NumPy 2.4), tests/ and dev/; at most 8 files under $OUT.
start=$SECONDS
pip install -q --no-index --no-deps --upgrade --target /tmp/site-bwd6 whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site-bwd6 PYTHONUNBUFFERED=1
L=/tmp/logs-bwd6; mkdir -p $L; rm -f /tmp/bwd6_phase1 /tmp/bwd6_measured
here=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $L/gpu.txt
left() { echo $(( ${1:-270} - (SECONDS - start) )); }  # seconds to a point of the call (default 270 s)

(cd /tmp && timeout "$(left 240)" python3 $here/dev/bwd6_measure.py --sizes 2048 4096 8192 16384 --runs 5 \
    --json $OUT/measure.json --wait-for /tmp/bwd6_phase1 > $L/measure.log 2>&1; touch /tmp/bwd6_measured) & mp=$!
(cd /tmp && timeout "$(left 250)" python3 $here/dev/gpu_bwd_versions.py --dims 64 --sizes 4096 8192 16384 --runs 5 \
    --configs qwg1x128s2kvwg1x128s2 fused fused=qwg1x128s2kvwg1x128s2 --json $OUT/versions.json \
    --wait-for /tmp/bwd6_measured > $L/versions.log 2>&1) & vp=$!

t() { ATTNKERN_TEST_GPU=1 timeout "$(left 150)" python3 -m pytest tests/$1 -q -p no:cacheprovider -k "$2" \
        > $L/t_$3.log 2>&1; echo "tests $3: $(tail -1 $L/t_$3.log)"; }
pids=()
t test_cuda_backward.py "fused" A & pids+=($!)
t test_cuda_backward.py "registered or wgmma_backward_routing or half_backward_features" B & pids+=($!)
t test_cuda_backward.py "half_backward_by_flash and bfloat16" C & pids+=($!)
(timeout "$(left 150)" python3 dev/gpu_bwd_wgmma_check.py --dims 64 --sizes 1000 4096 --fused --only-fused \
   --json $OUT/check.json > $L/check.log 2>&1; echo "check: $(tail -1 $L/check.log)") & pids+=($!)
(timeout "$(left 150)" python3 dev/gpu_bwd_wgmma_check.py --dims 64 --dtypes bfloat16 --sizes 4096 \
   > $L/check_default.log 2>&1; echo "check (default kernels): $(tail -1 $L/check_default.log)") & pids+=($!)
wait "${pids[@]}"
echo "phase 1 done at $((SECONDS - start)) s"
touch /tmp/bwd6_phase1
cat $L/gpu.txt $L/t_*.log $L/check.log $L/check_default.log > $OUT/tests.log
grep -h -aE "^FAILED|^E  " $L/t_*.log | head -30
grep -a FAIL $L/check.log $L/check_default.log | head -8
wait $mp $vp
echo "timings done at $((SECONDS - start)) s"
cat $L/measure.log $L/versions.log > $OUT/timings.log
grep -a "D=64" $L/measure.log | head -40
grep -a "TFLOP" $L/versions.log | head -20
# attnkern bench as the earlier tables measured it (the library path), while time remains
b() { (cd /tmp && timeout "$(left 285)" env $1 python3 -m attnkern bench --device cuda --backward --dtype bfloat16 \
        --dim 64 --sizes 4096 16384 --repeat 5 --json $OUT/bench-$2.json >> $L/bench.log 2>&1); }
[ "$(left 285)" -gt 40 ] && b ATTNKERN_BWD_DETERMINISTIC=1 default
[ "$(left 285)" -gt 30 ] && b ATTNKERN_BWD_DETERMINISTIC=0 fused
cp $L/bench.log $OUT/bench.log 2>/dev/null
grep -a "cuda.flash\|torch.fastest" $L/bench.log | head -20
echo "done at $((SECONDS - start)) s"
