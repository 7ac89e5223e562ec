"""Naive colocation on one GPU, for real: every component the planner's naive table lists, made resident in turn
as the tensors a framework without phase planning holds, until the device runs out of memory.

    python bench/naive_oom.py specs/qwen2_5_vl_7b_h200.yaml --out bench/results/naive_oom_7b_h200.json

Order (what such a run holds at its training peak): the actor's BF16 weights, a reference copy, a separate
rollout copy, FP32 gradients, FP32 master weights and the two Adam moments (torch.optim.AdamW's state on
FP32 masters), the rollout KV cache and the boundary KV, then one microbatch of activations. Each component
is real tensors of the planner's byte count (models are built with the spec's shapes; the rest as flat
buffers). The result names the component that did not fit, the bytes held when it failed, and the
planner's naive total beside the rollplex plan's peak, so that "the planner says it does not fit" and "a
naive run OOMs" are checked against each other.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from rollplex.graph.load import load_spec
from rollplex.graph.plan import compile_plan
from rollplex.models.model import Qwen2_5_VL

ORDER = ("weights (BF16)", "FP32 gradients", "FP32 master weights", "Adam moments (FP32)", "KV cache",
         "boundary KV", "activations (one microbatch)")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    loaded = load_spec(args.spec)
    plan = compile_plan(loaded)
    rows = [r for r in plan.naive if not r.vision]
    held: list[object] = []
    log: list[dict] = []
    failed = None
    torch.cuda.reset_peak_memory_stats()
    try:
        for component in ORDER:
            for row in (r for r in rows if r.component == component):
                if component == "weights (BF16)":  # a real model of the spec's shapes, for each role
                    torch.manual_seed(0)
                    held.append(Qwen2_5_VL(loaded.model, dtype=torch.bfloat16, device="cuda"))
                else:
                    held.append(torch.empty(row.bytes, dtype=torch.uint8, device="cuda"))
                torch.cuda.synchronize()
                log.append({"role": row.role, "component": component, "gib": round(row.bytes / 2**30, 2),
                            "allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 2)})  # fmt: skip
                print(f"{row.role:10s} {component:30s} {row.bytes / 2**30:7.2f} GiB -> "
                      f"{torch.cuda.memory_allocated() / 2**30:7.2f} GiB held", flush=True)  # fmt: skip
    except torch.OutOfMemoryError as e:
        failed = {"role": row.role, "component": component, "gib": round(row.bytes / 2**30, 2),
                  "error": str(e).splitlines()[0]}  # fmt: skip
        print(f"OUT OF MEMORY at {row.role} {component}: {failed['error']}", flush=True)
    total = torch.cuda.get_device_properties(0).total_memory
    result = {
        "gpu": torch.cuda.get_device_name(),
        "command": "python bench/naive_oom.py " + args.spec + " --out " + args.out,
        "model": loaded.spec.model.name,
        "device_gib": round(total / 2**30, 2),
        "naive_plan_gib": round(sum(r.bytes for r in rows) / 2**30, 2),
        "rollplex_plan_peak_gib": round(max(p.peak_bytes for p in plan.residency.phases) / 2**30, 2),
        "held_when_failed_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "out_of_memory_at": failed,
        "allocated": log,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("naive_plan_gib", "rollplex_plan_peak_gib", "held_when_failed_gib",
                                            "out_of_memory_at")}))  # fmt: skip


if __name__ == "__main__":
    main()
