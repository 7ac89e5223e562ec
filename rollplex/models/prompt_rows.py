"""The prefix's prompts packed end to end: its decoder layers run over the real tokens only.

A group's prompts arrive right-padded to the longest ([P, L]); their lengths differ by a fifth and more on video
prompts, and every projection, norm and MLP of a padded row is wasted work (in the prefix forward, its rerun and
its backward). `PromptRows` names the real rows of the padded batch; the layers see them packed ([1, T]) and
only attention goes back to the padded layout, where the causal dense kernel (cuDNN) wants it: q, k and v are
scattered into zeros, the output gathered back (`PackedPromptKV`). The boundary keeps that padded K and V, zeros
past each prompt's length. `Rows` moves rows both ways with gathers, never atomic adds.
Not here: the padded batch (`batching.py`), the attention call itself (`attention.causal_sdpa`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from rollplex.models.attention import LayerKV
from rollplex.models.inputs import to_device


class Rows(torch.autograd.Function):
    """`x.index_select(0, index)` whose backward is a gather or a plain scatter, never an atomic add (bf16
    atomics made the vision tower's backward a large share of the step). `back` [len(x)]: the output row whose
    gradient each row of x takes, every other output row that reads it having a zero gradient (the padding of
    `vision.PackedSegments`); None: `index` names each row of x at most once, and a row it leaves out gets zero."""

    @staticmethod
    def forward(ctx, x: Tensor, index: Tensor, back: Tensor | None) -> Tensor:
        ctx.save_for_backward(index, back)
        ctx.num_rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        index, back = ctx.saved_tensors
        if back is not None:
            return grad.index_select(0, back), None, None
        return grad.new_zeros(ctx.num_rows, *grad.shape[1:]).index_copy_(0, index, grad), None, None


class PromptRows(NamedTuple):
    """Where P right-padded prompts of lengths `lens` lie in [P * L] rows: `real` [T] the padded row of each
    packed token (prompt by prompt), `last` [P] each prompt's last token among the T."""

    real: Tensor
    last: Tensor
    num_prompts: int
    length: int  # L

    @staticmethod
    def of(lens: Tensor, device: torch.device) -> PromptRows | None:
        """The rows of prompts of CPU lengths `lens`, or None where no prompt is padded (nothing to pack)."""
        num_prompts, length = len(lens), int(lens.max())
        if int(lens.sum()) == num_prompts * length:
            return None
        real = (torch.arange(length) < lens[:, None]).flatten().nonzero()[:, 0]
        last = lens.cumsum(0) - 1
        return PromptRows(to_device(real, device), to_device(last, device), num_prompts, length)

    def pack(self, x: Tensor) -> Tensor:
        """[P, L, ...] -> [1, T, ...]: the real rows, end to end."""
        return Rows.apply(x.flatten(0, 1), self.real, None)[None]

    def unpack(self, x: Tensor) -> Tensor:
        """[T, ...] -> [P, L, ...], zeros past each prompt's length (backward: a gather)."""
        return unpack(x, self.real, self.num_prompts, self.length)


def unpack(x: Tensor, real: Tensor, num_prompts: int, length: int) -> Tensor:
    """Packed rows x [T, ...] at padded rows `real` -> [P, L, ...], zeros elsewhere (backward: a gather)."""
    padded = x.new_zeros(num_prompts * length, *x.shape[1:]).index_copy_(0, real, x)
    return padded.view(num_prompts, length, *x.shape[1:])


class PackedPromptKV(LayerKV):
    """`LayerKV` of a layer that runs over `PromptRows`-packed tokens (the padded rows `real` of P prompts padded to
    L): q [1, heads, T, D] and k/v [1, kv_heads, T, D] attend causally within their own prompt, in the padded
    layout; `key` and `value` are the padded [P, kv_heads, L, D] (the boundary's)."""

    def __init__(self, real: Tensor, num_prompts: int, length: int) -> None:
        self.real, self.num_prompts, self.length = real, num_prompts, length

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        q, k, v = (unpack(t[0].transpose(0, 1), self.real, self.num_prompts, self.length).transpose(1, 2)
                   for t in (q, k, v))  # fmt: skip
        out = super().__call__(layer, q, k, v)  # [P, heads, L, D]
        return Rows.apply(out.transpose(1, 2).flatten(0, 1), self.real, None).transpose(0, 1)[None]
