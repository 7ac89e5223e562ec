"""Decode products y = x W^T (+ bias) of a K-contiguous weight, computed as y^T = W x^T, W loaded through TMA.

At decode (M <= DECODE_MAX_M rows) a tile of 64 rows of x is mostly padding, and Hopper's warpgroup MMA wants 64
rows on its first side. Swapping the operands puts 64 weight rows there and the few tokens (16, 32 or 64, the
next power of two) on the other: no MMA row is padding, and each program streams one [BLOCK_N, BLOCK_K] block of
W per step through a tensor descriptor (TMA), which keeps more bytes in flight per SM than per-thread loads; that
is why a K-contiguous W at decode rows takes this kernel wherever its tiles fit (docs/results.md).

W is [rows, K] contiguous: HF's [O, I] (output column c reads row c), or Megatron's interleaved fused QKV
(`QKV`: column c reads row `stored_rows(c)`). A tile of BLOCK_N consecutive columns reads BLOCK_N consecutive
stored rows when BLOCK_N divides head_dim (the row map keeps a head's rows together), so one descriptor load
fetches it; `swap_fits` checks that and TMA's 16-byte alignment. A K split writes fp32 partials [SPLIT_K, M, N]
in split order (the bias in the first part), summed by `tiles.sum_splits` or left for the next kernel. Launched
as a programmatic dependent (`rollplex.kernels.pdl`), each program first pulls the start of its weight rows into
L2 before it waits: its first PREFETCH_BLOCKS blocks, or with `ahead` as much as `pdl.prefetch_k` gives. With
`PAIR` (gate/up blocks, `transposed_gemm.gate_up_silu`) a program also accumulates the up rows PAIR below its
gate rows and stores silu(gate) * up, K unsplit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rollplex.kernels.pdl import enter, leave, line_elements, pdl_options, prefetch_k, prefetch_l2
from rollplex.kernels.tiles import (
    DECODE_MAX_M,
    MAX_SPLIT,
    SHARED_BYTES,
    Tiles,
    check_dtypes,
    k_per_split,
    shortest_part,
    sm_count,
    sum_splits,
    zero_tile,
)

SWAP_BLOCK_N = 64  # weight rows per program: one warpgroup MMA's side
SWAP_BLOCK_K = 128
SWAP_MAX_STAGES = 6
SWAP_SPLIT_MIN_K = 512  # K rows each part of a swapped split reads at least
SWAP_RESIDENT_STAGES = 3  # the pipeline depth of a tile whose programs share SMs to be resident at once
PREFETCH_BLOCKS = 2  # K blocks of its weight rows a program launched as a dependent pulls into L2 before it waits
SM_SHARED_BYTES = 228 * 1024  # a Hopper SM's shared memory, divided among the programs resident on it
RESERVED_BYTES = 1024  # shared memory the driver keeps for each resident program


@dataclass(frozen=True, slots=True)
class QKVHeads:
    """The heads of a fused QKV stored in Megatron's order (`qkv_layout`), local to the shard: the row map's
    constants."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    kv_replicas: int = 1


