"""Building blocks shared by the vision encoder and the language decoder: RMSNorm and the gated (SwiGLU) MLP.

Not here: attention (`attention.py`, `decoder.py`, `vision.py`) and rotary embeddings (`rotary.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and returned in the input's dtype (as HF does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # F.rms_norm: one fused kernel on CUDA (forward and backward) for x * rsqrt(mean(x^2) + eps) in FP32;
        # the weight multiplies after the cast back, in the input's dtype, as HF does
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); the vision blocks use biases, the decoder does not."""

    def __init__(self, dim: int, hidden: int, *, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
