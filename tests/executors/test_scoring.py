"""Split scoring in batches of similar response lengths, across prompts, equals scoring each group padded to R."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from models_testkit import TinyInputs

from rollplex.executors.scoring import LeafBoundary, length_batches, row_batches, score_all
from rollplex.models.config import load_model_config
from rollplex.models.generate import Rollout
from rollplex.models.model import Qwen2_5_VL


@pytest.mark.parametrize("lens", [[3, 40, 5, 38, 1, 12, 12, 2], [7], [4, 4, 4], [1, 100]])
def test_length_batches_cover_every_response_once_with_bounded_padding(lens):
    batches = length_batches(lens, max_waste=0.25)
    assert sorted(i for b in batches for i in b) == list(range(len(lens)))
    for b in batches:
        longest, total = max(lens[i] for i in b), sum(lens[i] for i in b)
        assert len(b) == 1 or len(b) * longest <= 1.25 * total
        assert lens[b[0]] == longest  # longest first


def test_length_batches_group_similar_lengths():
    assert length_batches([3, 40, 5, 38, 1, 12, 12, 2]) == [[1, 3], [5, 6, 2], [0, 7], [4]]


def test_length_batches_hold_at_most_max_rows():
    assert length_batches([5] * 7, max_rows=3) == [[0, 1, 2], [3, 4, 5], [6]]


def test_row_batches_mix_prompts_and_score_as_each_group_alone():
    config = load_model_config("tiny")
    torch.manual_seed(0)
    model = Qwen2_5_VL(config)
    inputs = TinyInputs(config, torch.Generator().manual_seed(5))
    prompts = [inputs.prompt(3, inputs.image((4, 6)), 5), inputs.prompt(4)]
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([[9, 1, 8, 3], [2, 2, 9, 5]])
    rollout = Rollout(torch.randint(config.text.vocab_size, (2, 4, 9), generator=g), lens, torch.zeros(2, 4, 9))
    batches = row_batches(rollout, max_rows=4)
    assert len(batches) > 2 and all(len(b.index) <= 4 for b in batches)
    assert any(len(set((b.index // 4).tolist())) == 2 for b in batches)  # a batch mixing both prompts
    results = []
    for split in (True, False):  # length batches across prompts; the oracle: each group padded to R in one call
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
