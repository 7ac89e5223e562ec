"""Multimodal rotary position ids of a token sequence: Qwen2.5-VL's `get_rope_index` rule.

Text tokens advance by one on all three axes (temporal, height, width). A visual's tokens form a grid that
starts at the current position: temporal = start + floor(frame * tokens_per_second * second_per_grid_t) for a
video (start for an image), height = start + row, width = start + column. Text after a visual, and the first
response token after a prompt, continue at the largest position so far + 1.

That last rule is Qwen's original one, which the released checkpoints were trained with. transformers 5.x
resumes text after a visual at start + max(rows, columns) instead, ignoring the temporal axis; the two agree
unless a video's temporal span exceeds its spatial span. Ours keeps a full forward over prompt ++ response
consistent with the boundary's next position. Some transformers 5.x releases (5.17 among them) also truncate
second_per_grid_t to an integer; ours keeps the fraction, as Qwen's code and transformers 5.24 do.

Not here: the cos/sin tables (`rotary.py`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from rollplex.models.config import ModelConfig, VisionConfig
from rollplex.models.inputs import Visual


def num_visual_tokens(visual: Visual, vision: VisionConfig) -> int:
    """Tokens a visual occupies in the prompt: its patches over the spatial merge unit."""
    return visual.num_patches // vision.merge_unit


def visual_positions(visual: Visual, start: int, vision: VisionConfig) -> Tensor:
    """[3, num_visual_tokens] position ids of one visual's tokens, its grid starting at `start`."""
    t, h, w = visual.grid_thw
    m = vision.spatial_merge_size
    step = vision.tokens_per_second * visual.second_per_grid_t if visual.is_video else 1.0
    temporal = (torch.arange(t) * step).long()
    grid = torch.meshgrid(temporal, torch.arange(h // m), torch.arange(w // m), indexing="ij")
    return torch.stack(grid).reshape(3, -1) + start


def sequence_positions(
    input_ids: Tensor, visuals: Sequence[Visual], config: ModelConfig, text_from: int | None = None
) -> tuple[Tensor, int]:
    """Position ids [3, L] of one sequence, and the position of the token that would follow it.

    Tokens from `text_from` on (a sampled response) are text even if their ids are image/video ids."""
    is_visual = visual_token_mask(input_ids, config, text_from)
    runs, counts = torch.unique_consecutive(is_visual.cpu(), return_counts=True)
    pending = iter(visuals)
    parts: list[Tensor] = []
    next_position = 0
    for run_is_visual, count in zip(runs.tolist(), counts.tolist(), strict=True):
        if run_is_visual:
            run = _visual_run(count, pending, next_position, config.vision)
        else:
            run = torch.arange(next_position, next_position + count).expand(3, -1)
        parts.append(run)
        next_position = int(run.max()) + 1
    if next(pending, None) is not None:
        raise ValueError(f"prompt has {len(visuals)} visuals but fewer runs of image/video tokens to hold them")
    return torch.cat(parts, dim=1), next_position


def visual_token_mask(input_ids: Tensor, config: ModelConfig, text_from: int | None = None) -> Tensor:
    """[..., L] bool: image/video tokens before `text_from`."""
    tokens = config.tokens
    is_visual = (input_ids == tokens.image) | (input_ids == tokens.video)
    if text_from is not None:
        is_visual = is_visual & (torch.arange(input_ids.shape[-1], device=input_ids.device) < text_from)
    return is_visual


def _visual_run(count: int, pending: Iterator[Visual], start: int, vision: VisionConfig) -> Tensor:
    """Positions [3, count] of a run of `count` visual tokens, filled by the next visual(s) of the prompt."""
    parts = []
    while count > 0:
        visual = next(pending, None)
        if visual is None:
            raise ValueError(f"{count} image/video tokens have no visual: add the visual or drop the tokens")
        parts.append(visual_positions(visual, start, vision))
        start = int(parts[-1].max()) + 1
        count -= parts[-1].shape[1]
    if count < 0:
        raise ValueError(f"a visual needs {-count} more image/video tokens than the prompt holds for it")
    return torch.cat(parts, dim=1)
