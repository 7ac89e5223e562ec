"""`swap_gemm` computes decode products as y^T = W x^T from TMA-loaded tiles: equal to torch.matmul on HF's [O, I]
weight and on the materialised grouped QKV (its row map), with K splits that add the bias once and replay
bitwise, and tiles planned per shape."""

from __future__ import annotations

import pytest
import torch
from kernels_testkit import assert_matches, needs_cuda, random
from test_qkv_gemm import reference

pytest.importorskip("triton")
from rollplex.kernels.qkv_gemm import qkv_grouped_from_megatron
from rollplex.kernels.qkv_layout import num_stored_rows
from rollplex.kernels.swap_gemm import QKVHeads, swap_fits, swap_product, swap_tiles
from rollplex.kernels.tiles import NUM_SMS_H200, Tiles


def linear_reference(x, w, bias=None):
    y = torch.matmul(x.float(), w.float().T)
    return (y if bias is None else y + bias.float()).to(x.dtype)


@pytest.mark.parametrize("num_rows", [1, 5, 33, 64])
@pytest.mark.parametrize("in_features", [256, 200], ids=["whole-k-blocks", "k-past-the-last-block"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_an_hf_weight_gives_x_w_transposed(num_rows, in_features, with_bias):
    w, b = random(192, in_features, seed=1, scale=in_features**-0.5), random(192, seed=2)
    x = random(num_rows, in_features, seed=3)
    bias = b if with_bias else None
    assert_matches(swap_product(x, w, bias, 192), linear_reference(x, w, bias))


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "kv_replicas"), [(4, 2, 64, 1), (2, 1, 128, 1), (4, 1, 64, 2)]
)
def test_the_megatron_row_map_gives_the_grouped_projection(num_heads, num_kv_heads, head_dim, kv_replicas):
    n = num_stored_rows(num_heads, num_kv_heads, head_dim, kv_replicas)
    w, b = random(n, 256, seed=4, scale=256**-0.5), random(n, seed=5)
    x = random(7, 256, seed=6)
    cols = (num_heads + 2 * num_kv_heads) * head_dim
    y = swap_product(x, w, b, cols, QKVHeads(num_heads, num_kv_heads, head_dim, kv_replicas))
    assert_matches(y, reference(x, w, b, num_heads, num_kv_heads, head_dim, kv_replicas))


def test_a_k_split_of_the_qkv_row_map_adds_the_stored_bias_once():
    n = num_stored_rows(4, 1, 64, 2)
    w, b = random(n, 896, seed=19, scale=896**-0.5), random(n, seed=20)
    x = random(11, 896, seed=21)
    y = swap_product(x, w, b, 6 * 64, QKVHeads(4, 1, 64, 2), tiles=Tiles(16, 64, 128, num_stages=2, split_k=3))
    assert_matches(y, reference(x, w, b, 4, 1, 64, 2))


def test_qkv_at_decode_rows_takes_the_swapped_kernel_where_it_fits():
    n = num_stored_rows(4, 2, 64)
    w, b = random(n, 256, seed=7, scale=256**-0.5), random(n, seed=8)
    x = random(20, 256, seed=9)
    y = qkv_grouped_from_megatron(x, w, b, 4, 2, 64)
    assert torch.equal(y, swap_product(x, w, b, 8 * 64, QKVHeads(4, 2, 64)))
    assert_matches(y, reference(x, w, b, 4, 2, 64))


@pytest.mark.parametrize("split", [2, 3])
def test_a_k_split_adds_the_bias_once_and_its_parts_add_up(split):
    w, b = random(128, 640, seed=10, scale=640**-0.5), random(128, seed=11)
    x = random(9, 640, seed=12)
    tiles = Tiles(16, 64, 128, num_stages=2, split_k=split)
    assert_matches(swap_product(x, w, b, 128, tiles=tiles), linear_reference(x, w, b))
    parts = swap_product(x, w, b, 128, tiles=tiles, unsummed=True)
    assert parts.shape == (split, 9, 128) and parts.dtype == torch.float32
    assert_matches(parts.sum(0).to(x.dtype), linear_reference(x, w, b))


