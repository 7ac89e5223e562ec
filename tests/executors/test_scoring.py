"""Split scoring in batches of similar response lengths equals scoring the whole group padded to its longest."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from models_testkit import TinyInputs

import rollplex.executors.scoring as scoring
from rollplex.executors.scoring import LeafBoundary, length_batches, score_group_split
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


def test_batched_scores_and_boundary_gradients_equal_one_padded_batch(monkeypatch):
    config = load_model_config("tiny")
    torch.manual_seed(0)
    model = Qwen2_5_VL(config)
    inputs = TinyInputs(config, torch.Generator().manual_seed(5))
    prompts = [inputs.prompt(3, inputs.image((4, 6)), 5), inputs.prompt(4)]
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([[9, 1, 8, 3], [2, 2, 9, 5]])
    rollout = Rollout(torch.randint(config.text.vocab_size, (2, 4, 9), generator=g), lens, torch.zeros(2, 4, 9))
    results = []
    for waste in (0.25, float("inf")):  # batches of similar lengths; everything in one batch
        monkeypatch.setattr(scoring, "PADDING_WASTE", waste)
        leaf = LeafBoundary.of(model.prefix(prompts, attached=True))
        outs = [score_group_split(model, leaf.leaf, p, rollout) for p in range(2)]
        sum(o.logprobs.sum() + 0.5 * o.entropy.sum() for o in outs).backward()
        grads = [t.grad for t in (*leaf.leaf.keys, *leaf.leaf.values)]
        results.append([*(o.logprobs for o in outs), *(o.entropy for o in outs), *grads])
    assert len(length_batches(lens[0].tolist())) > 1
    for ours, oracle in zip(*results, strict=True):
        torch.testing.assert_close(ours, oracle, rtol=1e-5, atol=1e-5)
