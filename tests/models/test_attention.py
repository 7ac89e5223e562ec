"""Attention over a shared prompt merged with per-response attention equals attention over prompt ++ response."""

from __future__ import annotations

import pytest
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


def composite_attend(q, k, v, mask):
    """The oracle: plain autograd over the whole score matrix."""
    scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = scores.logsumexp(dim=-1)
    return torch.exp(scores - lse[..., None]).to(v.dtype) @ v, lse


@pytest.mark.parametrize("block_bytes", [4 * 16 * 7, 1 << 30])  # a few query rows per block; one block
@pytest.mark.parametrize("layout", ["shared prompt", "own causal"])
def test_block_attention_gives_the_composite_outputs_and_gradients_through_out_and_lse(
    monkeypatch, block_bytes, layout
):
    import rollplex.models.attention as attention

    monkeypatch.setattr(attention, "SCORE_BLOCK_BYTES", block_bytes)
    g = torch.Generator().manual_seed(0)
    if layout == "shared prompt":  # as SharedPrefixAttention._attend_prompt: heads share a prompt's KV
        q = torch.randn(2, 2, 3, 10, DIM, generator=g, dtype=torch.float32)
        k, v = (torch.randn(2, 2, 1, 7, DIM, generator=g, dtype=torch.float32) for _ in range(2))
        mask = (torch.arange(7) < torch.tensor([7, 4])[:, None])[:, None, None, None, :]
    else:  # as _attend_own: causal over the sequence's own keys, the last T of K
        q = torch.randn(3, 2, 2, 5, DIM, generator=g, dtype=torch.float32)
        k, v = (torch.randn(3, 2, 1, 8, DIM, generator=g, dtype=torch.float32) for _ in range(2))
        mask = torch.arange(8) <= torch.arange(3, 8)[:, None]
    w_out, w_lse = torch.randn(q.shape, generator=g, dtype=torch.float32), torch.randn(q.shape[:-1], generator=g)
    grads = []
    for fn in (attend, composite_attend):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out, lse = fn(*leaves, mask)
        ((out * w_out).sum() + (lse * w_lse).sum()).backward()
        grads.append((out.detach(), lse.detach(), *(t.grad for t in leaves)))
    for ours, oracle in zip(*grads, strict=True):
        torch.testing.assert_close(ours, oracle.to(ours.dtype), rtol=1e-5, atol=1e-5)


def test_block_attention_backward_through_out_alone():
    q, k, v = torch.randn(2, 5, DIM, requires_grad=True), torch.randn(2, 6, DIM), torch.randn(2, 6, DIM)
    out, _ = attend(q, k, v, torch.ones(5, 6, dtype=torch.bool))
    out.sum().backward()
    q2 = q.detach().clone().requires_grad_()
    composite_attend(q2, k, v, torch.ones(5, 6, dtype=torch.bool))[0].sum().backward()
    torch.testing.assert_close(q.grad, q2.grad)
