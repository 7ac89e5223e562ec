"""Attention over a shared prompt merged with per-response attention equals attention over prompt ++ response."""

from __future__ import annotations

import torch

from rollplex.models.attention import SharedPrefixAttention, attend, merge_attention
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


def test_scoring_attention_keeps_no_per_row_prompt_copy_for_backward_and_its_gradients_are_exact():
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
    for ours, theirs in zip(grads, oracle, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
