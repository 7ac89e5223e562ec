"""ZeRO-1 in the chunked AdamW: ranks that each keep and update a share of the FP32 state (gloo processes) end
every step with the parameters of one unsharded optimizer, checkpoint their shares and resume from them."""

from __future__ import annotations

import sys
from itertools import pairwise
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel"))
from parallel_testkit import spawn

from rollplex.memory.optimizer import ChunkedAdamW
from rollplex.memory.state_layout import Shard, flat_segments, plan_chunks

SHAPES = [(7, 5), (13,), (3, 4, 5), (1,), (64, 33), (2, 3)]  # 2,231 elements: shares split parameters


def params_and_grads(step: int, dtype=torch.bfloat16) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]
    grads = []
    for k in range(step):
        g = torch.Generator().manual_seed(100 + k)
        grads.append([torch.randn(s, generator=g) for s in SHAPES])
    return params, grads


def run_steps(optimizer: ChunkedAdamW, params, grads) -> list[float]:
    norms = []
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.to(p.dtype)
        norms.append(float(optimizer.step()))
        optimizer.zero_grad()
    return norms


def test_the_shares_partition_the_flat_elements_and_their_chunks_cover_only_their_share():
    numels = [35, 13, 60, 1, 2112, 6]
    total = sum(numels)
    shares = [Shard(r, 3).bounds(total) for r in range(3)]
    assert shares[0][0] == 0 and shares[-1][1] == total and all(a[1] == b[0] for a, b in pairwise(shares))
    for lo, hi in shares:
        chunks = plan_chunks(numels, 12 * 100, lo, hi)
        assert sum(c.numel for c in chunks) == hi - lo and max(c.numel for c in chunks) <= 100
    starts = [0, 35, 48, 108, 109, 2221, 2227]
    pieces = flat_segments(starts, 40, 110)  # the tail of 1, all of 2 and 3, the head of 4
    assert [(s.param_index, s.start, s.stop, s.offset) for s in pieces] == [
        (1, 5, 13, 0), (2, 0, 60, 8), (3, 0, 1, 68), (4, 0, 1, 69)
    ]  # fmt: skip


def _sharded_equals_whole(rank: int, world_size: int, clip: float | None, tmp: str) -> None:
    steps = 3
    params, grads = params_and_grads(steps)
    ours = ChunkedAdamW(params, lr=1e-2, max_grad_norm=clip, chunk_bytes=12 * 97, shard=Shard(rank, world_size))
    theirs_params, _ = params_and_grads(0)
    theirs = ChunkedAdamW(theirs_params, lr=1e-2, max_grad_norm=clip, chunk_bytes=12 * 97)
    assert 0 < sum(c.numel for c in ours.chunks) < sum(p.numel() for p in params)  # a share, not the whole
    our_norms, their_norms = run_steps(ours, params, grads[:2]), run_steps(theirs, theirs_params, grads[:2])
    for a, b in zip(params, theirs_params, strict=True):
        if clip is None:
            assert torch.equal(a, b)  # the same AdamW on every element, the same casts
        else:  # the clip coefficient from the norm summed in another order
            torch.testing.assert_close(a, b, rtol=0, atol=1e-2 * float(b.abs().max()) / 64)
    assert our_norms == pytest.approx(their_norms, rel=1e-6)
    # this rank's share in a checkpoint, a fresh sharded optimizer resumed from it: the third step agrees too
    torch.save(list(ours.state_parts(max_bytes=12 * 500)), f"{tmp}/rank{rank}.pt")
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = ChunkedAdamW(resumed_params, lr=1e-2, max_grad_norm=clip, chunk_bytes=12 * 64,
                           shard=Shard(rank, world_size))  # fmt: skip
    for part in torch.load(f"{tmp}/rank{rank}.pt", weights_only=True):
        assert part["param_groups"][0]["shard"] == [rank, world_size]
        resumed.load_state_dict(part)
    run_steps(resumed, resumed_params, grads[2:])
    run_steps(theirs, theirs_params, grads[2:])
    for a, b in zip(resumed_params, theirs_params, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0 if clip is None else 1e-2 * float(b.abs().max()) / 64)
    if world_size > 1:  # another rank's share is refused, in one line
        other = torch.load(f"{tmp}/rank{rank}.pt", weights_only=True)[0]
        other["param_groups"][0]["shard"] = [(rank + 1) % world_size, world_size]
        with pytest.raises(ValueError, match="resume with the data-parallel layout"):
            resumed.load_state_dict(other)


@pytest.mark.parametrize("world_size, clip", [(2, None), (3, 0.5)])
def test_sharded_ranks_step_to_the_parameters_of_one_whole_optimizer_and_resume_from_their_shares(
    tmp_path, world_size, clip
):
    spawn(_sharded_equals_whole, world_size, clip, str(tmp_path))


@pytest.mark.parametrize("distributed", [False, True], ids=["replicated", "zero1"])
def test_the_plans_optimizer_state_per_gpu_is_what_each_ranks_chunked_adamw_holds(distributed):
    from dataclasses import replace

    from rollplex.graph.load import load_spec
    from rollplex.graph.memobject import Component
    from rollplex.graph.plan import compile_plan
    from rollplex.memory.optimizer import STATE_BYTES_PER_ELEMENT
    from rollplex.models.config import load_model_config
    from rollplex.models.model import Qwen2_5_VL

    base = load_spec(Path(__file__).resolve().parents[2] / "specs/tiny_cpu_dp2.yaml")  # DP 2, vision trained
    parallel = base.spec.parallel.model_copy(update={"distributed_optimizer": distributed})
    plan = compile_plan(replace(base, spec=base.spec.model_copy(update={"parallel": parallel})))
    state = (Component.MASTER, Component.MOMENTS)
    planned = sum(o.bytes for o in plan.residency.objects if o.role == "actor" and o.component in state)
    params = [p for p in Qwen2_5_VL(load_model_config("tiny")).parameters() if p.requires_grad]
    for rank in range(2 if distributed else 1):
        optimizer = ChunkedAdamW(params, lr=1e-3, shard=Shard(rank, 2) if distributed else None)
        assert STATE_BYTES_PER_ELEMENT * sum(c.numel for c in optimizer.chunks) == planned, rank
