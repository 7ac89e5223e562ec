"""The training norm's kernels against the torch chain they replace (`models.layers.torch_rms_norm`): values, the
gradients of x and of the weight, for row counts that leave the last tile and the last program's run part full,
fewer rows than programs, and none."""

from __future__ import annotations

import pytest
import torch
from kernels_testkit import DEVICE, DTYPE, needs_cuda, unspecialized

from rollplex.executors.compiles import variants as compiled_variants
from rollplex.kernels import rms_norm as kernels
from rollplex.kernels.rms_norm import TILE, rms_norm
from rollplex.models import layers
from rollplex.models.layers import torch_rms_norm


def norm_and_grads(fn, x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
    y = fn(x, weight, 1e-6)
    y.backward(dy)
    return [y.detach(), x.grad, weight.grad]


def inputs(*shape: int, seed: int, weight_dtype: torch.dtype = DTYPE):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 3 + torch.randn(shape[-1], generator=g)).to(DEVICE, DTYPE)
    weight = torch.randn(shape[-1], generator=g).to(DEVICE, weight_dtype)
    dy = torch.randn(*shape, generator=g).to(DEVICE, torch.promote_types(DTYPE, weight_dtype))
    return x, weight, dy


def assert_alike(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        largest = max(1.0, float(w.abs().max()))  # the weight's gradient sums over every row
        tol = 1e-5 if DTYPE is torch.float32 else 2e-2
        torch.testing.assert_close(g.float(), w.float(), atol=tol * largest, rtol=tol)


@pytest.mark.parametrize(
    "shape",
    [
        (37, 3, 40),  # 111 rows of 40 columns (64 wide): 64-row tiles, the programs' runs ending mid-tile
        (3, 96),  # fewer rows than the backward has programs: one program a row
        (2, 5, 200),  # 256 wide: 16-row tiles
        (1, 9, TILE + 40),  # wider than a tile: one row a tile, masked past the width
    ],
)
def test_the_norm_and_its_gradients_are_the_torch_chains(shape):
    x, weight, dy = inputs(*shape, seed=sum(shape))
    got, want = norm_and_grads(rms_norm, x, weight, dy), norm_and_grads(torch_rms_norm, x, weight, dy)
    assert got[2].abs().min() > 0  # a weight gradient in every column
    assert_alike(got, want)


def test_without_gradients_the_same_values_and_no_rows_give_nothing():
    x, weight, dy = inputs(6, 48, seed=3)
    with torch.no_grad():
        y = rms_norm(x, weight, 1e-6)
    assert not y.requires_grad
    assert torch.equal(y, norm_and_grads(rms_norm, x, weight, dy)[0])
    empty = norm_and_grads(rms_norm, x[:0], weight, dy[:0])
    assert empty[0].shape == (0, 48) and empty[1].shape == (0, 48)
    assert torch.equal(empty[2], torch.zeros_like(weight))


def test_off_a_gpu_the_models_norm_is_the_torch_chain():
    x, weight = torch.randn(4, 8), torch.randn(8)
    assert torch.equal(layers.rms_norm(x, weight, 1e-6), torch_rms_norm(x, weight, 1e-6))


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 4099, 2048), (5000, 1280), (2, 3, 3584)])  # the decoders' and vision widths
def test_on_a_gpu_the_norm_at_the_models_widths_is_the_torch_chain(shape, weight_dtype):
    x, weight, dy = inputs(*shape, seed=shape[-1], weight_dtype=weight_dtype)
    got = norm_and_grads(layers.rms_norm, x, weight, dy)  # the model's norm on a GPU: the kernels
    assert torch.equal(got[0], rms_norm(x, weight, 1e-6))
    assert_alike(got, norm_and_grads(torch_rms_norm, x, weight, dy))


def test_the_kernels_are_not_specialized_on_row_counts():
    """Triton compiles a variant for an integer argument equal to 1 or divisible by 16: a row count of a new kind
    would compile in the middle of a step."""
    assert {"rows"} <= unspecialized(kernels._forward_kernel)
    assert {"rows", "rows_per_program"} <= unspecialized(kernels._backward_kernel)


@needs_cuda
@pytest.mark.gpu
def test_on_a_gpu_row_counts_of_every_kind_run_the_kernels_compiled_first():
    """After one call, row counts of 1, of 16 per program, a multiple of 16 and neither compile nothing."""
    norm_and_grads(rms_norm, *inputs(1000, 2048, seed=0))
    first = compiled_variants(kernels._forward_kernel), compiled_variants(kernels._backward_kernel)
    programs = kernels._programs(DEVICE)
    for rows in (1, 226, 16 * programs, 4096, 3259):
        norm_and_grads(rms_norm, *inputs(rows, 2048, seed=rows))
    assert (compiled_variants(kernels._forward_kernel), compiled_variants(kernels._backward_kernel)) == first
