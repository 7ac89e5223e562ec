"""`qkv_grouped_from_megatron` reads Megatron's interleaved fused QKV in place and equals the grouped (vLLM)
projection x @ W_grouped^T + b_grouped computed by torch on the materialised grouped weight."""

from __future__ import annotations

import pytest
import torch
from kernels_testkit import assert_matches, needs_cuda, random

pytest.importorskip("triton")
from rollplex.kernels.qkv_gemm import qkv_grouped_from_megatron
from rollplex.kernels.qkv_layout import grouped_rows, num_stored_rows
from rollplex.kernels.tiles import Tiles, wave_parts

SMALL = Tiles(block_m=16, block_n=16, block_k=32)  # column tiles narrower than, equal to and across heads
HIDDEN = 48
HEADS = [(1, 1, 16), (4, 1, 16), (8, 2, 16), (6, 3, 32), (4, 4, 16), (16, 2, 8)]  # (num_heads, num_kv_heads, d)


def reference(x, w, bias, num_heads, num_kv_heads, head_dim, kv_replicas=1):
    """torch.matmul on the materialised grouped weight (and bias), fp32 accumulation."""
    rows = grouped_rows(num_heads, num_kv_heads, head_dim, kv_replicas).to(w.device)
    y = torch.matmul(x.float(), w[rows].float().T)
    return (y if bias is None else y + bias[rows].float()).to(x.dtype)


def stored(num_heads, num_kv_heads, head_dim, kv_replicas=1, hidden=HIDDEN):
    n = num_stored_rows(num_heads, num_kv_heads, head_dim, kv_replicas)
    return random(n, hidden, seed=11, scale=hidden**-0.5), random(n, seed=12)


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), HEADS)
@pytest.mark.parametrize("num_rows", [1, 37])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_the_megatron_store_gives_the_grouped_projection(num_heads, num_kv_heads, head_dim, num_rows, with_bias):
    w, b = stored(num_heads, num_kv_heads, head_dim)
    bias = b if with_bias else None
    x = random(num_rows, HIDDEN, seed=13)
    y = qkv_grouped_from_megatron(x, w, bias, num_heads, num_kv_heads, head_dim, tiles=SMALL)
    assert_matches(y, reference(x, w, bias, num_heads, num_kv_heads, head_dim))


@pytest.mark.parametrize("num_rows", [3, 70])
def test_picked_tiles_wider_than_a_head_give_the_grouped_projection(num_rows):
    w, b = stored(8, 2, 16)
    x = random(num_rows, HIDDEN, seed=14)
    assert_matches(qkv_grouped_from_megatron(x, w, b, 8, 2, 16), reference(x, w, b, 8, 2, 16))


def test_bound_shards_that_repeat_a_kv_head_read_its_first_copy():
    w, b = stored(8, 1, 16, kv_replicas=4)  # 4 training shards of one KV head each, bound into one rollout shard
    x = random(21, HIDDEN, seed=15)
    y = qkv_grouped_from_megatron(x, w, b, 8, 1, 16, kv_replicas=4, tiles=SMALL)
    assert_matches(y, reference(x, w, b, 8, 1, 16, kv_replicas=4))


def test_the_launcher_rejects_a_weight_of_the_wrong_head_count():
    w, b = stored(8, 2, 16)
    x = random(4, HIDDEN, seed=0)
    with pytest.raises(AssertionError, match="Megatron-order"):
        qkv_grouped_from_megatron(x, w, b, 8, 4, 16)
    with pytest.raises(AssertionError, match="bias must be"):
        qkv_grouped_from_megatron(x, w, b[:-16], 8, 2, 16)


def test_the_launcher_rejects_a_transposed_weight_and_heads_that_do_not_split_into_groups():
    w, b = stored(8, 2, 16)
    x = random(4, HIDDEN, seed=0)
    with pytest.raises(AssertionError, match="Megatron-order"):
        qkv_grouped_from_megatron(x, w.T.contiguous(), b, 8, 2, 16)
    with pytest.raises(AssertionError, match="q heads vs"):
        qkv_grouped_from_megatron(x, w, b, 6, 4, 16)
    rows = num_stored_rows(8, 2, 16)
    square, _ = stored(8, 2, 16, hidden=rows)  # a view [H, rows]^T has the right shape but not the layout
    with pytest.raises(AssertionError, match="contiguous stored"):
        qkv_grouped_from_megatron(random(4, rows, seed=0), square.T, b, 8, 2, 16)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_rows", [1, 8, 64, 4096])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "hidden"), [(16, 2, 2048), (8, 1, 2048), (28, 4, 3584)])
def test_qwen_sized_fused_qkv_matches_torch_in_bf16(num_rows, num_heads, num_kv_heads, hidden):
    n = num_stored_rows(num_heads, num_kv_heads, 128)
    w, b = random(n, hidden, seed=1, scale=hidden**-0.5), random(n, seed=2)
    x = random(num_rows, hidden, seed=3)
    assert_matches(
        qkv_grouped_from_megatron(x, w, b, num_heads, num_kv_heads, 128),
        reference(x, w, b, num_heads, num_kv_heads, 128),
    )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_rows", [1, 64])
def test_on_a_gpu_a_k_split_of_the_fused_qkv_adds_the_bias_once_and_repeats_bitwise(num_rows):
    n = num_stored_rows(4, 1, 128)  # 7B at TP 8: 4 q heads, 1 kv head, hidden 3584
    w, b = random(n, 3584, seed=1, scale=3584**-0.5), random(n, seed=2)
    x = random(num_rows, 3584, seed=3)
    tiles = Tiles(16 if num_rows == 1 else 64, 64, 256 if num_rows == 1 else 128, num_stages=4, split_k=4)
    y = qkv_grouped_from_megatron(x, w, b, 4, 1, 128, tiles=tiles)
    assert_matches(y, reference(x, w, b, 4, 1, 128))
    assert all(torch.equal(y, qkv_grouped_from_megatron(x, w, b, 4, 1, 128, tiles=tiles)) for _ in range(5))


def test_tiles_that_divide_k_and_the_columns_take_the_unmasked_loads():
    num_heads, num_kv_heads, head_dim = 4, 2, 8  # 64 output columns; hidden 64: both split into 16 x 32 tiles
    n = num_stored_rows(num_heads, num_kv_heads, head_dim)
    w, b = random(n, 64, seed=16, scale=64**-0.5), random(n, seed=17)
    x = random(19, 64, seed=18)
    y = qkv_grouped_from_megatron(x, w, b, num_heads, num_kv_heads, head_dim, tiles=Tiles(16, 16, 32))
    assert_matches(y, reference(x, w, b, num_heads, num_kv_heads, head_dim))


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_rows_short_of_a_whole_wave_split_k_and_add_the_bias_once(with_bias):
    """4 SMs, 150 rows x 128 columns in 32 x 128 tiles: rows 0-127 fill a wave, rows 128-149 run in 64-wide
    tiles with K split in two."""
    num_heads, num_kv_heads, head_dim, hidden = 4, 2, 16, 600
    w, b = stored(num_heads, num_kv_heads, head_dim, hidden=hidden)
    bias = b if with_bias else None
    x = random(150, hidden, seed=19)
    tiles = Tiles(32, 128, 32)
    assert [(t.block_n, t.split_k) for *_, t in wave_parts(150, 128, hidden, tiles, num_sms=4)] == [(128, 1), (64, 2)]
    y = qkv_grouped_from_megatron(x, w, bias, num_heads, num_kv_heads, head_dim, tiles=tiles, num_sms=4)
    assert_matches(y, reference(x, w, bias, num_heads, num_kv_heads, head_dim))
