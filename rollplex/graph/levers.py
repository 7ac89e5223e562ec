"""What would make an infeasible plan fit, and what would make a feasible one faster: the levers this spec has,
each priced by compiling the spec with it.

A lever is a change of spec keys that exists for this spec (a setting not already chosen, a TP degree within the
cluster that splits the model's heads, a smaller workload). Each is applied to a copy of the spec and compiled
(the compiler is cheap); the levers that lower what the plan needs are reported with what it then needs, those
that make the plan fit first (`price_levers`). For a plan that fits, `faster_residencies` prices the other
placement of the prefix's saved tensors and of the FP32 state by the time plan's step bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from rollplex.errors import SpecError
from rollplex.graph.load import LoadedSpec, check_model_fits_parallel
from rollplex.graph.spec import Spec

GIB = 2**30


@dataclass(frozen=True)
class Lever:
    text: str  # as the user would write it: "set memory.recompute: full"
    changes: dict  # nested spec keys -> new values


@dataclass(frozen=True)
class Priced:
    lever: Lever
    need_bytes: int  # the plan's peak without what it spends to save time (`ResidencyPlan.need_bytes`)
    fits: bool

    def line(self) -> str:
        verdict = "fits" if self.fits else "still over"
        return f"{self.lever.text} (needs {self.need_bytes / GIB:.1f} GiB, {verdict})"


def candidate_levers(spec: Spec) -> list[Lever]:
    """The changes that exist for this spec and could lower a GPU's peak."""
    m, p, w, c = spec.memory, spec.parallel, spec.workload, spec.cluster
    found = []
    if m.recompute != "full":
        found.append(Lever("set memory.recompute: full", {"memory": {"recompute": "full"}}))
    if m.layers_kept not in ("auto", 0):
        found.append(Lever("set memory.layers_kept: auto", {"memory": {"layers_kept": "auto"}}))
    if m.prefix_activations != "recompute":
        found.append(Lever("set memory.prefix_activations: recompute", {"memory": {"prefix_activations": "recompute"}}))
    for key in ("optimizer_state", "prefix_saved"):
        if getattr(m, key) != "host":
            found.append(Lever(f"set memory.{key}: host", {"memory": {key: "host"}}))
    if m.runtime_reserve_gib > 1:
        found.append(Lever("set memory.runtime_reserve_gib: 1", {"memory": {"runtime_reserve_gib": 1.0}}))
    if c.num_gpus > p.train_tp and not p.distributed_optimizer:
        found.append(Lever("set parallel.distributed_optimizer: true", {"parallel": {"distributed_optimizer": True}}))
    for tp in range(p.train_tp + 1, c.num_gpus + 1):  # every degree the cluster splits into (heads checked later)
        if c.num_gpus % tp == 0:
            found.append(Lever(f"raise parallel.train_tp to {tp}", {"parallel": {"train_tp": tp}}))
    if p.rollout_tp < p.train_tp:
        r = next(r for r in range(p.rollout_tp + 1, p.train_tp + 1) if p.train_tp % r == 0)
        found.append(Lever(f"raise parallel.rollout_tp to {r}", {"parallel": {"rollout_tp": r}}))
    dp = c.num_gpus // p.train_tp
    if w.prompts_per_step // 2 >= dp and (w.prompts_per_step // 2) % dp == 0:
        half = w.prompts_per_step // 2
        found.append(Lever(f"lower workload.prompts_per_step to {half}", {"workload": {"prompts_per_step": half}}))
    return found


MAX_CHAIN = 4  # levers combined at most, when none fits alone


def price_levers(loaded: LoadedSpec, schedule, need_bytes: int) -> list[Priced]:
    """Each lever that lowers what the plan needs (`ResidencyPlan.need_bytes`), with what it gives; those that
    fit first, then by need. When none fits alone, the first entry chains them (the best, then the best on top of
    it, ...) until the plan fits."""
    singles = _priced(loaded, schedule, need_bytes)
    chain, current, priced = [], loaded, singles
    while priced and not (chain and chain[-1].fits) and len(chain) < MAX_CHAIN:
        chain.append(priced[0])  # each entry lowers the peak below the last: `_priced` keeps only those
        current = with_changes(current, priced[0].lever.changes)
        priced = _priced(current, schedule, priced[0].need_bytes)
    if len(chain) > 1 and chain[-1].fits:
        text = ", then ".join(p.lever.text for p in chain)
        return [Priced(Lever(text, {}), chain[-1].need_bytes, True), *singles]
    return singles


