#!/bin/bash
# shellcheck disable=SC2086  # MEASURE_ARGS is a list of words: split on purpose
# One device call for FP8's P-rounding divisions (docs/gpu-fp8.md, "P rounded during the softmax"),
# run from a folder holding the cp312 wheels (whl/: attnkern and NumPy 2.4), tests/ and dev/:
# tests/test_cuda_fp8.py for each new division forced (x1c, x1i, x8i: one pytest process each) and
# for everything not run per division (the default's library paths, the new divisions' same-answer
# test), in parallel, while dev/gpu_fp8_measure.py compiles and measures the errors; its timings
# (the new divisions against the default x1, our bfloat16 kernel and every torch SDPA backend)
# wait for the tests to end. Logs and JSON under $OUT (7 files).
set -u
out=${OUT:-/tmp/fp8d-out}; mkdir -p "$out"
pip install -q --upgrade --no-index --no-deps --target /tmp/site-fp8d whl/*.whl
export PYTHONPATH=/tmp/site-fp8d
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv > "$out/gpu.txt"
rm -f /tmp/fp8d-tests-done
pids=()
for sel in x1c x1i x8i "not wg2k"; do
    log="$out/tests_${sel// /_}.log"
    ATTNKERN_TEST_GPU=1 timeout "${TESTS_S:-170}" python3 -m pytest tests/test_cuda_fp8.py -x -q \
        -p no:cacheprovider -k "$sel" > "$log" 2>&1 &
    pids+=($!)
done
timeout "${MEASURE_S:-265}" python3 dev/gpu_fp8_measure.py "$out/fp8_measure.json" --after /tmp/fp8d-tests-done \
    --runs 10 --quantized-configs 1 \
    --fp8-configs "${CONFIGS:-wg2k192s2petx1,wg2k192s2petx1c,wg2k192s2petx1i,wg2k192s2petx8i}" \
    ${MEASURE_ARGS:-} > "$out/measure.log" 2>&1 &
m=$!
wait "${pids[@]}"
touch /tmp/fp8d-tests-done
wait $m
tail -n 2 "$out"/tests_*.log; tail -c 2500 "$out/measure.log"
