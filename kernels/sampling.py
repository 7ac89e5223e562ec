"""Fused sampling for rollout decode: one pass over each row's logits draws the next token and records it.

Per row (one program): a streaming log-sum-exp of the logits (temperature 1: the log-prob that GRPO's ratio
needs) and, in the same pass, the Gumbel-max draw argmax_v(logits_v / T + G_v), G_v = -log(-log U_v), which
samples softmax(logits / T) exactly (temperature 0: argmax). U comes from Philox keyed by (seed, column, slot),
so a seed gives one rollout whatever the batch layout. The kernel then writes the token and its log-prob at
[slot, column], the slot's last token, and marks the slot done if the token is a stop token. No top-p: the
caller samples top-p < 1 with torch (`rollplex.models.sampling`). Every input is a device tensor, so a CUDA
graph can replay it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_STOP_IDS = 16


@triton.jit
def sample_kernel(
    logits_ptr,  # [rows, V], any float dtype
    slots_ptr,  # [rows] int64
    column_ptr,  # [1] int64: which token of each response this is
    seed_ptr,  # [1] int64
    temperature_ptr,  # [1] fp32; 0 = greedy
    stop_ptr,  # [MAX_STOP] int64, -1 = unused
    tokens_ptr,  # [SLOTS, R] int64
    logprobs_ptr,  # [SLOTS, R] fp32
    last_token_ptr,  # [SLOTS] int64
    done_ptr,  # [SLOTS] int8
    num_slots,
    V: tl.constexpr,
    R: tl.constexpr,
    BLOCK: tl.constexpr,
    MAX_STOP: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    column = tl.load(column_ptr)
    temperature = tl.load(temperature_ptr)
    greedy = temperature == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    seed = (tl.load(seed_ptr) + column * num_slots + slot).to(tl.uint32)
    m = tl.full([], -float("inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    best_key = tl.full([], -float("inf"), tl.float32)
    best_index = tl.full([], 0, tl.int32)
    best_logit = tl.full([], 0.0, tl.float32)
    for start in range(0, V, BLOCK):
        v = start + tl.arange(0, BLOCK)
        live = v < V
        x = tl.load(logits_ptr + row.to(tl.int64) * V + v, mask=live, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        u = tl.rand(seed, v)
        gumbel = -tl.log(-tl.log(tl.maximum(u, 1e-20)))
        key = tl.where(live, tl.where(greedy, x, x * inv_t + gumbel), -float("inf"))
        block_best = tl.max(key, axis=0)
        at = tl.argmax(key, axis=0)
        better = block_best > best_key
        best_key = tl.where(better, block_best, best_key)
        best_index = tl.where(better, start + at, best_index)
        best_logit = tl.where(better, tl.sum(tl.where(tl.arange(0, BLOCK) == at, x, 0.0), axis=0), best_logit)
    token = best_index.to(tl.int64)
    logprob = best_logit - (m + tl.log(s))
    stops = tl.load(stop_ptr + tl.arange(0, MAX_STOP))
    is_stop = tl.sum((stops == token).to(tl.int32), axis=0) > 0
    at_slot = slot * R + column
    tl.store(tokens_ptr + at_slot, token)
    tl.store(logprobs_ptr + at_slot, logprob)
    tl.store(last_token_ptr + slot, token)
    done = tl.load(done_ptr + slot)
    tl.store(done_ptr + slot, tl.where(is_stop, 1, done).to(tl.int8))


def fused_sample(
    logits: torch.Tensor,  # [rows, V]
    slots: torch.Tensor,  # [rows] int64
    column: torch.Tensor,  # [1] int64
    seed: torch.Tensor,  # [1] int64
    temperature: torch.Tensor,  # [1] fp32
    stop_ids: torch.Tensor,  # [MAX_STOP_IDS] int64, -1 padded
    tokens: torch.Tensor,  # [SLOTS, R] int64
    logprobs: torch.Tensor,  # [SLOTS, R] fp32
    last_token: torch.Tensor,  # [SLOTS] int64
    done: torch.Tensor,  # [SLOTS] int8
    block: int = 4096,
) -> None:
    rows, vocab = logits.shape
    num_slots, max_tokens = tokens.shape
    assert logits.is_contiguous() and slots.shape == (rows,), f"logits {tuple(logits.shape)}, slots {slots.shape}"
    assert stop_ids.shape == (MAX_STOP_IDS,) and done.dtype == torch.int8 and tokens.dtype == torch.long
    assert logprobs.shape == tokens.shape and last_token.shape == done.shape == (num_slots,)
    sample_kernel[(rows,)](
        logits, slots, column, seed, temperature, stop_ids, tokens, logprobs, last_token, done, num_slots,
        V=vocab, R=max_tokens, BLOCK=min(block, triton.next_power_of_2(vocab)), MAX_STOP=MAX_STOP_IDS,
    )  # fmt: skip
