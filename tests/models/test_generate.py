"""Rollout decode over a shared prompt boundary agrees with the full forward and with suffix scoring."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rollplex.models.generate import generate
from rollplex.models.inputs import Prompt
from rollplex.models.sampling import SamplingParams

NUM_SAMPLES = 3


def rollout(model, prompts, params: SamplingParams, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return generate(model, prompts, num_samples=NUM_SAMPLES, params=params, generator=generator)


def rollout_from(model, prompts, params: SamplingParams, boundary):
    generator = torch.Generator().manual_seed(0)
    return generate(model, prompts, num_samples=NUM_SAMPLES, params=params, generator=generator, boundary=boundary)


def test_the_same_seed_gives_the_same_rollout_and_another_seed_another(model, prompts):
    params = SamplingParams(temperature=1.0, max_tokens=6)
    first, again, other = (
        rollout(model, prompts, params),
        rollout(model, prompts, params),
        rollout(model, prompts, params, 1),
    )
    assert torch.equal(first.responses, again.responses) and torch.equal(first.logprobs, again.logprobs)
    assert not torch.equal(first.responses, other.responses)


def test_responses_end_at_their_first_stop_token_or_at_max_tokens(model, prompts):
    stop = (10, 11, 12, 13, 14, 15, 16, 17)
    out = rollout(model, prompts, SamplingParams(temperature=1.5, max_tokens=8, stop_token_ids=stop))
    assert out.responses.shape[-1] == int(out.response_lens.max()) <= 8
    for response, length in zip(out.responses.flatten(0, 1), out.response_lens.flatten(), strict=True):
        is_stop = torch.isin(response[:length], torch.tensor(stop))
        assert not is_stop[:-1].any()
        assert is_stop[-1] or length == 8
        assert (response[length:] == 0).all()


def test_a_length_budget_ends_a_response_unless_a_stop_token_came_first(model, prompts):
    stop = (10, 11, 12)
    budgets = torch.tensor([[1, 4, 8]] * len(prompts))
    params = SamplingParams(temperature=1.0, max_tokens=8, stop_token_ids=stop)
    out = generate(
        model, prompts, num_samples=3, params=params, generator=torch.Generator().manual_seed(0), max_lens=budgets
    )
    assert (out.response_lens <= budgets).all() and out.response_lens[:, 0].eq(1).all()
    ends = zip(out.responses.flatten(0, 1), out.response_lens.flatten(), budgets.flatten(), strict=True)
    for response, length, budget in ends:
        assert length == budget or int(response[length - 1]) in stop


def test_a_given_prefill_is_decoded_from_and_none_is_made(model, prompts, monkeypatch):
    """The rollout from a boundary made elsewhere (the actor prefix's): the same rollout as from its own prefill
    when the boundary is the same; another boundary's first token distribution when it is not."""
    params = SamplingParams(temperature=1.0, max_tokens=4)
    own = rollout(model, prompts, params)
    boundary = model.prefix(prompts, attached=True).detached()
    monkeypatch.setattr(model, "prefix", lambda *a, **kw: pytest.fail("the rollout prefilled again"))
    given = rollout_from(model, prompts, params, boundary)
    torch.testing.assert_close(given.logprobs, own.logprobs)
    assert torch.equal(given.responses, own.responses)
    certain = torch.full_like(boundary.first_logprobs, -1e4).index_fill(-1, torch.tensor([7]), 0.0)
    forced = rollout_from(model, prompts, params, replace(boundary, first_logprobs=certain))
    assert (forced.responses[..., 0] == 7).all()


def test_greedy_decoding_follows_the_argmax_of_the_full_forward(model, prompts):
    out = rollout(model, prompts, SamplingParams(temperature=0.0, max_tokens=5))
    for p, prompt in enumerate(prompts):
        for n in range(NUM_SAMPLES):
            response = out.responses[p, n, : out.response_lens[p, n]]
            logits = model([Prompt(torch.cat([prompt.input_ids, response]), prompt.visuals)])[0]
            greedy = logits[prompt.num_tokens - 1 : -1].argmax(-1)
            assert torch.equal(greedy, response)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_sampling_logprobs_equal_suffix_logprobs_at_the_sampling_temperature(model, prompts, temperature):
    out = rollout(model, prompts, SamplingParams(temperature=temperature, top_p=1.0, max_tokens=6))
    boundary = model.prefix(prompts, attached=False)
    scored = model.suffix(boundary, out.responses, out.response_lens, temperature=temperature)
    assert (out.logprobs - scored.logprobs).abs().max() <= 1e-5 * scored.logprobs.abs().max()
    if temperature != 1.0:
        at_one = model.suffix(boundary, out.responses, out.response_lens)
        assert (out.logprobs - at_one.logprobs).abs().max() > 0.01


def test_a_vanishing_top_p_samples_the_greedy_token(model, prompts):
    greedy = rollout(model, prompts, SamplingParams(temperature=0.0, max_tokens=4))
    nucleus = rollout(model, prompts, SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=4))
    assert torch.equal(greedy.responses, nucleus.responses)


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"max_tokens": 0}, {"stop_token_ids": [2]}]
)
def test_invalid_sampling_params_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
