"""Whether two runs' updates agree: the gradient sketch, the distances, and the noise floor's widening."""

from __future__ import annotations

import torch

from rollplex.bench.agreement import GRAD_SKETCH, grad_sketch, relative_difference, same_rollout, updates_match


def test_the_first_step_comparison_needs_the_same_tokens_and_close_gradients():
    model = torch.nn.Linear(64, 100)
    model(torch.randn(3, 64)).square().sum().backward()
    sketch = grad_sketch(p.grad for p in model.parameters())
    assert sketch.numel() == min(GRAD_SKETCH, 6400) + 100 and sketch.dtype == torch.float32
    assert relative_difference(sketch, sketch) == 0.0
    assert abs(relative_difference(sketch, 1.01 * sketch) - 0.01) < 1e-6
    assert relative_difference(sketch, None) == float("inf")
    tokens, lens = torch.arange(12).view(1, 3, 4), torch.tensor([[4, 2, 3]])
    assert same_rollout((tokens, lens), (tokens.clone(), lens.clone()))
    assert not same_rollout((tokens, lens), (tokens + 1, lens)) and not same_rollout((tokens, lens), None)


def test_a_measured_noise_floor_widens_the_gradient_tolerance_to_twice_itself_and_no_more():
    assert updates_match(True, 0.009, "bfloat16") and not updates_match(True, 0.015, "bfloat16")
    assert updates_match(True, 0.015, "bfloat16", noise_floor=0.01)  # serial differs from itself by 1e-2
    assert not updates_match(True, 0.021, "bfloat16", noise_floor=0.01)
    assert updates_match(True, 0.009, "bfloat16", noise_floor=0.0)  # never below the dtype's tolerance
    assert not updates_match(True, 0.015, "bfloat16", noise_floor=float("inf"))  # an unmeasured floor widens nothing
    assert not updates_match(False, 0.0, "bfloat16", noise_floor=0.01)  # other tokens never match
    assert updates_match(True, 0.04, "bfloat16", noise_floor=0.1) and not updates_match(True, 0.06, "bfloat16", 0.1)
