"""The README table of issue 5: every `rollplex bench --policies` result of the given specs, one row per
(workload, policy), from the JSON files `rollplex bench` wrote (`<out>_<policy>.json`).

    python bench/policy_table.py bench/results/qwen2_5_vl_3b_h200*_*.json

Prints a Markdown table: step times, measured speedup against Eq. 1's ideal and the speedup with the work
after the rollout at serial's time (what the overlap alone gave), decode slowdown, where rollplex's
step gained and lost against serial's (prefixes hidden / rollout longer / after the rollout longer, seconds;
from the phase times where a result predates `step_balance_s`), whether the updates match, and the measured
per-phase peak against the plan's. A row timed after serial in one process is marked: not a fair figure.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def balance_parts(result: dict) -> dict | None:
    """rollplex's step minus serial's in three parts that add up to it (from the phase times where a result
    predates `step_balance_s`), None where the result lacks the times."""
    parts = result.get("step_balance_s")
    if parts is None and "phase_s" in result:
        rollout, (t_d, t_p), s = (
            result["phase_s"]["rollplex"]["rollout"],
            (result["T_D_s"], result["T_P_s"]),
            result["step_s"],
        )
        parts = {"prefixes_hidden": -t_p, "rollout_longer": rollout - t_d,
                 "after_rollout_longer": (s["rollplex"] - rollout) - (s["serial"] - t_d - t_p)}  # fmt: skip
    return parts


def balance(result: dict) -> str:
    parts = balance_parts(result)
    if parts is None:
        return "-"
    return " / ".join(f"{parts[k]:+.2f}" for k in ("prefixes_hidden", "rollout_longer", "after_rollout_longer"))


def after_serial(result: dict) -> bool:
    """Whether rollplex was timed in the process serial had just run in (not a fair figure: the cuDNN attention
    plans of serial's shapes served it). Results from before the key: those that did not load serial's run."""
    flag = result.get("after_another_schedule_in_process")
    return flag if flag is not None else not result.get("serial_from")


def overlap_only(result: dict) -> str:
    """The speedup with the work after the rollout at serial's time (`overlap_speedup`; from the balance where a
    result predates it), "-" where the result lacks the times."""
    if "overlap_speedup" in result:
        return f"{result['overlap_speedup']:.3f}x"
    parts, serial = balance_parts(result), result["step_s"]["serial"]
    if parts is None:
        return "-"
    return f"{serial / (serial + parts['prefixes_hidden'] + parts['rollout_longer']):.3f}x"


def row(name: str, result: dict) -> str:
    s = result["step_s"]
    slowdown = result.get("decode_slowdown")
    peaks = result.get("peak_gib", {}).get("rollplex", {})
    plan = result.get("plan_peak_gib", {}).get("rollplex", {})
    marked = name + (" (after serial, in one process)" if after_serial(result) else "")
    memory = " / ".join(f"{peaks.get(p, '-')} ({plan.get(p, '-')})" for p in ("1", "2", "3"))
    return (
        f"| {marked} | {result['workload']['dataset']} | {result['policy']} | {s['serial']:.2f} | "
        f"{s['rollplex']:.2f} | {result['speedup']:.3f}x | {result['ideal_speedup']:.3f}x | {overlap_only(result)} | "
        f"{'n/a' if slowdown is None else f'{slowdown:.3f}x'} | {balance(result)} | {result['updates_match']} | "
        f"{memory} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", type=Path, help="bench result JSON files")
    args = ap.parse_args()
    results = sorted(((p.stem, json.loads(p.read_text())) for p in args.results),
                     key=lambda r: (r[1]["workload"]["dataset"], r[1]["policy"], r[0]))  # fmt: skip
    print("| file | workload | policy | serial s | rollplex s | speedup | ideal (Eq. 1) | overlap alone |"
          " decode slowdown | rollplex - serial s: prefixes / rollout / after | updates match |"
          " peak GiB per phase 1 / 2 / 3 (plan) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, result in results:
        print(row(name, result))


if __name__ == "__main__":
    main()
