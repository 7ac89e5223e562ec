"""Rotary embeddings: the decoder's multimodal rotary (mrope) and the vision encoder's 2D rotary.

Turns position ids into cos/sin tables and rotates queries and keys with them. Which position each token gets
is decided elsewhere (`positions.py` for the decoder, `vision_layout.py` for patches). Tables are computed in
float32 from the config on every call and never stored as buffers, so a model built on the meta device has
nothing to fill.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollplex.models.config import TextConfig
from rollplex.models.layers import gpu_compiled

VISION_ROPE_THETA = 10_000.0


def inverse_frequencies(dim: int, theta: float, device: torch.device) -> Tensor:
    """[dim // 2] float32: theta ** (-2i / dim)."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)


def rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


@gpu_compiled
def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotates x [..., D] by cos/sin (broadcastable to x) in float32; returns x's dtype."""
    x32 = x.float()
    return (x32 * cos + rotate_half(x32) * sin).to(x.dtype)


@gpu_compiled
def rotated_packed_qkv(qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q and k of qkv [S, 3, heads, D] (the vision tower's one GEMM output), rotated, and v: [S, heads, D] each.
    The whole output goes into the compiled chain: a q or k view's row stride is none of its sizes, and handed to a
    chain compiled for varying lengths such a stride becomes a symbol the kernel indexes its rows through. v comes
    out as a tensor of its own, not a view of qkv: autograd then takes qkv's whole gradient from this chain's
    backward, one kernel, where a view's gradient would be added to it apart (an add of qkv's size), and the
    attention, which keeps v, does not keep all of qkv alive."""
    return apply_rotary.eager(qkv[:, 0], cos, sin), apply_rotary.eager(qkv[:, 1], cos, sin), qkv[:, 2].contiguous()


@gpu_compiled
def split_rotated(qkv: Tensor, cos: Tensor, sin: Tensor, num_heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """q, k and v of one [q; k; v] projection's output qkv [B, T, (heads + 2 kv_heads) D] (`packing.packed_linear`),
    q and k rotated: [B, heads, T, D] and [B, kv_heads, T, D] twice. v is a view of qkv: its gradient is added to
    the chain's (an add of qkv's size, small beside the projection at a decoder's widths); a copy of it, which
    would spare that add, cannot leave a compiled layer (`compile_halves`) as the transposed view the attention
    takes: Inductor then checks its strides against a length it does not know."""
    head_dim = cos.shape[-1]
    heads = qkv.unflatten(-1, (-1, head_dim)).transpose(1, 2)  # [B, heads + 2 kv_heads, T, D]
    kv_heads = (heads.shape[1] - num_heads) // 2
    q, k, v = heads.split([num_heads, kv_heads, kv_heads], dim=1)
    return apply_rotary.eager(q, cos, sin), apply_rotary.eager(k, cos, sin), v


def text_rotary(positions: Tensor, text: TextConfig) -> tuple[Tensor, Tensor]:
    """positions [3, B, T] (temporal, height, width) -> cos, sin [B, 1, T, head_dim], broadcast over heads.

    The head dimension's frequency slots are split by `mrope_section`: the first section rotates by the
    temporal position, the second by the height position, the third by the width position.
    """
    inv_freq = inverse_frequencies(text.head_dim, text.rope_theta, positions.device)  # [D/2]
    freqs = positions[..., None].float() * inv_freq  # [3, B, T, D/2]
    sections = freqs.split(list(text.mrope_section), dim=-1)
    freqs = torch.cat([section[axis] for axis, section in enumerate(sections)], dim=-1)  # [B, T, D/2]
    angles = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, D]
    return angles.cos(), angles.sin()


def vision_rotary(rows: Tensor, cols: Tensor, head_dim: int) -> tuple[Tensor, Tensor]:
    """Patch rows, cols [S] -> cos, sin [S, 1, head_dim]: half the slots rotate by row, half by column."""
    inv_freq = inverse_frequencies(head_dim // 2, VISION_ROPE_THETA, rows.device)  # [D/4]
    freqs = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)  # [S, D/2]
    angles = torch.cat([freqs, freqs], dim=-1)[:, None]  # [S, 1, D]
    return angles.cos(), angles.sin()
