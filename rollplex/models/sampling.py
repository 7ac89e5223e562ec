"""Token sampling for rollout: temperature and top-p (nucleus) over a batch of next-token distributions.

One rule holds for every log-prob rollplex computes, in rollout and in training alike: it is the log-prob under
softmax(logits / T), T the sampling temperature (1 when sampling is greedy), so that the trainer scores a
token under the distribution it was drawn from (`tempered`). Not here: the decode loop (`generate.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

Rows = tuple[Sequence[int], int]  # (these rows' indices, the rows of the whole batch): a share of a larger batch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_p keeps the smallest set of most likely tokens holding that much mass.

    A response ends at its first stop token (which it keeps as its last token) or after max_tokens tokens.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature {self.temperature} is negative: use 0 for greedy, or a positive value")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p {self.top_p} is outside (0, 1]: use 1 to sample from the whole vocabulary")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens {self.max_tokens} must be at least 1")
        if not isinstance(self.stop_token_ids, tuple):
            raise ValueError(f"stop_token_ids must be a tuple of token ids, got {self.stop_token_ids!r}")

    @property
    def logprob_temperature(self) -> float:
        """The T of every log-prob (module docstring): the sampling temperature, or 1 when greedy."""
        return self.temperature if self.temperature > 0 else 1.0


def tempered(logits: Tensor, temperature: float) -> Tensor:
    """log softmax(logits / temperature) over the last dimension, in float32. Logits may be shifted by any
    constant per row (log-probs at temperature 1 work as well)."""
    logits = logits.float()
    return torch.log_softmax(logits if temperature == 1 else logits / temperature, dim=-1)


def top_p_filter(probs: Tensor, top_p: float) -> Tensor:
    """probs [B, V] -> the same with every token outside the top-p nucleus set to 0 (not renormalised)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # the most likely token always has 0 before it
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)


def sample(logprobs: Tensor, params: SamplingParams, generator: torch.Generator, rows: Rows | None = None) -> Tensor:
    """One token id [B] from each next-token distribution logprobs [B, V] (float32), already at
    `params.logprob_temperature` (`tempered`): the most likely token when greedy, else a draw, within top-p.
    `rows` (index, total): these are rows `index` of a batch of `total`, whose random numbers are all drawn."""
    if params.temperature == 0:
        return logprobs.argmax(dim=-1)
    probs = logprobs.exp()
    if params.top_p < 1:
        probs = top_p_filter(probs, params.top_p)
    return race(probs, generator, rows)


def race(probs: Tensor, generator: torch.Generator, rows: Rows | None = None) -> Tensor:
    """One draw per row of probs [B, V]: the first of V exponential clocks of rates probs to ring.

    argmax(probs / E) with E ~ Exp(1) picks token v with probability probs[v] / sum(probs), like multinomial,
    but as three elementwise/reduction kernels with no host synchronisation (CUDA-graph and stream friendly).
    """
    if rows is None:
        clocks = torch.empty_like(probs).exponential_(generator=generator)
    else:
        index, total = rows
        every = probs.new_empty(total, probs.shape[-1]).exponential_(generator=generator)
        clocks = every.index_select(0, torch.as_tensor(index, device=probs.device))
    return (probs / clocks).argmax(dim=-1)
