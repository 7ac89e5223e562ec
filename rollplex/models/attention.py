"""Attention cores of the language decoder, and the exact merge of attention computed over two sets of keys.

A decoder layer projects and rotates q, k, v, then hands them to an `Attention`:
- `CausalAttention`: self-attention over right-padded whole sequences (full forward, prompt prefill). It can
  record each layer's K and V: the boundary KV of a prefix (`prompt_rows.PackedPromptKV` where the prefix's
  layers run over packed prompts).
- `PackedPrefixAttention`: scoring. The tokens of many responses, of any prompts, packed end to end
  (`rollplex.models.packed`), attend to their prompt's boundary KV (one copy, shared by every response that
  reads it) and causally to their own response, in one masked call per layer: the result equals attention
  over prompt ++ response, and autograd sums the responses' gradients into the one boundary KV.
- `SharedPrefixAttention`: decode with a cache. The N samples' new tokens attend to their prompt's KV and to
  their own cache apart, and the two are merged exactly through their log-sum-exp (the cascade / merge-state
  trick), never expanding the prompt KV.
Where SDPA runs on cuDNN, the causal calls pad their length to `attention_length` buckets: cuDNN plans every
new shape on the host and every step of a run brings new prompt lengths; padded, a run meets a few lengths per
octave and plans each once, so after the first steps the prefix calls stop paying for plans.
Not here: projections and rotary (`decoder.py`), where the boundary comes from (`model.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from rollplex.models.inputs import to_device

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

    from rollplex.models.boundary import Boundary
    from rollplex.models.cache import ResponseCache
    from rollplex.models.packed import ResponsePack


class Attention(Protocol):
    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [B, heads, T, D], k/v [B, kv_heads, T, D] of the new tokens -> output [B, heads, T, D]."""
        ...


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax attention that also returns each query's log-sum-exp of scores.

    q [..., Q, D], k/v [..., K, D] and mask [..., Q, K] (True = may attend) broadcast over leading dims.
    Returns out [..., Q, D] in v's dtype and lse [..., Q] float32. Every query must see at least one key.
    Materialises the [..., Q, K] scores: for decode steps (Q = 1); scoring goes through `PackedPrefixAttention`.
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


FLEX_BLOCK = 128  # FlexAttention's block of queries and of keys
MASK_BAND_ELEMENTS = 1 << 26  # mask elements evaluated at once while building a block mask


