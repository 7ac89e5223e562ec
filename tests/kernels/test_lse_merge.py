"""The cascade's two-part merge kernel against the torch form it replaces on a GPU (`models.cascade.merged` off a
GPU): outputs and log-sum-exps far apart per row (each part dominating some rows), a log-sum-exp given as a
transposed view (cuDNN's statistics), a part without keys for some rows, a row count that leaves the last program
part full, a head size not a power of two, and a float32 part merged into a 16-bit output."""

from __future__ import annotations

import pytest
import torch
from kernels_testkit import DEVICE, DTYPE, needs_cuda, unspecialized

from rollplex.executors.compiles import variants as compiled_variants
from rollplex.kernels import lse_merge
from rollplex.kernels.lse_merge import ROWS, merge_two
from rollplex.models.cascade import torch_merged


def parts(tokens: int, heads: int, head_dim: int, seed: int, second_dtype: torch.dtype = DTYPE):
    g = torch.Generator().manual_seed(seed)
    o1 = torch.randn(tokens, heads, head_dim, generator=g).to(DEVICE, DTYPE)
    o2 = torch.randn(tokens, heads, head_dim, generator=g).to(DEVICE, second_dtype)
    lse1 = (torch.randn(heads, tokens + 5, generator=g) * 4).to(DEVICE)[:, 5:]  # a row stride past T
    lse2 = (torch.randn(tokens, heads, generator=g) * 4).to(DEVICE).T  # [H, T] as a view of [T, H]
    lse2[:, : tokens // 3] = float("-inf")  # the second part has no keys for the first rows
    return o1, lse1, o2, lse2


def torch_merge(o1, lse1, o2, lse2, dtype):
    return torch_merged([(o1, lse1), (o2, lse2)], dtype)


@pytest.mark.parametrize("tokens, heads, head_dim", [(3, 1, 128), (ROWS + 3, 16, 128), (37, 12, 80)])
def test_merge_matches_torch(tokens: int, heads: int, head_dim: int) -> None:
    o1, lse1, o2, lse2 = parts(tokens, heads, head_dim, seed=tokens)
    out, lse = merge_two(o1, lse1, o2, lse2, DTYPE)
    want_out, want_lse = torch_merge(o1, lse1, o2, lse2, DTYPE)
    assert out.dtype == DTYPE and out.shape == (tokens, heads, head_dim) and lse.shape == (heads, tokens)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    tol = 1e-5 if DTYPE is torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want_out.float(), atol=tol, rtol=tol)
    head = slice(0, tokens // 3)
    torch.testing.assert_close(out[head].cpu(), o1[head].cpu())  # where the second part has no keys: the first's


def test_merge_without_keys_in_either_part() -> None:
    o1, lse1, o2, lse2 = parts(8, 2, 64, seed=3)
    lse1[:, 2], lse2[:, 2] = float("-inf"), float("-inf")
    out, lse = merge_two(o1, lse1, o2, lse2, DTYPE)
    assert torch.equal(out[2].cpu(), torch.zeros(2, 64, dtype=DTYPE)) and bool((lse[:, 2] == float("-inf")).all())
    assert bool(out.isfinite().all()) and bool(lse[:, 3:].isfinite().all())


@needs_cuda
def test_float32_part_into_bf16() -> None:
    o1, lse1, o2, lse2 = parts(300, 16, 128, seed=5, second_dtype=torch.float32)
    out, lse = merge_two(o1, lse1, o2, lse2, torch.bfloat16)
    want_out, want_lse = torch_merge(o1, lse1, o2, lse2, torch.bfloat16)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.float(), want_out.float(), atol=1e-2, rtol=1e-2)


def test_the_kernel_is_not_specialized_on_token_counts_or_the_strides_they_set():
    assert {"rows", "l1_head", "l1_token", "l2_head", "l2_token", "tokens"} <= unspecialized(lse_merge._merge_kernel)


@needs_cuda
@pytest.mark.gpu
def test_on_a_gpu_token_counts_of_every_kind_run_the_kernel_compiled_first():
    """After one call, token counts of 1, a multiple of 16 and neither compile nothing."""
    merge_two(*parts(37, 16, 128, seed=0), DTYPE)
    first = compiled_variants(lse_merge._merge_kernel)
    for tokens in (1, 64, 226, 3259):
        merge_two(*parts(tokens, 16, 128, seed=tokens), DTYPE)
    assert compiled_variants(lse_merge._merge_kernel) == first
