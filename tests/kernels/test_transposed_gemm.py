"""`matmul_transposed` reads a row-parallel weight stored as W^T and equals x @ W^T on the materialised W; `linear`
reads HF's [O, I] weight with its bias through the same kernel and equals F.linear; the decode variants (parts left
unsummed, silu(gate) * up in one launch) equal their unfused products."""

from __future__ import annotations

import pytest
import torch
from kernels_testkit import DEVICE, DTYPE, ON_GPU, assert_matches, needs_cuda, random

pytest.importorskip("triton")
from rollplex.kernels.decode_ops import silu_mul
from rollplex.kernels.tiles import Tiles, pick_tiles, sum_splits, wave_parts
from rollplex.kernels.transposed_gemm import (
    gate_up_silu,
    gate_up_swaps,
    linear,
    linear_parts,
    matmul_transposed,
    matmul_transposed_parts,
)

SMALL = Tiles(block_m=16, block_n=32, block_k=32)  # several tiles on each axis at test sizes
TAIL = Tiles(block_m=32, block_n=128, block_k=32)  # rows short of a whole wave take narrower tiles, then split K


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """torch.matmul on the materialised [O, I] weight, fp32 accumulation."""
    return torch.matmul(x.float(), w.float().T).to(x.dtype)


@pytest.mark.parametrize("num_rows", [1, 5, 16, 37])
@pytest.mark.parametrize("tiles", [SMALL, None], ids=["small-tiles", "picked-tiles"])
def test_the_transposed_store_gives_x_times_w_transposed(num_rows, tiles):
    w = random(72, 80, seed=1, scale=80**-0.5)  # logical [O, I]
    x = random(num_rows, 80, seed=2)
    y = matmul_transposed(x, w.T.contiguous(), tiles)
    assert_matches(y, reference(x, w))


def test_a_rollout_slab_of_two_training_slabs_is_read_in_place():
    slabs = [random(48, 64, seed=s, scale=96**-0.5) for s in (3, 4)]  # two training shards of I, each [I/2, O]
    stored = torch.cat(slabs)  # the bound rollout slab [I, O]: the slabs back to back
    x = random(20, 96, seed=5)
    assert_matches(matmul_transposed(x, stored, SMALL), reference(x, stored.T))


def test_no_rows_gives_an_empty_output():
    assert matmul_transposed(random(0, 32, seed=0), random(32, 48, seed=1)).shape == (0, 48)


@pytest.mark.parametrize(
    ("x_shape", "s_shape", "why"),
    [((4, 32), (48, 32), "pass W\\^T"), ((4, 32, 1), (32, 48), "expected x")],
)
def test_the_launcher_rejects_shapes_that_are_not_x_and_w_transposed(x_shape, s_shape, why):
    with pytest.raises(AssertionError, match=why):
        matmul_transposed(random(*x_shape, seed=0), random(*s_shape, seed=1))


def test_the_launcher_rejects_a_transposed_view_instead_of_the_stored_slab():
    w = random(48, 32, seed=1)  # [O, I] as vLLM stores it
    with pytest.raises(AssertionError, match="contiguous"):
        matmul_transposed(random(4, 32, seed=0), w.T)


def test_the_launcher_rejects_fp16_and_mixed_dtypes():
    x, s = random(4, 32, seed=0), random(32, 48, seed=1)
    with pytest.raises(AssertionError, match="expected bf16"):
        matmul_transposed(x.half(), s.half())
    other = torch.float32 if torch.bfloat16 == DTYPE else torch.bfloat16
    with pytest.raises(AssertionError, match="mixed dtypes"):
        matmul_transposed(x, s.to(other))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_rows", [1, 8, 64, 4096])
@pytest.mark.parametrize(("out_features", "in_features"), [(2048, 2048), (2048, 5504), (3584, 18944)])
def test_qwen_sized_row_parallel_weights_match_torch_in_bf16(num_rows, out_features, in_features):
    w = random(out_features, in_features, seed=1, scale=in_features**-0.5)
    x = random(num_rows, in_features, seed=2)
    assert DEVICE.type == "cuda"
    assert_matches(matmul_transposed(x, w.T.contiguous()), reference(x, w))


def test_tiles_that_divide_k_and_n_take_the_unmasked_loads():
    w = random(64, 96, seed=6, scale=96**-0.5)  # O = 64 and I = 96 split into 32-wide tiles
    x = random(21, 96, seed=7)
    assert_matches(matmul_transposed(x, w.T.contiguous(), SMALL), reference(x, w))


