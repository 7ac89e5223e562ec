"""`build`: a spec's graph section (or the standard GRPO or PPO graph) -> the IR, checked for the user's mistakes.

The standard graphs are the textbook, unsplit iterations; `split_at_response` does the splitting.
"""

from __future__ import annotations

import networkx as nx

from rollplex.errors import SpecError
from rollplex.graph.ir import DATASET, NodeKind, Op, Role, TensorClass, TensorInfo, make_graph
from rollplex.graph.spec import GraphSpec, NodeSpec, Spec, TensorSpec


def standard_grpo(kl_coef: float) -> GraphSpec:
    """rollout -> reward, reference scoring, actor scoring -> loss + backward -> update.

    With kl_coef == 0 the reference model is not in the graph at all.
    """
    with_ref = kl_coef > 0
    nodes = [
        NodeSpec(id="rollout", kind="decode", role="rollout", inputs=(DATASET,), outputs=("responses",)),
        NodeSpec(id="reward", kind="reward", inputs=(DATASET, "responses"), outputs=("rewards",)),
        NodeSpec(
            id="actor_score",
            kind="forward",
            role="actor",
            inputs=(DATASET, "responses"),
            outputs=("logprobs",),
        ),
        NodeSpec(
            id="actor_backward",
            kind="backward",
            role="actor",
            inputs=("logprobs", "rewards", *(("ref_logprobs",) if with_ref else ())),
            outputs=("actor_grads",),
        ),
        NodeSpec(id="actor_update", kind="update", role="actor", inputs=("actor_grads",)),
    ]
    if with_ref:
        ref = NodeSpec(
            id="ref_score",
            kind="forward",
            role="reference",
            inputs=(DATASET, "responses"),
            outputs=("ref_logprobs",),
        )
        nodes.insert(2, ref)
    return GraphSpec(nodes=tuple(nodes), tensors=())


def standard_ppo(kl_coef: float) -> GraphSpec:
    """GRPO's graph with a critic: its scoring gives the values the actor's advantages come from, and its own
    backward and update train it."""
    nodes = list(standard_grpo(kl_coef).nodes)
    critic = [
        NodeSpec(id="critic_score", kind="forward", role="critic", inputs=(DATASET, "responses"), outputs=("values",)),
        NodeSpec(
            id="critic_backward",
            kind="backward",
            role="critic",
            inputs=("values", "rewards"),
            outputs=("critic_grads",),
        ),
        NodeSpec(id="critic_update", kind="update", role="critic", inputs=("critic_grads",)),
    ]
    actor_backward = next(i for i, n in enumerate(nodes) if n.id == "actor_backward")
    backward = nodes[actor_backward]
    nodes[actor_backward] = backward.model_copy(update={"inputs": (*backward.inputs, "values")})
    return GraphSpec(nodes=(*nodes, *critic), tensors=())


def graph_spec_of(spec: Spec) -> GraphSpec:
    if spec.graph is not None:
        return spec.graph
    if spec.algorithm.name == "ppo":
        return standard_ppo(spec.algorithm.kl_coef)
    return standard_grpo(spec.algorithm.kl_coef)


def build(graph: GraphSpec) -> nx.DiGraph:
    """Requires: a GraphSpec (pydantic-validated fields).
    Ensures: unique ids; one producer per tensor; every input produced or the dataset's `prompts`;
    no update output read in the same iteration; a DAG; declared classes on tensors (default phase-local).
    """
    _check_ids(graph.nodes)
    producers = _producers(graph.nodes)
    _check_inputs(graph.nodes, producers)
    _check_update_outputs(graph.nodes)
    ops = [_op(i, n) for i, n in enumerate(graph.nodes)]
    g = make_graph(ops, _tensor_infos(graph.nodes, graph.tensors))
    _check_acyclic(g)
    return g


def _op(i: int, n: NodeSpec) -> Op:
    role = Role(n.role) if n.role else None
    return Op(id=n.id, kind=NodeKind(n.kind), role=role, inputs=n.inputs, outputs=n.outputs, source=n.id, index=i)


def _check_ids(nodes: tuple[NodeSpec, ...]) -> None:
    seen: set[str] = set()
    for i, n in enumerate(nodes):
        if n.id in seen:
            raise SpecError(f"graph.nodes.{i}.id", f"duplicate node id '{n.id}'", "give every node its own id")
        seen.add(n.id)


def _producers(nodes: tuple[NodeSpec, ...]) -> dict[str, str]:
    producers: dict[str, str] = {}
    for i, n in enumerate(nodes):
        for t in n.outputs:
            if t == DATASET:
                raise SpecError(f"graph.nodes.{i}.outputs", f"'{DATASET}' comes from the dataset", "rename the output")
            if t in producers:
                raise SpecError(
                    f"graph.nodes.{i}.outputs",
                    f"tensor '{t}' is produced by both '{producers[t]}' and '{n.id}'",
                    "give each output its own name",
                )
            producers[t] = n.id
    return producers


def _check_inputs(nodes: tuple[NodeSpec, ...], producers: dict[str, str]) -> None:
    for i, n in enumerate(nodes):
        for t in n.inputs:
            if t != DATASET and t not in producers:
                raise SpecError(
                    f"graph.nodes.{i}.inputs",
                    f"node '{n.id}' reads '{t}', which no node produces",
                    f"add a node that outputs '{t}', or read '{DATASET}' (the dataset)",
                )


def _check_update_outputs(nodes: tuple[NodeSpec, ...]) -> None:
    updated = {t: n.id for n in nodes if n.kind == "update" for t in n.outputs}
    for i, n in enumerate(nodes):
        for t in n.inputs:
            if t in updated:
                raise SpecError(
                    f"graph.nodes.{i}.inputs",
                    f"node '{n.id}' reads '{t}', written by update '{updated[t]}' for the next iteration",
                    "read the update's inputs instead",
                )


def _check_acyclic(g: nx.DiGraph) -> None:
    try:
        cycle = nx.find_cycle(g)
    except nx.NetworkXNoCycle:
        return
    path = " -> ".join([u for u, _ in cycle] + [cycle[0][0]])
    raise SpecError("graph.nodes", f"the graph has a cycle: {path}", "break it: an iteration must be a DAG")


def _tensor_infos(nodes: tuple[NodeSpec, ...], declared: tuple[TensorSpec, ...]) -> dict[str, TensorInfo]:
    names = {DATASET} | {t for n in nodes for t in (*n.inputs, *n.outputs)}
    classes = {d.name: TensorClass(d.cls) for d in declared}
    for i, d in enumerate(declared):
        if d.name not in names:
            raise SpecError(f"graph.tensors.{i}.name", f"tensor '{d.name}' is not used by any node", "remove it")
    return {t: TensorInfo(t, classes.get(t, TensorClass.PHASE_LOCAL)) for t in sorted(names)}
