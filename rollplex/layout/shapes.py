"""Model shapes in bytes: parameter families, parameters per TP rank, KV and activation bytes per token.

Pure arithmetic over a `ModelConfig`; no torch. Conventions: BF16 weights and activations (2 bytes),
flash attention (no score matrix saved); a rank holds its heads' and its MLP slice's activations, and the
hidden-sized ones whole, or split over the TP ranks under sequence parallelism (`sp`); the vision encoder
replicated on every GPU of a role.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from rollplex.models.config import TextConfig, VisionConfig

BF16, FP32 = 2, 4


class Sharding(Enum):
    REPLICATED = "replicated"
    COLUMN = "column"  # output features (dim 0) split over ranks
    ROW = "row"  # input features (dim 1) split over ranks


@dataclass(frozen=True, slots=True)
class ParamFamily:
    """One kind of LLM parameter, e.g. every layer's fused QKV weight."""

    name: str
    shape: tuple[int, ...]
    count: int  # how many tensors of this family (layers)
    sharding: Sharding

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def params(self) -> int:
        return self.numel * self.count


def shares(num_prompts: int, num_replicas: int) -> list[range]:
    """Each rollout replica's prompts (`parallel.split_rollout`): contiguous, near-equal shares in replica order (the
    first ones one prompt longer when uneven)."""
    base, extra = divmod(num_prompts, num_replicas)
    bounds = [0]
    for j in range(num_replicas):
        bounds.append(bounds[-1] + base + (j < extra))
    return [range(bounds[j], bounds[j + 1]) for j in range(num_replicas)]


