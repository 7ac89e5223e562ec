"""The passes split, phase, place and order any valid iteration graph, with the verifier after every pass."""

import random

import networkx as nx
import pytest

from rollplex.graph.build import build, standard_grpo
from rollplex.graph.ir import (
    Executor,
    NodeKind,
    Part,
    Phase,
    Role,
    Schedule,
    TensorClass,
    lifetimes,
    op,
    ops,
    steps,
    tensors,
)
from rollplex.graph.passes import assign_phases, split_at_response
from rollplex.graph.pipeline import graph_passes, run_passes
from rollplex.graph.spec import GraphSpec, NodeSpec
from rollplex.graph.verify import VerifyError, verify


def compiled(graph: GraphSpec, schedule=Schedule.ROLLPLEX) -> nx.DiGraph:
    g = build(graph)
    verify(g)
    return run_passes(g, graph_passes(schedule), check=True)


def test_standard_grpo_splits_both_scorers_at_the_first_response():
    g = compiled(standard_grpo(kl_coef=0.04))
    names = {o.id for o in ops(g)}
    assert {"ref_score.prefix", "ref_score.suffix", "actor_score.prefix", "actor_score.suffix"} <= names
    for o in ops(g):
        if o.part is Part.PREFIX:
            assert o.inputs == ("prompts",) and o.phase is Phase.ROLLOUT
            assert tensors(g)[o.outputs[0]].cls is TensorClass.BOUNDARY
        if o.part is Part.SUFFIX:
            assert o.inputs[0].endswith(".boundary") and "responses" in o.inputs and o.phase is Phase.TRAIN


def test_the_actor_boundary_stays_attached_to_backward_and_the_reference_one_does_not():
    g = compiled(standard_grpo(kl_coef=0.04))
    backward = op(g, "actor_backward")
    assert "actor_score.boundary" in backward.inputs
    assert "ref_score.boundary" not in backward.inputs
    life = lifetimes(g)
    assert life["actor_score.boundary"].last == life["actor_grads"].first  # until backward
    assert life["ref_score.boundary"].last < life["actor_score.boundary"].last


def test_what_a_fused_scoring_op_reads_lives_until_its_backward_runs_it():
    for schedule in Schedule.ROLLPLEX, Schedule.SERIAL:
        g = compiled(standard_grpo(kl_coef=0.04), schedule)
        at = {n: s.index for s in steps(g) for n in s.ops}
        suffix = op(g, "actor_score.suffix")
        assert suffix.fused_into == "actor_backward" and at["actor_score.suffix"] < at["actor_backward"]
        life = lifetimes(g)
        assert all(life[t].last >= at["actor_backward"] for t in suffix.inputs), schedule
        assert life["ref_score.boundary"].last == at["ref_score.suffix"] < at["actor_backward"]


def test_kl_coefficient_zero_drops_the_reference_model():
    g = compiled(standard_grpo(kl_coef=0.0))
    assert all(o.role is not Role.REFERENCE for o in ops(g))


def test_rollplex_runs_each_prefix_beside_decode_and_serial_after_it():
    for schedule in Schedule.ROLLPLEX, Schedule.SERIAL:
        g = compiled(standard_grpo(0.04), schedule)
        phase1 = [s for s in steps(g) if s.phase is Phase.ROLLOUT]
        with_decode = [s for s in phase1 if "rollout" in s.ops]
        if schedule is Schedule.ROLLPLEX:
            assert [s.ops for s in phase1] == [("rollout", "ref_score.prefix"), ("rollout", "actor_score.prefix")]
        else:
            assert [s.ops for s in with_decode] == [("rollout",)] and len(phase1) == 3


def test_the_actors_prefill_runs_its_prefix_before_decode_and_the_reference_beside_it():
    for schedule, phase1 in (
        (Schedule.ROLLPLEX, [("actor_score.prefix",), ("rollout", "ref_score.prefix")]),
        (Schedule.SERIAL, [("actor_score.prefix",), ("rollout",), ("ref_score.prefix",)]),
    ):
        g = build(standard_grpo(0.04))
        g = run_passes(g, graph_passes(schedule, actor_prefill=True), check=True)
        assert op(g, "rollout").inputs == ("prompts", "actor_score.boundary")
        assert [s.ops for s in steps(g) if s.phase is Phase.ROLLOUT] == phase1
        life = lifetimes(g)
        assert (
            life["actor_score.boundary"].first == 0 and life["actor_score.boundary"].last == life["actor_grads"].first
        )
    unsplit = run_passes(build(standard_grpo(0.04)), graph_passes(Schedule.UNSPLIT, actor_prefill=True), check=True)
    assert op(unsplit, "rollout").inputs == ("prompts",)  # no prefix: the rollout prefills


