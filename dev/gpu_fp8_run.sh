#!/bin/bash
# shellcheck disable=SC2086  # MEASURE_ARGS is a list of words: split on purpose
# One device call for the FP8 forward (docs/gpu-fp8.md), run from a folder holding the cp312 wheels
# (whl/: attnkern and NumPy 2.4), tests/ and dev/: the FP8 GPU tests and a bfloat16 wgmma subset
# (flash_wgmma.cu and its header changed) in parallel, while dev/gpu_fp8_measure.py compiles and
# measures the errors; its timings wait for the tests to end. Logs and JSON under $OUT.
set -u
out=${OUT:-/tmp/fp8-out}; mkdir -p "$out"
pip install -q --upgrade --no-index --no-deps --target /tmp/site-gpufp8 whl/*.whl
export PYTHONPATH=/tmp/site-gpufp8
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv > "$out/gpu.txt"
rm -f /tmp/fp8-tests-done
ATTNKERN_TEST_GPU=1 timeout "${TESTS_S:-200}" python3 -m pytest tests/test_cuda_fp8.py -q -p no:cacheprovider \
    > "$out/fp8_tests.log" 2>&1 &
t1=$!
ATTNKERN_TEST_GPU=1 timeout "${TESTS_S:-200}" python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider \
    -k "features_half_cuda_cpp and 128-bfloat16 or unrounded and 128-True-bfloat16" > "$out/bf16_tests.log" 2>&1 &
t2=$!
timeout "${MEASURE_S:-280}" python3 dev/gpu_fp8_measure.py "$out/fp8_measure.json" --after /tmp/fp8-tests-done \
    ${MEASURE_ARGS:-} > "$out/measure.log" 2>&1 &
m=$!
wait $t1 $t2
touch /tmp/fp8-tests-done
wait $m
tail -n 3 "$out/fp8_tests.log" "$out/bf16_tests.log"; tail -c 3000 "$out/measure.log"
