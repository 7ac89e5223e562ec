"""The prefix's attention planned before the first step: which shapes, and that the planning calls meet them."""

from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest
import torch

from rollplex.models import attention
from rollplex.models.attention import attention_length
from rollplex.models.attention_plans import (
    buckets_between,
    plan_prefix_attention,
    prefix_attention_shapes,
    run_prefix_layer,
)
from rollplex.models.config import load_model_config
from rollplex.models.model import Qwen2_5_VL


def test_the_buckets_between_two_lengths_are_those_of_every_length_between_them():
    rng = random.Random(0)
    for _ in range(200):
        low = rng.randrange(1, 9000)
        high = low + rng.randrange(0, 3000)
        assert buckets_between(low, high) == sorted({attention_length(n) for n in range(low, high + 1)})


def test_the_shapes_cover_every_group_of_the_steps_as_its_prefix_groups_them():
    rng = random.Random(1)
    steps = [[rng.randrange(4800, 7400) for _ in range(8)] for _ in range(20)]
    for per_chunk, sizes in ((1, {1}), (3, {3, 2}), (None, {8})):
        shapes = prefix_attention_shapes(steps, per_chunk)
        assert {size for size, _ in shapes} == sizes and len(set(shapes)) == len(shapes)
        for lens in steps:
            size = per_chunk or len(lens)
            for i in range(0, len(lens), size):
                group = lens[i : i + size]
                assert (len(group), attention_length(max(group))) in shapes
    longest = max(max(lens) for lens in steps)
    alone = [length for _, length in prefix_attention_shapes(steps, 1)]
    assert max(alone) == attention_length(int(longest * (1 + 1 / 16)))  # one bucket's width beyond the longest
    assert len(prefix_attention_shapes([[5000, 5001]], None)) <= 3  # one group: its bucket and the margin's


def test_planning_runs_the_first_layer_at_each_shape_without_and_with_grad_and_leaves_no_gradient(monkeypatch):
    config = load_model_config("tiny")
    torch.manual_seed(0)
    model = Qwen2_5_VL(config)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recorded(q, k, v, **kwargs):
        calls.append((tuple(q.shape), q.is_contiguous(), torch.is_grad_enabled()))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(attention, "plans_per_shape", lambda device: True)  # bucketed, as on cuDNN
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    shapes = [(1, 40), (1, 48), (3, 56)]
    plan_prefix_attention(model, shapes)
    heads, dim = config.text.num_attention_heads, config.text.head_dim
    expected = [((p, heads, length, dim), True, grad) for p, length in shapes for grad in (False, True)]
    assert calls == expected  # padded to the bucket: each shape once under no_grad, once attached
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_a_bucketed_call_at_a_bucket_length_runs_on_a_contiguous_copy_and_equals_the_exact_call():
    q = torch.randn(2, 32, 4, 8).transpose(1, 2).requires_grad_(True)  # [B, heads, L, D], L = 32 a bucket
    k, v = (torch.randn(2, 32, 2, 8).transpose(1, 2).requires_grad_(True) for _ in range(2))
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recorded(q, k, v, **kwargs):
        seen.append(all(t.is_contiguous() for t in (q, k, v)))
        return sdpa(q, k, v, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.nn.functional, "scaled_dot_product_attention", recorded)
        outs = [attention.causal_sdpa(q, k, v, bucketed=bucketed) for bucketed in (False, True)]
    assert seen == [False, True]
    torch.testing.assert_close(outs[1], outs[0])
    exact, bucketed = (torch.autograd.grad(out.square().sum(), (q, k, v)) for out in outs)
    for ours, theirs in zip(bucketed, exact, strict=True):
        torch.testing.assert_close(ours, theirs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.usefixtures("cudnn_attention")
def test_on_a_gpu_a_planned_bucket_costs_the_prefix_layer_no_plan():
    """A layer call at a length whose bucket was planned takes a fraction of the host time of one at a bucket
    not planned (cuDNN builds that one's plans first), at the bucket's own length too (no padding)."""
    base = load_model_config("qwen2_5_vl_3b")
    config = replace(base, text=replace(base.text, num_hidden_layers=1), vision=replace(base.vision, depth=1))
    model = Qwen2_5_VL(config, torch.bfloat16, torch.device("cuda"))
    assert attention.plans_per_shape(model.device)
    plan_prefix_attention(model, [(1, 3328)])  # lengths 3,201-3,328

    def host_s(length: int) -> float:
        torch.cuda.synchronize()
        began = time.perf_counter()
        run_prefix_layer(model, [length])  # the layer without and with grad, and its backward
        torch.cuda.synchronize()
        return time.perf_counter() - began

    host_s(2048)  # the first calls' other costs (kernels compiled, the allocator's blocks) out of the way
    unplanned = host_s(2300)  # bucket 2,304
    planned = [host_s(3300), host_s(3328)]  # the second unpadded: the bucket's own length
    assert max(planned) < unplanned / 3, (planned, unplanned)
