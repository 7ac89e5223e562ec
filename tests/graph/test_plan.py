"""The per-GPU plan: the paper's Table 1 from its spec, feasibility on one H200, and plan properties."""

import re
from pathlib import Path

import pytest

from rollplex.graph.decisions import PrefixActivations, Recompute
from rollplex.graph.ir import Phase, Schedule, steps
from rollplex.graph.load import load_spec, parse_spec
from rollplex.graph.memobject import GIB, Residency
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
sharing: {{update_beside_prefix: false}}
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
    kept = "memory: {recompute: %s, prefix_activations: offload}\n"  # forced: auto would try the levers itself
    plan = compile_plan(parse_spec(text + kept % "none"))
    priced = price_levers(plan.loaded, plan.schedule, plan.residency.peak_bytes)
    assert priced[0].fits and "set memory.recompute: full" in priced[0].lever.text  # a chain that fits comes first
    single = next(p for p in priced if p.lever.text == "set memory.recompute: full")
    by_hand = compile_plan(parse_spec(text + kept % "full"))
    assert single.need_bytes == by_hand.residency.need_bytes and not single.fits
    chain = r"to fit: raise parallel\.train_tp to 4, then set memory\.recompute: full"
    chain += r"(, then [^;(]+)? \(needs [0-9.]+ GiB, fits\)"
    with pytest.raises(PlanDoesNotFit, match=chain):
        check_fits(plan)
    alone = compile_plan(parse_spec(text.replace("gpus_per_node: 4", "gpus_per_node: 1") + kept % "none"))
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


def test_auto_recompute_keeps_what_autograd_saves_where_that_fits_and_reruns_elsewhere():
    small = compile_plan(load_spec(SPECS / "tiny_cpu.yaml"))  # neither setting named: auto
    assert (small.loaded.spec.memory.recompute, small.loaded.spec.memory.prefix_activations) == ("none", "offload")
    d = small.decisions
    assert d.prefix_activations is PrefixActivations.OFFLOAD and d.recompute is Recompute.NONE
    text = "\n".join(
        line
        for line in (SPECS / "qwen2_5_vl_3b_h200.yaml").read_text().splitlines()
        if not line.startswith(("  recompute:", "  prefix_activations:"))
    )
    big = compile_plan(parse_spec(text))
    # every tensor of the prefix would need ~400 GiB of pinned host: it reruns; the microbatch's activations, whole,
    # fit in their turn of the backward step (the backward through the prefix holds its layer in the other) with the
    # prefix's saved tensors and part of the FP32 state on the host, and beat rerunning by the step bound
    assert (big.loaded.spec.memory.prefix_activations, big.loaded.spec.memory.recompute) == ("recompute", "none")
    assert big.decisions.recompute is Recompute.NONE and big.residency.layers_kept == 0
    # on a smaller card, whole or with each attention's, they fit only by sending more of the FP32 state to the host:
    # a tie at the step bound, settled by the host link's bytes
    tight = compile_plan(parse_spec(text.replace("hbm_gib: 139", "hbm_gib: 125")))
    assert tight.loaded.spec.memory.recompute == "full"
    tie = r"memory\.recompute auto: full \(step bound [0-9.]+ s against [0-9.]+, a tie: [0-9.]+ GB .* with selective\)"
    assert re.search(tie, tight.chosen)


def test_auto_recompute_takes_selective_where_it_beats_keeping_everything_and_full_does_not_beat_it():
    from rollplex.graph.timeplan import step_bound_s, time_plan

    lines = (SPECS / "qwen2_5_vl_3b_h200.yaml").read_text().replace("hbm_gib: 139", "hbm_gib: 120").splitlines()
    text = "\n".join(line for line in lines if not line.startswith("  recompute:"))
    plan = compile_plan(parse_spec(text))
    assert plan.loaded.spec.memory.recompute == "selective" and plan.decisions.recompute is Recompute.SELECTIVE
    assert re.search(
        r"memory\.recompute auto: selective \(step bound [0-9.]+ s against [0-9.]+ with none\)", plan.chosen
    )
    bounds = {}
    for how in ("selective", "full"):
        named = compile_plan(parse_spec(text.replace("memory:\n", f"memory:\n  recompute: {how}\n")))
        bounds[how] = step_bound_s(named, time_plan(named))
    assert bounds["selective"] <= bounds["full"]


def test_the_lowering_takes_only_settled_recompute_settings_and_changes_keep_the_users_defaults_unset():
    from rollplex.graph.levers import with_changes
    from rollplex.graph.pipeline import compile_graph
    from rollplex.graph.plan import plan_of

    loaded = load_spec(SPECS / "tiny_cpu.yaml")
    with pytest.raises(AssertionError, match=r"memory\.prefix_activations auto reached the lowering"):
        plan_of(loaded, Schedule.ROLLPLEX, compile_graph(loaded.spec))
    changed = with_changes(loaded, {"memory": {"recompute": "full"}})
    assert changed.spec.memory.recompute == "full" and "gpu" not in changed.spec.cluster.model_fields_set


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_an_unsplit_plan_keeps_the_vision_towers_saved_tensors_for_every_sequence_of_the_group(recompute):
    """Unsplit, each of a group's sequences runs the vision tower over its prompt's patches (`hidden` over prompt
    ++ response), and the microbatch's backward needs each run's saved tensors: group_size x patches x blocks
    (under recompute, selective or full, each block's input and one block's whole)."""
    from rollplex.layout.shapes import BF16, vision_activation_bytes_per_patch

    text = (SPECS / "qwen2_5_vl_3b_h200.yaml").read_text().replace("recompute: full", f"recompute: {recompute}")
    plan = compile_plan(parse_spec(text), Schedule.UNSPLIT)
    v, g = plan.context.model.vision, plan.context.gpu
    [kept] = [
        o for o in plan.residency.objects if o.role == "actor" and o.component.value.startswith("activ") and o.vision
    ]
    per_block = vision_activation_bytes_per_patch(v, 1)
    per_patch = v.depth * v.hidden_size * BF16 + per_block if recompute != "none" else v.depth * per_block
    assert kept.bytes == g.group_size * g.patches_per_prompt * per_patch > 0
    assert kept.live == next(o for o in plan.residency.objects if o.role == "actor" and o.label == kept.label
                             and not o.vision).live  # fmt: skip
    frozen = compile_plan(
        parse_spec(text.replace("model: qwen2_5_vl_3b\n", "model: {name: qwen2_5_vl_3b, freeze_vision: true}\n")),
        Schedule.UNSPLIT,
    )
    assert not [o for o in frozen.residency.objects if o.component.value.startswith("activ") and o.vision]
