"""What `rollplex run` refuses of a spec the planner plans: data-parallel sampling it cannot make the one-process
run's. The dry-run lists them (`report.tables`); the engines raise the first that applies on their device
(`executors.engines`). Pure: the spec alone decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rollplex.graph.spec import Spec


@dataclass(frozen=True)
class Refusal:
    key: str  # the spec key to change
    problem: str
    fix: str
    on: Literal["any", "cuda", "cpu"] = "any"  # the device type it is refused on


def run_refusals(spec: Spec) -> list[Refusal]:
    p = spec.parallel
    replicas_per_group, dp = p.train_tp // p.rollout_tp, spec.cluster.num_gpus // p.train_tp
    refused = []
    if dp > 1 and replicas_per_group > 1 and p.split_rollout:
        refused.append(Refusal("parallel.split_rollout", "true reseeds each rollout replica (the CPU's sampler "
                               "draws per batch), so data-parallel ranks would not sample as one process",
                               "set it false with data parallelism on the CPU", on="cpu"))  # fmt: skip
    if dp > 1 and spec.algorithm.top_p < 1:
        refused.append(Refusal("algorithm.top_p", f"{spec.algorithm.top_p:g}: top-p on a GPU draws per batch row, so "
                               "a rank's share would not sample as the whole step", "use top_p 1 with data "
                               "parallelism", on="cuda"))  # fmt: skip
    if p.train_tp > 1 and spec.run.compiled_layers:
        refused.append(Refusal("run.compiled_layers", "true compiles a layer's halves with their tensor-parallel "
                               "collectives inside, which it does not trace", "set it false, or train_tp 1",
                               on="cuda"))  # fmt: skip
    return refused
