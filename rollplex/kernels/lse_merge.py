"""Two attention outputs over disjoint key sets merged into the whole softmax's, one pass (the training cascade's
combine, `models.cascade`).

`merge_two(o1, lse1, o2, lse2, dtype)`: o1, o2 [T, H, D] in a 16-bit or float32 dtype, lse1, lse2 [H, T] float32 (any
strides: cuDNN's statistics come as a transposed view) -> out [T, H, D] in `dtype` and lse [H, T] float32 with
lse = log(e^lse1 + e^lse2) and out = o1 e^(lse1 - lse) + o2 e^(lse2 - lse), in float32 inside. A part without
keys for a query has lse -inf and adds nothing; a query with keys in neither part gets out 0 and lse -inf.

Why a kernel: the same merge in torch ops (stack, logsumexp, each output widened to float32, scaled, summed,
narrowed) writes and reads float32 copies of the outputs several times; here each output is read once and the
merged one written once. A CPU test runs it under Triton's interpreter against the torch form.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

ROWS = 32  # (token, head) rows a program merges
# the arguments that follow a call's tokens, not specialized: Triton would compile a variant for each equal to 1 or
# divisible by 16, in the middle of a step where a batch brings a new kind
LENGTHS = ["rows", "l1_head", "l1_token", "l2_head", "l2_token", "tokens"]


@triton.jit(do_not_specialize=LENGTHS)
def _merge_kernel(
    o1_ptr, o2_ptr, l1_ptr, l2_ptr, out_ptr, lse_ptr, rows, heads, l1_head, l1_token, l2_head, l2_token, tokens,
    D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # token * heads + head
    live = row < rows
    token, head = row // heads, row % heads
    l1 = tl.load(l1_ptr + head * l1_head + token * l1_token, mask=live, other=float("-inf"))
    l2 = tl.load(l2_ptr + head * l2_head + token * l2_token, mask=live, other=float("-inf"))
    top = tl.maximum(l1, l2)
    top = tl.where(top == float("-inf"), 0.0, top)
    e1, e2 = tl.exp(l1 - top), tl.exp(l2 - top)
    total = e1 + e2
    lse = tl.where(total > 0, top + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))
    w1 = tl.where(total > 0, e1 / tl.where(total > 0, total, 1.0), 0.0)
    w2 = tl.where(total > 0, e2 / tl.where(total > 0, total, 1.0), 0.0)
    cols = tl.arange(0, BLOCK_D)[None, :]
    at = row[:, None] * D + cols
    mask = live[:, None] & (cols < D)
    o1 = tl.load(o1_ptr + at, mask=mask, other=0.0).to(tl.float32)
    o2 = tl.load(o2_ptr + at, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + at, (o1 * w1[:, None] + o2 * w2[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(lse_ptr + head * tokens + token, lse, mask=live)


def merge_two(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(out [T, H, D] in `dtype`, lse [H, T] float32): the merge of two parts (see the module)."""
    tokens, heads, head_dim = o1.shape
    o1, o2 = o1.contiguous(), o2.contiguous()
    out = torch.empty(tokens, heads, head_dim, dtype=dtype, device=o1.device)
    lse = torch.empty(heads, tokens, dtype=torch.float32, device=o1.device)
    rows = tokens * heads
    if rows:
        _merge_kernel[(triton.cdiv(rows, ROWS),)](
            o1, o2, lse1, lse2, out, lse, rows, heads, *lse1.stride(), *lse2.stride(), tokens,
            D=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), ROWS=ROWS, num_warps=4,
        )  # fmt: skip
    return out, lse
