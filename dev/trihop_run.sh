#!/bin/bash
# triton.flash's forward on Hopper across batches 1-8 in one device call: the GPU tests of
# tests/test_triton.py (the Hopper variant forced on every call that can take it), of the finite
# scan (tests/test_cuda.py, tests/test_gpu_sync.py) and of each new candidate config of
# dev/trihop_sweep.py forced (dev/pytest_triton_hopper_config.py), in parallel, while worker
# processes compile the sweep's kernels into Triton's cache; then, on the quiet GPU,
# dev/trihop_sweep.py (the library call with and without check_finite, the kernel launched
# directly, the candidates, the finite scan before and after, every torch SDPA backend; 3 runs).
#
#   OUT=<dir> bash dev/trihop_run.sh    (env: TEST_S, WARM_S: time limits; END_S: the sweep
#                                        starts no row after this many seconds from the start)
#
# Run from a folder holding whl/ (the attnkern cp312 wheel and a NumPy 2.4 wheel), tests/, dev/
# and pyproject.toml (no attnkern/ source tree: the wheel is imported). Writes $OUT/log.txt,
# tests.txt, sweep.json.
set -u
start=$(date +%s)
S=/tmp/site-trihop
rm -rf $S && pip install -q --no-index --no-deps --target $S whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$S PYTHONUNBUFFERED=1
LOG=$OUT/log.txt
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())" >> $LOG 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv >> $LOG 2>&1
pids=()
tests() {  # NAME ENV... -- PYTEST ARGS
    local n=$1; shift
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    ( env ATTNKERN_TEST_GPU=1 "${envs[@]}" timeout ${TEST_S:-135} python3 -m pytest -q -p no:cacheprovider "$@" \
        > /tmp/tests-$n.txt 2>&1
      echo "exit $? after $(( $(date +%s) - start )) s: ${envs[*]} $*" >> /tmp/tests-$n.txt ) &
    pids+=($!)
}
H=ATTNKERN_TRITON_HOPPER=all
tests 1 $H -- tests/test_triton.py -k "triton_matches_reference"
tests 2 $H -- tests/test_triton.py -k "triton_backward"
tests 3 $H -- tests/test_triton.py -k "features or table or autotun or fast_path"
tests 4 $H -- tests/test_triton.py -k "hopper or prepared or compile or registered"
tests 5 $H -- tests/test_triton.py -k "cuda_flash or half_precision or numpy_half"
tests 6 -- tests/test_cuda.py tests/test_gpu_sync.py -k "finite or fast_path_matches or bad_input or overflowing"
i=7
for cfg in 128,64,8,3,0 128,64,4,4,0 128,128,8,3,0 128,64,8,4,0; do
    tests $i $H TRITON_HOPPER_CONFIG=$cfg PYTHONPATH=$S:dev -- -p pytest_triton_hopper_config tests/test_triton.py \
        -k "hopper_variant_matches or table_configs_match or triton_features_match"
    i=$((i + 1))
done
wpids=()
for i in 0 1 2 3 4 5; do
    timeout ${WARM_S:-105} python3 dev/trihop_sweep.py --warm-slice $i/6 > /tmp/warm-$i.txt 2>&1 &
    wpids+=($!)
done
for p in "${wpids[@]}"; do wait $p; done
echo "warm done after $(( $(date +%s) - start )) s" >> $LOG
cat /tmp/warm-*.txt >> $LOG
for p in "${pids[@]}"; do wait $p; done
cat /tmp/tests-*.txt > $OUT/tests.txt 2>/dev/null
echo "tests done after $(( $(date +%s) - start )) s" >> $LOG
grep -h "passed\|failed\|exit" /tmp/tests-*.txt >> $LOG
left=$(( ${END_S:-245} - ($(date +%s) - start) ))
timeout $(( left + 20 )) python3 dev/trihop_sweep.py --out $OUT/sweep.json --runs 3 --deadline $left >> $LOG 2>&1
echo "sweep exit $? after $(( $(date +%s) - start )) s" >> $LOG
