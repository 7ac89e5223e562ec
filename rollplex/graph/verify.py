"""The verifier: internal invariants of the IR, checked between passes in tests (`run_passes(verify=True)`).

A failure is a compiler bug, not a user error, so it raises `VerifyError` naming the pass that broke it.
"""

from __future__ import annotations

import networkx as nx

from rollplex.graph.ir import DATASET, Op, Phase, TensorClass, lifetimes, op, ops, steps, tensors


class VerifyError(AssertionError):
    pass


def verify(g: nx.DiGraph) -> None:
    """Checks every invariant that holds at the current stage (later stages add more fields)."""
    _check(nx.is_directed_acyclic_graph(g), "the graph has a cycle")
    _check_producers(g)
    all_ops = list(ops(g))
    if all(o.phase is not None for o in all_ops):
        _check_phases(g)
    if all(o.executor is not None for o in all_ops) is False and any(o.executor for o in all_ops):
        _check(False, "some ops have an executor and others none")
    if steps(g):
        _check_steps(g)
        _check_lifetimes(g)
        _check_fused(g)


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise VerifyError(what)


def _check_producers(g: nx.DiGraph) -> None:
    made: dict[str, str] = {}
    for o in ops(g):
        for t in o.outputs:
            _check(t not in made, f"tensor '{t}' has two producers: '{made.get(t)}' and '{o.id}'")
            made[t] = o.id
    for o in ops(g):
        for t in o.inputs:
            _check(t in made or t == DATASET, f"'{o.id}' reads '{t}', which nothing produces")
            _check(t in tensors(g), f"'{t}' has no TensorInfo")


def _check_phases(g: nx.DiGraph) -> None:
    info = tensors(g)
    for o in ops(g):
        if o.phase is Phase.ROLLOUT:
            bad = [t for t in o.inputs if info[t].response_dependent]
            _check(not bad, f"Phase-1 op '{o.id}' reads response-dependent {bad}")
        for p in g.predecessors(o.id):
            _check(g.nodes[p]["op"].phase <= o.phase, f"'{o.id}' runs before its producer '{p}'")
    made_in = {t: o.phase for o in ops(g) for t in o.outputs}
    for name, t in info.items():
        if t.cls is TensorClass.BOUNDARY and made_in.get(name) is Phase.ROLLOUT:  # a mini-batch's rerun comes later
            _check(not t.response_dependent, f"Phase-1 boundary '{name}' depends on a response")


def _check_steps(g: nx.DiGraph) -> None:
    seen = {n for s in steps(g) for n in s.ops}
    _check(seen == set(g.nodes), f"ops without a step: {sorted(set(g.nodes) - seen)}")
    phases = [s.phase for s in steps(g)]
    _check(phases == sorted(phases), "steps are not in phase order")
    for s in steps(g):
        _check(all(g.nodes[n]["op"].phase is s.phase for n in s.ops), f"step {s.index} mixes phases")


def _check_fused(g: nx.DiGraph) -> None:
    """A fused scoring op's outputs exist once its backward ran: no other op reads them before it."""
    step_of = {n: s.index for s in steps(g) for n in s.ops}
    for o in ops(g):
        if o.fused_into is None:
            continue
        _check(
            o.id in g.nodes[o.fused_into]["op"].fuses, f"'{o.id}' fused into '{o.fused_into}', which does not fuse it"
        )
        for reader in (r for r in ops(g) if set(r.inputs) & set(o.outputs) and r.id != o.fused_into):
            _check(step_of[reader.id] > step_of[o.fused_into], f"'{reader.id}' reads '{o.id}' before its backward")


def _runs_in(g: nx.DiGraph, o: Op) -> Phase:
    """The phase an op's work runs in: its backward's, for a scoring op fused into one."""
    return o.phase if o.fused_into is None else op(g, o.fused_into).phase


def _check_lifetimes(g: nx.DiGraph) -> None:
    """Every lifetime lies inside its window: from the producer's phase to the last consumer's phase."""
    by_index = {s.index: s for s in steps(g)}
    for name, life in lifetimes(g).items():
        _check(life.first <= life.last, f"'{name}' is used before it is produced")
        consumers = [_runs_in(g, o) for o in ops(g) if name in o.inputs]
        producer = [_runs_in(g, o) for o in ops(g) if name in o.outputs]
        if producer:
            _check(
                by_index[life.first].phase is producer[0],
                f"'{name}' lifetime starts outside its producer's phase",
            )
        if consumers:
            _check(by_index[life.last].phase is max(consumers), f"'{name}' lifetime ends outside its last phase")
