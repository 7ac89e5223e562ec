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
