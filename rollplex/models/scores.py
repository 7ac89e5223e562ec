"""Per-token scores of sampled responses: the log-probability of each token and the entropy of the
distribution it was drawn from, masked past each response's length, from final hidden states and the LM head
(`score_hidden`, `token_scores`: in chunks of tokens, never all the FP32 logits at once). Both are of
softmax(logits / temperature), the sampling temperature (`rollplex.models.sampling.tempered`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from rollplex.models.sampling import tempered

LOGIT_CHUNK_BYTES = 1 << 30  # FP32 logits of one chunk of response tokens in `score_hidden`


@dataclass(frozen=True)
class SuffixOut:
    logprobs: Tensor  # [P, N, R] float32: log p(response token j | prompt, tokens < j); 0 at j >= length
    entropy: Tensor  # [P, N, R] float32: entropy of the predictive distribution at token j; 0 at j >= length


def entropy(logprobs: Tensor) -> Tensor:
    """[..., V] log-probabilities -> [...] entropy."""
    return -(logprobs.exp() * logprobs).sum(dim=-1)


def score_hidden(
    first_logprobs: Tensor,
    hidden: Tensor,
    head: Callable[[Tensor], Tensor],
    responses: Tensor,
    response_lens: Tensor,
    temperature: float = 1.0,
) -> SuffixOut:
    """Scores [P, N, R] of responses [P, N, R] int64 of lengths [P, N]: first_logprobs [P, V] (at temperature 1)
    predict token 0, hidden [P, N, R-1, H] (after tokens 0..R-2) predict 1..R-1 through the LM head `head`
    (`token_scores`); all at `temperature`."""
    num_prompts, num_samples, num_tokens = responses.shape
    targets, vocab_size = responses[..., 1:].flatten(), first_logprobs.shape[-1]
    rest_lp, rest_ent = token_scores(hidden.flatten(0, 2), head, targets, vocab_size, temperature)
    if temperature != 1:
        first_logprobs = tempered(first_logprobs, temperature)
    rest_lp = rest_lp.view(num_prompts, num_samples, num_tokens - 1)
    rest_ent = rest_ent.view(num_prompts, num_samples, num_tokens - 1)
    first = first_logprobs.gather(-1, responses[:, :, 0])[..., None]
    logprobs = torch.cat([first, rest_lp], dim=-1)
    first_entropy = entropy(first_logprobs)[:, None, None].expand(num_prompts, num_samples, 1)
    entropies = torch.cat([first_entropy, rest_ent], dim=-1)
    is_real = torch.arange(num_tokens, device=responses.device) < response_lens[..., None]
    return SuffixOut(logprobs.where(is_real, 0.0), entropies.where(is_real, 0.0))


def token_scores(
    hidden: Tensor, head: Callable[[Tensor], Tensor], targets: Tensor, vocab_size: int, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Log-prob of each target and the entropy at each of hidden [M, H], at `temperature`: the head runs on chunks
    of tokens (LOGIT_CHUNK_BYTES of FP32 logits), each checkpointed when autograd records. [M] and [M], float32."""
    step = max(1, LOGIT_CHUNK_BYTES // (4 * vocab_size))
    score = partial(_token_scores, head, temperature)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in _params(head)))
    parts = [
        checkpoint(score, hidden[i : i + step], targets[i : i + step], use_reentrant=False)
        if grad
        else score(hidden[i : i + step], targets[i : i + step])
        for i in range(0, max(hidden.shape[0], 1), step)  # one empty chunk when there are no tokens
    ]
    return torch.cat([lp for lp, _ in parts]), torch.cat([e for _, e in parts])


def _token_scores(
    head: Callable[[Tensor], Tensor], temperature: float, hidden: Tensor, targets: Tensor
) -> tuple[Tensor, Tensor]:
    logprobs = tempered(head(hidden), temperature)  # [M, V]
    return logprobs.gather(-1, targets[:, None])[:, 0], entropy(logprobs)


def _params(head) -> list[Tensor]:
    return list(head.parameters()) if isinstance(head, torch.nn.Module) else []
