"""The time plan against a run: each phase's predicted seconds beside its measured median, for the check that the
dry-run's prediction lands within 25 % of each measured phase.

    python bench/timeplan_check.py SPEC METRICS.jsonl [--efficiency SOURCE]

The plan of SPEC is priced at the efficiencies of SOURCE (default: the 3B bench's, as docs/results.md's check;
any `rollplex compile --efficiency` source) and compared with the medians of the run's warm steps (its first
left out). The plan prices the mean of its planned steps, a run its own: a rollout decodes to its step's longest
response, which varies most between steps. So each phase is also predicted at the run's steps: where the run
recorded each step's token counts (`tokens`), the time plan of each warm step at those counts, their median (the
cost model of this commit on both sides); for older runs, the prediction scaled by the run's median bound (its
`bound_s`, priced by the cost model of the run's commit) over the plan's. A phase the run has no seconds for (one run
beside decode) or the plan does not price is left out; the step is the sum of the predicted phases against the
run's median step.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from rollplex.graph.load import load_spec
from rollplex.graph.plan import compile_plan
from rollplex.graph.timeplan import recorded_tokens, time_plan
from rollplex.report.efficiency import read_efficiencies

BENCH_3B = Path(__file__).resolve().parent / "results/qwen2_5_vl_3b_h200_green66.json"
TOLERANCE = 0.25


def compare(spec: Path, metrics: Path, efficiency: str) -> list[tuple[str, float, float, float]]:
    """(phase, predicted s, predicted at the run's steps, measured s) of each phase both price, then the step's."""
    plan = compile_plan(load_spec(spec))
    effs = read_efficiencies(efficiency, plan.schedule.value)
    rows = time_plan(plan, effs)
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    warm = records[1:] or records
    median = lambda key, phase: statistics.median(r[key].get(phase, 0.0) for r in warm)  # noqa: E731
    own = (
        [time_plan(plan, effs, (recorded_tokens(x["tokens"]),)) for x in warm]
        if all("tokens" in x for x in warm)
        else []
    )
    out = []
    for k, r in enumerate(rows):
        measured = median("time_s", r.timer)
        if r.predicted_s and measured > 0:
            bound = median("bound_s", r.timer) if all("bound_s" in x for x in warm) else 0.0
            at = r.predicted_s * bound / r.bound_s if bound else r.predicted_s
            out.append((r.timer, r.predicted_s, statistics.median(p[k].predicted_s for p in own) if own else at,
                        measured))  # fmt: skip
    total = lambda k: sum(row[k] for row in out)  # noqa: E731
    out.append(("step", sum(r.predicted_s or 0.0 for r in rows), total(2) - total(1) + sum(
        r.predicted_s or 0.0 for r in rows), median("time_s", "step")))  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec", type=Path)
    ap.add_argument("metrics", type=Path)
    ap.add_argument("--efficiency", default=str(BENCH_3B))
    args = ap.parse_args()
    print(f"{'phase':<22} {'predicted s':>11} {'at its steps':>12} {'measured s':>10} {'diff':>7}")
    for phase, predicted, at_steps, measured in compare(args.spec, args.metrics, args.efficiency):
        diff = at_steps / measured - 1
        flag = "" if abs(diff) <= TOLERANCE else f"  over {TOLERANCE:.0%}"
        print(f"{phase:<22} {predicted:>11.2f} {at_steps:>12.2f} {measured:>10.2f} {diff:>+7.0%}{flag}")


if __name__ == "__main__":
    main()