@pytest.mark.parametrize("split_k", [2, 3])
@pytest.mark.parametrize("num_rows", [1, 21])
def test_splitting_k_over_programs_sums_to_the_same_product(split_k, num_rows):
    w = random(64, 200, seed=8, scale=200**-0.5)  # K = 200: the last split is short, and not a tile multiple
    x = random(num_rows, 200, seed=9)
    y = matmul_transposed(x, w.T.contiguous(), Tiles(block_m=16, block_n=32, block_k=32, split_k=split_k))
    assert y.dtype == x.dtype
    assert_matches(y, reference(x, w))


@pytest.mark.parametrize("num_rows", [1, 150])
def test_rows_short_of_a_whole_wave_take_narrower_tiles_and_split_k_and_the_product_is_unchanged(num_rows):
    """4 SMs, 32 x 128 tiles, 128 columns: 150 rows make 5 tiles, rows 0-127 fill a wave and rows 128-149 run
    in two 64-wide tiles with K split in two (4 programs); one row is all tail. K = 600 (18.75 K tiles) leaves
    the last part shorter (280 rows) and not a tile multiple."""
    w = random(128, 600, seed=10, scale=600**-0.5)
    x = random(num_rows, 600, seed=11)
    parts = [(first, t.block_n, t.split_k) for first, _, t in wave_parts(num_rows, 128, 600, TAIL, num_sms=4)]
    assert parts == ([(0, 128, 1), (128, 64, 2)] if num_rows == 150 else [(0, 64, 2)])
    y = matmul_transposed(x, w.T.contiguous(), TAIL, num_sms=4)
    assert_matches(y, reference(x, w))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    ("num_rows", "in_features", "tiles"),
    [(1, 11008, None), (64, 11008, None), (1, 18944, Tiles(16, 64, 256, num_stages=4, split_k=8))],
    ids=["picked-4-parts", "picked-64-rows", "set-8-parts"],
)
def test_on_a_gpu_split_products_match_torch_and_repeat_bitwise(num_rows, in_features, tiles):
    """Four or more fp32 partials: added by atomics, their order (and so the sum) would vary run to run."""
    w = random(2048, in_features, seed=1, scale=in_features**-0.5)
    x, s = random(num_rows, in_features, seed=2), w.T.contiguous()
    planned = wave_parts(num_rows, 2048, in_features, tiles or pick_tiles(num_rows, 2048, in_features), 132)
    assert min(t.split_k for *_, t in planned) >= 4
    y = matmul_transposed(x, s, tiles, num_sms=132)
    assert_matches(y, reference(x, w))
    assert all(torch.equal(y, matmul_transposed(x, s, tiles, num_sms=132)) for _ in range(5))


def test_a_programmatic_dependent_launch_is_refused_off_the_gpu_in_one_line():
    if DEVICE.type == "cuda":
        pytest.skip("checks the refusal on a machine without a GPU")
    with pytest.raises(AssertionError, match="pdl: programmatic dependent launch needs a CUDA GPU"):
        matmul_transposed(random(4, 32, seed=0), random(32, 48, seed=1), pdl=True)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(ON_GPU and torch.cuda.get_device_capability()[0] < 9, reason="PDL needs Hopper or newer")
@pytest.mark.parametrize("num_rows", [1, 64])
def test_on_a_gpu_a_chain_of_dependent_launches_equals_plain_launches_bitwise(num_rows):
    """Each product reads the one before: a launch that read before its predecessor's writes landed would
    differ. Decode tiles of 11008 -> 2048 split K, so the chain also runs the partials' sum as a dependent."""
    w = [random(2048, 2048, seed=s, scale=2048**-0.5).T.contiguous() for s in range(8)]
    down = random(2048, 11008, seed=9, scale=11008**-0.5).T.contiguous()
    x = random(num_rows, 11008, seed=10)

    def chain(pdl: bool) -> torch.Tensor:
        y = matmul_transposed(x, down, pdl=pdl)
        for s in w:
            y = matmul_transposed(y, s, pdl=pdl)
        return y

    assert torch.equal(chain(False), chain(True))


@pytest.mark.parametrize("num_rows", [1, 21])
@pytest.mark.parametrize("tiles", [SMALL, Tiles(block_m=16, block_n=32, block_k=32, split_k=3), None])
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_reads_the_hf_layout_and_adds_the_bias_once_whatever_the_split(num_rows, tiles, with_bias):
    """[O, I] = [72, 200]: O not a multiple of the 32-wide tiles, and K split three ways (bias in part 0 only)."""
    w = random(72, 200, seed=12, scale=200**-0.5)
    bias = random(72, seed=13) if with_bias else None
    x = random(num_rows, 200, seed=14)
    expected = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
    assert_matches(linear(x, w, bias, tiles), expected.to(x.dtype))