def test_hand_given_tiles_must_lie_within_the_width_swap_fits_checked():
    w, x = random(128, 256, seed=22), random(4, 256, seed=23)
    with pytest.raises(AssertionError, match="64-row tiles"):
        swap_product(x, w, None, 128, tiles=Tiles(16, 128, 128, split_k=1))


@pytest.mark.parametrize("block_n", [16, 32])
def test_narrower_weight_tiles_give_the_same_products_split_paired_and_with_bias(block_n):
    w, b = random(128, 640, seed=24, scale=640**-0.5), random(128, seed=25)
    x = random(7, 640, seed=26)
    for split in (1, 3):
        wide, narrow = (Tiles(16, n, 128, num_stages=2, split_k=split) for n in (64, block_n))
        assert torch.equal(
            swap_product(x, w, b, 128, tiles=narrow, unsummed=True),
            swap_product(x, w, b, 128, tiles=wide, unsummed=True),
        )  # the same sums over the same K blocks, in the same order
    pair = Tiles(16, block_n, 128, num_stages=2, split_k=1)
    assert torch.equal(swap_product(x, w, None, 64, tiles=pair, pair=64), swap_product(x, w, None, 64, pair=64))


def test_unsplit_unsummed_is_the_product_as_one_part():
    w = random(64, 256, seed=13, scale=256**-0.5)
    x = random(3, 256, seed=14)
    parts = swap_product(x, w, None, 64, tiles=Tiles(16, 64, 128, num_stages=2, split_k=1), unsummed=True)
    assert parts.shape == (1, 3, 64) and torch.equal(parts[0], swap_product(x, w, None, 64))


def test_what_fits_the_swapped_kernel():
    w, x = random(128, 256, seed=15), random(64, 256, seed=16)
    assert swap_fits(x, w, 128) and swap_fits(x[:1], w, 128, run=128)
    assert not swap_fits(random(65, 256, seed=0), w, 128)  # prefill rows
    assert not swap_fits(x[:0], w, 128)
    assert not swap_fits(x, w[:96], 96)  # not whole 64-column tiles
    assert not swap_fits(x, w, 128, run=32)  # a tile would cross heads (or gate/up halves)
    assert not swap_fits(random(4, 257, seed=0), random(128, 257, seed=0), 128)  # rows not 16-byte multiples
    assert not swap_fits(x[:, 4:], w[:, 4:], 128)  # not contiguous
    one_row = random(1, 257, seed=0)[:, :256]  # one row counts as contiguous whatever its stride: it is checked
    assert one_row.is_contiguous() and not swap_fits(one_row, w, 128)
    assert not swap_fits(x.flatten()[1:257].view(1, 256), w, 128)  # a base off 16 bytes (TMA)
    with pytest.raises(AssertionError, match="not for swap"):
        swap_product(x, w[:96], None, 96)


@pytest.mark.parametrize(("blocks", "block_rows"), [(1, 64), (2, 128)])
def test_gate_up_pairs_give_silu_of_gate_times_up_as_the_product_then_silu_mul(blocks, block_rows):
    from rollplex.kernels.decode_ops import silu_mul

    w = random(blocks * 2 * block_rows, 256, seed=17, scale=256**-0.5)
    x = random(6, 256, seed=18)
    out = swap_product(x, w, None, blocks * block_rows, pair=block_rows)
    y = swap_product(x, w, None, 2 * blocks * block_rows).view(6 * blocks, 2 * block_rows)
    unfused = silu_mul(y, torch.empty(6 * blocks, block_rows, dtype=y.dtype, device=y.device))
    assert torch.equal(out, unfused.view(6, -1))
    exact = linear_reference(x, w).float().view(6 * blocks, 2 * block_rows)
    gate, up = exact[:, :block_rows], exact[:, block_rows:]
    assert_matches(out.view(-1, block_rows), (torch.nn.functional.silu(gate) * up).to(x.dtype))
    with pytest.raises(AssertionError, match="no bias"):
        swap_product(x, w, random(w.shape[0], seed=0), blocks * block_rows, pair=block_rows)
    with pytest.raises(AssertionError, match="K unsplit"):
        swap_product(x, w, None, blocks * block_rows, tiles=Tiles(16, 64, 128, split_k=2), pair=block_rows)


