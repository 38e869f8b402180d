#!/bin/bash
# triton.flash's forward Hopper variant on the device machine in one call: the GPU tests of
# tests/test_triton.py with the variant forced on every call that can take it
# (ATTNKERN_TRITON_HOPPER=all), in parallel groups, while worker processes compile the sweep's
# configs into Triton's cache; then, on the quiet GPU, dev/triton_hopper_sweep.py (3 runs).
#
#   OUT=<dir> bash dev/triton_hopper_run.sh       (env: TEST_S, WARM_S, SWEEP_S: time limits)
#
# MODE=library: no tests; the worker processes compile the library call's kernels, then
# dev/triton_hopper_sweep.py --library $SWEEP_ARGS (the library call per batch against every torch
# SDPA backend, 3 runs) writes $OUT/sweep.json.
#
# Run from a folder holding whl/ (the attnkern cp312 wheel and a NumPy 2.4 wheel), tests/, dev/
# and pyproject.toml (no attnkern/ source tree: the wheel is imported). Writes $OUT/log.txt,
# tests.txt, sweep.json.
set -u
S=/tmp/site-trifwd
rm -rf $S && pip install -q --no-index --no-deps --target $S whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$S PYTHONUNBUFFERED=1
LOG=$OUT/log.txt
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())" >> $LOG 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv >> $LOG 2>&1
start=$(date +%s)
pids=()
tests() {  # N -k EXPR
    local n=$1; shift
    ( ATTNKERN_TEST_GPU=1 ATTNKERN_TRITON_HOPPER=all timeout ${TEST_S:-190} python3 -m pytest -q -p no:cacheprovider \
        tests/test_triton.py "$@" > /tmp/tests-$n.txt 2>&1
      echo "exit $? after $(( $(date +%s) - start )) s: $*" >> /tmp/tests-$n.txt ) &
    pids+=($!)
}
MODE=${MODE:-}
LIB=""
if [ "$MODE" = library ]; then LIB=--library; fi
if [ -z "$LIB" ]; then
tests 1 -k "triton_matches_reference"
tests 2 -k "triton_backward"
tests 3 -k "features or table or autotun or fast_path"
tests 4 -k "hopper or prepared or compile or registered"
tests 5 -k "cuda_flash or half_precision or numpy_half"
fi
wpids=()
for i in 0 1 2 3 4 5 6 7; do
    timeout ${WARM_S:-150} python3 dev/triton_hopper_sweep.py $LIB ${SWEEP_ARGS:-} --warm-slice $i/8 > /tmp/warm-$i.txt 2>&1 &
    wpids+=($!)
done
for p in "${wpids[@]}"; do wait $p; done
echo "warm done after $(( $(date +%s) - start )) s" >> $LOG
cat /tmp/warm-*.txt >> $LOG
for p in "${pids[@]+"${pids[@]}"}"; do wait $p; done
cat /tmp/tests-*.txt > $OUT/tests.txt 2>/dev/null
echo "tests done after $(( $(date +%s) - start )) s" >> $LOG
grep -h "passed\|failed\|exit" /tmp/tests-*.txt >> $LOG
timeout ${SWEEP_S:-120} python3 dev/triton_hopper_sweep.py $LIB ${SWEEP_ARGS:-} --out $OUT/sweep.json --runs 3 >> $LOG 2>&1
echo "sweep exit $? after $(( $(date +%s) - start )) s" >> $LOG
