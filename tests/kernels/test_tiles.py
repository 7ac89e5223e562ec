"""Tile choice per regime, and the promises of the package and the benchmark on a machine without a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
import triton

from rollplex.kernels.tiles import DECODE_MAX_M, MIN_COLUMN_TILES, PREFILL, SHARED_BYTES, pick_tiles

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
