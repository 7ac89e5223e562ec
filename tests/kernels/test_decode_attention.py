"""Cascade decode attention equals plain softmax attention over prompt ++ own keys, for every live row."""

from __future__ import annotations

import pytest
import torch
from kernels_testkit import DEVICE, assert_matches, random

from rollplex.kernels.decode_attention import DecodeAttention, DecodeAttentionShape
from rollplex.rollout.batch import layout


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
    ("heads", "kv_heads", "num_samples", "live_slots", "step", "prompt_chunk"),
    [
        (4, 2, 3, None, 37, 32),  # every sequence live, every own chunk reached
        (8, 2, 2, [0, 3, 4, 5], 37, 32),  # prompt 1 down to one sequence, prompt 0 to one
        (7, 1, 4, [5, 6, 9], 37, 32),  # 7 heads per group (padded), prompts 0 and 2 finished: 2 of 3 in the batch
        (4, 2, 3, None, 5, 32),  # early in the response: own chunks 1 and 2 are empty (as prompt 2's chunks 1, 2)
        (4, 2, 3, None, 0, 32),  # the first decode step: one own key
        (4, 2, 3, [7, 8], 37, 0),  # one prompt in the batch, its chunk picked for one prompt
        (4, 1, 2, [1, 4, 5], 37, 0),  # prompts 0 and 2 of 3, the chunk picked for two
    ],
)
def test_cascade_attention_equals_attention_over_the_concatenated_keys(
    heads, kv_heads, num_samples, live_slots, step, prompt_chunk
):
    num_prompts, head_dim, max_prompt_len, max_tokens = 3, 16, 80, 40
    shape = DecodeAttentionShape(
        num_prompts, num_samples, heads, kv_heads, head_dim, max_prompt_len, max_tokens, prompt_chunk, 16, block=16
    )
    slots = torch.arange(num_prompts * num_samples) if live_slots is None else torch.tensor(live_slots)
    rows = len(slots)
    prompt_lens = torch.tensor([80, 33, 5])
    q = random(rows, heads, head_dim, seed=1)
    prompt_kv = random(2, num_prompts, max_prompt_len, kv_heads, head_dim, seed=2).transpose(2, 3)  # strided
    own_kv = random(2, num_prompts * num_samples + 1, kv_heads, max_tokens, head_dim, seed=3)
    batch = layout(slots, rows, num_prompts, num_samples)
    present = batch.prompts.clone()
    present[: batch.num_prompts] = present[: batch.num_prompts].flip(0)  # the batch's prompts in any order
    out = torch.empty_like(q)
    attention = DecodeAttention(shape, DEVICE)
    attention.prompt_out.fill_(float("nan"))  # a chunk without keys writes no output: the combine must not read it
    attention.own_out.fill_(float("nan"))
    attention(
        q, prompt_kv[0], prompt_kv[1], prompt_lens.to(DEVICE), batch.row_start.to(DEVICE), batch.row_count.to(DEVICE),
        own_kv[0].contiguous(), own_kv[1].contiguous(), slots.to(DEVICE), torch.tensor([step], device=DEVICE), out,
        present.to(DEVICE), batch.num_prompts,
    )  # fmt: skip
    expected = reference(
        q.cpu(), prompt_kv[0].cpu(), prompt_kv[1].cpu(), prompt_lens, own_kv[0].cpu(), own_kv[1].cpu(), slots,
        step, num_samples,
    )  # fmt: skip
    assert_matches(out.cpu(), expected.to(out.dtype))


def test_a_batch_of_fewer_prompts_cuts_them_into_shorter_chunks():
    """At the 3B rollout's shapes (2 kv heads, 5,888-key prompts, 8 prompts a rollout), the chunk follows the
    prompts the batch spans, half a wave of prompt programs each time; the workspace holds the shortest's splits."""
    shape = DecodeAttentionShape(8, 8, 16, 2, 128, 5888, 2048)
    assert [shape.chunk_for(n) for n in range(1, 9)] == [128, 256, 512, 512, 512, 1024, 1024, 1024]
    assert shape.max_prompt_splits == shape.prompt_splits(1) == 64  # over 8,192 keys: one kernel up to there
    assert [shape.launch_count(n) for n in range(1, 9)] == [1, 2, 5, 5, 5, 8, 8, 8]  # one grid a chunk
    assert DecodeAttentionShape(8, 8, 16, 2, 128, 5888, 2048, prompt_chunk=512).chunk_for(1) == 512
    with pytest.raises(AssertionError, match="0 of 8 prompts"):
        shape.chunk_for(0)
