#!/bin/bash
# Rollout decode on one H200 under each kernel setting, one device call (~6-8 minutes; it compiles first, in parallel):
#
#   bash bench/decode_h200.sh
#
# 1. the GPU tests of the decode path: our GEMMs (`linear`), dependent launches changing no rollout
#    -> $OUT/decode_gpu_tests.log
# 2. for cuBLAS GEMMs (as today), our GEMMs (--triton-gemm), our GEMMs launched as programmatic dependents
#    with the step's other kernels (--triton-gemm --pdl), and the same with our GEMMs prefetching their weights
#    into L2 before they wait (--prefetch): bench/decode.py at 512-token prompts (batch 32, 64) and
#    bench/decode_profile.py at the rollout's shapes (5,888-token prompts, a 2,048-token cache, batch 32, 64)
#    -> $OUT/decode_3b_h200_SETTING.json, $OUT/decode_profile_3b_r2048_h200_SETTING.json
# 3. bench/decode_beside.py: the decode step alone and beside a compute-bound stand-in for the prefix on 33 or 66
#    SMs, with cuBLAS, our GEMMs, and our GEMMs planned for the SMs left -> $OUT/decode_beside_3b_h200.json
#
# Run from the repository root on the device machine with the pydantic wheels carried in .whl/ (made by
# ../shared/tools/gpu-wheels.sh .whl pydantic). Prints a table last. Move what comes back into bench/results/
# with the code's commit.
set -uo pipefail
OUT=${OUT:?the device sets OUT}
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
  || { echo "decode_h200: installing .whl/*.whl failed (made by ../shared/tools/gpu-wheels.sh .whl pydantic)" >&2; exit 2; }
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=$PWD/.triton-cache
ln -sfn ../kernels rollplex/kernels
flags_of() {  # flags_of SETTING: the decode benches' kernel flags
  case $1 in
    cublas) ;; triton) echo --triton-gemm ;; pdl) echo --triton-gemm --pdl ;; prefetch) echo --triton-gemm --pdl --prefetch ;;
  esac
}
# compile first, in parallel (triton compiles on the host; a cold cache would eat the timed runs' time limits)
for setting in triton pdl prefetch; do
  # shellcheck disable=SC2046
  timeout 240 python3 bench/decode_profile.py --model 3b --batch 32 64 --prompt-tokens 5888 --tokens 2048 --steps 2 \
    $(flags_of $setting) > /dev/null 2>&1 &
  timeout 240 python3 bench/decode.py --models 3b --batches 32 64 --prompt-tokens 512 --tokens 256 $(flags_of $setting) \
    > /dev/null 2>&1 &
done
timeout 240 python3 bench/decode_beside.py --model 3b --batch 32 64 --beside-sms 33 66 --capture-only > /dev/null 2>&1 &
timeout 150 python3 -m pytest -q -m gpu tests/rollout/test_engine.py tests/kernels/test_transposed_gemm.py --tb=short -rfEs \
  > "$OUT/decode_gpu_tests.log" 2>&1
tests=$?
tail -3 "$OUT/decode_gpu_tests.log"
wait
for setting in cublas triton pdl prefetch; do
  # shellcheck disable=SC2046
  timeout 60 python3 bench/decode.py --models 3b --batches 32 64 --prompt-tokens 512 --tokens 256 $(flags_of $setting) \
    --out "$OUT/decode_3b_h200_$setting.json" > "$OUT/decode_$setting.log" 2>&1 || echo "decode.py $setting failed"
  # shellcheck disable=SC2046
  timeout 90 python3 bench/decode_profile.py --model 3b --batch 32 64 --prompt-tokens 5888 --tokens 2048 \
    $(flags_of $setting) --out "$OUT/decode_profile_3b_r2048_h200_$setting.json" > "$OUT/decode_profile_$setting.log" \
    2>&1 || echo "decode_profile.py $setting failed"
done
timeout 150 python3 bench/decode_beside.py --model 3b --batch 32 64 --beside-sms 33 66 \
  --out "$OUT/decode_beside_3b_h200.json" > "$OUT/decode_beside.log" 2>&1 || echo "decode_beside.py failed"
tail -18 "$OUT/decode_beside.log"
python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'setting':>8} {'prompt':>6} {'batch':>5} {'step ms':>8} {'of bound':>8}")
for setting in ("cublas", "triton", "pdl", "prefetch"):
    for name, key, rows in (("decode_3b_h200", "engine", "step_ms"), ("decode_profile_3b_r2048_h200", "cases", "graph_step_ms")):
        path = out / f"{name}_{setting}.json"
        if not path.exists():
            print(f"{setting:>8} {name}: no result")
            continue
        for r in json.loads(path.read_text())[key]:
            prompt = r.get("prompt_tokens", "?")
            print(f"{setting:>8} {prompt:>6} {r['batch']:>5} {r[rows]:>8.3f} {r['fraction_of_hbm_bound']:>8.1%}")
EOF
exit $tests
