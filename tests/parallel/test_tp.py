"""A model trained at TP t (gloo processes), with and without sequence parallelism, against the same model trained
whole: same logits, same update.

The update is one SGD step (linear in the gradient): AdamW's first step divides each gradient by its own
magnitude, which turns float rounding on near-zero gradients into differences of the full learning rate."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from parallel_testkit import config_for, image_prompt, next_token_loss, spawn, text_prompts

from rollplex.models.chunks import drain
from rollplex.models.inputs import Prompt
from rollplex.models.model import Qwen2_5_VL
from rollplex.models.rerun import Rerun
from rollplex.parallel.group import TPGroup
from rollplex.parallel.model import full_state, parallelize


def _train_step(model: Qwen2_5_VL, prompts) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # linear in the gradient: compares gradients
    next_token_loss(model, prompts).backward()
    optimizer.step()


def _tp_equals_whole(rank: int, world_size: int, sequence_parallel: bool) -> None:
    config = config_for(world_size)
    torch.manual_seed(0)
    whole = Qwen2_5_VL(config)
    group = TPGroup(world_size, rank, dist.group.WORLD)
    sharded = parallelize(copy.deepcopy(whole), group, sequence_parallel=sequence_parallel)
    prompts = [*text_prompts(), image_prompt(config), Prompt(torch.arange(10, 23))]  # 13 rows: splits unevenly
    rows = []
    sharded.model.language_model.layers[0].register_forward_hook(lambda m, args, out: rows.append(args[0].shape[1]))
    with torch.no_grad():
        torch.testing.assert_close(sharded(prompts), whole(prompts), atol=1e-5, rtol=1e-5)
    length = max(p.num_tokens for p in prompts)
    assert rows == [-(-length // world_size) if sequence_parallel else length]  # the rows a layer holds
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
    spawn(_tp_equals_whole, world_size, False)


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_a_sequence_parallel_model_computes_and_updates_like_the_whole_model(world_size):
    """The batch's rows split over the ranks (padded when they do not divide)."""
    spawn(_tp_equals_whole, world_size, True)


def _split_score(
    model: Qwen2_5_VL, prompts, responses, lens, prompts_per_chunk: int | None, selective: bool = False
) -> torch.Tensor:
    """The split path as the trainer runs it: the attached prefix in chunks of `prompts_per_chunk` prompts (None:
    all, their layers over the prompts packed end to end) with its units rerun in backward, then each response
    scored over its prompt's boundary (`selective`: each layer's halves around its attention rerun in backward);
    an SGD step on a loss of the log-probs and entropies. Returns the log-probs."""
    from rollplex.memory.offload import recompute_methods

    with torch.no_grad():
        chunks = model.prefix_chunks(prompts, attached=True, prompts_per_chunk=prompts_per_chunk, rerun=Rerun())
        boundary = drain(chunks)
    halves = ("before_attention", "after_attention") if selective else ()
    with recompute_methods((layer, h) for layer in model.model.language_model.layers for h in halves):
        out = model.suffix_rows(boundary, list(range(len(prompts))), responses, lens)
        weights = torch.linspace(-1, 1, out.logprobs.numel()).view_as(out.logprobs)
        ((out.logprobs * weights).sum() + 0.1 * out.entropy.sum()).backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    optimizer.step()
    return out.logprobs.detach()


def _sequence_parallel_split_path(rank: int, world_size: int) -> None:
    config = config_for(world_size)
    prompts = [*text_prompts(), image_prompt(config)]
    assert len({p.num_tokens for p in prompts}) > 1  # one group of them is padded: its layers run packed
    responses = torch.randint(10, 100, (len(prompts), 6), generator=torch.Generator().manual_seed(1))
    lens = [6, 2, 5, 1]  # responses of different lengths: the packed suffix is 10 rows
    for per_chunk, selective in ((1, False), (None, False), (None, True)):  # the sharded suffix's layers selective
        torch.manual_seed(0)
        whole = Qwen2_5_VL(config)
        group = TPGroup(world_size, rank, dist.group.WORLD)
        sharded = parallelize(copy.deepcopy(whole), group, sequence_parallel=True)
        torch.testing.assert_close(
            _split_score(sharded, prompts, responses, lens, per_chunk, selective),
            _split_score(whole, prompts, responses, lens, per_chunk), atol=1e-5, rtol=1e-5,
        )  # fmt: skip
        expected = whole.state_dict()
        for name, value in full_state(sharded, group).items():
            torch.testing.assert_close(value, expected[name], atol=2e-5, rtol=1e-4, msg=f"{per_chunk}: {name}")


def test_the_split_path_under_sequence_parallelism_scores_and_updates_like_the_whole_model():
    """Prefix chunks with reruns (their units rerun with the collectives inside) and the packed suffix; the prefix
    one prompt per chunk and all prompts in one packed group."""
    spawn(_sequence_parallel_split_path, 2)


def _prefix_keeps_what_the_plan_counts(rank: int, world_size: int, sequence_parallel: bool) -> None:
    from rollplex.layout.shapes import BF16, layer_input_bytes_per_token

    kept = []

    class Counting(Rerun):  # keeps what Rerun keeps (each unit's input, its `x`) and notes its bytes
        def __call__(self, unit, x, params, *consts):
            kept.append(x.numel() * x.element_size())
            return super().__call__(unit, x, params, *consts)

    config = config_for(world_size)
    torch.manual_seed(0)
    model = parallelize(
        Qwen2_5_VL(config), TPGroup(world_size, rank, dist.group.WORLD), sequence_parallel=sequence_parallel
    )
    prompts = text_prompts()  # 22 tokens end to end: whole rows on either rank under sequence parallelism
    drain(model.prefix_chunks(prompts, attached=True, rerun=Counting()))
    tokens, t = sum(p.num_tokens for p in prompts), config.text
    planned = tokens * t.num_hidden_layers * layer_input_bytes_per_token(t, world_size, sequence_parallel)
    assert sum(kept) == planned * 4 // BF16  # the plan's bf16 bytes; the CPU runs float32


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated-rows", "sequence-parallel"])
def test_the_recomputed_prefix_keeps_on_each_rank_the_layer_inputs_the_plan_counts(sequence_parallel):
    spawn(_prefix_keeps_what_the_plan_counts, 2, sequence_parallel)
