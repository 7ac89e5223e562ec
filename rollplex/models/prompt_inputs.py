"""What a forward reads of a batch of prompts, on the model's device, built before any of its compute.

A prefix reads host tensors: token ids, text positions, where the visual tokens go, the vision tower's patches and
index lists, which rows are real. `to_device` copies each onto the compute stream, in order with the kernels. Built
up front, a prefix's copies can all be issued before other copies load the host link: a deferred update's FP32
state (`sharing.update_beside_prefix`) streams while the actor prefix runs, and a copy the prefix issues in its
middle waits behind that stream, the prefix's compute with it (docs/results.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from torch import Tensor

from rollplex.models.batching import PackedSequences, pack_sequences
from rollplex.models.inputs import Prompt, to_device
from rollplex.models.prompt_rows import PromptRows
from rollplex.models.vision import VisionInputs

if TYPE_CHECKING:
    from rollplex.models.model import Qwen2_5_VL


class PromptInputs(NamedTuple):
    """A batch of prompts (or whole sequences) as a forward reads them; tensors on the model's device."""

    prompts: Sequence[Prompt]
    packed: PackedSequences  # on the host
    positions: Tensor  # [3, B, L] mrope positions
    input_ids: Tensor  # [B, L]
    slots: Tensor | None  # [B, L] bool: the visual tokens; None: no visuals
    vision: VisionInputs | None  # None: no visuals, or a shared (frozen) tower computes their embeddings
    rows: PromptRows | None  # the real rows of the padded batch (`PromptRows.of`); None: nothing padded
    lens: Tensor  # [B]
    next_positions: Tensor  # [B]


def prompt_inputs(model: Qwen2_5_VL, prompts: Sequence[Prompt], shared_vision: bool = False) -> PromptInputs:
    """`prompts` packed (`pack_sequences`) with every tensor a forward of them reads copied to the model's device.
    `shared_vision`: a `SharedVision` embeds their visuals (it reads the patches itself, once a step)."""
    device, packed = model.device, pack_sequences(prompts, model.config)
    visuals = packed.visuals
    return PromptInputs(
        prompts,
        packed,
        to_device(packed.positions, device),
        to_device(packed.input_ids, device),
        to_device(packed.visual_slots(model.config.tokens), device) if visuals else None,
        model.model.visual.inputs(visuals) if visuals and not shared_vision else None,
        PromptRows.of(packed.lens, device),
        to_device(packed.lens, device),
        to_device(packed.next_positions, device),
    )
