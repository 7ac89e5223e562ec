#!/bin/bash
# Issue 5's measurements on one H200, one stage per device call (each stays under the 10-minute call limit):
#
#   bash bench/issue5_h200.sh STAGE
#     tests | profile [SCHEDULE [KERNELS [GROUPING]]] | unsplit3b [STEPS] | bench3b [POLICY [STEPS [SERIAL_GROUPING]]]
#     | policies3b STEPS SERIAL_GROUPING POLICY... (two policies per call at most) | preset NAME [POLICY...] | naive7b
#     | run7b [ALLOC_CONF] | share | inprocess | split (SPLIT_SMS, SPLIT_KERNELS, SPLIT_TIMEOUT)
#   CUDNN=off bash bench/issue5_h200.sh STAGE: the 3B stages (profile, bench3b, policies3b, preset) run a copy of
#     their spec with run.cudnn_attention false; their files are tagged _nocudnn
#   PPC=N bash bench/issue5_h200.sh STAGE: the same with sharing.prompts_per_chunk N (rollplex's prefix grouping
#     beside decode, and so of its prefix backward; the 3B specs group all 8 prompts, as serial's `all`; PPC=1
#     puts one prompt in each chunk); tagged _ppcN
#   TAIL=N bash bench/issue5_h200.sh STAGE: the same with sharing.tail_rows N (rollplex's prefix work beside decode
#     starts once the live decode batch is at most N rows); tagged _tailN
#   KERNELS=NAME bash bench/issue5_h200.sh STAGE: the same with run.decode_kernels NAME (cublas, rollplex,
#     rollplex_pdl, rollplex_fused, rollplex_ahead; both schedules decode with them); tagged _NAME. Without KERNELS and PREFILL a
#     stage runs the spec's defaults (`auto`: on an H200, rollplex_fused decode from the actor prefix's boundary)
#   PREFILL=actor|rollout bash bench/issue5_h200.sh STAGE: the same with run.rollout_prefill actor_prefix (the
#     rollout decodes from the actor prefix's boundary instead of prefilling; that prefix runs before decode: what
#     the 3B specs' `auto` picks) or rollout (the engine prefills); tagged _actorprefill / _rolloutprefill
#   WARMUP=N: bench3b / policies3b warm-up steps (default 1; cuDNN plans the bucketed attention shapes over the
#     first few steps)
#
# Run from the repository root on the device machine with the pydantic wheels carried in .whl/ (made by
# ../shared/tools/gpu-wheels.sh .whl pydantic). Logs and result JSON/PNG go to $OUT (the folder the device
# returns); each stage prints its short summary last. Serial and rollplex are timed in processes of their own:
# a schedule run second in one process finds the attention shapes the first met already planned (cuDNN plans
# each new shape, and the process keeps the plan). `bench3b` (one policy, default green:66, 3 steps) takes
# most of a device call; it leaves its serial run in bench/baselines/ (git-ignored: it stays on a machine kept
# warm) for `policies3b`. `unsplit3b [STEPS]` (3 steps by default, a device call of its own: a textbook step
# takes 60-80 s) leaves the unsplit schedule's run there too, and a later bench3b of the same STEPS and WARMUP
# (and a policy other than mps) adds it to its results (`--unsplit-from`); the saved run keeps no weights (about
# 10 MB), so with it copied to $OUT and bench/baselines carried into the next call, the two calls need not share
# a warm machine. Under mps (`bench3b mps:50 2`) run 2 steps: serial with its rollout in a child process,
# 2 warm-ups, 3 steps and the noise floor do not fit in the serial run's 330 s timeout. `preset NAME [POLICY...]`
# benches specs/qwen2_5_vl_3b_h200_NAME.yaml (clevrer, perception_test, star) under each policy.
# Move what comes back into bench/results/ with the code's commit. The device's copy of the tree may carry an
# older .git than its files: set ROLLPLEX_COMMIT=<the commit you sent> so the result JSON names the right one.
set -u
STAGE=${1:?stage: tests, profile, bench3b, policies3b, preset, naive7b or run7b (see the header)}
OUT=${OUT:?the device sets OUT}
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=$PWD/.triton-cache
TAG=; [ "${CUDNN:-on}" = off ] && TAG=_nocudnn
[ -n "${PPC:-}" ] && TAG=${TAG}_ppc$PPC
[ -n "${TAIL:-}" ] && TAG=${TAG}_tail$TAIL
[ -n "${KERNELS:-}" ] && TAG=${TAG}_$KERNELS
case ${PREFILL:-} in "") ;; actor|rollout) TAG=${TAG}_${PREFILL}prefill ;;
  *) echo "PREFILL is actor or rollout, not $PREFILL" >&2; exit 2 ;; esac
