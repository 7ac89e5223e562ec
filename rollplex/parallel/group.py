"""A tensor-parallel group and the four collectives its layers need, as autograd functions.

Megatron's conjugate pairs: `copy_to` is the identity forward and an all-reduce of the gradient backward (the
input of a column-parallel layer); `reduce_from` all-reduces forward and passes the gradient through (the
output of a row-parallel layer); `gather_from` concatenates the ranks' last-dim shards forward and keeps this
rank's slice of the gradient backward (vocab-parallel logits). A group of size 1 makes all of them the
identity, so the same layers serve one GPU. No global state: every call names its group.

Sequence parallelism (Megatron's) adds four along the sequence dimension (dim 1 of [B, T, hidden]): each rank
holds `sequence_chunk(T)` = ceil(T / size) rows (the sequence zero-padded to size x chunk, so every shard has
the same shape). `scatter_sequence` (enter: this rank's rows; backward gathers) and `leave_sequence` (the whole
sequence, unpadded; backward keeps this rank's rows) bound the region; inside it, `sequence_linear` is a
column-parallel GEMM over the gathered rows that saves only this rank's rows for backward (it gathers them again
there, as Megatron does, and reduce-scatters the input's partial gradient), and `reduce_scatter_sequence` sums a
row-parallel GEMM's partial outputs into this rank's rows (backward gathers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class TPGroup:
    """`size` ranks of one tensor-parallel group; `rank` is this process's index in it (not its global rank)."""

    size: int
    rank: int
    group: dist.ProcessGroup | None = None  # None only when size == 1

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.size, f"rank {self.rank} outside a group of {self.size}"
        assert self.size == 1 or self.group is not None, "a group of several ranks needs its process group"

    def shard(self, n: int) -> range:
        """This rank's part of n items split evenly in rank order."""
        assert n % self.size == 0, f"{n} does not split over {self.size} ranks"
        return range(self.rank * n // self.size, (self.rank + 1) * n // self.size)


SINGLE = TPGroup(1, 0)


def _gather_single():
    """torch's all-gather into one tensor: `all_gather_single` from torch 2.13, `all_gather_into_tensor` before."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_into(out: Tensor, part: Tensor, group: TPGroup) -> None:
    """out = concat over ranks of each rank's `part` along dim 0 (part may be a view of out's own region)."""
    if group.size == 1:  # never hand torch a None group here: it would gather over the whole world
        if out.data_ptr() != part.data_ptr():
            out.copy_(part)
        return
    _gather_single()(out, part, group=group.group)


def all_gather_async(out: Tensor, part: Tensor, group: TPGroup) -> dist.Work:
    """`all_gather_into` started on the current stream's queue; wait on the returned work before reading out."""
    assert group.size > 1, "a group of one rank has nothing to gather"
    return _gather_single()(out, part, group=group.group, async_op=True)


def all_gather_many(pairs: list[tuple[Tensor, Tensor]], group: TPGroup, *, coalesced: bool = True) -> None:
    """`all_gather_into` for every (out, part); on NCCL, `coalesced` launches them as one group."""
    if not coalesced or group.size == 1 or dist.get_backend(group.group) != "nccl":
        for out, part in pairs:
            all_gather_into(out, part, group)
        return
    from torch.distributed.distributed_c10d import _coalescing_manager

    with _coalescing_manager(group=group.group, device=pairs[0][0].device, async_ops=True) as batch:
        for out, part in pairs:
            dist.all_gather_into_tensor(out, part, group=group.group)
    batch.wait()


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: TPGroup) -> Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group.group)
        return grad, None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: TPGroup) -> Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group.group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: TPGroup) -> Tensor:
        ctx.group, ctx.width = group, x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(group.size)]
        dist.all_gather(parts, x.contiguous(), group=group.group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: Tensor):
        start = ctx.group.rank * ctx.width
        return grad[..., start : start + ctx.width].contiguous(), None


def copy_to(x: Tensor, group: TPGroup) -> Tensor:
    return x if group.size == 1 else _CopyTo.apply(x, group)


def reduce_from(x: Tensor, group: TPGroup) -> Tensor:
    return x if group.size == 1 else _ReduceFrom.apply(x, group)