class PackedPrefixAttention:
    """Attention of a `ResponsePack`'s tokens (q [1, heads, M, D], k/v [1, kv_heads, M, D]) over their prompts'
    boundary KV and the earlier tokens of their own response: token for token, attention over prompt ++ response.

    One call per layer sees the keys [used prompts' boundary KV, end to end; the packed tokens' own], each
    prompt's KV once however many responses read it (autograd sums their gradients into it). The mask says who
    sees whom (`visibility`). On a GPU the call is FlexAttention (compiled once, for every length) with a block
    mask, so the prompts' KV blocks a query block cannot see are skipped, not computed and masked; elsewhere it
    is SDPA with the mask made dense.
    """

    def __init__(self, boundary: Boundary, pack: ResponsePack) -> None:
        self.boundary = boundary
        device = pack.index.device
        used = sorted(set(pack.rows))
        used_rows = to_device(torch.tensor(used, dtype=torch.long), device)
        self.used = None if used == list(range(boundary.num_prompts)) else used_rows
        prompt_lens = boundary.prompt_lens if self.used is None else boundary.prompt_lens.index_select(0, self.used)
        span = boundary.max_prompt_len
        real = torch.arange(span, device=device) < prompt_lens[:, None]  # [U, S]
        owner = used_rows[:, None].expand(-1, span)
        prompt_keys = torch.where(real, owner, -1).flatten()  # [U*S]: the prompt of each real prompt key, else -1
        own_keys = torch.full((pack.num_tokens,), -1, device=device)
        no_row = torch.full((prompt_keys.numel(),), -1, device=device)
        self.num_queries, self.num_keys = pack.num_tokens, prompt_keys.numel() + pack.num_tokens
        # per query and per key, padded to whole blocks with values that match nothing
        queries = [_padded(t, -2) for t in (pack.prompt, pack.owner, pack.offset)]
        keys = [_padded(torch.cat(parts), -1) for parts in ((prompt_keys, own_keys), (no_row, pack.owner),
                                                             (no_row, pack.offset))]  # fmt: skip
        self.padded_lengths = (queries[0].numel(), keys[0].numel())
        self.visible = visibility(*queries, *keys)
        self.flex = device.type == "cuda"
        self.mask = self._block_mask() if self.flex else self._dense_mask()

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        keys = torch.cat([self._prompt_kv(self.boundary.keys[layer]), k], dim=2)  # [1, G, U*S + M, D]
        values = torch.cat([self._prompt_kv(self.boundary.values[layer]), v], dim=2)
        if self.flex:
            return _compiled_flex()(
                q, keys, values, block_mask=self.mask, enable_gqa=True, kernel_options=_flex_options(q.device)
            )
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, enable_gqa=True)

    def _prompt_kv(self, x: Tensor) -> Tensor:
        """A layer's boundary K or V [P, G, S, D] -> the used prompts' end to end, [1, G, U*S, D]."""
        used = x if self.used is None else x.index_select(0, self.used)  # unique indices: a deterministic backward
        return used.transpose(0, 1).flatten(1, 2)[None]

    def _dense_mask(self) -> Tensor:
        """[M, K] bool: `visible` at every query and key."""
        q = torch.arange(self.num_queries, device=self.boundary.prompt_lens.device)
        kv = torch.arange(self.num_keys, device=q.device)
        return self.visible(None, None, q[:, None], kv[None, :])

    def _block_mask(self) -> BlockMask:
        """The FlexAttention block mask of `visible`: the mask evaluated a band of query blocks at a time (bounded
        memory, no compile), each FLEX_BLOCK x FLEX_BLOCK block then kept as full (every pair visible), partial
        (some) or skipped. torch's `create_block_mask` would hold the whole [M, K] mask at once, or compile."""
        from torch.nn.attention.flex_attention import BlockMask

        b, device = FLEX_BLOCK, self.boundary.prompt_lens.device
        q_blocks, kv_blocks = (n // b for n in self.padded_lengths)
        kv = torch.arange(kv_blocks * b, device=device)
        band = max(1, MASK_BAND_ELEMENTS // (kv_blocks * b * b))
        partial, full = [], []
        for start in range(0, q_blocks, band):
            q = torch.arange(start * b, min(q_blocks, start + band) * b, device=device)
            blocks = self.visible(None, None, q[:, None], kv[None, :]).view(-1, b, kv_blocks, b)
            seen, whole = blocks.any(3).any(1), blocks.all(3).all(1)  # [band, kv_blocks]
            partial.append(seen & ~whole)
            full.append(whole)

        def listed(chosen: list[Tensor]) -> tuple[Tensor, Tensor]:
            chosen = torch.cat(chosen)[None, None]  # [1, 1, q_blocks, kv_blocks]
            order = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True)  # the chosen blocks first
            return chosen.sum(-1, dtype=torch.int32), order.to(torch.int32)

        (counts, indices), (full_counts, full_indices) = listed(partial), listed(full)
        return BlockMask.from_kv_blocks(
            counts, indices, full_counts, full_indices, BLOCK_SIZE=b, mask_mod=self.visible,
            seq_lengths=(self.num_queries, self.num_keys),
        )  # fmt: skip


def visibility(
    q_prompt: Tensor, q_row: Tensor, q_offset: Tensor, kv_prompt: Tensor, kv_row: Tensor, kv_offset: Tensor
) -> Callable[..., Tensor]:
    """The mask_mod of packed responses: query q sees key kv of its own prompt, or of its own response at or
    before its offset. A closure over plain tensors, as FlexAttention traces it (index tensors that broadcast)."""

    def visible(_batch, _head, q: Tensor, kv: Tensor) -> Tensor:
        same_prompt = kv_prompt[kv] == q_prompt[q]
        earlier_in_own = (kv_row[kv] == q_row[q]) & (kv_offset[kv] <= q_offset[q])
        return same_prompt | earlier_in_own

    return visible


def _padded(t: Tensor, fill: int) -> Tensor:
    """t [n] with `fill` appended up to a whole number of FLEX_BLOCKs."""
    return F.pad(t, (0, -t.numel() % FLEX_BLOCK), value=fill)


@cache
def _flex_options(device: torch.device) -> dict[str, bool]:
    """FlexAttention's kernel options on `device`: on Hopper or newer its loads go through the Tensor Memory
    Accelerator: the same numbers, faster at the packed suffix's shapes (`bench/flex_suffix.py`)."""
    return {"USE_TMA": True} if torch.cuda.get_device_capability(device) >= (9, 0) else {}


@cache
def _compiled_flex() -> Callable[..., Tensor]:
    """FlexAttention compiled for any lengths (its eager form is a slow reference and has no CPU backward)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


class SharedPrefixAttention:
    """Attention of decode's new tokens, P prompts x N samples (batch row p * N + n), over a shared boundary and
    each response's cache: the tokens continue the responses after the cache's tokens, which they also see."""

    def __init__(self, boundary: Boundary, num_samples: int, cache: ResponseCache) -> None:
        self.boundary = boundary
        self.num_samples = num_samples
        self.cache = cache

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
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
