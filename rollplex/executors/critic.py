"""PPO's critic pass: its values of the step's responses, their clipped value loss and its backward, fused like the
actor's scoring and backward (`training.py`).

Split, the values come in length batches from the critic's attached boundary, each batch's backward stopping at
its leaf copy, then one backward through the critic's prefix; unsplit, each group over prompt ++ response. Each
response's returns are GAE over its own values (`ppo.gae`): a batch of whole responses holds all it needs. The
values (detached) are the pass's output: the actor's advantages come from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rollplex.executors.grpo import LossScale, loss_scale
from rollplex.executors.ppo import PpoConfig, gae, token_rewards, value_loss
from rollplex.executors.scoring import LeafBoundary, microbatch_budget, row_batches
from rollplex.models.generate import Rollout
from rollplex.models.inputs import Prompt
from rollplex.models.model import Qwen2_5_VL
from rollplex.models.values import suffix_values, whole_values


@dataclass(frozen=True)
class CriticResult:
    values: Tensor  # [P, N, R] float32, detached, 0 past each response's end
    loss: Tensor  # the step's value loss (detached scalar)


def train_critic(
    critic: Qwen2_5_VL,
    cfg: PpoConfig,
    prompts: Sequence[Prompt],
    rollout: Rollout,
    rewards: Tensor,
    boundary: LeafBoundary | None,
    microbatch_memory,
    dp=None,
    microbatch_tokens: int | None = None,
) -> CriticResult:
    """The critic's values and value loss over the step's responses; gradients accumulate in its `.grad`s. Split,
    in microbatches of at most `microbatch_tokens` (`scoring.microbatch_budget`)."""
    num_prompts, num_samples, width = rollout.responses.shape
    mask = torch.arange(width, device=rollout.responses.device) < rollout.response_lens[..., None]
    scale = loss_scale(mask)
    if dp is not None:  # the whole step's normaliser, over every data-parallel rank's responses
        scale = LossScale(*(int(x) for x in dp.sum([scale.num_tokens, scale.num_sequences])))
    step_rewards = token_rewards(rewards.to(mask.device), mask)
    values = torch.zeros(num_prompts * num_samples, width, device=mask.device)
    total = torch.zeros((), device=mask.device)

    def backward(v: Tensor, index: Tensor, cols: int) -> None:
        m, r = mask.flatten(0, 1)[index, :cols], step_rewards.flatten(0, 1)[index, :cols]
        old = v.detach()
        _, returns = gae(cfg, r, old, m)
        loss = value_loss(cfg, scale, v, old, returns, m)
        loss.backward()
        nonlocal total
        total = total + loss.detach()
        values[:, :cols].index_copy_(0, index, old)

    if boundary is not None:
        for batch in row_batches(rollout, max_tokens=microbatch_budget(microbatch_tokens, num_samples, width)):
            with microbatch_memory():
                responses = rollout.responses.flatten(0, 1).index_select(0, batch.index)[:, : batch.width]
                v = suffix_values(critic, boundary.leaf, batch.rows, responses, batch.lens)
            backward(v, batch.index, batch.width)
        boundary.backward_through_prefix()
    else:
        for p, prompt in enumerate(prompts):
            with microbatch_memory():
                v = whole_values(critic, prompt, rollout.responses[p], rollout.response_lens[p])
            index = torch.arange(p * num_samples, (p + 1) * num_samples, device=mask.device)
            backward(v, index, width)
    return CriticResult(values.view(num_prompts, num_samples, width), total)
