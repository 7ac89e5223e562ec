"""The AdamW update, op for op torch's single-tensor `torch.optim.AdamW` step, and its hyperparameters.

Not here: where the state lives and how it streams through the device (`rollplex.memory.optimizer`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AdamWConfig:
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2
    max_grad_norm: float | None = None

    def __post_init__(self) -> None:
        if not all(0.0 <= beta < 1.0 for beta in self.betas):
            raise ValueError(f"betas {self.betas} must lie in [0, 1)")
        if self.lr < 0 or self.eps < 0 or self.weight_decay < 0:
            raise ValueError(f"lr {self.lr}, eps {self.eps} and weight_decay {self.weight_decay} must be >= 0")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm {self.max_grad_norm} must be positive, or None to not clip")


def adamw_(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    denom: torch.Tensor,
    config: AdamWConfig,
    step: int,
) -> None:
    """One AdamW update in place, op for op torch's single-tensor AdamW; `denom` is scratch of grad's size."""
    beta1, beta2 = config.betas
    if config.weight_decay != 0:
        master.mul_(1 - config.lr * config.weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step_size = config.lr / (1 - beta1 ** float(step))
    torch.sqrt(exp_avg_sq, out=denom)
    denom.div_((1 - beta2 ** float(step)) ** 0.5).add_(config.eps)
    master.addcdiv_(exp_avg, denom, value=-step_size)
