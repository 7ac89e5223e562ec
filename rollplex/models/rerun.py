"""Checkpointed units of a forward whose backward runs on a stream chosen when the work is set up.

What it is: the recompute of the actor prefix (`memory.prefix_activations: recompute`). A unit (a decoder
layer, a vision block) keeps only its input; backward reruns it with grad and backpropagates through the
rerun (the reentrant scheme), so the parameters' gradients accumulate as in a plain backward.

Why not `torch.utils.checkpoint`: autograd runs a node's backward on the stream its forward ran on. Under
`rollplex` the actor prefix runs beside decode on a green partition (half the SMs); with torch's checkpoint its
whole backward (reruns and gradient kernels) would run there too, in Phase 2, where decode is over and the
whole device is free, so half the SMs would sit idle. Here each unit is one node whose backward does its
work on `Rerun.stream` and makes the node's own stream wait for it. Neither the rerun nor the stream changes a
number: the same ops run on the same inputs.

Not here: what is offloaded (`rollplex.memory.offload`), which units are checkpointed (the model's prefix).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

Unit = Callable[..., tuple[Tensor, ...]]  # (x, *consts) -> outputs; the unit's parameters are read inside


@dataclass(frozen=True)
class Rerun:
    """`rerun(unit, x, params, *consts)` is `unit(x, *consts)` keeping only `x` and `consts`; backward reruns the
    unit on `stream` (None: on the stream the forward ran on, as autograd would) and backpropagates through it.
    `params`: the trainable tensors the unit reads (their gradients accumulate there; they make the outputs
    require grad even when x does not). `consts`: tensors the unit reads that need no gradient (rotary tables,
    index groups); they are saved like x, so that saved-tensor hooks (host offload) see them too.

    Each unit's rerun is a backward of its own: a parameter's post-accumulate-grad hooks fire once per unit
    and prompt group that reads it, not once per backward, and `torch.autograd.grad` or `backward(inputs=...)`
    through a rerun unit still accumulates into the parameters' `.grad`."""

    stream: torch.cuda.Stream | None = None

    def __call__(self, unit: Unit, x: Tensor, params: Iterable[Tensor], *consts: Tensor) -> tuple[Tensor, ...]:
        trainable = any(p.requires_grad for p in params)
        if not torch.is_grad_enabled() or not (x.requires_grad or trainable):
            return unit(x, *consts)
        # the parameters are not inputs of the node (the rerun's own backward accumulates their gradients; as
        # inputs they would also get the node's None, and their post-accumulate hooks would run twice); a leaf
        # that needs a gradient makes the outputs differentiable when x is not
        return _Rerun.apply(unit, self.stream, torch.empty(0, requires_grad=True), x, *consts)


def run_unit(
    rerun: Rerun | None, unit: Unit, x: Tensor, params: Iterable[Tensor], *consts: Tensor
) -> tuple[Tensor, ...]:
    """`unit(x, *consts)`, under `rerun` when there is one (the prefix's vision blocks and decoder layers)."""
    return unit(x, *consts) if rerun is None else rerun(unit, x, params, *consts)


class _Rerun(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, unit: Unit, stream: torch.cuda.Stream | None, differentiable: Tensor, x: Tensor, *consts: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.unit, ctx.stream = unit, stream
        ctx.set_materialize_grads(False)  # an unused output (no gradient) costs nothing in backward
        ctx.save_for_backward(x, *consts)
        return tuple(unit(x, *consts))

    @staticmethod
    def backward(ctx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        saved, *consts = ctx.saved_tensors
        own = torch.cuda.current_stream(saved.device) if saved.is_cuda else None  # the forward's stream
        moved = ctx.stream is not None and own is not None and ctx.stream != own
        if moved:
            ctx.stream.wait_stream(own)  # the saved tensors and the incoming gradients are ready on it
        with torch.cuda.stream(ctx.stream) if moved else nullcontext():
            x = saved.detach().requires_grad_(saved.requires_grad)
            with torch.enable_grad():
                outputs = ctx.unit(x, *consts)
            pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if g is not None and o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        dx = x.grad
        if moved:
            own.wait_stream(ctx.stream)
            if dx is not None:
                dx.record_stream(own)  # made on ctx.stream, read on the node's stream from here on
        return None, None, None, dx, *(None,) * len(consts)
