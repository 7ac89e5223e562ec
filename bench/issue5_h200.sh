#!/bin/bash
# Issue 5's measurements on one H200, one stage per device call (each stays under the 10-minute call limit):
#
#   bash bench/issue5_h200.sh STAGE      (STAGE: start | tests | sdpa | profile [SCHEDULE [KERNELS [GROUPING]]] | bench3b [POLICY [STEPS [SERIAL_GROUPING]]] | policies3b STEPS SERIAL_GROUPING POLICY... | preset NAME | naive7b | run7b [ALLOC_CONF])
#
# Run from the repository root on the device machine with the pydantic wheels carried in .whl/ (made by
# ../shared/tools/gpu-wheels.sh .whl pydantic). Logs and result JSON/PNG go to $OUT (the folder the device
# returns); each stage prints its short summary last. `preset NAME` benches specs/qwen2_5_vl_3b_h200_NAME.yaml
# (clevrer, perception_test, star); `bench3b` one policy (default green:66, 3 steps: ~6-7 minutes with
# serial; serial and rollplex in processes of their own, one call). Move what comes back into bench/results/ with the code's commit.
set -u
STAGE=${1:?stage: start, tests, sdpa, profile [SCHEDULE [KERNELS [GROUPING]]], bench3b [POLICY [STEPS]], preset NAME, naive7b or run7b}
OUT=${OUT:?the device sets OUT}
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=$PWD/.triton-cache
ln -sfn ../kernels rollplex/kernels
# CUDNN=off (environment): the 3B stages run a copy of the spec with run.cudnn_attention false, files tagged _nocudnn
SPEC3B=specs/qwen2_5_vl_3b_h200.yaml; TAG=
if [ "${CUDNN:-on}" = off ]; then
  { cat "$SPEC3B"; printf 'run:\n  cudnn_attention: false\n'; } > specs/.qwen2_5_vl_3b_h200_nocudnn.yaml
  SPEC3B=specs/.qwen2_5_vl_3b_h200_nocudnn.yaml; TAG=_nocudnn
fi
quiet() { grep -v -e USDT -e UserWarning -e "return Variable._execution_engine" -e "_warn_once"; }