def test_tiles_split_k_to_fill_the_wave_and_cover_the_tokens():
    """The 3B decode GEMMs at TP 1: QKV (40 column tiles) in three parts, o_proj and down (32) in four; gate_up's
    172 paired programs at 3 stages, two an SM, at batch 8, and at the deepest pipeline from batch 32 (two would
    not fit an SM); 7B TP-1 QKV: 72 column tiles, a split would pass 132 SMs; 7B TP-2 QKV: 36, in three (1280-row
    parts at most); 3B TP-2 QKV (1280 x 2048): 20, in four 512-row parts (five would leave one empty)."""
    assert swap_tiles(8, 2560, 2048, NUM_SMS_H200) == Tiles(16, 64, 128, num_stages=6, split_k=3)
    assert swap_tiles(8, 2048, 2048, NUM_SMS_H200).split_k == swap_tiles(8, 2048, 11008, NUM_SMS_H200).split_k == 4
    assert swap_tiles(8, 11008, 2048, NUM_SMS_H200, paired=True) == Tiles(16, 64, 128, num_stages=3, split_k=1)
    assert swap_tiles(32, 11008, 2048, NUM_SMS_H200, paired=True) == Tiles(32, 64, 128, num_stages=5, split_k=1)
    assert swap_tiles(32, 4608, 3584, NUM_SMS_H200) == Tiles(32, 64, 128, num_stages=6, split_k=1)
    assert swap_tiles(1, 2304, 3584, NUM_SMS_H200) == Tiles(16, 64, 128, num_stages=6, split_k=3)
    assert swap_tiles(64, 1280, 2048, NUM_SMS_H200).split_k == 4
    assert swap_tiles(64, 1280, 2048, NUM_SMS_H200).num_stages * (64 + 64) * 128 * 2 <= 200 * 1024
    assert swap_tiles(17, 512, 18944, NUM_SMS_H200) == Tiles(32, 64, 128, num_stages=6, split_k=8)
    paired = swap_tiles(64, 512, 18944, NUM_SMS_H200, paired=True)  # gate/up: never split, two blocks a stage
    assert paired.split_k == 1 and paired.num_stages == 200 * 1024 // ((64 + 128) * 128 * 2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_rows", [1, 8, 32, 64])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "hidden"), [(16, 2, 2048), (8, 1, 2048), (28, 4, 3584), (14, 2, 3584)]
)
def test_on_a_gpu_qwen_sized_qkv_matches_torch_and_repeats_bitwise(num_rows, num_heads, num_kv_heads, hidden):
    n = num_stored_rows(num_heads, num_kv_heads, 128)
    w, b = random(n, hidden, seed=1, scale=hidden**-0.5), random(n, seed=2)
    x = random(num_rows, hidden, seed=3)
    assert swap_fits(x, w, n, 128)
    y = swap_product(x, w, b, n, QKVHeads(num_heads, num_kv_heads, 128))
    assert_matches(y, reference(x, w, b, num_heads, num_kv_heads, 128))
    assert all(torch.equal(y, swap_product(x, w, b, n, QKVHeads(num_heads, num_kv_heads, 128))) for _ in range(3))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("split", [2, 4, 8])
def test_on_a_gpu_a_split_hf_product_matches_torch_and_repeats_bitwise(split):
    w, b = random(2048, 11008, seed=4, scale=11008**-0.5), random(2048, seed=5)
    x = random(32, 11008, seed=6)
    tiles = Tiles(32, 64, 128, num_stages=4, split_k=split)
    y = swap_product(x, w, b, 2048, tiles=tiles)
    assert_matches(y, linear_reference(x, w, b))
    assert all(torch.equal(y, swap_product(x, w, b, 2048, tiles=tiles)) for _ in range(5))