@triton.jit
def stored_rows(
    cols, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, KV_REP: tl.constexpr
):
    """Stored (Megatron) row of each grouped (vLLM) output column; the same formula as `qkv_layout.grouped_rows`."""
    PER_GROUP: tl.constexpr = NUM_HEADS // (NUM_KV_HEADS * KV_REP)
    head = cols // HEAD_DIM
    offset = cols % HEAD_DIM
    is_q = head < NUM_HEADS
    is_k = (head >= NUM_HEADS) & (head < NUM_HEADS + NUM_KV_HEADS)
    kv_head = tl.where(is_k, head - NUM_HEADS, head - NUM_HEADS - NUM_KV_HEADS)
    group = tl.where(is_q, head // PER_GROUP, kv_head * KV_REP)
    slot = tl.where(is_q, head % PER_GROUP, tl.where(is_k, PER_GROUP, PER_GROUP + 1))
    return (group * (PER_GROUP + 2) + slot) * HEAD_DIM + offset


@triton.jit
def swap_gemm_kernel(
    x_desc,  # [M, K], blocks [BLOCK_M, BLOCK_K] (rows past M read as zeros)
    w_desc,  # [rows, K], blocks [BLOCK_N, BLOCK_K]
    w_ptr,  # the same weight, for the lines PREFETCH_K pulls into L2
    b_ptr,  # [rows] bias, stored like W's rows, or a dummy when not HAS_BIAS
    y_ptr,  # [M, N] row-major
    p_ptr,  # [SPLIT_K, M, N] fp32 partials when SPLIT_K > 1 (else unused)
    M,
    N: tl.constexpr,
    K: tl.constexpr,
    QKV: tl.constexpr,  # read column c from stored row stored_rows(c) (else row c)
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_REP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # tokens per program: the MMA's short side
    BLOCK_N: tl.constexpr,  # output columns (weight rows) per program
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,  # programs per column tile along K (axis 1 of the grid)
    K_SPLIT: tl.constexpr,  # K per split, a multiple of BLOCK_K
    USE_GDC: tl.constexpr = False,  # see `transposed_gemm_kernel`
    PAIR: tl.constexpr = 0,  # > 0: y = silu(gate) * up, as `transposed_gemm_kernel`'s PAIR (K unsplit)
    AHEAD: tl.constexpr = False,  # `pdl.enter`
    PREFETCH_K: tl.constexpr = 0,  # with USE_GDC: elements of each of its W rows a program pulls into L2 first
    LINE: tl.constexpr = 64,  # elements per L2 line
):
    first_col = tl.program_id(0) * BLOCK_N
    first_k = tl.program_id(1) * K_SPLIT
    if QKV:
        first_row = stored_rows(first_col, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, KV_REP)
    elif PAIR > 0:  # blocks of PAIR gate rows then PAIR up rows; a tile lies in one block's gate half
        first_row = (first_col // PAIR) * (2 * PAIR) + first_col % PAIR
    else:
        first_row = first_col
    if USE_GDC and PREFETCH_K > 0:  # the weights: no kernel of the chain writes them
        ks = tl.minimum(first_k + tl.arange(0, PREFETCH_K // LINE) * LINE, K - 1)  # a last part's end: within W
        lines = w_ptr + (first_row + tl.arange(0, BLOCK_N))[:, None].to(tl.int64) * K + ks[None, :]
        prefetch_l2(lines)
        if PAIR > 0:
            prefetch_l2(lines + PAIR * K)
    enter(USE_GDC, AHEAD)
    leave(USE_GDC, AHEAD)
    acc = zero_tile(BLOCK_N, BLOCK_M)  # y^T's tile
    up = zero_tile(BLOCK_N, BLOCK_M)  # the up rows' sums (PAIR > 0)
    for k0 in range(first_k, tl.minimum(first_k + K_SPLIT, K), BLOCK_K):  # past K, TMA reads zeros
        x_t = x_desc.load([0, k0]).T
        acc = tl.dot(w_desc.load([first_row, k0]), x_t, acc)
        if PAIR > 0:
            up = tl.dot(w_desc.load([first_row + PAIR, k0]), x_t, up)
    acc = acc.T  # [BLOCK_M, BLOCK_N]
    if PAIR > 0:  # silu(gate) * up, each op rounded to the output dtype as `decode_ops.silu_mul` rounds it
        gate = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty).to(tl.float32)
        acc = act * up.T.to(y_ptr.dtype.element_ty).to(tl.float32)
    cols = first_col + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    if HAS_BIAS:  # in the first part of a split only (times 1 or 0: exact for a finite bias)
        bias = tl.load(b_ptr + first_row + tl.arange(0, BLOCK_N)).to(tl.float32)
        acc += bias[None, :] * (tl.program_id(1) == 0).to(tl.float32)
    inside = rows[:, None] < M
    if SPLIT_K == 1:
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=inside)
    else:
        p_tile = p_ptr + tl.program_id(1).to(tl.int64) * M * N + rows[:, None] * N + cols[None, :]
        tl.store(p_tile, acc, mask=inside)


def swap_fits(x: torch.Tensor, w: torch.Tensor, num_cols: int, run: int | None = None) -> bool:
    """Whether x [M, K] by w [rows, K] can take the swapped kernel: decode rows, whole 64-column tiles, each
    within a `run` of consecutive stored rows (a head for the QKV map, a gate half for PAIR), rows of 16-byte
    multiples and 16-byte aligned bases (TMA: the row strides are checked too, since a one-row view counts as
    contiguous whatever its stride), on a GPU or the CPU interpreter."""
    size = x.element_size()
    return (
        0 < x.shape[0] <= DECODE_MAX_M
        and num_cols % SWAP_BLOCK_N == 0
        and (run is None or run % SWAP_BLOCK_N == 0)
        and x.is_contiguous()
        and w.is_contiguous()
        and all(t.stride(0) * size % 16 == 0 and t.data_ptr() % 16 == 0 for t in (x, w))
    )


def swap_tiles(
    num_rows: int, num_cols: int, num_inner: int, num_sms: int, paired: bool = False, element_size: int = 2
) -> Tiles:
    """The swapped kernel's tile: tokens rounded up to a power of two (16-64), 64 weight rows, K in 128-row blocks
    (`element_size`: bytes per element, 4 for the fp32 the tests may run in), split as many ways (up to MAX_SPLIT,
    parts of at least SWAP_SPLIT_MIN_K rows) as still fits one wave, at the deepest pipeline that fits (up to
    SWAP_MAX_STAGES), or at SWAP_RESIDENT_STAGES where more programs than SMs then all fit at once, several an SM.
    `paired` (gate/up pairs): K unsplit, two weight blocks a stage. On an H200 (`bench/swap_tiles.py`) gate_up's
    172 programs at batch 8 run 8 % faster two an SM at 3 stages than as 1.3 waves at 5; splitting the others
    further, their programs sharing SMs, takes 3-9 % off each product but as much again in the kernels that add
    the parts (`bench/decode_profile.py`)."""
    block_m = max(16, triton.next_power_of_2(num_rows))
    col_tiles = triton.cdiv(num_cols, SWAP_BLOCK_N)
    stage_bytes = (block_m + SWAP_BLOCK_N * (2 if paired else 1)) * SWAP_BLOCK_K * element_size
    split = max(
        s
        for s in range(1, MAX_SPLIT + 1)
        if s == 1
        or (not paired and col_tiles * s <= num_sms and shortest_part(num_inner, s, SWAP_BLOCK_K) >= SWAP_SPLIT_MIN_K)
    )
    resident = num_sms * (SM_SHARED_BYTES // (SWAP_RESIDENT_STAGES * stage_bytes + RESERVED_BYTES))
    deepest = swap_stages(block_m, SWAP_BLOCK_N, paired, element_size)
    stages = min(SWAP_RESIDENT_STAGES, deepest) if num_sms < col_tiles * split <= resident else deepest
    return Tiles(block_m, SWAP_BLOCK_N, SWAP_BLOCK_K, num_stages=stages, split_k=split)


def swap_stages(block_m: int, block_n: int, paired: bool = False, element_size: int = 2) -> int:
    """The deepest pipeline (up to SWAP_MAX_STAGES) whose stages, each an x block and one weight block (two for a
    gate/up pair) of SWAP_BLOCK_K columns, fit in shared memory."""
    stage_bytes = (block_m + block_n * (2 if paired else 1)) * SWAP_BLOCK_K * element_size
    return min(SWAP_MAX_STAGES, SHARED_BYTES // stage_bytes)


def swap_prefetch(num_programs: int, rows: int, k_per_program: int, element_size: int, t: Tiles, ahead: bool) -> int:
    """Elements of each of its `rows` weight rows a program launched as a dependent pulls into L2 before it waits:
    `pdl.prefetch_k`'s share where it launched `ahead` (the kernels before it still run), else at most its first
    PREFETCH_BLOCKS blocks of K (the wait is about a kernel's drain)."""
    most = prefetch_k(num_programs, rows, k_per_program, element_size)
    return most if ahead else min(most, PREFETCH_BLOCKS * t.block_k)


def swap_product(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    num_cols: int,
    heads: QKVHeads | None = None,
    tiles: Tiles | None = None,
    num_sms: int | None = None,
    pdl: bool = False,
    unsummed: bool = False,
    pair: int = 0,
    ahead: bool = False,
) -> torch.Tensor:
    """x [M, K] by w [rows, K] (`swap_fits`) -> y [M, num_cols] = x W^T (+ bias), W's column c at row c, or at
    Megatron's stored row of grouped column c when `heads` are given.
    `unsummed`: [S, M, N] (fp32 partials of a K split, or [1, M, N] in x's dtype) instead of y. `pair` > 0:
    y = silu(gate) * up of w's [gate; up] blocks of `pair` rows each (K unsplit). Tiles: `tiles` (split_k set)
    or `swap_tiles`' for `num_sms` (default: the device's); hand-given tiles may be 16 or 32 weight rows wide (each
    lies within a 64-row tile that `swap_fits` checked; `bench/swap_tiles.py` times them). `pdl`, `ahead`:
    `rollplex.kernels.pdl`; launched so, each program first pulls the start of its weight rows into L2 (see the
    module docstring)."""
    run = heads.head_dim if heads else pair or None
    assert swap_fits(x, w, num_cols, run), f"x {tuple(x.shape)}, w {tuple(w.shape)}: not for swap"
    assert not (heads and pair), "the QKV row map and the gate/up pairing do not combine"
    assert not (pair and bias is not None), "a gate/up pair takes no bias (it would land after the activation)"
    assert w.shape[1] == x.shape[1], f"x is [M, {x.shape[1]}] but w is [rows, {w.shape[1]}]"
    assert bias is None or (bias.shape == (w.shape[0],) and bias.is_contiguous()), f"bias must be [{w.shape[0]}]"
    assert x.device == w.device, f"x on {x.device}, w on {w.device}"
    check_dtypes(x, w, *([] if bias is None else [bias]))
    from triton.tools.tensor_descriptor import TensorDescriptor

    (m, k), n = x.shape, num_cols
    num_sms = sm_count(x.device) if num_sms is None else num_sms
    t = tiles or swap_tiles(m, n, k, num_sms, paired=pair > 0, element_size=x.element_size())
    assert t.block_m >= m and t.split_k is not None, f"{t}: tokens must fit one tile, split_k set"
    assert SWAP_BLOCK_N % t.block_n == 0, f"{t}: swap_fits checked {SWAP_BLOCK_N}-row tiles (or their halves)"
    assert not pair or t.split_k == 1, "gate/up pairs need K unsplit (the activation needs whole sums)"
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partials = torch.empty(t.split_k, m, n, dtype=torch.float32, device=x.device) if t.split_k > 1 else y
    h = heads or QKVHeads(1, 1, 1)
    x_desc = TensorDescriptor.from_tensor(x, [t.block_m, t.block_k])
    w_desc = TensorDescriptor.from_tensor(w, [t.block_n, t.block_k])
    grid, per_split = (triton.cdiv(n, t.block_n), t.split_k), k_per_split(k, t.split_k, t)
    rows = t.block_n * (2 if pair else 1)
    prefetch = (
        {"PREFETCH_K": swap_prefetch(math.prod(grid), rows, per_split, w.element_size(), t, ahead)} if pdl else {}
    )
    swap_gemm_kernel[grid](
        x_desc, w_desc, w, w if bias is None else bias, y, partials, m, n, k,
        heads is not None, h.num_heads, h.num_kv_heads, h.head_dim, h.kv_replicas, bias is not None,
        t.block_m, t.block_n, t.block_k, t.split_k, per_split, PAIR=pair, LINE=line_elements(w),
        num_warps=t.num_warps, num_stages=t.num_stages, **pdl_options(pdl, x, ahead), **prefetch,
    )  # fmt: skip
    if unsummed:
        return partials if t.split_k > 1 else y[None]
    if t.split_k > 1:
        sum_splits(partials, y, pdl)
    return y
