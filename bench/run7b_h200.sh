#!/bin/bash
# The 7B spec (or SPEC=another) in `rollplex run` on one H200, as shipped and in variants, each run in a process of
# its own:
#
#   STEPS=4 bash bench/run7b_h200.sh VARIANT [VARIANT...]
#   SPEC=specs/qwen2_5_vl_3b_h200.yaml STEPS=6 bash bench/run7b_h200.sh shipped norecompute+mb4096
#
# A VARIANT is `shipped` or keys joined by '+': `joined` (sharing.update_beside_prefix false: the update ends its
# step), `beside` (true), `nocudnn` (run.cudnn_attention false), `chunkN` (memory.optimizer_chunk_mib N), `hbm`
# (memory.prefix_saved hbm), `norecompute` (memory.recompute none), `selective` (memory.recompute selective),
# `compiled` (run.compiled_layers true), `keepcache` (memory.empty_cache mappings), `adaptive` (sharing.prefix_sms
# adaptive), `flex` / `cudnnsuffix` (run.suffix_attention flex / cudnn), `mbN` (memory.microbatch_tokens N), `tailN`
# (sharing.tail_rows N); e.g. `nocudnn+joined`. A 7B run of 4 steps takes about 170 s, of 5 about 210: two runs fit
# one 600 s device call.
# Each run's metrics go to $OUT/run_NAME_VARIANT_metrics.jsonl (NAME: the spec's, less `qwen2_5_vl_`, as
# `7b_h200`; each '+' of VARIANT a '-'); the last lines printed
# are each run's phases (medians of the warm steps, `rollplex run`'s summary) and its peaks against the plan's.
#
# Run from the repository root on the device machine with the pydantic wheels carried in .whl/ (made by
# ../shared/tools/gpu-wheels.sh .whl pydantic). Set ROLLPLEX_COMMIT=<the commit you sent>: the device's copy of the
# tree may carry an older .git than its files. Move what comes back into bench/results/ with the code's commit.
set -u
[ $# -ge 1 ] || { echo "usage: bash bench/run7b_h200.sh VARIANT [VARIANT...] (see the header)" >&2; exit 2; }
OUT=${OUT:?the device sets OUT}
STEPS=${STEPS:-4}
SPEC=${SPEC:-specs/qwen2_5_vl_7b_h200.yaml}
NAME=$(basename "$SPEC" .yaml); NAME=${NAME#qwen2_5_vl_}
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=$PWD/.triton-cache

lines=()
for variant in "$@"; do
  spec=$(python3 bench/run_variants.py spec "$SPEC" "$variant") || exit 2
  file=${variant//+/-}  # what comes back from the device: letters, digits, '.', '_' and '-'
  rm -rf "/tmp/r_$variant"
  timeout $((60 + 45 * STEPS)) python3 bench/startup_times.py run "$spec" --steps "$STEPS" --out "/tmp/r_$variant" \
    --no-checkpoints --quiet > "$OUT/run_${NAME}_$file.log" 2>&1
  echo "[$variant] exit $?"
  if [ -f "/tmp/r_$variant/metrics.jsonl" ]; then
    cp "/tmp/r_$variant/metrics.jsonl" "$OUT/run_${NAME}_${file}_metrics.jsonl"
    lines+=("[$variant] $(python3 bench/run_variants.py summary "/tmp/r_$variant/metrics.jsonl" "$spec" | tr '\n' ' ')")
  else
    tail -5 "$OUT/run_${NAME}_$file.log"
  fi
done
printf '%s\n' "${lines[@]}"
