"""Pixel geometry of Qwen2.5-VL, without pixels: how frames are resized and how many patches they give.

Pure arithmetic (no torch, no numpy), so that the compiler and the workload presets can size visual tokens
without importing the preprocessing stack (`video`, which re-exports these names).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_ASPECT_RATIO = 200


@dataclass(frozen=True)
class VisionSpec:
    """How pixels become patches. Defaults are the Qwen2-VL video processor's; `for_images()` the image's."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28

    def __post_init__(self) -> None:
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"need 0 < min_pixels <= max_pixels, got {self.min_pixels} and {self.max_pixels}")

    @classmethod
    def for_images(cls) -> VisionSpec:
        return cls(min_pixels=56 * 56, max_pixels=28 * 28 * 1280)

    @property
    def factor(self) -> int:
        """Height and width must be multiples of this: one merged visual token covers factor x factor px."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size**2


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Nearest (height, width) that are multiples of `factor` with min_pixels <= h*w <= max_pixels."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"aspect ratio of {height}x{width} exceeds {MAX_ASPECT_RATIO}: crop the frames first")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def output_size(height: int, width: int, spec: VisionSpec, size: tuple[int, int] | None = None) -> tuple[int, int]:
    """Frame size after resizing: `size` if given (a workload's fixed resolution), else smart_resize."""
    if size is None:
        return smart_resize(height, width, spec.factor, spec.min_pixels, spec.max_pixels)
    if size[0] <= 0 or size[1] <= 0 or size[0] % spec.factor or size[1] % spec.factor:
        raise ValueError(f"target size {size} must be positive multiples of {spec.factor} (patch * merge)")
    return size


def grid_thw(num_frames: int, height: int, width: int, spec: VisionSpec) -> tuple[int, int, int]:
    """Patch grid of `num_frames` frames already resized to (height, width)."""
    grid_t = -(-num_frames // spec.temporal_patch_size)
    return grid_t, height // spec.patch_size, width // spec.patch_size
