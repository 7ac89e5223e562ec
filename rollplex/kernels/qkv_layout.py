"""Where each row of the grouped (vLLM) fused QKV lies in the interleaved (Megatron) one: a pure-torch index.

Stored (Megatron-Core, `rollplex.layout.sharing.qkv_megatron`): per stored group, its q heads, then its k head,
then its v head, each head `head_dim` rows. Wanted (vLLM, `qkv_vllm`): all q heads, then all k, then all v.
A rollout shard bound over q training shards is again a run of stored groups; when the training TP exceeds
the number of KV heads, consecutive stored groups repeat one KV head (`kv_replicas` copies), and the grouped
order keeps the first copy. `grouped_rows` is the closed form the kernel computes per tile; `permutation`
derives the same index from segment lists, so tests can tie the two to the layout algebra.
"""

from __future__ import annotations

import torch

from rollplex.layout.sharing import Segment


def num_stored_rows(num_heads: int, num_kv_heads: int, head_dim: int, kv_replicas: int = 1) -> int:
    return (num_heads + 2 * num_kv_heads * kv_replicas) * head_dim


def grouped_rows(num_heads: int, num_kv_heads: int, head_dim: int, kv_replicas: int = 1) -> torch.Tensor:
    """int64 [(num_heads + 2 * num_kv_heads) * head_dim]: entry j is the stored row of grouped row j."""
    num_groups = num_kv_heads * kv_replicas
    assert num_heads % num_groups == 0, f"{num_heads} q heads do not split into {num_groups} stored groups"
    per_group = num_heads // num_groups  # q heads per stored group
    j = torch.arange((num_heads + 2 * num_kv_heads) * head_dim)
    head, offset = j // head_dim, j % head_dim
    is_q, is_k = head < num_heads, (head >= num_heads) & (head < num_heads + num_kv_heads)
    kv_head = torch.where(is_k, head - num_heads, head - num_heads - num_kv_heads)
    group = torch.where(is_q, head // per_group, kv_head * kv_replicas)
    slot = torch.where(is_q, head % per_group, torch.where(is_k, per_group, per_group + 1))
    return (group * (per_group + 2) + slot) * head_dim + offset


def rows_of(segments: tuple[Segment, ...] | list[Segment]) -> list[tuple[str, int]]:
    """The (component, logical row) of every stored row, in storage order."""
    return [(s.component, i) for s in segments for i in range(s.start, s.stop)]


def permutation(stored: list[tuple[str, int]], wanted: list[tuple[str, int]]) -> torch.Tensor:
    """int64 index p with stored[p[j]] == wanted[j]; a row stored more than once is read from its first copy."""
    first: dict[tuple[str, int], int] = {}
    for i, row in enumerate(stored):
        first.setdefault(row, i)
    missing = [row for row in wanted if row not in first]
    assert not missing, f"{len(missing)} wanted rows are not stored, e.g. {missing[:3]}"
    return torch.tensor([first[row] for row in wanted], dtype=torch.int64)
