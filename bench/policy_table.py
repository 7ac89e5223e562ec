"""The README table of issue 5: every `rollplex bench --policies` result of the given specs, one row per
(workload, policy), from the JSON files `rollplex bench` wrote (`<out>_<policy>.json`).

    python bench/policy_table.py bench/results/qwen2_5_vl_3b_h200*_*.json

Prints a Markdown table: step times, measured speedup against Eq. 1's ideal, decode slowdown, whether the
updates match, and the measured per-phase peak against the plan's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def row(name: str, result: dict) -> str:
    s = result["step_s"]
    slowdown = result.get("decode_slowdown")
    peaks = result.get("peak_gib", {}).get("rollplex", {})
    plan = result.get("plan_peak_gib", {}).get("rollplex", {})
    memory = " / ".join(f"{peaks.get(p, '-')} ({plan.get(p, '-')})" for p in ("1", "2", "3"))
    return (
        f"| {name} | {result['workload']['dataset']} | {result['policy']} | {s['serial']:.2f} | {s['rollplex']:.2f} | "
        f"{result['speedup']:.3f}x | {result['ideal_speedup']:.3f}x | "
        f"{'n/a' if slowdown is None else f'{slowdown:.3f}x'} | {result['updates_match']} | {memory} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path, help="bench result JSON files")
    args = ap.parse_args()
    results = sorted(((p.stem, json.loads(p.read_text())) for p in args.results),
                     key=lambda r: (r[1]["workload"]["dataset"], r[1]["policy"], r[0]))  # fmt: skip
    print("| file | workload | policy | serial s | rollplex s | speedup | ideal (Eq. 1) | decode slowdown |"
          " updates match | peak GiB per phase 1 / 2 / 3 (plan) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, result in results:
        print(row(name, result))


if __name__ == "__main__":
    main()
