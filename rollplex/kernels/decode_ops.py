"""The small fused kernels of a decode step, one launch each where eager torch takes five to ten:

- `add_rms_norm`: residual += delta, then RMSNorm of the new residual (HF's rounding: normalise in fp32,
  round to the model dtype, multiply by the weight in that dtype).
- `rotary_to_cache`: from one packed [q k v] projection per row, rotates q and k of the new token by its text
  position, writes k and v into the row's slot of the response cache at the current step, q into [rows, H, D].
- `silu_mul`: silu(gate) * up from one packed [gate up] projection, rounded after each op as eager torch does.

`add_rms_norm` and `rotary_to_cache` read the projection before them as parts [S, rows, N]: the fp32 partials of a
K split, which they add in split order and round to the model dtype as `tiles.sum_splits` would (so the split
needs no launch of its own: `transposed_gemm.linear_parts`), or one part in the model dtype (any product, [None]).
Positions and the step come from device tensors, so a captured CUDA graph replays them step after step. Each
takes `pdl`: launched as a programmatic dependent, it waits for the kernel before it and lets the next one launch
once its own stores are issued, or with `ahead` before it waits (`rollplex.kernels.pdl`). What no kernel of the
chain writes it reads before it waits (`pdl.enter`): the norm's weight; rotary's position and its cos and sin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rollplex.kernels.pdl import enter, leave, pdl_options

NORM_WARPS = 8  # a row's loads and its sum spread over more threads: the latency-bound decode norm is shorter


@triton.jit
def summed(ptr, offsets, mask, part_stride, PARTS: tl.constexpr, DTYPE: tl.constexpr):
    """The PARTS parts at ptr + offsets (each part_stride elements after the one before) added in order in fp32,
    rounded to DTYPE, then widened to fp32 again: the value the unsplit product would hold."""
    total = tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    for part in range(1, PARTS):
        total += tl.load(ptr + part * part_stride + offsets, mask=mask, other=0.0).to(tl.float32)
    return total.to(DTYPE).to(tl.float32)


@triton.jit
def norm_weight(weight_ptr, N: tl.constexpr, BLOCK: tl.constexpr):
    """A norm's weight [N] as `add_rms_norm_row` takes it: BLOCK lanes, zeros past N."""
    cols = tl.arange(0, BLOCK)
    return tl.load(weight_ptr + cols, mask=cols < N, other=0.0)


