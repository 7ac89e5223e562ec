"""The time plan: each phase's cost averaged over the planned steps (a synthetic preset's first steps), what
each residency choice costs on the host link, and the seconds predicted at given efficiencies."""

import dataclasses
import json
from pathlib import Path

import pytest

from rollplex.graph import cost, modelcost, timeplan
from rollplex.graph.ir import Schedule
from rollplex.graph.load import load_spec, parse_spec
from rollplex.graph.modelcost import StepTokens
from rollplex.graph.plan import compile_plan

SPECS = Path(__file__).resolve().parents[2] / "specs"


def test_the_time_plan_prices_the_residency_choices_and_predicts_at_given_efficiencies():
    text = (
        (SPECS / "qwen2_5_vl_3b_h200.yaml")
        .read_text()
        .replace("sharing:\n", "sharing:\n  update_beside_prefix: false\n")
    )

    hbm = compile_plan(parse_spec(text))
    host = compile_plan(parse_spec(text.replace("memory:\n", "memory:\n  optimizer_state: host\n")))
    by = {r.timer: r for r in timeplan.time_plan(host, {"update": 0.5})}
    assert {r.timer: r for r in timeplan.time_plan(hbm)}["update"].cost.host_bytes == 0
    assert by["update"].cost.host_bytes == pytest.approx(12 * (by["update"].cost.hbm_bytes / 30))
    link = modelcost.KNOWN_PEAKS["H200"].host_bytes_s
    streamed = by["update"].cost.host_bytes / link  # the link's time: the streamed update's bound
    assert by["update"].bound_s == pytest.approx(streamed)
    assert by["update"].predicted_s == pytest.approx(streamed / timeplan.HOST_LINK_EFFICIENCY)  # not bound / 0.5
    kept = {r.timer: r for r in timeplan.time_plan(hbm, {"update": 0.5})}["update"]
    assert kept.predicted_s == pytest.approx(kept.bound_s / 0.5)  # device work only: at the efficiency
    assert by["rollout"].predicted_s is None


def test_a_frozen_vision_tower_runs_forward_once_per_step_with_no_backward_or_update():
    # the decoder layers kept whole pinned: the HBM a frozen tower frees would keep more of them
    text = (SPECS / "qwen2_5_vl_3b_h200.yaml").read_text().replace("memory:\n", "memory:\n  layers_kept: 0\n")
    trained = {r.timer: r.cost for r in timeplan.time_plan(compile_plan(parse_spec(text)))}
    frozen_model = "model: {name: qwen2_5_vl_3b, freeze_vision: true}"
    frozen_plan = compile_plan(parse_spec(text.replace("model: qwen2_5_vl_3b", frozen_model)))
    frozen = {r.timer: r.cost for r in timeplan.time_plan(frozen_plan)}
    config, steps = frozen_plan.loaded.model, timeplan.planned_steps(frozen_plan)
    vision = sum(
        modelcost.vision_forward(config.vision, p, f, 1)
        for tokens in steps
        for p, f in zip(tokens.patches, tokens.frames, strict=True)
    ) / len(steps)  # the time plan's: a mean over the planned steps
    assert vision > 0.2 * trained["actor_prefix"].flops  # a video prompt's tower is a large part of its prefix
    assert frozen["ref_prefix"].flops == trained["ref_prefix"].flops  # the reference's prefix embeds for both
    assert frozen["actor_prefix"].flops == pytest.approx(trained["actor_prefix"].flops - vision)
    rerun = 3  # the shipped spec recomputes the prefix: forward again, then backward (twice the forward)
    backward = trained["actor_suffix_backward"].flops
    assert frozen["actor_suffix_backward"].flops == pytest.approx(backward - rerun * vision)
    from rollplex.layout import shapes

    llm, tower = shapes.llm_params_per_rank(config.text, 1), shapes.vision_params(config.vision, stored=True)
    assert frozen["update"].hbm_bytes == pytest.approx(trained["update"].hbm_bytes * llm / (llm + tower))


