"""A compiled plan's ops priced: the bound's rules (the slowest of compute, HBM and host link; an op's parts one
after another), and each op mapped to the passes of the model it runs (a rollout prefilled by the actor's prefix,
replicas sharing the prompts, a paged reference, a fused critic, ZeRO, mini-batches, unsplit scoring)."""

from pathlib import Path

import pytest

from rollplex.graph import cost, modelcost, timeplan
from rollplex.graph.load import parse_spec
from rollplex.graph.memobject import Component, Residency
from rollplex.graph.modelcost import Cost, DevicePeaks, decode, suffix_forward
from rollplex.graph.plan import compile_plan

SPECS = Path(__file__).resolve().parents[2] / "specs"
PEAKS = DevicePeaks("test", flops=1e12, hbm_bytes_s=1e9, host_bytes_s=1e8)


def test_a_bound_is_the_slowest_resource_and_an_ops_parts_add_up():
    assert Cost(flops=2e12, hbm_bytes=1e9, host_bytes=1e7).bound_s(PEAKS) == 2.0
    assert Cost(flops=1e9, hbm_bytes=3e9).bound_s(PEAKS) == 3.0
    assert Cost(host_bytes=5e8).bound_s(PEAKS) == 5.0
    text = (SPECS / "qwen2_5_vl_3b_h200.yaml").read_text() + "run: {rollout_prefill: rollout}\n"
    plan = compile_plan(parse_spec(text))
    costs = cost.plan_phase_costs(plan, timeplan.planned_steps(plan)[0])
    prefill, decoding = costs["rollout"]
    assert cost.phase_bounds(costs, PEAKS)["rollout"] == prefill.bound_s(PEAKS) + decoding.bound_s(PEAKS)
    assert decoding.hbm_bytes / PEAKS.hbm_bytes_s > decoding.flops / PEAKS.flops  # decode reads, prefill computes


def test_a_rollout_prefilled_by_the_actor_prefix_costs_its_decode_alone():
    text = (SPECS / "qwen2_5_vl_3b_h200.yaml").read_text()
    assert "\nrun:" not in text
    own = compile_plan(parse_spec(text + "run: {rollout_prefill: rollout}\n"))
    shared = compile_plan(parse_spec(text))  # auto: the actor's prefix, as the spec allows it
    tokens = timeplan.planned_steps(own)[0]
    prefill, decoding = cost.plan_phase_costs(own, tokens)["rollout"]
    assert cost.plan_phase_costs(shared, tokens)["rollout"] == (decoding,)
    assert cost.plan_phase_costs(shared, tokens)["actor_prefix"] == cost.plan_phase_costs(own, tokens)["actor_prefix"]
    assert prefill.flops == cost.plan_phase_costs(own, tokens)["actor_prefix"][0].flops  # the work it no longer does


