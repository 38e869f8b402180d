#!/bin/bash
# shellcheck disable=SC2086  # a variant is a list of words: split on purpose
# Compiles cuda.flash's CUDA C++ tensor-core sources (flash_mma.cu, flash_wgmma.cu,
# flash_tf32.cu, flash_bwd_mma.cu, each after flash_common.cuh (and flash_wgmma_common.cuh), as cpp._linked_kernel hands them to NVRTC)
# with nvcc for sm_90a, in several of the variants the library builds: a check that needs
# nvcc but no GPU (the device machine compiles them on first use, and a broken source
# breaks every half-precision cuda.flash call there). -v prints registers and spills
# of each device function (compiled alone, without the kernel's launch bounds).
# Usage: dev/cuda_compile_check.sh [-v] [repository root, default .]
set -u
verbose=0; [ "${1:-}" = -v ] && { verbose=1; shift; }
src=${1:-.}/attnkern/backends/cuda
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
fail=0
for variant in "mma D=64 BN=64 MT=1 NW=8" "mma D=128 BN=32 MT=1 NW=8 FEAT=1 MASK=1" \
        "mma D=64 BN=64 MT=2 NW=4 BF16=0 FEAT=1 ALIBI=1" "wgmma D=64 BN=128 NWG=3" "wgmma D=128 BN=64 NWG=2 FEAT=1 FAST=1" \
        "mma D=128 BN=32 MT=1 NW=8 WIDE=1" "wgmma D=64 BN=128 NWG=3 WIDE=1" \
        "wgmma D=128 BN=128 NWG=2 WS=1 STAGES=2" "wgmma D=64 BN=128 NWG=2 WS=1 STAGES=3 PINGPONG=1 FEAT=1 MASK=1" \
        "wgmma D=128 BN=176 NWG=2 WS=1 STAGES=2 PINGPONG=1 EARLYK=1 TMA=1" "wgmma D=128 BN=176 NWG=2 WS=1 STAGES=2 PINGPONG=1 EARLYK=1 TMA=1 PERSIST=1" "wgmma D=128 BN=176 NWG=2 WS=1 STAGES=2 PINGPONG=1 EARLYK=1 TMA=1 PERSIST=2" \
        "wgmma D=64 BN=128 NWG=2 WS=1 STAGES=3 EARLYK=1 TMA=1 PERSIST=1 WIDE=1" "wgmma D=64 BN=128 NWG=2 WS=1 STAGES=3 EARLYK=1 TMA=1 WIDE=1" \
        "wgmma D=128 BN=128 NWG=2 WS=1 STAGES=3 WIDE=1 BF16=0" "wgmma D=64 BN=64 NWG=3 WS=1 STAGES=3 FEAT=1 ALIBI=1" \
        "wgmma D=128 BN=128 NWG=2 WS=1 STAGES=4 EARLYK=1 FP8=1" "wgmma D=128 BN=128 NWG=2 WS=1 STAGES=4 EARLYK=1 PINGPONG=1 FP8=1 FEAT=1" \
        "wgmma D=128 BN=192 NWG=2 WS=1 STAGES=2 EARLYK=1 PINGPONG=1 TMA=1 FP8=1 FP8_EXP=1" \
        "wgmma D=128 BN=160 NWG=2 WS=1 STAGES=3 EARLYK=1 PINGPONG=1 TMA=1 FP8=1 FP8_EXP=4 FEAT=1" "fp8_vt NAME=attend" \
        "tf32 D=64 BN=64 MT=1 NW=8" "tf32 D=128 BN=32 MT=1 NW=8 FEAT=1" \
        "mma D=64 BN=64 MT=2 NW=4 FEAT=1 DROPOUT=1" "mma D=128 BN=64 MT=2 NW=4 QSMEM=1 BF16=0 FEAT=1 DROPOUT=1" \
        "bwd_mma D=128 BN=64 MT=1 NW=4 PART=1" "bwd_mma D=128 BN=64 MT=1 NW=4 PART=2" \
        "bwd_mma D=64 BN=64 MT=1 NW=4 PART=1 FEAT=1 DROPOUT=1" "bwd_mma D=64 BN=128 MT=1 NW=4 PART=2 FEAT=1 DROPOUT=1" \
        "bwd_mma D=128 BN=64 MT=1 NW=4 PART=1 FEAT=1 DROPOUT=1 BF16=0" \
        "bwd_mma D=128 BN=64 MT=1 NW=4 PART=2 FEAT=1 DROPOUT=1 MASK=1" \
        "mma D=64 BN=64 MT=2 NW=4 FEAT=1 VARLEN=1 ALIBI=1" "bwd_mma D=64 BN=64 MT=1 NW=4 PART=1 FEAT=1 VARLEN=1" \
        "bwd_mma D=64 BN=128 MT=1 NW=4 PART=2 FEAT=1 VARLEN=1 DROPOUT=1 BF16=0" \
        "bwd_mma D=64 BN=64 MT=1 NW=8 PART=3" "bwd_mma D=128 BN=64 MT=1 NW=8 PART=3" \
        "bwd_mma D=64 BN=64 MT=1 NW=8 PART=3 FEAT=1 BF16=0" "bwd_mma D=128 BN=64 MT=1 NW=8 PART=3 FEAT=1" \
        "bwd_mma D=64 BN=64 MT=1 NW=8 PART=4" "bwd_mma D=128 BN=64 MT=1 NW=8 PART=4 FEAT=1 BF16=0" \
        "bwd_mma D=64 BN=128 MT=1 NW=4 PART=3 STAGES=2" "bwd_mma D=128 BN=64 MT=1 NW=8 PART=3 STAGES=3 FEAT=1" \
        "bwd_mma D=64 BN=128 MT=1 NW=4 PART=4 STAGES=2 FEAT=1 BF16=0" "bwd_mma D=128 BN=128 MT=1 NW=8 PART=4 STAGES=2" \
        "mma D=256 BN=64 MT=1 NW=4 QSMEM=1" "mma D=256 BN=32 MT=1 NW=4 QSMEM=1 FEAT=1 DROPOUT=1 VARLEN=1 BF16=0" \
        "bwd_mma D=256 BN=32 MT=1 NW=4 PART=1" "bwd_mma D=256 BN=32 MT=1 NW=4 PART=2 DSPLIT=2 FEAT=1 DROPOUT=1 MASK=1" \
        "bwd_mma D=208 BN=32 MT=1 NW=4 PART=1 DSPLIT=2 FEAT=1 VARLEN=1" "bwd_mma D=160 BN=32 MT=1 NW=4 PART=2 DSPLIT=2"; do
    set -- $variant; kind=$1; shift
    declare -A def=([BF16]=1 [QSMEM]=0 [FEAT]=0 [MASK]=0 [ALIBI]=0 [FAST]=0 [WIDE]=0 [DROPOUT]=0 [VARLEN]=0 [PART]=1 [NAME]=attend
                     [DYNAMIC]=1)
    for kv in "$@"; do def[${kv%=*}]=${kv#*=}; done
    { for k in "${!def[@]}"; do echo "#define ATTNKERN_$k ${def[$k]}"; done
      # the wgmma wrappers before the sources that use them (cpp.source_headers)
      wg=""; { [ "$kind" = wgmma ] || [ "${def[PART]}" -ge 3 ]; } && wg="$src/flash_wgmma_common.cuh"
      cat "$src/flash_common.cuh" $wg "$src/flash_$kind.cu"; } > "$work/t.cu"
    unset def
    if nvcc -gencode arch=compute_90a,code=sm_90a -rdc=true -Xptxas -v -c "$work/t.cu" -o "$work/t.o" \
            2> "$work/err.txt"; then
        echo "ok   $variant$([ $verbose = 1 ] && grep -o 'Used [0-9]* registers\|[0-9]* bytes spill stores' \
            "$work/err.txt" | tr '\n' ' ' | sed 's/^/: /')"
    else
        echo "FAIL $variant"; grep -v "^ptxas info" "$work/err.txt" | head -8; fail=1
    fi
done
exit $fail