case "$STAGE" in
  start)  # one call instead of two (each call pays the machine's start-up): the GPU tests, then the prefix profile
    TESTS_TIMEOUT=180 bash "$0" tests
    PROFILE_TIMEOUT=380 bash "$0" profile serial prefix ;;
  tests)
    timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -q -m gpu tests/executors tests/models tests/rollout \
      tests/memory/test_optimizer.py tests/memory/test_pager.py tests/memory/test_offload.py \
      --tb=short -rfEs 2>&1 > "$OUT/gpu_tests.log"
    tail -8 "$OUT/gpu_tests.log" ;;
  profile)
    SCHEDULE=${2:-serial}  # KERNELS: the ops whose kernels are listed (an op id substring: prefix, actor_backward)
    KERNELS=${3:-actor_backward}
    GROUPING=${4:+--prompts-per-chunk $4}  # the prefixes' prompt grouping (default: the spec's)
    timeout "${PROFILE_TIMEOUT:-540}" python3 bench/profile_step.py "$SPEC3B" --warmup 1 --top 25 \
      --schedule "$SCHEDULE" --kernels "$KERNELS" $GROUPING 2>&1 | quiet | tail -75 > "$OUT/profile_3b_h200${TAG}_${SCHEDULE}_$KERNELS.log"
    cat "$OUT/profile_3b_h200${TAG}_${SCHEDULE}_$KERNELS.log" ;;
  bench3b)  # serial and rollplex each in a process of their own (a schedule run second in one process finds the
    # shapes the first met cached: cuDNN attention plans, GEMM heuristics). The serial run stays in
    # bench/baselines/ (git-ignored: it survives on a machine kept warm) for policies3b.
    POLICY=${2:-green:66}  # SERIAL_GROUPING (4th): --serial-prompts-per-chunk, e.g. all (default: the spec's)
    GROUPING=${4:+--serial-prompts-per-chunk $4}
    mkdir -p bench/baselines
    timeout 330 python3 -m rollplex bench "$SPEC3B" --steps "${3:-3}" --warmup 1 $GROUPING --noise-floor \
      --serial-only --save-serial bench/baselines/serial_3b_h200$TAG.pt 2>&1 | quiet > "$OUT/bench3b.log"
    timeout 250 python3 -m rollplex bench "$SPEC3B" --steps "${3:-3}" --warmup 1 $GROUPING --noise-floor \
      --serial-from bench/baselines/serial_3b_h200$TAG.pt --policies "$POLICY" --out "$OUT/qwen2_5_vl_3b_h200${TAG}_${POLICY//:/}" \
      2>&1 | quiet >> "$OUT/bench3b.log"
    tail -12 "$OUT/bench3b.log" ;;
  policies3b)  # policies3b STEPS GROUPING POLICY...: rollplex only, one process per policy, against the serial run
    # a bench3b left in bench/baselines/ (this machine, kept warm; or carried) with the same STEPS and GROUPING
    STEPS=${2:?steps}; GROUPING=${3:?serial grouping (e.g. all)}; shift 3
    for POLICY in "$@"; do
      timeout 280 python3 -m rollplex bench "$SPEC3B" --steps "$STEPS" --warmup 1 \
        --serial-prompts-per-chunk "$GROUPING" --serial-from bench/baselines/serial_3b_h200$TAG.pt --noise-floor \
        --policies "$POLICY" --out "$OUT/qwen2_5_vl_3b_h200${TAG}_${POLICY//:/}" 2>&1 | quiet >> "$OUT/policies3b.log"
    done
    grep -e "x (ideal" -e Error -e error "$OUT/policies3b.log" | tail -12 ;;
  preset)  # as bench3b, 2 steps, for specs/qwen2_5_vl_3b_h200_NAME.yaml, serial grouping all prompts
    NAME=${2:?preset: clevrer, perception_test or star}
    SPEC=specs/qwen2_5_vl_3b_h200_$NAME.yaml; SAVED=/tmp/serial_$NAME.pt
    timeout 280 python3 -m rollplex bench "$SPEC" --steps 2 --warmup 1 --serial-prompts-per-chunk all --noise-floor \
      --serial-only --save-serial "$SAVED" 2>&1 | quiet > "$OUT/bench_$NAME.log"
    timeout 260 python3 -m rollplex bench "$SPEC" --steps 2 --warmup 1 --serial-prompts-per-chunk all --noise-floor \
      --serial-from "$SAVED" --policies green:66 --out "$OUT/qwen2_5_vl_3b_h200_$NAME" 2>&1 | quiet >> "$OUT/bench_$NAME.log"
    tail -8 "$OUT/bench_$NAME.log" ;;
  sdpa)  # what new attention shapes cost per SDPA backend (each in its own process), the runtime's shapes
    timeout 500 python3 bench/sdpa_shapes.py --model qwen2_5_vl_3b --steps 3 --out "$OUT/sdpa_shapes_3b_h200.json" 2>&1 \
      | quiet | tail -20 | tee "$OUT/sdpa_shapes.log" ;;
  naive7b)
    timeout 300 python3 bench/naive_oom.py specs/qwen2_5_vl_7b_h200.yaml --out "$OUT/naive_oom_7b_h200.json" 2>&1 \
      | quiet | tail -20 ;;
  run7b)  # run7b [ALLOC_CONF]: e.g. expandable_segments:True (the allocator's reserve above its peak is fragmentation)
    [ -n "${2:-}" ] && export PYTORCH_CUDA_ALLOC_CONF=$2
    timeout 560 python3 -m rollplex run specs/qwen2_5_vl_7b_h200.yaml --steps 3 --out /tmp/r7 --quiet --no-checkpoints 2>&1 | quiet \
      | tail -20 > "$OUT/run7b.log"
    cp /tmp/r7/metrics.jsonl "$OUT/run_7b_h200_metrics.jsonl" 2>/dev/null
    cat "$OUT/run7b.log" ;;
  *)
    echo "unknown stage $STAGE" >&2; exit 2 ;;
esac
