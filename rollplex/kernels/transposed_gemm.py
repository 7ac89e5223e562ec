"""y = x W^T (+ bias) reading W as it is stored: transposed (DESIGN.md section 5, Case 2) or as HF stores it.

W is logically [O, I]. The trainer stores a row-parallel weight (o_proj, down_proj) as S = W^T = [I, O]
contiguous, so that each training shard of the I axis is a contiguous slab and a rollout shard is q slabs back
to back (`matmul_transposed`); a full model's projections are HF's [O, I] (`linear`, with its bias: the decode
step's GEMMs, where a chain of our kernels can launch as programmatic dependents). At decode rows an HF weight
goes to `swap_gemm` where it fits (y^T = W x^T from TMA-loaded tiles); everything else takes this module's
kernel, which reads S[i, o] at i * S_ROW + o * S_COL for either layout, bf16 in, fp32 accumulation, bf16 out.
A launch of it follows `tiles.wave_parts`:
decode tiles may cut K over several programs (`pick_tiles`), and prefill rows short of a whole wave take
narrower tiles and, if still short, a K split; each part of a split writes an fp32 partial that `sum_splits`
adds in order. It does not shard, bind or all-reduce; the caller passes the slab its rank holds.

Two decode variants save the step a launch each (`rollplex.rollout.weights`, fused kernels):
- `linear_parts` / `matmul_transposed_parts` leave a K split's partials unsummed, for the kernel that reads the
  product next to add in split order (`rollplex.kernels.decode_ops`), bitwise what `sum_splits` would give it;
- `gate_up_silu` computes silu(gate) * up of a packed [gate; up] projection: each program accumulates an output
  tile's gate columns and its up columns side by side and applies the activation before it stores, rounded
  after each op as `decode_ops.silu_mul` does.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from rollplex.kernels.pdl import enter, leave, pdl_options
from rollplex.kernels.swap_gemm import swap_fits, swap_product, swap_tiles
from rollplex.kernels.tiles import (
    DECODE_MAX_M,
    Tiles,
    check_dtypes,
    k_per_split,
    launch_in_parts,
    num_programs,
    pick_tiles,
    sm_count,
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
    PAIR: tl.constexpr = 0,  # > 0: y = silu(gate) * up, output column c from W rows g(c) and g(c) + PAIR (below)
    AHEAD: tl.constexpr = False,  # `pdl.enter`
):
    pid_m, pid_n = tile_position(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    first = tl.program_id(1) * K_SPLIT
    enter(USE_GDC, AHEAD)  # x may be the last kernel's output: wait for it, and let the next kernel launch meanwhile
    leave(USE_GDC, AHEAD)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # PAIR > 0: W holds blocks of PAIR gate rows then PAIR up rows; column c's gate row is g(c), its up row g(c) + PAIR
    w_cols = (cols // PAIR) * (2 * PAIR) + cols % PAIR if PAIR > 0 else cols
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + rows[:, None].to(tl.int64) * K + (first + ks)[None, :]  # [BLOCK_M, BLOCK_K]
    s_tile = s_ptr + (first + ks)[:, None].to(tl.int64) * S_ROW + w_cols[None, :].to(tl.int64) * S_COL
    acc = zero_tile(BLOCK_M, BLOCK_N)
    up = zero_tile(BLOCK_M, BLOCK_N)  # the up columns' sums (PAIR > 0)
    for k0 in range(0, K_SPLIT, BLOCK_K):
        if K == K_SPLIT * SPLIT_K and N % BLOCK_N == 0:  # compile-time: no K or column masks, only the row one
            a = tl.load(x_tile, mask=rows[:, None] < M, other=0.0)
            b = tl.load(s_tile)
            if PAIR > 0:
                b_up = tl.load(s_tile + PAIR * S_COL)
        else:
            left = K - first - k0
            a = tl.load(x_tile, mask=(rows[:, None] < M) & (ks[None, :] < left), other=0.0)
            b = tl.load(s_tile, mask=(ks[:, None] < left) & (cols[None, :] < N), other=0.0)
            if PAIR > 0:
                b_up = tl.load(s_tile + PAIR * S_COL, mask=(ks[:, None] < left) & (cols[None, :] < N), other=0.0)
        acc = tl.dot(a, b, acc)
        if PAIR > 0:
            up = tl.dot(a, b_up, up)
        x_tile += BLOCK_K
        s_tile += BLOCK_K * S_ROW
    if PAIR > 0:  # silu(gate) * up, each op rounded to the output dtype as `decode_ops.silu_mul` rounds it
        gate = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(y_ptr.dtype.element_ty).to(tl.float32)
        acc = act * up.to(y_ptr.dtype.element_ty).to(tl.float32)
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
    it reads anything (the overlap needs the kernel before to be launched so too)."""
    _check_slab(x, s)
    return _product(x, s, None, (s.shape[1], 1), tiles, num_sms, pdl)


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: Tiles | None = None,
    num_sms: int | None = None,
    pdl: bool = False,
    swap: bool = True,
    split: bool = True,
) -> torch.Tensor:
    """F.linear with our kernel: x [M, I], w [O, I] contiguous (HF's layout), bias [O] -> [M, O] in x's dtype.
    `num_sms`, `pdl`: see `matmul_transposed`. Decode rows take `swap_gemm`'s kernel where it fits, unless
    `tiles` are given or `swap` is off (this module's kernel: a [gate; up] weight whose `gate_up_silu` cannot
    swap, `gate_up_swaps`); there `split` off reads K in one part, as `gate_up_silu` does."""
    _check_hf(x, w, bias)
    if swap and tiles is None and swap_fits(x, w, w.shape[0]):
        if split:
            return swap_product(x, w, bias, w.shape[0], num_sms=num_sms, pdl=pdl)
        num_sms = sm_count(x.device) if num_sms is None else num_sms
        whole = swap_tiles(x.shape[0], w.shape[0], w.shape[1], num_sms, element_size=x.element_size())
        return swap_product(x, w, bias, w.shape[0], tiles=replace(whole, split_k=1), pdl=pdl)
    return _product(x, w.T, bias, (1, w.shape[1]), tiles, num_sms, pdl)


