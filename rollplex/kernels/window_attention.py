"""Attention within short runs of consecutive rows (the vision tower's windows), forward and backward, one program
per (run, head) holding the whole run.

`window_attention(q, k, v, bounds, longest)`: q, k, v [S, heads, D] (each row's heads contiguous, any row stride:
v is a view of the fused QKV output), the runs given by `bounds` [runs + 1] int32 (flash attention's cumulative
lengths) -> out [S, heads, D] in q's dtype, each row attending to every row of its run. Runs of at most MAX_RUN
rows (the 3B and 7B towers' windows: 64 patches at most; a longer run spills registers):
- forward: a program loads its run's q, k and v at once, computes the [run, run] scores, their softmax and the
  output, and keeps each row's log-sum-exp;
- backward: the probabilities again from the log-sum-exp, then dv, dq and dk, each input loaded just before its
  first use and each gradient stored as soon as it is made (fewer tiles live at once: no spills at 64 rows, 4
  warps; `tests/kernels/test_hopper_compile.py` checks the compiled kernels).
The head dim is padded in registers to a power of two (masked loads), never in memory; a run's heads are
consecutive programs (a row's heads are adjacent in memory). Why not flash attention's variable-length kernels,
which the tower's frames (runs of a whole frame) still take: they tile 128 rows or more whatever the run, pad the
head dim of 80 in memory and accumulate dq in FP32 through atomics, most of a 64-row window's time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.autograd.function import once_differentiable

MAX_RUN = 64  # the longest run a program holds
FORWARD_WARPS, BACKWARD_WARPS = 4, 4


@triton.jit
def _program_run(bounds_ptr, heads):
    """This program's head, and its run's first row and length."""
    run, head = tl.program_id(0) // heads, tl.program_id(0) % heads
    start = tl.load(bounds_ptr + run).to(tl.int64)
    return head, start, tl.load(bounds_ptr + run + 1).to(tl.int64) - start


@triton.jit
def _run_tile(start, length, head, D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Which of the tile's BLOCK rows lie in the run, the [BLOCK, BLOCK_D] tile's mask, each row's index [BLOCK] and
    the head's columns [1, BLOCK_D] within a row."""
    rows, cols = tl.arange(0, BLOCK), tl.arange(0, BLOCK_D)
    real = rows < length
    return real, real[:, None] & (cols < D)[None, :], start + rows, head * D + cols[None, :]


@triton.jit
def _load_tile(ptr, row, row_stride, offsets, tile):
    """The [BLOCK, BLOCK_D] tile of the rows `row` [BLOCK] (their stride `row_stride`) at the head's `offsets`."""
    return tl.load(ptr + row[:, None] * row_stride + offsets, mask=tile, other=0.0)


@triton.jit
def _forward_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, bounds_ptr, q_row, k_row, v_row, out_row, heads,
                    scale, D: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):  # fmt: skip
    head, start, length = _program_run(bounds_ptr, heads)
    if length == 0:
        return
    real, tile, row, offsets = _run_tile(start, length, head, D, BLOCK, BLOCK_D)
    q, k = _load_tile(q_ptr, row, q_row, offsets, tile), _load_tile(k_ptr, row, k_row, offsets, tile)
    v = _load_tile(v_ptr, row, v_row, offsets, tile)
    scores = tl.dot(q, tl.trans(k)) * scale  # [BLOCK, BLOCK] fp32
    scores = tl.where(real[None, :], scores, float("-inf"))
    top = tl.max(scores, axis=1)
    probs = tl.exp(scores - top[:, None])
    total = tl.sum(probs, axis=1)
    out = tl.dot(probs.to(v.dtype), v) / total[:, None]
    tl.store(out_ptr + row[:, None] * out_row + offsets, out.to(out_ptr.dtype.element_ty), mask=tile)
    tl.store(lse_ptr + row * heads + head, top + tl.log(total), mask=real)


