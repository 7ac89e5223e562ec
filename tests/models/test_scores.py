"""Scores from hidden states in chunks of tokens equal the scores of the whole logits, gradients included."""

from __future__ import annotations

import pytest
import torch

import rollplex.models.scores as scores
from rollplex.models.scores import SuffixOut, entropy, join_first, token_scores


def whole_logits_scores(first_logprobs, logits, responses, lens) -> SuffixOut:
    """The oracle: log-softmax over all the logits [B, R-1, V] at once."""
    rest = torch.log_softmax(logits.float(), dim=-1)
    first = first_logprobs.gather(-1, responses[:, :1])
    logprobs = torch.cat([first, rest.gather(-1, responses[..., 1:, None])[..., 0]], dim=-1)
    first_entropy = entropy(first_logprobs)[:, None]
    entropies = torch.cat([first_entropy, entropy(rest)], dim=-1)
    real = torch.arange(responses.shape[1]) < lens[..., None]
    return SuffixOut(logprobs.where(real, 0.0), entropies.where(real, 0.0))


def chunked(hidden, head, responses) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_scores` of tokens 1.. from hidden [B, R-1, H], back in [B, R-1]."""
    lp, ent = token_scores(hidden.flatten(0, 1), head, responses[:, 1:].flatten(), head.out_features)
    return lp.view(responses.shape[0], -1), ent.view(responses.shape[0], -1)


@pytest.mark.parametrize("chunk_bytes", [4 * 11 * 3, 1 << 30])  # 3 tokens per chunk; everything in one
def test_chunked_scores_and_their_gradients_equal_the_whole_logits(monkeypatch, chunk_bytes):
    monkeypatch.setattr(scores, "LOGIT_CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(6, 11, bias=False)
    hidden = torch.randn(6, 4, 6, generator=g)
    first = torch.log_softmax(torch.randn(6, 11, generator=g), dim=-1)
    responses, lens = torch.randint(11, (6, 5), generator=g), torch.tensor([5, 2, 1, 3, 5, 4])
    results = []
    for whole in (False, True):
        h = hidden.clone().requires_grad_()
        head.zero_grad()
        out = (
            whole_logits_scores(first, head(h), responses, lens)
            if whole
            else join_first(first, *chunked(h, head, responses), responses, lens)
        )
        (out.logprobs.sum() + 0.3 * out.entropy.sum()).backward()
        results.append((out.logprobs.detach(), out.entropy.detach(), h.grad, head.weight.grad.clone()))
    for ours, oracle in zip(*results, strict=True):
        torch.testing.assert_close(ours, oracle)
