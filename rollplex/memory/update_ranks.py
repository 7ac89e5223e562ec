"""What a `ChunkedAdamW` step shares with other ranks: the global gradient norm over the tensor-parallel group
(sharded segments summed, replicated ones counted once: Megatron's rule) and over the ZeRO-1 ranks, and ZeRO-1's
all-gather of every rank's new values after the step. One rank alone needs neither."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rollplex.memory.state_layout import flat_segments

if TYPE_CHECKING:
    from rollplex.memory.optimizer import ChunkedAdamW


def global_norm(opt: ChunkedAdamW, norms: torch.Tensor) -> torch.Tensor:
    """The norm of every segment's norm; under tensor parallelism the sharded segments' squares are summed
    over the group and the replicated ones counted once (Megatron's rule); under ZeRO-1 each rank's squares
    are of its own elements, summed over the data-parallel ranks first."""
    if opt.shard is not None:
        return _sharded_global_norm(opt, norms)
    if opt.tp is None or opt.tp.size == 1:
        return torch.linalg.vector_norm(norms)
    if opt.sharded_segments is None:  # built on the first step, on the norms' device
        flags = [opt.sharded[s.param_index] for chunk in opt.chunks for s in chunk.segments]
        opt.sharded_segments = torch.tensor(flags, device=norms.device)
    mask = opt.sharded_segments
    squares = norms.square()
    sharded = torch.where(mask, squares, 0.0).sum()
    dist.all_reduce(sharded, group=opt.tp.group)
    return (sharded + torch.where(mask, 0.0, squares).sum()).sqrt()


def _sharded_global_norm(opt: ChunkedAdamW, norms: torch.Tensor) -> torch.Tensor:
    squares = norms.square()
    flags = [opt.sharded[s.param_index] for chunk in opt.chunks for s in chunk.segments]
    mask = torch.tensor(flags, dtype=torch.bool, device=norms.device)
    sums = torch.stack([torch.where(mask, squares, 0.0).sum(), torch.where(mask, 0.0, squares).sum()])
    dist.all_reduce(sums, group=opt.shard.group)  # every element is one rank's: the whole model's squares
    if opt.tp is not None and opt.tp.size > 1:
        dist.all_reduce(sums[0], group=opt.tp.group)
    return sums.sum().sqrt()


def share_updates(opt: ChunkedAdamW) -> None:
    """ZeRO-1's all-gather: every rank's new FP32 values, written here through `write` (this rank's own went
    there in `_adam`). A window of `capacity` elements of each rank's share at a time, read from the state."""
    opt.wait()
    s, total = opt.shard, opt.starts[-1]
    ranks = [s.bounds(total, r) for r in range(s.size)]
    window = opt.chunk_elements  # the same on every rank
    for w in range(0, max(b - a for a, b in ranks), window):
        send = torch.zeros(window, dtype=torch.float32, device=opt.device)
        _read_masters(opt, opt.lo + w, min(opt.hi, opt.lo + w + window), send)
        parts = [torch.empty_like(send) for _ in range(s.size)]
        dist.all_gather(parts, send, group=s.group)
        for r, (a, b) in enumerate(ranks):
            if r == s.rank or a + w >= b:
                continue
            for seg in flat_segments(opt.starts, a + w, min(b, a + w + window)):
                opt.write(seg.param_index, seg.start, parts[r][seg.offset : seg.offset + seg.numel])


def _read_masters(opt: ChunkedAdamW, first: int, last: int, out: torch.Tensor) -> None:
    """This rank's FP32 master weights of flat elements [first, last) into out[: last - first]."""
    begin = opt.lo
    for j, chunk in enumerate(opt.chunks):
        a, b = max(first, begin), min(last, begin + chunk.numel)
        if a < b:
            out[a - first : b - first].copy_(opt.chunk_state(j)[0, a - begin : b - begin])
        begin += chunk.numel