spec3b() {  # spec3b PATH: the spec a 3B stage runs (CUDNN=off / PPC=N / TAIL=N / KERNELS=NAME / PREFILL=...: a copy beside it)
  if [ -z "$TAG" ]; then echo "$1"; return; fi
  local run_keys=; { [ "${CUDNN:-on}" = off ] || [ -n "${KERNELS:-}" ] || [ -n "${PREFILL:-}" ]; } && run_keys=1
  if [ -n "$run_keys" ] && grep -q "^run:" "$1"; then
    echo "CUDNN=off / KERNELS / PREFILL: $1 has a run: section; set the key in it" >&2; exit 2
  fi
  local copy; copy=$(dirname "$1")/.$(basename "$1" .yaml)$TAG.yaml
  { if [ -n "${PPC:-}" ] && grep -q "^  prompts_per_chunk:" "$1"; then sed "s/^  prompts_per_chunk:.*/  prompts_per_chunk: $PPC/" "$1"
    elif [ -n "${PPC:-}" ]; then sed "/^sharing:\$/a\\  prompts_per_chunk: $PPC" "$1"; else cat "$1"; fi |
      if [ -n "${TAIL:-}" ]; then sed "/^sharing:\$/a\\  tail_rows: $TAIL"; else cat; fi
    if [ -n "$run_keys" ]; then echo "run:"; fi
    if [ "${CUDNN:-on}" = off ]; then echo "  cudnn_attention: false"; fi
    if [ "${PREFILL:-}" = actor ]; then echo "  rollout_prefill: actor_prefix"; fi
    if [ "${PREFILL:-}" = rollout ]; then echo "  rollout_prefill: rollout"; fi
    if [ -n "${KERNELS:-}" ]; then echo "  decode_kernels: $KERNELS"; fi; } > "$copy"
  echo "$copy"
}
quiet() { grep -v -e USDT -e UserWarning -e "return Variable._execution_engine" -e "_warn_once" || true; }
serial_then_rollplex() {  # SPEC STEPS GROUPING POLICY SAVED OUT_NAME LOG [FLAG...]: serial saved, then rollplex
  # against it (the FLAGs too)
  local spec=$1 steps=$2 grouping=$3 policy=$4 saved=$5 name=$6 log=$7; shift 7
  rm -f "$saved"  # never compare with a serial run an earlier call left here
  set -o pipefail
  timeout 330 python3 -m rollplex bench "$spec" --steps "$steps" --warmup "${WARMUP:-1}" --serial-prompts-per-chunk "$grouping" \
    --noise-floor --policies "$policy" --serial-only --save-serial "$saved" 2>&1 | quiet > "$log" \
    || { echo "serial failed or timed out: no rollplex run" | tee -a "$log"; return 1; }
  timeout 250 python3 -m rollplex bench "$spec" --steps "$steps" --warmup "${WARMUP:-1}" --serial-prompts-per-chunk "$grouping" \
    --noise-floor --policies "$policy" --serial-from "$saved" "$@" --out "$name" 2>&1 | quiet >> "$log"
}

