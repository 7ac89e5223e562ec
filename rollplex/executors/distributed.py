"""The processes of a tensor-parallel `rollplex run`: one per GPU of the training TP group, started by torchrun.

    torchrun --nproc-per-node 2 -m rollplex run spec.yaml      # parallel: {train_tp: 2, rollout_tp: 1}

Every rank builds the same full actor from the same seed (or checkpoint), keeps its Megatron-layout shards
(`rollplex.parallel.model`), binds its rollout replica over them (`rollplex.parallel.bind`) and runs the same
iteration on the same batch; rank 0 alone writes metrics and the checkpoint's weights. NCCL on GPUs, gloo on
the CPU (the tests). Data parallelism is not here: the run has exactly train_tp processes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rollplex.parallel.bind import make_groups
from rollplex.parallel.group import TPGroup


@dataclass(frozen=True)
class TPSetup:
    train: TPGroup  # all ranks: the trainer's tensor-parallel group
    exchange: TPGroup  # the q ranks that fill one rollout shard
    rollout: TPGroup  # the r ranks of this rank's rollout replica

    @property
    def is_main(self) -> bool:
        return self.train.rank == 0

    def barrier(self) -> None:
        dist.barrier(group=self.train.group)


def launched_processes() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    """Rank 0 of a torchrun launch, or the only process."""
    return os.environ.get("RANK", "0") == "0"


def max_over_ranks(value: float) -> float:
    """The largest of every rank's value (collective); the value itself in a one-process run."""
    if not dist.is_initialized():
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def finish() -> None:
    """Under torchrun: waits for every rank, then ends the process group. A rank that exits while another
    still uses the group can abort at interpreter exit in gloo's threads ("terminate called without an active
    exception", seen once in a CI run after a bench's last collective). Nothing in a one-process run."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def check_launch(train_tp: int) -> None:
    """ValueError unless exactly train_tp processes were launched (torchrun sets WORLD_SIZE)."""
    world = launched_processes()
    if world != train_tp:
        launch = f"torchrun --nproc-per-node {train_tp} -m rollplex run SPEC" if train_tp > 1 else "rollplex run SPEC"
        raise ValueError(f"train_tp is {train_tp} but {world} processes were launched: use {launch}")


def init_tp(train_tp: int, rollout_tp: int, device: torch.device) -> tuple[TPSetup | None, torch.device]:
    """(the groups, this rank's device); (None, device) for a one-process run (see `check_launch`)."""
    check_launch(train_tp)
    if train_tp == 1:
        return None, device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return TPSetup(*make_groups(train_tp, rollout_tp, dist.get_rank())), device
