"""`OverlappedSum`: the ranks' gradients summed while the last backward runs (gloo processes) equal the plain sum
taken after it, with FP32 main grads or without; a bucket is sent from the backward once it is complete, and what
the last backward did not reach is sent by `finish`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from parallel_testkit import spawn

from rollplex.executors import dataparallel
from rollplex.executors.dataparallel import DataParallel, OverlappedSum
from rollplex.memory.optimizer import ChunkedAdamW


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)  # every rank the same weights
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))


def _loss(model: torch.nn.Sequential, rank: int, seed: int, whole: bool = True) -> torch.Tensor:
    """A loss that differs per rank; not `whole`: it reaches the last two layers only."""
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(10 * rank + seed))
    out = model(x) if whole else model[3](model[2](torch.tanh(x @ torch.ones(8, 16))))
    return out.square().sum() * (rank + 1)


def _sums_match(rank: int, world_size: int, fp32_grads: bool, whole: bool) -> None:
    dataparallel.BUCKET_BYTES = 4 * (16 * 16 + 16)  # FP32 bytes: buckets [5, 4, 3], [2, 1], [0]
    dp = DataParallel(world_size, rank)
    ours, theirs = _model(), _model()
    optimizers = [ChunkedAdamW(m.parameters(), lr=1e-2, fp32_grads=fp32_grads) for m in (ours, theirs)]
    summed = OverlappedSum(dp, optimizers[0])
    assert summed.buckets == [[5, 4, 3], [2, 1], [0]]  # the order the backward reaches them
    for model in (ours, theirs):
        _loss(model, rank, 0).backward()  # an earlier backward of the mini-batch
    summed.arm()
    _loss(ours, rank, 1, whole).backward()  # the last one
    summed.finish()
    _loss(theirs, rank, 1, whole).backward()
    dp.all_reduce_grads([optimizers[1].grad_of(i) for i in range(6)])
    for i in range(6):
        assert torch.equal(optimizers[0].grad_of(i), optimizers[1].grad_of(i)), i
    assert summed.launched_in_backward == (3 if whole else 1)  # the rest: sent by finish
    dist.barrier()


@pytest.mark.parametrize("fp32_grads", [False, True], ids=["grads", "fp32-main-grads"])
@pytest.mark.parametrize("whole", [True, False], ids=["every-layer-reached", "last-two-reached"])
def test_a_sum_started_inside_the_last_backward_equals_the_sum_after_it(fp32_grads, whole):
    spawn(_sums_match, 2, fp32_grads, whole)


def _twice(rank: int, world_size: int) -> None:
    """The armed backward accumulates every parameter twice (as the prefix's reruns do, once per prompt group)."""
    dataparallel.BUCKET_BYTES = 4 * (16 * 16 + 16)
    dataparallel.IN_FLIGHT = 1  # one flat copy at a time
    dp = DataParallel(world_size, rank)
    ours, theirs = _model(), _model()
    optimizers = [ChunkedAdamW(m.parameters(), lr=1e-2, fp32_grads=True) for m in (ours, theirs)]
    summed = OverlappedSum(dp, optimizers[0], from_backward=False)
    summed.arm()
    for seed in (1, 2):
        _loss(ours, rank, seed).backward()
        _loss(theirs, rank, seed).backward()
    summed.finish()
    dp.all_reduce_grads([optimizers[1].grad_of(i) for i in range(6)])
    for i in range(6):
        assert torch.equal(optimizers[0].grad_of(i), optimizers[1].grad_of(i)), i
    assert summed.launched_in_backward == 0 and summed.most_in_flight == 1
    early = OverlappedSum(dp, optimizers[0])  # assumes one accumulation per parameter: a second one is refused
    early.arm()
    _loss(ours, rank, 3).backward()
    with pytest.raises(RuntimeError, match="accumulated again after its bucket was summed"):
        _loss(ours, rank, 4).backward()
    dist.barrier()


def test_a_backward_that_accumulates_twice_is_summed_once_after_it_one_bucket_copy_at_a_time():
    spawn(_twice, 2)
