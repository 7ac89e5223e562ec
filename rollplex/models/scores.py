"""Per-token scores of sampled responses: the log-probability of each token and the entropy of the
distribution it was drawn from, masked past each response's length, from final hidden states and the LM head
(`token_scores`: in chunks of tokens, never all the logits at once; `join_first`). Both are of
softmax(logits / temperature), the sampling temperature (`rollplex.models.sampling.tempered`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from rollplex.layout.shapes import LOGIT_CHUNK_BYTES
from rollplex.models.sampling import tempered


@dataclass(frozen=True)
class SuffixOut:
    logprobs: Tensor  # [..., R] float32: log p(response token j | prompt, tokens < j); 0 at j >= length
    entropy: Tensor  # [..., R] float32: entropy of the predictive distribution at token j; 0 at j >= length


def entropy(logprobs: Tensor) -> Tensor:
    """[..., V] log-probabilities -> [...] entropy."""
    return -(logprobs.exp() * logprobs).sum(dim=-1)


def join_first(
    first_logprobs: Tensor,
    rest_logprobs: Tensor,
    rest_entropy: Tensor,
    responses: Tensor,
    response_lens: Tensor,
    temperature: float = 1.0,
) -> SuffixOut:
    """Scores [B, R] of responses [B, R] int64 of lengths [B]: token 0's from first_logprobs [B, V] (the
    boundary's, at temperature 1, tempered here), tokens 1.. from rest_logprobs and rest_entropy [B, R-1] (the
    LM head's at `temperature`, `token_scores`); 0 at and past each length."""
    if temperature != 1:
        first_logprobs = tempered(first_logprobs, temperature)
    logprobs = torch.cat([first_logprobs.gather(-1, responses[:, :1]), rest_logprobs], dim=-1)
    entropies = torch.cat([entropy(first_logprobs)[:, None], rest_entropy], dim=-1)
    is_real = torch.arange(responses.shape[1], device=responses.device) < response_lens[:, None]
    return SuffixOut(logprobs.where(is_real, 0.0), entropies.where(is_real, 0.0))


def token_scores(
    hidden: Tensor, head: Callable[[Tensor], Tensor], targets: Tensor, vocab_size: int, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Log-prob of each target and the entropy at each of hidden [M, H], at `temperature`: the head runs on chunks
    of tokens (LOGIT_CHUNK_BYTES of logits), on a GPU through the fused kernels of `kernels.token_scores` where
    the head is a plain linear layer or vocabulary-parallel, else in eager torch with FP32 logits (gathered whole
    under TP), each chunk checkpointed when autograd records. [M] and [M], float32."""
    if hidden.is_cuda and (group := _fused_head_group(head)) is not None:
        step = max(1, LOGIT_CHUNK_BYTES // (head.weight.element_size() * head.weight.shape[0]))
        score, recorded = partial(_fused_scores, head.weight, temperature, group), False  # recomputes in backward
    else:
        step = max(1, LOGIT_CHUNK_BYTES // (4 * vocab_size))
        score = partial(_token_scores, head, temperature)
        recorded = torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in _params(head)))
    parts = [
        checkpoint(score, hidden[i : i + step], targets[i : i + step], use_reentrant=False)
        if recorded
        else score(hidden[i : i + step], targets[i : i + step])
        for i in range(0, max(hidden.shape[0], 1), step)  # one empty chunk when there are no tokens
    ]
    return torch.cat([lp for lp, _ in parts]), torch.cat([e for _, e in parts])


def _token_scores(
    head: Callable[[Tensor], Tensor], temperature: float, hidden: Tensor, targets: Tensor
) -> tuple[Tensor, Tensor]:
    logprobs = tempered(head(hidden), temperature)  # [M, V]
    return logprobs.gather(-1, targets[:, None])[:, 0], entropy(logprobs)


def _fused_scores(weight: Tensor, temperature: float, group, hidden: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    from rollplex.kernels.token_scores import head_scores  # Triton: imported on a GPU only

    return head_scores(hidden, weight, targets, temperature, group)


def _fused_head_group(head):
    """The TP group over which `head` is split (a single rank for a whole one) where the fused kernels take it: a
    plain linear head without bias or a vocabulary-parallel one; else None (a value head, a test's function)."""
    from rollplex.parallel.group import TPGroup
    from rollplex.parallel.layers import VocabParallelHead

    if type(head) is torch.nn.Linear and head.bias is None:
        return TPGroup(1, 0)
    return head.group if isinstance(head, VocabParallelHead) else None


def _params(head) -> list[Tensor]:
    return list(head.parameters()) if isinstance(head, torch.nn.Module) else []
