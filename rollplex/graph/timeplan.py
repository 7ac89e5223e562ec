"""The time plan: each phase's cost over the steps a plan is made for, its bound on the plan's GPU, and its
predicted seconds at given efficiencies (`rollplex compile --dry-run`'s time table). Costs and bounds come from
the cost model (`cost.py` over `modelcost.py`); efficiencies from a bench, a run or the user
(`report.efficiency`). Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from rollplex.graph.cost import plan_actor_update, plan_phase_costs, plan_prefix_backward, timer_of, total
from rollplex.graph.ir import NodeKind, beside_decode, op, ops
from rollplex.graph.modelcost import KNOWN_PEAKS, RECORDED_FIELDS, Cost, DevicePeaks, StepTokens
from rollplex.graph.workload import PerGpu


def overlapped_timers(g) -> set[str]:
    """The timers of the ops that share a step with a decode in `g` (rollplex's prefixes beside it): the runtime
    counts their seconds in the rollout's."""
    decodes = [o.id for o in ops(g) if o.kind is NodeKind.DECODE]
    return {timer_of(op(g, name)) for d in decodes for name in beside_decode(g, d)}


@dataclass(frozen=True, slots=True)
class PhaseTime:
    timer: str
    cost: Cost
    bound_s: float
    efficiency: float | None  # bound over measured seconds, where known
    predicted_s: float | None  # at the efficiency (`time_plan`)


HOST_LINK_EFFICIENCY = 0.96  # the streamed optimizer's host traffic: 1.04x its ideal (`chunked_adamw_3b.json`)

UPDATE_BESIDE = "actor_prefix_beside_update"  # an efficiency's key: the actor prefix measured with an update in it
UPDATE_DEFERRED = "update_deferred"  # and the update's phase of a step whose update ran on past it
UPDATE_BESIDE_SHARE = 0.57  # of the shorter's seconds alone that the actor prefix and a streamed update beside it
# add to the longer's: they contend for the SMs (the update's kernels between the prefix's), the link's copies wait
# on them (docs/results.md, "The time plan against measured runs": 7B runs with the update apart and beside)


PREFIX_BACKWARD = "prefix_backward"  # the part of `actor_suffix_backward` the plan, runs and benches bound apart

PLANNED_STEPS = 64  # steps of a synthetic preset the time plan averages: a step decodes to its longest response
# ... fewer, down to one, where a step holds more prompts or responses than these over PLANNED_STEPS: a larger
# step's longest response varies less, and a dry-run's work stays bounded for any workload the spec takes
PLANNED_PROMPTS = 512
PLANNED_RESPONSES = 4096


def time_plan(
    plan, efficiencies: dict[str, float] | None = None, steps: Sequence[StepTokens] | None = None
) -> tuple[PhaseTime, ...]:
    """Each phase timer's cost and bound, averaged over `steps` (default: those the plan is made for,
    `planned_steps`; a run's own, recorded in its metrics, to check the plan against it), and its predicted seconds
    at the given efficiencies (`report.efficiency.read_efficiencies`). A bench's efficiency is that
    of a phase's device work (FLOPs and HBM bytes); its host-link traffic, which another spec may have where the
    bench had none (an optimizer state streamed rather than kept in HBM), is predicted at HOST_LINK_EFFICIENCY of
    the link, the two overlapping: each part takes the longer of the two. A phase that runs beside decode
    (`overlapped_timers`) has no seconds of its own: its time is in the rollout's. An actor prefix with the step
    before's update running on into it (`update_beside_prefix`): see `_prefix_beside_update_s`."""
    peaks = KNOWN_PEAKS[plan.loaded.spec.cluster.gpu]
    steps = steps or planned_steps(plan)
    each = [plan_phase_costs(plan, tokens) for tokens in steps]
    beside = overlapped_timers(plan.graph)
    found = efficiencies or {}
    deferring = plan.decisions.update_beside_prefix and "actor_prefix" in each[0]
    rows = []
    for timer in each[0]:
        parts = _mean_parts(each, timer)
        bound = sum(p.bound_s(peaks) for p in parts)
        e = None if timer in beside else found.get(timer)
        if timer == "update" and deferring:
            e = found.get(UPDATE_DEFERRED, e)
        predicted = sum(_predicted_s(p, peaks, e) for p in parts) if e else None
        if timer == "actor_prefix" and deferring and timer not in beside:
            e, predicted = _prefix_beside_update_s(plan, steps, parts, peaks, found)
        rows.append(PhaseTime(timer, total(parts), bound, e, predicted))
    return tuple(rows)


def _mean_parts(each: Sequence[dict[str, tuple[Cost, ...]]], timer: str) -> list[Cost]:
    """A timer's parts, each the mean over the steps' phase costs `each`."""
    return [sum((c[timer][k] for c in each), Cost()).scaled(1 / len(each)) for k in range(len(each[0][timer]))]


def _prefix_beside_update_s(
    plan, steps: Sequence[StepTokens], parts: list[Cost], peaks: DevicePeaks, found: dict[str, float]
) -> tuple[float | None, float | None]:
    """(efficiency, predicted seconds) of the actor prefix with the step before's update running on into it: at an
    efficiency measured so (UPDATE_BESIDE, of the two's device bound together); else the prefix and the actor's
    update each at its own efficiency as it costs alone, the longer whole and the shorter at UPDATE_BESIDE_SHARE of
    its seconds (the efficiency shown: the two's device bound over that, as a source measured so would give it).
    Unpredicted where the source prices neither way."""
    if e := found.get(UPDATE_BESIDE):
        return e, sum(_predicted_s(p, peaks, e) for p in parts)
    prefix_e, update_e = found.get("actor_prefix"), found.get("update")
    if not (prefix_e and update_e):
        return None, None
    alone = [plan_phase_costs(plan, tokens, held=False, deferred=False) for tokens in steps]
    prefix = sum(_predicted_s(p, peaks, prefix_e) for p in _mean_parts(alone, "actor_prefix"))
    update = sum(_predicted_s(plan_actor_update(plan, tokens), peaks, update_e) for tokens in steps) / len(steps)
    predicted = max(prefix, update) + UPDATE_BESIDE_SHARE * min(prefix, update)
    return sum(Cost(p.flops, p.hbm_bytes).bound_s(peaks) for p in parts) / predicted, predicted


def prefix_backward_plan(
    plan, steps: Sequence[StepTokens] | None = None, efficiency: float | None = None
) -> PhaseTime | None:
    """The actor's backward through its prefix (`cost.plan_prefix_backward`), a part of `actor_suffix_backward`
    shown apart, averaged over `steps` as `time_plan` averages, predicted at `efficiency` of its whole bound (the
    saved tensors' way back from the host in it, as runs and benches record it); None unsplit."""
    each = [plan_prefix_backward(plan, tokens) for tokens in (steps or planned_steps(plan))]
    if None in each:
        return None
    peaks = KNOWN_PEAKS[plan.loaded.spec.cluster.gpu]
    cost = total(each).scaled(1 / len(each))
    bound = cost.bound_s(peaks)
    predicted = bound / efficiency if efficiency else None
    return PhaseTime(PREFIX_BACKWARD, cost, bound, efficiency, predicted)


def recorded_tokens(d: dict) -> StepTokens:
    """A step's counts as a run's metrics line records them (`tokens`: `StepTokens.record()` as JSON lists)."""
    *per_prompt, lens = RECORDED_FIELDS
    rows = tuple(tuple(int(x) for x in row) for row in d[lens])
    return StepTokens(*(tuple(int(x) for x in d[k]) for k in per_prompt), rows)


def step_bound_s(plan, rows: tuple[PhaseTime, ...]) -> float:
    """The step's bound from its time plan `rows`: the phases one after another, but the work beside decode
    (`overlapped_timers`) shares the rollout: the two together take at least the larger of each alone and of their
    summed FLOPs, HBM bytes and link bytes each at its peak."""
    peaks = KNOWN_PEAKS[plan.loaded.spec.cluster.gpu]
    beside = overlapped_timers(plan.graph)
    alone = sum(r.bound_s for r in rows if r.timer not in beside and r.timer != "rollout")
    shared = [r for r in rows if r.timer in beside or r.timer == "rollout"]
    if not shared:
        return alone
    together = total([r.cost for r in shared]).bound_s(peaks)
    return alone + max(together, *(r.bound_s for r in shared))


def predicted_step_s(plan, rows: tuple[PhaseTime, ...]) -> float | None:
    """The step's predicted seconds: its phases' summed, where every phase with work and seconds of its own (not
    beside decode) is predicted; else None (a sum that leaves phases out is no step's)."""
    beside = overlapped_timers(plan.graph)
    timed = [r for r in rows if r.timer not in beside and (r.cost.flops or r.cost.hbm_bytes or r.cost.host_bytes)]
    if not timed or any(r.predicted_s is None for r in timed):
        return None
    return sum(r.predicted_s for r in timed)


def _predicted_s(part: Cost, peaks: DevicePeaks, efficiency: float) -> float:
    device = Cost(part.flops, part.hbm_bytes).bound_s(peaks) / efficiency
    return max(device, part.host_bytes / peaks.host_bytes_s / HOST_LINK_EFFICIENCY)


def planned_tokens(gpu: PerGpu, frames: int, lengths: Sequence[int] = ()) -> StepTokens:
    """The step the plan is made for: every prompt at its budget, videos of `frames` temporal patches, the
    responses of `lengths` in order (repeated as needed; default: every one at the budget)."""
    n, group = gpu.prompts_per_rank, gpu.group_size
    lengths = list(lengths) or [gpu.response_tokens]
    lens = [min(lengths[i % len(lengths)], gpu.response_tokens) for i in range(n * group)]
    return StepTokens(
        prompt_tokens=(gpu.prompt_tokens,) * n,
        patches=(gpu.patches_per_prompt,) * n,
        frames=(max(1, frames),) * n,
        response_lens=tuple(tuple(lens[p * group : (p + 1) * group]) for p in range(n)),
    )


def planned_steps(plan, count: int | None = None) -> tuple[StepTokens, ...]:
    """The steps' token counts as the plan sees them. A synthetic preset: its first `count` steps (default
    `planned_count`), their prompts' tokens within the budget and every patch and frame of their videos (the vision
    tower runs on all of them, as the run's own bounds count them), responses drawn from its length distribution
    for each (what `workload.replay_lengths` replays). Other data: one step, prompts at their budget, videos of the
    spec's frames, responses at the budget."""
    spec, gpu = plan.loaded.spec, plan.context.gpu
    w = spec.workload
    if not w.dataset.startswith("synthetic:"):
        return (planned_tokens(gpu, -(-w.video.frames // 2) if w.video else 1),)
    budgets = (gpu.prompt_tokens, gpu.response_tokens)
    count = count or planned_count(gpu.prompts_per_rank, gpu.group_size)
    return _synthetic_steps(w.dataset, spec.run.seed, gpu.prompts_per_rank, gpu.group_size, budgets, count)


def planned_count(prompts: int, group: int) -> int:
    """How many steps of `prompts` prompts of `group` responses each the time plan draws: PLANNED_STEPS, fewer where
    they would hold more than PLANNED_PROMPTS prompts or PLANNED_RESPONSES responses, at least one."""
    return max(1, min(PLANNED_STEPS, PLANNED_PROMPTS // prompts, PLANNED_RESPONSES // (prompts * group)))


@cache
def _synthetic_steps(
    dataset: str, seed: int, n: int, group: int, budgets: tuple[int, int], count: int
) -> tuple[StepTokens, ...]:
    """`planned_steps` of a synthetic preset, once per process for each workload (a dry-run prices many plans of
    one workload: every lever and residency it weighs)."""
    from rollplex.data.presets import synthetic_preset
    from rollplex.data.sizes import grid_thw

    preset = synthetic_preset(dataset)
    prompt_budget, response_budget = budgets
    merge = preset.vision.merge_size**2
    steps = []
    for k in range(count):
        layouts = [preset.layout(seed, k * n + i) for i in range(n)]
        lens = [min(int(x), response_budget) for x in preset.response.sample(n * group, seed + k)]
        steps.append(
            StepTokens(
                prompt_tokens=tuple(min(preset.prompt_tokens(lay), prompt_budget) for lay in layouts),
                patches=tuple(preset.num_video_tokens(lay) * merge for lay in layouts),  # the tower runs on all
                frames=tuple(grid_thw(lay.num_frames, *preset.frame_size(lay), preset.vision)[0] for lay in layouts),
                response_lens=tuple(tuple(lens[p * group : (p + 1) * group]) for p in range(n)),
            )
        )
    return tuple(steps)
