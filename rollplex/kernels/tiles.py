"""Tile configurations of the layout GEMMs, one per regime, the grouped tile order they share, and how a launch
is cut into waves.

A GPU runs one tile per SM at a time, so 160 tiles on 132 SMs take two waves, the second 21 % full.

These are the pointer kernels' tiles (`transposed_gemm`, `qkv_gemm`). A K-contiguous W at decode rows takes
`swap_gemm` wherever its tiles fit, with tiles of its own (`swap_tiles`); the decode rules below then serve the
transposed slabs, and the K-contiguous weights only where `swap_gemm` does not fit. The examples are shapes as the
pointer kernels run them.

Decode (M <= 64 rows) is bound by reading W once, and one wave holds all of it: `pick_tiles` takes the split of the
columns into N tiles (16, 32 or 64 wide) and of K into 1-8 parts that gives the most programs within one wave, K split
only where every part reads at least DECODE_SPLIT_MIN_K rows, or SHORT_SPLIT_MIN_K for a K-contiguous W (HF's [O, I],
the fused QKV) where that gives strictly more programs (7B TP-2 QKV, 2304 x 3584: 64 wide in three parts of
1280/1280/1024 rows, 108 programs, rather than two parts at 64 rows). On a tie it takes the widest tile, except for a W
stored [K, N] (N contiguous, `n_contiguous`) with K <= SHORT_K, where it takes the fewest K parts among tiles at least
32 wide: there the partials and their sum cost more than a wider tile gains (7B o_proj, 3584 x 3584: 32 wide unsplit
rather than 64 wide in two parts at 64 rows). 16- or 64-row M tiles (64 rows run on Hopper's warpgroup MMA, which 32
rows do not reach) and the deepest pipeline that fits in shared memory. Prefill (large M) is bound by math: the usual
128x256x64 Hopper tile with grouped ordering so that neighbouring programs reuse W tiles from L2, and `wave_parts` runs
the rows whose tiles fill whole waves as they are and the rows left over with narrower N tiles (and, if that is not
enough, K split) so that they fill one more wave instead of a fraction of one. The rules follow H200 sweeps of
Qwen2.5-VL 3B/7B shapes at TP 1 and 2 (`bench/gemm_layouts.py --sweep`; docs/results.md).

A K split writes each part's fp32 partial product to a buffer of its own, and `sum_splits` adds them in split
order: the result does not depend on which program finished first (no atomics), so a product replays bitwise
for the same rows on a GPU with as many SMs. It may change with the row count (a prefill tail's split) or the
SM count (another plan); `sm_count` is the device's, not a green context's share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from rollplex.kernels.pdl import pdl_options

DECODE_MAX_M = 64
NUM_SMS_H200 = 132
SHARED_BYTES = 200 * 1024  # of the 228 KiB an H200 SM has, what a decode tile's pipeline may take
DECODE_SPLIT_MIN_K = 1536  # K rows each part of a decode split reads: shorter parts lose to the partials' sum
MAX_SPLIT = 8
MIN_TAIL_BLOCK_N = 64  # the narrowest N tile a prefill tail takes before it splits K instead
MIN_BLOCKS_PER_SPLIT = 8  # K tiles each part of a prefill tail's split keeps
SHORT_K = 4096  # an N-contiguous W with K up to this prefers unsplit tiles on a tie (see the module docstring)
SHORT_SPLIT_MIN_K = 1024  # a K-contiguous W's parts may be this short where that gives more programs


@dataclass(frozen=True, slots=True)
class Tiles:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    split_k: int | None = None  # None: `wave_parts` plans the launch; n: every row with K cut n ways

    def __post_init__(self) -> None:
        for b in (self.block_m, self.block_n, self.block_k):
            assert b >= 16 and b & (b - 1) == 0, f"tile sides must be powers of two >= 16 (tl.dot), got {self}"
        assert self.split_k is None or self.split_k >= 1, f"split_k must be None or >= 1, got {self}"


# 4 stages (192 KiB of shared memory): the deepest pipeline that fits, which hides more of the loads than 3 stages
PREFILL = Tiles(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=4)


def pick_tiles(
    num_rows: int, num_cols: int, num_inner: int = 0, num_sms: int = NUM_SMS_H200, n_contiguous: bool = False
) -> Tiles:
    """The tile for an [num_rows, num_inner] x [num_inner, num_cols] product: PREFILL above DECODE_MAX_M rows,
    else the decode tile of the module docstring (K unsplit when `num_inner` is not given). n_contiguous: W is
    stored [K, N] with N contiguous (a row-parallel slab), which changes the tie-break."""
    if num_rows > DECODE_MAX_M:
        return PREFILL
    block_m = 16 if num_rows <= 16 else 64
    block_k = 256 if block_m == 16 else 128
    programs = lambda n, k: triton.cdiv(num_cols, n) * k  # noqa: E731

    def fitting(min_k: int) -> list[tuple[int, int]]:
        """(N tile, K parts) within one wave whose parts read at least min_k rows each."""
        splits = [k for k in range(1, MAX_SPLIT + 1) if k == 1 or shortest_part(num_inner, k, block_k) >= min_k]
        return [(n, k) for n in (16, 32, 64) for k in splits if programs(n, k) <= num_sms]

    fits = fitting(DECODE_SPLIT_MIN_K)
    shorter = [] if n_contiguous else fitting(SHORT_SPLIT_MIN_K)
    if shorter and max(programs(*f) for f in shorter) > max((programs(*f) for f in fits), default=0):
        fits = shorter  # a K-contiguous W: parts of 1024+ rows where they give strictly more programs
    if n_contiguous and num_inner <= SHORT_K:
        tie = lambda f: (programs(*f), f[0] >= 32, -f[1], f[0])  # noqa: E731
    else:
        tie = lambda f: (programs(*f), f[0])  # noqa: E731
    block_n, split = max(fits, key=tie) if fits else (64, 1)
    stage_bytes = (block_m + block_n) * block_k * 2  # one bf16 tile of x and one of W
    stages = next(s for s in (6, 4, 3, 2) if s * stage_bytes <= SHARED_BYTES)
    return Tiles(block_m, block_n, block_k, num_warps=4, num_stages=stages, split_k=split)


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


def wave_parts(
    num_rows: int, num_cols: int, num_inner: int, tiles: Tiles, num_sms: int
) -> list[tuple[int, int, Tiles]]:
    """(first row, end row, tiles with split_k set) of each launch. Tiles with split_k set: one launch. Else the
    rows whose tiles make whole waves, then the rest with N tiles halved (down to MIN_TAIL_BLOCK_N) while they
    still fit in one wave, and K split as many ways as then fills it (at most MAX_SPLIT, every part at least
    MIN_BLOCKS_PER_SPLIT K tiles deep); one launch when that changes nothing."""
    if tiles.split_k is not None:
        return [(0, num_rows, tiles)]
    whole_tiles = replace(tiles, split_k=1)
    row_tiles, col_tiles = triton.cdiv(num_rows, tiles.block_m), triton.cdiv(num_cols, tiles.block_n)
    whole = (row_tiles * col_tiles // num_sms) * num_sms // col_tiles  # row tiles in full waves
    if whole == row_tiles:
        return [(0, num_rows, whole_tiles)]

    def tail_programs(block_n: int) -> int:
        return (row_tiles - whole) * triton.cdiv(num_cols, block_n)

    block_n = tiles.block_n
    while block_n > MIN_TAIL_BLOCK_N and tail_programs(block_n // 2) <= num_sms:
        block_n //= 2
    deep_enough = MIN_BLOCKS_PER_SPLIT * tiles.block_k
    splits = range(min(MAX_SPLIT, num_sms // tail_programs(block_n)), 1, -1)  # empty: more than a wave as it is
    split = next((k for k in splits if shortest_part(num_inner, k, tiles.block_k) >= deep_enough), 1)
    tail = replace(tiles, block_n=block_n, split_k=split)
    if tail == whole_tiles:
        return [(0, num_rows, whole_tiles)]
    first = whole * tiles.block_m
    return ([(0, first, whole_tiles)] if first else []) + [(first, num_rows, tail)]


def k_per_split(num_inner: int, split: int, tiles: Tiles) -> int:
    """K rows each part of a split reads: a multiple of BLOCK_K; the last part takes what is left, which a
    split set by hand may leave empty (the planned ones never do: `shortest_part`)."""
    return triton.cdiv(triton.cdiv(num_inner, split), tiles.block_k) * tiles.block_k


def shortest_part(num_inner: int, split: int, block_k: int) -> int:
    """K rows of a split's last part, its shortest (<= 0: the split has empty parts)."""
    per = triton.cdiv(triton.cdiv(num_inner, split), block_k) * block_k
    return num_inner - (split - 1) * per


