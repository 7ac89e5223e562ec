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
    MAX_SPLIT,
    MIN_BLOCKS_PER_SPLIT,
    MIN_COLUMN_TILES,
    PREFILL,
    SHARED_BYTES,
    Tiles,
    k_per_split,
    pick_tiles,
    wave_parts,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("num_rows", [1, 8, 16, 17, 32, 64])
def test_decode_rows_get_the_shortest_m_tile_that_holds_them(num_rows):
    tiles = pick_tiles(num_rows, 2048)
    assert tiles.block_m >= num_rows and (tiles.block_m == 16 or tiles.block_m < 2 * num_rows)


def test_decode_tiles_narrow_until_there_are_enough_column_tiles_to_spread_w_over_the_sms():
    assert [pick_tiles(8, n).block_n for n in (4608, 3584, 2048, 1280)] == [64, 32, 32, 16]
    assert all(triton.cdiv(n, pick_tiles(1, n).block_n) >= MIN_COLUMN_TILES for n in (1280, 2048, 3584, 4608))


@pytest.mark.parametrize("num_rows", [1, 8, 32, 64])
@pytest.mark.parametrize("num_cols", [1280, 2048, 4608])
def test_decode_tiles_take_the_deepest_pipeline_that_fits_in_shared_memory(num_rows, num_cols):
    t = pick_tiles(num_rows, num_cols)
    stage = (t.block_m + t.block_n) * t.block_k * 2
    deeper = {6: None, 4: 6, 3: 4, 2: 3}[t.num_stages]
    assert t.num_stages * stage <= SHARED_BYTES and (deeper is None or deeper * stage > SHARED_BYTES)


def test_prefill_rows_get_the_prefill_tile():
    assert pick_tiles(DECODE_MAX_M + 1, 2048) == pick_tiles(4096, 2048) == PREFILL


def test_decode_rows_split_long_k_until_the_tiles_fill_the_sms():
    decode = Tiles(block_m=16, block_n=64, block_k=256)
    assert wave_parts(1, 2048, 11008, decode, 132) == [(0, 1, 4)]  # 32 column tiles: 4 x 32 programs
    assert wave_parts(1, 2048, 5504, decode, 132) == [(0, 1, 2)]  # 22 K tiles: at most 2 splits of 8 tiles
    assert MIN_BLOCKS_PER_SPLIT == 8
    assert wave_parts(1, 2048, 2048, decode, 132) == [(0, 1, 1)]  # 8 K tiles: not worth a split
    assert wave_parts(1, 512, 65536, decode, 132) == [(0, 1, MAX_SPLIT)]


def test_prefill_rows_in_whole_waves_stay_unsplit_and_the_rest_split_to_fill_one_wave():
    # 4096 x 1280 in 128 x 256 tiles: 32 x 5 = 160 tiles; 26 row tiles (130) fill a wave, 6 x 5 = 30 are left
    assert wave_parts(4096, 1280, 2048, PREFILL, 132) == [(0, 26 * 128, 1), (26 * 128, 4096, 4)]
    # 4096 x 2048: 32 x 8 = 256 tiles; the 128 left nearly fill the second wave: no split
    assert wave_parts(4096, 2048, 2048, PREFILL, 132) == [(0, 4096, 1)]
    # 4096 x 2560 (10 column tiles): 26 row tiles are two waves, 60 tiles left: two splits each
    assert wave_parts(4096, 2560, 2048, PREFILL, 132) == [(0, 26 * 128, 1), (26 * 128, 4096, 2)]
    # 32768 x 1280: 1280 tiles, 237 row tiles fill 9 waves, and the 95 left would fill a wave in one split
    assert wave_parts(32768, 1280, 2048, PREFILL, 132) == [(0, 32768, 1)]


def test_a_set_split_applies_to_every_row():
    assert wave_parts(4096, 1280, 2048, Tiles(128, 256, 64, split_k=3), 132) == [(0, 4096, 3)]


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
