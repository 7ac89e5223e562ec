"""The cost model of a compiled plan: each phase's FLOPs and bytes for one step, and its bound on a device.

Each op of the plan's graph maps to the passes of the model it runs, priced by `modelcost.py` (which also states
the conventions of the counts): rollout's prefill then its decode, a prefix's forward, a role's scoring from a
boundary or over whole sequences, its backward, an update. The plan's choices shape the mapping: recompute, where
the prefix's saved tensors and the optimizer state live, mini-batches, a rollout prefilled by the actor's prefix,
the actor's update run beside the next prefix, a paged reference's weights. bound = max(FLOPs / peak FLOP/s, HBM
bytes / HBM bandwidth, host bytes / host-link bandwidth) for each part of an op (rollout's prefill and its decode
are two parts, one after the other), summed per phase timer (the keys of `time_s`: `rollout`, `ref_prefix`, ...).
Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from rollplex.graph.decisions import Decisions
from rollplex.graph.ir import (
    NodeKind,
    Op,
    Part,
    Role,
    backpropagated_prompts,
    op,
    ops,
    prefilled_decodes,
    steps,
    steps_of,
)
from rollplex.graph.memobject import Component, Residency
from rollplex.graph.modelcost import (
    Cost,
    DevicePeaks,
    StepTokens,
    backward,
    decode,
    grad_norm_pass,
    prefix_backward,
    prefix_forward,
    prefix_saved_bytes,
    suffix_forward,
    update,
    whole_forward,
)
from rollplex.graph.workload import PerGpu
from rollplex.layout import shapes as S
from rollplex.models.config import ModelConfig, TextConfig


def phase_costs(
    ops_: Sequence[Op],
    model: ModelConfig,
    gpu: PerGpu,
    d: Decisions,
    tokens: StepTokens,
    held: bool = False,
    deferred: bool = False,
) -> dict[str, tuple[Cost, ...]]:
    """{timer: the parts of its ops, in order} of one step. Under `update_beside_prefix`: `held`, the step's actor
    prefix runs the step before's actor update beside it (priced as this step's, the two as one part: one
    resource's work beside another's); `deferred`, the step's own actor update runs on past it, its update timer
    waiting for the gradient norm only."""
    split = {o.role for o in ops_ if o.part is Part.SUFFIX}  # the roles whose scoring starts at a boundary
    embedder = vision_embedder(ops_)
    prefilled = prefilled_decodes(ops_)
    out: dict[str, tuple[Cost, ...]] = {}
    for o in ops_:
        kept = backpropagated_prompts(ops_, o) if o.part is Part.PREFIX else None
        graph_share = None if kept is None else 1.0 / kept.count
        parts = op_parts(o, model, gpu, d, tokens, o.role in split, o is embedder, o.id in prefilled, graph_share)
        if deferred and _is_actor_update(o):
            parts = (grad_norm_pass(model.text, model.vision, gpu.train_tp, d),)
        out[timer_of(o)] = out.get(timer_of(o), ()) + parts
    if held and "actor_prefix" in out:
        out["actor_prefix"] = (total(out["actor_prefix"]) + actor_update(ops_, model, gpu, d, tokens),)
    return out


def actor_update(ops_: Sequence[Op], model: ModelConfig, gpu: PerGpu, d: Decisions, tokens: StepTokens) -> Cost:
    """The actor's update of one step, whole (a critic's is not in it)."""
    parts = [op_parts(o, model, gpu, d, tokens, split=False) for o in ops_ if _is_actor_update(o)]
    return total([p for each in parts for p in each])


def _is_actor_update(o: Op) -> bool:
    return o.kind is NodeKind.UPDATE and o.role is Role.ACTOR


def vision_embedder(ops_: Sequence[Op]) -> Op | None:
    """Under `model.freeze_vision`, the prefix op counted for the step's one vision forward (`SharedVision`: the
    first prefix to reach a prompt runs it): the reference's, else the actor's first."""
    prefixes = [o for o in ops_ if o.kind is NodeKind.FORWARD and o.part is Part.PREFIX]
    return next((o for o in prefixes if o.role is Role.REFERENCE), prefixes[0] if prefixes else None)


def plan_phase_costs(
    plan, tokens: StepTokens, held: bool | None = None, deferred: bool | None = None
) -> dict[str, tuple[Cost, ...]]:
    """`phase_costs` of a compiled plan, the reference's page-ins first in the timers of the ops they precede.
    `held`, `deferred` (`phase_costs`): by default a step of the plan's steady state, both where it runs the actor's
    update on into the next actor prefix (`update_beside_prefix`, a graph with an actor prefix); False, False prices
    the prefix and the update each alone."""
    g, d = plan.graph, plan.decisions
    steady = d.update_beside_prefix and any(o.role is Role.ACTOR and o.part is Part.PREFIX for o in ops(g))
    held, deferred = steady if held is None else held, steady if deferred is None else deferred
    costs = phase_costs(list(ops(g)), plan.loaded.model, plan.context.gpu, d, tokens, held, deferred)
    for timer, num_bytes in reference_page_ins(plan):
        costs[timer] = (Cost(host_bytes=num_bytes), *costs[timer])
    return costs


def plan_actor_update(plan, tokens: StepTokens) -> Cost:
    """`actor_update` of a compiled plan: what the step before's update adds to an actor prefix that runs it."""
    return actor_update(list(ops(plan.graph)), plan.loaded.model, plan.context.gpu, plan.decisions, tokens)