def test_replicas_sharing_the_prompts_cost_the_share_that_decodes_the_most():
    text = (SPECS / "qwen2_5_vl_32b_h200x8.yaml").read_text()  # train TP 8, rollout TP 4: two replicas per rank
    split, whole = (compile_plan(parse_spec(text.replace("parallel:\n", f"parallel:\n  split_rollout: {on}\n")))
                    for on in ("true", "false"))  # fmt: skip
    tokens = timeplan.planned_steps(split)[0]
    n = len(tokens.prompt_tokens)
    model = split.loaded.model.text
    halves = [tokens.of_prompts(range(0, n // 2)), tokens.of_prompts(range(n // 2, n))]
    slowest = max(halves, key=lambda h: decode(model, h, 4).hbm_bytes)
    assert decode(model, halves[0], 4) != decode(model, halves[1], 4)  # the shares carry different lengths
    assert cost.plan_phase_costs(split, tokens)["rollout"][-1] == decode(model, slowest, 4)
    assert cost.plan_phase_costs(whole, tokens)["rollout"][-1] == decode(model, tokens, 4)  # each replica all


def test_a_paged_reference_crosses_the_link_inwards_once_per_window_of_its_steps():
    text = (SPECS / "qwen2_5_vl_32b_h800.yaml").read_text()
    paged, kept = (compile_plan(parse_spec(text.replace("page_reference: true", f"page_reference: {on}")))
                   for on in ("true", "false"))  # fmt: skip
    tokens = timeplan.planned_steps(paged)[0]
    weights = sum(
        o.bytes for o in paged.residency.objects if o.role == "reference" and o.component is Component.WEIGHTS
    )
    ins = cost.reference_page_ins(paged)
    assert [timer for timer, _ in ins] == ["ref_prefix", "ref_suffix"]  # Phase 1's step, then Phase 2's
    assert all(n == weights for _, n in ins) and cost.reference_page_ins(kept) == []
    for timer in ("ref_prefix", "ref_suffix"):
        first, *rest = cost.plan_phase_costs(paged, tokens)[timer]
        assert first == Cost(host_bytes=weights) and tuple(rest) == cost.plan_phase_costs(kept, tokens)[timer]


def test_a_critics_scoring_is_priced_once_inside_its_backward_with_a_scalar_head():
    from rollplex.graph.load import load_spec

    plan = compile_plan(load_spec(SPECS / "ppo_critic_7b_h200.yaml"))
    tokens = timeplan.planned_steps(plan)[0]
    t, v, d = plan.loaded.model.text, plan.loaded.model.vision, plan.decisions
    critic = cost.total(cost.plan_phase_costs(plan, tokens)["critic_suffix_backward"])
    assert critic == modelcost.backward(True, t, v, tokens, 1, d, False, value=True)  # the fused scoring adds nothing
    assert critic.host_bytes == 0 < d.host_pool_bytes  # its prefix tensors stay in HBM while the actor's travel
    head = suffix_forward(t, tokens, 1).flops - suffix_forward(t, tokens, 1, value=True).flops
    assert head == pytest.approx(2 * t.hidden_size * (t.vocab_size - 1) * tokens.response_tokens)


def test_under_zero_the_actors_update_is_sharded_and_a_critics_is_not():
    text = (SPECS / "ppo_critic_tiny.yaml").read_text().replace("{hbm_gib: 16,", "{gpus_per_node: 2, hbm_gib: 16,")
    alone, sharded = (
        compile_plan(parse_spec(text + extra)) for extra in ("", "parallel: {distributed_optimizer: true}\n")
    )
    assert sharded.context.gpu.train_dp == 2
    tokens = timeplan.planned_steps(alone)[0]
    (actor, critic), (actor_z, critic_z) = (
        [cost.op_cost(o, p.loaded.model, p.context.gpu, p.decisions, tokens, True) for o in updates(p)]
        for p in (alone, sharded)
    )
    assert actor_z.hbm_bytes == pytest.approx(actor.hbm_bytes / 2, rel=1e-6) and critic_z == critic
    state = [
        sum(
            o.host_bytes + o.bytes for o in p.residency.objects if o.role == "critic" and o.component.value != "weights"
        )
        for p in (alone, sharded)
    ]
    assert state[0] == state[1]  # the critic's FP32 state and gradients, whole on each rank


def updates(plan):
    from rollplex.graph.ir import NodeKind, ops

    found = sorted((o for o in ops(plan.graph) if o.kind is NodeKind.UPDATE), key=lambda o: o.role.value)
    return found  # actor, critic


def test_each_mini_batch_backpropagates_through_its_own_prompts_prefix():
    """The step's prefix keeps the graph of mini-batch 1's prompts only (its saved tensors, over the host link when
    they live there), and each mini-batch's backward runs through its own share of the prefix."""
    from rollplex.executors.bounds import prefix_backward_bound_s
    from rollplex.graph.ir import NodeKind, Part, Role, ops

    text = (SPECS / "qwen2_5_vl_3b_h200.yaml").read_text()
    text = text.replace("algorithm:\n", "algorithm:\n  minibatches_per_step: 2\n") + "run: {rollout_prefill: rollout}\n"
    text = text.replace("memory:\n", "memory:\n  prefix_saved: host\n")
    plan = compile_plan(parse_spec(text))
    tokens = timeplan.planned_steps(plan)[0]
    model, gpu, d = plan.loaded.model, plan.context.gpu, plan.decisions
    t, v, sp = model.text, model.vision, gpu.sequence_parallel
    first, second = (next(o for o in ops(plan.graph) if o.kind is NodeKind.BACKWARD and o.id.endswith(k)) for k in "12")
    whole = modelcost.backward(True, t, v, tokens, 1, d, sp)
    prefix = modelcost.prefix_backward(t, v, tokens, 1, d, sp)
    assert cost.op_cost(second, model, gpu, d, tokens, True) == whole.scaled(0.5)
    assert cost.op_cost(first, model, gpu, d, tokens, True) == whole.scaled(0.5)
    peaks = modelcost.KNOWN_PEAKS["H200"]
    assert prefix_backward_bound_s(plan, tokens) == round(prefix.bound_s(peaks), 4)
    assert d.prefix_saved is Residency.HOST and prefix.host_bytes > 0
    prefixes = [o for o in ops(plan.graph) if o.role is Role.ACTOR and o.part is Part.PREFIX]
    phase = cost.phase_costs(prefixes, model, gpu, d, tokens)  # the step's prefix and mini-batch 2's rerun
    assert len(prefixes) == 2 and cost.total(phase["actor_prefix"]).host_bytes == prefix.host_bytes
    saved = [o for o in plan.residency.objects if o.role == "actor" and o.component is Component.PREFIX_SAVED]
    one = compile_plan(parse_spec(text.replace("  minibatches_per_step: 2\n", "")))
    saved_one = [o for o in one.residency.objects if o.role == "actor" and o.component is Component.PREFIX_SAVED]
    assert sum(o.bytes for o in saved) * 2 == sum(o.bytes for o in saved_one) > 0


def test_a_role_scored_over_whole_sequences_is_priced_unsplit_beside_a_split_one():
    """A custom graph whose actor scores from the responses alone (no prompt: no boundary) while the critic's is
    split: the actor's backward reruns every prompt per response, the critic's goes through its prefix."""
    from rollplex.graph.load import load_spec

    text = (SPECS / "ppo_critic_7b_h200.yaml").read_text()
    custom = text.replace("{id: actor_score, kind: forward, role: actor, inputs: [prompts, responses]",
                          "{id: actor_score, kind: forward, role: actor, inputs: [responses]")  # fmt: skip
    assert custom != text
    plan, split = compile_plan(parse_spec(custom)), compile_plan(load_spec(SPECS / "ppo_critic_7b_h200.yaml"))
    tokens = timeplan.planned_steps(plan)[0]
    t, v, d, sp = plan.loaded.model.text, plan.loaded.model.vision, plan.decisions, plan.context.gpu.sequence_parallel
    costs, split_costs = cost.plan_phase_costs(plan, tokens), cost.plan_phase_costs(split, tokens)
    assert cost.total(costs["actor_suffix_backward"]) == modelcost.backward(False, t, v, tokens, 1, d, sp)
    assert cost.total(costs["critic_suffix_backward"]) == cost.total(split_costs["critic_suffix_backward"])
    assert timeplan.prefix_backward_plan(plan) is None
