#!/bin/bash
# shellcheck disable=SC2086  # P is a command line of words: split on purpose
# A 2-GPU device call, run from a checkout whose .dev-lead/ holds whl/ (the cp312 wheels) and src/ (tests/, dev/):
# (A) GPU 1: the dynamic persistent walk Pd forced as default + bit identity, the backward after the
#     fused-path merge, triton.flash with the new table; GPU 0: the D 64 grid default vs P vs Pd;
# (B) both GPUs: the NCCL ring tests, then ring scaling W 1 -> 2, bfloat16 and float32, causal zigzag.
O=${OUT:-/tmp/out}; mkdir -p "$O/logs"; L=$O/logs; T0=$(date +%s)
at() { echo "== $1 at $(( $(date +%s) - T0 )) s"; }
nvidia-smi -L
S=/tmp/site_f; rm -rf $S; pip install -q --no-index --no-deps --target $S .dev-lead/whl/*.whl .dev-lead/whl/optuna/*.whl 2>&1 | grep -v WARN
export PYTHONPATH=$S PYTHONUNBUFFERED=1
rm -rf /tmp/t && cp -r .dev-lead/src /tmp/t && cd /tmp/t || exit
at installed
P="timeout 130 python3 -m pytest -q -p no:cacheprovider -rf"
( export ATTNKERN_TEST_GPU=1 CUDA_VISIBLE_DEVICES=1
  for id in Pd-bfloat16-128-wg2k176s2pet Pd-bfloat16-64-wg2k128s3et; do
    $P "tests/test_cuda.py::test_wgmma_persistent_bit_identical[$id]" > $L/t_bits_$id.txt 2>&1 &
  done
  WGMMA_DEFAULT="64=wg2k128s3etPd,128=wg2k176s2petPd" PYTHONPATH=$S:dev $P -p pytest_wgmma_default tests/test_cuda.py \
      -k "(matches_reference or bitwise or fast_path_matches or wgmma or repeated_featured) and not bit_identical" > $L/t_pd_forced.txt 2>&1 &
  WGMMA_DEFAULT="64=wg2k128s3etPd,128=wg2k176s2petPd" PYTHONPATH=$S:dev $P -p pytest_wgmma_default tests/test_cuda.py -k "features_half_cuda_cpp and (64 or 128)" > $L/t_pd_features.txt 2>&1 &
  $P tests/test_cuda_backward.py -k "wgmma_backward_routing or half_backward_features or fused" > $L/t_bwd.txt 2>&1 &
  $P tests/test_triton.py -k "triton_matches_reference or table or fast_path" > $L/t_triton.txt 2>&1 &
  wait ) &
TA=$!
CUDA_VISIBLE_DEVICES=0 timeout 130 python3 dev/gpu_flash_versions.py $O/grid-d64.json --dims 64 --batches 2,4,8 --sizes 2048,4096 --dtypes bfloat16 --runs 3 --warmup-s 0.05 --configs default,wg2k128s3etP,wg2k128s3etPd > $L/grid-d64.txt 2>&1
at "grid done"
grep -v "^{" $L/grid-d64.txt | grep -v Warn | grep -v "torch.sdpa \|torch.flash\|torch.efficient"; grep odd_error $L/grid-d64.txt | cut -c1-200
wait $TA
at "tests done"; for f in $L/t_*.txt; do echo "-- $f"; grep -E "passed|failed|FAILED|rror" $f | grep -v Warn | tail -4; done
ATTNKERN_TEST_GPU=1 timeout 95 python3 -m pytest -q -p no:cacheprovider -rf tests/test_ring.py -k nccl > $L/t_ring.txt 2>&1
at "ring tests"; grep -E "passed|failed|FAILED|rror" $L/t_ring.txt | tail -4
cd /tmp || exit
for dt in bfloat16 float32; do
  timeout 60 python3 -m attnkern ring --device cuda --world-sizes 1 2 --dtype $dt --seq 32768 --dim 128 \
    --heads 16 --kernel cuda.flash --layout zigzag --causal yes --repeat 5 --profile-steps --json $O/ring-$dt.json 2>&1 | grep -v Warn | tail -14
  at "ring $dt"
done
(cd $O && tar czf logs.tgz logs && rm -rf logs)
at "all done"