def plan_prefix_backward(plan, tokens: StepTokens) -> Cost | None:
    """The actor's backwards through its prefix in a step of a compiled plan (`prefix_backward`, each mini-batch's
    through its own prompts'): a part of `actor_suffix_backward`; None unsplit."""
    g, model, gpu, d = plan.graph, plan.loaded.model, plan.context.gpu, plan.decisions
    backwards = [o for o in ops(g) if o.role is Role.ACTOR and o.kind is NodeKind.BACKWARD]
    if not backwards or not any(o.role is Role.ACTOR and o.part is Part.PREFIX for o in ops(g)):
        return None
    return prefix_backward(model.text, model.vision, tokens, gpu.train_tp, d, gpu.sequence_parallel)


def reference_page_ins(plan) -> list[tuple[str, int]]:
    """Where the plan pages the reference (`memory.page_reference`), its weights cross the host link inwards at
    the start of each run of consecutive steps that use them and leave without a copy (`WeightPager`): per run,
    the timer of its first reference op and the bytes (per GPU)."""
    if plan.decisions.reference_weights is not Residency.HOST:
        return []
    held = (o for o in plan.residency.objects if o.role == Role.REFERENCE.value and o.component is Component.WEIGHTS)
    weights = sum(o.bytes for o in held)
    used = steps_of(plan.graph, Role.REFERENCE)
    firsts = [
        next(op(plan.graph, n) for n in s.ops if op(plan.graph, n).role is Role.REFERENCE)
        for s in steps(plan.graph)
        if s.index in used and s.index - 1 not in used
    ]
    return [(timer_of(o), weights) for o in firsts]


def phase_bounds(costs: dict[str, tuple[Cost, ...]], peaks: DevicePeaks) -> dict[str, float]:
    """Seconds at the bound of each timer: its parts one after another."""
    return {k: sum(part.bound_s(peaks) for part in parts) for k, parts in costs.items()}


def total(parts: Sequence[Cost]) -> Cost:
    out = Cost()
    for part in parts:
        out = out + part
    return out


TIMERS = (
    "rollout", "reward", "ref_prefix", "actor_prefix", "critic_prefix", "ref_suffix", "actor_suffix_backward",
    "critic_suffix_backward", "update",
)  # fmt: skip


def timer_of(o: Op) -> str:
    """The `time_s` key (one of `TIMERS`) an op's seconds count under, at run time and in the time plan (a step
    records the timers of its graph's ops, `timers`)."""
    if o.kind is NodeKind.DECODE:
        return "rollout"
    if o.kind in (NodeKind.REWARD, NodeKind.UPDATE):
        return o.kind.value
    who = {Role.REFERENCE: "ref", Role.CRITIC: "critic"}.get(o.role, "actor")
    if o.part is Part.PREFIX:
        return f"{who}_prefix"
    return "ref_suffix" if who == "ref" else f"{who}_suffix_backward"


