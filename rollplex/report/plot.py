"""`--plot FILE.png`: HBM per GPU by role over the iteration's steps, stacked, with the capacity line."""

from __future__ import annotations

from pathlib import Path

from rollplex.graph.ir import steps
from rollplex.graph.memobject import GIB, held
from rollplex.graph.plan import Plan

_COLORS = {
    "actor": "#4c72b0",
    "reference": "#55a868",
    "rollout": "#c44e52",
    "critic": "#8172b2",
    "optimizer": "#ccb974",
    "data": "#64b5cd",
    "runtime": "#999999",
}


def plot_memory(plan: Plan, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = plan.residency
    n = len(r.step_bytes)
    roles = list(dict.fromkeys(o.role for o in r.objects))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * n + 2), 4.5))
    bottom = [0.0] * n
    for role in roles:
        heights = [sum(o.bytes for o in held(r.objects, i) if o.role == role) / GIB for i in range(n)]
        if any(heights):
            ax.bar(range(n), heights, bottom=bottom, color=_COLORS.get(role, "#dd8452"), label=role, width=0.8)
            bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.axhline(r.capacity_bytes / GIB, color="black", linestyle="--", linewidth=1, label="capacity")
    ax.set_xticks(range(n), [_label(plan, i) for i in range(n)], fontsize=7)
    ax.set_ylabel("HBM per GPU (GiB)")
    ax.set_title(f"{plan.loaded.model.name}, schedule {plan.schedule.value}")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _label(plan: Plan, i: int) -> str:
    s = steps(plan.graph)[i]
    return f"P{int(s.phase)}\n" + " +\n".join(s.ops)
