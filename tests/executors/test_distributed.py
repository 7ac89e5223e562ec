"""`check_world`: a launch must start one process per GPU of the spec's cluster, as many on each node as it has
GPUs; a launch that does not is one error naming the command that fits."""

from __future__ import annotations

import pytest

from rollplex.executors.distributed import check_world


def torchrun(monkeypatch, world: int, local: int) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))


def test_a_launch_of_the_clusters_shape_passes(monkeypatch):
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    check_world(1, 1)  # no torchrun: one process
    torchrun(monkeypatch, 4, 2)
    check_world(2, 2)


def test_as_many_processes_on_another_number_of_nodes_is_refused_with_the_launch_that_fits(monkeypatch):
    torchrun(monkeypatch, 2, 2)  # one node of two processes for a cluster of two one-GPU nodes
    with pytest.raises(ValueError, match="1 GPUs per node but 2 processes were launched on this node") as e:
        check_world(2, 1)
    assert "torchrun --nnodes 2 --nproc-per-node 1 --node-rank R" in str(e.value)


def test_another_number_of_processes_is_refused_with_the_launch_that_fits(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="the cluster has 2 GPUs but 1 processes") as e:
        check_world(1, 2)
    assert "use rollplex run SPEC" in str(e.value)  # which starts one node's processes itself