def timers(ops_: Sequence[Op]) -> tuple[str, ...]:
    """The timers of these ops, in `TIMERS` order."""
    used = {timer_of(o) for o in ops_}
    return tuple(t for t in TIMERS if t in used)


def op_parts(o: Op, model: ModelConfig, gpu: PerGpu, d: Decisions, tokens: StepTokens, split: bool,
             embeds_vision: bool = True, prefilled: bool = False, graph_share: float | None = None
             ) -> tuple[Cost, ...]:  # fmt: skip
    """An op's parts, one after another: rollout's prefill (unless `prefilled`: it reads a prefix's boundary,
    `prefill_from_actor`) then its decode; one part for any other op (`op_cost`)."""
    if o.kind is NodeKind.DECODE:
        t, v = model.text, model.vision
        tokens = slowest_replica(t, tokens, gpu)
        prefill = () if prefilled else (prefix_forward(t, v, tokens, gpu.rollout_tp),)
        return *prefill, decode(t, tokens, gpu.rollout_tp)
    return (op_cost(o, model, gpu, d, tokens, split, embeds_vision, graph_share),)


def slowest_replica(t: TextConfig, tokens: StepTokens, gpu: PerGpu) -> StepTokens:
    """What a training rank's rollout waits for: where its replicas share the prompts (`parallel.split_rollout`),
    the share that decodes the most bytes (they decode at once); else every prompt."""
    if gpu.prompts_per_replica >= gpu.prompts_per_rank:
        return tokens
    parts = [tokens.of_prompts(share) for share in S.shares(len(tokens.prompt_tokens), gpu.train_tp // gpu.rollout_tp)]
    return max(parts, key=lambda part: decode(t, part, gpu.rollout_tp).hbm_bytes)


def op_cost(o: Op, model: ModelConfig, gpu: PerGpu, d: Decisions, tokens: StepTokens, split: bool,
            embeds_vision: bool = True, graph_share: float | None = None) -> Cost:  # fmt: skip
    """One op's cost (parts summed); `split`: the op's role scores from a boundary (its backward has a prefix);
    `embeds_vision`: a prefix op runs the vision tower even under `freeze_vision` (`vision_embedder`);
    `graph_share`: the part of the step's prompts a prefix op keeps its graph for (`ir.backpropagated_prompts`;
    default its own share)."""
    t, v, tp = model.text, model.vision, gpu.train_tp
    share = _share(o, tokens)
    if o.kind is NodeKind.DECODE:
        return total(op_parts(o, model, gpu, d, tokens, split, embeds_vision))
    if o.kind is NodeKind.UPDATE:
        actor = o.role is Role.ACTOR  # a critic's optimizer is not sharded (ZeRO-1 is the actor's)
        shards = gpu.train_dp if d.distributed_optimizer and actor else 1
        return update(t, v, tp, d, keeps_share=actor, shards=shards)
    if o.kind is NodeKind.REWARD:
        return Cost()
    if o.kind is NodeKind.FORWARD and o.part is Part.PREFIX:
        cost = prefix_forward(t, v, tokens, tp, vision=embeds_vision or not d.freeze_vision).scaled(share)
        if o.role is Role.ACTOR and d.prefix_saved is Residency.HOST:
            saved = prefix_saved_bytes(t, v, tokens, tp, d, gpu.sequence_parallel)
            cost = cost + Cost(host_bytes=(share if graph_share is None else graph_share) * saved)
        return cost
    if o.kind is NodeKind.FORWARD:
        if o.fused_into is not None:
            return Cost()  # a trained role's scoring runs fused with its backward (the backward op counts it)
        return (suffix_forward(t, tokens, tp) if o.part is Part.SUFFIX else whole_forward(t, v, tokens, tp)).scaled(
            share
        )
    value, sp = o.role is Role.CRITIC, gpu.sequence_parallel  # a value model: a scalar head for the LM head
    return backward(split, t, v, tokens, tp, d, sp, value).scaled(share)


def _share(o: Op, tokens: StepTokens) -> float:
    return 1.0 if o.minibatch is None else 1.0 / o.minibatch.count  # a mini-batch's share of the prompts, or all