@dataclass(frozen=True)
class Faster:
    lever: Lever
    bound_s: float  # the step's bound with the lever (`timeplan.step_bound_s`)
    predicted_s: float | None  # at the given efficiencies


RESIDENCY_KEYS = ("prefix_saved", "optimizer_state")


def faster_residencies(plan, efficiencies: dict[str, float] | None = None) -> list[Faster]:
    """The other placement (hbm or host) of each of `RESIDENCY_KEYS`, where its plan fits and its step bound is
    lower than `plan`'s: fastest first. The decoder layers kept whole stay as planned (the lever names their
    number where the spec leaves it to auto): HBM a placement frees would otherwise go to more of them, and the
    bound, which hides the link's traffic under the device's work, would count each placement on the host as a
    gain."""
    from rollplex.graph.plan import compile_plan, keeping_layers

    bound, _ = step_seconds(plan, efficiencies)
    found = []
    for key in RESIDENCY_KEYS:
        other = "host" if getattr(plan.decisions, key).value == "hbm" else "hbm"
        changes = keeping_layers(plan, {"memory": {key: other}})
        pinned = f" and memory.layers_kept: {plan.decisions.layers_kept}" if "layers_kept" in changes["memory"] else ""
        lever = Lever(f"set memory.{key}: {other}{pinned}", changes)
        try:
            alternative = compile_plan(with_changes(plan.loaded, changes), plan.schedule)
        except (ValidationError, SpecError, ValueError):
            continue
        if alternative.residency.fits:
            faster = Faster(lever, *step_seconds(alternative, efficiencies))
            if faster.bound_s < bound:
                found.append(faster)
    return sorted(found, key=lambda f: f.bound_s)


def faster_recompute(plan, efficiencies: dict[str, float] | None = None) -> list[Faster]:
    """The other `memory.recompute` settings (none, selective, full) whose plan fits with a lower step bound than
    `plan`'s: fastest first. Auto may have kept the one it did on a tie (`plan._beats`), or the spec named it."""
    from rollplex.graph.plan import RECOMPUTE_SETTINGS, compile_plan

    bound, _ = step_seconds(plan, efficiencies)
    found = []
    for value in RECOMPUTE_SETTINGS["recompute"]:
        if value == plan.loaded.spec.memory.recompute:
            continue
        lever = Lever(f"set memory.recompute: {value}", {"memory": {"recompute": value}})
        alternative = compile_plan(with_changes(plan.loaded, lever.changes), plan.schedule)
        if alternative.residency.fits:
            faster = Faster(lever, *step_seconds(alternative, efficiencies))
            if faster.bound_s < bound:
                found.append(faster)
    return sorted(found, key=lambda f: f.bound_s)


def step_seconds(plan, efficiencies: dict[str, float] | None = None) -> tuple[float, float | None]:
    """The step's bound (`timeplan.step_bound_s`) and (given efficiencies that price every phase) predicted seconds
    (`timeplan.predicted_step_s`)."""
    from rollplex.graph.timeplan import predicted_step_s, step_bound_s, time_plan

    rows = time_plan(plan, efficiencies)
    return step_bound_s(plan, rows), predicted_step_s(plan, rows)


def _priced(loaded: LoadedSpec, schedule, need_bytes: int) -> list[Priced]:
    from rollplex.graph.plan import compile_plan

    priced = []
    for lever in candidate_levers(loaded.spec):
        try:
            changed = with_changes(loaded, lever.changes)
            plan = compile_plan(changed, schedule)
        except (ValidationError, SpecError, ValueError):
            continue  # not a lever for this spec after all (a TP degree the heads do not split, ...)
        r = plan.residency
        if r.need_bytes < need_bytes:
            priced.append(Priced(lever, r.need_bytes, r.fits))
    return sorted(priced, key=lambda x: (not x.fits, x.need_bytes))


def with_changes(loaded: LoadedSpec, changes: dict) -> LoadedSpec:
    """The loaded spec with `changes` (nested spec keys -> new values), validated again; what the user left to its
    default stays unset (the dry-run names the defaults it priced)."""
    spec = Spec.model_validate(_merged(loaded.spec.model_dump(by_alias=True, exclude_unset=True), changes))
    check_model_fits_parallel(spec, loaded.model)
    return LoadedSpec(spec, loaded.model, loaded.path, loaded.yaml_root)


def _merged(base: dict, changes: dict) -> dict:
    out = dict(base)
    for key, value in changes.items():
        out[key] = _merged(out.get(key) or {}, value) if isinstance(value, dict) else value
    return out