def test_the_planned_steps_are_a_synthetic_presets_first_steps_within_the_budget():
    plan = compile_plan(load_spec(SPECS / "qwen2_5_vl_7b_h200.yaml"))
    from rollplex.data.presets import get_preset

    preset, gpu, seed = get_preset("llava_video"), plan.context.gpu, plan.loaded.spec.run.seed
    steps = timeplan.planned_steps(plan)
    assert len(steps) == timeplan.PLANNED_STEPS
    n = gpu.prompts_per_rank
    expected = [min(preset.prompt_tokens(preset.layout(seed, 1 * n + i)), gpu.prompt_tokens) for i in range(n)]
    assert list(steps[1].prompt_tokens) == expected and max(expected) < gpu.prompt_tokens  # not the budget
    longest = {max(max(group) for group in s.response_lens) for s in steps}
    assert len(longest) > 1 and max(longest) <= gpu.response_tokens  # each step its own draw


def test_larger_steps_are_drawn_fewer_times_and_priced_per_prompt_as_per_response():
    """A step of many prompts or samples is drawn fewer times (one at least), so a dry-run's work stays bounded; the
    cost model sums each prompt's lengths once and prices them as the lengths one by one would."""
    assert timeplan.planned_count(8, 8) == timeplan.PLANNED_STEPS
    assert timeplan.planned_count(128, 1) == timeplan.PLANNED_PROMPTS // 128
    assert timeplan.planned_count(8, 64) == timeplan.PLANNED_RESPONSES // 512
    assert timeplan.planned_count(2**16, 16) == 1
    big = compile_plan(parse_spec((SPECS / "tiny_cpu.yaml").read_text().replace("group_size: 16", "group_size: 4096")))
    (step,) = timeplan.planned_steps(big)
    assert step.num_responses == 8 * 4096 and len(set(step.response_lens[0])) > 1
    t = big.loaded.model.text
    ones = [
        StepTokens((p,), (0,), (1,), ((r,),))
        for p, lens in zip(step.prompt_tokens, step.response_lens, strict=True)
        for r in lens
    ]
    for additive in (modelcost.suffix_attention_flops, modelcost.whole_attention_flops):
        assert additive(t, step, 1) == pytest.approx(sum(additive(t, one, 1) for one in ones))
    lens = [r for group in step.response_lens for r in group]  # decode, from each response's length
    live = sum(p * max(group) for p, group in zip(step.prompt_tokens, step.response_lens, strict=True))
    reads = max(lens) * modelcost.S.decode_params_per_rank(t, 1) * 2 + modelcost.S.kv_bytes_per_token(t, 1) * (
        sum(r * (r + 1) / 2 for r in lens) + live
    )
    assert modelcost.decode(t, step, 1).hbm_bytes == pytest.approx(reads)
    assert timeplan.recorded_tokens(json.loads(json.dumps(step.record()))) == step


def test_the_planned_steps_count_every_patch_the_runs_bounds_count():
    """The tower runs on each video's every patch, also past `workload.visual_tokens` (a planning budget)."""
    import torch

    from rollplex.data.source import batch_at, open_dataset
    from rollplex.executors.bounds import step_tokens
    from rollplex.executors.task import make_tokenizer

    loaded = load_spec(SPECS / "qwen2_5_vl_7b_h200.yaml")
    plan, w = compile_plan(loaded), loaded.spec.workload
    dataset = open_dataset(w.dataset, make_tokenizer(loaded), loaded.spec.run.seed, loaded.path.parent)
    run = step_tokens(batch_at(dataset, 0, w.prompts_per_step), torch.ones(w.prompts_per_step, w.group_size))
    planned = timeplan.planned_steps(plan)[0]
    assert (planned.patches, planned.frames) == (run.patches, run.frames)
    assert max(run.patches) > plan.context.gpu.patches_per_prompt  # a video past the budget


