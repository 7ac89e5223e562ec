"""The layout algebra of training shards and rollout bindings, for TP up to 8 (single process, no groups)."""

from __future__ import annotations

import pytest
import torch
from parallel_testkit import wide_config

from rollplex.kernels.qkv_layout import grouped_rows
from rollplex.models.attention import CausalAttention
from rollplex.models.config import load_model_config
from rollplex.models.decoder import SelfAttention
from rollplex.models.layers import GatedMLP
from rollplex.models.rotary import text_rotary
from rollplex.parallel import layout
from rollplex.parallel.bind import grouped_index
from rollplex.parallel.group import SINGLE
from rollplex.parallel.layers import ParallelMLP, ParallelSelfAttention, QKVOrder

TEXT = wide_config().text
PAIRS = [(t, r) for t in (1, 2, 4, 8) for r in (1, 2, 4, 8) if r <= t and t % r == 0]


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_training_shards_partition_every_sharded_tensor(tp):
    q, kv = TEXT.num_attention_heads * TEXT.head_dim, TEXT.num_key_value_heads * TEXT.head_dim
    for rows, total in (
        ([layout.qkv_rows(TEXT, tp, r) for r in range(tp)], q + 2 * kv),
        ([layout.gate_up_rows(TEXT, tp, r) for r in range(tp)], 2 * TEXT.intermediate_size),
        ([layout.even_rows(TEXT.vocab_size, tp, r) for r in range(tp)], TEXT.vocab_size),
    ):
        assert all(len(r) == total // tp for r in rows)
        assert torch.equal(torch.cat(rows).sort().values, torch.arange(total))
        full = torch.randn(total, 3)
        assert torch.equal(layout.scatter_rows([full[r] for r in rows], rows, total), full)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_each_megatron_shard_holds_whole_query_groups_in_interleaved_order(tp):
    d, per_group = TEXT.head_dim, TEXT.heads_per_group
    for rank in range(tp):
        rows = layout.qkv_rows(TEXT, tp, rank).view(-1, per_group + 2, d)  # [groups, q heads + k + v, D]
        for local, group in enumerate(range(rank * TEXT.num_key_value_heads // tp, (rank + 1) * 8 // tp)):
            q_heads = rows[local, :per_group, 0] // d
            assert q_heads.tolist() == list(range(group * per_group, (group + 1) * per_group))
            assert rows[local, per_group, 0] == TEXT.num_attention_heads * d + group * d  # k of the group
            assert rows[local, per_group + 1, 0] == (TEXT.num_attention_heads + 8) * d + group * d  # v


def test_a_row_parallel_slab_is_the_transposed_input_columns():
    w = torch.randn(6, 8)
    slabs = [layout.row_parallel_slab(w, 4, r) for r in range(4)]
    assert all(s.is_contiguous() and s.shape == (2, 6) for s in slabs)
    assert torch.equal(torch.cat(slabs).t(), w)  # q slabs back to back are the rollout's slab


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_case2_modules_expose_the_logical_orientation_as_a_view_of_the_stored_slab(tp):
    heads, groups, dim, hidden, inter = 8, 8, 4, 12, 16
    o_proj, down_proj = torch.randn(hidden, heads * dim), torch.randn(hidden, inter)
    for rank in range(tp):
        qkv = torch.zeros((heads + 2 * groups) // tp * dim, hidden)
        attn = ParallelSelfAttention(
            qkv, qkv[:, 0], layout.row_parallel_slab(o_proj, tp, rank), heads // tp, groups // tp, dim,
            QKVOrder.INTERLEAVED, SINGLE, trainable=True,
        )  # fmt: skip
        mlp = ParallelMLP(torch.zeros(2 * inter // tp, hidden), layout.row_parallel_slab(down_proj, tp, rank), 1,
                          SINGLE, trainable=True)  # fmt: skip
        o_cols, down_cols = heads * dim // tp, inter // tp
        assert torch.equal(attn.o_weight, o_proj[:, rank * o_cols : (rank + 1) * o_cols])  # nn.Linear's [O, I]
        assert torch.equal(mlp.down_weight, down_proj[:, rank * down_cols : (rank + 1) * down_cols])
        assert attn.o_weight.data_ptr() == attn.o_slab.data_ptr()  # a view, no copy
        with torch.no_grad():
            attn.o_weight[1, 0] = 7.0  # writes land in the stored [I, O] slab
            mlp.down_weight[1, 0] = 7.0
        assert attn.o_slab[0, 1] == 7.0 and mlp.down_slab[0, 1] == 7.0


@pytest.mark.parametrize(("train_tp", "rollout_tp"), PAIRS)
def test_the_case3_copy_index_is_the_closed_form_the_permuted_gemm_reads(train_tp, rollout_tp):
    q = train_tp // rollout_tp
    for k in range(rollout_tp):
        bound = torch.cat([layout.qkv_rows(TEXT, train_tp, k * q + j) for j in range(q)])
        index = grouped_index(TEXT, train_tp, rollout_tp, k)
        assert torch.equal(bound[index], layout.qkv_grouped_rows(TEXT, rollout_tp, k))
        heads, groups = TEXT.num_attention_heads // rollout_tp, TEXT.num_key_value_heads // rollout_tp
        assert torch.equal(index, grouped_rows(heads, groups, TEXT.head_dim))


def test_training_tp_must_divide_the_kv_heads():
    with pytest.raises(ValueError, match=r"must divide the 2 KV heads.*use \[1, 2\]"):
        layout.check_train_tp(load_model_config("tiny").text, 4)


@pytest.mark.parametrize(("train_tp", "rollout_tp"), PAIRS)
def test_a_replica_over_q_training_shards_computes_the_full_layers(train_tp, rollout_tp):
    """Rollout rank k's layers, built from the q training shards it binds, equal the full layers restricted to
    rank k's heads and vocabulary (here at rollout TP 1 the whole layer; else the unreduced partial sums)."""
    torch.manual_seed(0)
    q, t = train_tp // rollout_tp, TEXT
    attn, mlp = SelfAttention(t), GatedMLP(t.hidden_size, t.intermediate_size, bias=False)
    x = torch.randn(2, 5, t.hidden_size)
    positions = torch.arange(5).expand(3, 2, 5)
    cos, sin = text_rotary(positions, t)
    with torch.no_grad():
        full_qkv_w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        full_qkv_b = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
        full_gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        expected_attn, expected_mlp = torch.zeros_like(x), torch.zeros_like(x)
        for k in range(rollout_tp):
            ranks = range(k * q, (k + 1) * q)
            qkv_rows = torch.cat([layout.qkv_rows(t, train_tp, r) for r in ranks])
            o = torch.cat([layout.row_parallel_slab(attn.o_proj.weight, train_tp, r) for r in ranks])
            heads, groups = t.num_attention_heads // rollout_tp, t.num_key_value_heads // rollout_tp
            w, b = full_qkv_w[qkv_rows], full_qkv_b[qkv_rows]
            index = grouped_rows(heads, groups, t.head_dim)
            partial = {
                order: ParallelSelfAttention(w, b, o, heads, groups, t.head_dim, order, SINGLE, trainable=False)(
                    x, cos, sin, CausalAttention(), 0
                )
                for order, (w, b) in ((QKVOrder.INTERLEAVED, (w, b)), (QKVOrder.GROUPED, (w[index], b[index])))
            }
            torch.testing.assert_close(partial[QKVOrder.GROUPED], partial[QKVOrder.INTERLEAVED], atol=1e-5, rtol=1e-5)
            expected_attn += partial[QKVOrder.INTERLEAVED]
            gate_up = torch.cat([full_gate_up[layout.gate_up_rows(t, train_tp, r)] for r in ranks])
            down = torch.cat([layout.row_parallel_slab(mlp.down_proj.weight, train_tp, r) for r in ranks])
            expected_mlp += ParallelMLP(gate_up, down, q, SINGLE, trainable=False)(x)
        torch.testing.assert_close(expected_attn, attn(x, cos, sin, CausalAttention(), 0), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(expected_mlp, mlp(x), atol=1e-5, rtol=1e-5)


def test_gathering_over_a_group_of_one_copies_the_part_and_touches_no_process_group():
    from rollplex.parallel.group import all_gather_into, all_gather_many

    out, part = torch.zeros(3), torch.arange(3.0)
    all_gather_into(out, part, SINGLE)  # no process group exists in this test process
    assert torch.equal(out, part)
    whole = torch.arange(4.0)
    all_gather_many([(whole, whole[:4])], SINGLE)
    assert torch.equal(whole, torch.arange(4.0))