def test_executors_follow_roles_and_kinds():
    g = compiled(standard_grpo(0.04))
    expected = {
        "rollout": Executor.ROLLOUT,
        "ref_score.prefix": Executor.SCORER,
        "actor_backward": Executor.TRAINER,
        "actor_update": Executor.OPTIMIZER,
        "reward": Executor.HOST,
        "actor_score.prefix": Executor.TRAINER,
    }
    assert {n: op(g, n).executor for n in expected} == expected


def ppo_with_critic() -> GraphSpec:
    n = NodeSpec
    return GraphSpec(
        nodes=(
            n(id="rollout", kind="decode", role="rollout", inputs=("prompts",), outputs=("responses",)),
            n(id="reward", kind="reward", inputs=("prompts", "responses"), outputs=("rewards",)),
            n(id="values", kind="forward", role="critic", inputs=("prompts", "responses"), outputs=("v",)),
            n(id="lp", kind="forward", role="actor", inputs=("prompts", "responses"), outputs=("logp",)),
            n(id="cb", kind="backward", role="critic", inputs=("v", "rewards"), outputs=("cg",)),
            n(id="ab", kind="backward", role="actor", inputs=("logp", "v", "rewards"), outputs=("ag",)),
            n(id="cu", kind="update", role="critic", inputs=("cg",)),
            n(id="au", kind="update", role="actor", inputs=("ag",)),
        )
    )


def test_ppo_with_a_critic_compiles_and_each_backward_keeps_only_its_own_boundary():
    g = compiled(ppo_with_critic())
    assert op(g, "cb").inputs[-1] == "values.boundary" and "lp.boundary" not in op(g, "cb").inputs
    assert "lp.boundary" in op(g, "ab").inputs and "values.boundary" not in op(g, "ab").inputs
    assert {op(g, "cu").phase, op(g, "au").phase} == {Phase.UPDATE}


def random_graph(rng: random.Random) -> GraphSpec:
    """A random valid iteration: a decode, forwards over any mix of tensors, rewards, backwards, updates."""
    nodes = [NodeSpec(id="d0", kind="decode", role="rollout", inputs=("prompts",), outputs=("r0",))]
    available = ["prompts", "r0"]
    for i in range(rng.randint(2, 9)):
        kind = rng.choice(["forward", "forward", "reward", "backward", "decode"])
        if kind == "decode":
            inputs = ("prompts",)
        else:
            inputs = tuple(dict.fromkeys(rng.sample(available, rng.randint(1, min(3, len(available))))))
        role = {"decode": "rollout", "reward": None}.get(kind, rng.choice(["actor", "reference", "critic"]))
        nodes.append(NodeSpec(id=f"n{i}", kind=kind, role=role, inputs=inputs, outputs=(f"t{i}",)))
        available.append(f"t{i}")
    grads = [n.outputs[0] for n in nodes if n.kind == "backward"]
    if grads:
        nodes.append(NodeSpec(id="upd", kind="update", role="actor", inputs=tuple(grads)))
    rng.shuffle(nodes)
    return GraphSpec(nodes=tuple(nodes))


@pytest.mark.parametrize("seed", range(40))
def test_any_valid_dag_compiles_under_both_schedules_with_the_verifier_between_passes(seed):
    graph = random_graph(random.Random(seed))
    for schedule in Schedule.SERIAL, Schedule.ROLLPLEX:
        g = compiled(graph, schedule)
        dependent = {n for n, t in tensors(g).items() if t.response_dependent}
        for o in ops(g):
            if o.phase is Phase.ROLLOUT:
                assert not dependent & set(o.inputs)
            if o.kind is NodeKind.FORWARD and o.part is Part.WHOLE:
                reads = set(o.inputs) - {"prompts"}
                assert reads <= dependent or not (set(o.inputs) & dependent)


def test_the_verifier_rejects_a_phase_1_op_that_reads_a_response():
    g = assign_phases(split_at_response(build(standard_grpo(0.04))))
    broken = g.copy()
    suffix = op(g, "actor_score.suffix")
    broken.nodes[suffix.id]["op"] = type(suffix)(
        **{**{f: getattr(suffix, f) for f in suffix.__slots__}, "phase": Phase.ROLLOUT}
    )
    with pytest.raises(VerifyError, match="reads response-dependent"):
        verify(broken)


def test_run_passes_names_the_pass_that_broke_an_invariant_and_the_ones_before():
    def drop_steps_of_update(g):
        out = g.copy()
        out.graph["steps"] = tuple(s for s in steps(g) if "actor_update" not in s.ops)
        return out

    passes = [*graph_passes(Schedule.ROLLPLEX), ("drop_steps_of_update", drop_steps_of_update)]
    with pytest.raises(VerifyError, match=r"after pass 'drop_steps_of_update' .*order_steps.*ops without a step"):
        run_passes(build(standard_grpo(0.04)), passes, check=True)
