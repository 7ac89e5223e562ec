"""Tile configurations of the layout GEMMs, one per regime, the grouped tile order they share, and how a launch
is cut into waves.

Decode (M <= 64 rows) is bound by reading W once: a short M tile, tiles narrow enough in N to give at least
MIN_COLUMN_TILES programs, a long K tile and the deepest pipeline that fits in shared memory. Prefill (large M)
is bound by math: the usual 128x256x64 Hopper tile with grouped ordering so that neighbouring programs reuse W
tiles from L2. Decode tiles follow an H200 sweep of Qwen2.5-VL 3B/7B shapes at TP 1 and 2
(`bench/gemm_layouts.py --sweep`, `bench/results/gemm_sweep_h200.json`); the prefill tile is the usual start.

Waves: a GPU runs one tile per SM at a time, so 160 tiles on 132 SMs take two waves, the second 21 % full.
`wave_parts` runs the rows whose tiles fill whole waves as they are, and the rows left over (all of them in
decode, where there are fewer tiles than SMs) with K split over enough programs to fill the last wave. Each
split writes its fp32 partial product to a buffer of its own; `sum_splits` adds them in split order, so the
result does not depend on which program finished first (no atomics: a rollout replays bitwise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

DECODE_MAX_M = 64
NUM_SMS_H200 = 132
MIN_COLUMN_TILES = 64  # fewer column tiles leave most of an H200's 132 SMs without a slice of W to read
SHARED_BYTES = 200 * 1024  # of the 228 KiB an H200 SM has, what a decode tile's pipeline may take
MAX_SPLIT = 8
MIN_BLOCKS_PER_SPLIT = 8  # K tiles each split keeps: below that the partials' traffic and the sum outweigh the gain


@dataclass(frozen=True, slots=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 0  # 0: `wave_parts` decides per launch; n >= 1: every row with K cut n ways (sweeps, tests)

    def __post_init__(self) -> None:
        for b in (self.block_m, self.block_n, self.block_k):
            assert b >= 16 and b & (b - 1) == 0, f"tile sides must be powers of two >= 16 (tl.dot), got {self}"
        assert self.split_k >= 0, f"split_k must be >= 0, got {self}"


PREFILL = Tiles(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3)


def pick_tiles(num_rows: int, num_cols: int, num_inner: int = 0) -> Tiles:
    """The tile for an [num_rows, num_inner] x [num_inner, num_cols] product: decode for short M, prefill
    otherwise. Decode: the widest N tile (64, 32, 16) that still gives MIN_COLUMN_TILES column tiles, K in
    256-deep steps up to 32 rows and 128-deep for 64, and the deepest pipeline (6, 4, 3 stages) that fits."""
    if num_rows > DECODE_MAX_M:
        return PREFILL
    block_m = max(16, triton.next_power_of_2(num_rows))
    block_n = next((n for n in (64, 32) if triton.cdiv(num_cols, n) >= MIN_COLUMN_TILES), 16)
    block_k = 256 if block_m <= 32 else 128
    stage_bytes = (block_m + block_n) * block_k * 2  # one bf16 tile of x and one of W
    stages = next(s for s in (6, 4, 3, 2) if s * stage_bytes <= SHARED_BYTES)
    return Tiles(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=4, num_stages=stages)


@triton.jit
def tile_position(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of this program: GROUP_M row tiles sweep the column tiles together (L2 reuse of W)."""
    pid = tl.program_id(0)
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M  # not tl.cdiv: see `zero_tile`
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    return pid_m, pid_n


@triton.jit
def zero_tile(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """tl.zeros without tl.zeros: the kernels use only builtins of triton.language, never its @jit helpers
    (tl.zeros, tl.cdiv), which stay compiled-mode functions when triton was imported before TRITON_INTERPRET."""
    return tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)


def num_programs(num_rows: int, num_cols: int, tiles: Tiles) -> int:
    return triton.cdiv(num_rows, tiles.block_m) * triton.cdiv(num_cols, tiles.block_n)


def sm_count(device: torch.device) -> int:
    """The SMs a launch spreads over; the CPU interpreter has none, so it plans as for an H200."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else NUM_SMS_H200


def wave_parts(num_rows: int, num_cols: int, num_inner: int, tiles: Tiles, num_sms: int) -> list[tuple[int, int, int]]:
    """(first row, end row, K splits) of each launch: the rows whose tiles make whole waves unsplit, then the
    rest with K split as many ways as fills one wave (at most MAX_SPLIT, each split MIN_BLOCKS_PER_SPLIT K tiles
    deep). One unsplit part when splitting would not help; every row with `tiles.split_k` when that is set."""
    if tiles.split_k:
        return [(0, num_rows, tiles.split_k)]
    row_tiles, col_tiles = triton.cdiv(num_rows, tiles.block_m), triton.cdiv(num_cols, tiles.block_n)
    whole = min(row_tiles, (row_tiles * col_tiles // num_sms) * num_sms // col_tiles)  # row tiles in full waves
    left = (row_tiles - whole) * col_tiles
    split = min(MAX_SPLIT, num_sms // max(left, 1), triton.cdiv(num_inner, tiles.block_k) // MIN_BLOCKS_PER_SPLIT)
    if left == 0 or split < 2:
        return [(0, num_rows, 1)]
    first = whole * tiles.block_m
    return ([(0, first, 1)] if first else []) + [(first, num_rows, split)]


def k_per_split(num_inner: int, split: int, tiles: Tiles) -> int:
    """K rows each split reads: a multiple of BLOCK_K; the last split takes what is left (maybe nothing)."""
    return triton.cdiv(triton.cdiv(num_inner, split), tiles.block_k) * tiles.block_k


@triton.jit
def sum_splits_kernel(p_ptr, y_ptr, NUMEL, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """y = sum over s of p[s] (fp32, in split order), cast to y's dtype; p is [SPLIT_K, NUMEL]."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < NUMEL
    acc = tl.load(p_ptr + offs, mask=inside, other=0.0)
    for s in range(1, SPLIT_K):
        acc += tl.load(p_ptr + s * NUMEL + offs, mask=inside, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=inside)


def sum_splits(partials: torch.Tensor, y: torch.Tensor) -> None:
    """Writes the split-ordered sum of `partials` [splits, *y.shape] (fp32) into the contiguous `y`."""
    assert partials.is_contiguous() and y.is_contiguous() and partials.shape[1:] == y.shape, "partials [S, *y]"
    block = 1024
    sum_splits_kernel[(triton.cdiv(y.numel(), block),)](partials, y, y.numel(), partials.shape[0], block)


def check_dtypes(*tensors: torch.Tensor) -> None:
    """bf16 is the production dtype; fp32 is accepted because the CPU interpreter's tl.dot mishandles bf16."""
    dtype = tensors[0].dtype
    assert dtype in (torch.bfloat16, torch.float32), f"expected bf16 (or fp32 for the interpreter), got {dtype}"
    assert all(t.dtype == dtype for t in tensors), f"mixed dtypes: {[t.dtype for t in tensors]}"
