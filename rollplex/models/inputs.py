"""What a model call reads: prompts (token ids + preprocessed visual patches) and sampled responses.

These types are the contract between `rollplex.data` (which builds them) and `rollplex.models` /
`rollplex.executors` (which consume them). They hold torch tensors but no model logic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from rollplex.models.packing import packed_view


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (an input of the model: ids, positions, patches, index lists) on `device` without making the
    host wait: torch finishes a plain host-to-GPU copy before returning (the stream drains), once per tensor of
    every prompt group. Staged through pinned memory instead (torch's pinned cache keeps the staging buffer until
    the copy is done; a pinned tensor is copied from where it lies) and copied on the stream in order. On the CPU,
    or from the GPU, a plain `.to`."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    staged = tensor if tensor.is_pinned() else tensor.pin_memory()  # pinned already: `back_to_back` patches
    return staged.to(device, non_blocking=True)


@dataclass(frozen=True)
class Visual:
    """One video or image, already patchified the way the Qwen2.5-VL processor does it.

    pixel_values: [grid_t * grid_h * grid_w, in_channels * temporal_patch_size * patch_size**2], float32,
    rows ordered as transformers' Qwen2-VL processor orders them (merge-window major).
    """

    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    is_video: bool
    second_per_grid_t: float = 1.0

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w


@dataclass(frozen=True)
class Prompt:
    """One prompt: token ids with the vision pad tokens in place, and its visuals in order of appearance."""

    input_ids: torch.Tensor  # [L] int64
    visuals: tuple[Visual, ...] = ()
    response_start: int | None = None  # prompt ++ response: from here on every token is text, whatever its id

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())


def pixels_of(visuals: Sequence[Visual]) -> torch.Tensor:
    """The visuals' patches one after another, [sum of their rows, C]: a view where they lie back to back in one
    tensor (`back_to_back`), else a copy."""
    tensors = [visual.pixel_values for visual in visuals]
    view = packed_view(*tensors)
    return view if view is not None else torch.cat(tensors)


def back_to_back(prompts: Sequence[Prompt], pin: bool) -> list[Prompt]:
    """The same prompts with every visual's patches in one host tensor, one after another, pinned when `pin`: a
    prefix then reads any run of them as one view (`pixels_of`) and copies it to the GPU straight from there,
    instead of concatenating and staging the patches again on every call."""
    visuals = [visual for prompt in prompts for visual in prompt.visuals]
    if not visuals:
        return list(prompts)
    rows = [visual.pixel_values.shape[0] for visual in visuals]
    first = visuals[0].pixel_values
    store = torch.empty(sum(rows), *first.shape[1:], dtype=first.dtype, pin_memory=pin)
    torch.cat([visual.pixel_values for visual in visuals], out=store)
    parts = iter(store.split(rows))
    return [replace(p, visuals=tuple(replace(v, pixel_values=next(parts)) for v in p.visuals)) for p in prompts]
