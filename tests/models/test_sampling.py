"""Temperature and top-p sampling keep exactly the tokens they should."""

from __future__ import annotations

import torch

from rollplex.models.sampling import SamplingParams, sample, tempered, top_p_filter


def test_top_p_keeps_the_smallest_set_of_most_likely_tokens_reaching_p():
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3]])
    assert (top_p_filter(probs, 0.4) > 0).tolist() == [[False, True, False, False]]
    assert (top_p_filter(probs, 0.5) > 0).tolist() == [[False, True, False, True]]
    assert torch.equal(top_p_filter(probs, 1.0), probs)


def test_temperature_zero_is_the_argmax():
    logprobs = torch.log_softmax(torch.randn(6, 50), dim=-1)
    tokens = sample(logprobs, SamplingParams(temperature=0.0), torch.Generator().manual_seed(0))
    assert torch.equal(tokens, logprobs.argmax(-1))


def test_sampled_tokens_follow_the_distribution():
    logprobs = torch.log(torch.tensor([[0.7, 0.2, 0.1, 0.0]])).expand(20_000, 4)
    tokens = sample(logprobs, SamplingParams(), torch.Generator().manual_seed(0))
    frequencies = torch.bincount(tokens, minlength=4) / tokens.numel()
    assert torch.allclose(frequencies, torch.tensor([0.7, 0.2, 0.1, 0.0]), atol=0.02)


def test_tempered_logprobs_are_of_logits_over_the_temperature_and_ignore_a_shift():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(tempered(logits, 0.5), torch.log_softmax(logits / 0.5, dim=-1))
    torch.testing.assert_close(tempered(logits.log_softmax(-1), 0.5), tempered(logits + 7.0, 0.5))
    assert torch.equal(tempered(logits, 1.0), torch.log_softmax(logits, dim=-1))


def test_the_logprob_temperature_is_the_sampling_one_or_one_when_greedy():
    assert SamplingParams(temperature=0.7).logprob_temperature == 0.7
    assert SamplingParams(temperature=0.0).logprob_temperature == 1.0
