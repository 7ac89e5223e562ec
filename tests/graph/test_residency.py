"""Residency: where each object a plan could move lives (HBM, the pinned pool, kept or streamed), what the planner
spends free HBM on, and what the spec forces."""

from pathlib import Path

import pytest
from test_plan import both_parts, tiny, tiny_text

from rollplex.graph.decisions import Recompute
from rollplex.graph.ir import Role, Schedule, steps
from rollplex.graph.load import load_spec, parse_spec
from rollplex.graph.memobject import GIB, Residency
from rollplex.graph.plan import compile_plan

SPECS = Path(__file__).resolve().parents[2] / "specs"


def seven_text() -> str:
    """The 7B spec with its update ending its step (auto would run it beside the next actor prefix): the
    residency choices alone."""
    text = (SPECS / "qwen2_5_vl_7b_h200.yaml").read_text()
    return text.replace("sharing:\n", "sharing:\n  update_beside_prefix: false\n")


def test_a_short_host_keeps_frozen_weights_and_saved_prefix_state_in_hbm_instead():
    extra = ", page_reference: true, optimizer_state: host"  # the whole FP32 state on the host: over 100 GiB in all
    roomy, short = tiny(extra), tiny(extra + ", host_pool_gib: 100")
    assert roomy.residency.host.needed_bytes_per_node > 100 * GIB
    assert short.residency.host.needed_bytes_per_node <= 100 * GIB and short.residency.fits
    update = max(s.index for s in steps(roomy.graph))
    for ref in both_parts(roomy, "reference", "weights (BF16)"):
        assert ref.residency(update) is Residency.HOST
    for ref in both_parts(short, "reference", "weights (BF16)"):  # moved back together, as one pager moves them
        assert ref.residency(update) is Residency.HBM


def test_the_reference_waits_on_the_host_between_its_steps_only_where_the_spec_lets_the_plan_page_it():
    kept, paged = tiny(", optimizer_state: host"), tiny(", page_reference: true, optimizer_state: host")
    update = max(s.index for s in steps(kept.graph))
    for ref in both_parts(kept, "reference", "weights (BF16)"):
        assert ref.residency(update) is Residency.HBM and ref.host_bytes == 0
    for ref in both_parts(paged, "reference", "weights (BF16)"):
        assert ref.residency(update) is Residency.HOST and ref.host_bytes == ref.bytes
    assert paged.residency.phases[-1].peak_bytes < kept.residency.phases[-1].peak_bytes


def test_trained_weights_are_in_hbm_at_every_step_however_late_their_role_first_runs():
    """The update writes them in place and nothing frees them between steps: a critic, which first runs after the
    rollout, holds its weights through the next step's Phase 1 too."""
    plan = compile_plan(load_spec(SPECS / "ppo_critic_7b_h200.yaml"))
    first = min(s.index for s in steps(plan.graph) if any(name.startswith("critic") for name in s.ops))
    assert first > 0
    for role in ("actor", "critic"):
        for weights in both_parts(plan, role, "weights (BF16)"):
            assert all(weights.residency(s.index) is Residency.HBM for s in steps(plan.graph)), (role, weights)


