"""Compiler passes, each a pure function Graph -> Graph. `pipeline.run_passes` owns their order.

build -> split_at_response -> split_minibatches -> [prefill_from_actor] -> fuse_scoring -> assign_phases
-> assign_executors -> order_steps -> (memory) lower_residency
"""

from __future__ import annotations

from dataclasses import replace

import networkx as nx

from rollplex.errors import SpecError
from rollplex.graph.ir import (
    DATASET,
    Executor,
    Lifetime,
    MiniBatch,
    NodeKind,
    Op,
    Part,
    Phase,
    Role,
    Schedule,
    Step,
    TensorClass,
    TensorInfo,
    make_graph,
    ops,
    steps,
    tensors,
)


def response_dependent(g: nx.DiGraph) -> set[str]:
    """Tensors whose value depends on a sampled response: decode outputs and everything computed from them."""
    dep: set[str] = set()
    for o in ops(g):
        if o.kind is NodeKind.DECODE or any(t in dep for t in o.inputs):
            dep.update(o.outputs)
    return dep


def split_at_response(g: nx.DiGraph) -> nx.DiGraph:
    """Requires: a built graph (DAG, every input produced).
    Ensures: every forward that read both prompt-side and response-dependent tensors is replaced by
    `<id>.prefix` (prompt-side inputs -> `<id>.boundary`) and `<id>.suffix` (boundary + responses -> outputs);
    a backward of the same role that reads the suffix's outputs also reads the boundary (it stays attached);
    tensors are marked response-dependent.
    """
    dep = response_dependent(g)
    boundaries: dict[str, tuple[Role | None, str]] = {}  # suffix output -> (role, boundary tensor)
    new_ops: list[Op] = []
    for o in ops(g):
        prompt_side = tuple(t for t in o.inputs if t not in dep)
        response_side = tuple(t for t in o.inputs if t in dep)
        if o.kind is NodeKind.FORWARD and prompt_side and response_side:
            b = f"{o.id}.boundary"
            new_ops.append(replace(o, id=f"{o.id}.prefix", inputs=prompt_side, outputs=(b,), part=Part.PREFIX))
            new_ops.append(replace(o, id=f"{o.id}.suffix", inputs=(b, *response_side), part=Part.SUFFIX))
            boundaries.update({t: (o.role, b) for t in o.outputs})
        else:
            new_ops.append(o)
    new_ops = [_attach(o, boundaries) for o in new_ops]
    infos = {n: replace(i, response_dependent=n in dep) for n, i in tensors(g).items()}
    infos.update({b: TensorInfo(b, TensorClass.BOUNDARY) for _, b in boundaries.values()})
    return make_graph(new_ops, infos)


def _attach(o: Op, boundaries: dict[str, tuple[Role | None, str]]) -> Op:
    if o.kind is not NodeKind.BACKWARD:
        return o
    extra = tuple(dict.fromkeys(b for t in o.inputs if t in boundaries for r, b in [boundaries[t]] if r == o.role))
    return replace(o, inputs=(*o.inputs, *extra)) if extra else o


def split_minibatches(g: nx.DiGraph, num_minibatches: int) -> nx.DiGraph:
    """Requires: split_at_response (or, for the unsplit oracle, a built graph); `num_minibatches` divides the
    step's prompts. Ensures, with more than one mini-batch: each trained role's scoring forward, backward and
    update repeated per mini-batch k (ops `<id>@k`, k from 1, with `Op.minibatch`); mini-batch k > 1 first reruns
    the role's prefix on its prompts (split graphs) with the weights update k-1 wrote (`<role>.weights@k`, the
    tensor that orders them); the scoring forward of mini-batch 1 also writes `<role>.old_logprobs`, every
    response's log-prob under the rollout's weights, which the later backwards read (their ratio's
    denominator). With one mini-batch the graph is returned as it is.
    """
    if num_minibatches == 1:
        return g
    infos = dict(tensors(g))
    chains = [_chain(g, u) for u in ops(g) if u.kind is NodeKind.UPDATE]
    repeated = {o.id for chain in chains for o in (*chain[1], chain[2], chain[3])}
    new_ops = [o for o in ops(g) if o.id not in repeated]
    for prefixes, scores, backward, update in chains:
        role = update.role.value if update.role else update.id
        old = f"{role}.old_logprobs"
        infos[old] = TensorInfo(old, TensorClass.PHASE_LOCAL, response_dependent=True)
        for k in range(1, num_minibatches + 1):
            mb, weights = MiniBatch(k - 1, num_minibatches), f"{role}.weights@{k}"
            names = {t: f"{t}@{k}" for o in (*scores, backward, update) for t in o.outputs}
            if k > 1:
                names |= {t: f"{t}@{k}" for p in prefixes for t in p.outputs}
                new_ops += [_repeat(p, k, names, mb, extra_in=(weights,)) for p in prefixes]
            first = (weights,) if k > 1 and not prefixes else ()
            new_ops += [_repeat(f, k, names, mb, extra_in=first, extra_out=(old,) if k == 1 else ()) for f in scores]
            new_ops.append(_repeat(backward, k, names, mb, extra_in=(old,) if k > 1 else ()))
            last = k == num_minibatches
            new_ops.append(_repeat(update, k, names, mb, outputs=None if last else (f"{role}.weights@{k + 1}",)))
            for t, name in names.items():
                infos[name] = replace(infos[t], name=name)
            if not last:
                infos[f"{role}.weights@{k + 1}"] = TensorInfo(f"{role}.weights@{k + 1}", TensorClass.REGENERABLE)
    used = {DATASET} | {t for o in new_ops for t in (*o.inputs, *o.outputs)}
    return make_graph(new_ops, {n: i for n, i in infos.items() if n in used})


