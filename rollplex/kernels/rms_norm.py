"""RMSNorm for the training half on a GPU: one kernel forward, one backward, for any number of rows.

`rms_norm(x, weight, eps)` -> weight * (x32 * r).to(x.dtype), r = rsqrt(mean(x32^2) + eps) over the last dimension
(HF's Qwen2 norm, `models.layers.rms_norm`), with its autograd:
- forward: a program per block of rows reads them once and writes y and r [M] float32, which backward keeps with x
  and the weight.
- backward: a fixed number of programs (a few per SM), each over one run of rows, reads x, dy and r once, writes dx
  in x's dtype and its own partial of dW in float32; torch sums the partials. With n = x32 r and c the gradient
  that reaches the cast (dy w rounded to x's dtype, as autograd rounds it): dx = r (c - n mean(c n)),
  dW = sum over rows of dy n.to(x.dtype).
Inductor's kernels for the same chain, compiled for any length (the length an unbacked symbol, so that no batch
length compiles it again), sum the weight's gradient over the rows in a kernel of its own that reads x and dy
again, and split the forward in two; here every tensor is read once each way. The values equal eager torch's
within float32 rounding (the sums run in another order). A CPU test runs the kernels under Triton's interpreter.

The row counts are not specialized (`do_not_specialize`): Triton compiles a variant of a kernel for each integer
argument equal to 1 or divisible by 16, so a length batch of a new kind (a few short responses: one row a
backward program) would compile in the middle of a step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

TILE = 4096  # elements a program holds per tile: rows of a few thousand columns, a few at a time
PROGRAMS_PER_SM = 4  # backward's programs: enough loads in flight to stream at bandwidth, few partials to sum


@triton.jit(do_not_specialize=["rows"])
def _forward_kernel(
    x_ptr, w_ptr, y_ptr, r_ptr, rows, eps,
    N: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    lines = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row, cols = lines[:, None], tl.arange(0, BLOCK_N)[None, :]
    mask = (row < rows) & (cols < N)
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    r = tl.rsqrt(tl.sum(x32 * x32, 1) / N + eps)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
    y = w.to(tl.float32) * (x32 * r[:, None]).to(x.dtype).to(tl.float32)
    tl.store(y_ptr + row * N + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(r_ptr + lines, r, mask=lines < rows)


@triton.jit(do_not_specialize=["rows", "rows_per_program"])
def _backward_kernel(
    x_ptr, w_ptr, r_ptr, dy_ptr, dx_ptr, dw_ptr, rows, rows_per_program,
    N: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    program = tl.program_id(0)
    columns = tl.arange(0, BLOCK_N)
    cols = columns[None, :]
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
    dw = tl.zeros((ROWS, BLOCK_N), tl.float32)
    start = program.to(tl.int64) * rows_per_program
    end = tl.minimum(start + rows_per_program, rows)
    for first in range(start, end, ROWS):
        row = first + tl.arange(0, ROWS)[:, None]
        mask = (row < end) & (cols < N)
        x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0)
        dy = tl.load(dy_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(r_ptr + row, mask=row < end, other=0.0)
        n = x.to(tl.float32) * r
        dw += dy * n.to(x.dtype).to(tl.float32)
        c = (dy * w.to(tl.float32)).to(x.dtype).to(tl.float32)
        dx = r * (c - n * (tl.sum(c * n, 1)[:, None] / N))
        tl.store(dx_ptr + row * N + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + program * N + columns, tl.sum(dw, 0), mask=columns < N)


def _tiles(width: int) -> tuple[int, int]:
    """(BLOCK_N, ROWS): the row's columns rounded up to a power of two, and rows a tile."""
    block = triton.next_power_of_2(width)
    return block, max(1, TILE // block)


def _programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def _forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """y [M, N] (the promoted dtype of x and weight) and r [M] float32 of x [M, N], contiguous."""
    rows, width = x.shape
    y = torch.empty(rows, width, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    r = torch.empty(rows, dtype=torch.float32, device=x.device)
    block, tile_rows = _tiles(width)
    if rows:
        _forward_kernel[(triton.cdiv(rows, tile_rows),)](
            x, weight, y, r, rows, eps, N=width, BLOCK_N=block, ROWS=tile_rows, num_warps=8
        )
    return y, r


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        y, r = _forward(x, weight, eps)
        ctx.save_for_backward(x, weight, r)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, weight, r = ctx.saved_tensors
        rows, width = x.shape
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        programs = max(1, min(_programs(x.device), rows))
        partials = torch.empty(programs, width, dtype=torch.float32, device=x.device)
        block, tile_rows = _tiles(width)
        if rows:
            _backward_kernel[(programs,)](
                x, weight, r, dy, dx, partials, rows, triton.cdiv(rows, programs),
                N=width, BLOCK_N=block, ROWS=tile_rows, num_warps=8,
            )  # fmt: skip
        else:
            partials.zero_()
        return dx, partials.sum(0).to(weight.dtype), None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The norm of x [..., N] over its last dimension with weight [N] (see the module); x's shape, the dtype x and
    weight promote to."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1]).contiguous()
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        y = _RMSNorm.apply(rows, weight.contiguous(), eps)
    else:
        y, _ = _forward(rows, weight.contiguous(), eps)
    return y.view(shape)
