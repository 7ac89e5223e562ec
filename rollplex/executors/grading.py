"""What a rollout's responses score: each response's text as a grader reads it (`response_text`), by every reward
term of the spec, and whether its answer is correct. A step's reward op and a held-out evaluation read the same
numbers from here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rollplex.data.rewards import RewardTerms, is_correct
from rollplex.data.tokenizer import Tokenizer, response_text
from rollplex.data.types import Example
from rollplex.models.generate import Rollout


@dataclass(frozen=True)
class Grades:
    rewards: Tensor  # [P, N] float32 on the host: each response's summed reward
    term_sums: Tensor  # [terms] float64: each reward term summed over the responses
    num_correct: int  # responses whose answer earns full accuracy

    @property
    def num_responses(self) -> int:
        return self.rewards.numel()


def grade(rollout: Rollout, examples: Sequence[Example], tokenizer: Tokenizer, reward: RewardTerms) -> Grades:
    """The rollout's responses to `examples` (prompt p's responses are row p), each scored by every term."""
    rewards = torch.zeros(rollout.response_lens.shape)
    terms, correct = torch.zeros(len(reward.names), dtype=torch.float64), 0
    responses, lens = rollout.responses.cpu(), rollout.response_lens.cpu()
    for p, example in enumerate(examples):
        for n in range(responses.shape[1]):
            text = response_text(tokenizer, responses[p, n, : int(lens[p, n])].tolist())
            scores = reward.scores(text, example)
            rewards[p, n] = reward.total(scores)
            terms += torch.tensor(scores, dtype=torch.float64)
            correct += is_correct(text, example)
    return Grades(rewards, terms, correct)
