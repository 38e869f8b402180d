#!/bin/bash
# The device call behind docs/gpu-backward.md's prepared-backward figures (2026-11-26): the GPU
# tests of the prepared triton.flash autograd path and test_triton.py in full (parallel groups,
# CPUs 4-15), beside dev/gpu_call_overhead.py with triton.flash (CPUs 0-3), then the small grid
# and a quieter rerun of the tiny shape. Run from a
# folder holding whl/ (the attnkern cp312 wheel and a NumPy 2.4 wheel), tests/ and dev/:
#   bash <folder>/dev/triton_overhead_device_run.sh   (writes $OUT/tests.txt, overhead.*, small.*, quiet.txt)
cd "$(dirname "$0")/.."
start=$(date +%s)
S=/tmp/site-triover
pip install -q --no-index --no-deps --upgrade --target $S whl/*.whl > /dev/null 2>&1
[ -d overlay ] && cp -r overlay/. $S/attnkern/
export PYTHONPATH=$S PYTHONUNBUFFERED=1
L=/tmp/logs; mkdir -p $L
el() { echo $(( $(date +%s) - start )); }
P1=""; P2=""
if command -v taskset > /dev/null; then P1="taskset -c 4-15"; P2="taskset -c 0-3"; fi
{ nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
  python3 -c "import triton, torch, attnkern; print('triton', triton.__version__, 'torch', torch.__version__, attnkern.kernel_info('triton.flash')['reason'], attnkern.kernel_info('cuda.flash')['reason'])"; } > $L/env.txt 2>&1
cat $L/env.txt
t() { ATTNKERN_TEST_GPU=1 timeout ${TS:-300} $P1 python3 -m pytest tests/$1 -q -p no:cacheprovider -k "$2" > $L/t_$3.log 2>&1; echo "tests $3 ($2): $(tail -1 $L/t_$3.log) at $(el) s"; }
T=test_triton.py
t $T "prepared or wait" A &
t $T "not backward and not features and not table and not autotun and not prepared and not wait and not fast_path" B &
t $T "backward and not prepared" C &
t $T "features or table or autotun or fast_path" D &
t test_gpu_sync.py "" E &
$P2 timeout 170 python3 dev/gpu_call_overhead.py --kernels triton.flash --shapes tiny,default --calls 30 \
  --cprofile --out $L/ovh > $OUT/overhead.txt 2>&1; echo "overhead exit $? at $(el) s"
$P2 timeout 75 python3 dev/gpu_call_overhead.py --kernels triton.flash --shapes small --quick --calls 20 \
  --out $L/small > $OUT/small.txt 2>&1; echo "small exit $? at $(el) s"
wait
cat $L/env.txt $L/t_*.log > $OUT/tests.txt
grep -h -aE "^FAILED|^E  |passed|failed" $L/t_*.log | head -30
left=$(( 385 - $(el) ))
if [ $left -gt 25 ]; then
  timeout $(( left - 5 )) python3 dev/gpu_call_overhead.py --kernels triton.flash,cuda.flash --shapes tiny --quick \
    --calls 30 > $OUT/quiet.txt 2>&1; echo "quiet exit $? at $(el) s"
fi
cp $L/ovh/overhead.json $OUT/overhead.json 2>/dev/null
cp $L/small/overhead.json $OUT/small.json 2>/dev/null
grep -h "^#" $OUT/overhead.txt $OUT/small.txt $OUT/quiet.txt 2>/dev/null | grep "fwd+bwd" | head -60