@triton.jit
def _backward_kernel(q_ptr, k_ptr, v_ptr, out_ptr, grad_ptr, lse_ptr, bounds_ptr, dq_ptr, dk_ptr, dv_ptr, q_row,
                     k_row, v_row, out_row, grad_row, heads, scale, D: tl.constexpr, BLOCK: tl.constexpr,
                     BLOCK_D: tl.constexpr):  # fmt: skip
    head, start, length = _program_run(bounds_ptr, heads)
    if length == 0:
        return
    real, tile, row, offsets = _run_tile(start, length, head, D, BLOCK, BLOCK_D)
    at = row[:, None]
    q = _load_tile(q_ptr, row, q_row, offsets, tile)
    k = _load_tile(k_ptr, row, k_row, offsets, tile)
    lse = tl.load(lse_ptr + row * heads + head, mask=real, other=0.0)
    scores = tl.dot(q, tl.trans(k)) * scale
    probs = tl.where(real[None, :] & real[:, None], tl.exp(scores - lse[:, None]), 0.0)  # [query, key]
    grad = _load_tile(grad_ptr, row, grad_row, offsets, tile)
    dv = tl.dot(tl.trans(probs.to(grad.dtype)), grad)
    tl.store(dv_ptr + at * heads * D + offsets, dv.to(dv_ptr.dtype.element_ty), mask=tile)
    v = _load_tile(v_ptr, row, v_row, offsets, tile)
    dprobs = tl.dot(grad, tl.trans(v))
    out = _load_tile(out_ptr, row, out_row, offsets, tile)
    delta = tl.sum(grad.to(tl.float32) * out.to(tl.float32), axis=1)  # sum_j p_j dp_j = do . o
    dscores = (probs * (dprobs - delta[:, None]) * scale).to(q.dtype)
    dq = tl.dot(dscores, k)
    tl.store(dq_ptr + at * heads * D + offsets, dq.to(dq_ptr.dtype.element_ty), mask=tile)
    dk = tl.dot(tl.trans(dscores), q)
    tl.store(dk_ptr + at * heads * D + offsets, dk.to(dk_ptr.dtype.element_ty), mask=tile)


def _rows_of_heads(x: Tensor) -> Tensor:
    """x [S, heads, D] with each row's heads contiguous (a row stride of its own), else a contiguous copy."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def _launch(bounds: Tensor, longest: int, heads: int, d: int) -> dict:
    block = max(16, triton.next_power_of_2(longest))
    return dict(grid=((bounds.numel() - 1) * heads,), D=d, BLOCK=block, BLOCK_D=max(16, triton.next_power_of_2(d)))


class _WindowAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bounds: Tensor, longest: int) -> Tensor:
        q, k, v = (_rows_of_heads(x) for x in (q, k, v))
        rows, heads, d = q.shape
        out = torch.empty(rows, heads, d, dtype=q.dtype, device=q.device)
        lse = torch.empty(rows, heads, dtype=torch.float32, device=q.device)
        launch = _launch(bounds, longest, heads, d)
        grid = launch.pop("grid")
        if rows:
            _forward_kernel[grid](
                q, k, v, out, lse, bounds, q.stride(0), k.stride(0), v.stride(0), out.stride(0), heads, d**-0.5,
                num_warps=FORWARD_WARPS, **launch,
            )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse, bounds)
        ctx.longest = longest
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse, bounds = ctx.saved_tensors
        grad = _rows_of_heads(grad)
        rows, heads, d = q.shape
        dq, dk, dv = (torch.empty(rows, heads, d, dtype=q.dtype, device=q.device) for _ in range(3))
        launch = _launch(bounds, ctx.longest, heads, d)
        grid = launch.pop("grid")
        if rows:
            _backward_kernel[grid](
                q, k, v, out, grad, lse, bounds, dq, dk, dv, q.stride(0), k.stride(0), v.stride(0), out.stride(0),
                grad.stride(0), heads, d**-0.5, num_warps=BACKWARD_WARPS, **launch,
            )  # fmt: skip
        return dq, dk, dv, None, None


def window_attention(q: Tensor, k: Tensor, v: Tensor, bounds: Tensor, longest: int) -> Tensor:
    """Attention within the runs `bounds` [runs + 1] int32 of at most `longest` <= MAX_RUN rows each
    (`vision_layout.segment_bounds` gives both): q, k, v [S, heads, D] of one dtype -> [S, heads, D] (see the
    module)."""
    if longest > MAX_RUN:
        raise ValueError(f"runs of up to {longest} rows: window_attention takes at most {MAX_RUN}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v of one dtype, not {q.dtype}, {k.dtype} and {v.dtype}")
    return _WindowAttention.apply(q, k, v, bounds, longest)
