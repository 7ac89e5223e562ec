"""prefix + suffix equals the unsplit forward over prompt ++ response, in values and in every gradient."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from rollplex.models.boundary import concat_boundaries
from rollplex.models.inputs import Prompt
from rollplex.models.model import Qwen2_5_VL

NUM_SAMPLES = 3
MAX_RESPONSE = 5


@pytest.fixture
def responses(config) -> tuple[torch.Tensor, torch.Tensor]:
    """Responses [P, N, R] of lengths 1..R (padding holds token 0), and the lengths [P, N]."""
    generator = torch.Generator().manual_seed(7)
    shape = (3, NUM_SAMPLES, MAX_RESPONSE)
    tokens = torch.randint(8, config.text.vocab_size, shape, generator=generator)
    lens = torch.tensor([[5, 1, 3], [2, 5, 4], [3, 3, 1]])
    return tokens.where(torch.arange(MAX_RESPONSE) < lens[..., None], 0), lens


def unsplit_logprobs(model: Qwen2_5_VL, prompts: list[Prompt], responses, lens) -> tuple[torch.Tensor, ...]:
    """Log-probs and entropy [P, N, R] from whole prompt ++ response sequences: the prompt runs once per sample."""
    sequences = [
        Prompt(torch.cat([prompt.input_ids, responses[p, n, : lens[p, n]]]), prompt.visuals)
        for p, prompt in enumerate(prompts)
        for n in range(responses.shape[1])
    ]
    logits = model(sequences)
    logprobs = torch.zeros(responses.shape)
    entropy = torch.zeros(responses.shape)
    for row, sequence in enumerate(sequences):
        p, n = divmod(row, responses.shape[1])
        start = prompts[p].num_tokens - 1
        dist = torch.log_softmax(logits[row, start : sequence.num_tokens - 1].float(), dim=-1)  # [len, V]
        logprobs[p, n, : lens[p, n]] = dist.gather(-1, responses[p, n, : lens[p, n], None])[:, 0]
        entropy[p, n, : lens[p, n]] = -(dist.exp() * dist).sum(-1)
    return logprobs, entropy


def assert_close(ours: torch.Tensor, reference: torch.Tensor, rel: float = 1e-5) -> None:
    assert (ours - reference).norm() <= rel * reference.norm()


def test_suffix_logprobs_and_entropy_equal_the_unsplit_forward(model, prompts, responses):
    tokens, lens = responses
    out = model.suffix(model.prefix(prompts, attached=False), tokens, lens)
    with torch.no_grad():
        logprobs, entropy = unsplit_logprobs(model, prompts, tokens, lens)
    assert_close(out.logprobs, logprobs)
    assert_close(out.entropy, entropy)
    assert (out.logprobs[tokens == 0] == 0).all() and (out.entropy[tokens == 0] == 0).all()


def test_detached_boundary_holds_no_graph(model, prompts):
    boundary = model.prefix(prompts, attached=False)
    assert not any(t.requires_grad for t in (*boundary.keys, *boundary.values, boundary.first_logprobs))


def test_boundary_holds_one_prompt_kv_per_prompt_not_per_sample(model, prompts, config):
    boundary = model.prefix(prompts, attached=False)
    longest = max(prompt.num_tokens for prompt in prompts)
    kv_shape = (len(prompts), config.text.num_key_value_heads, longest, config.text.head_dim)
    assert all(k.shape == kv_shape for k in boundary.keys + boundary.values)
    assert boundary.first_logprobs.shape == (len(prompts), config.text.vocab_size)
    assert boundary.prompt_lens.tolist() == [prompt.num_tokens for prompt in prompts]
    assert boundary.host_prompt_lens == tuple(prompt.num_tokens for prompt in prompts)  # read without a device sync
    both = concat_boundaries([boundary, model.prefix(prompts[:1], attached=False)])
    assert both.host_prompt_lens == (*boundary.host_prompt_lens, prompts[0].num_tokens)


def test_attached_prefix_gives_every_parameter_the_unsplit_gradient(model, prompts, responses):
    tokens, lens = responses
    weights = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(3))

    model.zero_grad()
    out = model.suffix(model.prefix(prompts, attached=True), tokens, lens)
    ((out.logprobs + 0.1 * out.entropy) * weights).sum().backward()
    split = {name: p.grad.clone() for name, p in model.named_parameters()}

    model.zero_grad()
    logprobs, entropy = unsplit_logprobs(model, prompts, tokens, lens)
    ((logprobs + 0.1 * entropy) * weights).sum().backward()
    for name, p in model.named_parameters():
        assert split[name].norm() > 0, name
        assert_close(split[name], p.grad)


def test_suffix_of_one_token_responses_reads_only_the_boundary(model, prompts):
    boundary = model.prefix(prompts, attached=False)
    tokens = torch.arange(8, 8 + len(prompts) * 2).view(len(prompts), 2, 1)
    out = model.suffix(boundary, tokens, torch.ones(len(prompts), 2, dtype=torch.long))
    assert torch.equal(out.logprobs[..., 0], boundary.first_logprobs.gather(-1, tokens[..., 0]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_scoring_a_length_batch_never_makes_the_host_wait(model, prompts, responses):
    """suffix_rows takes its rows and lengths from the host: the pack's index lists, the block mask and the
    scores reach the device without a stream sync, so the host stays ahead of the kernels (a sync here raises)."""
    tokens, lens = responses
    model = model.cuda()
    boundary = model.prefix(prompts, attached=False)
    rows = [p for p in range(tokens.shape[0]) for _ in range(tokens.shape[1])]
    batch, counts = tokens.flatten(0, 1).cuda(), lens.flatten().tolist()
    with torch.no_grad():
        first = model.suffix_rows(boundary, rows, batch, counts)  # compiles: Inductor may sync
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            again = model.suffix_rows(boundary, rows, batch, counts)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(again.logprobs, first.logprobs) and torch.equal(again.entropy, first.entropy)


def _layer_units(model: Qwen2_5_VL, how: str) -> list[tuple[torch.nn.Module, str]]:
    halves = ("forward",) if how == "full" else ("before_attention", "after_attention")
    return [(layer, h) for layer in model.model.language_model.layers for h in halves]


def _mark_attention(monkeypatch, inside: list[bool], seen) -> None:
    """Patches the suffix's attention: `inside[0]` is True while a call runs, and `seen(attention, q, out)` hears
    of each call after it."""
    from rollplex.models.attention import PackedPrefixAttention

    attend = PackedPrefixAttention.__call__

    def marked(self, layer, q, k, v):
        inside[0] = True
        try:
            out = attend(self, layer, q, k, v)
        finally:
            inside[0] = False
        seen(self, q, out)
        return out

    monkeypatch.setattr(PackedPrefixAttention, "__call__", marked)


@pytest.mark.parametrize("how", ["selective", "full"])
def test_a_recomputed_suffix_gives_the_same_gradients_and_selective_runs_each_attention_once(
    model, prompts, responses, monkeypatch, how
):
    """Selective recompute reruns each decoder layer's two halves around its attention and keeps what the attention
    saves: backward runs no attention again, where full recompute reruns every layer's. Neither changes a bit."""
    from rollplex.memory.offload import recompute_methods
    from rollplex.models.attention import PackedPrefixAttention

    tokens, lens = responses
    weights = torch.randn(tokens.shape, generator=torch.Generator().manual_seed(3))
    calls, attend = [], PackedPrefixAttention.__call__

    def counted(self, layer, q, k, v):
        calls.append(layer)
        return attend(self, layer, q, k, v)

    def gradients(context) -> dict[str, torch.Tensor]:
        model.zero_grad()
        with context:
            out = model.suffix(model.prefix(prompts, attached=True), tokens, lens)
            ((out.logprobs + 0.1 * out.entropy) * weights).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters()}

    kept = gradients(nullcontext())
    monkeypatch.setattr(PackedPrefixAttention, "__call__", counted)
    ours = gradients(recompute_methods(_layer_units(model, how)))
    layers = len(model.model.language_model.layers)
    assert sorted(calls) == sorted(list(range(layers)) * (1 if how == "selective" else 2))
    for name, g in kept.items():
        assert torch.equal(ours[name], g), name


