"""The prefix's prompts packed end to end: its decoder layers run over the real tokens only.

A group's prompts arrive right-padded to the longest ([P, L]); their lengths differ by a fifth and more on video
prompts, and every projection, norm and MLP of a padded row is wasted work (in the prefix forward, its rerun and
its backward). `PromptRows` names the real rows of the padded batch; the layers see them packed ([1, T]).
Attention stays packed where SDPA would run it on cuDNN: one causal cuDNN call a prompt (`PromptCausal`), so no
prompt pays for the causal work over the longest one's padding and q is never padded. Elsewhere it goes back to
the padded layout for one SDPA call: q, k and v scattered into zeros, the output gathered back. Either way the
boundary keeps K and V padded ([P, G, L, D], zeros past each prompt's length; `PackedPromptKV`). `Rows` moves rows
both ways with gathers, never atomic adds.
Not here: the padded batch (`batching.py`), the padded attention call (`attention.causal_sdpa`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from rollplex.models.attention import LayerKV, attention_length, plans_per_shape
from rollplex.models.cascade import CudnnDense, DenseCall, padded_rows
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
    lens: tuple[int, ...]  # each prompt's, on the host

    @staticmethod
    def of(lens: Tensor, device: torch.device) -> PromptRows | None:
        """The rows of prompts of CPU lengths `lens`, or None where no prompt is padded (nothing to pack)."""
        num_prompts, length = len(lens), int(lens.max())
        if int(lens.sum()) == num_prompts * length:
            return None
        real = (torch.arange(length) < lens[:, None]).flatten().nonzero()[:, 0]
        last = lens.cumsum(0) - 1
        return PromptRows(to_device(real, device), to_device(last, device), num_prompts, length, tuple(lens.tolist()))

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


CUDNN_CAUSAL = CudnnDense(causal=True)


def prompt_dense(device: torch.device) -> DenseCall | None:
    """The call each packed prompt's attention runs on: cuDNN's where SDPA may run on it (`PromptCausal`; a call
    whose tensors cuDNN does not take, as float32, still goes padded), else None (the prompts padded into one SDPA
    call)."""
    return CUDNN_CAUSAL if plans_per_shape(device) else None


class PromptCausal(torch.autograd.Function):
    """Causal attention of prompts packed end to end, each over its own rows: q [T, H, D], k and v [T, G, D], host
    lengths `lens`; one causal `DenseCall` a prompt, over the window of `attention_length(n)` rows from its first
    (few shapes for a kernel that plans each). A window's rows past the prompt are the next prompt's, or zeros
    past the last: no real query sees them (they come after it), their outputs are dropped, and backward gives
    them a zero output gradient, so they add nothing to any gradient. The result is each prompt's attention."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, lens: tuple[int, ...], dense: DenseCall) -> Tensor:
        scale, out = q.shape[-1] ** -0.5, torch.empty_like(q)
        lses, calls = [], []
        for start, n in _spans(lens):
            window = [_window(x, start, attention_length(n)) for x in (q, k, v)]
            call_out, lse, call = dense.forward(*window, scale)
            out[start : start + n] = call_out[:n]
            lses.append(lse)
            calls.append(call)
        ctx.lens, ctx.dense, ctx.scale, ctx.calls = lens, dense, scale, calls
        ctx.save_for_backward(q, k, v, out, *lses)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, *lses = ctx.saved_tensors
        grads = [torch.empty_like(x) for x in (q, k, v)]
        for (start, n), lse, call in zip(_spans(ctx.lens), lses, ctx.calls, strict=True):
            size = attention_length(n)
            window = [_window(x, start, size) for x in (q, k, v, out)]
            call_grads = ctx.dense.backward(padded_rows(dout[start : start + n], size), *window, lse, ctx.scale, call)
            for grad, call_grad in zip(grads, call_grads, strict=True):
                grad[start : start + n] = call_grad[:n]
        return *grads, None, None


def _spans(lens: tuple[int, ...]) -> list[tuple[int, int]]:
    """(first row, length) of each prompt packed end to end."""
    return [(sum(lens[:i]), n) for i, n in enumerate(lens)]


def _window(x: Tensor, start: int, size: int) -> Tensor:
    """Rows [start, start + size) of x, zeros past its end."""
    return x[start : start + size] if start + size <= x.shape[0] else padded_rows(x[start:], size)


class PackedPromptKV(LayerKV):
    """`LayerKV` of a layer that runs over `PromptRows`-packed tokens (the padded rows `real` of P prompts of host
    lengths `lens` padded to L): q [1, heads, T, D] and k/v [1, kv_heads, T, D] attend causally within their own
    prompt, packed through `dense` (`PromptCausal`) where it takes them, else in the padded layout; `key` and
    `value` are the padded [P, kv_heads, L, D] (the boundary's)."""

    def __init__(
        self, real: Tensor, num_prompts: int, length: int, lens: tuple[int, ...], dense: DenseCall | None = None
    ) -> None:
        self.real, self.num_prompts, self.length, self.lens, self.dense = real, num_prompts, length, lens, dense

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        rows = [t[0].transpose(0, 1) for t in (q, k, v)]  # [T, heads, D]
        padded = [unpack(t, self.real, self.num_prompts, self.length).transpose(1, 2) for t in rows[1:]]
        smallest = min(attention_length(n) for n in self.lens)  # the checks cover each window's shape
        if self.dense is not None and self.dense.takes(*(x[:smallest] for x in rows)):
            self.key, self.value = padded
            return PromptCausal.apply(*rows, self.lens, self.dense).transpose(0, 1)[None]
        q = unpack(rows[0], self.real, self.num_prompts, self.length).transpose(1, 2)
        out = super().__call__(layer, q, *padded)  # [P, heads, L, D]
        return Rows.apply(out.transpose(1, 2).flatten(0, 1), self.real, None).transpose(0, 1)[None]
