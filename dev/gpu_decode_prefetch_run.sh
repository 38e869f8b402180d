#!/bin/bash
# The device call behind docs/gpu-decode-h100.md's "L2 prefetch hint (H100)": cuda.flash's decode
# tests with ATTNKERN_DECODE_PREFETCH=256 forced (7 pytest processes in parallel), then the decode
# timings with the prefetch sizes beside no hint (all on the general path) and the torch SDPA
# backends, in turns; files under $OUT. Copy it to the top of a carried folder holding whl/ (the
# attnkern and NumPy 2.4 cp312 wheels), tests/, dev/ and pyproject.toml (docs/gpu-device.md), and
# run `bash FOLDER/gpu_decode_prefetch_run.sh` there (about 2 minutes on an H100, warm start aside).
# The 2026-11-26 run named no hint "64x2x4" (no hint was then the default); "+PREFETCH=0" now.
cd "$(dirname "$0")"
start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site-gpudec-prefetch whl/*.whl || exit 1
export PYTHONPATH=/tmp/site-gpudec-prefetch PYTHONUNBUFFERED=1 ATTNKERN_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $OUT/gpu.txt 2>&1; cat $OUT/gpu.txt
T=tests/test_cuda_decode.py
P="python3 -m pytest $T -q -p no:cacheprovider"
t=125
{
export ATTNKERN_DECODE_PREFETCH=256
timeout $t $P -k "matches and not triton" > $OUT/t1.log 2>&1 &
timeout $t $P -k "pipeline and (16-1 or 32-1 or 32-2)" > $OUT/t2.log 2>&1 &
timeout $t $P -k "pipeline and (64-2 or 64-4)" > $OUT/t3.log 2>&1 &
timeout $t $P -k "split_rules_and_tiles or shorter_long" > $OUT/t4.log 2>&1 &
timeout $t $P -k "fused_decode_gives and (mha or gqa4 or softcap)" > $OUT/t5.log 2>&1 &
timeout $t $P -k "fused_decode_gives and (gqa8 or lengths or window or d64)" > $OUT/t6.log 2>&1 &
timeout $t $P -k "not matches and not pipeline and not split_rules_and_tiles and not triton and not fused_decode_gives and not shorter_long" > $OUT/t7.log 2>&1 &
wait
unset ATTNKERN_DECODE_PREFETCH
} 2>/dev/null
echo "tests took $(( $(date +%s) - start )) s"; for f in $OUT/t?.log; do echo "$f: $(tail -n 1 $f)"; done
grep -h -E "^(FAILED|ERROR)|Error|assert" $OUT/t?.log | head -20
cat $OUT/t?.log > $OUT/tests.log; rm -f $OUT/t?.log
left=$(( 268 - $(date +%s) + start ))
timeout $left python3 dev/gpu_decode_measure.py --batches 1 4 8 --nk 4096 16384 65536 131072 --runs 5 \
  --decode-configs 64x2x4+PREFETCH=0 64x2x4+PREFETCH=64 64x2x4+PREFETCH=128 64x2x4+PREFETCH=256 \
  --torch cudnn flash efficient --json $OUT/dec.json > $OUT/dec.log 2>&1
echo "rc $?"; grep -v "^B=" $OUT/dec.log | tail -40
echo "all took $(( $(date +%s) - start )) s"
