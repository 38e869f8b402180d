#!/bin/bash
# The device machine's second run for the warp-specialized dK/dV kernel (docs/gpu-backward-wgmma.md): its
# first run gave wrong, non-repeatable dK/dV in the plain (MHA) variant at benchmark sizes, so this one
# runs the kernel's variants (cpp.BWD_WS_VARIANT, flash_bwd_mma.cu's ATTNKERN_WSVAR bits: 1 the producer
# as warpgroup 0, 2 no setmaxnreg, 4 a barrier of each consumer warpgroup around each tile, 8 the producer
# waits for its copies and arrives plainly, 16 the producer stores lse and delta plainly and arrives
# for them (release) beside its copies' arrival): per variant
# (but 2, whose consumers spill) dev/gpu_bwd_wgmma_check.py (against float64, repeats bit-identical) and dev/gpu_bwd_versions.py at D = 128
# (diff against the default division: the warp-specialized kernel must give its bits), timed in turns.
pip install -q --no-index --no-deps --target /tmp/site-gpubwd4 whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/site-gpubwd4 PYTHONUNBUFFERED=1
L=/tmp/logs; mkdir -p $L; rm -f /tmp/go_*
here=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader | tee $L/gpu.txt
V128="qwg2x128s2kvwg2x64s3 qwg2x128s2kvwg1x64s2 qwg2x128s2kvwg2x64s3w qwg2x128s2kvwg2x64s4w qwg2x128s2kvwg1x64s2w"
v() { cd /tmp && timeout $3 python3 $here/dev/gpu_bwd_versions.py --ws-variant $1 --dims 128 --sizes $4 --runs 5 \
        --json $OUT/versions_v$1.json --wait-for /tmp/go_$1 --configs $V128 > $L/v$1.log 2>&1; touch /tmp/done_$1; }
v 1 /tmp/go_1 230 "4096" & p1=$!
v 4 /tmp/go_4 240 "4096" & p4=$!
v 2 /tmp/go_2 250 "4096" & p2=$!
v 8 /tmp/go_8 270 "4096 8192" & p8=$!
v 16 /tmp/go_16 290 "4096 8192" & p16=$!
c() { timeout 130 python3 dev/gpu_bwd_wgmma_check.py --ws-variant $1 --sizes 4096 --json $L/check_v$1.json \
        --configs 128=qwg2x128s2kvwg2x64s3w 128=qwg2x128s2kvwg1x64s2w > $L/check_v$1.log 2>&1
      echo "check v$1: $(tail -1 $L/check_v$1.log)"; }
c 1 & c1=$!
c 4 & c4=$!
c 8 & c8=$!
c 16 & c16=$!
wait $c1 $c4 $c8 $c16
for x in 1 4 8 16; do echo "== v$x"; grep -a "FAIL" $L/check_v$x.log | grep -o "D=.*det=[A-Za-z]*" | sort | uniq -c | head -12; done
touch /tmp/go_1; wait $p1; touch /tmp/go_4; wait $p4; touch /tmp/go_2; wait $p2; touch /tmp/go_8; wait $p8; touch /tmp/go_16; wait $p16
for x in 1 4 2 8 16; do echo "== versions v$x"; grep -v Warn $L/v$x.log; done
cat $L/gpu.txt $L/check_v*.log > $OUT/check.log
