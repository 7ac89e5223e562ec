"""The LM head's log-prob of each sampled token and the entropy at it, without FP32 logits.

`head_scores(hidden, weight, targets, temperature, group)` -> (logprobs [M], entropy [M]), float32, of
softmax(hidden W^T / temperature), the autograd of both included; W is the whole head or, with a TP `group`, this
rank's rows of a vocabulary-parallel one (equal shards in rank order). Eager torch widens the head's bf16 logits to
FP32 and makes a handful of [M, V] FP32 passes each way (the cast, log-softmax, exp, the entropy's product and
sum, and their backwards), after gathering every shard's logits under TP; here:
- forward: this rank's logits (one GEMM, as `nn.Linear`), then one kernel reads each row once, keeping a running
  max m, s = sum exp(z - m) and u = sum exp(z - m) (z - m) of z = logits / temperature, and the target's z_t where
  this shard holds it. The ranks' (m, s, u / s, z_t) combine over the group into the row's max M, log S,
  lse = M + log S and the entropy H = log S - E[z - M]; the log-prob is z_t - lse. Three floats a row and `hidden`
  are kept for backward.
- backward: the logits again (one GEMM), which one kernel turns in place into their gradient,
  d z_j = g_lp ([j = t] - p_j) - g_ent p_j (log p_j + H), with log p_j = (z_j - M) - log S, divided by the
  temperature and rounded to the logits' dtype as autograd rounds the gradient of eager's cast; then
  d hidden = d logits W (summed over the group by `copy_to`'s backward) and d W = d logits^T hidden.
The values equal eager's within FP32 rounding (the sums run in another order). For a head without bias, on a GPU
(`models.scores` decides; a CPU test runs the kernels under Triton's interpreter).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from rollplex.parallel.group import TPGroup, copy_to

BLOCK_V = 2048  # vocabulary columns a program reads at a time
# the running max before the first block: finite, so that the first rescale is exp(-huge) = 0 (a constexpr: compiled
# Triton reads no plain global)
START = tl.constexpr(-1.0e30)


@triton.jit
def _forward_kernel(
    logits_ptr,  # [M, V], row stride `stride`: this shard's columns
    targets_ptr,  # [M] int64, over the whole vocabulary
    max_ptr,  # [M] fp32 out: m
    log_sum_ptr,  # [M] fp32 out: log s
    mean_ptr,  # [M] fp32 out: u / s, the mean of z - m under this shard's softmax
    target_ptr,  # [M] fp32 out: z_t where this shard holds the target, else 0
    inv_temperature,
    stride,
    vocab_start,  # the shard's first column in the whole vocabulary
    V: tl.constexpr,  # the shard's columns: a model's constant (and the interpreter ranges over constexprs only)
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
    target = tl.load(targets_ptr + row) - vocab_start
    held = (target >= 0) & (target < V)
    z_t = tl.load(base + tl.where(held, target, 0)).to(tl.float32) * inv_temperature
    tl.store(max_ptr + row, m)
    tl.store(log_sum_ptr + row, tl.log(s))
    tl.store(mean_ptr + row, u / s)
    tl.store(target_ptr + row, tl.where(held, z_t, 0.0))


@triton.jit
def _backward_kernel(
    logits_ptr,  # [M, V]: read, then overwritten with d logits
    targets_ptr,  # [M] int64, over the whole vocabulary
    grad_logprob_ptr,  # [M] fp32
    grad_entropy_ptr,  # [M] fp32
    max_ptr,  # [M] fp32: the row's M over every shard
    log_sum_ptr,  # [M] fp32: its log S
    entropy_ptr,  # [M] fp32: H
    inv_temperature,
    stride,
    vocab_start,
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
    target = tl.load(targets_ptr + row) - vocab_start  # outside [0, V) where another shard holds it
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        real = cols < V
        x = tl.load(base + cols, mask=real, other=0.0)
        log_p = (x.to(tl.float32) * inv_temperature - m) - log_s  # exact near the max, as lse rounded is not
        p = tl.exp(log_p)
        dz = -g_lp * p - g_ent * p * (log_p + h)
        dz = tl.where(cols == target, dz + g_lp, dz)
        tl.store(base + cols, (dz * inv_temperature).to(x.dtype), mask=real)


def _scores(logits: Tensor, targets: Tensor, temperature: float, group: TPGroup) -> tuple[Tensor, ...]:
    """(logprobs, entropy, M, log S) of each row of this shard's logits [M, V], combined over `group`."""
    rows, vocab = logits.shape
    m, log_s, mean, z_t = (torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(4))
    if rows:
        _forward_kernel[(rows,)](
            logits, targets, m, log_s, mean, z_t, 1.0 / temperature, logits.stride(0), group.rank * vocab,
            V=vocab, BLOCK=BLOCK_V,
        )  # fmt: skip
    if group.size > 1:  # each shard's softmax rescaled to the row's max over all of them
        top = m.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group.group)
        weight = torch.exp(m - top + log_s)  # s e^(m - M)
        sums = torch.stack([weight, weight * (mean + m - top), z_t])
        dist.all_reduce(sums, group=group.group)
        m, log_s, mean, z_t = top, torch.log(sums[0]), sums[1] / sums[0], sums[2]
    return z_t - (m + log_s), log_s - mean, m, log_s


class _HeadScores(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, group: TPGroup):
        logprobs, entropy, m, log_s = _scores(F.linear(hidden, weight), targets, temperature, group)
        ctx.save_for_backward(hidden, weight, targets, m, log_s, entropy)
        ctx.temperature, ctx.group = temperature, group
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
                grads, targets, grad_logprobs, grad_entropy, m, log_s, entropy, 1.0 / ctx.temperature,
                grads.stride(0), ctx.group.rank * vocab, V=vocab, BLOCK=BLOCK_V,
            )  # fmt: skip
        grad_hidden = grads @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grads.t() @ hidden if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None, None, None


def head_scores(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0, group: TPGroup | None = None
) -> tuple[Tensor, Tensor]:
    """Log-prob of each target [M] int64 and the entropy at each of hidden [M, H] under the head weight [V, H]
    (this rank's [V / size, H] of a vocabulary-parallel head over `group`) at `temperature`: [M] and [M],
    float32 (see the module)."""
    group = group or TPGroup(1, 0)
    hidden, targets = hidden.contiguous(), targets.contiguous()
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _HeadScores.apply(copy_to(hidden, group), weight, targets, temperature, group)
    logprobs, entropy, _, _ = _scores(F.linear(hidden, weight), targets, temperature, group)
    return logprobs, entropy