def test_linear_refuses_a_weight_that_is_not_a_contiguous_o_by_i():
    w = random(32, 48, seed=1)  # a stored [I, O] slab's transposed view is not HF's layout
    with pytest.raises(AssertionError, match="contiguous"):
        linear(random(4, 32, seed=0), w.T)
    with pytest.raises(AssertionError, match="bias must be"):
        linear(random(4, 48, seed=0), w, random(48, seed=2))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_rows", [1, 32, 64])
@pytest.mark.parametrize(("out_features", "in_features"), [(2560, 2048), (2048, 2048), (2048, 11008)])
def test_on_a_gpu_linear_matches_torch_on_qwen_3b_decode_projections(num_rows, out_features, in_features):
    """The decode step's qkv (with bias), o_proj and down_proj of the 3B model."""
    w = random(out_features, in_features, seed=1, scale=in_features**-0.5)
    bias = random(out_features, seed=3) if out_features == 2560 else None
    x = random(num_rows, in_features, seed=2)
    expected = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
    assert_matches(linear(x, w, bias), expected.to(x.dtype))


def summed(parts: torch.Tensor) -> torch.Tensor:
    """What `sum_splits` makes of a split's partials (one part in the model dtype is the product itself)."""
    if parts.shape[0] == 1:
        return parts[0]
    y = torch.empty(parts.shape[1:], dtype=DTYPE, device=parts.device)
    sum_splits(parts, y)
    return y


@pytest.mark.parametrize(
    ("in_features", "num_parts"),
    [(200, 1), (2048, 2)],  # a K-contiguous W splits into 1,024-row parts where that gives more programs
)
@pytest.mark.parametrize("num_rows", [3, 64, 65])
def test_linear_parts_add_up_to_the_product_and_leave_a_split_unsummed(in_features, num_parts, num_rows):
    w = random(48, in_features, seed=1, scale=in_features**-0.5)
    bias, x = random(48, seed=2), random(num_rows, in_features, seed=3)
    parts = linear_parts(x, w, bias)
    expected = num_parts if num_rows <= 64 else 1  # prefill rows: the summed product as one part
    assert parts.shape == (expected, num_rows, 48)
    assert parts.dtype == (DTYPE if expected == 1 else torch.float32)
    assert_matches(summed(parts), torch.nn.functional.linear(x.float(), w.float(), bias.float()).to(DTYPE))


def test_linear_parts_at_decode_rows_through_swap_gemm_sum_to_linear_bitwise():
    w = random(128, 3200, seed=8, scale=3200**-0.5)  # 2 column tiles of 64 rows, K split in five 640-row parts
    bias, x = random(128, seed=9), random(5, 3200, seed=10)
    parts = linear_parts(x, w, bias)
    assert parts.shape == (5, 5, 128) and parts.dtype == torch.float32
    assert torch.equal(summed(parts), linear(x, w, bias))
    assert_matches(summed(parts), torch.nn.functional.linear(x.float(), w.float(), bias.float()).to(DTYPE))


def test_transposed_parts_of_a_long_slab_split_and_add_up_to_the_product():
    w = random(32, 3072, seed=4, scale=3072**-0.5)  # K 3072: two parts of 1,536 rows
    x = random(5, 3072, seed=5)
    parts = matmul_transposed_parts(x, w.T.contiguous())
    assert parts.shape == (2, 5, 32) and parts.dtype == torch.float32
    assert_matches(summed(parts), reference(x, w))


@pytest.mark.parametrize(
    ("blocks", "block_rows", "in_features", "num_rows"),
    [
        (1, 96, 64, 2),  # K shorter than one K tile: the masked loads (96 rows: `linear` could swap, is told not to)
        (2, 40, 64, 33),
        (4, 24, 64, 70),  # prefill rows: the prefill tile, masked columns
        (1, 32, 256, 5),  # whole K tiles and 16-wide tiles that divide N: the pointer kernel's unmasked loads
        (1, 64, 256, 5),  # whole 64-row gate and up tiles: both through swap_gemm
        (1, 64, 1024, 3),  # K long enough that swap_gemm would split it for `linear`, which is told not to
        (2, 20, 512, 9),  # 20 columns a block: the 16-wide tiles mask a tail
    ],
)
def test_gate_up_silu_equals_the_gemm_then_silu_mul_per_block(blocks, block_rows, in_features, num_rows):
    """w holds per block its gate rows then its up rows (HF's packed [gate; up] is one block, a TP layer's
    gate_up one per training rank): the output's block b is silu(x G_b^T) * (x U_b^T), at decode rows bitwise
    what `linear` (K unsplit) then `silu_mul` give."""
    w = random(blocks * 2 * block_rows, in_features, seed=6, scale=in_features**-0.5)
    x = random(num_rows, in_features, seed=7)
    swap = gate_up_swaps(x, w, block_rows)  # the kernel family both products take (the unfused step's rule)
    y = linear(x, w, swap=swap, split=False).view(num_rows * blocks, 2 * block_rows)  # [gate_b up_b] a row, block
    expected = silu_mul(y, torch.empty(num_rows * blocks, block_rows, dtype=DTYPE, device=DEVICE))
    out = gate_up_silu(x, w, block_rows)
    assert out.shape == (num_rows, blocks * block_rows)
    if num_rows <= 64:  # decode rows; prefill tiles differ in width, and the interpreter's sums with them
        assert torch.equal(out, expected.view(num_rows, -1))
    exact = reference(x, w).view(num_rows * blocks, 2 * block_rows)
    gate, up = exact[:, :block_rows], exact[:, block_rows:]
    assert_matches(out.view(-1, block_rows), (torch.nn.functional.silu(gate.float()) * up.float()).to(DTYPE))


