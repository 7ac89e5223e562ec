"""The fused LM-head scores over a vocabulary-parallel head (`kernels.token_scores`, TP group of gloo processes,
the kernels under Triton's interpreter): each rank's shard combines into the whole head's log-probs and entropies,
and the gradients are the whole head's (the hidden states' summed over the ranks, each shard's its rows)."""

from __future__ import annotations

import pytest
import torch
from parallel_testkit import spawn

from rollplex.kernels.token_scores import BLOCK_V, head_scores
from rollplex.models.sampling import tempered
from rollplex.parallel.group import TPGroup

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter's test (a GPU runs compiled)")


def _inputs():
    g = torch.Generator().manual_seed(0)
    rows, width, vocab = 5, 16, 2 * BLOCK_V + 200  # each shard of two: a whole block and a partial one
    hidden = torch.randn(rows, width, generator=g) * 2
    weight = torch.randn(vocab, width, generator=g)
    targets = torch.tensor([0, vocab // 2 - 1, vocab // 2, vocab - 1, 77])  # on either side of the shards' border
    return hidden, weight, targets, torch.randn(2, rows, generator=g)


def _sharded_equals_whole(rank: int, world_size: int, temperature: float) -> None:
    import torch.distributed as dist

    hidden, weight, targets, (a, b) = _inputs()
    group = TPGroup(world_size, rank, dist.group.WORLD)
    rows = group.shard(weight.shape[0])
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logprobs = tempered(h @ w.t(), temperature)
    lp, ent = logprobs.gather(-1, targets[:, None])[:, 0], -(logprobs.exp() * logprobs).sum(-1)
    (a * lp + b * ent).sum().backward()
    h2, shard = hidden.clone().requires_grad_(), weight[rows.start : rows.stop].clone().requires_grad_()
    lp2, ent2 = head_scores(h2, shard, targets, temperature, group)
    (a * lp2 + b * ent2).sum().backward()
    tol = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lp2, lp.detach(), **tol)
    torch.testing.assert_close(ent2, ent.detach(), **tol)
    grads = dict(atol=5e-5, rtol=1e-4)  # sums over the whole vocabulary in another order
    torch.testing.assert_close(h2.grad, h.grad, **grads)
    torch.testing.assert_close(shard.grad, w.grad[rows.start : rows.stop], **grads)
    with torch.no_grad():
        again = head_scores(hidden, weight[rows.start : rows.stop], targets, temperature, group)
    torch.testing.assert_close(torch.stack(again), torch.stack([lp, ent]).detach(), **tol)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_a_vocabulary_parallel_heads_scores_and_gradients_are_the_whole_heads(temperature):
    spawn(_sharded_equals_whole, 2, temperature)
