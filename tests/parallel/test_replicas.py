"""Rollout replicas sharing a step's prompts (gloo processes): every rank gets the same whole rollout, a greedy
split rollout equals one replica sampling everything, and so does a sampled one where the rollout keys its random
numbers by row (the engine's fused sampler), for a data-parallel rank's share too."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from parallel_testkit import spawn, text_prompts

from rollplex.models.config import load_model_config
from rollplex.models.generate import generate
from rollplex.models.inputs import Prompt
from rollplex.models.model import Qwen2_5_VL
from rollplex.models.sampling import SamplingParams
from rollplex.parallel.group import TPGroup
from rollplex.parallel.replicas import shares, split_rollout


@pytest.mark.parametrize(("num_prompts", "num_replicas"), [(8, 2), (7, 2), (5, 4), (4, 4)])
def test_shares_cover_the_prompts_in_order_and_differ_by_at_most_one(num_prompts, num_replicas):
    parts = shares(num_prompts, num_replicas)
    assert [i for r in parts for i in r] == list(range(num_prompts))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def _split_equals_whole(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = Qwen2_5_VL(load_model_config("tiny"))
    replicas = TPGroup(world_size, rank, dist.group.WORLD)
    prompts = [*text_prompts(), Prompt(torch.arange(20, 29))]
    rollout = split_rollout(lambda p, **kw: generate(model, p, **kw), replicas)
    greedy = SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=tuple(range(20, 40)))
    ours = rollout(prompts, num_samples=2, params=greedy, generator=torch.Generator().manual_seed(1))
    whole = generate(model, prompts, num_samples=2, params=greedy, generator=torch.Generator())
    width = whole.responses.shape[2]
    assert torch.equal(ours.response_lens, whole.response_lens) and torch.equal(
        ours.responses[..., :width], whole.responses
    )
    torch.testing.assert_close(ours.logprobs[..., :width], whole.logprobs, atol=1e-5, rtol=1e-5)
    sampled = SamplingParams(temperature=1.0, max_tokens=5)
    runs = [rollout(prompts, num_samples=2, params=sampled, generator=torch.Generator().manual_seed(2)) for _ in "ab"]
    assert torch.equal(runs[0].responses, runs[1].responses)  # reproducible from the shared generator's state
    everyone = [None] * world_size
    dist.all_gather_object(everyone, runs[0].responses)
    assert all(torch.equal(r, everyone[0]) for r in everyone)  # every rank trains on the same rollout


@pytest.mark.slow
def test_a_greedy_split_rollout_equals_one_replica_sampling_everything():
    spawn(_split_equals_whole, 2)


def _keyed_split_equals_whole(rank: int, world_size: int) -> None:
    from rollplex.rollout.engine import RolloutEngine

    torch.manual_seed(0)
    model = Qwen2_5_VL(load_model_config("tiny"))
    replicas = TPGroup(world_size, rank, dist.group.WORLD)
    prompts = [*text_prompts(), Prompt(torch.arange(20, 29))]
    sampled = SamplingParams(temperature=1.0, max_tokens=3)
    whole = RolloutEngine(model).generate(
        prompts, num_samples=2, params=sampled, generator=torch.Generator().manual_seed(3)
    )
    rollout = split_rollout(RolloutEngine(model).generate, replicas, keyed=True)
    generator = torch.Generator().manual_seed(3)
    ours = rollout(prompts, num_samples=2, params=sampled, generator=generator)
    width = ours.responses.shape[2]
    assert torch.equal(ours.response_lens, whole.response_lens)
    assert torch.equal(ours.responses, whole.responses[..., :width])
    torch.testing.assert_close(ours.logprobs, whole.logprobs[..., :width], atol=1e-5, rtol=1e-5)
    drew = torch.Generator().manual_seed(3)
    torch.randint(2**62, (1,), generator=drew)
    assert torch.equal(generator.get_state(), drew.get_state())  # one seed drawn, as one replica draws it
    # a data-parallel rank holding the step's last two prompts (rows 4..7 of 8): its replicas sample those rows
    part = rollout(prompts[2:], num_samples=2, params=sampled, generator=torch.Generator().manual_seed(3),
                   rows=([4, 5, 6, 7], 8))  # fmt: skip
    width = part.responses.shape[2]
    assert torch.equal(part.response_lens, whole.response_lens[2:])
    assert torch.equal(part.responses, whole.responses[2:, :, :width])


@pytest.mark.slow
def test_a_split_rollout_keyed_by_row_samples_what_one_replica_samples():
    spawn(_keyed_split_equals_whole, 2)
