"""The byte model's vocabulary: a memory object (its bytes, class, HBM window and where it waits outside it),
where it can be (`Residency`), what it is (`Component`), and the compiled graph and shapes a plan prices them
from (`Context`). Which objects an iteration has: `objects.py`; where they go: `residency.py`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum, StrEnum

import networkx as nx

from rollplex.graph.ir import TensorClass
from rollplex.graph.spec import Spec
from rollplex.graph.workload import PerGpu
from rollplex.layout.sharing import SharingReport
from rollplex.models.config import ModelConfig

GIB = 2**30


class Residency(Enum):
    HBM = "hbm"
    HOST = "host"  # pinned host pool: paged-out frozen weights, FP32 state, offloaded saved tensors
    DROPPED = "dropped"  # regenerable, rebuilt when needed
    ABSENT = "-"  # not produced yet or released


class Component(StrEnum):
    """What an object is (its value is how the plan prints it)."""

    RESERVE = "runtime reserve"
    WEIGHTS = "weights (BF16)"
    GRADIENTS = "FP32 gradients"
    MASTER = "FP32 master weights"
    MOMENTS = "Adam moments (FP32)"
    ACTIVATIONS = "activations (one microbatch)"
    LAYERS_KEPT = "activations kept whole"  # `memory.layers_kept`: the last decoder layers that rerun nothing
    SUFFIX_ATTENTION = "suffix attention KV"
    PREFIX_SAVED = "prefix saved tensors"
    PREFIX_LAYER = "prefix, one layer in flight"
    BOUNDARY_KV = "boundary KV"
    BOUNDARY_LOGPROBS = "boundary log-probs"
    BOUNDARY_GRADIENT = "boundary KV gradient"
    KV_CACHE = "KV cache"
    CASE3_BUFFER = "Case-3 buffer"
    OPTIMIZER_CHUNKS = "streamed chunks"
    VISION_OUTPUT = "shared vision output"  # `model.freeze_vision`: each prompt's, read by every prefix of the step
    DATA = "data"  # a tensor the graph passes between nodes (`MemObject.name` says which)


PROMPT_INPUTS = "prompt inputs, copied first"  # `prompt_inputs_first`
SUFFIX_TURN = "suffix"  # a split backward's turns (`MemObject.turn`): a suffix microbatch's activations,
PREFIX_TURN = "prefix"  # then the backward through the prefix, one layer at a time


@dataclass(frozen=True, slots=True)
class MemObject:
    role: str
    component: Component
    cls: TensorClass
    bytes: int
    live: frozenset[int]  # steps in which the bytes are in HBM
    outside: Residency  # where they are in the other steps
    vision: bool = False
    host_bytes: int = 0  # bytes it occupies in the pinned host pool (per GPU)
    window: frozenset[int] = frozenset()  # steps it exists in, when that is not every step
    name: str = ""  # the tensor's name, for `Component.DATA`
    turn: str = ""  # the part of its role's step it is held in, where parts take turns (`held`); "" for all of it

    @property
    def label(self) -> str:
        return self.name or self.component.value

    @property
    def movable(self) -> bool:
        """Waits in the host pool between uses, and could stay in HBM over its whole window instead."""
        host = self.outside is Residency.HOST and self.cls is not TensorClass.PERMANENT
        return host and bool(self.window) and self.live != self.window

    def residency(self, step: int) -> Residency:
        if step in self.live:
            return Residency.HBM
        return Residency.ABSENT if self.window and step not in self.window else self.outside


def held(objects: Iterable[MemObject], step: int) -> list[MemObject]:
    """The objects in HBM at `step`'s peak. Every object live in the step, except where a role's objects take
    turns (`MemObject.turn`: its split backward frees a suffix microbatch's activations before the backward
    through the prefix rematerializes its first layer): of those, only the role's largest turn."""
    live = [o for o in objects if step in o.live]
    turns: dict[tuple[str, str], int] = {}
    for o in live:
        if o.turn:
            turns[o.role, o.turn] = turns.get((o.role, o.turn), 0) + o.bytes
    largest: dict[str, tuple[int, str]] = {}
    for (role, turn), size in turns.items():
        largest[role] = max(largest.get(role, (size, turn)), (size, turn))
    return [o for o in live if not o.turn or largest[o.role][1] == o.turn]


def held_bytes(objects: Iterable[MemObject], step: int) -> int:
    """HBM in use at `step`'s peak (`held`)."""
    return sum(o.bytes for o in held(objects, step))


@dataclass(frozen=True, slots=True)
class Context:
    g: nx.DiGraph
    spec: Spec
    model: ModelConfig
    gpu: PerGpu
    sharing: SharingReport
