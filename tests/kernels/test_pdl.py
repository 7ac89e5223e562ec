"""How much of its weights a GEMM launched as a dependent (`ahead` or not) prefetches, and the launch keywords
(the compiled order of the waits, launches and prefetches is checked in test_hopper_compile.py)."""

import pytest
import torch

from rollplex.kernels.pdl import PREFETCH_BYTES, pdl_options, prefetch_k
from rollplex.kernels.swap_gemm import swap_prefetch, swap_tiles
from rollplex.kernels.tiles import k_per_split


@pytest.mark.parametrize(
    ("name", "rows", "cols", "inner", "paired", "expected"),
    [
        ("qkv", 32, 2560, 2048, False, 512),  # K split 3 ways: 120 programs, a power of two of 640
        ("o_proj", 32, 2048, 2048, False, 512),  # K split 4 ways: 128 programs of 512 rows
        ("gate_up", 32, 11008, 2048, True, 256),  # 172 programs of gate and up rows: two blocks of K each
        ("down_proj", 32, 2048, 11008, False, 1024),  # K split 4 ways: 128 programs, a power of two of 2,752
    ],
)
def test_the_3b_decode_gemms_prefetch_a_power_of_two_within_their_part_and_the_budget(
    name, rows, cols, inner, paired, expected
):
    t = swap_tiles(rows, cols, inner, 132, paired=paired)
    programs, per_program_rows = -(-cols // t.block_n) * t.split_k, t.block_n * (2 if paired else 1)
    got = prefetch_k(programs, per_program_rows, k_per_split(inner, t.split_k, t), 2)
    assert got == expected, (name, t)
    assert got & (got - 1) == 0 and got <= k_per_split(inner, t.split_k, t)
    assert programs * per_program_rows * got * 2 <= PREFETCH_BYTES


@pytest.mark.parametrize(
    ("name", "cols", "inner", "paired"), [("qkv", 2560, 2048, False), ("gate_up", 11008, 2048, True)]
)
def test_a_gemm_launched_as_a_dependent_but_not_ahead_prefetches_at_most_its_first_two_blocks(
    name, cols, inner, paired
):
    t = swap_tiles(32, cols, inner, 132, paired=paired)
    programs, rows, part = (
        -(-cols // t.block_n) * t.split_k,
        t.block_n * (2 if paired else 1),
        k_per_split(inner, t.split_k, t),
    )
    assert swap_prefetch(programs, rows, part, 2, t, ahead=True) == prefetch_k(programs, rows, part, 2)
    assert swap_prefetch(programs, rows, part, 2, t, ahead=False) == min(
        2 * t.block_k, prefetch_k(programs, rows, part, 2)
    )
    assert swap_prefetch(programs, rows, part, 2, t, ahead=False) == {"qkv": 256, "gate_up": 256}[name]
    assert swap_prefetch(100_000, rows, part, 2, t, ahead=False) == 0  # the budget leaves no line a row


def test_nothing_is_prefetched_where_not_a_line_a_row_fits():
    assert prefetch_k(100_000, 64, 4096, 2) == 0  # 16 MiB over 6.4M rows: 2 bytes each
    assert prefetch_k(1, 64, 32, 2) == 0  # a part shorter than a line
    assert prefetch_k(1, 64, 64, 2) == 64 and prefetch_k(1, 64, 16, 4) == 0  # fp32: 32 elements a line


def test_ahead_needs_a_dependent_launch():
    x = torch.zeros(1)
    assert pdl_options(False, x) == {"USE_GDC": False}
    with pytest.raises(AssertionError, match="ahead"):
        pdl_options(False, x, ahead=True)