def test_a_prefix_beside_decode_has_no_seconds_of_its_own_and_one_decode_reads_runs_alone():
    text = (SPECS / "qwen2_5_vl_3b_h200.yaml").read_text()
    own = compile_plan(parse_spec(text + "run: {rollout_prefill: rollout}\n"))
    shared = compile_plan(parse_spec(text))  # auto: the actor's prefix, as the spec allows it
    given = {"actor_prefix": 0.5, "ref_prefix": 0.5}
    beside = {r.timer: r.predicted_s for r in timeplan.time_plan(own, given)}
    alone = {r.timer: r for r in timeplan.time_plan(shared, given)}
    assert beside["actor_prefix"] is None and beside["ref_prefix"] is None and alone["ref_prefix"].predicted_s is None
    assert alone["actor_prefix"].predicted_s == pytest.approx(alone["actor_prefix"].bound_s / 0.5)
    assert timeplan.overlapped_timers(own.graph) == {"actor_prefix", "ref_prefix"}
    assert timeplan.overlapped_timers(shared.graph) == {"ref_prefix"}  # what the bench's T_P sums


def test_a_critics_ops_have_timers_of_their_own_so_the_actor_prefix_alone_is_predicted():
    plan = compile_plan(load_spec(SPECS / "ppo_critic_7b_h200.yaml"))
    every = {timer: 0.5 for timer in cost.TIMERS}
    rows = {r.timer: r for r in timeplan.time_plan(plan, every)}
    assert {"critic_prefix", "critic_suffix_backward"} <= set(rows)
    assert "critic_prefix" in timeplan.overlapped_timers(plan.graph)  # beside decode, as the reference's
    assert rows["critic_prefix"].predicted_s is None and rows["ref_prefix"].predicted_s is None
    assert rows["actor_prefix"].predicted_s is not None  # it runs alone, before decode reads its boundary
    grpo = compile_plan(load_spec(SPECS / "qwen2_5_vl_7b_h200.yaml"))
    assert not any(r.timer.startswith("critic") for r in timeplan.time_plan(grpo))


def test_the_step_bound_prices_the_work_beside_decode_together_with_the_rollout():
    text = (SPECS / "qwen2_5_vl_3b_h200.yaml").read_text()
    rollplex, serial = (compile_plan(parse_spec(text), s) for s in (Schedule.ROLLPLEX, Schedule.SERIAL))
    by = {r.timer: r for r in timeplan.time_plan(rollplex)}
    summed = sum(r.bound_s for r in by.values())
    assert timeplan.step_bound_s(serial, timeplan.time_plan(serial)) == pytest.approx(summed)  # one after another
    # decode is HBM-bound and the reference prefix FLOP-bound: beside each other the rollout's bound holds both
    together = cost.total([by["rollout"].cost, by["ref_prefix"].cost]).bound_s(modelcost.KNOWN_PEAKS["H200"])
    assert together == pytest.approx(by["rollout"].bound_s, rel=1e-3)
    step = timeplan.step_bound_s(rollplex, tuple(by.values()))
    assert step == pytest.approx(summed - by["ref_prefix"].bound_s, rel=1e-4)
    heavy = {**by, "ref_prefix": dataclasses.replace(by["ref_prefix"], cost=by["ref_prefix"].cost.scaled(40))}
    flops = (by["rollout"].cost.flops + 40 * by["ref_prefix"].cost.flops) / modelcost.KNOWN_PEAKS["H200"].flops
    assert timeplan.step_bound_s(rollplex, tuple(heavy.values())) == pytest.approx(step - by["rollout"].bound_s + flops)


