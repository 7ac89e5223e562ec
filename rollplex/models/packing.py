"""Packed projection storage: a decoder layer's q/k/v weights (and biases), and its gate/up weights, live back
to back in one tensor each, while each stays its own `nn.Parameter` under its HF name.

Training sees no difference (every parameter is a leaf with its own gradient; the optimizer writes in place);
rollout's decode reads each pack as one [q; k; v] or [gate; up] matrix and runs one GEMM instead of three or
two, with no copy of any weight, so an update is visible to rollout the moment it is written. Packing is
done once, when the model is built; anything that re-allocates a parameter (`.to(device)`, `to_empty`)
unpacks it and must pack again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn


def pack(modules: Sequence[nn.Module], name: str) -> None:
    """Moves `module.<name>` of each module into one new tensor, in order along dim 0, as views."""
    tensors = [getattr(m, name) for m in modules]
    packed = torch.cat([t.detach() for t in tensors])
    offset = 0
    for module, t in zip(modules, tensors, strict=True):
        rows = t.shape[0]
        setattr(module, name, nn.Parameter(packed[offset : offset + rows], requires_grad=t.requires_grad))
        offset += rows


def packed_view(*tensors: Tensor) -> Tensor | None:
    """The one tensor that `tensors` (contiguous, same dtype) tile along dim 0 back to back; None if they don't."""
    first = tensors[0]
    offset = first.storage_offset()
    for t in tensors:
        same_storage = t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        if not (same_storage and t.is_contiguous() and t.storage_offset() == offset and t.dtype == first.dtype):
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.detach().as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())
