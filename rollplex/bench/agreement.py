"""Whether two runs' updates agree: the first step's rollouts as tokens, and its gradients (a strided sketch)
within the rounding of the model dtype, widened to a measured noise floor where that is larger.

Used by `rollplex bench` (serial against rollplex) and its saved baselines; pure functions of tensors.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

GRAD_SKETCH = 4096  # gradient elements sampled per parameter (strided) for the first-step comparison


def grad_sketch(grads: Iterable[torch.Tensor | None]) -> torch.Tensor:
    """A strided sample of at most GRAD_SKETCH elements of every gradient, FP32 on the CPU."""
    parts = []
    for g in grads:
        if g is not None:
            flat = g.detach().reshape(-1)
            parts.append(flat[:: max(1, flat.numel() // GRAD_SKETCH)][:GRAD_SKETCH].float().cpu())
    return torch.cat(parts) if parts else torch.zeros(0)


def same_rollout(a: tuple | None, b: tuple | None) -> bool:
    return a is not None and b is not None and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def relative_difference(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """||a - b|| / ||a|| (0 for equal vectors; inf when either is missing or they differ in size)."""
    if a is None or b is None or a.shape != b.shape:
        return float("inf")
    scale = float(a.norm()) or 1.0
    return float((a - b).norm()) / scale


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over parameters of max |a - b| / max |a| (0 for equal weights)."""
    worst = 0.0
    for name, x in a.items():
        scale = float(x.float().abs().max()) or 1.0
        worst = max(worst, float((x.float() - b[name].float()).abs().max()) / scale)
    return worst


FLOOR_MARGIN = 2.0  # rollplex's gradient difference from serial may reach this multiple of serial's own
FLOOR_CAP = 5.0  # ... but never more than this multiple of the dtype's tolerance: a larger floor is a bug


def updates_match(rollouts_match: bool, grad_difference: float, dtype: str, noise_floor: float | None = None) -> bool:
    """The first step's rollouts are the same tokens and its gradients agree within the dtype's rounding: the
    dtype's tolerance, or FLOOR_MARGIN times the measured noise floor where that is larger (rollplex adds its own
    rounding differences, the SM partition's kernels and run-to-run atomics, to the grouping's), up to FLOOR_CAP
    times the tolerance (a floor that large means the grouping itself changes the gradient: nothing is widened)."""
    bound = tolerance(dtype)
    if noise_floor is not None and math.isfinite(noise_floor):
        bound = min(max(bound, FLOOR_MARGIN * noise_floor), FLOOR_CAP * bound)
    return rollouts_match and grad_difference <= bound


def tolerance(dtype: str) -> float:
    return 1e-2 if dtype == "bfloat16" else 1e-5  # a few units of the last place, relative to the tensor
