"""Attention cores of the language decoder, and the exact merge of attention computed over two sets of keys.

A decoder layer projects and rotates q, k, v, then hands them to an `Attention`:
- `CausalAttention`: self-attention over right-padded whole sequences (full forward, prompt prefill). It can
  record each layer's K and V: the boundary KV of a prefix.
- `SharedPrefixAttention`: the response tokens of N samples per prompt attend to their prompt's boundary KV
  (one copy, shared by the group, never expanded N times) and to their own response KV (causal). The two parts
  are computed apart and merged exactly through their log-sum-exp (the cascade / merge-state trick), so the
  result equals attention over prompt ++ response and autograd sums the group's gradients into the one
  boundary KV.
Not here: projections and rotary (`decoder.py`), where the boundary comes from (`model.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from rollplex.models.boundary import Boundary
    from rollplex.models.cache import ResponseCache


class Attention(Protocol):
    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [B, heads, T, D], k/v [B, kv_heads, T, D] of the new tokens -> output [B, heads, T, D]."""
        ...


SCORE_BLOCK_BYTES = 256 << 20  # FP32 scores of one block of queries: what attention holds beyond q, k, v, out


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax attention that also returns each query's log-sum-exp of scores.

    q [..., Q, D], k/v [..., K, D] and mask [..., Q or 1, K] (True = may attend) broadcast over leading dims.
    Returns out [..., Q, D] in v's dtype and lse [..., Q] float32. Every query must see at least one key.
    Memory-efficient, as the planner assumes (flash-style): queries go in blocks whose FP32 scores fit
    SCORE_BLOCK_BYTES, and backward recomputes a block's scores instead of saving them (q, k, v, out and lse
    are all it keeps); gradients flow through both out and lse (the merge of two attentions needs lse's).
    """
    return _BlockAttention.apply(q, k, v, mask)


def _block_rows(q: Tensor, k: Tensor) -> int:
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]).numel()
    return max(1, SCORE_BLOCK_BYTES // (4 * max(lead * k.shape[-2], 1)))


def _rows(mask: Tensor, start: int, end: int) -> Tensor:
    return mask if mask.shape[-2] == 1 else mask[..., start:end, :]


def _scores(q: Tensor, k: Tensor, mask: Tensor) -> Tensor:
    scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5  # [..., Qb, K]
    return scores.masked_fill(~mask, float("-inf"))


def _sum_to(x: Tensor, shape: torch.Size) -> Tensor:
    """x summed over the dimensions that were broadcast from `shape` (a gradient back to its input's shape)."""
    dims = [i for i, (a, b) in enumerate(zip(x.shape, shape, strict=True)) if b == 1 and a != 1]
    return x.sum(dims, keepdim=True) if dims else x


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        outs, lses, n = [], [], q.shape[-2]
        step = _block_rows(q, k)
        for start in range(0, max(n, 1), step):  # one (empty) block when there are no queries
            scores = _scores(q[..., start : start + step, :], k, _rows(mask, start, start + step))
            lse = scores.logsumexp(dim=-1)
            outs.append(torch.exp(scores - lse[..., None]).to(v.dtype) @ v)
            lses.append(lse)
        out, lse = torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)
        ctx.save_for_backward(q, k, v, mask, lse)
        ctx.set_materialize_grads(False)  # an output nothing reads gets no gradient work
        return out, lse

    @staticmethod
    def backward(ctx, d_out: Tensor | None, d_lse: Tensor | None):
        q, k, v, mask, lse = ctx.saved_tensors
        n, scale = q.shape[-2], q.shape[-1] ** -0.5
        step = _block_rows(q, k)
        dq_blocks = []
        dk = torch.zeros(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]) + k.shape[-2:], dtype=torch.float32,
                         device=k.device)  # fmt: skip
        dv = torch.zeros(dk.shape, dtype=torch.float32, device=v.device)
        for start in range(0, max(n, 1), step):  # one (empty) block when there are no queries
            end = min(start + step, n)
            qb = q[..., start:end, :]
            probs = torch.exp(_scores(qb, k, _rows(mask, start, end)) - lse[..., start:end, None])
            d_scores = torch.zeros_like(probs)
            if d_out is not None:
                dob = d_out[..., start:end, :]
                dv += probs.to(v.dtype).transpose(-1, -2) @ dob
                d_probs = (dob @ v.transpose(-1, -2)).float()
                d_scores += probs * (d_probs - (probs * d_probs).sum(-1, keepdim=True))
            if d_lse is not None:
                d_scores += probs * d_lse[..., start:end, None]
            d_scores = (d_scores * scale).to(q.dtype)
            dq_blocks.append(d_scores @ k)
            dk += d_scores.transpose(-1, -2) @ qb
        dq = _sum_to(torch.cat(dq_blocks, dim=-2), q.shape)
        return dq, _sum_to(dk, k.shape).to(k.dtype), _sum_to(dv, v.shape).to(v.dtype), None


