"""Where each patch of the visuals sits: its row and column (for the 2D rotary), and the frame and the window
it attends within. Pure index arithmetic on grid sizes, no weights.

Patches arrive in the processor's order: per frame, merge units row-major, the m x m patches of a unit
row-major. Full-attention blocks attend within a frame; the other blocks within a window of `window_size //
(patch_size * m)` merge units square, tiled from the frame's top-left corner and ragged at its right and
bottom edges (the windows transformers' Qwen2.5-VL builds). Attention is order-free within a segment: in the
processor's order a segment is a list of indices (`segment_groups`); in window order (`window_order`) every
window and every frame is a run of consecutive patches (`segment_bounds`), which a variable-length attention
kernel takes as it lies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rollplex.models.config import VisionConfig


@dataclass(frozen=True)
class PatchLayout:
    """Per patch [S] int64: row and column in its frame, frame id and window id (unique over all visuals)."""

    rows: Tensor
    cols: Tensor
    frames: Tensor
    windows: Tensor

    def take(self, order: Tensor) -> PatchLayout:
        """The layout of the patches in `order` (patch indices), by `index_select`: on the host, indexing by a
        permutation as `t[order]` runs far slower."""
        return PatchLayout(*(t.index_select(0, order) for t in (self.rows, self.cols, self.frames, self.windows)))


def patch_layout(grids: Sequence[tuple[int, int, int]], vision: VisionConfig) -> PatchLayout:
    """Layout of the patches of several visuals, concatenated in order."""
    parts = []
    num_frames = num_windows = 0
    for grid in grids:
        rows, cols, frames, windows = _visual_layout(grid, vision)
        parts.append((rows, cols, frames + num_frames, windows + num_windows))
        num_frames += int(frames.max()) + 1
        num_windows += int(windows.max()) + 1
    return PatchLayout(*(torch.cat(column) for column in zip(*parts, strict=True)))


def _visual_layout(grid: tuple[int, int, int], vision: VisionConfig) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    t, h, w = grid
    m = vision.spatial_merge_size
    side = vision.window_size // m // vision.patch_size  # window side, in merge units
    windows_per_row = -(-(w // m) // side)
    windows_per_frame = -(-(h // m) // side) * windows_per_row
    frame, unit_row, unit_col, row_in_unit, col_in_unit = torch.meshgrid(
        *(torch.arange(n) for n in (t, h // m, w // m, m, m)), indexing="ij"
    )
    window = frame * windows_per_frame + (unit_row // side) * windows_per_row + unit_col // side
    rows = unit_row * m + row_in_unit
    cols = unit_col * m + col_in_unit
    return rows.flatten(), cols.flatten(), frame.flatten(), window.flatten()


def segment_groups(segment_ids: Tensor) -> list[Tensor]:
    """Member indices of each segment, batched by length: one [num_segments, length] tensor per length.

    Members keep their order of appearance, so a segment's indices are increasing.
    """
    lengths = torch.bincount(segment_ids)  # [num_segments]
    starts = lengths.cumsum(0) - lengths
    order = torch.argsort(segment_ids, stable=True)
    return [order[starts[lengths == n][:, None] + torch.arange(n)] for n in lengths.unique().tolist() if n > 0]


def window_order(layout: PatchLayout) -> Tensor:
    """The patches sorted by window, each window's in their order of appearance: every window, and so every frame
    (window ids grow with the frame), is a run of consecutive patches; a merge unit's m x m patches, which lie in
    one window, stay consecutive and in order, the units in window order."""
    return torch.argsort(layout.windows, stable=True)


def segment_bounds(segment_ids: Tensor) -> tuple[Tensor, int]:
    """Segments that are runs of consecutive patches (ids non-decreasing): [segments + 1] int32, each run's first
    patch and then the end (flash attention's cumulative lengths), and the longest run."""
    assert bool((segment_ids.diff() >= 0).all()), "segments are not runs of consecutive patches"
    lengths = torch.unique_consecutive(segment_ids, return_counts=True)[1]
    bounds = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
    return bounds, int(lengths.max())


def unit_positions(order: Tensor, merge_unit: int) -> Tensor:
    """Where each merge unit (in the processor's order) lies among the units in `order` (`window_order`): the
    gather that puts merged tokens back in the processor's order."""
    units = order[::merge_unit] // merge_unit  # the unit at each position
    return torch.empty_like(units).index_copy_(0, units, torch.arange(units.numel()))
