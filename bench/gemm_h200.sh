#!/bin/bash
# Issue 6's layout GEMMs on one H200, one stage per device call:
#
#   bash bench/gemm_h200.sh tests | sweep | picked | focus | wide
#     tests:  the kernels' GPU tests (tests/kernels -m gpu) -> $OUT/kernels_gpu_tests.log
#     sweep:  bench/gemm_layouts.py --sweep (every shape, the picked tiles and the swept ones; compiled first in
#             16 parallel processes) -> $OUT/gemm_sweep_h200.json
#     picked: bench/gemm_layouts.py with the picked tiles only -> $OUT/gemm_layouts_h200.json
#     focus:  the sweep where the picked tiles can miss their targets: 7B decode at 32 and 64 rows, 3B at 64 rows,
#             and the QKV prefill -> $OUT/gemm_focus_{7b_decode,3b_decode,qkv_prefill}_h200.json
#     wide:   7B TP-1 QKV decode (32, 64 rows) over warps and K tiles too -> $OUT/gemm_wide_7b_qkv_h200.json
#     swap:   the swap_gemm and qkv GPU tests -> $OUT/swap_gpu_tests.log, swap_gemm's tiles swept on every fused QKV
#             at decode rows -> $OUT/gemm_swap_sweep_h200.json, then the picked stage
#
# Run from the repository root on the device machine with the pydantic wheels carried in .whl/ (made by
# ../shared/tools/gpu-wheels.sh .whl pydantic). Each stage prints its table last. Move what comes back into
# bench/results/ with the code's commit.
set -uo pipefail  # a stage's status is its python's (through the tail), not tail's
STAGE=${1:?stage: tests, sweep or picked}
OUT=${OUT:?the device sets OUT}
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
  || { echo "gemm_h200: installing .whl/*.whl failed (made by ../shared/tools/gpu-wheels.sh .whl pydantic)" >&2; exit 2; }
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=$PWD/.triton-cache
case "$STAGE" in
  tests)
    timeout 240 python3 -m pytest -q -m gpu tests/kernels --tb=short -rfEs > "$OUT/kernels_gpu_tests.log" 2>&1
    status=$?; tail -5 "$OUT/kernels_gpu_tests.log"; exit $status ;;
  sweep)
    for i in $(seq 0 15); do
      timeout 200 python3 bench/gemm_layouts.py --sweep --compile-only --shard "$i/16" > /dev/null 2>&1 &
    done
    wait
    timeout 360 python3 bench/gemm_layouts.py --sweep --out "$OUT/gemm_sweep_h200.json" 2>&1 | tail -64 ;;
  focus)
    sweep_set() {  # NAME ARGS...: compile in 16 processes, then time
      for i in $(seq 0 15); do
        timeout 150 python3 bench/gemm_layouts.py --sweep --compile-only --shard "$i/16" "${@:2}" > /dev/null 2>&1 &
      done
      wait
      timeout 150 python3 bench/gemm_layouts.py --sweep "${@:2}" --out "$OUT/gemm_focus_$1_h200.json" 2>&1 | tail -14
    }
    sweep_set 7b_decode --models 7b --rows 32 64
    sweep_set 3b_decode --models 3b --rows 64
    sweep_set qkv_prefill --ops qkv --rows 4096 ;;
  wide)
    for i in $(seq 0 15); do
      timeout 120 python3 bench/gemm_layouts.py --sweep --wide --models 7b --tp 1 --ops qkv --rows 32 64 \
        --compile-only --shard "$i/16" > /dev/null 2>&1 &
    done
    wait
    timeout 120 python3 bench/gemm_layouts.py --sweep --wide --models 7b --tp 1 --ops qkv --rows 32 64 \
      --out "$OUT/gemm_wide_7b_qkv_h200.json" 2>&1 | tail -4 ;;
  swap)
    timeout 150 python3 -m pytest -q -m gpu tests/kernels/test_swap_gemm.py tests/kernels/test_qkv_gemm.py --tb=short \
      -rfEs > "$OUT/swap_gpu_tests.log" 2>&1
    tail -3 "$OUT/swap_gpu_tests.log"
    for i in $(seq 0 15); do
      timeout 100 python3 bench/gemm_layouts.py --sweep --swap --ops qkv --rows 1 8 32 64 --compile-only \
        --shard "$i/16" > /dev/null 2>&1 &
    done
    wait
    timeout 100 python3 bench/gemm_layouts.py --sweep --swap --ops qkv --rows 1 8 32 64 \
      --out "$OUT/gemm_swap_sweep_h200.json" 2>&1 | tail -18
    exec bash "$0" picked ;;
  picked)
    for i in $(seq 0 15); do
      timeout 120 python3 bench/gemm_layouts.py --compile-only --shard "$i/16" > /dev/null 2>&1 &
    done
    wait
    timeout 300 python3 bench/gemm_layouts.py --out "$OUT/gemm_layouts_h200.json" 2>&1 | tail -64 ;;
  *)
    echo "unknown stage $STAGE" >&2; exit 2 ;;
esac
