"""The cost model against torch's own FLOP count of our model's matmuls, the attention terms counted by hand,
and the bound's rules (the slowest of compute, HBM and host link; parts one after another)."""

import re
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from rollplex.data.source import batch_at, open_dataset
from rollplex.data.tokenizer import CharTokenizer
from rollplex.executors.bounds import step_tokens
from rollplex.graph import cost, timeplan
from rollplex.graph.cost import Cost, DevicePeaks, StepTokens, decode, prefix_forward, suffix_forward
from rollplex.graph.load import parse_spec
from rollplex.graph.memobject import Component, Residency
from rollplex.graph.plan import compile_plan
from rollplex.models.config import load_model_config
from rollplex.models.model import Qwen2_5_VL

SPECS = Path(__file__).resolve().parents[2] / "specs"
PEAKS = DevicePeaks("test", flops=1e12, hbm_bytes_s=1e9, host_bytes_s=1e8)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = load_model_config("tiny")
    examples = batch_at(open_dataset("synthetic:clevrer@tiny", CharTokenizer(), 0), 0, 3)
    return config, Qwen2_5_VL(config), examples


def counted(fn) -> int:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def counted_linears(fn) -> int:
    """FLOPs of the decoder's projections and the LM head alone (the suffix's attention runs partly as matmuls)."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn()
    counts = counter.get_flop_counts()
    linears = [k for k in counts if re.search(r"layers\.\d+\.(self_attn|mlp)\.\w+_proj$", k)] + ["Linear"]
    return sum(sum(counts[k].values()) for k in linears if k in counts)


def without_attention(monkeypatch):
    """torch's counter leaves out scaled_dot_product_attention on the CPU: compare the matmuls alone."""
    monkeypatch.setattr(cost, "_attention_flops", lambda *a, **k: 0.0)
    monkeypatch.setattr(cost, "vision_forward", _vision_matmuls)


_vision_forward = cost.vision_forward


