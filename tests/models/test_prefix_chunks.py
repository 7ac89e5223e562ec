"""`prefix_chunks`: the prefix in pauses, for interleaving with decode; the same boundary as `prefix`."""

from __future__ import annotations

import pytest
import torch


def drain(chunks, outer_grad: bool):
    pauses = 0
    while True:
        try:
            next(chunks)
        except StopIteration as done:
            return done.value, pauses
        pauses += 1
        assert torch.is_grad_enabled() == outer_grad  # nothing leaks out of a chunk


@pytest.mark.parametrize("attached", [False, True])
def test_chunks_give_the_boundary_of_prefix_and_pause_once_per_group_of_layers(model, prompts, attached):
    whole = model.prefix(prompts, attached=attached)
    num_layers = model.config.text.num_hidden_layers
    with torch.no_grad():  # the caller's mode (rollout decode) differs from the chunks' own
        chunked, pauses = drain(model.prefix_chunks(prompts, attached=attached, layers_per_chunk=1), False)
    vision_pauses = model.config.vision.depth - 1  # one vision block per chunk too
    assert pauses == num_layers + vision_pauses
    for a, b in zip(whole.keys + whole.values, chunked.keys + chunked.values, strict=True):
        assert torch.equal(a, b) and a.requires_grad == b.requires_grad == attached
    assert torch.equal(whole.first_logprobs, chunked.first_logprobs)
    assert torch.equal(whole.next_positions, chunked.next_positions)


def test_an_attached_chunked_prefix_carries_gradients_to_the_vision_encoder(model, prompts):
    boundary, _ = drain(model.prefix_chunks(prompts, attached=True, layers_per_chunk=1), True)
    (boundary.keys[-1].float().sum() + boundary.first_logprobs.sum()).backward()
    assert model.model.visual.blocks[0].attn.qkv.weight.grad.abs().sum() > 0


def test_one_prompt_per_chunk_gives_the_batched_boundary_within_rounding(model, prompts):
    whole = model.prefix(prompts, attached=False)
    chunked, pauses = drain(model.prefix_chunks(prompts, attached=False, prompts_per_chunk=1), True)
    with_visuals = sum(bool(p.visuals) for p in prompts)  # their vision encoders pause between blocks
    layer_pauses = (model.config.text.num_hidden_layers + 1) * len(prompts) - 1  # + each later group's embedding
    assert pauses == layer_pauses + with_visuals * (model.config.vision.depth - 1)
    assert torch.equal(chunked.prompt_lens, whole.prompt_lens)
    assert torch.equal(chunked.next_positions, whole.next_positions)
    torch.testing.assert_close(chunked.first_logprobs, whole.first_logprobs, atol=1e-5, rtol=1e-5)
    real = whole.key_mask()[:, None, :, None]  # padding positions differ (zeros vs padded-token values)
    for a, b in zip(whole.keys + whole.values, chunked.keys + chunked.values, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a * real, b * real, atol=1e-5, rtol=1e-5)


def test_an_attached_prefix_of_several_groups_drained_under_no_grad_stays_attached(model, prompts):
    # rollout decode drains the chunks under no_grad: joining the groups' boundaries must still record autograd
    with torch.no_grad():
        boundary, _ = drain(model.prefix_chunks(prompts, attached=True, prompts_per_chunk=1), False)
    assert all(t.requires_grad for t in (*boundary.keys, *boundary.values, boundary.first_logprobs))
    (boundary.keys[-1].float().sum() + boundary.first_logprobs.sum()).backward()
    assert model.model.visual.blocks[0].attn.qkv.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("prompts_per_chunk", [None, 1])
