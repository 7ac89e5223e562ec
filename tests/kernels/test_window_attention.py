"""Attention within short runs (the vision tower's windows) against SDPA run by run: the output and the gradients
to q, k and v, the three read as views of one fused QKV output, at a head dim that is not a power of two."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from kernels_testkit import DEVICE, DTYPE, ON_GPU

from rollplex.kernels.window_attention import MAX_RUN, window_attention

TOL = dict(atol=2e-2, rtol=2e-2) if ON_GPU else dict(atol=1e-5, rtol=1e-5)


def per_run(q, k, v, bounds):
    runs = [
        F.scaled_dot_product_attention(*(x[a:b].transpose(0, 1).float() for x in (q, k, v))).transpose(0, 1)
        for a, b in itertools.pairwise(bounds.tolist())
    ]
    return torch.cat(runs).to(q.dtype)


@pytest.mark.parametrize("lengths", [[64, 17, 1, 40, 64], [3], [128, 5]])
def test_window_attention_and_its_gradients_equal_sdpa_run_by_run(lengths):
    heads, d = 3, 80
    g = torch.Generator().manual_seed(len(lengths))
    qkv = torch.randn(sum(lengths), 3, heads, d, generator=g).to(DEVICE, DTYPE)
    grad = torch.randn(sum(lengths), heads, d, generator=g).to(DEVICE, DTYPE)
    bounds = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEVICE)
    got, want = [], []
    for fn, out in (
        (lambda *a: window_attention(*a, bounds, max(lengths)), got),
        (lambda *a: per_run(*a, bounds), want),
    ):
        fused = qkv.clone().requires_grad_()
        y = fn(fused[:, 0], fused[:, 1], fused[:, 2])
        y.backward(grad)
        out += [y.detach(), fused.grad]
    assert got[0].dtype == DTYPE and got[1].abs().sum() > 0
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), **TOL)


def test_a_run_longer_than_a_program_holds_is_refused():
    x = torch.zeros(MAX_RUN + 1, 1, 16, device=DEVICE, dtype=DTYPE)
    bounds = torch.tensor([0, MAX_RUN + 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(AssertionError, match="at most"):
        window_attention(x, x, x, bounds, MAX_RUN + 1)
