#!/bin/bash
# The device call behind docs/gpu-decode.md's "Fused combine (H100)": cuda.flash's decode tests
# (7 pytest processes in parallel, the wheel's defaults and the fused / two-launch / shorter-chunk
# variants the tests force), then the decode timings with the variants side by side, then a host
# profile of isolated calls; files under $OUT. Copy it to the top of a carried folder holding whl/
# (the attnkern and NumPy 2.4 cp312 wheels), tests/, dev/ and pyproject.toml (docs/gpu-device.md),
# and run `bash FOLDER/gpu_decode_fused_run.sh [SECONDS]` there (SECONDS: the whole run's budget,
# 290 by default).
cd "$(dirname "$0")"
budget=${1:-290}
start=$(date +%s)
# --upgrade: a warm machine may hold an earlier call's install there, which pip would otherwise keep
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site-gpudec4 whl/*.whl || exit 1
export PYTHONPATH=/tmp/site-gpudec4 PYTHONUNBUFFERED=1 ATTNKERN_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $OUT/gpu.txt 2>&1
python3 -c "from attnkern.backends.cuda import cpp; print('defaults', cpp.DECODE_TILE, cpp.DECODE_STAGES, cpp.DECODE_KEY_WARPS, cpp.DECODE_SPLIT_RULE, 'fused', cpp.DECODE_FUSED, 'long min chunk', cpp.DECODE_LONG_MIN_CHUNK)"
T=tests/test_cuda_decode.py
P="python3 -m pytest $T -q -p no:cacheprovider"
t=140
{
timeout $t $P -k "matches and not triton" > $OUT/t1.log 2>&1 &
timeout $t $P -k "pipeline and (16-1 or 32-1 or 32-2)" > $OUT/t2.log 2>&1 &
timeout $t $P -k "pipeline and (64-2 or 64-4)" > $OUT/t3.log 2>&1 &
timeout $t $P -k "split_rules_and_tiles or shorter_long" > $OUT/t4.log 2>&1 &
timeout $t $P -k "fused_decode_gives and (mha or gqa4 or softcap)" > $OUT/t5.log 2>&1 &
timeout $t $P -k "fused_decode_gives and (gqa8 or lengths or window or d64)" > $OUT/t6.log 2>&1 &
timeout $t $P -k "not matches and not pipeline and not split_rules_and_tiles and not triton and not fused_decode_gives and not shorter_long" > $OUT/t7.log 2>&1 &
wait
} 2>/dev/null
echo "tests took $(( $(date +%s) - start )) s"; for f in $OUT/t?.log; do echo "$f: $(tail -n 1 $f)"; done
grep -h -E "^(FAILED|ERROR)|Error|assert" $OUT/t?.log | head -20
cat $OUT/t?.log > $OUT/tests.log; rm -f $OUT/t?.log
left=$(( budget - 30 - $(date +%s) + start ))
timeout $left python3 dev/gpu_decode_measure.py --batches 1 4 8 --nk 4096 16384 65536 131072 --runs 5 \
  --decode-configs 64x2x4+FUSED=0 64x2x4+LONG_MIN_CHUNK=128 64x3x4+LONG_MIN_CHUNK=128 \
  --torch cudnn flash efficient --json $OUT/dec.json > $OUT/dec.log 2>&1
grep -v "^B=" $OUT/dec.log | tail -30
echo "timings took $(( $(date +%s) - start )) s"
left=$(( budget - $(date +%s) + start ))
timeout $left python3 dev/gpu_decode_measure.py --batches 1 --nk 4096 131072 --runs 3 --host-profile 30 \
  --torch cudnn --json $OUT/host.json > $OUT/host.log 2>&1
grep -E "host |isolated|^ +[0-9]" $OUT/host.log | head -60
echo "all took $(( $(date +%s) - start )) s"
