"""Attention over a shared prompt merged with per-response attention equals attention over prompt ++ response."""

from __future__ import annotations

import pytest
import torch

from rollplex.models import attention
from rollplex.models.attention import SharedPrefixAttention, attend, attention_length, causal_sdpa, merge_attention
from rollplex.models.boundary import Boundary

HEADS, KV_HEADS, DIM = 4, 2, 8


def test_merging_attention_over_two_key_sets_equals_attention_over_their_union():
    q, k, v = torch.randn(2, 3, 5, DIM), torch.randn(2, 3, 9, DIM), torch.randn(2, 3, 9, DIM)
    everything = torch.ones(5, 9, dtype=torch.bool)
    out, lse = attend(q, k, v, everything)
    out_a, lse_a = attend(q, k[..., :4, :], v[..., :4, :], everything[:, :4])
    out_b, lse_b = attend(q, k[..., 4:, :], v[..., 4:, :], everything[:, 4:])
    assert torch.allclose(merge_attention(out_a, lse_a, out_b, lse_b), out, atol=1e-6)
    assert torch.allclose(torch.logaddexp(lse_a, lse_b), lse, atol=1e-6)


def test_shared_prefix_attention_equals_causal_attention_over_the_copied_prompt():
    num_prompts, num_samples, num_tokens, prompt_lens = 2, 3, 4, torch.tensor([5, 3])
    keys = torch.randn(num_prompts, KV_HEADS, 5, DIM)
    values = torch.randn(num_prompts, KV_HEADS, 5, DIM)
    boundary = Boundary((keys,), (values,), torch.zeros(num_prompts, 1), prompt_lens, prompt_lens)
    batch = num_prompts * num_samples
    q = torch.randn(batch, HEADS, num_tokens, DIM)
    k, v = torch.randn(batch, KV_HEADS, num_tokens, DIM), torch.randn(batch, KV_HEADS, num_tokens, DIM)

    out = SharedPrefixAttention(boundary, num_samples)(0, q, k, v)

    for row in range(batch):
        p, length = row // num_samples, int(prompt_lens[row // num_samples])
        full_k = torch.cat([keys[p, :, :length], k[row]], dim=1).repeat_interleave(HEADS // KV_HEADS, 0)
        full_v = torch.cat([values[p, :, :length], v[row]], dim=1).repeat_interleave(HEADS // KV_HEADS, 0)
        mask = torch.ones(num_tokens, length + num_tokens, dtype=torch.bool).tril(length)
        expected = torch.nn.functional.scaled_dot_product_attention(q[row], full_k, full_v, attn_mask=mask)
        assert torch.allclose(out[row], expected, atol=1e-6)


def test_attention_lengths_are_few_per_octave_and_waste_at_most_a_sixteenth():
    lengths = range(1, 20000)
    padded = [attention_length(n) for n in lengths]
    assert all(n <= p <= n * (1 + 1 / 16) for n, p in zip(lengths, padded, strict=True))
    assert padded == sorted(padded) and all(attention_length(p) == p for p in padded)  # monotone, idempotent
    assert len({attention_length(n) for n in range(4097, 8193)}) == 16  # 4352, 4608, ..., 8192
    assert attention_length(4910) == 5120 and attention_length(16) == 16


def test_causal_attention_at_a_bucketed_length_equals_it_at_the_exact_length_gradients_included():
    q = torch.randn(2, HEADS, 37, DIM, requires_grad=True)  # 37 tokens run as 38
    k = torch.randn(2, KV_HEADS, 37, DIM, requires_grad=True)
    v = torch.randn(2, KV_HEADS, 37, DIM, requires_grad=True)
    outs = [causal_sdpa(q, k, v, bucketed=bucketed) for bucketed in (False, True)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    weights = torch.randn_like(outs[0])
    exact, padded = (torch.autograd.grad((out * weights).sum(), (q, k, v)) for out in outs)
    for ours, theirs in zip(padded, exact, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_scoring_attention_keeps_no_per_row_prompt_copy_for_backward_and_its_gradients_are_exact():
    torch.manual_seed(0)  # not the state earlier tests leave: fp32 sums of another order, near-cancelling elements
    num_prompts, num_tokens, prompt_lens = 2, 4, torch.tensor([5, 3])
    rows = torch.tensor([1, 0, 1])  # a batch mixing the prompts' responses, in any order
    keys = torch.randn(num_prompts, KV_HEADS, 5, DIM, requires_grad=True)
    values = torch.randn(num_prompts, KV_HEADS, 5, DIM, requires_grad=True)
    boundary = Boundary((keys,), (values,), torch.zeros(num_prompts, 1), prompt_lens, prompt_lens)
    q = torch.randn(3, HEADS, num_tokens, DIM, requires_grad=True)
    k = torch.randn(3, KV_HEADS, num_tokens, DIM, requires_grad=True)
    v = torch.randn(3, KV_HEADS, num_tokens, DIM, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        out = SharedPrefixAttention(boundary, 1, rows=rows)(0, q, k, v)
    assert (3, HEADS, 5 + num_tokens, DIM) not in saved  # the gathered, head-repeated K and V are rebuilt
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, keys, values))
    rows_out = []
    for row in range(3):  # the oracle: each row over its own prompt's real keys, then its own causally
        p, length = int(rows[row]), int(prompt_lens[rows[row]])
        full_k = torch.cat([keys[p, :, :length], k[row]], dim=1).repeat_interleave(HEADS // KV_HEADS, 0)
        full_v = torch.cat([values[p, :, :length], v[row]], dim=1).repeat_interleave(HEADS // KV_HEADS, 0)
        mask = torch.ones(num_tokens, length + num_tokens, dtype=torch.bool).tril(length)
        rows_out.append(torch.nn.functional.scaled_dot_product_attention(q[row], full_k, full_v, attn_mask=mask))
    torch.testing.assert_close(out, torch.stack(rows_out), rtol=1e-5, atol=1e-6)
    oracle = torch.autograd.grad(torch.stack(rows_out).square().sum(), (q, k, v, keys, values))
    for ours, theirs in zip(grads, oracle, strict=True):  # O(1) gradients; fp32 sums in another order
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.usefixtures("cudnn_attention")
def test_on_a_gpu_causal_cudnn_attention_at_a_bucketed_length_equals_the_exact_length():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    shapes = [(1, n, 600, 128) for n in (16, 2, 2)]  # 600 tokens run as 608
    q, k, v = (torch.randn(s, device="cuda", dtype=torch.bfloat16, requires_grad=True) for s in shapes)
    assert attention.plans_per_shape(q.device)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):  # the kernel that plans per shape takes the padded call
        outs = [causal_sdpa(q, k, v, bucketed=bucketed) for bucketed in (False, True)]
    torch.testing.assert_close(outs[1], outs[0])
    exact, padded = (torch.autograd.grad(out.float().square().sum(), (q, k, v)) for out in outs)
    for ours, theirs in zip(padded, exact, strict=True):
        assert torch.isfinite(ours).all()
        torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2)
