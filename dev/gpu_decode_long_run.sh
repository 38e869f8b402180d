#!/bin/bash
# The device call behind docs/gpu-decode.md's "Long chunks and 64-key tiles (H100)": the decode
# tests of cuda.flash (4 pytest processes in parallel, at the defaults of the wheel), then the
# decode timings with the split rules and tiles side by side, files under $OUT. Copy it to the top
# of a carried folder holding whl/ (the attnkern and NumPy 2.4 cp312 wheels), tests/, dev/ and
# pyproject.toml (docs/gpu-device.md), and run `bash FOLDER/gpu_decode_long_run.sh [SECONDS]` there
# (SECONDS: the whole run's budget, 230 by default).
cd "$(dirname "$0")"
budget=${1:-230}
start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site-gpudec3 whl/*.whl || exit 1
export PYTHONPATH=/tmp/site-gpudec3 PYTHONUNBUFFERED=1 ATTNKERN_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $OUT/gpu.txt 2>&1
python3 -c "from attnkern.backends.cuda import cpp; print('defaults', cpp.DECODE_TILE, cpp.DECODE_STAGES, cpp.DECODE_KEY_WARPS, cpp.DECODE_SPLIT_RULE)"
T=tests/test_cuda_decode.py
timeout 100 python3 -m pytest $T -q -p no:cacheprovider -k "matches and not triton" > $OUT/t1.log 2>&1 &
timeout 100 python3 -m pytest $T -q -p no:cacheprovider -k "pipeline" > $OUT/t2.log 2>&1 &
timeout 100 python3 -m pytest $T -q -p no:cacheprovider -k "split_rules_and_tiles" > $OUT/t3.log 2>&1 &
timeout 100 python3 -m pytest $T -q -p no:cacheprovider \
  -k "not matches and not pipeline and not split_rules_and_tiles and not triton" > $OUT/t4.log 2>&1 &
wait
echo "tests took $(( $(date +%s) - start )) s"; for f in $OUT/t?.log; do echo "$f: $(tail -n 1 $f)"; done
grep -h -E "^(FAILED|ERROR)|Error|assert" $OUT/t?.log | head -20
left=$(( budget - $(date +%s) + start ))
timeout $left python3 dev/gpu_decode_measure.py --batches 1 4 8 --nk 4096 16384 65536 131072 --runs 5 \
  --decode-configs 32x3x1:waves 64x2x4:waves 32x3x1:long 64x3x4:long --torch cudnn flash efficient \
  --json $OUT/dec.json > $OUT/dec.log 2>&1
grep -v "^B=" $OUT/dec.log | tail -40
echo "all took $(( $(date +%s) - start )) s"
