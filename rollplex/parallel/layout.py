"""Where a training rank's shard of each decoder tensor comes from in the full (HF) tensors, and back.

The full tensors are the model's packed ones: [q; k; v] rows of the QKV projection (weight and bias), [gate; up]
rows of the MLP, [vocab] rows of the embedding and LM head, and the row-parallel o_proj / down_proj [O, I].
Training shards follow Megatron-Core (`rollplex.layout.sharing`): fused QKV interleaved per query group, fused
[gate; up] per rank, and the row-parallel weights stored transposed ([I / t, O] slabs, DESIGN.md Case 2). Each
layout is a list of row indices into the full tensor, derived from the planner's segment lists, so the
binding and the planner cannot disagree. Pure torch indexing; no process group.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollplex.layout.sharing import Segment, per_rank_components, qkv_megatron, qkv_vllm
from rollplex.models.config import TextConfig


def check_train_tp(t: TextConfig, tp: int) -> None:
    """Megatron-Core's rule: every rank holds whole query groups, and the vocabulary splits evenly."""
    if t.num_key_value_heads % tp:
        kv = t.num_key_value_heads
        choices = [d for d in range(1, kv + 1) if kv % d == 0]
        raise ValueError(f"training TP {tp} must divide the {kv} KV heads (whole query groups per rank): use {choices}")
    if t.vocab_size % tp or t.intermediate_size % tp:
        raise ValueError(f"training TP {tp} must divide vocab_size {t.vocab_size} and intermediate_size")


def rows_of(segments: tuple[Segment, ...], offsets: dict[str, int]) -> Tensor:
    """int64 rows of the full tensor, in segment order; `offsets` places each component in the full tensor."""
    return torch.cat([torch.arange(s.start, s.stop) + offsets[s.component] for s in segments])


def qkv_offsets(t: TextConfig) -> dict[str, int]:
    q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    return {"q": 0, "k": q, "v": q + kv}


def qkv_rows(t: TextConfig, tp: int, rank: int) -> Tensor:
    """Rows of the full [q; k; v] in rank `rank`'s Megatron shard (per query group: q heads, k, v)."""
    return rows_of(qkv_megatron(t, tp, rank), qkv_offsets(t))


def qkv_grouped_rows(t: TextConfig, tp: int, rank: int) -> Tensor:
    """Rows of the full [q; k; v] in vLLM's grouped shard (all q, then k, then v) of rollout rank `rank`."""
    return rows_of(qkv_vllm(t, tp, rank), qkv_offsets(t))


def gate_up_rows(t: TextConfig, tp: int, rank: int) -> Tensor:
    """Rows of the full [gate; up] in a rank's shard: its gate rows, then its up rows."""
    i = t.intermediate_size
    return rows_of(per_rank_components({"gate": i, "up": i}, tp, rank), {"gate": 0, "up": i})


def even_rows(n: int, tp: int, rank: int) -> Tensor:
    return torch.arange(rank * n // tp, (rank + 1) * n // tp)


def row_parallel_slab(w: Tensor, tp: int, rank: int) -> Tensor:
    """The stored [I / tp, O] slab of a row-parallel [O, I] weight: rank's input columns, transposed, contiguous."""
    return w[:, even_rows(w.shape[1], tp, rank)].t().contiguous()


def scatter_rows(shards: list[Tensor], rows: list[Tensor], num_rows: int) -> Tensor:
    """Inverse of taking rows: the full tensor whose rows[r] are shards[r] (replicated rows agree by construction)."""
    full = shards[0].new_empty(num_rows, *shards[0].shape[1:])
    for shard, index in zip(shards, rows, strict=True):
        full[index] = shard
    return full
