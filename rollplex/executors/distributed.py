"""The processes of a parallel `rollplex run`, one per GPU of the cluster, started by torchrun: a tensor-parallel
group of train_tp ranks, or data-parallel ranks of train_tp 1 each (`dataparallel.py`).

    torchrun --nproc-per-node 2 -m rollplex run spec.yaml      # parallel: {train_tp: 2, rollout_tp: 1}

Every rank builds the same full actor from the same seed (or checkpoint), keeps its Megatron-layout shards
(`rollplex.parallel.model`), binds its rollout replica over them (`rollplex.parallel.bind`) and runs the same
iteration on the same batch; rank 0 alone writes metrics and the checkpoint's weights. NCCL on GPUs, gloo on
the CPU (the tests). With more processes than train_tp, each TP group is one data-parallel replica.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rollplex.executors.dataparallel import DataParallel
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


def check_world(nodes: int, gpus_per_node: int) -> None:
    """ValueError unless one process per GPU of the spec's cluster was launched (`rollplex run`): nodes x
    gpus_per_node in all, gpus_per_node on this node (torchrun's LOCAL_WORLD_SIZE; absent outside torchrun)."""
    from rollplex.report.tables import launch_command

    launch, more = launch_command(nodes, gpus_per_node), ", or describe the machines you run on in `cluster`"
    _check_processes(nodes * gpus_per_node, f"the cluster has {nodes * gpus_per_node} GPUs", launch, more)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", gpus_per_node))
    if local != gpus_per_node:
        raise ValueError(
            f"the cluster has {gpus_per_node} GPUs per node but {local} processes were launched on this node: "
            f"use {launch}{more}"
        )


def check_launch(train_tp: int) -> None:
    """ValueError unless exactly train_tp processes were launched (`rollplex bench`, one TP group)."""
    from rollplex.report.tables import launch_command

    _check_processes(train_tp, f"train_tp is {train_tp}", launch_command(1, train_tp, command="bench"))


def _check_processes(expected: int, why: str, launch: str, more: str = "") -> None:
    world = launched_processes()  # torchrun sets WORLD_SIZE
    if world != expected:
        raise ValueError(f"{why} but {world} processes were launched: use {launch}{more}")


def init_parallel(
    train_tp: int, rollout_tp: int, device: torch.device
) -> tuple[TPSetup | None, DataParallel | None, torch.device]:
    """This process's tensor-parallel groups (None at train_tp 1), its data-parallel replicas (None when the
    launched processes are one TP group) and its device. Ranks r*t .. r*t + t-1 form data-parallel replica r."""
    world = launched_processes()
    if world < train_tp:
        check_launch(train_tp)
    if world == 1:
        return None, None, device
    if world % train_tp:
        raise ValueError(f"{world} processes do not split into TP groups of {train_tp}")
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()
    tp = TPSetup(*make_groups(train_tp, rollout_tp, rank, world)) if train_tp > 1 else None
    dp = None
    if world > train_tp:
        position = rank % train_tp
        groups = [dist.new_group(list(range(j, world, train_tp))) for j in range(train_tp)]  # every rank makes all
        on = device if device.type == "cuda" else None  # NCCL reduces device tensors, gloo host ones
        dp = DataParallel(world // train_tp, rank // train_tp, groups[position], device=on)
    return tp, dp, device
