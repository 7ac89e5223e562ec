"""Tile choice per regime, and the promises of the package and the benchmark on a machine without a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
import triton

from rollplex.kernels.tiles import (
    DECODE_MAX_M,
    DECODE_SPLIT_MIN_K,
    MAX_SPLIT,
    MIN_BLOCKS_PER_SPLIT,
    NUM_SMS_H200,
    PREFILL,
    SHARED_BYTES,
    SHORT_SPLIT_MIN_K,
    Tiles,
    k_per_split,
    pick_tiles,
    shortest_part,
    wave_parts,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("num_rows", [1, 8, 16, 17, 32, 64])
def test_decode_rows_get_a_16_row_tile_or_the_64_row_one_that_runs_on_warpgroup_mma(num_rows):
    assert pick_tiles(num_rows, 2048).block_m == (16 if num_rows <= 16 else 64)


def test_decode_tiles_give_the_most_programs_within_one_wave():
    # (columns, K) -> (N tile, K split): 2048/16 = 128 programs; 2560/32 = 80 (2560/16 = 160 is two waves);
    # 4608/64 = 72; K 11008 splits 2048/64 = 32 column tiles 4 ways (128, the widest tile of the ties);
    # 2304/64 = 36 tiles split 3 ways (108) into parts of 1280, 1280 and 1024 rows (K-contiguous: see below)
    cases = {(2048, 2048): (16, 1), (2560, 2048): (32, 1), (4608, 3584): (64, 1), (2048, 11008): (64, 4),
             (3584, 18944): (64, 2), (1280, 2048): (16, 1), (2304, 3584): (64, 3)}  # fmt: skip
    for (num_cols, num_inner), picked in cases.items():
        t = pick_tiles(1, num_cols, num_inner)
        assert (t.block_n, t.split_k) == picked, (num_cols, num_inner)
        assert triton.cdiv(num_cols, t.block_n) * t.split_k <= NUM_SMS_H200


def test_a_k_contiguous_weight_splits_into_shorter_parts_only_for_more_programs():
    # 2304 x 3584: 1536-row parts allow two (72 programs); 1024-row parts three (108): taken. 2560 x 2048: two
    # parts of 1024 give 80 programs at 64 wide, no more than 32 wide unsplit: not taken. An N-contiguous
    # slab keeps the 1536-row rule.
    assert pick_tiles(64, 2304, 3584).split_k == 3 and pick_tiles(64, 2304, 3584).block_n == 64
    assert (pick_tiles(64, 2560, 2048).block_n, pick_tiles(64, 2560, 2048).split_k) == (32, 1)
    assert pick_tiles(64, 2304, 3584, n_contiguous=True).split_k < 3  # (32, 1): the tie of the test below


def test_an_n_contiguous_weight_with_short_k_takes_the_fewest_k_parts_on_a_tie():
    # 3584 x 3584 stored [K, N] (a row-parallel slab): 32 wide unsplit and 64 wide in two parts are both 112
    # programs; the sweep measured the unsplit faster at every row count. K-contiguous (HF's [O, I], the QKV
    # kernel) and long K keep the widest tile; a tie never falls to 16 wide when 32 ties too.
    def pick(rows, num_cols, num_inner, n_contiguous):
        t = pick_tiles(rows, num_cols, num_inner, n_contiguous=n_contiguous)
        return t.block_n, t.split_k

    for rows in (1, 8, 32, 64):
        assert pick(rows, 3584, 3584, True) == (32, 1)
        assert pick(rows, 3584, 3584, False) == (64, 2)
        assert pick(rows, 3584, 18944, True) == pick(rows, 3584, 18944, False) == (64, 2)
    assert pick(8, 2048, 5504, True) == (32, 2)  # (16, 1) ties at 128 programs too


def test_decode_splits_k_only_where_every_part_reads_enough_rows():
    assert pick_tiles(1, 2048, 2048).split_k == 1  # 2 x 1024 rows: the partials' sum costs more than it gains
    assert pick_tiles(1, 2048).split_k == 1  # K unknown: never split
    t = pick_tiles(1, 1024, 12544)  # 64 wide x 8 parts of 1792 rows ties on programs but leaves the 8th part empty
    assert (t.block_n, t.split_k) == (32, 4)
    for num_rows in (1, 64):
        for num_inner in range(256, 40_000, 128):
            t = pick_tiles(num_rows, 1024, num_inner, n_contiguous=True)
            assert t.split_k == 1 or shortest_part(num_inner, t.split_k, t.block_k) >= DECODE_SPLIT_MIN_K
            k_contiguous = pick_tiles(num_rows, 1024, num_inner)
            shortest = shortest_part(num_inner, k_contiguous.split_k, k_contiguous.block_k)
            assert k_contiguous.split_k == 1 or shortest >= SHORT_SPLIT_MIN_K
            if k_contiguous.split_k > 1 and shortest < DECODE_SPLIT_MIN_K:  # only for strictly more programs
                assert k_contiguous.split_k * 1024 // k_contiguous.block_n > t.split_k * 1024 // t.block_n
    assert pick_tiles(1, 1 << 20, 4096) == Tiles(16, 64, 256, num_stages=4, split_k=1)  # more than a wave anyway


@pytest.mark.parametrize("num_rows", [1, 8, 32, 64])
@pytest.mark.parametrize("num_cols", [1280, 2048, 4608])
def test_decode_tiles_take_the_deepest_pipeline_that_fits_in_shared_memory(num_rows, num_cols):
    t = pick_tiles(num_rows, num_cols)
    stage = (t.block_m + t.block_n) * t.block_k * 2
    deeper = {6: None, 4: 6, 3: 4, 2: 3}[t.num_stages]
    assert t.num_stages * stage <= SHARED_BYTES and (deeper is None or deeper * stage > SHARED_BYTES)


def test_prefill_rows_get_the_prefill_tile():
    assert pick_tiles(DECODE_MAX_M + 1, 2048) == pick_tiles(4096, 2048) == PREFILL


def parts(num_rows, num_cols, num_inner, tiles=PREFILL):
    return [
        (first, end, t.block_n, t.split_k) for first, end, t in wave_parts(num_rows, num_cols, num_inner, tiles, 132)
    ]


def test_prefill_rows_in_whole_waves_stay_as_they_are_and_the_rest_take_narrower_tiles_to_fill_one_wave():
    # 4096 x 1280 in 128 x 256 tiles: 32 x 5 = 160 tiles; 26 row tiles (130) fill a wave; the 6 left run in
    # 64-wide tiles, 6 x 20 = 120
    assert parts(4096, 1280, 2048) == [(0, 26 * 128, 256, 1), (26 * 128, 4096, 64, 1)]
    # 4096 x 2560 (10 column tiles): 26 row tiles are two waves, the 6 left make 60 tiles, 120 at 128 wide
    assert parts(4096, 2560, 2048) == [(0, 26 * 128, 256, 1), (26 * 128, 4096, 128, 1)]
    # 4096 x 2048: 32 x 8 = 256 tiles; the 128 left nearly fill the second wave: one launch
    assert parts(4096, 2048, 2048) == [(0, 4096, 256, 1)]
    # 32768 x 1280: 1280 tiles, 237 row tiles fill 9 waves, and the 95 left fill the tenth as they are
    assert parts(32768, 1280, 2048) == [(0, 32768, 256, 1)]
    # 200 rows x 256: 2 tiles; halving to 64 wide gives 8, and K 65536 then splits 8 ways (64 programs)
    assert parts(200, 256, 65536) == [(0, 200, 64, MAX_SPLIT)]


def test_a_tail_split_keeps_enough_k_tiles_in_every_part():
    assert parts(200, 256, 1024) == [(0, 200, 64, 2)]  # 16 K tiles: two parts of 8
    # 57 K tiles: 7 parts (9 x 6 + 3 tiles) or 6 (10 x 5 + 7) would cut the last one short; 5 are 12 x 4 + 9
    assert parts(200, 256, 57 * 64)[-1][-1] == 5
    for num_inner in range(64, 20_000, 64):
        for *_, t in wave_parts(200, 256, num_inner, PREFILL, 132):
            deep = MIN_BLOCKS_PER_SPLIT * t.block_k
            assert t.split_k == 1 or shortest_part(num_inner, t.split_k, t.block_k) >= deep, num_inner


def test_a_product_wider_than_a_wave_never_splits():
    assert parts(4096 + 64, 152064, 2048) == [(0, 4096 + 64, 256, 1)]  # a vocabulary: 594 column tiles


def test_set_tiles_are_one_launch():
    t = Tiles(128, 256, 64, split_k=3)
    assert wave_parts(4096, 1280, 2048, t, 132) == [(0, 4096, t)]


@pytest.mark.parametrize(("num_inner", "split"), [(2048, 4), (200, 3), (65, 4), (11008, 4)])
def test_the_splits_cover_k_in_tile_multiples(num_inner, split):
    per = k_per_split(num_inner, split, PREFILL)
    assert per % PREFILL.block_k == 0 and per * split >= num_inner > (per - PREFILL.block_k) * split


def test_importing_the_kernels_package_loads_neither_triton_nor_torch():
    code = "import sys, rollplex.kernels; print('triton' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_the_benchmark_refuses_to_time_without_a_gpu_in_one_line(tmp_path):
    bench = REPO / "bench" / "gemm_layouts.py"
    out = subprocess.run(
        [sys.executable, str(bench), "--out", str(tmp_path / "x.json")], capture_output=True, text=True
    )
    assert out.returncode != 0 and out.stderr.strip().splitlines() == [
        "gemm_layouts: needs a CUDA GPU (timing under the CPU interpreter means nothing)"
    ]
    assert not (tmp_path / "x.json").exists()
