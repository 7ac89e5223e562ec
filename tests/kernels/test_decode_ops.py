"""The fused decode kernels equal the eager torch ops of the model they replace, and read a split product's parts
as its sum."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernels_testkit import DEVICE, DTYPE, assert_matches, random

from rollplex.kernels.decode_ops import add_rms_norm, rotary_to_cache, silu_mul
from rollplex.kernels.tiles import sum_splits
from rollplex.models.config import load_model_config
from rollplex.models.layers import RMSNorm
from rollplex.models.rotary import apply_rotary, text_rotary


def test_add_rms_norm_equals_residual_add_then_the_models_rmsnorm():
    residual, delta = random(5, 96, seed=1), random(5, 96, seed=2)
    norm = RMSNorm(96, 1e-6).to(DEVICE, DTYPE)
    norm.weight.data = random(96, seed=3)
    out, updated = torch.empty_like(residual), residual.clone()
    add_rms_norm(delta, updated, norm.weight, 1e-6, out)
    assert torch.equal(updated, residual + delta)
    assert_matches(out, norm(residual + delta))
    add_rms_norm(None, residual, norm.weight, 1e-6, out)
    assert_matches(out, norm(residual))


def test_silu_mul_equals_eager_silu_times_up():
    gate, up = random(3, 300, seed=1), random(3, 300, seed=2)
    out = silu_mul(torch.cat([gate, up], dim=1), torch.empty_like(gate), block=128)
    assert_matches(out, F.silu(gate) * up)


def test_rotary_to_cache_rotates_q_and_k_by_the_text_position_and_writes_the_rows_slot():
    text = load_model_config("tiny").text
    heads, groups, d = text.num_attention_heads, text.num_key_value_heads, text.head_dim
    num_samples, max_tokens, step = 2, 6, 4
    slots, next_positions = torch.tensor([1, 2, 5]), torch.tensor([7, 30, 12, 0])
    rows = len(slots)
    q, k, v = random(rows, heads * d, seed=1), random(rows, groups * d, seed=2), random(rows, groups * d, seed=3)
    positions = torch.arange(64).expand(3, 1, 64)
    cos, sin = (t[0, 0].contiguous().to(DEVICE) for t in text_rotary(positions, text))  # [64, D]
    k_cache = torch.zeros(7, groups, max_tokens, d, dtype=DTYPE, device=DEVICE)
    v_cache, q_out = torch.zeros_like(k_cache), torch.empty(rows, heads, d, dtype=DTYPE, device=DEVICE)
    rotary_to_cache(
        torch.cat([q, k, v], dim=1), cos, sin, slots.to(DEVICE), next_positions.to(DEVICE),
        torch.tensor([step], device=DEVICE), q_out, k_cache, v_cache, num_samples,
    )  # fmt: skip
    at = (next_positions[slots // num_samples] + step).to(DEVICE)  # [rows]
    c, s = cos[at][:, None], sin[at][:, None]  # [rows, 1, D]
    assert_matches(q_out, apply_rotary(q.view(rows, heads, d), c, s))
    assert_matches(k_cache[slots, :, step], apply_rotary(k.view(rows, groups, d), c, s))
    assert torch.equal(v_cache[slots, :, step], v.view(rows, groups, d))
    others = torch.ones(7, dtype=torch.bool)
    others[slots] = False
    assert not k_cache[others].any() and not k_cache[:, :, :step].any()


BF16 = torch.bfloat16  # the parts tests run in bf16 even in the interpreter (no tl.dot here): the rounding shows


def bf16(*shape: int, seed: int) -> torch.Tensor:
    return random(*shape, seed=seed).to(BF16)


def split(product: torch.Tensor, num_parts: int, seed: int) -> torch.Tensor:
    """fp32 parts [S, *product.shape] that add up to `product` (random, so that the order of adding them shows)."""
    parts = random(num_parts, *product.shape, seed=seed).float()
    parts[-1] = product.float() - parts[:-1].sum(0)
    return parts


def sum_of(parts: torch.Tensor) -> torch.Tensor:
    """What the split's own sum kernel stores: the parts added in order, rounded to bf16."""
    y = torch.empty(parts.shape[1:], dtype=BF16, device=DEVICE)
    sum_splits(parts, y)
    return y


def test_add_rms_norm_adds_a_splits_parts_as_sum_splits_does():
    product = random(4, 96, seed=2).float() / 3  # not a bf16 value (on a GPU `random` gives bf16): the sum rounds
    residual, parts, weight = bf16(4, 96, seed=1), split(product, 3, seed=4), bf16(96, seed=3)
    fused, unfused = residual.clone(), residual.clone()
    out_fused, out_unfused = torch.empty_like(residual), torch.empty_like(residual)
    add_rms_norm(parts, fused, weight, 1e-6, out_fused)
    add_rms_norm(sum_of(parts), unfused, weight, 1e-6, out_unfused)
    assert torch.equal(fused, unfused) and torch.equal(out_fused, out_unfused)
    unrounded = residual.float() + parts.sum(0)  # without the sum's rounding to bf16 the result differs
    assert not torch.equal(fused, unrounded.to(BF16))


def test_fused_kernels_refuse_parts_of_another_shape_or_a_low_precision_split():
    residual, out, weight = bf16(4, 96, seed=1), bf16(4, 96, seed=2), bf16(96, seed=3)
    with pytest.raises(AssertionError, match="expected \\[S, \\*\\(4, 96\\)\\]"):
        add_rms_norm(bf16(2, 4, 48, seed=4), residual, weight, 1e-6, out)
    with pytest.raises(AssertionError, match=r"2 parts of torch\.bfloat16"):
        add_rms_norm(bf16(2, 4, 96, seed=4), residual, weight, 1e-6, out)


def test_rotary_to_cache_reads_a_splits_parts_as_their_sum():
    text = load_model_config("tiny").text
    heads, groups, d = text.num_attention_heads, text.num_key_value_heads, text.head_dim
    slots, next_positions, step = torch.tensor([0, 3], device=DEVICE), torch.tensor([5, 9, 0], device=DEVICE), 2
    parts = split(random(2, (heads + 2 * groups) * d, seed=1).float() / 3, 2, seed=2)  # not bf16 values
    cos, sin = (t[0, 0].contiguous().to(DEVICE) for t in text_rotary(torch.arange(32).expand(3, 1, 32), text))
    results = []
    for product in (parts, sum_of(parts)):
        k_cache = torch.zeros(5, groups, 4, d, dtype=BF16, device=DEVICE)
        v_cache, q_out = torch.zeros_like(k_cache), torch.empty(2, heads, d, dtype=BF16, device=DEVICE)
        rotary_to_cache(
            product, cos, sin, slots, next_positions, torch.tensor([step], device=DEVICE), q_out, k_cache, v_cache, 2
        )
        results.append((q_out, k_cache, v_cache))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
