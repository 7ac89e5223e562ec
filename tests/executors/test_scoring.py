"""Split scoring in packed batches of responses across prompts, within a token budget, equals scoring all at once."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from models_testkit import TinyInputs

from rollplex.executors.scoring import LeafBoundary, row_batches, score_all, token_batches
from rollplex.models.config import load_model_config
from rollplex.models.generate import Rollout
from rollplex.models.model import Qwen2_5_VL


@pytest.mark.parametrize("lens", [[3, 40, 5, 38, 1, 12, 12, 2], [7], [4, 4, 4], [1, 100], [0, 0, 3]])
def test_token_batches_cover_every_response_once_within_the_budget(lens):
    batches = token_batches(lens, max_tokens=50)
    assert sorted(i for b in batches for i in b) == list(range(len(lens)))
    for b in batches:
        assert len(b) == 1 or sum(lens[i] for i in b) <= 50  # a longer response alone
        assert b == sorted(b)  # in index order: a prompt's responses together


def test_token_batches_are_as_few_as_first_fit_needs_and_share_the_tokens():
    # first fit, longest first: [0, 1, 2, 7] (50 tokens), [3, 5] (50), [4, 6] (13)
    assert token_batches([3, 40, 5, 38, 1, 12, 12, 2], max_tokens=50) == [[1], [3], [0, 2, 4, 5, 6, 7]]
    assert token_batches([5] * 7, max_tokens=15) == [[0, 3, 6], [1, 4], [2, 5]]  # first fit: 15, 15, 5
    assert token_batches([100, 30, 20], max_tokens=50) == [[0], [1, 2]]  # the longer one alone


def test_token_batches_keep_the_first_fit_where_dealing_finds_no_room():
    # dealing longest first leaves 4 + 4 + 3 and 4 + 3 + 3, the last 3 fitting neither; first fit fills both batches
    lens = [4, 4, 4, 3, 3, 3, 3]
    assert token_batches(lens, max_tokens=12) == [[0, 1, 2], [3, 4, 5, 6]]


@pytest.mark.parametrize("seed", range(4))
def test_token_batches_of_a_long_tailed_step_hold_about_equal_tokens(seed):
    rng = random.Random(seed)
    lens = [2048] + [min(2048, max(1, round(rng.lognormvariate(5.5, 1.0)))) for _ in range(63)]
    budget = 8 * 2048 if sum(lens) > 8 * 2048 else sum(lens) // 2 + 1  # two batches or more
    batches = token_batches(lens, max_tokens=budget)
    tokens = [sum(lens[i] for i in b) for b in batches]
    assert len(batches) == -(-sum(lens) // budget) and max(tokens) - min(tokens) <= 2048, tokens


def test_row_batches_mix_prompts_and_score_as_each_group_alone():
    config = load_model_config("tiny")
    torch.manual_seed(0)
    model = Qwen2_5_VL(config)
    inputs = TinyInputs(config, torch.Generator().manual_seed(5))
    prompts = [inputs.prompt(3, inputs.image((4, 6)), 5), inputs.prompt(4)]
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([[9, 1, 8, 3], [2, 2, 9, 5]])
    rollout = Rollout(torch.randint(config.text.vocab_size, (2, 4, 9), generator=g), lens, torch.zeros(2, 4, 9))
    batches = row_batches(rollout, max_tokens=12)
    assert len(batches) > 2 and all(sum(b.lens) <= 12 for b in batches)
    assert any(len(set(b.rows)) == 2 for b in batches)  # a batch mixing both prompts
    assert all(b.rows == tuple((b.index // 4).tolist()) and b.lens == tuple(lens.flatten()[b.index].tolist())
               for b in batches)  # fmt: skip
    results = []
    for split in (True, False):  # batches across prompts (score_all's: a group of the longest's tokens each)
        leaf = LeafBoundary.of(model.prefix(prompts, attached=True))
        if split:
            out = score_all(model, prompts, leaf.leaf, rollout)
        else:
            out = model.suffix(leaf.leaf, rollout.responses, lens)
        (out.logprobs.sum() + 0.5 * out.entropy.sum()).backward()
        grads = [t.grad for t in (*leaf.leaf.keys, *leaf.leaf.values, leaf.leaf.first_logprobs)]
        results.append([out.logprobs, out.entropy, *grads])
    for ours, oracle in zip(*results, strict=True):
        torch.testing.assert_close(ours, oracle, rtol=1e-5, atol=1e-5)