@triton.jit
def add_rms_norm_row(
    delta_ptr, residual_ptr, w, out_ptr, row, eps, part_stride,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr, PARTS: tl.constexpr,
):  # fmt: skip
    """One row of `add_rms_norm_kernel`: residual[row] += delta's parts (summed in order, rounded), then out[row] =
    RMSNorm(residual[row]) * w, the weight as `norm_weight` loads it."""
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(residual_ptr + row * N + cols, mask=mask, other=0.0)
    if HAS_DELTA:
        delta = summed(delta_ptr, row * N + cols, mask, part_stride, PARTS, residual_ptr.dtype.element_ty)
        x = (x.to(tl.float32) + delta).to(x.dtype)
        tl.store(residual_ptr + row * N + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    normed = (x32 / tl.sqrt(tl.sum(x32 * x32, axis=0) / N + eps)).to(x.dtype)
    tl.store(out_ptr + row * N + cols, (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype), mask=mask)


@triton.jit
def add_rms_norm_kernel(
    delta_ptr,  # [PARTS, rows, N] or unused
    residual_ptr,  # [rows, N], updated in place
    weight_ptr,  # [N]
    out_ptr,  # [rows, N]
    eps,
    part_stride,  # rows * N: elements from one part of delta to the next
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    PARTS: tl.constexpr = 1,
    USE_GDC: tl.constexpr = False,  # a programmatic dependent launch (`pdl.pdl_options`)
    AHEAD: tl.constexpr = False,  # `pdl.enter`
):
    w = norm_weight(weight_ptr, N, BLOCK)
    enter(USE_GDC, AHEAD)
    row = tl.program_id(0).to(tl.int64)
    add_rms_norm_row(delta_ptr, residual_ptr, w, out_ptr, row, eps, part_stride, N, BLOCK, HAS_DELTA, PARTS)
    leave(USE_GDC, AHEAD)


def add_rms_norm(
    delta: torch.Tensor | None,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor,
    pdl: bool = False,
    ahead: bool = False,
) -> torch.Tensor:
    """residual [rows, N] (+= delta), out [rows, N] = RMSNorm(residual) * weight; all contiguous, one dtype. delta:
    [rows, N] in that dtype, or parts [S, rows, N] (see the module docstring). `pdl`, `ahead`: see there."""
    rows, n = residual.shape
    assert residual.is_contiguous() and out.is_contiguous() and out.shape == residual.shape
    assert weight.shape == (n,) and weight.dtype == residual.dtype, f"weight {tuple(weight.shape)} {weight.dtype}"
    parts = None if delta is None else _as_parts(delta, residual.shape, residual.dtype)
    add_rms_norm_kernel[(rows,)](
        residual if parts is None else parts, residual, weight, out, eps, rows * n, N=n,
        BLOCK=triton.next_power_of_2(n), HAS_DELTA=parts is not None, PARTS=1 if parts is None else parts.shape[0],
        num_warps=NORM_WARPS, **pdl_options(pdl, out, ahead),
    )  # fmt: skip
    return out


@triton.jit
def rotary_to_cache_kernel(
    qkv_ptr,  # [PARTS, rows, (H + 2G) * D]: q, k, v of each row side by side (one packed projection)
    cos_ptr,  # [positions, D] fp32
    sin_ptr,  # [positions, D] fp32
    slots_ptr,  # [rows] int64
    next_positions_ptr,  # [P + 1] int64: position of response token 0 per prompt (one spare for padding rows)
    step_ptr,  # [1] int64
    q_out_ptr,  # [rows, H, D]
    k_cache_ptr,  # [SLOTS, G, R, D]
    v_cache_ptr,  # [SLOTS, G, R, D]
    part_stride,  # rows * (H + 2G) * D: elements from one part of qkv to the next
    H: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,
    NUM_SAMPLES: tl.constexpr,
    PARTS: tl.constexpr = 1,
    USE_GDC: tl.constexpr = False,
    AHEAD: tl.constexpr = False,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q heads, then kv heads
    slot = tl.load(slots_ptr + row)
    step = tl.load(step_ptr)
    position = tl.load(next_positions_ptr + slot // NUM_SAMPLES) + step
    half = tl.arange(0, D // 2)
    cos = tl.load(cos_ptr + position * D + half)  # both halves of the table are equal
    sin = tl.load(sin_ptr + position * D + half)
    enter(USE_GDC, AHEAD)  # the projection: from here on
    src = (row * (H + 2 * G) + head) * D  # offset in each part
    dtype = q_out_ptr.dtype.element_ty
    whole_half = half < D // 2  # every lane: `summed` takes a mask
    if head < H:
        dst = q_out_ptr + (row * H + head) * D
    else:
        g = head - H
        dst = k_cache_ptr + ((slot * G + g) * R + step) * D
        full = tl.arange(0, D)
        v = summed(qkv_ptr, src + G * D + full, full < D, part_stride, PARTS, dtype)
        tl.store(v_cache_ptr + ((slot * G + g) * R + step) * D + full, v.to(dtype))
    x1 = summed(qkv_ptr, src + half, whole_half, part_stride, PARTS, dtype)
    x2 = summed(qkv_ptr, src + D // 2 + half, whole_half, part_stride, PARTS, dtype)
    tl.store(dst + half, (x1 * cos - x2 * sin).to(dst.dtype.element_ty))
    tl.store(dst + D // 2 + half, (x2 * cos + x1 * sin).to(dst.dtype.element_ty))
    leave(USE_GDC, AHEAD)


def rotary_to_cache(
    qkv: torch.Tensor,  # [rows, (H + 2G) * D], or parts [S, rows, (H + 2G) * D] (see the module docstring)
    cos: torch.Tensor,  # [positions, D] fp32
    sin: torch.Tensor,
    slots: torch.Tensor,  # [rows] int64
    next_positions: torch.Tensor,  # [P + 1] int64
    step: torch.Tensor,  # [1] int64
    q_out: torch.Tensor,  # [rows, H, D]
    k_cache: torch.Tensor,  # [SLOTS, G, R, D]
    v_cache: torch.Tensor,
    num_samples: int,
    pdl: bool = False,
    ahead: bool = False,
) -> torch.Tensor:
    rows, num_heads, head_dim = q_out.shape
    _, num_groups, max_tokens, _ = k_cache.shape
    width = (num_heads + 2 * num_groups) * head_dim
    parts = _as_parts(qkv, (rows, width), q_out.dtype)
    assert all(t.is_contiguous() for t in (q_out, k_cache, v_cache, cos, sin))
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape[1] == head_dim
    rotary_to_cache_kernel[(rows, num_heads + num_groups)](
        parts, cos, sin, slots, next_positions, step, q_out, k_cache, v_cache, rows * width,
        H=num_heads, G=num_groups, D=head_dim, R=max_tokens, NUM_SAMPLES=num_samples, PARTS=parts.shape[0],
        **pdl_options(pdl, q_out, ahead),
    )  # fmt: skip
    return q_out


def _as_parts(product: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """product as parts [S, *shape]: a [*shape] product in `dtype` is one part; fp32 partials must be [S, *shape]."""
    parts = product[None] if product.dim() == len(shape) else product
    assert tuple(parts.shape[1:]) == tuple(shape), f"product {tuple(product.shape)}, expected [S, *{tuple(shape)}]"
    assert parts.is_contiguous(), "the product must be contiguous"
    assert parts.dtype == (dtype if parts.shape[0] == 1 else torch.float32), f"{parts.shape[0]} parts of {parts.dtype}"
    return parts


@triton.jit
def silu_mul_kernel(gate_up_ptr, out_ptr, N: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr = False):
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(gate_up_ptr + row * 2 * N + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * 2 * N + N + cols, mask=mask, other=0.0)
    g32 = gate.to(tl.float32)
    act = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)
    tl.store(out_ptr + row * N + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor, block: int = 1024, pdl: bool = False) -> torch.Tensor:
    """out [rows, N] = silu(gate) * up, where gate_up [rows, 2N] holds gate then up (one packed projection)."""
    rows, n = out.shape
    assert gate_up.shape == (rows, 2 * n) and gate_up.is_contiguous() and out.is_contiguous()
    silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, N=n, BLOCK=block, **pdl_options(pdl, out))
    return out