def gather_from(x: Tensor, group: TPGroup) -> Tensor:
    return x if group.size == 1 else _GatherFrom.apply(x, group)


def sequence_chunk(length: int, group: TPGroup) -> int:
    """Rows of a sequence of `length` each rank holds under sequence parallelism (the last ones pad)."""
    return -(-length // group.size)


def _all_gather_rows(x: Tensor, group: TPGroup) -> Tensor:
    """[B, c, ...] on every rank -> [B, size * c, ...], ranks' rows in rank order."""
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x.contiguous(), group=group.group)
    return torch.cat(parts, dim=1)


def _reduce_scatter_rows(x: Tensor, group: TPGroup) -> Tensor:
    """[B, size * c, ...] partial sums on every rank -> this rank's c rows of their sum. NCCL reduce-scatters;
    gloo has no reduce-scatter, so there the whole sum is all-reduced and sliced (the same numbers)."""
    chunk = x.shape[1] // group.size
    if dist.get_backend(group.group) == "nccl":
        rows = x.transpose(0, 1).contiguous()  # the ranks' rows as dim-0 slabs
        out = rows.new_empty((chunk, *rows.shape[1:]))
        dist.reduce_scatter_tensor(out, rows, group=group.group)
        return out.transpose(0, 1).contiguous()
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group.group)
    return x[:, group.rank * chunk : (group.rank + 1) * chunk].contiguous()


def _own_rows(x: Tensor, group: TPGroup) -> Tensor:
    """This rank's chunk of x [B, T, ...] (zero-padded to size x chunk rows)."""
    chunk = sequence_chunk(x.shape[1], group)
    x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, group.size * chunk - x.shape[1]))
    return x[:, group.rank * chunk : (group.rank + 1) * chunk].contiguous()


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: TPGroup) -> Tensor:
        ctx.group, ctx.length = group, x.shape[1]
        return _own_rows(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_gather_rows(grad, ctx.group)[:, : ctx.length], None


class _LeaveSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: TPGroup, length: int) -> Tensor:
        ctx.group = group
        return _all_gather_rows(x, group)[:, :length]

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _own_rows(grad, ctx.group), None, None


class _SequenceLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, group: TPGroup) -> Tensor:
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)  # this rank's rows: 1 / size of the gathered input
        return F.linear(_all_gather_rows(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        grad_x = _reduce_scatter_rows(grad @ weight, ctx.group) if need_x else None
        grad_w = grad.flatten(0, -2).t() @ _all_gather_rows(x, ctx.group).flatten(0, -2) if need_w else None
        grad_b = grad.flatten(0, -2).sum(0) if ctx.has_bias and need_b else None
        return grad_x, grad_w, grad_b, None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: TPGroup) -> Tensor:
        ctx.group = group
        return _reduce_scatter_rows(x, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _all_gather_rows(grad, ctx.group), None


def scatter_sequence(x: Tensor, group: TPGroup) -> Tensor:
    """Replicated x [B, T, ...] -> this rank's [B, sequence_chunk(T), ...] rows (entering the region)."""
    return x if group.size == 1 else _ScatterSequence.apply(x, group)


def leave_sequence(x: Tensor, group: TPGroup, length: int) -> Tensor:
    """The ranks' rows [B, c, ...] -> the whole, replicated [B, length, ...] (leaving the region)."""
    return x if group.size == 1 else _LeaveSequence.apply(x, group, length)


def sequence_linear(x: Tensor, weight: Tensor, bias: Tensor | None, group: TPGroup) -> Tensor:
    """A column-parallel GEMM of the ranks' rows x [B, c, in]: F.linear of the gathered [B, size * c, in] (zero
    rows past the sequence's end)."""
    return F.linear(x, weight, bias) if group.size == 1 else _SequenceLinear.apply(x, weight, bias, group)


def reduce_scatter_sequence(x: Tensor, group: TPGroup) -> Tensor:
    """A row-parallel GEMM's partial output [B, size * c, ...] -> this rank's c rows of the sum over ranks."""
    return x if group.size == 1 else _ReduceScatterSequence.apply(x, group)
