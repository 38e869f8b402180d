#!/bin/bash
# shellcheck disable=SC2086  # WORLDS, SEQS and DIMS are lists: split on purpose
# Ring attention on the GPUs of one machine over NCCL: the tests, attnkern ring's
# measurements with cuda.flash and torch.sdpa as local kernels, and torch's own
# context_parallel on the same problems. Results go to $OUT (default ./ring-gpu).
# SEQS, DIMS: the problems (default N 32768 65536, D 64 128); DTYPE: float32 (default),
# bfloat16 or float16; PROFILE=1 adds attnkern ring's --profile-steps (per-step compute and
# communication); TESTS: pytest's -k (default nccl); CONTEXT_PARALLEL=0 skips torch's comparison.
# Needs attnkern installed with its CUDA backend, and two or more GPUs for W > 1.
set -u
OUT=${OUT:-ring-gpu}
mkdir -p "$OUT"
GPUS=$(nvidia-smi -L | wc -l)
WORLDS="1"; for w in 2 4 8; do [ "$w" -le "$GPUS" ] && WORLDS="$WORLDS $w"; done
{ nvidia-smi -L; lscpu | grep -E "Model name"; grep -o -w 'amx_[a-z0-9]*\|avx512_bf16\|avx512_fp16' /proc/cpuinfo \
    | sort -u | tr '\n' ' '; echo; python3 -c "import torch; print('torch', torch.__version__)"; } \
    | tee "$OUT/machine.txt"
echo "== tests (W = $WORLDS)"
rm -rf /tmp/ring-tests && cp -r tests /tmp/ring-tests
(cd /tmp/ring-tests && ATTNKERN_TEST_GPU=1 timeout 240 python3 -m pytest -q -x -p no:cacheprovider test_ring.py \
    -k "${TESTS:-nccl}" 2>&1 | tail -5) | tee "$OUT/tests.txt"
echo "== attnkern ring"
timeout 300 python3 -m attnkern ring --device cuda --world-sizes $WORLDS --seq ${SEQS:-32768 65536} \
    --dim ${DIMS:-64 128} --heads 16 --kernel cuda.flash torch.sdpa --layout zigzag --causal both \
    --dtype "${DTYPE:-float32}" ${PROFILE:+--profile-steps} \
    --repeat 2 --json "$OUT/ring-gpu.json" --plot "$OUT/ring-gpu.png" 2>&1 | grep -v "^\[\|^frame" \
    | tee "$OUT/ring-gpu.txt"
if [ "$GPUS" -ge 2 ] && [ "${CONTEXT_PARALLEL:-1}" = 1 ]; then
    echo "== torch context_parallel"
    timeout 200 python3 -m torch.distributed.run --nproc-per-node "$GPUS" dev/context_parallel_compare.py \
        --seq ${SEQS:-32768 65536} --dim ${DIMS:-64 128} --heads 16 --repeat 2 --json "$OUT/context-parallel.json" \
        2>&1 | grep -v "^\[\|^frame\|^W1" | tail -20 | tee "$OUT/context-parallel.txt"
fi
