#!/bin/bash
# triton.flash on the device machine in one call: correctness (the GPU tests that run triton.flash,
# in parallel) while worker processes fill Triton's cache with the configs to time, then the config
# sweep, the large tables (old config vs the table's vs torch's SDPA backends) and the small grid
# with the per-call overhead (dev/triton_measure.py, dev/gpu_half_measure.py).
#
#   OUT=<dir> bash dev/triton_device_run.sh [PARTS]     (PARTS: tests,configs,tables,small; default all)
#   env: TEST_S, WARM_S, MEASURE_S, SMALL_S (time limits), NS, DTYPES (the tables' lengths and dtypes),
#   WARM_ARGS (more arguments of the warm part)
#
# Run from a folder holding whl/ (the attnkern cp312 wheel and a NumPy 2.4 wheel), tests/, dev/,
# pyproject.toml and, for the "old" column, old_flash.py (an earlier attnkern/backends/triton/flash.py);
# overlay/ (optional) is copied over the installed attnkern package (Python files changed since the
# wheel was built). Writes $OUT/log.txt, tests.txt, measure.json, small.json.
set -u
PARTS=${1:-tests,configs,tables,small}
S=/tmp/site-tribwd
rm -rf $S && pip install -q --no-index --no-deps --target $S whl/*.whl 2>&1 | tail -2
[ -d overlay ] && cp -r overlay/. $S/attnkern/
export PYTHONPATH=$S
LOG=$OUT/log.txt
python3 -c "import triton, torch; print('triton', triton.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())" >> $LOG 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv >> $LOG 2>&1
OLD=""; [ -f old_flash.py ] && OLD="--old old_flash.py"
start=$(date +%s)
pids=()
tests() {  # N FILE [-k EXPR]
    local n=$1; shift
    ( ATTNKERN_TEST_GPU=1 timeout ${TEST_S:-300} python3 -m pytest -q -p no:cacheprovider "$@" > /tmp/tests-$n.txt 2>&1
      echo "exit $? after $(( $(date +%s) - start )) s: $*" >> /tmp/tests-$n.txt ) &
    pids+=($!)
}
if [[ $PARTS == *tests* ]]; then
    tests 1 tests/test_triton.py -k "not backward and not features and not table and not autotun"
    tests 2 tests/test_triton.py -k backward
    tests 3 tests/test_triton.py -k "features or table or autotun or fast_path"
    tests 4 tests/test_combinations.py -k triton
    tests 5 tests/test_dropin.py
fi
if [[ $PARTS == *configs* || $PARTS == *tables* ]]; then
    wpids=()
    for i in 0 1 2 3 4 5 6 7 8 9; do  # compile every config to be timed, 10 processes
        timeout ${WARM_S:-240} python3 dev/triton_measure.py --parts warm --warm-slice $i/10 $OLD ${WARM_ARGS:-} > /tmp/warm-$i.txt 2>&1 &
        wpids+=($!)
    done
    for p in "${wpids[@]}"; do wait $p; done
    echo "warm done after $(( $(date +%s) - start )) s" >> $LOG
    cat /tmp/warm-*.txt >> $LOG
fi
for p in "${pids[@]}"; do wait $p; done
cat /tmp/tests-*.txt > $OUT/tests.txt 2>/dev/null
echo "tests done after $(( $(date +%s) - start )) s" >> $LOG
grep -h "passed\|failed\|exit" /tmp/tests-*.txt >> $LOG
MP=""
[[ $PARTS == *configs* ]] && MP="configs"
[[ $PARTS == *tables* ]] && MP="${MP:+$MP,}tables"
[[ $PARTS == *small* ]] && MP="${MP:+$MP,}overhead"
if [ -n "$MP" ]; then
    timeout ${MEASURE_S:-200} python3 dev/triton_measure.py --parts $MP $OLD --ns ${NS:-2048,4096,8192,16384} --dtypes ${DTYPES:-bfloat16,float16} --out $OUT/measure.json >> $LOG 2>&1
    echo "measure exit $? after $(( $(date +%s) - start )) s" >> $LOG
fi
if [[ $PARTS == *small* ]]; then
    timeout ${SMALL_S:-90} python3 dev/gpu_half_measure.py $OUT/small.json --parts small --kernels triton.flash,torch.sdpa \
        --dtypes bfloat16 >> $LOG 2>&1
    echo "small exit $? after $(( $(date +%s) - start )) s" >> $LOG
fi
