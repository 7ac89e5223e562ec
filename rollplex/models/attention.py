"""Attention cores of the language decoder, and the exact merge of attention computed over two sets of keys.

A decoder layer projects and rotates q, k, v, then hands them to an `Attention`:
- `CausalAttention`: self-attention over right-padded whole sequences (full forward, prompt prefill). It can
  record each layer's K and V: the boundary KV of a prefix.
- `SharedPrefixAttention`: the response tokens of N samples per prompt attend to their prompt's boundary KV
  (one copy, shared by the group) and to their own response KV (causal), so the result equals attention over
  prompt ++ response and autograd sums the group's gradients into the one boundary KV. Scoring whole
  responses runs one masked SDPA call over [prompt KV repeated per sample for the call; own KV] (fused,
  memory-efficient kernels on a GPU); decoding with a cache computes the two parts apart and merges them
  exactly through their log-sum-exp (the cascade / merge-state trick), never expanding the prompt KV.
Where SDPA runs on cuDNN, the causal calls pad their length to `attention_length` buckets: cuDNN plans every
new shape on the host and every step of a run brings new prompt lengths; padded, a run meets a few lengths per
octave and plans each once, so after the first steps the prefix calls stop paying for plans. The scoring calls
are not padded: their shapes (rows, response length, prompt + response length) seldom repeat from step to step
even padded, so there the padding costs more than it saves.
Not here: projections and rotary (`decoder.py`), where the boundary comes from (`model.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

if TYPE_CHECKING:
    from rollplex.models.boundary import Boundary
    from rollplex.models.cache import ResponseCache


class Attention(Protocol):
    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [B, heads, T, D], k/v [B, kv_heads, T, D] of the new tokens -> output [B, heads, T, D]."""
        ...


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax attention that also returns each query's log-sum-exp of scores.

    q [..., Q, D], k/v [..., K, D] and mask [..., Q, K] (True = may attend) broadcast over leading dims.
    Returns out [..., Q, D] in v's dtype and lse [..., Q] float32. Every query must see at least one key.
    Materialises the [..., Q, K] scores: for decode steps (Q = 1); scoring whole responses goes through SDPA.
    """
    scores = (q @ k.transpose(-1, -2)).float() * q.shape[-1] ** -0.5  # [..., Q, K]
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = scores.logsumexp(dim=-1)
    probs = torch.exp(scores - lse[..., None])
    return probs.to(v.dtype) @ v, lse


def merge_attention(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tensor:
    """Attention over keys A ∪ B from the attention over A and over B: out [..., Q, D], lse [..., Q]."""
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse)[..., None]
    weight_b = torch.exp(lse_b - lse)[..., None]
    return (out_a.float() * weight_a + out_b.float() * weight_b).to(out_a.dtype)


BUCKETS_PER_OCTAVE = 16  # padded lengths per power of two: at most 1/16 more tokens than the call has


def attention_length(n: int) -> int:
    """`n` rounded up to a multiple of 1/BUCKETS_PER_OCTAVE of the power of two at or below it (n <= 16: n)."""
    if n <= BUCKETS_PER_OCTAVE:
        return n
    step = (1 << (n.bit_length() - 1)) // BUCKETS_PER_OCTAVE
    return -(-n // step) * step


def plans_per_shape(device: torch.device) -> bool:
    """Whether SDPA on `device` may run on cuDNN, which plans each new shape (`run.cudnn_attention`)."""
    return device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled()


def causal_sdpa(q: Tensor, k: Tensor, v: Tensor, *, bucketed: bool) -> Tensor:
    """Causal GQA attention q [B, heads, L, D] over k/v [B, kv_heads, L, D]. `bucketed`: the call runs at
    `attention_length(L)`, zeros appended; a real query sees no appended key (they come after it), and the
    appended queries' outputs are dropped, so the result is attention over the L tokens."""
    length = q.shape[2]
    extra = attention_length(length) - length if bucketed else 0
    if extra == 0:  # no copies of q, k and v
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    q, k, v = (F.pad(x, (0, 0, 0, extra)) for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[:, :, :length]


class CausalAttention:
    """Causal self-attention of right-padded sequences: a real token never sees the padding after it."""

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return causal_sdpa(q, k, v, bucketed=plans_per_shape(q.device))


class LayerKV(CausalAttention):
    """`CausalAttention` of a single layer call that keeps the call's (post-rotary) K and V [B, kv_heads, L, D]
    in `key` and `value`: the prefix returns them as the layer's outputs of their own (the boundary's KV). A
    checkpoint's rerun of the layer overwrites them here, never in the boundary."""

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.key, self.value = k, v
        return super().__call__(layer, q, k, v)


class SharedPrefixAttention:
    """Attention of response tokens, P prompts x N samples (batch row p * N + n), over a shared boundary.

    Without a cache, the new tokens are whole responses (or their first T tokens) and attend causally to each
    other; `rows` [B] (the prompt of each batch row) then lets a batch hold any responses of any prompts. With a
    `ResponseCache`, they continue the responses after the cache's tokens, which they also see.
    """

    def __init__(
        self, boundary: Boundary, num_samples: int, cache: ResponseCache | None = None, rows: Tensor | None = None
    ) -> None:
        if rows is not None and cache is not None:
            raise ValueError("rows: only without a cache (decode batches are P prompts x N samples)")
        self.boundary = boundary
        self.num_samples = num_samples
        self.cache = cache
        self.rows = rows
        self._pick: Tensor | None = None  # without a cache: the [B, P] one-hot row -> prompt of `_attend_joint`
        self._joint_mask: Tensor | None = None  # without a cache: the [B, 1, T, S + T] mask of `_attend_joint`

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.cache is None:
            return self._attend_joint(layer, q, k, v)
        k, v = self.cache.write(layer, k, v)
        out_prompt, lse_prompt = self._attend_prompt(layer, q)
        out_own, lse_own = self._attend_own(q, k, v)
        return merge_attention(out_prompt, lse_prompt, out_own, lse_own)

    def _attend_joint(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Whole responses (scoring): each sequence's queries [B, heads, T, D] over its prompt's KV then its own
        [B, G, T, D], in one fused SDPA call (flash-style kernels on a GPU, gradients included). The prompt's KV
        is gathered per row and repeated per head for the call only (the memory-efficient kernel takes a mask
        but no GQA): under autograd the call is checkpointed, so backward keeps q, k, v and the boundary, not
        the [B, heads, S + T, D] copies, and rebuilds them one layer at a time. Autograd sums the rows'
        gradients into the one copy of the prompt's KV."""
        keys, values = self.boundary.keys[layer], self.boundary.values[layer]  # [P, G, S, D]
        batch, _, num_tokens, _ = q.shape
        if self.rows is None:
            self.rows = torch.arange(keys.shape[0], device=q.device).repeat_interleave(self.num_samples)
        if self._pick is None:  # [B, P] one-hot: row b reads prompt rows[b]
            self._pick = F.one_hot(self.rows, keys.shape[0]).to(keys.dtype)
        if self._joint_mask is None:  # the same for every layer of the forward: built once
            prompt_keys = self.boundary.key_mask().index_select(0, self.rows)  # [B, S]
            own_keys = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=q.device).tril()  # causal
            self._joint_mask = torch.cat(
                [prompt_keys[:, None, :].expand(batch, num_tokens, -1), own_keys.expand(batch, -1, -1)], dim=-1
            )[:, None]  # [B, 1, T, S + T]
        tensors = (q, k, v, keys, values)
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return checkpoint(self._joint_sdpa, *tensors, use_reentrant=False)
        return self._joint_sdpa(*tensors)

    def _joint_sdpa(self, q: Tensor, k: Tensor, v: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        per_head = q.shape[1] // keys.shape[1]

        def joined(prompt: Tensor, own: Tensor) -> Tensor:
            # a one-hot matmul, not index_select: its backward sums a prompt's rows in a fixed order (index_add's
            # atomics on CUDA would make the boundary gradient differ from run to run); exact in every dtype
            picked = (self._pick @ prompt.flatten(1)).view(q.shape[0], *prompt.shape[1:])
            whole = torch.cat([picked, own], dim=2)
            return whole.repeat_interleave(per_head, dim=1)  # [B, heads, S + T, D]

        return F.scaled_dot_product_attention(q, joined(keys, k), joined(values, v), attn_mask=self._joint_mask)

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