def _vision_matmuls(v, patches, frames, tp):
    return _vision_forward(v, patches, frames, tp) - 4 * v.hidden_size * patches * (
        len(v.fullatt_block_indexes) * patches / frames
        + (v.depth - len(v.fullatt_block_indexes)) * min((v.window_size // v.patch_size) ** 2, patches / frames)
    )


def test_the_prefix_and_suffix_matmuls_are_the_flops_torch_counts_in_our_model(tiny, monkeypatch):
    config, model, examples = tiny
    lens = torch.tensor([[7, 3], [5, 7], [1, 6]])
    responses = torch.randint(13, 100, (3, 2, 7), generator=torch.Generator().manual_seed(1))
    tokens = step_tokens(examples, lens)
    boundary = model.prefix([e.prompt for e in examples], attached=False)
    prefix = counted(lambda: model.prefix([examples[0].prompt], attached=False))  # one prompt: no padding
    one_row = counted_linears(lambda: model.suffix_rows(boundary, torch.tensor([0]), responses[0, :1], lens[0, :1]))
    without_attention(monkeypatch)
    single = StepTokens(tokens.prompt_tokens[:1], tokens.patches[:1], tokens.frames[:1], ((7,),))
    assert cost.prefix_forward(config.text, config.vision, single, 1).flops == pytest.approx(prefix, rel=1e-6)
    # the suffix's LM head scores token 0 from the boundary: its row of R-1 hidden states, plus the head on them
    suffix = cost.suffix_forward(config.text, single, 1).flops
    head_on_first = 2 * config.text.hidden_size * config.text.vocab_size
    assert suffix - cost._llm_flops(config.text, 1, 1) - head_on_first == pytest.approx(one_row, rel=1e-6)


def test_attention_is_four_widths_per_query_key_pair_and_layer_halved_when_causal():
    t = load_model_config("qwen2_5_vl_3b").text
    one = StepTokens((1000,), (0,), (1,), ((10,),))
    attention = prefix_forward(t, load_model_config("qwen2_5_vl_3b").vision, one, 1).flops - (
        cost._llm_flops(t, 1000, 1) + cost._head_flops(t, 1, 1)
    )
    assert attention == pytest.approx(4 * t.hidden_size * 1000 * 1000 / 2 * t.num_hidden_layers)
    s = suffix_forward(t, one, 1).flops - cost._llm_flops(t, 10, 1) - cost._head_flops(t, 10, 1)
    assert s == pytest.approx(4 * t.hidden_size * t.num_hidden_layers * (10 * 1000 + 10 * 10 / 2))


def test_tensor_parallelism_divides_each_ranks_work_and_decode_reads_each_live_kv_once_per_step():
    t, v = (lambda c: (c.text, c.vision))(load_model_config("qwen2_5_vl_7b"))
    tokens = StepTokens((4000, 4000), (0, 0), (1, 1), ((100, 300), (50, 50)))
    assert prefix_forward(t, v, tokens, 2).flops == pytest.approx(prefix_forward(t, v, tokens, 1).flops / 2)
    longer = StepTokens((4000, 4000), (0, 0), (1, 1), ((100, 301), (50, 50)))
    one_more = decode(t, longer, 1).hbm_bytes - decode(t, tokens, 1).hbm_bytes
    from rollplex.layout import shapes as S

    kv = S.kv_bytes_per_token(t, 1)
    assert one_more == pytest.approx(S.decode_params_per_rank(t, 1) * S.BF16 + kv * (301 + 4000))


@pytest.mark.parametrize("tied", [False, True])
def test_a_decode_step_reads_every_weight_but_the_rows_of_an_untied_embedding(tied):
    from dataclasses import replace

    from rollplex.layout import shapes as S

    config = load_model_config("tiny")
    config = replace(config, text=replace(config.text, tie_word_embeddings=tied))
    model = Qwen2_5_VL(config)
    read = {id(p): p.numel() for n, p in model.named_parameters() if not n.startswith("model.visual.")}
    if not tied:  # the step gathers one row of the input embedding a sequence
        del read[id(model.model.language_model.embed_tokens.weight)]
    assert S.decode_params_per_rank(config.text, 1) == sum(read.values())


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
    assert critic == cost.backward(True, t, v, tokens, 1, d, False, value=True)  # the fused scoring adds nothing
    assert critic.host_bytes == 0 < d.host_pool_bytes  # its prefix tensors stay in HBM while the actor's travel
    head = suffix_forward(t, tokens, 1).flops - suffix_forward(t, tokens, 1, value=True).flops
    assert head == pytest.approx(2 * t.hidden_size * (t.vocab_size - 1) * tokens.response_tokens)


def test_a_sharded_update_reads_and_streams_only_its_ranks_share():
    config = load_model_config("qwen2_5_vl_7b")
    plan = compile_plan(parse_spec((SPECS / "qwen2_5_vl_7b_h200.yaml").read_text()))
    d = plan.decisions
    whole = cost.update(config.text, config.vision, 1, d, keeps_share=False)
    quarter = cost.update(config.text, config.vision, 1, d, keeps_share=False, shards=4)
    assert quarter.hbm_bytes == pytest.approx(whole.hbm_bytes / 4, rel=1e-6)
    assert quarter.host_bytes == pytest.approx(whole.host_bytes / 4, rel=1e-6) and whole.host_bytes > 0


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


@pytest.mark.parametrize("rerun", [True, False])
def test_the_backward_through_the_prefix_is_about_the_flops_torch_counts_in_it(tiny, monkeypatch, rerun):
    """Twice the prefix's forward, and a rerun of it under recompute; torch counts a little less, as nothing
    needs the gradient of the pixels or of the token embeddings' input."""
    from types import SimpleNamespace

    from rollplex.graph.decisions import PrefixActivations
    from rollplex.graph.memobject import Residency
    from rollplex.models.chunks import drain
    from rollplex.models.rerun import Rerun

    config, model, examples = tiny
    prompts = [examples[0].prompt]  # one prompt: no padding

    def forward_and_backward():
        b = drain(model.prefix_chunks(prompts, attached=True, rerun=Rerun() if rerun else None))
        kv = sum(k.float().sum() + v.float().sum() for k, v in zip(b.keys, b.values, strict=True))
        (kv + b.first_logprobs.sum()).backward()  # a loss on every boundary output, as the suffix's reaches them

    with FlopCounterMode(display=False) as counter:
        forward_and_backward()
    measured = counter.get_total_flops() - counted(lambda: model.prefix(prompts, attached=False))
    without_attention(monkeypatch)
    tokens = step_tokens(examples[:1], torch.tensor([[7]]))
    how = PrefixActivations.RECOMPUTE if rerun else PrefixActivations.OFFLOAD
    d = SimpleNamespace(prefix_activations=how, freeze_vision=False, prefix_saved=Residency.HBM)
    modelled = cost.prefix_backward(config.text, config.vision, tokens, 1, d).flops
    assert modelled == (3 if rerun else 2) * cost.prefix_forward(config.text, config.vision, tokens, 1).flops
    assert measured == pytest.approx(modelled, rel=0.06)


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
    whole = cost.backward(True, t, v, tokens, 1, d, sp)
    prefix = cost.prefix_backward(t, v, tokens, 1, d, sp)
    assert cost.op_cost(second, model, gpu, d, tokens, True) == whole.scaled(0.5)
    assert cost.op_cost(first, model, gpu, d, tokens, True) == whole.scaled(0.5)
    peaks = cost.KNOWN_PEAKS["H200"]
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
    assert cost.total(costs["actor_suffix_backward"]) == cost.backward(False, t, v, tokens, 1, d, sp)
    assert cost.total(costs["critic_suffix_backward"]) == cost.total(split_costs["critic_suffix_backward"])
    assert timeplan.prefix_backward_plan(plan) is None


@pytest.mark.parametrize("split", [True, False])
def test_selective_recompute_reruns_the_scoring_forward_but_its_decoders_attention(split):
    from types import SimpleNamespace

    from rollplex.graph.decisions import PrefixActivations, Recompute

    t, v = (lambda c: (c.text, c.vision))(load_model_config("qwen2_5_vl_3b"))
    tokens = StepTokens((5000, 3000), (9000, 4000), (20, 10), ((100, 2000, 7), (50, 600)))

    def priced(how: Recompute) -> float:
        d = SimpleNamespace(
            recompute=how, prefix_activations=PrefixActivations.RECOMPUTE, freeze_vision=False, prefix_saved=None,
            layers_kept=0,
        )  # fmt: skip
        return cost.backward(split, t, v, tokens, 1, d).flops

    scoring = (suffix_forward(t, tokens, 1) if split else cost.whole_forward(t, v, tokens, 1)).flops
    attention = (cost.suffix_attention_flops if split else cost.whole_attention_flops)(t, tokens, 1)
    none, selective, full = (priced(how) for how in (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL))
    head = sum(cost._head_flops(t, sum(lens), 1) for lens in tokens.response_lens)  # no recompute checkpoints it
    assert full - none == pytest.approx(scoring - head, rel=1e-9)
    assert full - selective == pytest.approx(attention, rel=1e-9) and 0 < attention < scoring / 2
    # the actor's last 9 of 36 decoder layers kept whole rerun nothing; unsplit, the vision tower still reruns
    d = SimpleNamespace(recompute=Recompute.FULL, prefix_activations=PrefixActivations.RECOMPUTE,
                        freeze_vision=False, prefix_saved=None, layers_kept=9)  # fmt: skip
    vision = 0.0 if split else cost.whole_vision_flops(v, tokens)
    kept = cost.backward(split, t, v, tokens, 1, d).flops
    assert full - kept == pytest.approx((scoring - vision - head) * 9 / t.num_hidden_layers, rel=1e-9)
    critic = cost.backward(split, t, v, tokens, 1, d, value=True)  # a critic's layers all rerun
    assert critic == cost.backward(split, t, v, tokens, 1, SimpleNamespace(**{**vars(d), "layers_kept": 0}), value=True)


def test_selective_recompute_reruns_every_matmul_full_recompute_does(tiny):
    """torch's CPU counter sees the matmuls, not the attention: a selective layer's halves rerun all of them."""
    from rollplex.memory.offload import recompute_methods

    _, model, examples = tiny
    lens = torch.tensor([[7, 3], [5, 7], [1, 6]])
    responses = torch.randint(13, 100, (3, 2, 7), generator=torch.Generator().manual_seed(1))
    boundary = model.prefix([e.prompt for e in examples], attached=False)

    def flops(*halves: str) -> int:
        units = [(layer, h) for layer in model.model.language_model.layers for h in halves]
        with recompute_methods(units), FlopCounterMode(display=False) as counter:
            model.suffix(boundary, responses, lens).logprobs.sum().backward()
        model.zero_grad(set_to_none=True)
        return counter.get_total_flops()

    kept = flops()
    assert flops("before_attention", "after_attention") == flops("forward") > kept
