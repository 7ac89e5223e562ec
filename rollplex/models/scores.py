"""Per-token scores of sampled responses: the log-probability of each token and the entropy of the
distribution it was drawn from, masked past each response's length. Pure tensor math on logits; no model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SuffixOut:
    logprobs: Tensor  # [P, N, R] float32: log p(response token j | prompt, tokens < j); 0 at j >= length
    entropy: Tensor  # [P, N, R] float32: entropy of the predictive distribution at token j; 0 at j >= length


def entropy(logprobs: Tensor) -> Tensor:
    """[..., V] log-probabilities -> [...] entropy."""
    return -(logprobs.exp() * logprobs).sum(dim=-1)


def score_responses(first_logprobs: Tensor, logits: Tensor, responses: Tensor, response_lens: Tensor) -> SuffixOut:
    """first_logprobs [P, V] predict token 0; logits [P, N, R-1, V] (after tokens 0..R-2) predict 1..R-1.

    responses [P, N, R] int64, response_lens [P, N] int64.
    """
    num_prompts, num_samples, num_tokens = responses.shape
    rest = torch.log_softmax(logits.float(), dim=-1)  # [P, N, R-1, V]
    logprobs = torch.cat(
        [
            first_logprobs.gather(-1, responses[:, :, 0])[..., None],
            rest.gather(-1, responses[..., 1:, None])[..., 0],
        ],
        dim=-1,
    )  # [P, N, R]
    first_entropy = entropy(first_logprobs)[:, None, None].expand(num_prompts, num_samples, 1)
    entropies = torch.cat([first_entropy, entropy(rest)], dim=-1)  # [P, N, R]
    is_real = torch.arange(num_tokens, device=responses.device) < response_lens[..., None]
    return SuffixOut(logprobs.where(is_real, 0.0), entropies.where(is_real, 0.0))
