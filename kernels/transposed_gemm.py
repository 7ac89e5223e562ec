"""y = x W^T (+ bias) reading W as it is stored: transposed (DESIGN.md section 5, Case 2) or as HF stores it.

W is logically [O, I]. The trainer stores a row-parallel weight (o_proj, down_proj) as S = W^T = [I, O]
contiguous, so that each training shard of the I axis is a contiguous slab and a rollout shard is q slabs back
to back (`matmul_transposed`); a full model's projections are HF's [O, I] (`linear`, with its bias: the decode
step's GEMMs, where a chain of our kernels can launch as programmatic dependents). One kernel reads S[i, o] at
i * S_ROW + o * S_COL for either, bf16 in, fp32 accumulation, bf16 out. A launch follows `tiles.wave_parts`:
decode tiles may cut K over several programs (`pick_tiles`), and prefill rows short of a whole wave take
narrower tiles and, if still short, a K split; each part of a split writes an fp32 partial that `sum_splits`
adds in order. It does not shard, bind or all-reduce; the caller passes the slab its rank holds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollplex.kernels.tiles import (
    Tiles,
    check_dtypes,
    k_per_split,
    launch_in_parts,
    num_programs,
    pdl_options,
    tile_position,
    zero_tile,
)


@triton.jit
def transposed_gemm_kernel(
    x_ptr,  # [M, K] row-major
    s_ptr,  # [K, N] = W^T, element (k, n) at k * S_ROW + n * S_COL
    b_ptr,  # [N] bias, or a dummy when not HAS_BIAS
    y_ptr,  # [M, N] row-major
    p_ptr,  # [SPLIT_K, M, N] fp32 partials when SPLIT_K > 1 (else unused)
    M,
    N: tl.constexpr,  # constexpr (a model's shape): tiles that divide it load without a column mask
    K: tl.constexpr,  # constexpr: the trip count is known, and triton 3.6's interpreter cannot range() a runtime int
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_K: tl.constexpr,  # programs per output tile along K (axis 1 of the grid)
    K_SPLIT: tl.constexpr,  # K per split, a multiple of BLOCK_K (K rounded up to one when SPLIT_K == 1)
    S_ROW: tl.constexpr,  # strides of s: (N, 1) for a stored [K, N] slab, (1, K) for HF's [N, K] weight
    S_COL: tl.constexpr,
    HAS_BIAS: tl.constexpr = False,
    USE_GDC: tl.constexpr = False,  # launched as a programmatic dependent of the kernel before it (`pdl`)
):
    pid_m, pid_n = tile_position(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    first = tl.program_id(1) * K_SPLIT
    if USE_GDC:  # x may be the last kernel's output: wait for it, and let the next kernel launch meanwhile
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + rows[:, None].to(tl.int64) * K + (first + ks)[None, :]  # [BLOCK_M, BLOCK_K]
    s_tile = s_ptr + (first + ks)[:, None].to(tl.int64) * S_ROW + cols[None, :].to(tl.int64) * S_COL
    acc = zero_tile(BLOCK_M, BLOCK_N)
    for k0 in range(0, K_SPLIT, BLOCK_K):
        if K == K_SPLIT * SPLIT_K and N % BLOCK_N == 0:  # compile-time: no K or column masks, only the row one
            a = tl.load(x_tile, mask=rows[:, None] < M, other=0.0)
            b = tl.load(s_tile)
        else:
            left = K - first - k0
            a = tl.load(x_tile, mask=(rows[:, None] < M) & (ks[None, :] < left), other=0.0)
            b = tl.load(s_tile, mask=(ks[:, None] < left) & (cols[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        x_tile += BLOCK_K
        s_tile += BLOCK_K * S_ROW
    if HAS_BIAS:  # in the first part of a split only (times 1 or 0: exact for a finite bias)
        bias = tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        acc += bias[None, :] * (tl.program_id(1) == 0).to(tl.float32)
    y_tile = y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    if SPLIT_K == 1:
        tl.store(y_tile, acc.to(y_ptr.dtype.element_ty), mask=inside)
    else:
        p_tile = p_ptr + tl.program_id(1).to(tl.int64) * M * N + rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(p_tile, acc, mask=inside)


def matmul_transposed(
    x: torch.Tensor,
    s: torch.Tensor,
    tiles: Tiles | None = None,
    num_sms: int | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """x: [M, I], s: [I, O] = W^T, both contiguous, same dtype -> y = x W^T: [M, O] in that dtype. `num_sms`:
    the SMs the waves are planned for (default: the device's). `pdl`: each launch is a programmatic dependent
    launch (Hopper): it may start while the kernel before it drains, and waits for that kernel's writes before
    it reads anything (the overlap needs the kernel before to be launched so too: bench/pdl_chain.py)."""
    assert x.dim() == 2 and s.dim() == 2, f"expected x [M, I] and s [I, O], got {tuple(x.shape)}, {tuple(s.shape)}"
    assert x.shape[1] == s.shape[0], f"x is [M, {x.shape[1]}] but s is [{s.shape[0]}, O]: pass W^T stored [I, O]"
    assert s.is_contiguous(), "s must be the contiguous stored [I, O] slab"
    return _product(x, s, None, (s.shape[1], 1), tiles, num_sms, pdl)


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: Tiles | None = None,
    num_sms: int | None = None,
    pdl: bool = False,
) -> torch.Tensor:
    """F.linear with our kernel: x [M, I], w [O, I] contiguous (HF's layout), bias [O] -> [M, O] in x's dtype.
    `num_sms`, `pdl`: see `matmul_transposed`."""
    assert x.dim() == 2 and w.dim() == 2, f"expected x [M, I] and w [O, I], got {tuple(x.shape)}, {tuple(w.shape)}"
    assert x.shape[1] == w.shape[1], f"x is [M, {x.shape[1]}] but w is [O, {w.shape[1]}]"
    assert w.is_contiguous(), "w must be a contiguous [O, I]"
    assert bias is None or (bias.shape == (w.shape[0],) and bias.is_contiguous()), f"bias must be [{w.shape[0]}]"
    return _product(x, w.T, bias, (1, w.shape[1]), tiles, num_sms, pdl)


def _product(
    x: torch.Tensor,
    s: torch.Tensor,
    bias: torch.Tensor | None,
    strides: tuple[int, int],
    tiles: Tiles | None,
    num_sms: int | None,
    pdl: bool,
) -> torch.Tensor:
    """y = x @ s (+ bias) for s [K, N] at `strides` (see the kernel)."""
    assert x.is_contiguous(), "x must be contiguous"
    assert x.device == s.device, f"x on {x.device}, the weight on {s.device}"
    check_dtypes(x, s, *([] if bias is None else [bias]))
    (m, k), n = x.shape, s.shape[1]

    def launch(rows: torch.Tensor, out: torch.Tensor, partials: torch.Tensor, t: Tiles) -> None:
        transposed_gemm_kernel[(num_programs(rows.shape[0], n, t), t.split_k)](
            rows, s, s if bias is None else bias, out, partials, rows.shape[0], n, k, t.block_m, t.block_n, t.block_k,
            t.group_m, t.split_k, k_per_split(k, t.split_k, t), *strides, bias is not None,
            num_warps=t.num_warps, num_stages=t.num_stages, **pdl_options(pdl, x),
        )  # fmt: skip

    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    return launch_in_parts(x, y, tiles, num_sms, launch, pdl, n_contiguous=strides[1] == 1)
