"""Cascade decode attention equals plain softmax attention over prompt ++ own keys, for every live row."""

from __future__ import annotations

import pytest
import torch
from kernels_testkit import DEVICE, assert_matches, random

from rollplex.kernels.decode_attention import DecodeAttention, DecodeAttentionShape


def reference(q, prompt_k, prompt_v, prompt_lens, own_k, own_v, slots, step, num_samples):
    """out [rows, H, D]: each row's heads attend to its prompt's real keys and its own first step+1 keys."""
    heads = q.shape[1]
    groups = prompt_k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float32)
    for row, slot in enumerate(slots.tolist()):
        p = slot // num_samples
        k = torch.cat([prompt_k[p, :, : prompt_lens[p]], own_k[slot, :, : step + 1]], dim=1).float()
        v = torch.cat([prompt_v[p, :, : prompt_lens[p]], own_v[slot, :, : step + 1]], dim=1).float()
        k, v = k.repeat_interleave(heads // groups, 0), v.repeat_interleave(heads // groups, 0)  # [H, K, D]
        scores = (q[row].float()[:, None] @ k.transpose(1, 2))[:, 0] * q.shape[-1] ** -0.5  # [H, K]
        out[row] = (scores.softmax(-1)[:, None] @ v)[:, 0]
    return out


@pytest.mark.parametrize(
    ("heads", "kv_heads", "num_samples", "live_slots", "step"),
    [
        (4, 2, 3, None, 37),  # every sequence live, every own chunk reached
        (8, 2, 2, [0, 3, 4, 5], 37),  # prompt 1 down to one sequence, prompt 0 to one
        (7, 1, 4, [5, 6, 9], 37),  # 7 heads per group (padded), prompts 0 and 2 finished
        (4, 2, 3, None, 5),  # early in the response: own chunks 1 and 2 are empty (as prompt 2's chunks 1, 2)
        (4, 2, 3, None, 0),  # the first decode step: one own key
    ],
)
def test_cascade_attention_equals_attention_over_the_concatenated_keys(heads, kv_heads, num_samples, live_slots, step):
    num_prompts, head_dim, max_prompt_len, max_tokens = 3, 16, 80, 40
    shape = DecodeAttentionShape(
        num_prompts, num_samples, heads, kv_heads, head_dim, max_prompt_len, max_tokens, 32, 16, block=16
    )
    slots = torch.arange(num_prompts * num_samples) if live_slots is None else torch.tensor(live_slots)
    rows = len(slots)
    prompt_lens = torch.tensor([80, 33, 5])
    q = random(rows, heads, head_dim, seed=1)
    prompt_kv = random(2, num_prompts, max_prompt_len, kv_heads, head_dim, seed=2).transpose(2, 3)  # strided
    own_kv = random(2, num_prompts * num_samples + 1, kv_heads, max_tokens, head_dim, seed=3)
    counts = torch.bincount(slots // num_samples, minlength=num_prompts)
    starts = counts.cumsum(0) - counts
    out = torch.empty_like(q)
    DecodeAttention(shape, DEVICE)(
        q, prompt_kv[0], prompt_kv[1], prompt_lens.to(DEVICE), starts.to(DEVICE), counts.to(DEVICE),
        own_kv[0].contiguous(), own_kv[1].contiguous(), slots.to(DEVICE), torch.tensor([step], device=DEVICE), out,
    )  # fmt: skip
    expected = reference(
        q.cpu(), prompt_kv[0].cpu(), prompt_kv[1].cpu(), prompt_lens, own_kv[0].cpu(), own_kv[1].cpu(), slots,
        step, num_samples,
    )  # fmt: skip
    assert_matches(out.cpu(), expected.to(out.dtype))