def launch_in_parts(
    x: torch.Tensor,
    y: torch.Tensor,
    tiles: Tiles | None,
    num_sms: int | None,
    launch: Callable,
    pdl: bool = False,
    n_contiguous: bool = False,
) -> torch.Tensor:
    """Fills y [M, N] = a product of x [M, K]: `launch(rows, out, partials, tiles)` per part of `wave_parts` (rows
    and out that part's row slices of x and y; partials [split, rows, N] fp32 where tiles.split_k > 1, else out),
    then the split's sum. Tiles: `tiles`, or `pick_tiles`' for `num_sms` (default: the device's) SMs and W's
    layout (`n_contiguous`)."""
    (m, k), n = x.shape, y.shape[1]
    num_sms = sm_count(x.device) if num_sms is None else num_sms
    picked = tiles or pick_tiles(m, n, k, num_sms, n_contiguous)
    for first, end, t in wave_parts(m, n, k, picked, num_sms) if m else []:
        out = y[first:end]
        partials = out.new_empty(t.split_k, end - first, n, dtype=torch.float32) if t.split_k > 1 else out
        launch(x[first:end], out, partials, t)
        if t.split_k > 1:
            sum_splits(partials, out, pdl)
    return y


@triton.jit
def sum_splits_kernel(p_ptr, y_ptr, NUMEL, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr = False):
    """y = sum over s of p[s] (fp32, in split order), cast to y's dtype; p is [SPLIT_K, NUMEL]. USE_GDC: see
    `transposed_gemm_kernel`."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < NUMEL
    p = p_ptr + offs
    acc = tl.load(p, mask=inside, other=0.0)
    for _ in range(1, SPLIT_K):
        p += NUMEL  # the pointer walks (64-bit): SPLIT_K * NUMEL may pass 2**31
        acc += tl.load(p, mask=inside, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=inside)


def sum_splits(partials: torch.Tensor, y: torch.Tensor, pdl: bool = False) -> None:
    """Writes the split-ordered sum of `partials` [splits, *y.shape] (fp32) into the contiguous `y`. `pdl`: a
    programmatic dependent launch (see `matmul_transposed`)."""
    assert partials.is_contiguous() and y.is_contiguous() and partials.shape[1:] == y.shape, "partials [S, *y]"
    block = 1024
    sum_splits_kernel[(triton.cdiv(y.numel(), block),)](
        partials, y, y.numel(), partials.shape[0], block, **pdl_options(pdl, y)
    )


def check_dtypes(*tensors: torch.Tensor) -> None:
    """bf16 is the production dtype; fp32 is accepted because the CPU interpreter's tl.dot mishandles bf16."""
    dtype = tensors[0].dtype
    assert dtype in (torch.bfloat16, torch.float32), f"expected bf16 (or fp32 for the interpreter), got {dtype}"
    assert all(t.dtype == dtype for t in tensors), f"mixed dtypes: {[t.dtype for t in tensors]}"
