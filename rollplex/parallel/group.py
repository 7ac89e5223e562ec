"""A tensor-parallel group and the four collectives its layers need, as autograd functions.

Megatron's conjugate pairs: `copy_to` is the identity forward and an all-reduce of the gradient backward (the
input of a column-parallel layer); `reduce_from` all-reduces forward and passes the gradient through (the
output of a row-parallel layer); `gather_from` concatenates the ranks' last-dim shards forward and keeps this
rank's slice of the gradient backward (vocab-parallel logits). A group of size 1 makes all of them the
identity, so the same layers serve one GPU. No global state: every call names its group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
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
