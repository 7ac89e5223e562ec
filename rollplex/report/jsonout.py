"""The plan as JSON (`rollplex compile --format json`, and `plan.json`): the runtime's part
(`graph.planfile.plan_dict`) and the memory report."""

from __future__ import annotations

from rollplex.graph.memobject import GIB, MemObject, Residency
from rollplex.graph.plan import Plan
from rollplex.graph.planfile import plan_dict
from rollplex.graph.timeplan import PREFIX_BACKWARD, prefix_backward_plan, time_plan


def _gib(b: int) -> float:
    return round(b / GIB, 3)


def plan_to_json(
    plan: Plan, efficiencies: dict[str, float] | None = None, efficiency_source: str | None = None
) -> dict:
    r, sh = plan.residency, plan.sharing
    naive_llm = [x for x in plan.naive if not x.vision]
    return {
        **plan_dict(plan),  # what `rollplex run plan.json` reads; the rest is the memory report
        "model": plan.loaded.model.name,
        "per_gpu": {k: getattr(plan.context.gpu, k) for k in plan.context.gpu.__slots__},
        "naive": {
            "total_gib": _gib(sum(x.bytes for x in naive_llm)),
            "vision_gib": _gib(sum(x.bytes for x in plan.naive if x.vision)),
            "rows": [
                {"role": x.role, "component": x.component, "gib": _gib(x.bytes), "vision": x.vision} for x in plan.naive
            ],
        },
        "plan": {
            "phases": [
                {
                    "name": p.phase.title,
                    "phase": int(p.phase),
                    "peak_gib": _gib(p.peak_bytes),
                    "steps": list(p.steps),
                    "objects": [_object(o, p.steps) for o in r.objects if _present(o, p.steps)],
                }
                for p in r.phases
            ],
            "step_gib": [_gib(b) for b in r.step_bytes],
            "peak_gib": _gib(r.peak_bytes),
        },
        "time_plan": [
            {
                "phase": t.timer,
                "tflop": round(t.cost.flops / 1e12, 3),
                "hbm_gb": round(t.cost.hbm_bytes / 1e9, 3),
                "host_gb": round(t.cost.host_bytes / 1e9, 3),
                "bound_s": round(t.bound_s, 4),
                "efficiency": t.efficiency,
                "predicted_s": None if t.predicted_s is None else round(t.predicted_s, 4),
            }
            for t in time_plan(plan, efficiencies)
        ],
        "efficiency_source": efficiency_source,  # where the time plan's efficiencies came from (None: none given)
        # of actor_suffix_backward's time_plan row: the part through the prefix
        "prefix_backward": _prefix_backward(plan, efficiencies),
        "capacity_gib": _gib(r.capacity_bytes),
        "fits": r.fits,
        "sharing": {
            "train_tp": sh.train_tp,
            "rollout_tp": sh.rollout_tp,
            "case_params": {str(c): sh.case_params[c] for c in (1, 2, 3)},
            "case_percent": {str(c): round(sh.percent(c), 2) for c in (1, 2, 3)},
            "case3_buffer_gib": _gib(sh.case3_buffer_bytes_per_gpu),
            "exchange_gib": _gib(sh.exchange_bytes_per_gpu),
            "tensors": [
                {
                    "family": e.family.name,
                    "count": e.family.count,
                    "params": e.family.params,
                    "case": int(e.case),
                    "reason": e.reason,
                }
                for e in sh.entries
            ],
        },
        "optimizer": {
            "chunk_bytes": r.optimizer.chunk_bytes if r.optimizer else 0,
            "num_chunks": r.optimizer.num_chunks if r.optimizer else 0,
            "state_gib": _gib(r.optimizer.state_bytes) if r.optimizer else 0.0,
        },
        "host": {
            "pinned_gib": _gib(r.host.pinned_bytes_per_node),
            "needed_gib": _gib(r.host.needed_bytes_per_node),
            "capacity_gib": _gib(r.host.capacity_bytes_per_node),
        },
    }


def _present(o: MemObject, idx: tuple[int, ...]) -> bool:
    return any(o.residency(i) is not Residency.ABSENT for i in idx)


def _object(o: MemObject, idx: tuple[int, ...]) -> dict:
    states = [o.residency(i) for i in idx]
    where = (
        Residency.HBM if Residency.HBM in states else next((r for r in states if r is not Residency.ABSENT), states[0])
    )
    return {
        "role": o.role,
        "component": o.label,
        "class": o.cls.value,
        "vision": o.vision,
        "gib": _gib(o.bytes),
        "residency": where.value,
        "turn": o.turn or None,  # a split backward's part it is held in: of a role's turns a step holds the larger
    }


def _prefix_backward(plan, efficiencies: dict[str, float] | None) -> dict | None:
    if (t := prefix_backward_plan(plan, efficiency=(efficiencies or {}).get(PREFIX_BACKWARD))) is None:
        return None
    c = t.cost
    return {"tflop": round(c.flops / 1e12, 3), "hbm_gb": round(c.hbm_bytes / 1e9, 3),
            "host_gb": round(c.host_bytes / 1e9, 3), "bound_s": round(t.bound_s, 4), "efficiency": t.efficiency,
            "predicted_s": None if t.predicted_s is None else round(t.predicted_s, 3)}  # fmt: skip