def linear_parts(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    num_sms: int | None = None,
    pdl: bool = False,
    ahead: bool = False,
) -> torch.Tensor:
    """`linear` left unsummed for the kernel that reads it next: [S, M, O] fp32 partials of a K split (S > 1, in
    split order, the bias in the first) or [1, M, O] in x's dtype, one launch at decode rows (M <= DECODE_MAX_M;
    more rows give `linear`'s product as [1, M, O]). Through `swap_gemm` where `linear` takes it. `ahead`: launched
    so (`rollplex.kernels.pdl`), and the swapped kernel pulls its weights' first blocks into L2 while it waits."""
    _check_hf(x, w, bias)
    if swap_fits(x, w, w.shape[0]):
        return swap_product(x, w, bias, w.shape[0], num_sms=num_sms, pdl=pdl, unsummed=True, ahead=ahead)
    return _parts(x, w.T, bias, (1, w.shape[1]), num_sms, pdl, ahead)


def matmul_transposed_parts(
    x: torch.Tensor, s: torch.Tensor, num_sms: int | None = None, pdl: bool = False, ahead: bool = False
) -> torch.Tensor:
    """`matmul_transposed` left unsummed (see `linear_parts`)."""
    _check_slab(x, s)
    return _parts(x, s, None, (s.shape[1], 1), num_sms, pdl, ahead)


def gate_up_silu(
    x: torch.Tensor,
    w: torch.Tensor,
    block_rows: int,
    num_sms: int | None = None,
    pdl: bool = False,
    ahead: bool = False,
) -> torch.Tensor:
    """silu(x G^T) * (x U^T) in one launch: w [blocks * 2 * block_rows, I] contiguous holds per block its gate
    rows, then its up rows (HF's packed [gate; up] is one block; a TP layer's `gate_up` one per training rank)
    -> [M, blocks * block_rows]. Tiles: `gate_up_tiles` (K never split: a program must hold both sums whole
    before the activation). Bitwise what `linear(..., swap=gate_up_swaps(...), split=False)` then `silu_mul` give
    where `linear`'s own kernel does not split K either, which holds for every shipped model's decode shapes at the
    TP degrees it allows (a test checks that); where it would split, the two round differently (within bf16
    rounding).
    Through `swap_gemm` where `gate_up_swaps`. `ahead`: as `linear_parts`."""
    _check_hf(x, w)
    assert w.shape[0] % (2 * block_rows) == 0, f"w {tuple(w.shape)}: not [gate; up] blocks"
    _check(x, w)
    (m, k), n = x.shape, w.shape[0] // 2
    if gate_up_swaps(x, w, block_rows):
        return swap_product(x, w, None, n, num_sms=num_sms, pdl=pdl, pair=block_rows, ahead=ahead)
    tiles = gate_up_tiles(m, n, k, sm_count(x.device) if num_sms is None else num_sms)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        _launch(x, w.T, None, (1, k), y, y, tiles, pdl, pair=block_rows, ahead=ahead)
    return y