@pytest.mark.parametrize("name", ["qwen2_5_vl_3b", "qwen2_5_vl_7b", "qwen2_5_vl_32b", "qwen2_5_vl_72b"])
def test_linear_never_splits_a_shipped_models_decode_gate_up_so_the_fused_one_is_bitwise_the_same(name):
    """`gate_up_silu` never splits K; it equals `linear` + `silu_mul` bitwise only where `linear` (told the same
    kernel family, `gate_up_swaps`, and through `swap_gemm` K unsplit) does not split either: its own kernel's
    tiles, at every training TP and every rollout TP dividing it, with blocks = train / rollout blocks of
    intermediate / train gate rows each, where `swap_gemm` does not take the product."""
    from rollplex.models.config import load_model_config
    from rollplex.parallel.layout import check_train_tp

    t = load_model_config(name).text
    for tp in (1, 2, 4, 8):
        try:
            check_train_tp(t, tp)
        except ValueError:
            continue
        for rollout_tp in (r for r in (1, 2, 4, 8) if tp % r == 0):
            block_rows, k = t.intermediate_size // tp, t.hidden_size
            rows = 2 * block_rows * (tp // rollout_tp)  # a rollout rank's [gate; up] blocks
            w, x = (torch.empty(*shape, device="meta", dtype=torch.bfloat16) for shape in ((rows, k), (1, k)))
            for m in range(1, 65):
                if not gate_up_swaps(x.expand(m, k).contiguous(), w, block_rows):
                    splits = [p[2].split_k for p in wave_parts(m, rows, k, pick_tiles(m, rows, k), 132)]
                    assert splits == [1], (tp, rollout_tp, m)


def test_gate_up_silu_refuses_a_weight_that_is_not_whole_gate_up_blocks():
    with pytest.raises(AssertionError, match="not \\[gate; up\\] blocks"):
        gate_up_silu(random(4, 32, seed=0), random(100, 32, seed=1), 30)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_rows", [1, 32, 64])
@pytest.mark.parametrize(("out_features", "in_features"), [(2560, 2048), (2048, 2048), (2048, 11008)])
def test_on_a_gpu_parts_summed_as_sum_splits_sums_them_equal_linear_bitwise(num_rows, out_features, in_features):
    """The fused decode step adds a split's parts itself: it must get what `linear` would have stored."""
    w = random(out_features, in_features, seed=1, scale=in_features**-0.5)
    x = random(num_rows, in_features, seed=2)
    assert torch.equal(summed(linear_parts(x, w)), linear(x, w))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_rows", [1, 32, 64, 200])
@pytest.mark.parametrize(("blocks", "intermediate", "hidden"), [(1, 11008, 2048), (2, 9472, 3584)])
def test_on_a_gpu_gate_up_silu_equals_the_gemm_then_silu_mul_bitwise(num_rows, blocks, intermediate, hidden):
    """3B's packed [gate; up] and 7B's at TP 2 bound for rollout TP 1 (two blocks): the fused epilogue rounds as
    the unfused path does, so the rollout does not change."""
    w = random(blocks * 2 * intermediate, hidden, seed=1, scale=hidden**-0.5)
    x = random(num_rows, hidden, seed=2)
    y = linear(x, w).view(num_rows * blocks, 2 * intermediate)
    unfused = silu_mul(y, torch.empty(num_rows * blocks, intermediate, dtype=DTYPE, device=DEVICE))
    assert torch.equal(gate_up_silu(x, w, intermediate), unfused.view(num_rows, -1))
