#!/usr/bin/env bash
# The learning check, on the CPU (about 9 minutes on 2 cores): specs/learning_check_tiny.yaml from random weights,
# and beside it the control, the same run with every question shown another example's video
# (workload.mismatch_videos), which must stay at chance. Both run at once, one thread each.
#   bash bench/learning_check.sh [OUT_DIR]     (default runs/learning_check; the plot goes there too)
set -euo pipefail
out=$(realpath -m "${1:-runs/learning_check}")  # as given, from where it was called
cd "$(dirname "$0")/.."
mkdir -p "$out"
control="$out/control.yaml"
sed 's/^  dataset: \(.*\)$/  dataset: \1\n  mismatch_videos: true/' specs/learning_check_tiny.yaml > "$control"
grep -q "mismatch_videos: true" "$control" || { echo "learning_check.sh: could not write the control spec" >&2; exit 2; }
OMP_NUM_THREADS=1 rollplex run specs/learning_check_tiny.yaml --out "$out/matched" --no-checkpoints --quiet &
matched=$!
trap 'kill "$matched" 2>/dev/null || true' EXIT  # the control failing leaves no run behind
OMP_NUM_THREADS=1 rollplex run "$control" --out "$out/control" --no-checkpoints --quiet
wait "$matched"
trap - EXIT
python bench/plot_metrics.py "$out/learning_check.png" "video shown=$out/matched" "another video (control)=$out/control"
python - "$out" <<'PY'
import json, sys
from pathlib import Path
for name in ("matched", "control"):
    rows = [json.loads(l) for l in (Path(sys.argv[1]) / name / "metrics.jsonl").read_text().splitlines()]
    last = rows[-200:]  # as README quotes it
    acc = sum(r["accuracy"] for r in last) / len(last)
    reward = sum(r["reward_mean"] for r in last) / len(last)
    held = [json.loads(l) for l in (Path(sys.argv[1]) / name / "eval.jsonl").read_text().splitlines()]
    late = [e["accuracy"] for e in held if e["step"] > len(rows) // 2]  # the evaluations of the second half
    print(f"{name}: {len(rows)} steps; last {len(last)} steps: accuracy {acc:.3f}, reward {reward:.3f}; held-out "
          f"prompts after steps {len(rows) // 2 + 1}-{len(rows)}: accuracy {min(late):.3f}-{max(late):.3f}, mean "
          f"{sum(late) / len(late):.3f} ({len(late)} evaluations of {held[-1]['prompts']} prompts)")
PY
echo "plot: $out/learning_check.png"