def merge_attention(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tensor:
    """Attention over keys A ∪ B from the attention over A and over B: out [..., Q, D], lse [..., Q]."""
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse)[..., None]
    weight_b = torch.exp(lse_b - lse)[..., None]
    return (out_a.float() * weight_a + out_b.float() * weight_b).to(out_a.dtype)


class CausalAttention:
    """Causal self-attention of right-padded sequences: a real token never sees the padding after it.

    With `record`, keeps each layer's (post-rotary) K and V [B, kv_heads, L, D] in `keys` / `values`.
    """

    def __init__(self, *, record: bool = False) -> None:
        self.record = record
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.record:
            self.keys.append(k)
            self.values.append(v)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class SharedPrefixAttention:
    """Attention of response tokens, P prompts x N samples (batch row p * N + n), over a shared boundary.

    Without a cache, the new tokens are whole responses (or their first T tokens) and attend causally to each
    other. With a `ResponseCache`, they continue the responses after the cache's tokens, which they also see.
    """

    def __init__(self, boundary: Boundary, num_samples: int, cache: ResponseCache | None = None) -> None:
        self.boundary = boundary
        self.num_samples = num_samples
        self.cache = cache

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.cache is not None:
            k, v = self.cache.write(layer, k, v)
        out_prompt, lse_prompt = self._attend_prompt(layer, q)
        out_own, lse_own = self._attend_own(q, k, v)
        return merge_attention(out_prompt, lse_prompt, out_own, lse_own)

    def _attend_prompt(self, layer: int, q: Tensor) -> tuple[Tensor, Tensor]:
        """All N samples' queries against their prompt's one KV [P, G, S, D]; only padding is masked."""
        keys, values = self.boundary.keys[layer], self.boundary.values[layer]
        num_prompts, num_groups = keys.shape[:2]
        _, num_heads, num_tokens, head_dim = q.shape
        shape = (num_prompts, self.num_samples, num_groups, num_heads // num_groups, num_tokens, head_dim)
        grouped = q.view(shape).permute(0, 2, 3, 1, 4, 5).flatten(3, 4)  # [P, G, heads/G, N*T, D]
        mask = self.boundary.key_mask()[:, None, None, None, :]  # [P, 1, 1, 1, S]
        out, lse = attend(grouped, keys[:, :, None], values[:, :, None], mask)
        out = out.unflatten(3, (self.num_samples, num_tokens)).permute(0, 3, 1, 2, 4, 5)  # [P, N, G, heads/G, T, D]
        lse = lse.unflatten(3, (self.num_samples, num_tokens)).permute(0, 3, 1, 2, 4)  # [P, N, G, heads/G, T]
        return out.reshape(q.shape), lse.reshape(q.shape[:-1])

    def _attend_own(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Each sequence's queries [B, heads, T, D] against its own response KV [B, G, K >= T, D], causally."""
        batch, num_heads, num_tokens, head_dim = q.shape
        num_groups, num_keys = k.shape[1], k.shape[2]
        grouped = q.view(batch, num_groups, num_heads // num_groups, num_tokens, head_dim)
        query_at = torch.arange(num_keys - num_tokens, num_keys, device=q.device)
        mask = torch.arange(num_keys, device=q.device) <= query_at[:, None]  # [T, K]
        out, lse = attend(grouped, k[:, :, None], v[:, :, None], mask)
        return out.reshape(q.shape), lse.reshape(q.shape[:-1])
