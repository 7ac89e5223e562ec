"""The per-GPU plan: the paper's Table 1 from its spec, feasibility on one H200, and plan properties."""

from pathlib import Path

import pytest

from rollplex.graph.ir import Phase, Schedule, steps
from rollplex.graph.load import load_spec, parse_spec
from rollplex.graph.objects import GIB, Residency
from rollplex.graph.plan import compile_plan

SPECS = Path(__file__).resolve().parents[2] / "specs"
GB = 1e9

# Paper Table 1 (Qwen2.5-VL-32B, train TP 8, rollout TP 4), GiB per GPU
TABLE_1 = {
    ("actor", "weights (BF16)"): 7.6,
    ("actor", "FP32 gradients"): 15.1,
    ("actor", "FP32 master weights"): 15.1,
    ("actor", "Adam moments (FP32)"): 30.3,
    ("actor", "activations (one microbatch)"): 28.3,
    ("reference", "weights (BF16)"): 7.6,
    ("rollout", "weights (BF16)"): 15.1,
    ("rollout", "KV cache"): 29.0,
}


@pytest.fixture(scope="module")
def paper_plan():
    return compile_plan(load_spec(SPECS / "qwen2_5_vl_32b_h800.yaml"), check=True)


def llm_rows(plan):
    return {(r.role, r.component): r.bytes / GIB for r in plan.naive if not r.vision}


def test_naive_footprint_reproduces_each_row_of_the_papers_table_1(paper_plan):
    rows = llm_rows(paper_plan)
    for key, paper in TABLE_1.items():
        assert rows[key] == pytest.approx(paper, rel=0.05), key
    preserved = rows[("actor", "boundary KV")] + rows[("reference", "boundary KV")]
    assert preserved == pytest.approx(16.0, rel=0.05)
    assert 2 <= rows[("runtime", "runtime reserve")] <= 4


def test_naive_total_is_within_3_percent_of_165_gib_and_cannot_fit(paper_plan):
    total = sum(llm_rows(paper_plan).values())
    assert total == pytest.approx(165, rel=0.03)
    assert total > 80 * GB / GIB


def test_the_rollplex_plan_of_the_paper_setup_peaks_below_80_gb_in_every_phase(paper_plan):
    assert [p.phase for p in paper_plan.residency.phases] == list(Phase)
    for p in paper_plan.residency.phases:
        assert p.peak_bytes < 80 * GB, p.phase
    assert paper_plan.residency.fits


def test_7b_on_one_h200_does_not_fit_naively_but_the_plan_does():
    plan = compile_plan(load_spec(SPECS / "qwen2_5_vl_7b_h200.yaml"), check=True)
    naive = sum(r.bytes for r in plan.naive)
    assert naive > plan.residency.capacity_bytes
    assert plan.residency.fits


def test_every_shipped_spec_compiles_and_its_peaks_are_sums_of_live_objects():
    for path in sorted(SPECS.glob("*.yaml")):
        for schedule in Schedule.SERIAL, Schedule.ROLLPLEX:
            plan = compile_plan(load_spec(path), schedule, check=True)
            r = plan.residency
            for s in steps(plan.graph):
                assert r.step_bytes[s.index] == sum(o.bytes for o in r.in_hbm(s.index))
            assert r.peak_bytes == max(p.peak_bytes for p in r.phases)


def test_the_optimizer_streams_all_fp32_state_through_what_the_update_leaves_free(paper_plan):
    r = paper_plan.residency
    opt = r.optimizer
    assert opt.num_chunks * opt.chunk_bytes >= opt.state_bytes > (opt.num_chunks - 1) * opt.chunk_bytes
    update = next(p for p in r.phases if p.phase is Phase.UPDATE)
    assert update.peak_bytes <= r.capacity_bytes
    resident_rest = update.peak_bytes - opt.workspace_bytes
    assert resident_rest + opt.state_bytes > r.capacity_bytes  # unchunked, the update could not fit


def tiny(extra: str = "", schedule: str = "rollplex", qkv_sharing: str = "in_place"):
    return compile_plan(parse_spec(tiny_text(extra, schedule, qkv_sharing)), check=True)


def tiny_text(extra: str = "", schedule: str = "rollplex", qkv_sharing: str = "in_place") -> str:
    return f"""
model: qwen2_5_vl_7b
cluster: {{hbm_gib: 139, host_gib: 1000}}
parallel: {{qkv_sharing: {qkv_sharing}}}
workload: {{prompts_per_step: 8, group_size: 8, prompt_tokens: 6144, response_tokens: 2048, visual_tokens: 5600}}
memory: {{recompute: full, prefix_activations: recompute{extra}}}
schedule: {schedule}
"""


def objects(plan, role, component):
    return [o for o in plan.residency.objects if o.role == role and o.component == component and not o.vision]


def both_parts(plan, role, component):
    """The decoder's and the vision encoder's object of a component."""
    found = [o for o in plan.residency.objects if o.role == role and o.component == component]
    assert sorted(o.vision for o in found) == [False, True]
    return found


