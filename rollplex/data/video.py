"""Qwen2.5-VL pixel preprocessing: RGB frames (uint8) -> `Visual` (flattened patches + grid_thw).

The pipeline of transformers' Qwen2-VL processors, on the PIL path, number for number:
    1. smart_resize: height and width become multiples of patch*merge (28), pixels within [min, max],
       aspect ratio kept as closely as possible; frames are resized with PIL bicubic
    2. rescale by 1/255 (in float64, then float32) and normalise with the OpenAI CLIP mean/std (float32)
    3. pad the frame count to a multiple of the temporal patch (2) by repeating the last frame
    4. cut [temporal 2 x 14 x 14] patches; rows in merge-window-major order (the 2x2 patches that merge
       into one visual token are adjacent), each row laid out [channel, temporal, patch_h, patch_w]
An image is a one-frame video (its frame repeated over the temporal patch), grid_t = 1.

What this is not: transformers' video processor resizes with torchvision, whose bicubic differs from PIL's
by rounding; we use PIL for images and videos alike (the tests say which oracle each path matches). This
module does not decode video files (see `video_r1`) nor build token ids (see `chat`).
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from rollplex.data.sizes import VisionSpec, grid_thw, output_size, smart_resize
from rollplex.models.inputs import Visual

__all__ = ["VisionSpec", "grid_thw", "output_size", "preprocess_image", "preprocess_video", "smart_resize"]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def resize_frames(frames: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """[T, H, W, 3] uint8 -> [T, h, w, 3] uint8 with PIL bicubic (what the PIL processors do)."""
    height, width = size
    if frames.shape[1:3] == (height, width):
        return frames
    out = [Image.fromarray(f).resize((width, height), Image.Resampling.BICUBIC) for f in frames]
    return np.stack([np.asarray(img) for img in out])


def rescale_normalize(frames: np.ndarray) -> np.ndarray:
    """[T, H, W, 3] uint8 -> [T, 3, H, W] float32: x/255 (via float64), then (x - mean) / std in float32."""
    x = (frames.astype(np.float64) * (1 / 255)).astype(np.float32)
    mean = np.asarray(CLIP_MEAN, dtype=np.float32)
    std = np.asarray(CLIP_STD, dtype=np.float32)
    return np.ascontiguousarray(((x - mean) / std).transpose(0, 3, 1, 2))


def patchify(x: np.ndarray, spec: VisionSpec) -> tuple[np.ndarray, tuple[int, int, int]]:
    """[T, C, H, W] -> ([grid_t*grid_h*grid_w, C*tp*p*p], grid_thw); T padded by repeating the last frame."""
    tp, p, m = spec.temporal_patch_size, spec.patch_size, spec.merge_size
    if pad := -x.shape[0] % tp:
        x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
    num_frames, channels, height, width = x.shape
    gt, gh, gw = grid_thw(num_frames, height, width, spec)
    x = x.reshape(gt, tp, channels, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [gt, gh/m, gw/m, m, m, C, tp, p, p]
    return x.reshape(gt * gh * gw, channels * tp * p * p), (gt, gh, gw)


def _check_frames(frames: np.ndarray) -> None:
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] == 0:
        raise ValueError(f"expected RGB frames [T>0, H, W, 3] uint8, got {frames.dtype} {tuple(frames.shape)}")


def preprocess_video(
    frames: np.ndarray, spec: VisionSpec, fps: float = 2.0, size: tuple[int, int] | None = None
) -> Visual:
    """Sampled frames [T, H, W, 3] uint8 at `fps` -> a video `Visual` (second_per_grid_t = tp / fps)."""
    _check_frames(frames)
    resized = resize_frames(frames, output_size(frames.shape[1], frames.shape[2], spec, size))
    rows, grid = patchify(rescale_normalize(resized), spec)
    return Visual(
        pixel_values=torch.from_numpy(np.ascontiguousarray(rows)),
        grid_thw=grid,
        is_video=True,
        second_per_grid_t=spec.temporal_patch_size / fps,
    )


def preprocess_image(image: np.ndarray, spec: VisionSpec, size: tuple[int, int] | None = None) -> Visual:
    """One RGB image [H, W, 3] uint8 -> an image `Visual` (grid_t = 1)."""
    frames = image[None]
    _check_frames(frames)
    resized = resize_frames(frames, output_size(image.shape[0], image.shape[1], spec, size))
    rows, grid = patchify(rescale_normalize(resized), spec)
    return Visual(pixel_values=torch.from_numpy(np.ascontiguousarray(rows)), grid_thw=grid, is_video=False)
