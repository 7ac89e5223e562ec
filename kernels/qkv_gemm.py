"""Fused QKV projection that reads Megatron's interleaved weight in place and writes vLLM's grouped output.

Case 3 of DESIGN.md section 5 without the copy: W is stored per query group ([q heads of g; k_g; v_g], head_dim
rows each, `rollplex.memory.sharing.qkv_megatron`); the rollout attention wants y = x W_grouped^T + b_grouped
with columns [all q | all k | all v] (`qkv_vllm`). Each program computes, for its output column tile, which
stored rows to load (the closed form of `qkv_layout.grouped_rows`), so the permuted weight never exists.
The bias is stored like the weight and read through the same index. Does not split heads or apply rope.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollplex.kernels.qkv_layout import num_stored_rows
from rollplex.kernels.tiles import Tiles, check_dtypes, num_programs, pick_tiles, tile_position, zero_tile


@triton.jit
def stored_rows(
    cols, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, KV_REP: tl.constexpr
):
    """Stored (Megatron) row of each grouped (vLLM) output column; the same formula as `grouped_rows`."""
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
def qkv_gemm_kernel(
    x_ptr,  # [M, K] row-major
    w_ptr,  # [num_stored_rows, K] row-major, Megatron order
    b_ptr,  # [num_stored_rows] Megatron order, or a dummy when not HAS_BIAS
    y_ptr,  # [M, N] row-major, vLLM order
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
):
    N: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    pid_m, pid_n = tile_position(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    src = stored_rows(cols, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, KV_REP)  # [BLOCK_N] rows of W to read
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]  # [BLOCK_M, BLOCK_K]
    w_tile = w_ptr + src[None, :].to(tl.int64) * K + ks[:, None]  # [BLOCK_K, BLOCK_N]: W[src]^T, K contiguous
    acc = zero_tile(BLOCK_M, BLOCK_N)
    for k0 in range(0, K, BLOCK_K):
        if K % BLOCK_K == 0 and N % BLOCK_N == 0:  # compile-time: no K or column masks, only the row one
            a = tl.load(x_tile, mask=rows[:, None] < M, other=0.0)
            b = tl.load(w_tile)
        else:
            a = tl.load(x_tile, mask=(rows[:, None] < M) & (ks[None, :] < K - k0), other=0.0)
            b = tl.load(w_tile, mask=(ks[:, None] < K - k0) & (cols[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + src, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    y_tile = y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(y_tile, acc.to(y_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def qkv_grouped_from_megatron(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_replicas: int = 1,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """x: [M, H]; w: [num_stored_rows, H] and bias: [num_stored_rows] in Megatron order (heads local to the shard;
    kv_replicas > 1 when consecutive stored groups repeat a KV head) -> [M, (num_heads + 2 * num_kv_heads) * d]
    in vLLM order."""
    stored = num_stored_rows(num_heads, num_kv_heads, head_dim, kv_replicas)
    assert num_heads % (num_kv_heads * kv_replicas) == 0, f"{num_heads} q heads vs {num_kv_heads}x{kv_replicas} groups"
    assert x.dim() == 2 and x.is_contiguous(), f"x must be a contiguous [M, H], got {tuple(x.shape)}"
    assert w.shape == (stored, x.shape[1]), f"w must be Megatron-order [{stored}, {x.shape[1]}], got {tuple(w.shape)}"
    assert w.is_contiguous(), "w must be the contiguous stored [rows, H] tensor (not a transposed view)"
    assert bias is None or (bias.shape == (stored,) and bias.is_contiguous()), f"bias must be a contiguous [{stored}]"
    assert x.device == w.device, f"x on {x.device}, w on {w.device}"
    check_dtypes(x, w, *([] if bias is None else [bias]))
    m, n = x.shape[0], (num_heads + 2 * num_kv_heads) * head_dim
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    t = tiles or pick_tiles(m, n, x.shape[1])
    assert t.split_k == 1, "the fused QKV GEMM does not split K"
    qkv_gemm_kernel[(num_programs(m, n, t),)](
        x, w, w if bias is None else bias, y, m, x.shape[1], num_heads, num_kv_heads, head_dim, kv_replicas,
        bias is not None, t.block_m, t.block_n, t.block_k, t.group_m, num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    return y