def test_rollout_kv_lives_only_while_decoding_and_boundaries_bridge_phase_1_to_2():
    plan = tiny()
    decode = {s.index for s in steps(plan.graph) if "rollout" in s.ops}
    (kv,) = objects(plan, "rollout", "KV cache")
    assert kv.live == decode
    for role in ("actor", "reference"):
        (b,) = objects(plan, role, "boundary KV")
        phases = {steps(plan.graph)[i].phase for i in b.live}
        assert phases == {Phase.ROLLOUT, Phase.TRAIN}


def test_the_actors_boundary_kv_gradient_is_counted_while_its_backward_runs_and_not_in_the_naive_table():
    plan = tiny()
    (kv,) = objects(plan, "actor", "boundary KV")
    (grad,) = objects(plan, "actor", "boundary KV gradient")
    backward = {s.index for s in steps(plan.graph) if "actor_backward" in s.ops}
    assert grad.bytes == kv.bytes > 0 and grad.live == backward
    assert not objects(plan, "reference", "boundary KV gradient")  # frozen: no gradient reaches its boundary
    assert not [r for r in plan.naive if r.component == "boundary KV gradient"]


def test_serial_frees_rollout_kv_before_the_prefixes_run():
    plan = tiny(schedule="serial")
    (kv,) = objects(plan, "rollout", "KV cache")
    (ref,) = objects(plan, "reference", "boundary KV")
    assert not kv.live & ref.live


def test_without_weight_sharing_rollout_holds_its_own_copy_and_no_case3_buffer():
    shared, separate = tiny(qkv_sharing="copy"), tiny(", weight_sharing: false")
    assert objects(shared, "rollout", "Case-3 buffer") and not objects(shared, "rollout", "weights (BF16)")
    in_place = tiny()
    assert not objects(in_place, "rollout", "Case-3 buffer") and not objects(in_place, "rollout", "weights (BF16)")
    assert objects(separate, "rollout", "weights (BF16)") and not objects(separate, "rollout", "Case-3 buffer")
    assert separate.residency.phases[0].peak_bytes > shared.residency.phases[0].peak_bytes


def test_recompute_shrinks_the_training_microbatch():
    text = (SPECS / "qwen2_5_vl_7b_h200.yaml").read_text().replace("recompute: full", "recompute: none")
    full = compile_plan(parse_spec(text))
    re = compile_plan(load_spec(SPECS / "qwen2_5_vl_7b_h200.yaml"))
    (a,), (b,) = (
        objects(full, "actor", "activations (one microbatch)"),
        objects(re, "actor", "activations (one microbatch)"),
    )
    assert b.bytes < a.bytes / 4


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


@pytest.mark.parametrize(("split", "expected"), [("true", 4), ("false", 8)])
def test_rollout_replicas_decode_their_share_of_the_prompts_unless_told_not_to(split, expected):
    from rollplex.graph.workload import per_gpu

    text = f"""
model: qwen2_5_vl_7b
cluster: {{gpus_per_node: 4, hbm_gib: 139, host_gib: 1000}}
parallel: {{train_tp: 4, rollout_tp: 2, split_rollout: {split}}}
workload: {{prompts_per_step: 8, group_size: 8, prompt_tokens: 6144, response_tokens: 2048, visual_tokens: 5600}}
"""
    loaded = parse_spec(text)
    assert per_gpu(loaded.spec, loaded.model).prompts_per_replica == expected  # 2 replicas of TP 2 on 4 GPUs


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
    from rollplex.graph.cost import update
    from rollplex.graph.residency import SPEND_LIMIT, STATE_SHARE_GRANULE

    text = (SPECS / "qwen2_5_vl_7b_h200.yaml").read_text().replace("memory:\n", "memory:\n  prefix_saved: hbm\n")
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
    text = (SPECS / "qwen2_5_vl_7b_h200.yaml").read_text()
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

    text = (SPECS / "qwen2_5_vl_7b_h200.yaml").read_text()
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

    text = (SPECS / "qwen2_5_vl_7b_h200.yaml").read_text()
    seven = compile_plan(parse_spec(text.replace("memory:\n", "memory:\n  prefix_saved: hbm\n")))
    (faster,) = faster_residencies(seven)
    assert faster.lever.changes == {"memory": {"prefix_saved": "host"}} and faster.predicted_s is None
    bound, _ = step_seconds(seven)
    assert faster.bound_s < bound - 0.3  # the update's exposed host traffic falls by about 28 GB each way
    three = compile_plan(load_spec(SPECS / "qwen2_5_vl_3b_h200.yaml"))  # all in HBM: the host is never faster
    assert faster_residencies(three) == []
    assert faster_residencies(compile_plan(parse_spec(text))) == []  # auto took the faster placement itself


def test_a_critics_state_streams_whole_while_the_actors_share_stays_in_hbm():
    from rollplex.graph.cost import op_cost, planned_tokens
    from rollplex.graph.ir import NodeKind, ops

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