def test_the_planned_optimizer_workspace_bounds_what_chunked_adamw_allocates():
    torch = pytest.importorskip("torch")
    from rollplex.graph.residency import OptimizerPlan
    from rollplex.memory.optimizer import ChunkedAdamW

    params = [torch.zeros(n, requires_grad=True) for n in (1000, 30_000, 7, 123_456)]
    total = sum(p.numel() for p in params) * 12
    for chunk in (12 * 1000, 12 * 40_000, total):
        opt = ChunkedAdamW(params, chunk_bytes=chunk)
        planned = OptimizerPlan(total, chunk, -(-total // chunk), 3)
        assert opt.peak_device_bytes <= planned.workspace_bytes
        in_hbm = ChunkedAdamW(params, chunk_bytes=chunk, state_on_device=True)  # updated in place: no slots
        assert in_hbm.peak_device_bytes <= OptimizerPlan(total, chunk, -(-total // chunk), 0).workspace_bytes
        assert in_hbm.peak_device_bytes < opt.peak_device_bytes


def _in_hbm(plan, component: str) -> bool:
    return all(o.host_bytes == 0 for o in plan.residency.objects if o.role == "actor" and o.component == component)


def test_the_planner_spends_free_hbm_on_what_would_cross_the_host_link_every_step():
    three = compile_plan(load_spec(SPECS / "qwen2_5_vl_3b_h200.yaml"))  # 139 GiB and a 3B model: room for both
    assert _in_hbm(three, "prefix saved tensors") and _in_hbm(three, "Adam moments (FP32)")
    d = three.decisions
    assert d.prefix_saved is Residency.HBM and d.optimizer_state is Residency.HBM and three.residency.fits
    seven = compile_plan(load_spec(SPECS / "qwen2_5_vl_7b_h200.yaml"))  # 85 GiB of FP32 state does not fit beside
    assert seven.decisions.optimizer_state is Residency.HOST and not _in_hbm(seven, "Adam moments (FP32)")
    assert seven.residency.fits and seven.residency.peak_bytes <= seven.residency.capacity_bytes
    # state in HBM is updated in place (no chunks staged); the 7B's streams three chunks at once
    assert three.residency.optimizer.pipeline_depth == 0 and seven.residency.optimizer.pipeline_depth == 3
    for plan in (three, seven):  # every step still fits with the smallest optimizer pipeline beside it
        assert max(plan.residency.step_bytes) <= plan.residency.capacity_bytes


def test_where_the_fp32_state_streams_the_share_of_it_that_every_step_has_room_for_stays_in_hbm():
    from rollplex.graph.modelcost import update
    from rollplex.graph.residency import SPEND_LIMIT, STATE_SHARE_GRANULE

    text = seven_text().replace("memory:\n", "memory:\n  prefix_saved: hbm\n  layers_kept: 0\n")
    auto = compile_plan(parse_spec(text))  # the prefix's saved tensors held where they are: only the state moves
    host = compile_plan(parse_spec(text.replace("memory:\n", "memory:\n  optimizer_state: host\n")))
    r, d = auto.residency, auto.decisions
    share = r.state_share_bytes
    assert d.optimizer_state is Residency.HOST and d.optimizer_kept_bytes == share > 0
    assert -share % STATE_SHARE_GRANULE < 8  # whole granules, less each object's rounding down
    state = lambda plan: [o for o in plan.residency.objects if o.role == "actor" and o.component in  # noqa: E731
                          ("FP32 master weights", "Adam moments (FP32)")]  # fmt: skip
    kept = [o for o in state(auto) if o.live]
    assert kept and all(o.live == frozenset(range(len(r.step_bytes))) and not o.host_bytes for o in kept)
    assert sum(o.bytes for o in state(auto)) == sum(o.bytes for o in state(host))  # split, not grown
    assert sum(o.host_bytes for o in state(auto)) == sum(o.host_bytes for o in state(host)) - share
    for a, b in zip(r.step_bytes, host.residency.step_bytes, strict=True):  # in every step, and nothing else moved
        assert a - b == share or a - b - share == r.optimizer.workspace_bytes - host.residency.optimizer.workspace_bytes
    assert r.need_bytes == host.residency.peak_bytes < r.peak_bytes <= SPEND_LIMIT * r.capacity_bytes
    assert r.host.needed_bytes_per_node == host.residency.host.needed_bytes_per_node - share
    t, v = auto.loaded.model.text, auto.loaded.model.vision
    assert update(t, v, 1, host.decisions).host_bytes - update(t, v, 1, d).host_bytes == share
    assert host.decisions.optimizer_kept_bytes == host.residency.state_share_bytes == 0  # forced: all of it streams
    assert -share % r.optimizer.chunk_bytes < 8  # whole chunks, as the optimizer keeps them


def test_prefix_saved_tensors_sent_to_the_host_stay_there_and_their_hbm_goes_to_the_fp32_states_share():
    """On the 7B spec the pool cannot hold the streamed FP32 state and the prefix's saved tensors at once: with
    `prefix_saved: host` the plan keeps the tensors on the host (it used to pull them back into HBM) and keeps a
    larger share of the state in HBM instead, so the pool still fits and less state crosses the link."""
    text = seven_text()
    hbm = compile_plan(parse_spec(text.replace("memory:\n", "memory:\n  prefix_saved: hbm\n")))
    host = compile_plan(parse_spec(text.replace("memory:\n", "memory:\n  prefix_saved: host\n")))
    saved = lambda plan: sum(  # noqa: E731
        o.host_bytes for o in plan.residency.objects if o.role == "actor" and o.component == "prefix saved tensors"
    )
    assert hbm.decisions.prefix_saved is Residency.HBM and saved(hbm) == 0
    assert host.decisions.prefix_saved is Residency.HOST and saved(host) > 20 * GIB
    gained = host.residency.state_share_bytes - hbm.residency.state_share_bytes
    assert gained > saved(host) - 2 * GIB  # about the HBM the tensors left, in whole optimizer chunks
    assert host.residency.fits and host.residency.host.needed_bytes_per_node <= 100 * GIB
    assert max(host.residency.step_bytes) <= host.residency.capacity_bytes
    assert hbm.chosen == host.chosen == ""  # forced, not chosen


def test_auto_sends_the_prefixs_saved_tensors_to_the_host_where_that_lowers_the_step_bound():
    """`prefix_saved: auto` on the 7B spec: the tensors' traffic hides under the prefix's compute while the FP32
    state's HBM share they would crowd out is exposed in the update, so auto takes the host plan (as the dry-run
    says); on the 3B spec the whole state is in HBM, nothing is gained, and the tensors stay in HBM."""
    from rollplex.graph.levers import step_seconds

    text = seven_text()
    auto = compile_plan(parse_spec(text))
    hbm = compile_plan(parse_spec(text.replace("memory:\n", "memory:\n  prefix_saved: hbm\n")))
    host = compile_plan(parse_spec(text.replace("memory:\n", "memory:\n  prefix_saved: host\n")))
    assert auto.decisions == host.decisions and auto.residency == host.residency
    assert step_seconds(auto)[0] < step_seconds(hbm)[0] - 0.3  # about 28 GB less each way in the update
    assert auto.chosen.startswith("memory.prefix_saved auto: host") and "against" in auto.chosen
    assert auto.loaded.spec.memory.prefix_saved == "host"  # the plan carries the choice to plan.json
    three = compile_plan(load_spec(SPECS / "qwen2_5_vl_3b_h200.yaml"))
    assert three.decisions.prefix_saved is Residency.HBM and three.chosen == ""


def test_faster_residencies_offers_the_other_placement_only_where_it_fits_and_lowers_the_step_bound():
    from rollplex.graph.levers import faster_residencies, step_seconds

    text = seven_text()
    seven = compile_plan(parse_spec(text.replace("memory:\n", "memory:\n  prefix_saved: hbm\n")))
    (faster,) = faster_residencies(seven)
    assert faster.lever.changes == {"memory": {"prefix_saved": "host", "layers_kept": 0}}  # the layers as planned
    assert faster.lever.text == "set memory.prefix_saved: host and memory.layers_kept: 0" and faster.predicted_s is None
    bound, _ = step_seconds(seven)
    assert faster.bound_s < bound - 0.3  # the update's exposed host traffic falls by about 28 GB each way
    three = compile_plan(load_spec(SPECS / "qwen2_5_vl_3b_h200.yaml"))  # all in HBM: the host is never faster
    assert faster_residencies(three) == []
    assert faster_residencies(compile_plan(parse_spec(text))) == []  # auto took the faster placement itself


def test_faster_recompute_offers_the_settings_that_fit_with_a_lower_step_bound_fastest_first():
    from rollplex.graph.levers import faster_recompute, step_seconds

    three = compile_plan(load_spec(SPECS / "qwen2_5_vl_3b_h200.yaml"))  # names full: none reruns nothing, and fits
    found = faster_recompute(three)
    assert [f.lever.text for f in found] == ["set memory.recompute: none", "set memory.recompute: selective"]
    bound, _ = step_seconds(three)
    assert all(f.bound_s < bound for f in found) and [f.bound_s for f in found] == sorted(f.bound_s for f in found)
    seven = compile_plan(parse_spec(seven_text()))  # the 7B at auto: full, the fastest that fits
    assert seven.loaded.spec.memory.recompute == "full" and faster_recompute(seven) == []


def test_a_critics_state_streams_whole_while_the_actors_share_stays_in_hbm():
    from rollplex.graph.cost import op_cost
    from rollplex.graph.ir import NodeKind, ops
    from rollplex.graph.timeplan import planned_tokens

    text = (SPECS / "ppo_critic_7b_h200.yaml").read_text().replace("qwen2_5_vl_7b", "qwen2_5_vl_3b")
    plan = compile_plan(parse_spec(text.replace("hbm_gib: 139", "hbm_gib: 120")))
    d, r = plan.decisions, plan.residency
    state = [o for o in r.objects if o.component in ("FP32 master weights", "Adam moments (FP32)")]
    assert any(o.host_bytes for o in state if o.role == "critic")
    assert d.optimizer_state is Residency.HOST  # so the critic's optimizer streams, as the plan counts it
    assert d.optimizer_kept_bytes == sum(o.bytes for o in state if o.role == "actor" and o.live) > 0
    costs = {o.role.value: op_cost(o, plan.loaded.model, plan.context.gpu, d, planned_tokens(plan.context.gpu, 1), True)
             for o in ops(plan.graph) if o.kind is NodeKind.UPDATE}  # fmt: skip
    critic_state = sum(o.host_bytes for o in state if o.role == "critic")
    assert costs["critic"].host_bytes == pytest.approx(critic_state, rel=1e-3)  # none of its state is kept
    assert costs["actor"].host_bytes < costs["critic"].host_bytes


@pytest.mark.parametrize("choice", ["host", "hbm"])
def test_the_spec_forces_where_the_optimizer_state_and_the_prefix_saved_tensors_live(choice):
    text = (SPECS / "qwen2_5_vl_3b_h200.yaml").read_text()
    text = text.replace("memory:\n", f"memory:\n  optimizer_state: {choice}\n  prefix_saved: {choice}\n")
    plan = compile_plan(parse_spec(text))
    assert _in_hbm(plan, "FP32 master weights") == _in_hbm(plan, "prefix saved tensors") == (choice == "hbm")
    assert plan.decisions.optimizer_state is Residency(choice)
    forced = compile_plan(parse_spec(text.replace("hbm_gib: 139", "hbm_gib: 80")))
    assert not forced.residency.fits_hbm or choice == "host"  # hbm is obeyed even where it cannot fit


def test_an_update_streamed_beside_the_next_prefix_moves_in_small_chunks_and_one_ending_its_step_in_large():
    """Beside the prefix a first use there (a new cuDNN plan, a lazily loaded kernel) waits for every queued chunk:
    the auto chunk is at most BESIDE_PREFIX_CHUNK; an update alone takes the largest that fits."""
    from rollplex.graph.residency import BESIDE_PREFIX_CHUNK, MAX_AUTO_CHUNK

    beside = compile_plan(load_spec(SPECS / "qwen2_5_vl_7b_h200.yaml"))
    joined = compile_plan(parse_spec(seven_text()))
    text = seven_text().replace("update_beside_prefix: false", "update_beside_prefix: true")
    forced = compile_plan(parse_spec(text.replace("memory:\n", "memory:\n  optimizer_chunk_mib: 512\n", 1)))
    assert beside.context.spec.sharing.update_beside_prefix is True
    assert beside.residency.optimizer.chunk_bytes == BESIDE_PREFIX_CHUNK
    assert joined.residency.optimizer.chunk_bytes == MAX_AUTO_CHUNK
    assert forced.residency.optimizer.chunk_bytes == 512 * 2**20  # the spec's choice still wins


def test_each_mini_batchs_gradients_exist_from_its_backward_to_its_update_only():
    """The update drops the gradients (`zero_grad`): the next mini-batch's prefix rerun and scoring run without
    them, and the plan does not count them there."""
    text = tiny_text().replace("schedule: rollplex", "schedule: serial") + "algorithm: {minibatches_per_step: 2}\n"
    plan = compile_plan(parse_spec(text), check=True)
    at = {name: s.index for s in steps(plan.graph) for name in s.ops}
    first, second = (
        (at["actor_backward@1"], at["actor_update@1"]),
        (at["actor_backward@2"], at["actor_update@2"]),
    )
    expected = set(range(first[0], first[1] + 1)) | set(range(second[0], second[1] + 1))
    between = set(range(first[1] + 1, second[0]))
    assert between, "mini-batch 2 reruns its prefix and scores before its backward"
    for grads in both_parts(plan, "actor", "FP32 gradients"):
        assert grads.live == expected


def test_a_capped_microbatch_holds_its_tokens_activations_so_that_no_recompute_fits_the_3b():
    """`memory.microbatch_tokens`: the split microbatch's activations are the cap's tokens' (a whole response at
    least, the rank's every response at most); without recompute the shipped 3B spec keeps its FP32 state in HBM
    at 4,096 tokens, and must stream part of it at a whole group."""
    from rollplex.graph.memobject import Component
    from rollplex.layout import shapes as S

    text = (SPECS / "qwen2_5_vl_3b_h200.yaml").read_text()
    shipped = compile_plan(parse_spec(text))
    assert shipped.context.gpu.microbatch_tokens == 8 * 2048
    capped = text.replace("  recompute: full\n", "  recompute: none\n  microbatch_tokens: 4096\n")
    plan = compile_plan(parse_spec(capped))
    gpu, t = plan.context.gpu, plan.loaded.model.text
    assert gpu.microbatch_tokens == 4096 and plan.decisions.recompute is Recompute.NONE
    (act,) = [o for o in plan.residency.objects if o.role == "actor" and o.component is Component.ACTIVATIONS]
    per_token = t.num_hidden_layers * S.layer_activation_bytes_per_token(t, 1) + S.output_activation_bytes_per_token(
        t, 1
    )
    assert act.bytes == 4096 * per_token + S.head_chunk_bytes(t, 1, 4096) and plan.residency.fits
    whole = compile_plan(parse_spec(text.replace("  recompute: full\n", "  recompute: none\n")))

    def streamed(p) -> int:
        state = (Component.MASTER, Component.MOMENTS)
        return sum(o.host_bytes for o in p.residency.objects if o.role == "actor" and o.component in state)

    assert streamed(plan) == 0 < streamed(whole)
    assert compile_plan(parse_spec(capped.replace("4096", "1000"))).context.gpu.microbatch_tokens == 2048
    wider = compile_plan(
        parse_spec(text.replace("  recompute: full\n", "  recompute: full\n  microbatch_tokens: 32768\n"))
    )
    (act,) = [o for o in wider.residency.objects if o.role == "actor" and o.component is Component.ACTIVATIONS]
    (whole_act,) = [o for o in shipped.residency.objects if o.role == "actor" and o.component is Component.ACTIVATIONS]
    assert wider.context.gpu.microbatch_tokens == 32768 and act.bytes > whole_act.bytes and wider.residency.fits
    everything = compile_plan(parse_spec(capped.replace("4096", str(1 << 20)))).context.gpu
    assert everything.microbatch_tokens == 8 * 8 * 2048  # the rank's every response at most


def test_a_selective_microbatch_holds_each_layers_input_and_attention_tensors_and_every_layers_suffix_keys():
    """Selective recompute keeps per token and layer the layer's input and what the attention saves (its q and
    output, their log-sum-exp; the split suffix's k and v are among the keys it attends), and every layer's keys;
    full recompute keeps the input alone and one layer's keys at a time."""
    from rollplex.graph.memobject import Component
    from rollplex.layout import shapes as S

    text = (SPECS / "qwen2_5_vl_3b_h200.yaml").read_text()
    full, selective = (
        compile_plan(parse_spec(text.replace("  recompute: full\n", f"  recompute: {how}\n")))
        for how in ("full", "selective")
    )

    def held(plan, component) -> int:
        (o,) = [o for o in plan.residency.objects if o.role == "actor" and o.component is component]
        return o.bytes

    t, tokens = full.loaded.model.text, full.context.gpu.microbatch_tokens
    attention = S.attention_saved_bytes_per_token(t, 1, keys=False)
    assert attention == 2 * t.num_attention_heads * t.head_dim * 2 + t.num_attention_heads * 4
    more = held(selective, Component.ACTIVATIONS) - held(full, Component.ACTIVATIONS)
    assert more == tokens * t.num_hidden_layers * attention
    keys = held(selective, Component.SUFFIX_ATTENTION)
    assert keys == held(full, Component.SUFFIX_ATTENTION) * t.num_hidden_layers // 2
    assert selective.decisions.recompute is Recompute.SELECTIVE and selective.residency.fits


def test_under_recompute_the_idle_hbm_of_the_microbatchs_steps_keeps_the_last_decoder_layers_whole():
    """`memory.layers_kept: auto`: after every other object, the layers each of the activations' steps has room for
    within SPEND_LIMIT of the card, one `kept_layer_bytes` each; a number is taken as it is."""
    from rollplex.graph.memobject import Component
    from rollplex.graph.objects import kept_layer_bytes, suffix_keys_per_layer
    from rollplex.graph.residency import SPEND_LIMIT
    from rollplex.layout import shapes as S

    text = (SPECS / "qwen2_5_vl_3b_h200.yaml").read_text()
    plan = compile_plan(parse_spec(text))
    r, d = plan.residency, plan.decisions
    (kept,) = [o for o in r.objects if o.component is Component.LAYERS_KEPT]
    per_layer = kept_layer_bytes(plan.context, Role.ACTOR)
    assert d.layers_kept == r.layers_kept > 0 and kept.bytes == d.layers_kept * per_layer
    (activations,) = [o for o in r.objects if o.role == "actor" and o.component is Component.ACTIVATIONS]
    assert kept.live == activations.live
    busiest = max(r.step_bytes[s] for s in kept.live)
    assert busiest <= SPEND_LIMIT * r.capacity_bytes < busiest + per_layer  # one layer more would not fit
    # room the plan would leave idle, not what it needs: the peak without them. They are held in the microbatch's
    # turn of the backward step, so they fill the room the backward through the prefix holds in its turn first
    unkept = compile_plan(parse_spec(text.replace("memory:\n", "memory:\n  layers_kept: 0\n"))).residency
    assert r.need_bytes == unkept.peak_bytes == r.peak_bytes - r.spent_layers_bytes
    (layer,) = [o for o in r.objects if o.component is Component.PREFIX_LAYER and o.role == "actor"]
    turn = activations.bytes + kept.bytes + sum(o.bytes for o in r.objects if o.component is Component.SUFFIX_ATTENTION)
    assert r.spent_layers_bytes == turn - layer.bytes < kept.bytes
    forced = compile_plan(parse_spec(text.replace("memory:\n", "memory:\n  layers_kept: 36\n")))
    d = forced.decisions  # a number is held as the activations are: the saved tensors and the state make room
    assert d.layers_kept == 36 and forced.residency.fits and Residency.HOST == d.prefix_saved == d.optimizer_state
    assert forced.residency.need_bytes == forced.residency.peak_bytes - forced.residency.state_share_bytes
    selective = compile_plan(parse_spec(text.replace("recompute: full", "recompute: selective")))
    t, tokens = plan.loaded.model.text, plan.context.gpu.microbatch_tokens
    attention = tokens * S.attention_saved_bytes_per_token(t, 1, keys=False)  # kept by selective anyway
    keys = suffix_keys_per_layer(plan.context)  # held by a kept layer under full recompute, by all under selective
    assert per_layer - kept_layer_bytes(selective.context, Role.ACTOR) == attention + keys
    none = compile_plan(parse_spec(text.replace("recompute: full", "recompute: none")))
    assert none.decisions.layers_kept == 0 and kept_layer_bytes(none.context, Role.ACTOR) == 0


def test_a_step_holds_of_a_roles_turns_only_the_largest_and_of_two_roles_both():
    from rollplex.graph.ir import TensorClass
    from rollplex.graph.memobject import Component, MemObject, held, held_bytes

    def obj(role: str, size: int, turn: str = "", live: frozenset[int] = frozenset({0, 1})) -> MemObject:
        return MemObject(role, Component.DATA, TensorClass.PHASE_LOCAL, size, live, Residency.ABSENT, turn=turn)

    shared, suffix, keys, prefix = (
        obj("actor", 5),
        obj("actor", 3, "suffix"),
        obj("actor", 2, "suffix"),
        obj("actor", 4, "prefix"),
    )
    critic = obj("critic", 7, "prefix")
    later = obj("actor", 9, "prefix", frozenset({1}))
    objects = [shared, suffix, keys, prefix, critic, later]
    assert held(objects, 0) == [shared, suffix, keys, critic]  # the actor's suffix turn (5) over its prefix turn (4)
    assert held_bytes(objects, 0) == 5 + 5 + 7  # a critic's turn is its own: it adds
    assert held(objects, 1) == [shared, prefix, critic, later] and held_bytes(objects, 1) == 5 + 13 + 7


def test_the_split_backward_step_holds_the_larger_of_the_microbatch_and_the_prefix_layer_in_flight():
    """The suffix's microbatches are freed before the backward through the prefix rematerializes its first layer:
    the backward step's peak is what both turns share plus the larger turn, not their sum."""
    from rollplex.graph.ir import NodeKind, op
    from rollplex.graph.memobject import PREFIX_TURN, SUFFIX_TURN, Component

    text = (SPECS / "qwen2_5_vl_3b_h200.yaml").read_text().replace("memory:\n", "memory:\n  layers_kept: 0\n")
    plan = compile_plan(parse_spec(text))
    r = plan.residency
    (backward,) = [
        s.index for s in steps(plan.graph) if any(op(plan.graph, n).kind is NodeKind.BACKWARD for n in s.ops)
    ]
    live = [o for o in r.objects if backward in o.live]
    turns = {t: sum(o.bytes for o in live if o.turn == t) for t in (SUFFIX_TURN, PREFIX_TURN)}
    assert {o.component for o in live if o.turn == SUFFIX_TURN} == {Component.ACTIVATIONS, Component.SUFFIX_ATTENTION}
    assert {o.component for o in live if o.turn == PREFIX_TURN} == {Component.PREFIX_LAYER}
    shared = sum(o.bytes for o in live if not o.turn)
    assert r.step_bytes[backward] == shared + max(turns.values()) < shared + sum(turns.values())
    unsplit = compile_plan(parse_spec(text), Schedule.UNSPLIT).residency
    assert not any(o.turn for o in unsplit.objects)  # a backward over whole sequences: nothing takes turns
