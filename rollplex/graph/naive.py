"""The everything-resident footprint: what naive overlap would hold on one GPU at once (the paper's Table 1).

Every role keeps its weights, gradients, FP32 master weights, Adam moments, one training microbatch of
activations (no recompute) and its boundary KV; rollout keeps its own weight copy and its KV cache.
The vision encoder is reported apart, as the paper's table counts the language model only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rollplex.graph.ir import TensorClass
from rollplex.graph.memobject import Component, Context, MemObject
from rollplex.graph.objects import memory_objects


@dataclass(frozen=True, slots=True)
class NaiveRow:
    role: str
    component: str  # how the plan prints it
    bytes: int
    vision: bool


def naive_rows(c: Context) -> list[NaiveRow]:
    spec = c.spec.model_copy(
        update={"memory": c.spec.memory.model_copy(update={"weight_sharing": False, "recompute": "none"})}
    )
    objects = memory_objects(replace(c, spec=spec))
    return [NaiveRow(o.role, o.label, o.bytes, o.vision) for o in objects if _counted(o)]


def _counted(o: MemObject) -> bool:
    """Model state, activations, boundaries, rollout state and the reserve; not the small data tensors,
    the offloaded prefix state, the in-flight layer, our scoring attention's copy of the prompts' KV or the
    boundary KV's gradient, which the paper's table does not list either (it lists the boundary once)."""
    left_out = (
        Component.DATA,
        Component.PREFIX_SAVED,
        Component.PREFIX_LAYER,
        Component.SUFFIX_ATTENTION,
        Component.BOUNDARY_GRADIENT,
        Component.BOUNDARY_LOGPROBS,
    )
    return o.component not in left_out and (o.cls is not TensorClass.PHASE_LOCAL or o.bytes > 0)
