"""The Qwen2.5-VL vision encoder: patch embedding, blocks with window / full attention and 2D rotary, patch
merger.

Input: the visuals' preprocessed patches. Output: one embedding per merged token, in the order the prompt's
image/video tokens hold them. Parameter names follow HF (`patch_embed.proj`, `blocks.{i}.attn.qkv`,
`merger.mlp.0`). Not here: which patch attends to which (`vision_layout.py`), the rotary tables (`rotary.py`).
"""

from __future__ import annotations

from collections.abc import Generator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rollplex.models.chunks import drain
from rollplex.models.config import VisionConfig
from rollplex.models.inputs import Visual
from rollplex.models.layers import GatedMLP, RMSNorm
from rollplex.models.rotary import apply_rotary, vision_rotary
from rollplex.models.vision_layout import patch_layout, segment_groups

VISION_NORM_EPS = 1e-6


def segment_attention(q: Tensor, k: Tensor, v: Tensor, groups: Sequence[Tensor]) -> Tensor:
    """Attention within segments: q, k, v [S, heads, D] -> [S, heads, D]; groups from `segment_groups`."""
    out = torch.zeros_like(q)
    for members in groups:  # [num_segments, length]
        q_s, k_s, v_s = (x[members].transpose(1, 2) for x in (q, k, v))  # [num_segments, heads, length, D]
        o = F.scaled_dot_product_attention(q_s, k_s, v_s)
        out = out.index_copy(0, members.flatten(), o.transpose(1, 2).flatten(0, 1))
    return out


class PatchEmbed(nn.Module):
    """A Conv3d whose kernel is the whole patch, applied as the equivalent matmul over flattened patches."""

    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        kernel = (vision.temporal_patch_size, vision.patch_size, vision.patch_size)
        self.proj = nn.Conv3d(vision.in_channels, vision.hidden_size, kernel, stride=kernel, bias=False)

    def forward(self, pixels: Tensor) -> Tensor:
        """pixels [S, in_channels * temporal_patch_size * patch_size**2] -> [S, hidden]."""
        return F.linear(pixels.to(self.proj.weight.dtype), self.proj.weight.flatten(1))


class VisionAttention(nn.Module):
    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        self.num_heads = vision.num_heads
        self.qkv = nn.Linear(vision.hidden_size, 3 * vision.hidden_size)
        self.proj = nn.Linear(vision.hidden_size, vision.hidden_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, groups: Sequence[Tensor]) -> Tensor:
        num_patches, hidden = x.shape
        q, k, v = self.qkv(x).view(num_patches, 3, self.num_heads, -1).unbind(1)  # [S, heads, D] each
        out = segment_attention(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, groups)
        return self.proj(out.reshape(num_patches, hidden))


class VisionBlock(nn.Module):
    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(vision.hidden_size, VISION_NORM_EPS)
        self.norm2 = RMSNorm(vision.hidden_size, VISION_NORM_EPS)
        self.attn = VisionAttention(vision)
        self.mlp = GatedMLP(vision.hidden_size, vision.intermediate_size, bias=True)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, groups: Sequence[Tensor]) -> Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, groups)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Norms each patch, concatenates the m x m patches of a merge unit and projects them to the LLM width."""

    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        merged = vision.hidden_size * vision.merge_unit
        self.ln_q = RMSNorm(vision.hidden_size, VISION_NORM_EPS)
        self.mlp = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, vision.out_hidden_size))

    def forward(self, x: Tensor) -> Tensor:
        """x [S, hidden] -> [S / merge_unit, out_hidden]."""
        return self.mlp(self.ln_q(x).view(-1, self.mlp[0].in_features))


class VisionEncoder(nn.Module):
    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        self.config = vision
        self.patch_embed = PatchEmbed(vision)
        self.blocks = nn.ModuleList(VisionBlock(vision) for _ in range(vision.depth))
        self.merger = PatchMerger(vision)

    def forward(self, visuals: Sequence[Visual]) -> Tensor:
        """Visuals -> [num_visual_tokens, out_hidden]: their merged tokens, concatenated in order."""
        return drain(self.chunks(visuals, blocks_per_chunk=len(self.blocks)))

    def chunks(self, visuals: Sequence[Visual], blocks_per_chunk: int) -> Generator[None, None, Tensor]:
        """`forward` as a generator that pauses after every `blocks_per_chunk` blocks (the patch embedding runs
        with the first ones, the merger with the last): the same ops in the same order."""
        device = self.merger.mlp[0].weight.device
        layout = patch_layout([visual.grid_thw for visual in visuals], self.config)
        cos, sin = vision_rotary(layout.rows.to(device), layout.cols.to(device), self.config.head_dim)
        frames = [members.to(device) for members in segment_groups(layout.frames)]
        windows = [members.to(device) for members in segment_groups(layout.windows)]
        x = self.patch_embed(torch.cat([visual.pixel_values for visual in visuals]).to(device))
        for index, block in enumerate(self.blocks):
            if index and index % blocks_per_chunk == 0:
                yield
            x = block(x, cos, sin, frames if index in self.config.fullatt_block_indexes else windows)
        return self.merger(x)
