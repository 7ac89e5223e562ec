"""The gradient noise floor by scoring attention: serial's first step run twice on fresh engines for each
`run.suffix_attention` named, and how far the two runs' gradients (`harness.grad_sketch`) are apart, relative; the
rollouts must be the same tokens. `rollplex bench --noise-floor` measures the same floor for the spec as it is; this
sets the scoring attention, to show which backward the floor follows (cuDNN's accumulates dq with atomics,
FlexAttention's does not).

    python bench/noise_floor.py SPEC --attention cudnn flex --out noise_floor.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from rollplex.bench.agreement import relative_difference, same_rollout
from rollplex.bench.harness import run_schedule
from rollplex.bench.variants import with_prompts_per_chunk
from rollplex.graph.ir import Schedule
from rollplex.graph.load import LoadedSpec, load_spec


def with_attention(loaded: LoadedSpec, attention: str) -> LoadedSpec:
    run = loaded.spec.run.model_copy(update={"suffix_attention": attention})
    return dataclasses.replace(loaded, spec=loaded.spec.model_copy(update={"run": run}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec")
    ap.add_argument("--attention", nargs="+", choices=("cudnn", "flex"), default=["cudnn", "flex"])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    loaded = with_prompts_per_chunk(load_spec(args.spec), "all")  # serial's prefixes as one batch, as bench3b runs
    batches: dict[int, list] = {}  # the same examples for every run
    result = {"spec": args.spec, "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    for attention in args.attention:
        a, b = (run_schedule(with_attention(loaded, attention), Schedule.SERIAL, 1, 0, batches) for _ in range(2))
        result[attention] = {
            "same_rollout": same_rollout(a.first_rollout, b.first_rollout),
            "relative_difference": relative_difference(a.first_grads, b.first_grads),
            "phase_s_second_run": {name: round(s, 3) for name, s in b.times[-1].items()},
        }
        Path(args.out).write_text(json.dumps(result, indent=1))
    for attention in args.attention:
        r = result[attention]
        print(f"{attention:6s} same rollout {r['same_rollout']}, gradients apart {r['relative_difference']:.3e}")


if __name__ == "__main__":
    main()