def test_selective_recompute_keeps_beside_the_attentions_own_only_what_full_recompute_does_and_their_outputs(
    model, prompts, responses, monkeypatch
):
    """What a selective layer saves outside its attention: its halves' inputs, the layer's input (as under full
    recompute) and the attention's output (which flash and FlexAttention save anyway); the plan counts these
    (`layout.shapes.attention_saved_bytes_per_token`)."""
    from rollplex.memory.offload import recompute_methods

    tokens, lens = responses
    boundary = model.prefix(prompts, attached=False)
    inside, outputs = [False], []
    _mark_attention(monkeypatch, inside, lambda attention, q, out: outputs.append(out.untyped_storage().nbytes()))

    def saved_outside_attention(how: str) -> int:
        saved = {}

        def pack(t):
            if not inside[0] and not isinstance(t, torch.nn.Parameter):
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        outputs.clear()
        with recompute_methods(_layer_units(model, how)), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            assert model.suffix(boundary, tokens, lens).logprobs.requires_grad
        return sum(saved.values())

    full = saved_outside_attention("full")
    assert saved_outside_attention("selective") == full + sum(outputs)
    assert len(outputs) == model.config.text.num_hidden_layers


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_a_selective_layers_attention_saves_what_the_plan_counts(config, prompts, responses, monkeypatch):
    """FlexAttention's saved tensors, per layer: q and the output (bf16) and their log-sum-exp (fp32) for each
    packed token, `attention_saved_bytes_per_token`; the keys and values it attends, the used prompts' boundary
    KV end to end beside the packed tokens' own, `objects._suffix_attention`'s per-layer keys."""
    from rollplex.layout import shapes as S
    from rollplex.memory.offload import recompute_methods

    torch.manual_seed(0)
    model = Qwen2_5_VL(config).cuda().to(torch.bfloat16)
    tokens, lens = responses
    boundary = model.prefix(prompts, attached=False)
    inside, seen, shapes = [False], {}, []
    _mark_attention(monkeypatch, inside, lambda attention, q, out: shapes.append((q.shape[2], attention.num_keys)))

    def pack(t):
        if inside[0] and t.is_floating_point() and not isinstance(t, torch.nn.Parameter):
            seen[t.data_ptr()] = t.numel() * t.element_size()
        return t

    with (
        recompute_methods(_layer_units(model, "selective")),
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
    ):
        assert model.suffix(boundary, tokens.cuda(), lens.cuda()).logprobs.requires_grad
    t = config.text
    queries, keys = shapes[0]
    assert set(shapes) == {(queries, keys)} and len(shapes) == t.num_hidden_layers
    kv = keys * S.kv_bytes_per_token(t, 1) // t.num_hidden_layers
    per_layer = queries * S.attention_saved_bytes_per_token(t, 1, keys=False) + kv
    assert sum(seen.values()) == t.num_hidden_layers * per_layer