case "$STAGE" in
  tests)
    timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -q -m gpu tests/executors tests/models tests/rollout \
      tests/memory/test_optimizer.py tests/memory/test_pager.py tests/memory/test_offload.py \
      --tb=short -rfEs > "$OUT/gpu_tests.log" 2>&1
    status=$?; tail -8 "$OUT/gpu_tests.log"; exit $status ;;
  profile)
    SCHEDULE=${2:-serial}  # OPS: the ops whose kernels are listed (an op id substring: prefix, actor_backward)
    OPS=${3:-actor_backward}  # comma-separated: a kernel table each (prefix,suffix,backward)
    GROUPING=${4:+--prompts-per-chunk $4}  # the prefixes' prompt grouping (default: the spec's)
    LOG="$OUT/profile_3b_h200${TAG}_${SCHEDULE}${4:+_$4}_${OPS//,/_}.log"
    timeout "${PROFILE_TIMEOUT:-540}" python3 bench/profile_step.py "$(spec3b specs/qwen2_5_vl_3b_h200.yaml)" \
      --warmup 1 --top 25 --schedule "$SCHEDULE" --kernels "$OPS" $GROUPING 2>&1 | quiet | tail -75 > "$LOG"
    cat "$LOG" ;;
  unsplit3b)
    STEPS=${2:-3}; SAVED=bench/baselines/unsplit_3b_h200${TAG}_${STEPS}steps_w${WARMUP:-1}.pt
    mkdir -p bench/baselines; rm -f "$SAVED"
    set -o pipefail
    timeout 540 python3 -m rollplex bench "$(spec3b specs/qwen2_5_vl_3b_h200.yaml)" --steps "$STEPS" \
      --warmup "${WARMUP:-1}" --save-unsplit "$SAVED" 2>&1 | quiet > "$OUT/unsplit3b.log"
    status=$?; tail -6 "$OUT/unsplit3b.log"; exit $status ;;
  bench3b)
    POLICY=${2:-green:66}; STEPS=${3:-3}; GROUPING=${4:-all}  # GROUPING: serial's prompts per prefix group (all: the fair one)
    mkdir -p bench/baselines
    UNSPLIT=bench/baselines/unsplit_3b_h200${TAG}_${STEPS}steps_w${WARMUP:-1}.pt  # unsplit3b's of these step counts
    case $POLICY in mps*) UNSPLIT= ;; esac  # (saved with the rollout in process: no stand-in for mps's)
    [ -n "$UNSPLIT" ] && [ -s "$UNSPLIT" ] || UNSPLIT=
    serial_then_rollplex "$(spec3b specs/qwen2_5_vl_3b_h200.yaml)" "$STEPS" "$GROUPING" "$POLICY" \
      "bench/baselines/serial_3b_h200$TAG.pt" "$OUT/qwen2_5_vl_3b_h200${TAG}_${POLICY//:/}" "$OUT/bench3b.log" \
      ${UNSPLIT:+--unsplit-from "$UNSPLIT"}
    tail -12 "$OUT/bench3b.log" ;;
  policies3b)  # policies3b STEPS GROUPING POLICY...: rollplex only, one process per policy (~3-4 minutes each),
    # against the serial run a bench3b left in bench/baselines/ (this machine, kept warm) with the same STEPS and
    # GROUPING and a policy of the same rollout engine (mps: its own bench3b)
    STEPS=${2:?steps}; GROUPING=${3:?serial grouping (e.g. all)}; shift 3
    [ -s "bench/baselines/serial_3b_h200$TAG.pt" ] || { echo "no serial run here: run bench3b first" >&2; exit 2; }
    for POLICY in "$@"; do
      timeout 280 python3 -m rollplex bench "$(spec3b specs/qwen2_5_vl_3b_h200.yaml)" --steps "$STEPS" --warmup "${WARMUP:-1}" \
        --serial-prompts-per-chunk "$GROUPING" --serial-from "bench/baselines/serial_3b_h200$TAG.pt" --noise-floor \
        --policies "$POLICY" --out "$OUT/qwen2_5_vl_3b_h200${TAG}_${POLICY//:/}" 2>&1 | quiet >> "$OUT/policies3b.log"
    done
    grep -e "x (ideal" -e Error -e error "$OUT/policies3b.log" | tail -12 ;;
  preset)  # preset NAME [POLICY...]: as bench3b (2 steps, serial grouping all prompts) for
    # specs/qwen2_5_vl_3b_h200_NAME.yaml, the first policy (default green:66) after serial, then each other one
    # in a process of its own against that serial run (a preset's steps are short: ~4 policies fit in a call)
    NAME=${2:?preset: clevrer, perception_test or star}; shift 2
    [ $# -gt 0 ] || set -- green:66
    SPEC=$(spec3b "specs/qwen2_5_vl_3b_h200_$NAME.yaml"); SAVED=bench/baselines/serial_3b_h200_$NAME$TAG.pt
    mkdir -p bench/baselines
    serial_then_rollplex "$SPEC" 2 all "$1" "$SAVED" "$OUT/qwen2_5_vl_3b_h200_$NAME${TAG}_${1//:/}" \
      "$OUT/bench_$NAME$TAG.log" && shift && for POLICY in "$@"; do
      timeout 250 python3 -m rollplex bench "$SPEC" --steps 2 --warmup "${WARMUP:-1}" --serial-prompts-per-chunk all \
        --serial-from "$SAVED" --noise-floor --policies "$POLICY" --out "$OUT/qwen2_5_vl_3b_h200_$NAME${TAG}_${POLICY//:/}" \
        2>&1 | quiet >> "$OUT/bench_$NAME$TAG.log"
    done
    { grep -e "x (ideal" -e Error -e error -e "failed" "$OUT/bench_$NAME$TAG.log" || true; } | tail -8 ;;
  inprocess)  # share's in-process ways only, with the SM clock and power over each window
    timeout 150 python3 bench/share_efficiency.py --clocks --ways stream green:33 green:66 \
      --out "$OUT/share_inprocess_3b_h200.json" 2>&1 | quiet | tail -8 ;;
  share)  # what decode and a compute-bound neighbour each keep of the GPU, per way of sharing it
    # (bench/share_efficiency.py): in-process ways; MPS ways with this process uncapped; decode capped at 70 %
    timeout 150 python3 bench/share_efficiency.py --ways stream green:33 green:66 \
      --out "$OUT/share_inprocess_3b_h200.json" 2>&1 | quiet | tail -8
    timeout 170 python3 bench/share_efficiency.py --ways mps:25 mps:50 mps:100 green:66 \
      --out "$OUT/share_mps_3b_h200.json" 2>&1 | quiet | tail -10
    timeout 120 python3 bench/share_efficiency.py --self-percent 70 --ways mps:100 mps:50 --batch 32 \
      --out "$OUT/share_mps_self70_3b_h200.json" 2>&1 | quiet | tail -4 ;;
  split)  # decode on a disjoint green partition of D SMs (our GEMMs planned for D), the neighbour on the rest
    # shellcheck disable=SC2086
    timeout "${SPLIT_TIMEOUT:-220}" python3 -X faulthandler bench/share_efficiency.py --clocks --decode-sms ${SPLIT_SMS:-96 64 48} \
      --decode-kernels "${SPLIT_KERNELS:-rollplex}" --ways rest --out "$OUT/share_split_3b_h200.json" \
      > "$OUT/split_full.log" 2>&1
    echo "share_efficiency exit $?"; quiet < "$OUT/split_full.log" | tail -20 ;;
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
