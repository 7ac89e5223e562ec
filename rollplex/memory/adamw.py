"""The AdamW update (torch's fused AdamW kernel: `torch.optim.AdamW(fused=True)`'s step) and its hyperparameters.

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
    step: torch.Tensor,
    config: AdamWConfig,
) -> None:
    """One AdamW update in place: torch's fused AdamW kernel (what `torch.optim.AdamW(fused=True)` runs), one
    launch that reads the four FP32 arrays once and writes three; `step` is the step number, a 0-d FP32 tensor on
    their device. Chosen over torch's single-tensor AdamW (eight elementwise ops, about three times the HBM
    traffic and eight launches a chunk, which a deferred update feeds to the device beside the next prefix): same
    formula, the master weights within one ulp of it."""
    beta1, beta2 = config.betas
    torch._fused_adamw_(
        [master], [grad], [exp_avg], [exp_avg_sq], [], [step],
        lr=config.lr, beta1=beta1, beta2=beta2, weight_decay=config.weight_decay, eps=config.eps, amsgrad=False,
        maximize=False,
    )  # fmt: skip
