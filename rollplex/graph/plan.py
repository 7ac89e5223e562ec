"""The compiled plan: the phased graph, the per-GPU residency plan, the runtime's decisions, the naive
footprint and weight sharing. The runtime's only input: it walks `graph`'s steps and builds its engines from
`decisions`, the spec's algorithm, workload and run settings and the model config.

`compile_plan` is the whole compiler from a loaded spec (`memory.prefix_activations` and `memory.recompute` at auto
compile the spec both ways, keeping what autograd saves where that fits unless rerunning beats it; where the FP32
state streams, `memory.prefix_saved: auto` compiles the spec with the tensors on the host too and
`sharing.update_beside_prefix: auto` with the update beside the next actor prefix, each keeping the plan that beats
the other: the lower step bound, or within 1 % of it the fewer bytes over the host link, `_beats`);
`check_fits` turns an infeasible plan into the
one error a user sees (phase, peak, capacity, largest objects, and the levers this spec has with the peak each
gives, `levers.py`). `planfile` writes and
reads it as `plan.json`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import networkx as nx

from rollplex.errors import PlanDoesNotFit, SpecError
from rollplex.graph.decisions import Decisions
from rollplex.graph.ir import Schedule
from rollplex.graph.levers import price_levers, with_changes
from rollplex.graph.load import LoadedSpec
from rollplex.graph.memobject import GIB, Component, Context, MemObject, Residency
from rollplex.graph.naive import NaiveRow, naive_rows
from rollplex.graph.pipeline import compile_graph, lower
from rollplex.graph.residency import ResidencyPlan
from rollplex.layout.sharing import SharingReport


@dataclass(frozen=True)
class Plan:
    loaded: LoadedSpec
    schedule: Schedule
    graph: nx.DiGraph
    context: Context
    residency: ResidencyPlan
    naive: tuple[NaiveRow, ...]
    decisions: Decisions
    chosen: str = ""  # what each `auto` chose by the step bound, and why, a line each ("" where fit alone chose)

    @property
    def sharing(self) -> SharingReport:
        return self.context.sharing


# Each recompute setting's values, from the one that keeps everything autograd saves to the one that reruns most.
RECOMPUTE_SETTINGS = {"prefix_activations": ("offload", "recompute"), "recompute": ("none", "selective", "full")}


def compile_plan(loaded: LoadedSpec, schedule: Schedule | None = None, *, check: bool = False) -> Plan:
    schedule = schedule or Schedule(loaded.spec.schedule)
    for key, values in RECOMPUTE_SETTINGS.items():
        if getattr(loaded.spec.memory, key) == "auto":
            return _keeps_where_it_fits(loaded, schedule, check, key, values)
    plan = _compiled(loaded, schedule, check)
    d = plan.decisions
    if (
        loaded.spec.memory.prefix_saved == "auto"
        and d.prefix_saved is Residency.HBM
        and d.optimizer_state is Residency.HOST
    ):
        # the saved tensors in HBM crowd the FP32 state's share out: its traffic is exposed in the update, theirs
        # hides under the prefix's compute
        plan = _if_faster(
            plan, {"memory": {"prefix_saved": "host"}}, check,
            "memory.prefix_saved auto: host, the HBM they leave keeps more of the FP32 state", "with them in HBM",
        )  # fmt: skip
    if loaded.spec.sharing.update_beside_prefix == "auto" and _actor_state_streams(plan):
        # the streamed update is the host link's time, the next actor prefix's is compute: one under the other
        plan = _if_faster(
            plan, {"sharing": {"update_beside_prefix": True}}, check,
            "sharing.update_beside_prefix auto: true, the streamed update runs under the next actor prefix's compute",
            "with the update ending its step",
        )  # fmt: skip
    return plan


def _keeps_where_it_fits(loaded: LoadedSpec, schedule: Schedule, check: bool, key: str, values: tuple[str, ...]):
    """`memory.<key>: auto`: the plan of each of `values` (`RECOMPUTE_SETTINGS`' order), each compiled whole, its
    other `auto` settings settled too. Of those that fit, the one that keeps the most, unless one that reruns more
    beats it (`_beats`), and so on down the list; where none fits, the one that reruns the most (its error then
    names the levers left)."""
    plans = [compile_plan(with_changes(loaded, {"memory": {key: v}}), schedule, check=check) for v in values]
    fitting = [(v, p) for v, p in zip(values, plans, strict=True) if p.residency.fits]
    if not fitting:
        return plans[-1]
    (kept, best), why = fitting[0], ""
    for value, plan in fitting[1:]:
        if beaten := _beats(plan, best):
            why = f"memory.{key} auto: {value} ({beaten} with {kept})"
            kept, best = value, plan
    return replace(best, chosen="\n".join(x for x in (best.chosen, why) if x)) if why else best


def _if_faster(plan: Plan, changes: dict, check: bool, chose: str, otherwise: str) -> Plan:
    """An `auto` setting: the plan compiled with `changes` where it fits, differs in its decisions (a change that
    has no effect is none) and beats `plan` (`_beats`) or `plan` does not fit, with why added to `chosen`; else
    `plan`. They are weighed with `plan`'s decoder layers kept whole (`memory.layers_kept`), the HBM a change frees
    otherwise buying more of them, which the bound would count for the change; the plan taken keeps its own."""
    kept = keeping_layers(plan, changes)
    pinned = _compiled(with_changes(plan.loaded, kept), plan.schedule, check)
    if pinned.decisions == plan.decisions or not pinned.residency.fits:
        return plan
    why = _beats(pinned, plan) if plan.residency.fits else "the plan does not fit"
    if not why:
        return plan
    other = pinned if kept is changes else _compiled(with_changes(plan.loaded, changes), plan.schedule, check)
    why = f"{chose} ({why} {otherwise})"
    return replace(other, chosen="\n".join(x for x in (plan.chosen, why) if x))


def keeping_layers(plan: Plan, changes: dict) -> dict:
    """`changes` with `plan`'s decoder layers kept whole as a number, where the spec leaves them to auto."""
    if plan.loaded.spec.memory.layers_kept != "auto":
        return changes
    memory = {**changes.get("memory", {}), "layers_kept": plan.decisions.layers_kept}
    return {**changes, "memory": memory}


TIE = 0.01  # step bounds this close, relative to the larger, are a tie


def _beats(plan: Plan, other: Plan) -> str:
    """Why `plan` is the faster of the two, or "" where it is not: a lower step bound, or bounds within TIE of each
    other and fewer bytes over the host link (the traffic the measured runs hide least behind the device's work: the
    7B prefix beside the streamed update, docs/results.md)."""
    from rollplex.graph.timeplan import step_bound_s, time_plan

    (ours, mine), (theirs, yours) = (
        (step_bound_s(p, rows), sum(r.cost.host_bytes for r in rows) / 1e9)
        for p, rows in ((plan, time_plan(plan)), (other, time_plan(other)))
    )
    bound = f"step bound {ours:.2f} s against {theirs:.2f}"
    if abs(ours - theirs) > TIE * max(ours, theirs):
        return bound if ours < theirs else ""
    return f"{bound}, a tie: {mine:.1f} GB over the host link a step against {yours:.1f}" if mine < yours else ""


def _actor_state_streams(plan: Plan) -> bool:
    """Whether part of the actor's FP32 state lives in the pinned pool (a critic's may while the actor's is kept)."""
    state = (Component.MASTER, Component.MOMENTS)
    return any(o.role == "actor" and o.component in state and o.host_bytes for o in plan.residency.objects)


def _compiled(loaded: LoadedSpec, schedule: Schedule, check: bool) -> Plan:
    try:
        g = compile_graph(loaded.spec, schedule=schedule, check=check)
    except SpecError as e:
        raise loaded.locate(e) from None
    return plan_of(loaded, schedule, g)


def plan_of(loaded: LoadedSpec, schedule: Schedule, g: nx.DiGraph, decisions: Decisions | None = None) -> Plan:
    """The plan of a compiled graph: its memory lowered, and the decisions (`decide`'s, unless given). The spec's
    recompute settings are settled (`compile_plan` settles auto)."""
    unsettled = [key for key in RECOMPUTE_SETTINGS if getattr(loaded.spec.memory, key) == "auto"]
    assert not unsettled, f"memory.{unsettled[0]} auto reached the lowering: compile the spec with compile_plan"
    low = lower(g, loaded.spec, loaded.model, decisions)
    return Plan(loaded, schedule, g, low.context, low.residency, tuple(naive_rows(low.context)), low.decisions)


def remedies(plan: Plan, objects: list[MemObject]) -> list[str]:
    """Levers that exist for this spec and act on `objects` (the largest first): none already pulled, none past
    the cluster (a TP degree above its GPUs)."""
    spec = plan.loaded.spec
    p, m, gpus = spec.parallel, spec.memory, spec.cluster.num_gpus
    more_tp = "raise parallel.train_tp" if p.train_tp < gpus else "add GPUs (cluster.gpus_per_node, cluster.nodes)"
    levers = {
        Component.ACTIVATIONS: "set memory.recompute: full"
        if m.recompute != "full"
        else "lower memory.microbatch_tokens or workload.response_tokens",
        Component.LAYERS_KEPT: "lower memory.layers_kept",
        Component.KV_CACHE: "lower memory.rollout_kv_gib" if m.rollout_kv_gib else "lower workload.prompts_per_step",
        Component.GRADIENTS: more_tp,
        Component.MASTER: "set parallel.distributed_optimizer: true" if gpus > p.train_tp else more_tp,
        Component.MOMENTS: "set parallel.distributed_optimizer: true" if gpus > p.train_tp else more_tp,
        Component.BOUNDARY_KV: "lower workload.prompts_per_step or add GPUs (more data-parallel ranks)",
        Component.CASE3_BUFFER: "raise parallel.rollout_tp" if p.rollout_tp < p.train_tp else "",
        Component.RESERVE: "lower memory.runtime_reserve_gib" if m.runtime_reserve_gib > 0 else "",
        Component.OPTIMIZER_CHUNKS: "set memory.optimizer_chunk_mib lower",
        Component.PREFIX_LAYER: "lower workload.prompt_tokens",
    }
    found = []
    for o in objects:
        lever = levers.get(o.component, "")
        if o.component is Component.WEIGHTS:  # rollout's own copy shrinks with its TP degree, the trainer's with TP
            lever = "raise parallel.rollout_tp" if o.role == "rollout" and p.rollout_tp < p.train_tp else more_tp
        if lever and lever not in found:
            found.append(lever)
    return found


def check_fits(plan: Plan) -> None:
    r = plan.residency
    if not r.fits_hbm:
        phase = max(r.phases, key=lambda p: p.peak_bytes)
        top = sorted(r.in_hbm(phase.peak_step), key=lambda o: -o.bytes)[:3]
        largest = ", ".join(f"{_name(o)} {o.bytes / GIB:.1f}" for o in top)
        priced = price_levers(plan.loaded, plan.schedule, r.need_bytes)
        fixes = "; ".join([p.line() for p in priced[:3]] or remedies(plan, top)[:2])
        raise PlanDoesNotFit(
            f"{plan.loaded.path}: plan does not fit: {phase.phase.title} peaks at {phase.peak_bytes / GIB:.1f} GiB > "
            f"{r.capacity_bytes / GIB:.1f} GiB per GPU; largest: {largest} GiB; to fit: {fixes or 'add GPUs'}"
        )
    if not r.host.fits:
        h, spec = r.host, plan.loaded.spec
        levers = [
            "set memory.prefix_activations: recompute" if spec.memory.prefix_activations != "recompute" else "",
            "raise memory.host_pool_gib" if h.pinned_bytes_per_node < h.capacity_bytes_per_node else "",
            "raise parallel.train_tp" if spec.parallel.train_tp < spec.cluster.num_gpus else "raise cluster.host_gib",
        ]
        raise PlanDoesNotFit(
            f"{plan.loaded.path}: plan does not fit in host memory: "
            f"needs {h.needed_bytes_per_node / GIB:.1f} GiB pinned per node "
            f"(pool {h.pinned_bytes_per_node / GIB:.1f}, host {h.capacity_bytes_per_node / GIB:.1f}); to fit: "
            + ", or ".join(x for x in levers if x)
        )


def _name(o: MemObject) -> str:
    role = "" if o.label.startswith(o.role) else f"{o.role} "
    return f"{role}{'vision ' if o.vision else ''}{o.label}"
