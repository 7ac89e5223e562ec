"""A step's bound from its real token counts: the cost model (`rollplex.graph.cost`) on the prompts, videos and
response lengths the step actually had, for `rollplex run`'s metrics and `rollplex bench`'s efficiencies: each
phase's bound (FLOPs, HBM bytes and host-link bytes) and its device bound (FLOPs and HBM bytes alone: what a time
plan's efficiency divides, `graph.timeplan`, which prices the link on its own)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rollplex.graph.cost import phase_bounds, plan_phase_costs, plan_prefix_backward
from rollplex.graph.modelcost import KNOWN_PEAKS, Cost, StepTokens
from rollplex.graph.plan import Plan


def step_tokens(examples: Sequence, response_lens: torch.Tensor) -> StepTokens:
    """The token counts of a step: each example's prompt tokens, vision patches and temporal patches, and each
    response's length ([P, N])."""
    prompts = [e.prompt for e in examples]
    return StepTokens(
        prompt_tokens=tuple(p.num_tokens for p in prompts),
        patches=tuple(sum(v.num_patches for v in p.visuals) for p in prompts),
        frames=tuple(max([v.grid_thw[0] for v in p.visuals], default=1) for p in prompts),
        response_lens=tuple(tuple(int(x) for x in row) for row in response_lens.cpu().tolist()),
    )


def step_bounds(
    plan: Plan, tokens: StepTokens, held: bool | None = None, deferred: bool | None = None
) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds at the bound of each phase timer of a step of these counts (`step_tokens`) on the spec's GPU
    (`cluster.gpu`), and at its device bound (the host link left out). `held`, `deferred`: where the actor's update
    ran, as `cost.phase_costs` takes them (default: the plan's steady state)."""
    peaks = KNOWN_PEAKS[plan.loaded.spec.cluster.gpu]
    costs = plan_phase_costs(plan, tokens, held, deferred)
    device = {k: tuple(Cost(p.flops, p.hbm_bytes) for p in parts) for k, parts in costs.items()}
    return tuple({k: round(v, 4) for k, v in phase_bounds(c, peaks).items()} for c in (costs, device))


def prefix_backward_bound_s(plan: Plan, tokens: StepTokens) -> float | None:
    """Seconds at the bound of the actor's backward through its prefix (`cost.plan_prefix_backward`, the part of
    `actor_suffix_backward` a run times apart as `prefix_backward_s`) in a step of these counts; None unsplit.
    Under data parallelism the measured seconds also hold the waits for the gradient sums that overlap it, which
    the bound leaves out."""
    cost = plan_prefix_backward(plan, tokens)
    return None if cost is None else round(cost.bound_s(KNOWN_PEAKS[plan.loaded.spec.cluster.gpu]), 4)
