"""Model weights laid out in one byte storage that two processes share (the `mps` policy's rollout,
`remote.py`): where each parameter and buffer lies (`TensorSlot`, `plan_slots`), moving a model's tensors
into the storage in place (`move_into`), and a model built over the same bytes (`shared_model`).

Tensors that shared a storage (the packed [q; k; v] and [gate; up] of `rollplex.models.packing`) keep their
byte layout, so both sides still read those packs as one matrix. What it is not: the transport of the
storage (VMM handles or shared memory: `remote.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod

import torch
from torch import Tensor, nn

from rollplex.models.config import ModelConfig
from rollplex.models.model import Qwen2_5_VL
from rollplex.parallel.bind import ALIGN


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Where one tensor lies in the shared storage: `offset` bytes from its start, as_strided(shape, stride)."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        """The bytes from the first element to past the last one (0 for an empty tensor)."""
        if prod(self.shape) == 0:
            return 0
        return (1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True))) * self.dtype.itemsize


def plan_slots(tensors: dict[str, Tensor]) -> tuple[int, dict[str, TensorSlot]]:
    """The storage size and each tensor's slot. Tensors that shared a storage keep their relative byte layout
    (packed projections stay packed); each group starts on an `ALIGN` boundary."""
    groups: dict[int, list[str]] = {}
    for name, t in tensors.items():
        groups.setdefault(t.untyped_storage().data_ptr(), []).append(name)
    total, slots = 0, {}
    for names in groups.values():
        starts = {n: tensors[n].storage_offset() * tensors[n].element_size() for n in names}
        base = -(-total // ALIGN) * ALIGN
        low = min(starts.values())
        for n in names:
            t = tensors[n]
            slots[n] = TensorSlot(base + starts[n] - low, tuple(t.shape), t.dtype, tuple(t.stride()))
            assert slots[n].offset % t.element_size() == 0, f"{n} would be misaligned in the shared storage"
        total = max([base] + [s.offset + s.num_bytes for s in (slots[n] for n in names)])
    return max(-(-total // ALIGN) * ALIGN, ALIGN), slots


def slot_view(storage: Tensor, slot: TensorSlot) -> Tensor:
    """The tensor of `slot` over the uint8 `storage` (a view: no copy)."""
    flat = storage[slot.offset : slot.offset + slot.num_bytes].view(slot.dtype)
    return flat.as_strided(slot.shape, slot.stride)


def named_tensors(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter and buffer under every name (a tied weight appears under each of its names)."""
    return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))


@torch.no_grad()
def move_into(tensors: dict[str, Tensor], storage: Tensor, slots: dict[str, TensorSlot]) -> None:
    """Moves each tensor into its slot of `storage`, in place (`tensor.data = view`: the same objects, so an
    optimizer, autograd and every module holding them see no difference)."""
    moved: set[int] = set()
    for name, t in tensors.items():
        if id(t) not in moved:
            view = slot_view(storage, slots[name])
            view.copy_(t)
            t.data = view
            moved.add(id(t))


def shared_model(
    config: ModelConfig, dtype: torch.dtype, storage: Tensor, slots: Sequence[tuple[str, TensorSlot]]
) -> Qwen2_5_VL:
    """A model whose every parameter and buffer is a view of `storage` at its slot (built on the meta device
    first: no weight is materialised); its parameters do not require grad."""
    model = Qwen2_5_VL(config, dtype=dtype, device="meta")
    for name, slot in slots:
        module_name, _, leaf = name.rpartition(".")
        module, view = model.get_submodule(module_name), slot_view(storage, slot)
        is_param = isinstance(getattr(module, leaf), nn.Parameter)
        setattr(module, leaf, nn.Parameter(view, requires_grad=False) if is_param else view)
    assert not any(t.is_meta for t in named_tensors(model).values()), "a tensor of the model is not in the storage"
    return model