def test_a_frozen_vision_tower_is_held_once_with_no_gradients_optimizer_state_or_saved_tensors():
    trained, frozen = tiny(), compile_plan(parse_spec(
        tiny_text().replace("model: qwen2_5_vl_7b", "model: {name: qwen2_5_vl_7b, freeze_vision: true}")))  # fmt: skip
    assert frozen.decisions.freeze_vision and not trained.decisions.freeze_vision

    def vision(plan, role, component):
        return [o for o in plan.residency.objects if o.role == role and o.component == component and o.vision]

    for component in ("FP32 gradients", "FP32 master weights", "Adam moments (FP32)", "prefix saved tensors"):
        assert vision(trained, "actor", component) and not vision(frozen, "actor", component), component
    assert vision(frozen, "actor", "weights (BF16)") and not vision(frozen, "reference", "weights (BF16)")
    assert objects(frozen, "actor", "shared vision output") and not objects(trained, "actor", "shared vision output")
    assert [o.bytes for o in objects(frozen, "actor", "shared vision output")] == [8 * 5600 * 3584 * 2]
    assert frozen.residency.need_bytes < trained.residency.need_bytes


def test_an_infeasible_plan_names_levers_this_spec_has_each_with_the_peak_it_gives():
    from rollplex.errors import PlanDoesNotFit
    from rollplex.graph.levers import price_levers
    from rollplex.graph.plan import check_fits

    text = """
model: qwen2_5_vl_7b
cluster: {gpus_per_node: 4, hbm_gib: 40, host_gib: 1000}
workload: {prompts_per_step: 8, group_size: 8, prompt_tokens: 6144, response_tokens: 2048, visual_tokens: 5600}
"""
    plan = compile_plan(parse_spec(text))
    priced = price_levers(plan.loaded, plan.schedule, plan.residency.peak_bytes)
    assert priced[0].fits and "set memory.recompute: full" in priced[0].lever.text  # a chain that fits comes first
    single = next(p for p in priced if p.lever.text == "set memory.recompute: full")
    by_hand = compile_plan(parse_spec(text + "memory: {recompute: full}\n"))
    assert single.need_bytes == by_hand.residency.need_bytes and not single.fits
    chain = r"to fit: raise parallel\.train_tp to 4, then set memory\.recompute: full"
    chain += r"(, then [^;(]+)? \(needs [0-9.]+ GiB, fits\)"
    with pytest.raises(PlanDoesNotFit, match=chain):
        check_fits(plan)
    alone = compile_plan(parse_spec(text.replace("gpus_per_node: 4", "gpus_per_node: 1")))
    texts = [p.lever.text for p in price_levers(alone.loaded, alone.schedule, alone.residency.peak_bytes)]
    assert texts and not any("train_tp" in t or "distributed_optimizer" in t for t in texts)  # one GPU: none


TINY = """\
model: tiny
cluster: {nodes: 1, gpus_per_node: 1, hbm_gib: 16, host_gib: 8}
workload: {prompts_per_step: 2, group_size: 4, prompt_tokens: 96, response_tokens: 16, visual_tokens: 8}
"""


@pytest.mark.parametrize(
    ("extra", "missing"),
    [
        ("", None),
        ("cluster: {nodes: 1, gpus_per_node: 2, hbm_gib: 16, host_gib: 8}\n", "one GPU"),
        ("algorithm: {minibatches_per_step: 2}\n", "algorithm.minibatches_per_step 1"),
        ("memory: {weight_sharing: false}\n", "memory.weight_sharing true"),
        ("sharing: {policy: mps}\n", "a sharing.policy other than mps"),
    ],
)
def test_auto_prefill_takes_the_actor_prefix_where_the_spec_allows_it_and_the_engines_elsewhere(extra, missing):
    from rollplex.graph.ir import op
    from rollplex.graph.pipeline import compile_graph

    text = (
        TINY.replace("cluster: {nodes: 1, gpus_per_node: 1, hbm_gib: 16, host_gib: 8}\n", "")
        if "cluster" in extra
        else TINY
    )
    spec = parse_spec(text + extra).spec
    assert spec.run.rollout_prefill == "auto"
    assert spec.prefills_from_actor is (missing is None)
    assert [m.startswith(missing) for m in spec.actor_prefill_missing()[:1]] == ([] if missing is None else [True])
    rollout = op(compile_graph(spec, schedule=Schedule.SERIAL), "rollout")
    assert ("actor_score.boundary" in rollout.inputs) is (missing is None)
    explicit = parse_spec(text + extra + "run: {rollout_prefill: rollout}\n").spec
    assert not explicit.prefills_from_actor  # rollout: the engine prefills whatever the spec allows


def test_the_dataset_prompts_wait_on_the_host_for_two_steps_the_one_training_and_the_one_made_ahead():
    plan = compile_plan(load_spec(SPECS / "qwen2_5_vl_3b_h200.yaml"), Schedule.ROLLPLEX)
    (prompts,) = [o for o in plan.residency.objects if o.role == "data" and o.name == "prompts"]
    vision, g = plan.loaded.model.vision, plan.context.gpu
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2 * 4  # float32
    one_step = g.prompts_per_rank * (g.patches_per_prompt * patch + g.prompt_tokens * 8)
    assert prompts.outside is Residency.HOST and not prompts.live and prompts.host_bytes == 2 * one_step