def kv_heads_per_rank(t: TextConfig, tp: int) -> int:
    """KV heads a TP rank holds; when TP exceeds the KV heads, each rank holds one replicated head."""
    return max(1, t.num_key_value_heads // tp)


def llm_families(t: TextConfig) -> list[ParamFamily]:
    h, i, d, L = t.hidden_size, t.intermediate_size, t.head_dim, t.num_hidden_layers
    qkv_rows = (t.num_attention_heads + 2 * t.num_key_value_heads) * d
    families = [
        ParamFamily("embed_tokens", (t.vocab_size, h), 1, Sharding.COLUMN),
        ParamFamily("qkv.weight", (qkv_rows, h), L, Sharding.COLUMN),
        ParamFamily("qkv.bias", (qkv_rows,), L, Sharding.COLUMN),
        ParamFamily("o_proj", (h, t.num_attention_heads * d), L, Sharding.ROW),
        ParamFamily("gate_up", (2 * i, h), L, Sharding.COLUMN),
        ParamFamily("down_proj", (h, i), L, Sharding.ROW),
        ParamFamily("norms", (h,), 2 * L + 1, Sharding.REPLICATED),
    ]
    if not t.tie_word_embeddings:
        families.append(ParamFamily("lm_head", (t.vocab_size, h), 1, Sharding.COLUMN))
    return families


def family_params_per_rank(f: ParamFamily, t: TextConfig, tp: int) -> int:
    """Parameters of the family one TP rank holds (all `count` tensors)."""
    if f.sharding is Sharding.REPLICATED:
        return f.params
    if f.name.startswith("qkv"):
        rows = (t.num_attention_heads // tp + 2 * kv_heads_per_rank(t, tp)) * t.head_dim
        return rows * (f.shape[1] if len(f.shape) > 1 else 1) * f.count
    return f.params // tp


def llm_params(t: TextConfig) -> int:
    return sum(f.params for f in llm_families(t))


def llm_params_per_rank(t: TextConfig, tp: int) -> int:
    return sum(family_params_per_rank(f, t, tp) for f in llm_families(t))


def decode_params_per_rank(t: TextConfig, tp: int) -> int:
    """The parameters a decode step reads whole on one TP rank: all of the language model's but an untied input
    embedding, of which a step gathers one row a sequence (a tied one is the LM head's, read whole)."""
    gathered = [f for f in llm_families(t) if f.name == "embed_tokens" and not t.tie_word_embeddings]
    return llm_params_per_rank(t, tp) - sum(family_params_per_rank(f, t, tp) for f in gathered)


def value_model_params_per_rank(t: TextConfig, tp: int) -> int:
    """A value model's (PPO's critic, `rollplex.models.values`): the language model's parameters with a scalar head
    (hidden + 1) in place of the LM head; where the config ties the head to the embedding, the embedding stays."""
    head = sum(family_params_per_rank(f, t, tp) for f in llm_families(t) if f.name == "lm_head")
    return llm_params_per_rank(t, tp) - head + t.hidden_size + 1


def vision_params(v: VisionConfig, *, stored: bool = False) -> int:
    """Parameters of the vision encoder as transformers has them, or `stored` as the runtime holds them (its MLP
    width padded: `VisionMLP`)."""
    hv, iv = v.hidden_size, v.stored_intermediate_size if stored else v.intermediate_size
    patch = v.in_channels * v.temporal_patch_size * v.patch_size**2 * hv
    block = 2 * hv + (3 * hv * hv + 3 * hv) + (hv * hv + hv) + (3 * hv * iv + 2 * iv + hv)
    merged = hv * v.merge_unit
    merger = hv + (merged * merged + merged) + (merged * v.out_hidden_size + v.out_hidden_size)
    return patch + v.depth * block + merger


PROMPT_LEN_QUANTUM = 1024  # prompt KV capacity grows in steps of this (or the next power of two below it)


def prompt_capacity(tokens: int) -> int:
    """The rollout engine's prompt KV capacity for prompts of up to `tokens`: a multiple of 1024 or of the next
    power of two below it, so that a few capacities serve every batch."""
    quantum = min(PROMPT_LEN_QUANTUM, 1 << max(tokens - 1, 0).bit_length())
    return -(-tokens // quantum) * quantum


def kv_bytes_per_token(t: TextConfig, tp: int) -> int:
    """K and V of every layer for one token on one TP rank, BF16."""
    return 2 * t.num_hidden_layers * kv_heads_per_rank(t, tp) * t.head_dim * BF16


def layer_activation_bytes_per_token(t: TextConfig, tp: int, sp: bool = False) -> int:
    """Saved tensors of one decoder layer per token on one rank: two norm inputs and the QKV and MLP inputs
    (hidden-sized: whole on every rank, or split over the TP ranks under sequence parallelism `sp`), and this
    rank's heads of q, k, v and the attention output (flash attention), and its part of the gate/up output and
    the down-projection input."""
    d = t.head_dim
    sharded = t.num_attention_heads * d * 2 + 3 * t.intermediate_size
    replicated = 4 * t.hidden_size * BF16
    return (replicated // tp if sp else replicated) + (sharded * BF16) // tp + 2 * kv_heads_per_rank(t, tp) * d * BF16


def output_activation_bytes_per_token(t: TextConfig, tp: int, sp: bool = False, value: bool = False) -> int:
    """The final norm input (whole on every rank, or split under sequence parallelism), what the head keeps for its
    backward (`head_saved_bytes_per_token`), its log-prob and entropy outputs, and in backward the head input's
    gradient twice (each chunk's, whole-sized, and autograd's running sum); a `value` model's scalar head keeps its
    input and one scalar instead, with the same two input gradients."""
    norm_input = t.hidden_size * BF16 // (tp if sp else 1)
    if value:
        return norm_input + 3 * t.hidden_size * BF16 + BF16
    return norm_input + head_saved_bytes_per_token(t) + 2 * FP32 + 2 * t.hidden_size * BF16


def head_saved_bytes_per_token(t: TextConfig) -> int:
    """What the fused LM-head scores keep per token for backward (`kernels.token_scores`): the head's input (the
    norm's output, whole on every rank), the row's max, log-sum and entropy, and the target."""
    return t.hidden_size * BF16 + 3 * FP32 + 8


LOGIT_CHUNK_BYTES = 1 << 30  # logits of one chunk of tokens in `models.scores.token_scores`


def head_chunk_bytes(t: TextConfig, tp: int, tokens: int) -> int:
    """What the LM head's scores over `tokens` hold at once beside the per-token tensors, on the fused kernels (a
    GPU's path; eager torch, the CPU's, holds a few FP32 copies of a chunk): one chunk's logits (at most
    LOGIT_CHUNK_BYTES; in backward recomputed and turned into their gradient in place) and two gradients of this
    rank's head weight (a chunk's and autograd's running sum)."""
    vocab = -(-t.vocab_size // tp)
    return min(LOGIT_CHUNK_BYTES, tokens * vocab * BF16) + 2 * vocab * t.hidden_size * BF16


def vision_activation_bytes_per_patch(v: VisionConfig, tp: int) -> int:
    """Saved tensors of one vision block per patch: the tower is replicated on every rank of a role, so `tp`
    divides nothing."""
    elems = 4 * v.hidden_size + 4 * v.hidden_size + 3 * v.stored_intermediate_size
    return elems * BF16


def prefix_saved_bytes_per_token(t: TextConfig, tp: int, sp: bool = False, recompute: bool = True) -> int:
    """What the attached prefix keeps for its backward per prompt token on one rank: each decoder layer's input
    (`recompute`: its unit reruns in backward) or all its saved tensors, and the final norm's input (the norm runs
    over every prompt token before the boundary takes each prompt's last)."""
    per_layer = layer_input_bytes_per_token(t, tp, sp) if recompute else layer_activation_bytes_per_token(t, tp, sp)
    return t.num_hidden_layers * per_layer + layer_input_bytes_per_token(t, tp, sp)


def attention_saved_bytes_per_token(t: TextConfig, tp: int, keys: bool) -> int:
    """What one decoder layer's attention (flash, cuDNN or FlexAttention) saves for its backward per query token
    on one rank: this rank's heads of q and of the output, and their log-sum-exp in FP32; with `keys`, also the
    token's k and v (the split suffix's are among the keys it attends, counted with the prompts')."""
    heads = t.num_attention_heads // tp
    kv = 2 * kv_heads_per_rank(t, tp) * t.head_dim * BF16 if keys else 0
    return 2 * heads * t.head_dim * BF16 + heads * FP32 + kv


def layer_input_bytes_per_token(t: TextConfig, tp: int, sp: bool = False) -> int:
    """What full recompute keeps per layer: the layer's input, the whole hidden state on every rank (split over
    the TP ranks under sequence parallelism)."""
    return t.hidden_size * BF16 // (tp if sp else 1)
