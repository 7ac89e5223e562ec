"""Cascade decode attention equals plain softmax attention over prompt ++ own keys, for every live row; fed the
unrotated qkv projection, it equals the rotary kernel followed by the attention, caches included."""

from __future__ import annotations

import pytest
import torch
from kernels_testkit import DEVICE, DTYPE, assert_matches, random

from rollplex.kernels.decode_attention import DecodeAttention, DecodeAttentionShape, Rotary
from rollplex.kernels.decode_ops import rotary_to_cache
from rollplex.models.config import load_model_config
from rollplex.models.rotary import text_rotary


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


@pytest.mark.parametrize(("step", "num_parts"), [(0, 1), (15, 2), (16, 1), (37, 2)])  # own chunks of 16 keys
def test_attention_that_rotates_equals_the_rotary_kernel_then_attention(step, num_parts):
    text = load_model_config("tiny").text
    heads, kv_heads, d = text.num_attention_heads, text.num_key_value_heads, text.head_dim
    num_prompts, num_samples, max_prompt_len, max_tokens = 3, 3, 80, 40
    shape = DecodeAttentionShape(
        num_prompts, num_samples, heads, kv_heads, d, max_prompt_len, max_tokens, 32, 16, block=16
    )
    slots = torch.tensor([0, 3, 4, 5, 9])  # prompt 2 finished; the last row pads (the spare slot 9)
    counts = torch.bincount(slots // num_samples, minlength=num_prompts + 1)[:num_prompts]
    starts = counts.cumsum(0) - counts
    width = (heads + 2 * kv_heads) * d
    qkv = random(num_parts, len(slots), width, seed=1)
    qkv = qkv.float() / 3 if num_parts > 1 else qkv[0]  # a K split's fp32 parts, or one product
    next_positions = torch.tensor([90, 33, 61, 0], device=DEVICE)
    cos, sin = (t[0, 0].contiguous().to(DEVICE) for t in text_rotary(torch.arange(160).expand(3, 1, 160), text))
    prompt_kv = random(2, num_prompts, kv_heads, max_prompt_len, d, seed=2)
    own_kv = random(2, num_prompts * num_samples + 1, kv_heads, max_tokens, d, seed=3)
    lengths, live = torch.tensor([80, 33, 5], device=DEVICE), (slots.to(DEVICE), torch.tensor([step], device=DEVICE))
    results = []
    for rotate in (False, True):
        attention, caches = DecodeAttention(shape, DEVICE), own_kv.clone()
        out = torch.empty(len(slots), heads, d, dtype=DTYPE, device=DEVICE)
        if rotate:
            q = qkv
        else:
            q = torch.empty_like(out)
            rotary_to_cache(qkv, cos, sin, live[0], next_positions, live[1], q, caches[0], caches[1], num_samples)
        attention(
            q, prompt_kv[0], prompt_kv[1], lengths, starts.to(DEVICE), counts.to(DEVICE), caches[0], caches[1],
            *live, out, rotary=Rotary(cos, sin, next_positions) if rotate else None,
        )  # fmt: skip
        results.append((out, caches))
    (out, caches), (fused_out, fused_caches) = results
    assert caches[:, slots, :, step].any() and not torch.equal(caches, own_kv)  # the step's keys were written
    assert torch.equal(fused_caches, caches)
    assert torch.equal(fused_out, out)


@pytest.mark.parametrize(("live_slots", "chunk"), [([0, 1, 2], 128), ([0, 3, 4, 7, 8], 512)])
def test_the_prompt_chunk_follows_the_steps_live_prompts(live_slots, chunk):
    """Picked per step (prompt_chunk 0), the chunk of one live prompt is finer than that of three; each step's
    output equals that of a shape whose chunk is fixed at the picked length, and the attention."""
    num_prompts, num_samples, heads, kv_heads, head_dim, max_prompt_len, max_tokens = 3, 3, 4, 2, 16, 600, 40
    picked = DecodeAttentionShape(
        num_prompts, num_samples, heads, kv_heads, head_dim, max_prompt_len, max_tokens, min_programs=8
    )
    assert (picked.chunk_for(1), picked.chunk_for(3), picked.prompt_splits) == (128, 512, 5)
    slots = torch.tensor(live_slots)
    counts = torch.bincount(slots // num_samples, minlength=num_prompts)
    assert picked.chunk_for(int((counts > 0).sum())) == chunk
    starts = counts.cumsum(0) - counts
    q = random(len(slots), heads, head_dim, seed=1)
    prompt_kv = random(2, num_prompts, kv_heads, max_prompt_len, head_dim, seed=2)
    own_kv = random(2, num_prompts * num_samples + 1, kv_heads, max_tokens, head_dim, seed=3)
    prompt_lens, step = torch.tensor([600, 333, 517]), 21
    outs = []
    fixed = DecodeAttentionShape(
        num_prompts, num_samples, heads, kv_heads, head_dim, max_prompt_len, max_tokens, prompt_chunk=chunk
    )
    for shape in (picked, fixed):
        out = torch.empty_like(q)
        DecodeAttention(shape, DEVICE)(
            q, prompt_kv[0], prompt_kv[1], prompt_lens.to(DEVICE), starts.to(DEVICE), counts.to(DEVICE),
            own_kv[0], own_kv[1], slots.to(DEVICE), torch.tensor([step], device=DEVICE), out,
        )  # fmt: skip
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    expected = reference(
        q.cpu(), prompt_kv[0].cpu(), prompt_kv[1].cpu(), prompt_lens, own_kv[0].cpu(), own_kv[1].cpu(), slots, step,
        num_samples,
    )  # fmt: skip
    assert_matches(outs[0].cpu(), expected.to(q.dtype))
