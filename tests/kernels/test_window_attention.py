"""Attention within short runs (the vision tower's windows) against attention run by run in FP32: the output and
the gradients to q, k and v, in the tower's layout (q and k whole tensors, v a view of the fused QKV output) and in
others, at a head dim that is not a power of two."""

from __future__ import annotations

import itertools

import pytest
import torch
from kernels_testkit import DEVICE, DTYPE, ON_GPU

from rollplex.kernels.window_attention import MAX_RUN, window_attention

HEADS, D = 3, 80


def per_run(q, k, v, bounds, dtype=torch.float32):
    """Attention of each run apart, every op (the scores, the softmax, the product) in `dtype`: in FP32 the oracle,
    in bf16 the rounding a bf16 kernel may be compared with (flash attention's tests measure kernels so)."""
    outs = []
    for a, b in itertools.pairwise(bounds.tolist()):
        q_r, k_r, v_r = (x[a:b].transpose(0, 1).to(dtype) for x in (q, k, v))  # [heads, run, D]
        probs = ((q_r @ k_r.transpose(1, 2)) * q.shape[-1] ** -0.5).softmax(-1)
        outs.append((probs @ v_r).transpose(0, 1))
    return torch.cat(outs)


def case(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lengths), 3, HEADS, D, generator=g).to(DEVICE, DTYPE)
    grad = torch.randn(sum(lengths), HEADS, D, generator=g).to(DEVICE, DTYPE)
    bounds = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEVICE)
    return qkv, grad, bounds


def tower_layout(qkv):
    """q and k whole tensors (the rotary's outputs), v a strided view of the fused output."""
    return qkv[:, 0] * 1.0, qkv[:, 1] * 1.0, qkv[:, 2]


def other_layout(qkv):
    """Every input a copy with its heads apart from each other (the copy path), in another row order."""
    return tuple(qkv[:, i].transpose(0, 1).contiguous().transpose(0, 1) for i in range(3))


def scored(fn, qkv, layout, grad):
    fused = qkv.clone().requires_grad_()
    y = fn(*layout(fused))
    y.backward(grad.transpose(0, 1).contiguous().transpose(0, 1))  # a gradient with its heads apart
    return [y.detach().float(), fused.grad.float()]


@pytest.mark.parametrize("layout", [tower_layout, other_layout])
@pytest.mark.parametrize("lengths", [[64, 17, 1, 40, 64], [3], [64, 0, 5]])
def test_window_attention_and_its_gradients_equal_attention_run_by_run(lengths, layout):
    qkv, grad, bounds = case(lengths, len(lengths))
    got = scored(lambda *a: window_attention(*a, bounds, max(lengths)), qkv, layout, grad)
    want = scored(lambda *a: per_run(*a, bounds), qkv, layout, grad)  # FP32
    assert got[1].abs().sum() > 0
    if not ON_GPU:
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        return
    # in bf16: at most twice as far from FP32 as the same attention computed op by op in bf16
    bf16 = scored(lambda *a: per_run(*a, bounds, torch.bfloat16), qkv, layout, grad)
    for a, b, c in zip(got, want, bf16, strict=True):
        assert (a - b).abs().max() <= 2 * (c - b).abs().max() + 1e-4


def test_a_run_longer_than_a_program_holds_or_mixed_dtypes_are_refused():
    x = torch.zeros(MAX_RUN + 1, 1, 16, device=DEVICE, dtype=DTYPE)
    bounds = torch.tensor([0, MAX_RUN + 1], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="at most"):
        window_attention(x, x, x, bounds, MAX_RUN + 1)
    with pytest.raises(ValueError, match="one dtype"):
        window_attention(x, x, x.double(), bounds, 1)
