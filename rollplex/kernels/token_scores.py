"""The LM head's log-prob of each sampled token and the entropy at it, without FP32 logits.

`head_scores(hidden, weight, targets, temperature)` -> (logprobs [M], entropy [M]), float32, of
softmax(hidden W^T / temperature), the autograd of both included. Eager torch widens the head's bf16 logits to
FP32 and makes a handful of [M, V] FP32 passes each way (the cast, log-softmax, exp, the entropy's product and
sum, and their backwards); here:
- forward: the logits (one GEMM, as `nn.Linear`), then one kernel reads each row once, keeping a running max m,
  s = sum exp(z - m) and u = sum exp(z - m) (z - m) of z = logits / temperature: lse = m + log s, the entropy
  log s - u / s, the target's log-prob z_t - lse. Only `hidden` and three floats a row are kept for backward.
- backward: the logits again (one GEMM), which one kernel turns in place into their gradient,
  d z_j = g_lp ([j = t] - p_j) - g_ent p_j (log p_j + H), with log p_j = (z_j - m) - log s, divided by the
  temperature and rounded to the logits' dtype as autograd rounds the gradient of eager's cast; then
  d hidden = d logits W and d W = d logits^T hidden.
The values equal eager's within FP32 rounding (the sums run in another order). For a single-rank head with no
bias (a vocabulary-parallel head gathers its logits: `rollplex.parallel`), on a GPU (`models.scores` decides).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

BLOCK_V = 2048  # vocabulary columns a program reads at a time
START = -1.0e30  # the running max before the first block: finite, so that the first rescale is exp(-huge) = 0


@triton.jit
def _forward_kernel(
    logits_ptr,  # [M, V], row stride `stride`
    targets_ptr,  # [M] int64
    logprob_ptr,  # [M] fp32 out
    entropy_ptr,  # [M] fp32 out
    max_ptr,  # [M] fp32 out: m
    log_sum_ptr,  # [M] fp32 out: log s (lse = m + log s)
    inv_temperature,
    stride,
    V: tl.constexpr,  # the vocabulary: a model's constant (and the interpreter ranges over constexprs only)
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    m = tl.full((), START, tl.float32)
    s = tl.zeros((), tl.float32)
    u = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        real = cols < V
        z = tl.load(base + cols, mask=real, other=0.0).to(tl.float32) * inv_temperature
        z = tl.where(real, z, START)
        m_new = tl.maximum(m, tl.max(z, 0))
        rescale = tl.exp(m - m_new)
        e = tl.where(real, tl.exp(z - m_new), 0.0)
        u = rescale * (u + s * (m - m_new)) + tl.sum(e * (z - m_new), 0)
        s = rescale * s + tl.sum(e, 0)
        m = m_new
    log_s = tl.log(s)
    lse = m + log_s
    target = tl.load(targets_ptr + row)
    z_t = tl.load(base + target).to(tl.float32) * inv_temperature
    tl.store(logprob_ptr + row, z_t - lse)
    tl.store(entropy_ptr + row, log_s - u / s)
    tl.store(max_ptr + row, m)
    tl.store(log_sum_ptr + row, log_s)


@triton.jit
def _backward_kernel(
    logits_ptr,  # [M, V]: read, then overwritten with d logits
    targets_ptr,  # [M] int64
    grad_logprob_ptr,  # [M] fp32
    grad_entropy_ptr,  # [M] fp32
    max_ptr,  # [M] fp32
    log_sum_ptr,  # [M] fp32
    entropy_ptr,  # [M] fp32
    inv_temperature,
    stride,
    V: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    m = tl.load(max_ptr + row)
    log_s = tl.load(log_sum_ptr + row)
    h = tl.load(entropy_ptr + row)
    g_lp = tl.load(grad_logprob_ptr + row)
    g_ent = tl.load(grad_entropy_ptr + row)
    target = tl.load(targets_ptr + row)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        real = cols < V
        x = tl.load(base + cols, mask=real, other=0.0)
        log_p = (x.to(tl.float32) * inv_temperature - m) - log_s  # exact near the max, as lse rounded is not
        p = tl.exp(log_p)
        dz = -g_lp * p - g_ent * p * (log_p + h)
        dz = tl.where(cols == target, dz + g_lp, dz)
        tl.store(base + cols, (dz * inv_temperature).to(x.dtype), mask=real)


def _forward(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, ...]:
    """logprobs, entropy, the running max m and log s of each row (see the module)."""
    rows, vocab = logits.shape
    out = [torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(4)]
    if rows:
        _forward_kernel[(rows,)](logits, targets, *out, 1.0 / temperature, logits.stride(0), V=vocab, BLOCK=BLOCK_V)
    return tuple(out)


class _HeadScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
        logprobs, entropy, m, log_s = _forward(F.linear(hidden, weight), targets, temperature)
        ctx.save_for_backward(hidden, weight, targets, m, log_s, entropy)
        ctx.temperature = temperature
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None):
        hidden, weight, targets, m, log_s, entropy = ctx.saved_tensors
        zeros = torch.zeros_like(m)
        grad_logprobs = zeros if grad_logprobs is None else grad_logprobs.float().contiguous()
        grad_entropy = zeros if grad_entropy is None else grad_entropy.float().contiguous()
        grads = F.linear(hidden, weight)  # the logits again, turned into their gradient in place
        rows, vocab = grads.shape
        if rows:
            _backward_kernel[(rows,)](
                grads, targets, grad_logprobs, grad_entropy, m, log_s, entropy, 1.0 / ctx.temperature, grads.stride(0),
                V=vocab, BLOCK=BLOCK_V,
            )  # fmt: skip
        grad_hidden = grads @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grads.t() @ hidden if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None


def head_scores(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Log-prob of each target [M] int64 and the entropy at each of hidden [M, H] under the head weight [V, H]
    at `temperature`: [M] and [M], float32 (see the module)."""
    hidden, targets = hidden.contiguous(), targets.contiguous()
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _HeadScores.apply(hidden, weight, targets, temperature)
    logprobs, entropy, _, _ = _forward(F.linear(hidden, weight), targets, temperature)
    return logprobs, entropy
