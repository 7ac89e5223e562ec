"""The closed-form QKV permutation the kernel computes equals what the layout algebra of
`rollplex.layout.sharing` implies, for every training/rollout TP pair up to 8 and every rollout rank."""

from __future__ import annotations

import pytest
import torch

from rollplex.kernels.qkv_layout import grouped_rows, num_stored_rows, permutation, rows_of
from rollplex.layout.sharing import qkv_megatron, qkv_vllm
from rollplex.models.config import TextConfig

HEAD_DIM = 8
HEADS = [(16, 2), (28, 4), (40, 8), (64, 8), (32, 8), (8, 8), (4, 1), (12, 3)]  # 3B, 7B, 32B, 72B, ...
TPS = (1, 2, 4, 8)


def text(num_heads: int, num_kv_heads: int) -> TextConfig:
    return TextConfig(
        vocab_size=64, hidden_size=num_heads * HEAD_DIM, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, rms_norm_eps=1e-6, rope_theta=1e6,
        mrope_section=(2, 1, 1), tie_word_embeddings=False, max_position_embeddings=64,
    )  # fmt: skip


def valid(num_heads: int, num_kv_heads: int, tp: int) -> bool:
    return num_heads % tp == 0 and (num_kv_heads % tp == 0 or tp % num_kv_heads == 0)


CASES = [
    (nh, kv, t, r) for nh, kv in HEADS for t in TPS for r in TPS if t % r == 0 and valid(nh, kv, t) and valid(nh, kv, r)
]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "train_tp", "rollout_tp"), CASES)
def test_grouped_rows_reads_each_rollout_shard_out_of_its_bound_training_shards(
    num_heads, num_kv_heads, train_tp, rollout_tp
):
    t, q = text(num_heads, num_kv_heads), train_tp // rollout_tp
    for k in range(rollout_tp):
        stored = [row for j in range(q) for row in rows_of(qkv_megatron(t, train_tp, k * q + j))]
        wanted = rows_of(qkv_vllm(t, rollout_tp, k))
        local_heads = sum(c == "q" for c, _ in wanted) // HEAD_DIM
        local_kv = sum(c == "k" for c, _ in wanted) // HEAD_DIM
        replicas = sum(c == "k" for c, _ in stored) // HEAD_DIM // local_kv
        assert len(stored) == num_stored_rows(local_heads, local_kv, HEAD_DIM, replicas)
        closed_form = grouped_rows(local_heads, local_kv, HEAD_DIM, replicas)
        assert torch.equal(closed_form, permutation(stored, wanted))
        assert [stored[i] for i in closed_form] == wanted


def test_grouped_rows_is_the_identity_for_one_query_group():
    assert torch.equal(grouped_rows(4, 1, 8), torch.arange(6 * 8))


def test_grouped_rows_is_a_permutation_without_replicas_and_an_injection_with_them():
    assert torch.equal(grouped_rows(16, 2, 8).sort().values, torch.arange(20 * 8))
    rows = grouped_rows(16, 1, 8, kv_replicas=2)
    assert len(set(rows.tolist())) == len(rows) == 18 * 8 and int(rows.max()) < num_stored_rows(16, 1, 8, 2)
