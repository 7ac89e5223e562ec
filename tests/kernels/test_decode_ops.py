"""The fused decode kernels equal the eager torch ops of the model they replace."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kernels_testkit import DEVICE, DTYPE, assert_matches, random

from rollplex.kernels.decode_ops import add_rms_norm, rotary_to_cache, silu_mul
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