def prefill_from_actor(g: nx.DiGraph) -> nx.DiGraph:
    """Requires: split_at_response, one mini-batch (`run.rollout_prefill: actor_prefix`).
    Ensures: every decode also reads the actor prefix's boundary (its prompt KV and first-token log-probs, the
    rollout's prefill on the same weights), so that prefix runs before decode. A graph without one actor prefix
    (the unsplit oracle) is returned as it is.
    """
    prefixes = [o for o in ops(g) if o.role is Role.ACTOR and o.part is Part.PREFIX]
    if len(prefixes) != 1:
        return g
    boundary = prefixes[0].outputs[0]
    new_ops = [replace(o, inputs=(*o.inputs, boundary)) if o.kind is NodeKind.DECODE else o for o in ops(g)]
    return make_graph(new_ops, dict(tensors(g)))


def _chain(g: nx.DiGraph, update: Op) -> tuple[list[Op], list[Op], Op, Op]:
    """The trained role's prefixes, scoring forwards, backward and `update`, as `split_minibatches` repeats them."""
    backward = next(p for p in (g.nodes[n]["op"] for n in g.predecessors(update.id)) if p.kind is NodeKind.BACKWARD)
    scores = [
        p
        for p in (g.nodes[n]["op"] for n in g.predecessors(backward.id))
        if p.kind is NodeKind.FORWARD and p.role is update.role and p.part is not Part.PREFIX
    ]
    prefixes = [
        p
        for f in scores
        for p in (g.nodes[n]["op"] for n in g.predecessors(f.id))
        if p.kind is NodeKind.FORWARD and p.role is update.role and p.part is Part.PREFIX
    ]
    return prefixes, scores, backward, update


def _repeat(
    o: Op,
    k: int,
    names: dict[str, str],
    mb: MiniBatch,
    *,
    extra_in: tuple[str, ...] = (),
    extra_out: tuple[str, ...] = (),
    outputs: tuple[str, ...] | None = None,
) -> Op:
    """Op `o` of mini-batch k: renamed tensors, and any extra inputs and outputs."""
    inputs = tuple(names.get(t, t) for t in o.inputs) + extra_in
    outputs = tuple(names.get(t, t) for t in o.outputs) if outputs is None else outputs
    return replace(o, id=f"{o.id}@{k}", inputs=inputs, outputs=outputs + extra_out, minibatch=mb)


def fuse_scoring(g: nx.DiGraph) -> nx.DiGraph:
    """Requires: a built graph (split or not, mini-batches or not).
    Ensures: each backward of a trained role `fuses` the role's scoring forwards whose scores it reads (suffix, or
    whole when unsplit; not a first mini-batch's scoring whose old log-probs a later one reads), and each of
    those is `fused_into` it: the backward runs their work batch by batch with its loss and backward, so no
    batch's activations wait for another's, and writes their outputs; an edge without tensors orders every other
    reader of them after the backward (PPO's actor reads the critic's values). A scoring op read by an op the
    backward depends on stays unfused (the runtime then has no way to run it and says so).
    """
    out = g.copy()
    for b in ops(g):
        if b.kind is not NodeKind.BACKWARD:
            continue
        before = nx.ancestors(out, b.id)
        scoring = sorted(
            p for p in g.predecessors(b.id)
            if (o := g.nodes[p]["op"]).kind is NodeKind.FORWARD and o.role is b.role and o.part is not Part.PREFIX
            and o.outputs[0] in b.inputs and not any(r in before for r in g.successors(p))
        )  # fmt: skip
        for name in scoring:
            out.nodes[name]["op"] = replace(g.nodes[name]["op"], fused_into=b.id)
            for reader in g.successors(name):
                if reader != b.id and not out.has_edge(b.id, reader):
                    out.add_edge(b.id, reader, tensors=())
        out.nodes[b.id]["op"] = replace(b, fuses=tuple(scoring))
    return out


