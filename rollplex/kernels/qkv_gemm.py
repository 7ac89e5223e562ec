"""Fused QKV projection that reads Megatron's interleaved weight in place and writes vLLM's grouped output.

Case 3 of DESIGN.md section 5 without the copy: W is stored per query group ([q heads of g; k_g; v_g], head_dim
rows each, `rollplex.layout.sharing.qkv_megatron`); the rollout attention wants y = x W_grouped^T + b_grouped
with columns [all q | all k | all v] (`qkv_vllm`). Each program computes, for its output column tile, which
stored rows to load (the closed form of `qkv_layout.grouped_rows`), so the permuted weight never exists.
The bias is stored like the weight and read through the same index. Decode rows take `swap_gemm`'s kernel where
it fits (whole 64-column tiles within a head), which applies the same map to each tile's first row; other rows,
and tiles given by hand, take this module's kernel, whose launch follows `tiles.wave_parts` (as in
`transposed_gemm`). In a K split the first part adds the bias. Does not split heads or apply rope.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollplex.kernels.qkv_layout import num_stored_rows
from rollplex.kernels.swap_gemm import QKVHeads, stored_rows, swap_fits, swap_product
from rollplex.kernels.tiles import (
    Tiles,
    check_dtypes,
    k_per_split,
    launch_in_parts,
    num_programs,
    tile_position,
    zero_tile,
)


@triton.jit
def qkv_gemm_kernel(
    x_ptr,  # [M, K] row-major
    w_ptr,  # [num_stored_rows, K] row-major, Megatron order
    b_ptr,  # [num_stored_rows] Megatron order, or a dummy when not HAS_BIAS
    y_ptr,  # [M, N] row-major, vLLM order
    p_ptr,  # [SPLIT_K, M, N] fp32 partials when SPLIT_K > 1 (else unused)
    M,
    K: tl.constexpr,  # constexpr: see transposed_gemm_kernel
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_REP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,  # programs per output tile along K (axis 1 of the grid)
    K_SPLIT: tl.constexpr,  # K per split, a multiple of BLOCK_K (K rounded up to one when SPLIT_K == 1)
):
    N: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    pid_m, pid_n = tile_position(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    src = stored_rows(cols, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, KV_REP)  # [BLOCK_N] rows of W to read
    first = tl.program_id(1) * K_SPLIT
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + rows[:, None].to(tl.int64) * K + (first + ks)[None, :]  # [BLOCK_M, BLOCK_K]
    w_tile = w_ptr + src[None, :].to(tl.int64) * K + (first + ks)[:, None]  # [BLOCK_K, BLOCK_N]: W[src]^T
    acc = zero_tile(BLOCK_M, BLOCK_N)
    for k0 in range(0, K_SPLIT, BLOCK_K):
        if K == K_SPLIT * SPLIT_K and N % BLOCK_N == 0:  # compile-time: no K or column masks, only the row one
            a = tl.load(x_tile, mask=rows[:, None] < M, other=0.0)
            b = tl.load(w_tile)
        else:
            left = K - first - k0
            a = tl.load(x_tile, mask=(rows[:, None] < M) & (ks[None, :] < left), other=0.0)
            b = tl.load(w_tile, mask=(ks[:, None] < left) & (cols[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    if HAS_BIAS:  # in the first part of a split only (times 1 or 0: exact for a finite bias)
        bias = tl.load(b_ptr + src, mask=cols < N, other=0.0).to(tl.float32)
        acc += bias[None, :] * (tl.program_id(1) == 0).to(tl.float32)
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT_K == 1:
        tl.store(y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=inside)
    else:
        p_tile = p_ptr + tl.program_id(1).to(tl.int64) * M * N + rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(p_tile, acc, mask=inside)


def qkv_grouped_from_megatron(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_replicas: int = 1,
    tiles: Tiles | None = None,
    num_sms: int | None = None,
    swap: bool | None = None,
) -> torch.Tensor:
    """x: [M, H]; w: [num_stored_rows, H] and bias: [num_stored_rows] in Megatron order (heads local to the shard;
    kv_replicas > 1 when consecutive stored groups repeat a KV head) -> [M, (num_heads + 2 * num_kv_heads) * d]
    in vLLM order. `num_sms`: the SMs the waves are planned for (default: the device's). `swap`: True takes
    `swap_gemm`'s kernel (with `tiles`, if given, as its tiles), False this module's (with `tiles`), None the
    former where it fits (`swap_fits`) unless `tiles` are given."""
    stored = num_stored_rows(num_heads, num_kv_heads, head_dim, kv_replicas)
    assert num_heads % (num_kv_heads * kv_replicas) == 0, f"{num_heads} q heads vs {num_kv_heads}x{kv_replicas} groups"
    assert x.dim() == 2 and x.is_contiguous(), f"x must be a contiguous [M, H], got {tuple(x.shape)}"
    assert w.shape == (stored, x.shape[1]), f"w must be Megatron-order [{stored}, {x.shape[1]}], got {tuple(w.shape)}"
    assert w.is_contiguous(), "w must be the contiguous stored [rows, H] tensor (not a transposed view)"
    assert bias is None or (bias.shape == (stored,) and bias.is_contiguous()), f"bias must be a contiguous [{stored}]"
    assert x.device == w.device, f"x on {x.device}, w on {w.device}"
    check_dtypes(x, w, *([] if bias is None else [bias]))
    (m, k), n = x.shape, (num_heads + 2 * num_kv_heads) * head_dim
    if swap or (swap is None and tiles is None and swap_fits(x, w, n, head_dim)):
        heads = QKVHeads(num_heads, num_kv_heads, head_dim, kv_replicas)
        return swap_product(x, w, bias, n, heads, tiles, num_sms)

    def launch(rows: torch.Tensor, out: torch.Tensor, partials: torch.Tensor, t: Tiles) -> None:
        qkv_gemm_kernel[(num_programs(rows.shape[0], n, t), t.split_k)](
            rows, w, w if bias is None else bias, out, partials, rows.shape[0], k, num_heads, num_kv_heads, head_dim,
            kv_replicas, bias is not None, t.block_m, t.block_n, t.block_k, t.group_m, t.split_k,
            k_per_split(k, t.split_k, t), num_warps=t.num_warps, num_stages=t.num_stages,
        )  # fmt: skip

    return launch_in_parts(x, torch.empty(m, n, dtype=x.dtype, device=x.device), tiles, num_sms, launch)
