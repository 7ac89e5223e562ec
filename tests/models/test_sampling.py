"""Temperature and top-p sampling keep exactly the tokens they should."""

from __future__ import annotations

import torch

from rollplex.models.sampling import SamplingParams, sample, top_p_filter


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
