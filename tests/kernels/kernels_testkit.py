"""Device, dtype and tolerance shared by the kernel tests (see conftest.py for the interpreter switch)."""

from __future__ import annotations

import pytest
import torch

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
needs_cuda = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def random(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, DTYPE)


def assert_matches(y: torch.Tensor, reference: torch.Tensor) -> None:
    """Same dtype and shape; values within rounding of the output dtype (reference computed in fp32)."""
    assert y.dtype == reference.dtype and y.shape == reference.shape
    tol = 2e-2 if y.dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(y.float(), reference.float(), atol=tol, rtol=tol)


def unspecialized(kernel) -> set[str]:
    """The arguments a Triton kernel is not specialized on (`do_not_specialize`), jitted or interpreted."""
    names = getattr(kernel, "do_not_specialize", None)
    if names is None:  # triton's interpreter keeps the decorator's arguments
        names = kernel.kwargs.get("do_not_specialize") or []
    return set(names)
