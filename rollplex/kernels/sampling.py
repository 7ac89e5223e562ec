"""Fused sampling for rollout decode: one pass over each row's logits draws the next token and records it.

Per block of a row's vocabulary (one program each, so that even one row fills the GPU): the block's
log-sum-exp terms of logits / T (the log-prob the trainer scores the token with, at the same temperature;
T = 1 when greedy) and, in the same pass, its best Gumbel key logits_v / T + G_v, G_v = -log(-log U_v).
The argmax of the keys samples softmax(logits / T) exactly (temperature 0: the argmax of the logits). U
comes from Philox keyed by (seed, column, the slot's row in the step's whole batch), so a seed gives one
rollout whatever the batch layout, and a data-parallel rank holding some rows of the batch draws for each the
numbers one process holding all of them would (`batch_rows`). A
second kernel merges each row's blocks, writes the token and its log-prob at [slot, column] and the slot's
last token, and marks the slot done on a stop token or at its length budget.
No top-p: the caller samples top-p < 1 with torch (`rollplex.models.sampling`). Every input is a device
tensor, so a CUDA graph can replay it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_STOP_IDS = 16


@triton.jit
def sample_partial_kernel(
    logits_ptr,  # [rows, V], any float dtype
    slots_ptr,  # [rows] int64
    column_ptr,  # [1] int64: which token of each response this is
    seed_ptr,  # [1] int64
    temperature_ptr,  # [1] fp32; 0 = greedy
    partial_ptr,  # [rows, SPLITS, 4] fp32: max logit / T, sum of exp(logit / T - max), best key, its logit / T
    index_ptr,  # [rows, SPLITS] int32: the best key's token
    batch_rows_ptr,  # [SLOTS] int64: each slot's row in the step's whole batch
    batch_slots_ptr,  # [1] int64: the whole batch's slots
    V: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One block of one row's vocabulary: its log-sum-exp terms and its best Gumbel key."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    slot = tl.load(slots_ptr + row)
    column = tl.load(column_ptr)
    temperature = tl.load(temperature_ptr)
    greedy = temperature == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    seed = (tl.load(seed_ptr) + column * tl.load(batch_slots_ptr) + tl.load(batch_rows_ptr + slot)).to(tl.uint32)
    v = split * BLOCK + tl.arange(0, BLOCK)
    live = v < V
    x = tl.load(logits_ptr + row.to(tl.int64) * V + v, mask=live, other=-float("inf")).to(tl.float32) * inv_t
    m = tl.max(x, axis=0)
    s = tl.sum(tl.exp(x - m), axis=0)
    u = tl.rand(seed, v)
    gumbel = -tl.log(-tl.log(tl.maximum(u, 1e-20)))
    key = tl.where(live, tl.where(greedy, x, x + gumbel), -float("inf"))
    best = tl.max(key, axis=0)
    at = tl.argmax(key, axis=0)
    logit = tl.sum(tl.where(tl.arange(0, BLOCK) == at, x, 0.0), axis=0)
    out = partial_ptr + (row * SPLITS + split) * 4
    tl.store(out, m)
    tl.store(out + 1, s)
    tl.store(out + 2, best)
    tl.store(out + 3, logit)
    tl.store(index_ptr + row * SPLITS + split, split * BLOCK + at)


@triton.jit
def sample_finish_kernel(
    partial_ptr,  # [rows, SPLITS, 4] fp32
    index_ptr,  # [rows, SPLITS] int32
    slots_ptr,  # [rows] int64
    column_ptr,  # [1] int64
    stop_ptr,  # [MAX_STOP] int64, -1 = unused
    tokens_ptr,  # [SLOTS, R] int64
    logprobs_ptr,  # [SLOTS, R] fp32
    last_token_ptr,  # [SLOTS] int64
    done_ptr,  # [SLOTS] int8
    max_lens_ptr,  # [SLOTS] int64: a sequence also ends after this many tokens
    R: tl.constexpr,
    SPLITS: tl.constexpr,
    SPLITS_POW2: tl.constexpr,
    MAX_STOP: tl.constexpr,
):
    """Merges a row's blocks: the token with the best key, its log-prob at temperature T, its stop flag."""
    row = tl.program_id(0)
    i = tl.arange(0, SPLITS_POW2)
    live = i < SPLITS
    part = partial_ptr + (row * SPLITS + i) * 4
    m_i = tl.load(part, mask=live, other=-float("inf"))
    m = tl.max(m_i, axis=0)
    s = tl.sum(tl.load(part + 1, mask=live, other=0.0) * tl.exp(m_i - m), axis=0)
    keys = tl.load(part + 2, mask=live, other=-float("inf"))
    at = tl.argmax(keys, axis=0)
    pick = i == at
    logit = tl.sum(tl.where(pick, tl.load(part + 3, mask=live, other=0.0), 0.0), axis=0)
    token = tl.sum(tl.where(pick, tl.load(index_ptr + row * SPLITS + i, mask=live, other=0), 0), axis=0).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    column = tl.load(column_ptr)
    at_slot = slot * R + column
    stops = tl.load(stop_ptr + tl.arange(0, MAX_STOP))
    is_stop = (tl.sum((stops == token).to(tl.int32), axis=0) > 0) | (column + 1 >= tl.load(max_lens_ptr + slot))
    tl.store(tokens_ptr + at_slot, token)
    tl.store(logprobs_ptr + at_slot, logit - (m + tl.log(s)))
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
    max_lens: torch.Tensor,  # [SLOTS] int64
    batch_rows: torch.Tensor | None = None,  # [SLOTS] int64: each slot's row in the whole batch (default: the slot)
    batch_slots: torch.Tensor | None = None,  # [1] int64: the whole batch's slots (default: SLOTS)
    block: int = 4096,
) -> None:
    rows, vocab = logits.shape
    num_slots, max_tokens = tokens.shape
    if batch_rows is None:
        batch_rows = torch.arange(num_slots, device=logits.device)
    if batch_slots is None:
        batch_slots = torch.tensor([num_slots], device=logits.device)
    assert logits.is_contiguous() and slots.shape == (rows,), f"logits {tuple(logits.shape)}, slots {slots.shape}"
    assert stop_ids.shape == (MAX_STOP_IDS,) and done.dtype == torch.int8 and tokens.dtype == torch.long
    assert logprobs.shape == tokens.shape and last_token.shape == done.shape == max_lens.shape == (num_slots,)
    assert batch_rows.shape == (num_slots,) and batch_slots.shape == (1,), f"{batch_rows.shape}, {batch_slots.shape}"
    block = min(block, triton.next_power_of_2(vocab))
    splits = triton.cdiv(vocab, block)
    partial = torch.empty(rows, splits, 4, dtype=torch.float32, device=logits.device)
    index = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
    sample_partial_kernel[(rows, splits)](
        logits, slots, column, seed, temperature, partial, index, batch_rows, batch_slots,
        V=vocab, SPLITS=splits, BLOCK=block,
    )  # fmt: skip
    sample_finish_kernel[(rows,)](
        partial, index, slots, column, stop_ids, tokens, logprobs, last_token, done, max_lens,
        R=max_tokens, SPLITS=splits, SPLITS_POW2=triton.next_power_of_2(splits), MAX_STOP=MAX_STOP_IDS,
    )  # fmt: skip
