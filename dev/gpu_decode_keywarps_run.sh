#!/bin/bash
# The device call behind docs/gpu-decode.md's "Key warps and tiles (H100)": the decode tests
# (4 pytest processes in parallel), then the decode timings, files under $OUT. Copy it to the top
# of a carried folder holding whl/ (the attnkern and NumPy 2.4 cp312 wheels), tests/, dev/ and
# pyproject.toml (docs/gpu-device.md), and run `bash FOLDER/gpu_decode_keywarps_run.sh` there.
cd "$(dirname "$0")"
python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site-gpudec2 whl/*.whl || exit 1
export PYTHONPATH=/tmp/site-gpudec2 PYTHONUNBUFFERED=1 ATTNKERN_TEST_GPU=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $OUT/gpu.txt 2>&1
T=tests/test_cuda_decode.py
start=$(date +%s)
timeout 150 python3 -m pytest $T -v -p no:cacheprovider -k "matches and not triton" > $OUT/t1.log 2>&1 &
timeout 150 python3 -m pytest $T -v -p no:cacheprovider -k "pipeline" > $OUT/t2.log 2>&1 &
timeout 150 python3 -m pytest $T -v -p no:cacheprovider -k "matches and triton" > $OUT/t3.log 2>&1 &
timeout 150 python3 -m pytest $T -v -p no:cacheprovider -k "not matches and not pipeline" > $OUT/t4.log 2>&1 &
wait
echo "tests took $(( $(date +%s) - start )) s"; tail -n 3 $OUT/t?.log
left=$(( 285 - $(date +%s) + start ))
timeout $left python3 dev/gpu_decode_measure.py --batches 1 4 8 --nk 4096 16384 65536 131072 --runs 5 --before --rules \
  --decode-configs 32x3x1 64x3x4 64x2x4 --torch cudnn flash efficient --json $OUT/dec.json 2>&1 | tee $OUT/dec.log | grep -v "^B=" 
echo "all took $(( $(date +%s) - start )) s"
