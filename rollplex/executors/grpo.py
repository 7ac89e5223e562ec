"""GRPO's arithmetic: group-normalised advantages and the per-token policy loss (clipped ratio, k3 KL, entropy),
which PPO's actor shares with per-token advantages (`ppo.py`).

Pure tensor math on log-probabilities; no model. Shapes: one prompt group is [N, R] (N responses of up to
R tokens); `mask` marks real response tokens. The loss of a microbatch is returned already divided by the
normaliser of the whole step (`LossScale`), so summing microbatch losses (or their gradients) gives exactly
the loss of the full batch, however it is split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

ADVANTAGE_EPS = 1e-6
LOG_RATIO_LIMIT = 20.0  # a log ratio's most before exp: FP32 stays finite, so no inf x 0 = NaN (below, exp only
# underflows to 0 and the gradient is kept)


def group_advantages(rewards: Tensor) -> Tensor:
    """rewards [P, N] -> (r - mean over the group) / (unbiased std over the group + eps), [P, N]. A group whose
    rewards are all equal, one response among them, has advantage 0 (verl's group of one gets its raw reward): it
    has nothing to be compared with. That 0 is set, not computed: a float32 mean of rewards such as 0.7 lands an
    ulp off them, and that ulp over eps would be an advantage of 0.1 for every response of the group."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True) if rewards.shape[1] > 1 else torch.zeros_like(mean)
    agrees = rewards.amax(dim=1, keepdim=True) == rewards.amin(dim=1, keepdim=True)
    return ((rewards - mean) / (std + ADVANTAGE_EPS)).masked_fill(agrees, 0.0)


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """The k3 estimator of KL(pi || ref) per token: exp(ref - lp) - (ref - lp) - 1 (non-negative), with
    ref - lp clamped to at most LOG_RATIO_LIMIT."""
    delta = (ref_logprobs - logprobs).clamp(max=LOG_RATIO_LIMIT)
    return torch.exp(delta) - delta - 1


@dataclass(frozen=True, slots=True)
class GrpoConfig:
    clip_ratio: float
    kl_coef: float
    entropy_coef: float
    loss_agg: Literal["token_mean", "seq_mean"]


@dataclass(frozen=True, slots=True)
class LossScale:
    """The whole step's normaliser: its number of response tokens (token_mean) or sequences (seq_mean)."""

    num_tokens: int
    num_sequences: int


def loss_scale(mask: Tensor) -> LossScale:
    """mask [P, N, R] of the whole step."""
    return LossScale(int(mask.sum()), int(mask.shape[0] * mask.shape[1]))


@dataclass(frozen=True)
class GroupLoss:
    loss: Tensor  # scalar, this microbatch's share of the step's loss
    kl: Tensor  # scalar sums over real tokens (detached), for metrics
    entropy: Tensor
    clipped: Tensor  # tokens where the clip binds (`_binding_clip`)


def grpo_loss(
    cfg: GrpoConfig,
    scale: LossScale,
    logprobs: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor | None,
    advantages: Tensor,
    entropy: Tensor,
    mask: Tensor,
) -> GroupLoss:
    """logprobs, old_logprobs, ref_logprobs, entropy, mask: [..., R]; advantages: [...] per sequence (GRPO) or
    [..., R] per token (PPO)."""
    mask = mask.to(logprobs.dtype)
    ratio = torch.exp((logprobs - old_logprobs).clamp(max=LOG_RATIO_LIMIT))
    adv = advantages if advantages.dim() == logprobs.dim() else advantages.unsqueeze(-1)
    clipped_ratio = ratio.clamp(1 - cfg.clip_ratio, 1 + cfg.clip_ratio)
    per_token = -torch.minimum(ratio * adv, clipped_ratio * adv)
    kl = k3_kl(logprobs, ref_logprobs) if ref_logprobs is not None else torch.zeros_like(logprobs)
    if cfg.kl_coef > 0:
        per_token = per_token + cfg.kl_coef * kl
    if cfg.entropy_coef > 0:
        per_token = per_token - cfg.entropy_coef * entropy
    return GroupLoss(
        loss=_aggregate(cfg, scale, per_token, mask),
        kl=(kl * mask).sum().detach(),
        entropy=(entropy * mask).sum().detach(),
        clipped=(_binding_clip(ratio, adv, cfg.clip_ratio).to(mask.dtype) * mask).sum().detach(),
    )


def _binding_clip(ratio: Tensor, adv: Tensor, clip_ratio: float) -> Tensor:
    """Where the clip decides the loss (TRL's rule): the ratio below 1 - eps with a negative advantage, or above
    1 + eps with a positive one; elsewhere the unclipped term is the minimum and the clip changes nothing."""
    return ((ratio < 1 - clip_ratio) & (adv < 0)) | ((ratio > 1 + clip_ratio) & (adv > 0))


def _aggregate(cfg: GrpoConfig, scale: LossScale, per_token: Tensor, mask: Tensor) -> Tensor:
    if cfg.loss_agg == "token_mean":
        return (per_token * mask).sum() / scale.num_tokens
    lengths = mask.sum(dim=-1).clamp(min=1)
    return ((per_token * mask).sum(dim=-1) / lengths).sum() / scale.num_sequences