def test_the_backward_through_the_prefix_is_shown_within_the_actors_phase_and_absent_unsplit(capsys):
    from rollplex.cli import main

    plan = compile_plan(load_spec(SPECS / "qwen2_5_vl_3b_h200.yaml"))
    steps = timeplan.planned_steps(plan)
    part = timeplan.prefix_backward_plan(plan)
    each = [cost.plan_prefix_backward(plan, tokens) for tokens in steps]
    assert part.cost.flops == pytest.approx(sum(c.flops for c in each) / len(each))
    (whole,) = [r for r in timeplan.time_plan(plan) if r.timer == "actor_suffix_backward"]
    assert 0 < part.bound_s < whole.bound_s and part.cost.flops < whole.cost.flops
    assert (
        timeplan.prefix_backward_plan(compile_plan(load_spec(SPECS / "qwen2_5_vl_3b_h200.yaml"), Schedule.UNSPLIT))
        is None
    )
    assert main(["compile", str(SPECS / "qwen2_5_vl_3b_h200.yaml"), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("actor_suffix_backward "))
    assert lines[at + 1].startswith("  of it, through the prefix") and f"{part.bound_s:.3f}" in lines[at + 1]


@pytest.mark.parametrize("name", ["qwen2_5_vl_7b_h200", "ppo_critic_7b_h200"])
def test_a_prefix_with_the_updates_rest_in_it_is_priced_from_the_two_apart_sharing_the_device(name):
    """The 7B specs run the actor's streamed update on into the next actor prefix. From efficiencies of the two
    measured apart, the prefix's seconds are the longer's plus a share of the shorter's, each priced as it costs
    alone (its device bound at its efficiency, its link bytes at the link's); a critic's update (PPO) stays in the
    update's phase. From an efficiency measured beside (UPDATE_BESIDE), the two's bound over it; from neither,
    none; the update's phase at UPDATE_DEFERRED where a source gives it."""
    plan = compile_plan(load_spec(SPECS / f"{name}.yaml"))
    assert plan.decisions.update_beside_prefix
    peaks = modelcost.KNOWN_PEAKS["H200"]
    steps = timeplan.planned_steps(plan)[:2]
    alone = [cost.plan_phase_costs(plan, t, held=False, deferred=False) for t in steps]
    update = cost.plan_actor_update(plan, steps[0])
    assert update == cost.plan_actor_update(plan, steps[1]) and update.host_bytes > 0  # the state streams

    def at(c: modelcost.Cost, e: float) -> float:
        link = c.host_bytes / peaks.host_bytes_s / timeplan.HOST_LINK_EFFICIENCY
        return max(modelcost.Cost(c.flops, c.hbm_bytes).bound_s(peaks) / e, link)

    p = at(cost.total([cost.total(a["actor_prefix"]) for a in alone]).scaled(0.5), 0.6)
    u = at(update, 0.8)
    assert min(p, u) > 0.05 * max(p, u)  # both count
    found = {"actor_prefix": 0.6, "update": 0.8}
    together = {r.timer: r for r in timeplan.time_plan(plan, found, steps)}
    prefix = together["actor_prefix"]
    assert prefix.predicted_s == pytest.approx(max(p, u) + timeplan.UPDATE_BESIDE_SHARE * min(p, u))
    device = modelcost.Cost(prefix.cost.flops, prefix.cost.hbm_bytes).bound_s(peaks)
    assert prefix.efficiency == pytest.approx(device / prefix.predicted_s)  # as a run of it would record
    critic = [cost.total(a["update"]) for a in alone]  # the critic's update where PPO has one, and the actor's
    own = cost.total([cost.total(a["update"]) for a in alone]).scaled(0.5)
    assert together["update"].cost.host_bytes == pytest.approx(own.host_bytes - update.host_bytes)
    assert (together["update"].cost.host_bytes > 0) is (name.startswith("ppo")) and len(critic) == 2
    measured = {r.timer: r for r in timeplan.time_plan(plan, {timeplan.UPDATE_BESIDE: 0.5}, steps)}
    assert measured["actor_prefix"].predicted_s == pytest.approx(at(measured["actor_prefix"].cost, 0.5))
    assert measured["actor_prefix"].cost.host_bytes == pytest.approx(
        update.host_bytes + cost.total([cost.total(a["actor_prefix"]) for a in alone]).scaled(0.5).host_bytes
    )
    assert measured["update"].predicted_s is None
    prefix_only = {r.timer: r for r in timeplan.time_plan(plan, {"actor_prefix": 0.6}, steps)}["actor_prefix"]
    assert prefix_only.predicted_s is None and prefix_only.efficiency is None
    waited = {r.timer: r for r in timeplan.time_plan(plan, {**found, timeplan.UPDATE_DEFERRED: 0.25}, steps)}
    steady = [cost.plan_phase_costs(plan, t)["update"] for t in steps]  # the gradient norm, then a critic's update
    parts = [cost.total([each[k] for each in steady]).scaled(0.5) for k in range(len(steady[0]))]
    assert waited["update"].predicted_s == pytest.approx(sum(at(part, 0.25) for part in parts))
