#!/bin/bash
# Rollout decode on one H200 under each `run.decode_kernels` setting, one device call (~4-6 minutes; it compiles
# first, in parallel):
#
#   bash bench/decode_h200.sh
#
# 1. the GPU tests of the decode path: our GEMMs (`linear`, the fused variants), dependent launches and fused
#    kernels changing no rollout
# 2. for each setting of SETTINGS (default: cublas, rollplex_fused and rollplex_ahead, run.decode_kernels names):
#    bench/decode.py at 512-token prompts (batch 32, 64) and bench/decode_profile.py at the rollout's shapes
#    (5,888-token prompts, a 2,048-token cache, batch 8, 32, 64: batch 8 is one prompt), and its tail as the rollout
#    meets it (graphs for 8 prompts; batch 8, 4, 2, 1 over 5, 3, 2, 1 live prompts: `--live-prompts`)
# 3. with BESIDE=1, bench/decode_beside.py: the decode step alone and beside a compute-bound stand-in for the prefix
#    on 33 or 66 SMs, under each setting
#
# Run from the repository root on the device machine with the pydantic wheels carried in .whl/ (made by
# ../shared/tools/gpu-wheels.sh .whl pydantic). Every file goes into $OUT/decode_h200.tgz (the device returns 8
# files at most); the table prints last. Move what comes back into bench/results/ with the code's commit.
set -uo pipefail
OUT=${OUT:?the device sets OUT}
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
  || { echo "decode_h200: installing .whl/*.whl failed (made by ../shared/tools/gpu-wheels.sh .whl pydantic)" >&2; exit 2; }
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=$PWD/.triton-cache
R=$(mktemp -d)
trap 'tar czf "$OUT/decode_h200.tgz" -C "$R" .' EXIT
SETTINGS=${SETTINGS:-cublas rollplex_fused rollplex_ahead}
# compile first, in parallel (triton compiles on the host; a cold cache would eat the timed runs' time limits)
for k in $SETTINGS; do
  [ "$k" = cublas ] && continue
  timeout 240 python3 bench/decode_profile.py --model 3b --batch 8 32 64 --prompt-tokens 5888 --tokens 2048 --steps 2 \
    --kernels $k > /dev/null 2>&1 &
  timeout 240 python3 bench/decode_profile.py --model 3b --batch 8 4 2 1 --live-prompts 5 3 2 1 --prompt-tokens 5888 \
    --tokens 2048 --steps 2 --kernels $k > /dev/null 2>&1 &
  timeout 240 python3 bench/decode.py --models 3b --batches 32 64 --prompt-tokens 512 --tokens 256 --kernels $k \
    > /dev/null 2>&1 &
done
[ "${BESIDE:-0}" = 1 ] && timeout 240 python3 bench/decode_beside.py --model 3b --batch 32 64 --beside-sms 33 66 \
  --capture-only > /dev/null 2>&1 &
timeout 200 python3 -m pytest -q -m gpu tests/rollout/test_engine.py tests/kernels/test_transposed_gemm.py tests/kernels/test_swap_gemm.py --tb=short -rfEs \
  > "$R/decode_gpu_tests.log" 2>&1
tests=$?
timeout 60 python3 -m pytest -q tests/kernels/test_decode_ops.py --tb=short -rfEs >> "$R/decode_gpu_tests.log" 2>&1 \
  || tests=1  # not marked gpu: on a GPU they run in bf16
tail -3 "$R/decode_gpu_tests.log"
wait
for k in $SETTINGS; do
  timeout 60 python3 bench/decode.py --models 3b --batches 32 64 --prompt-tokens 512 --tokens 256 --kernels $k \
    --out "$R/decode_3b_h200_$k.json" > "$R/decode_$k.log" 2>&1 || echo "decode.py $k failed"
  timeout 90 python3 bench/decode_profile.py --model 3b --batch 8 32 64 --prompt-tokens 5888 --tokens 2048 --kernels $k \
    --out "$R/decode_profile_3b_r2048_h200_$k.json" > "$R/decode_profile_$k.log" 2>&1 || echo "decode_profile.py $k failed"
  timeout 90 python3 bench/decode_profile.py --model 3b --batch 8 4 2 1 --live-prompts 5 3 2 1 --prompt-tokens 5888 \
    --tokens 2048 --kernels $k --out "$R/decode_profile_3b_tail_h200_$k.json" > "$R/decode_tail_$k.log" 2>&1 \
    || echo "decode_profile.py --live-prompts $k failed"
done
if [ "${BESIDE:-0}" = 1 ]; then
  # shellcheck disable=SC2086
  timeout 150 python3 bench/decode_beside.py --model 3b --batch 32 64 --beside-sms 33 66 --settings $SETTINGS \
    --out "$R/decode_beside_3b_h200.json" > "$R/decode_beside.log" 2>&1 || echo "decode_beside.py failed"
  tail -14 "$R/decode_beside.log"
fi
python3 - "$R" $SETTINGS <<'EOF2'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'kernels':>12} {'prompt':>6} {'batch':>5} {'prompts':>7} {'step ms':>8} {'of bound':>8}")
for setting in sys.argv[2:]:
    for name, key, rows in (("decode_3b_h200", "engine", "step_ms"), ("decode_profile_3b_r2048_h200", "cases", "graph_step_ms"),
                            ("decode_profile_3b_tail_h200", "cases", "graph_step_ms")):
        path = out / f"{name}_{setting}.json"
        if not path.exists():
            print(f"{setting:>12} {name}: no result")
            continue
        for r in json.loads(path.read_text())[key]:
            prompt = r.get("prompt_tokens", "?")
            prompts = r.get("live_prompts", r.get("prompts", "?"))
            print(f"{setting:>12} {prompt:>6} {r['batch']:>5} {prompts:>7} {r[rows]:>8.3f} {r['fraction_of_hbm_bound']:>8.1%}")
EOF2
exit $tests
