"""A model trained at TP t (gloo processes) against the same model trained whole: same logits, same update.

The update is one SGD step (linear in the gradient): AdamW's first step divides each gradient by its own
magnitude, which turns float rounding on near-zero gradients into differences of the full learning rate."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from parallel_testkit import config_for, image_prompt, next_token_loss, spawn, text_prompts

from rollplex.models.model import Qwen2_5_VL
from rollplex.parallel.group import TPGroup
from rollplex.parallel.model import full_state, parallelize


def _train_step(model: Qwen2_5_VL, prompts) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # linear in the gradient: compares gradients
    next_token_loss(model, prompts).backward()
    optimizer.step()


def _tp_equals_whole(rank: int, world_size: int) -> None:
    config = config_for(world_size)
    torch.manual_seed(0)
    whole = Qwen2_5_VL(config)
    sharded = parallelize(copy.deepcopy(whole), TPGroup(world_size, rank, dist.group.WORLD))
    prompts = [*text_prompts(), image_prompt(config)]
    with torch.no_grad():
        torch.testing.assert_close(sharded(prompts), whole(prompts), atol=1e-5, rtol=1e-5)
    _train_step(whole, prompts)
    _train_step(sharded, prompts)
    state = full_state(sharded, TPGroup(world_size, rank, dist.group.WORLD))
    expected = whole.state_dict()
    assert set(state) | {"lm_head.weight"} == set(expected) | {"lm_head.weight"}
    moved = 0
    for name, value in state.items():
        torch.testing.assert_close(value, expected[name], atol=2e-5, rtol=1e-4, msg=name)
        moved += int(not torch.equal(value, Qwen2_5_VL(config).state_dict()[name]))
    assert moved > 0.9 * len(state)  # the update reached (nearly) every tensor


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_tp_model_computes_and_updates_like_the_whole_model(world_size):
    spawn(_tp_equals_whole, world_size)
