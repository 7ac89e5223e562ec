"""Packed projection storage: a decoder layer's q/k/v weights (and biases) and its gate/up weights, and a vision
block's gate/up weights and biases, live back to back in one tensor each, while each stays its own `nn.Parameter`
under its HF name.

Every parameter is a leaf with its own gradient (the optimizer writes in place). The training forward
(`packed_linear`) and rollout's decode read each pack as one [q; k; v] or [gate; up] matrix and run one GEMM
instead of three or two, with no copy of any weight, so an update is visible to rollout the moment it is
written. Packing is done once, when the model is built; anything that re-allocates a parameter (`.to(device)`,
`to_empty`) unpacks it and must pack again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
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


def packed_linear(x: Tensor, linears: Sequence[nn.Linear]) -> Tensor:
    """x through `linears` side by side: [..., the sum of their outputs]. Where their weights (and biases) lie back to
    back (`pack`), one GEMM forward and two backward over the whole pack, where the linears would take one and two
    each and autograd would add their input gradients (an add for each linear past the first); each parameter
    still gets its own gradient, a view of the pack's. Otherwise, and inside a compiled region (which traces no
    storage), the same GEMM over the parameters concatenated (a copy of them each call)."""
    weights = [linear.weight for linear in linears]
    biases = [linear.bias for linear in linears if linear.bias is not None]
    if not torch.compiler.is_compiling():
        weight = packed_view(*weights)
        bias = packed_view(*biases) if biases else None
        if weight is not None and (bias is not None or not biases):
            if torch.is_grad_enabled() and any(t.requires_grad for t in (x, *weights, *biases)):
                return _PackedLinear.apply(x, weight, bias, *weights, *biases)
            return F.linear(x, weight, bias)
    return F.linear(x, torch.cat(weights), torch.cat(biases) if biases else None)


class _PackedLinear(torch.autograd.Function):
    """F.linear(x, weight, bias) over a pack's views (`packed_view`), whose gradients go to the pack's parameters
    (`leaves`: its weights, then its biases) as views of the one weight and bias gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, *leaves: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.rows = [t.shape[0] for t in leaves[: len(leaves) // 2 if ctx.has_bias else len(leaves)]]
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight = ctx.saved_tensors
        dx = dy @ weight if ctx.needs_input_grad[0] else None
        grads: list[Tensor | None] = [None] * (len(ctx.needs_input_grad) - 3)
        if any(ctx.needs_input_grad[3:]):
            rows = dy.reshape(-1, dy.shape[-1])
            grads = [*(rows.t() @ x.reshape(-1, x.shape[-1])).split(ctx.rows)]
            if ctx.has_bias:
                grads += rows.sum(0).split(ctx.rows)
        return dx, None, None, *grads