def assign_phases(g: nx.DiGraph) -> nx.DiGraph:
    """Requires: split_at_response (or, for the unsplit oracle, a built graph).
    Ensures: decode and prompt-side forwards in Phase 1, the last updates in Phase 3 (a mini-batch's update,
    whose weights the next one reads, in Phase 2), the rest in Phase 2; no op runs in an earlier phase than a
    producer of its inputs; no Phase-1 op reads a response.
    """
    dep = response_dependent(g)
    info = {n: replace(i, response_dependent=n in dep) for n, i in tensors(g).items()}
    phase_of: dict[str, Phase] = {}
    out = g.copy()
    out.graph["tensors"] = info
    for o in ops(g):
        reads_response = any(info[t].response_dependent for t in o.inputs)
        base = Phase.TRAIN if o.kind is NodeKind.UPDATE and any(g.successors(o.id)) else _base_phase(o, reads_response)
        after = max((phase_of[p] for p in g.predecessors(o.id)), default=Phase.ROLLOUT)
        if o.kind is NodeKind.DECODE and (reads_response or after > Phase.ROLLOUT):
            late = [t for t in o.inputs if info[t].response_dependent] or [t for t in o.inputs if t != DATASET]
            raise SpecError(
                f"graph.nodes.{o.index}.inputs",
                f"decode node '{o.id}' runs in Phase 1 but would read '{late[0]}', which is only ready "
                "after a response is sampled",
                "a decode may only read prompt-side tensors",
            )
        phase_of[o.id] = max(base, after)
        out.nodes[o.id]["op"] = replace(o, phase=phase_of[o.id])
    return out


def _base_phase(o: Op, reads_response: bool) -> Phase:
    if o.kind is NodeKind.UPDATE:
        return Phase.UPDATE
    if o.kind in (NodeKind.DECODE, NodeKind.FORWARD) and not reads_response:
        return Phase.ROLLOUT
    return Phase.TRAIN


def assign_executors(g: nx.DiGraph) -> nx.DiGraph:
    """Requires: assign_phases. Ensures: every op has an executor."""
    out = g.copy()
    for o in ops(g):
        out.nodes[o.id]["op"] = replace(o, executor=_executor(o))
    return out


def _executor(o: Op) -> Executor:
    if o.kind is NodeKind.UPDATE:
        return Executor.OPTIMIZER
    if o.kind is NodeKind.REWARD:
        return Executor.HOST
    if o.role is Role.ROLLOUT:
        return Executor.ROLLOUT
    if o.role is Role.REFERENCE:
        return Executor.SCORER
    return Executor.TRAINER


_ROLE_RANK = {Role.ROLLOUT: "0", Role.REFERENCE: "1", None: "2", Role.CRITIC: "3", Role.ACTOR: "4"}
_KIND_RANK = {NodeKind.DECODE: "0", NodeKind.FORWARD: "1", NodeKind.REWARD: "2", NodeKind.BACKWARD: "3"}


def _order_key(g: nx.DiGraph):
    """Within a phase: the reference first (its weights leave HBM early), then rewards, critic, actor."""

    def key(n: str) -> str:
        o = g.nodes[n]["op"]
        return f"{int(o.phase)}{_ROLE_RANK[o.role]}{_KIND_RANK.get(o.kind, '4')}{n}"

    return key


def order_steps(g: nx.DiGraph, schedule: Schedule) -> nx.DiGraph:
    """Requires: assign_executors. Ensures: `steps` (ordered) and `lifetimes` of every tensor.

    A Phase-1 op a decode reads (the actor prefix under `prefill_from_actor`) runs alone before it; of the
    rest, rollplex: each Phase-1 op other than decode shares a step with the decodes (they overlap); serial:
    decodes first, then each Phase-1 op alone. Phases 2 and 3: one op per step.
    """
    order = [g.nodes[n]["op"] for n in nx.lexicographical_topological_sort(g, key=_order_key(g))]
    groups: list[tuple[Phase, tuple[str, ...]]] = []
    for phase in Phase:
        in_phase = [o for o in order if o.phase is phase]
        decodes = tuple(o.id for o in in_phase if o.kind is NodeKind.DECODE)
        before = {a for d in decodes for a in nx.ancestors(g, d)}
        groups += [(phase, (o.id,)) for o in in_phase if o.id in before]
        others = [(o.id,) for o in in_phase if o.kind is not NodeKind.DECODE and o.id not in before]
        if schedule is Schedule.ROLLPLEX and decodes and others:
            groups += [(phase, decodes + x) for x in others]
        else:
            groups += [(phase, x) for x in ([decodes] if decodes else []) + others]
    out = g.copy()
    out.graph["steps"] = tuple(Step(i, p, x) for i, (p, x) in enumerate(groups))
    out.graph["lifetimes"] = _lifetimes(out)
    return out


def _lifetimes(g: nx.DiGraph) -> dict[str, Lifetime]:
    """Each tensor's steps, from its producer's to its last reader's. A scoring op fused into a backward runs in
    the backward's step: its reads and writes count there (the runtime frees a tensor after its last step)."""
    at = {n: s.index for s in steps(g) for n in s.ops}
    for o in ops(g):
        if o.fused_into is not None:
            at[o.id] = at[o.fused_into]
    result = {}
    for name in tensors(g):
        prod = [at[o.id] for o in ops(g) if name in o.outputs]
        cons = [at[o.id] for o in ops(g) if name in o.inputs]
        first = prod[0] if prod else 0
        result[name] = Lifetime(first, max(cons, default=first))
    return result
