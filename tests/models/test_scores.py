"""Scores from hidden states in chunks of tokens equal the scores of the whole logits, gradients included."""

from __future__ import annotations

import pytest
import torch

import rollplex.models.scores as scores
from rollplex.models.scores import score_hidden, score_responses


@pytest.mark.parametrize("chunk_bytes", [4 * 11 * 3, 1 << 30])  # 3 tokens per chunk; everything in one
def test_chunked_scores_and_their_gradients_equal_the_whole_logits(monkeypatch, chunk_bytes):
    monkeypatch.setattr(scores, "LOGIT_CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(6, 11, bias=False)
    hidden = torch.randn(2, 3, 4, 6, generator=g)
    first = torch.log_softmax(torch.randn(2, 11, generator=g), dim=-1)
    responses, lens = torch.randint(11, (2, 3, 5), generator=g), torch.tensor([[5, 2, 1], [3, 5, 4]])
    results = []
    for whole in (False, True):
        h = hidden.clone().requires_grad_()
        head.zero_grad()
        out = (
            score_responses(first, head(h), responses, lens) if whole else score_hidden(first, h, head, responses, lens)
        )
        (out.logprobs.sum() + 0.3 * out.entropy.sum()).backward()
        results.append((out.logprobs.detach(), out.entropy.detach(), h.grad, head.weight.grad.clone()))
    for ours, oracle in zip(*results, strict=True):
        torch.testing.assert_close(ours, oracle)
