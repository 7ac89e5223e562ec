"""PPO's arithmetic beside GRPO's (`grpo.py`): the sequence reward at a response's last token, generalised
advantage estimation over the critic's values, advantages whitened over the step, and the clipped value loss.

Pure tensor math. Shapes: [..., R] per response token, `mask` marks real tokens; a value past a response's end
is 0 (the return after the last token is the reward alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rollplex.executors.grpo import LossScale
from rollplex.models.generate import Rollout

WHITEN_EPS = 1e-8


@dataclass(frozen=True, slots=True)
class PpoConfig:
    gamma: float
    lam: float
    value_clip: float


def token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """rewards [...] of whole responses -> [..., R]: each at its response's last real token, 0 elsewhere."""
    lens = mask.sum(dim=-1, keepdim=True).long()
    last = torch.arange(mask.shape[-1], device=mask.device) == (lens - 1)
    return torch.where(last & mask, rewards.unsqueeze(-1).to(torch.float32), 0.0)


def gae(cfg: PpoConfig, rewards: Tensor, values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Advantages and returns [..., R] from token rewards and values [..., R] (both 0 past each end):
    delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}, returns A + V."""
    values = values.where(mask, 0.0)
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[..., 0])
    width = values.shape[-1]
    for t in reversed(range(width)):
        following = values[..., t + 1] if t + 1 < width else torch.zeros_like(running)
        delta = rewards[..., t] + cfg.gamma * following - values[..., t]
        running = delta + cfg.gamma * cfg.lam * running
        advantages[..., t] = running
    advantages = advantages.where(mask, 0.0)
    return advantages, (advantages + values).where(mask, 0.0)


def whiten(x: Tensor, mask: Tensor, dp=None) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the real tokens (population variance), 0 elsewhere; under data
    parallelism (`dp`) over every rank's real tokens (two passes: the mean, then the squared deviations)."""
    real = x[mask]
    if dp is None:
        mean, var = real.mean(), real.var(unbiased=False)
    else:
        total, count = dp.sum([float(real.double().sum()), float(real.numel())])
        mean = torch.tensor(total / count, dtype=x.dtype, device=x.device)
        (squares,) = dp.sum([float((real - mean).double().square().sum())])
        var = torch.tensor(squares / count, dtype=x.dtype, device=x.device)
    return ((x - mean) * torch.rsqrt(var + WHITEN_EPS)).where(mask, 0.0)


def value_loss(
    cfg: PpoConfig, scale: LossScale, values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor
) -> Tensor:
    """0.5 max((V - R)^2, (clip(V, V_old +- value_clip) - R)^2) summed over real tokens, over the step's tokens."""
    clipped = old_values + (values - old_values).clamp(-cfg.value_clip, cfg.value_clip)
    per_token = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return (per_token * mask.to(per_token.dtype)).sum() / scale.num_tokens


def advantages(cfg: PpoConfig, rewards: Tensor, values: Tensor, rollout: Rollout, dp=None) -> Tensor:
    """PPO's per-token advantages [P, N, R]: GAE over the critic's values, whitened over the step's tokens (every
    data-parallel rank's)."""
    width = rollout.responses.shape[-1]
    mask = torch.arange(width, device=values.device) < rollout.response_lens[..., None].to(values.device)
    raw, _ = gae(cfg, token_rewards(rewards.to(values.device), mask), values, mask)
    return whiten(raw, mask, dp)
