"""What one pass of the model costs, against torch's own FLOP count of our model's matmuls and the attention terms
counted by hand: prefill, scoring, decode, the update, and the backward and what it reruns."""

import re
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from rollplex.data.source import batch_at, open_dataset
from rollplex.data.tokenizer import CharTokenizer
from rollplex.executors.bounds import step_tokens
from rollplex.graph import modelcost
from rollplex.graph.load import parse_spec
from rollplex.graph.modelcost import StepTokens, decode, prefix_forward, suffix_forward
from rollplex.graph.plan import compile_plan
from rollplex.models.config import load_model_config
from rollplex.models.model import Qwen2_5_VL

SPECS = Path(__file__).resolve().parents[2] / "specs"


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
    """FLOPs of the decoder's projections and the LM head alone: the linear products (mm, addmm) inside each decoder
    layer (packed projections run in the layer's or the MLP's own call, `packed_linear`) and the head's."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn()
    counts = counter.get_flop_counts()
    linears = [k for k in counts if re.search(r"layers\.\d+$", k)] + ["Linear"]
    products = {torch.ops.aten.mm, torch.ops.aten.addmm}
    return sum(n for k in linears if k in counts for op, n in counts[k].items() if op in products)


def without_attention(monkeypatch):
    """torch's counter leaves out scaled_dot_product_attention on the CPU: compare the matmuls alone."""
    monkeypatch.setattr(modelcost, "_attention_flops", lambda *a, **k: 0.0)
    monkeypatch.setattr(modelcost, "vision_forward", _vision_matmuls)


_vision_forward = modelcost.vision_forward


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
    assert modelcost.prefix_forward(config.text, config.vision, single, 1).flops == pytest.approx(prefix, rel=1e-6)
    # the suffix's LM head scores token 0 from the boundary: its row of R-1 hidden states, plus the head on them
    suffix = modelcost.suffix_forward(config.text, single, 1).flops
    head_on_first = 2 * config.text.hidden_size * config.text.vocab_size
    assert suffix - modelcost._llm_flops(config.text, 1, 1) - head_on_first == pytest.approx(one_row, rel=1e-6)


def test_attention_is_four_widths_per_query_key_pair_and_layer_halved_when_causal():
    t = load_model_config("qwen2_5_vl_3b").text
    one = StepTokens((1000,), (0,), (1,), ((10,),))
    attention = prefix_forward(t, load_model_config("qwen2_5_vl_3b").vision, one, 1).flops - (
        modelcost._llm_flops(t, 1000, 1) + modelcost._head_flops(t, 1, 1)
    )
    assert attention == pytest.approx(4 * t.hidden_size * 1000 * 1000 / 2 * t.num_hidden_layers)
    s = suffix_forward(t, one, 1).flops - modelcost._llm_flops(t, 10, 1) - modelcost._head_flops(t, 10, 1)
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


def test_a_sharded_update_reads_and_streams_only_its_ranks_share():
    config = load_model_config("qwen2_5_vl_7b")
    plan = compile_plan(parse_spec((SPECS / "qwen2_5_vl_7b_h200.yaml").read_text()))
    d = plan.decisions
    whole = modelcost.update(config.text, config.vision, 1, d, keeps_share=False)
    quarter = modelcost.update(config.text, config.vision, 1, d, keeps_share=False, shards=4)
    assert quarter.hbm_bytes == pytest.approx(whole.hbm_bytes / 4, rel=1e-6)
    assert quarter.host_bytes == pytest.approx(whole.host_bytes / 4, rel=1e-6) and whole.host_bytes > 0


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
    modelled = modelcost.prefix_backward(config.text, config.vision, tokens, 1, d).flops
    assert modelled == (3 if rerun else 2) * modelcost.prefix_forward(config.text, config.vision, tokens, 1).flops
    assert measured == pytest.approx(modelled, rel=0.06)


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
        return modelcost.backward(split, t, v, tokens, 1, d).flops

    scoring = (suffix_forward(t, tokens, 1) if split else modelcost.whole_forward(t, v, tokens, 1)).flops
    attention = (modelcost.suffix_attention_flops if split else modelcost.whole_attention_flops)(t, tokens, 1)
    none, selective, full = (priced(how) for how in (Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL))
    head = sum(modelcost._head_flops(t, sum(lens), 1) for lens in tokens.response_lens)  # no recompute checkpoints it
    assert full - none == pytest.approx(scoring - head, rel=1e-9)
    assert full - selective == pytest.approx(attention, rel=1e-9) and 0 < attention < scoring / 2
    # the actor's last 9 of 36 decoder layers kept whole rerun nothing; unsplit, the vision tower still reruns
    d = SimpleNamespace(recompute=Recompute.FULL, prefix_activations=PrefixActivations.RECOMPUTE,
                        freeze_vision=False, prefix_saved=None, layers_kept=9)  # fmt: skip
    vision = 0.0 if split else modelcost.whole_vision_flops(v, tokens)
    kept = modelcost.backward(split, t, v, tokens, 1, d).flops
    assert full - kept == pytest.approx((scoring - vision - head) * 9 / t.num_hidden_layers, rel=1e-9)
    critic = modelcost.backward(split, t, v, tokens, 1, d, value=True)  # a critic's layers all rerun
    assert critic == modelcost.backward(
        split, t, v, tokens, 1, SimpleNamespace(**{**vars(d), "layers_kept": 0}), value=True
    )


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
