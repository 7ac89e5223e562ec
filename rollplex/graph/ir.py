"""The compiler's intermediate representation: a networkx DAG whose nodes carry one frozen `Op` each.

Glossary (used the same everywhere):
  phase      a time window of the iteration (1: rollout + prefixes, 2: suffixes + backward, 3: update)
  executor   who runs a node (rollout engine, reference scorer, trainer, optimizer, host)
  step       one slot of the compiled order; the ops in a step run at the same time
  lifetime   first to last step a tensor is used
  residency  where an object's bytes live in a step (HBM, host, dropped, ...)
  boundary   state at the first response position (prefix KV + last-position log-probs)
  prefix / suffix   the parts of a model call before / from the first response position

Graph payloads: `g.nodes[id]["op"]` is an `Op`; `g.graph["tensors"]` maps names to `TensorInfo`;
edges (producer -> consumer) carry `g.edges[u, v]["tensors"]`. Read them through the accessors below.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import Enum, IntEnum

import networkx as nx

DATASET = "prompts"  # the one tensor no node produces: the step's prompts from the dataset


class NodeKind(Enum):
    DECODE = "decode"
    FORWARD = "forward"
    BACKWARD = "backward"
    UPDATE = "update"
    REWARD = "reward"


class Role(Enum):
    ROLLOUT = "rollout"
    REFERENCE = "reference"
    ACTOR = "actor"
    CRITIC = "critic"


class TensorClass(Enum):
    PERMANENT = "permanent"
    REGENERABLE = "regenerable"
    BOUNDARY = "boundary"
    PHASE_LOCAL = "phase-local"


class Part(Enum):
    WHOLE = "whole"
    PREFIX = "prefix"
    SUFFIX = "suffix"


class Phase(IntEnum):
    ROLLOUT = 1  # rollout decode, with the response-independent prefixes beside it
    TRAIN = 2  # suffixes, rewards, loss and backward
    UPDATE = 3  # optimizer and publication of the next snapshot

    @property
    def title(self) -> str:
        return {1: "Phase 1: rollout + prefixes", 2: "Phase 2: suffixes + backward", 3: "Phase 3: update"}[self]


class Schedule(Enum):
    UNSPLIT = "unsplit"  # textbook: every response scored over its full sequence (the oracle; `run` only)
    SERIAL = "serial"  # split + prefix sharing, phases one after another
    ROLLPLEX = "rollplex"  # split + prefix sharing + the prefixes beside decode in Phase 1


class Executor(Enum):
    ROLLOUT = "rollout engine"
    SCORER = "reference scorer"
    TRAINER = "trainer"
    OPTIMIZER = "optimizer"
    HOST = "host"


@dataclass(frozen=True, slots=True)
class MiniBatch:
    """The share of the step's prompt groups an op trains on: the `index`-th (from 0) of `count` equal shares."""

    index: int
    count: int

    def prompts(self, num_prompts: int) -> slice:
        size = num_prompts // self.count
        return slice(self.index * size, (self.index + 1) * size)


@dataclass(frozen=True, slots=True)
class Op:
    id: str
    kind: NodeKind
    role: Role | None
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    part: Part = Part.WHOLE
    source: str = ""  # the user's node id this op came from (split parts share it)
    index: int | None = None  # position of that node in the spec's `graph.nodes`, for error messages
    phase: Phase | None = None
    executor: Executor | None = None
    minibatch: MiniBatch | None = None  # set on the ops `split_minibatches` repeats; None: the whole step
    fused_into: str | None = None  # a scoring forward whose work its role's backward runs (`fuse_scoring`)
    fuses: tuple[str, ...] = ()  # on that backward: the scoring forwards it runs, in length batches with its loss


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    cls: TensorClass
    response_dependent: bool = False


@dataclass(frozen=True, slots=True)
class Step:
    """Ops that run together; in `rollplex`, decode shares every Phase-1 step with one prefix op."""

    index: int
    phase: Phase
    ops: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Lifetime:
    first: int  # step index of the producer (0 for the dataset's prompts)
    last: int  # step index of the last consumer


def make_graph(ops: list[Op], tensors: dict[str, TensorInfo]) -> nx.DiGraph:
    """Builds the DAG: one node per op, one edge per (producer, consumer) pair, tensors on the edge."""
    g = nx.DiGraph(tensors=dict(tensors))
    for o in ops:
        g.add_node(o.id, op=o)
    producers = {t: o.id for o in ops for t in o.outputs}
    for o in ops:
        for t in o.inputs:
            if t in producers:
                src = producers[t]
                if g.has_edge(src, o.id):
                    g.edges[src, o.id]["tensors"] += (t,)
                else:
                    g.add_edge(src, o.id, tensors=(t,))
    return g


def op(g: nx.DiGraph, node: str) -> Op:
    return g.nodes[node]["op"]


def ops(g: nx.DiGraph) -> Iterator[Op]:
    """Ops in a deterministic topological order (ties broken by id)."""
    for n in nx.lexicographical_topological_sort(g):
        yield g.nodes[n]["op"]


def tensors(g: nx.DiGraph) -> dict[str, TensorInfo]:
    return g.graph["tensors"]


def producer(g: nx.DiGraph, tensor: str) -> Op | None:
    return next((o for o in ops(g) if tensor in o.outputs), None)


def steps(g: nx.DiGraph) -> tuple[Step, ...]:
    return g.graph.get("steps", ())


def steps_of(g: nx.DiGraph, role: Role) -> set[int]:
    """Indices of the steps that hold one of the role's ops (a paged role's window of resident steps)."""
    return {s.index for s in steps(g) if any(op(g, name).role is role for name in s.ops)}


def prefilled_decodes(ops_: Iterable[Op]) -> set[str]:
    """The decode ops that read a prefix's boundary (`prefill_from_actor`): their rollout prefills nothing."""
    ops_ = list(ops_)
    boundaries = {t for o in ops_ if o.part is Part.PREFIX for t in o.outputs}
    return {o.id for o in ops_ if o.kind is NodeKind.DECODE and any(t in boundaries for t in o.inputs)}


def backpropagated_prompts(ops_: Iterable[Op], prefix: Op) -> MiniBatch | None:
    """The prompts a prefix op keeps its graph for: a mini-batch's rerun, its own; the step's prefix of a role
    trained in mini-batches, mini-batch 1's (the first scores every response, but only its own backpropagate,
    and the later ones rerun their prefixes); else all of them (None)."""
    if prefix.minibatch is not None:
        return prefix.minibatch
    count = max((o.minibatch.count for o in ops_ if o.minibatch is not None and o.role is prefix.role), default=1)
    return MiniBatch(0, count) if count > 1 else None


def beside_decode(g: nx.DiGraph, decode: str) -> list[str]:
    """The ops that share a step with decode (the Phase-1 prefixes of `rollplex`): they run beside it."""
    return [name for s in steps(g) if decode in s.ops for name in s.ops if name != decode]


def lifetimes(g: nx.DiGraph) -> dict[str, Lifetime]:
    return g.graph.get("lifetimes", {})


def roles(g: nx.DiGraph) -> set[Role]:
    return {o.role for o in ops(g) if o.role is not None}