def test_inputs_first_copies_every_groups_inputs_before_the_first_pause_and_changes_no_bit(
    model, prompts, prompts_per_chunk, monkeypatch
):
    import rollplex.models.model as model_module
    import rollplex.models.prompt_inputs as prompt_inputs_module
    import rollplex.models.prompt_rows as prompt_rows_module
    import rollplex.models.vision as vision_module

    copies: list[int] = []  # per call of to_device: the pauses seen so far
    pauses = [0]

    def counted(tensor, device):
        copies.append(pauses[0])
        return tensor.to(device)

    for module in (model_module, prompt_inputs_module, prompt_rows_module, vision_module):
        monkeypatch.setattr(module, "to_device", counted)

    def run(first: bool):
        copies.clear()
        pauses[0] = 0
        model.zero_grad(set_to_none=True)
        chunks = model.prefix_chunks(prompts, attached=True, prompts_per_chunk=prompts_per_chunk, inputs_first=first)
        while True:
            try:
                next(chunks)
            except StopIteration as done:
                boundary = done.value
                break
            pauses[0] += 1
        (boundary.keys[-1].float().sum() + boundary.first_logprobs.sum()).backward()
        grads = [p.grad.clone() for p in (model.model.visual.blocks[0].attn.qkv.weight, model.lm_head.weight)]
        return boundary, grads, list(copies)

    joined, joined_grads, joined_copies = run(False)
    first, first_grads, first_copies = run(True)
    assert first_copies and set(first_copies) == {0}  # all before the first group has run a chunk
    assert len(first_copies) == len(joined_copies)  # the same copies, earlier
    assert (max(joined_copies) > 0) == (prompts_per_chunk == 1)  # by group, later groups' after pauses
    for a, b in zip(joined.keys + joined.values, first.keys + first.values, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(joined.first_logprobs, first.first_logprobs)
    assert torch.equal(joined.next_positions, first.next_positions) and torch.equal(
        joined.prompt_lens, first.prompt_lens
    )
    for a, b in zip(joined_grads, first_grads, strict=True):
        assert torch.equal(a, b) and a.abs().sum() > 0


def test_prompt_inputs_hold_what_a_prefix_reads_and_leave_a_shared_towers_patches_to_it(model, prompts):
    from rollplex.models.prompt_inputs import prompt_inputs

    own, shared = prompt_inputs(model, prompts), prompt_inputs(model, prompts, shared_vision=True)
    assert own.vision is not None and shared.vision is None and shared.slots is not None
    assert own.vision.pixels.shape[0] == sum(v.num_patches for p in prompts for v in p.visuals)
    assert own.input_ids.shape == own.slots.shape == (len(prompts), max(p.num_tokens for p in prompts))
    assert own.lens.tolist() == [p.num_tokens for p in prompts] and own.rows is not None  # the prompts differ in length
    text = prompt_inputs(model, prompts[2:])
    assert text.vision is None and text.slots is None and text.rows is None


@pytest.mark.parametrize("prompts_per_chunk", [None, 1])
def test_attached_prompts_keep_the_graph_of_the_first_prompts_only_and_their_gradients(
    model, prompts, prompts_per_chunk
):
    """The step's prefix of mini-batches: the first prompts (mini-batch 1's) keep their graph, the rest run without
    one; the boundary is the same within rounding, and a loss on the first prompts' rows gives the gradients it
    gives through a prefix attached whole (the other rows got zero gradients there)."""

    def run(attached_prompts):
        model.zero_grad(set_to_none=True)
        chunks = model.prefix_chunks(
            prompts, attached=True, prompts_per_chunk=prompts_per_chunk, attached_prompts=attached_prompts
        )
        boundary, _ = drain(chunks, True)
        first = boundary.keys[-1][:1].float().sum() + boundary.values[0][:1].float().sum()
        (first + boundary.first_logprobs[:1].sum()).backward()
        return boundary, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    whole, whole_grads = run(None)
    part, part_grads = run(1)
    real = whole.key_mask()[:, None, :, None]
    for a, b in zip(whole.keys + whole.values, part.keys + part.values, strict=True):
        torch.testing.assert_close(a * real, b * real, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(whole.first_logprobs, part.first_logprobs, atol=1e-5, rtol=1e-5)
    assert part_grads.keys() == whole_grads.keys() and model.model.visual.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
    for name, grad in whole_grads.items():
        torch.testing.assert_close(part_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    for attached_prompts, kept in ((1, False), (None, True)):  # the other prompts' rows: a graph only when whole
        boundary, _ = drain(model.prefix_chunks(prompts, attached=True, attached_prompts=attached_prompts), True)
        rest = boundary.keys[-1][1:].float().sum() + boundary.first_logprobs[1:].sum()
        grads = torch.autograd.grad(rest, list(model.parameters()), allow_unused=True)
        assert any(g is not None and g.abs().sum() > 0 for g in grads) == kept