def gate_up_swaps(x: torch.Tensor, w: torch.Tensor, block_rows: int) -> bool:
    """Whether `gate_up_silu` reads [gate; up] blocks of `block_rows` rows through `swap_gemm` (each 64-row tile
    within one gate or up half). The unfused path passes it to `linear` as `swap` (with `split` off), so that
    both products come from the same kernel and agree bitwise."""
    return swap_fits(x, w, w.shape[0] // 2, block_rows)


def gate_up_tiles(num_rows: int, num_cols: int, num_inner: int, num_sms: int) -> Tiles:
    """`gate_up_silu`'s tile for num_cols output columns: `pick_tiles`' for the 2 * num_cols rows of W, half as wide
    (each program reads as many W rows as there, but at least 16 columns of each half), K unsplit."""
    whole = pick_tiles(num_rows, 2 * num_cols, num_inner, num_sms)
    return replace(whole, block_n=max(16, whole.block_n // 2), split_k=1)


def _check_slab(x: torch.Tensor, s: torch.Tensor) -> None:
    """x [M, I] and a stored [I, O] slab."""
    assert x.dim() == 2 and s.dim() == 2, f"expected x [M, I] and s [I, O], got {tuple(x.shape)}, {tuple(s.shape)}"
    assert x.shape[1] == s.shape[0], f"x is [M, {x.shape[1]}] but s is [{s.shape[0]}, O]: pass W^T stored [I, O]"
    assert s.is_contiguous(), "s must be the contiguous stored [I, O] slab"


def _check_hf(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """x [M, I], HF's contiguous [O, I] weight and its bias [O]."""
    assert x.dim() == 2 and w.dim() == 2, f"expected x [M, I] and w [O, I], got {tuple(x.shape)}, {tuple(w.shape)}"
    assert x.shape[1] == w.shape[1], f"x is [M, {x.shape[1]}] but w is [O, {w.shape[1]}]"
    assert w.is_contiguous(), "w must be a contiguous [O, I]"
    assert bias is None or (bias.shape == (w.shape[0],) and bias.is_contiguous()), f"bias must be [{w.shape[0]}]"


def _check(x: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    assert x.is_contiguous(), "x must be contiguous"
    assert x.device == s.device, f"x on {x.device}, the weight on {s.device}"
    check_dtypes(x, s, *([] if bias is None else [bias]))


def _launch(
    x: torch.Tensor,
    s: torch.Tensor,
    bias: torch.Tensor | None,
    strides: tuple[int, int],
    out: torch.Tensor,
    partials: torch.Tensor,
    t: Tiles,
    pdl: bool,
    pair: int = 0,
    ahead: bool = False,
) -> None:
    """One launch over x's rows: out = x @ s (+ bias), or its split's partials (t.split_k > 1)."""
    (m, k), n = x.shape, out.shape[-1]
    transposed_gemm_kernel[(num_programs(m, n, t), t.split_k)](
        x, s, s if bias is None else bias, out, partials, m, n, k, t.block_m, t.block_n, t.block_k,
        t.group_m, t.split_k, k_per_split(k, t.split_k, t), *strides, bias is not None, PAIR=pair,
        num_warps=t.num_warps, num_stages=t.num_stages, **pdl_options(pdl, x, ahead),
    )  # fmt: skip


def _parts(
    x: torch.Tensor,
    s: torch.Tensor,
    bias: torch.Tensor | None,
    strides: tuple[int, int],
    num_sms: int | None,
    pdl: bool,
    ahead: bool = False,
) -> torch.Tensor:
    """x @ s (+ bias) for s [K, N] at `strides`, unsummed (see `linear_parts`)."""
    (m, k), n = x.shape, s.shape[1]
    if m > DECODE_MAX_M or m == 0:
        return _product(x, s, bias, strides, None, num_sms, pdl)[None]
    _check(x, s, bias)
    t = pick_tiles(m, n, k, sm_count(x.device) if num_sms is None else num_sms, n_contiguous=strides[1] == 1)
    parts = torch.empty(t.split_k, m, n, dtype=x.dtype if t.split_k == 1 else torch.float32, device=x.device)
    _launch(x, s, bias, strides, parts[0], parts, t, pdl, ahead=ahead)
    return parts


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
    _check(x, s, bias)
    y = torch.empty(x.shape[0], s.shape[1], dtype=x.dtype, device=x.device)

    def launch(rows: torch.Tensor, out: torch.Tensor, partials: torch.Tensor, t: Tiles) -> None:
        _launch(rows, s, bias, strides, out, partials, t, pdl)

    return launch_in_parts(x, y, tiles, num_sms, launch, pdl, n_contiguous=strides[1] == 1)
