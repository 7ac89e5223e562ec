"""Tile choice per regime, and the promises of the package and the benchmark on a machine without a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
from rollplex.kernels.tiles import DECODE_MAX_M, PREFILL, pick_tiles

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("num_rows", [1, 8, 16, 17, 32, 64])
def test_decode_rows_get_the_shortest_m_tile_that_holds_them(num_rows):
    tiles = pick_tiles(num_rows, 2048)
    assert tiles.block_m >= num_rows and (tiles.block_m == 16 or tiles.block_m < 2 * num_rows)


def test_short_decode_tiles_go_deep_in_k_and_narrow_in_n_when_k_is_long():
    assert pick_tiles(1, 3584, 3584).block_k == 256 and pick_tiles(1, 3584, 3584).block_n == 64
    assert pick_tiles(8, 3584, 18944).block_n == 32  # down_proj: long K, few columns


def test_wider_decode_tiles_narrow_until_the_column_tiles_can_fill_an_h200():
    assert pick_tiles(64, 2048).block_n == 32 and pick_tiles(64, 32768).block_n == 64


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
