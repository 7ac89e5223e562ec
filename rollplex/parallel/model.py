"""A Qwen2.5-VL trained at tensor-parallel degree t: shard a full model in place, and materialise it back.

`parallelize` swaps the language decoder's projections, embedding and LM head of a full `Qwen2_5_VL` for this
rank's Megatron-layout shards (`layers.py`, `layout.py`); the norms and the vision encoder stay replicated, as
in Megatron without sequence parallelism (their gradients agree on every rank because the residual stream's
gradient is all-reduced at each column-parallel input). Every method of `Qwen2_5_VL` then runs at TP t
unchanged, with every rank of the group calling it on the same inputs. `full_state` gathers the shards into the
full tensors under HF names: the oracle that TP runs and the rollout binding are tested against.

With `sequence_parallel` (Megatron's), the decoder's rows are split over the group from its first layer through
its final norm (`SequenceShards`): each rank keeps ceil(T / t) rows of every hidden-sized activation, the
residual stream and the norms run on them, and the TP layers gather and reduce-scatter at their borders.
Training only: a rollout replica (`bind.py`) builds its own layers and keeps the whole rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from rollplex.models.decoder import SelfAttention, SequenceRegion
from rollplex.models.model import Qwen2_5_VL
from rollplex.parallel import layout
from rollplex.parallel.group import TPGroup, leave_sequence, scatter_sequence
from rollplex.parallel.layers import (
    ParallelMLP,
    ParallelSelfAttention,
    QKVOrder,
    SequenceParallelNorm,
    VocabParallelEmbedding,
    VocabParallelHead,
)


@dataclass(frozen=True)
class SequenceShards(SequenceRegion):
    """The decoder's rows split over `group` (sequence parallelism): `enter` keeps this rank's, `leave` gathers."""

    group: TPGroup

    def enter(self, x: Tensor) -> Tensor:
        return scatter_sequence(x, self.group)

    def leave(self, x: Tensor, length: int) -> Tensor:
        return leave_sequence(x, self.group, length)


@torch.no_grad()
def parallelize(model: Qwen2_5_VL, group: TPGroup, *, sequence_parallel: bool = False) -> Qwen2_5_VL:
    """Replaces the decoder's sharded tensors by rank `group.rank`'s shards (copies; the full ones are freed);
    with `sequence_parallel`, splits the decoder's rows over the group too (`SequenceShards`)."""
    sp = sequence_parallel and group.size > 1
    t, tp, rank = model.config.text, group.size, group.rank
    layout.check_train_tp(t, tp)
    lm = model.model.language_model
    qkv_rows, gate_up_rows = layout.qkv_rows(t, tp, rank), layout.gate_up_rows(t, tp, rank)
    for layer in lm.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(attn, SelfAttention), "the model is parallelized already"
        qkv_w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        qkv_b = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
        layer.self_attn = ParallelSelfAttention(
            qkv_w[qkv_rows.to(qkv_w.device)], qkv_b[qkv_rows.to(qkv_b.device)],
            layout.row_parallel_slab(attn.o_proj.weight, tp, rank), t.num_attention_heads // tp,
            t.num_key_value_heads // tp, t.head_dim, QKVOrder.INTERLEAVED, group, trainable=True, sequence_parallel=sp,
        )  # fmt: skip
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])[gate_up_rows.to(qkv_w.device)]
        down = layout.row_parallel_slab(mlp.down_proj.weight, tp, rank)
        layer.mlp = ParallelMLP(gate_up, down, 1, group, trainable=True, sequence_parallel=sp)
        if sp:
            layer.input_layernorm = SequenceParallelNorm(layer.input_layernorm, group)
            layer.post_attention_layernorm = SequenceParallelNorm(layer.post_attention_layernorm, group)
    if sp:
        lm.norm, lm.region = SequenceParallelNorm(lm.norm, group), SequenceShards(group)
    vocab = group.shard(t.vocab_size)
    embed = lm.embed_tokens.weight[vocab.start : vocab.stop].clone()  # not a view: the full table must go
    lm.embed_tokens = VocabParallelEmbedding(embed, vocab.start, group, trainable=True)
    if t.tie_word_embeddings:
        model.lm_head = VocabParallelHead(lm.embed_tokens.weight, group, trainable=True)
    else:
        head = model.lm_head.weight[vocab.start : vocab.stop].clone()
        model.lm_head = VocabParallelHead(head, group, trainable=True)
    return model


def sharded_parameters(model: Qwen2_5_VL) -> set[int]:
    """ids of the parameters that differ between ranks (the rest is replicated: norms, vision encoder)."""
    kinds = (ParallelSelfAttention, ParallelMLP, VocabParallelEmbedding, VocabParallelHead)
    return {id(p) for m in model.modules() if isinstance(m, kinds) for p in m.parameters(recurse=False)}


@torch.no_grad()
def load_sharded(model: Qwen2_5_VL, directory, group: TPGroup) -> None:
    """Copies this rank's shards of an HF checkpoint into a parallelized model, in place (bound views stay)."""
    from rollplex.models.checkpoint import load_checkpoint

    full = Qwen2_5_VL(model.config, dtype=model.lm_head.weight.dtype, device="cpu")
    load_checkpoint(full, directory)
    shards = parallelize(full, group)
    mine, theirs = list(model.named_parameters()), list(shards.named_parameters())
    assert [n for n, _ in mine] == [n for n, _ in theirs], "the model and the checkpoint's shards differ in structure"
    for (_, p), (_, shard) in zip(mine, theirs, strict=True):
        p.copy_(shard)


def _gather(x: Tensor, group: TPGroup, dst: int | None) -> list[Tensor] | None:
    """Every rank's `x` in rank order: on every rank (dst None) or only on group rank `dst` (None elsewhere)."""
    if group.size == 1:
        return [x]
    x = x.contiguous()
    receive = dst is None or group.rank == dst
    parts = [torch.empty_like(x) for _ in range(group.size)] if receive else None
    if dst is None:
        dist.all_gather(parts, x, group=group.group)
    else:
        dist.gather(x, parts, dst=dist.get_global_rank(group.group, dst), group=group.group)
    return parts


@torch.no_grad()
def full_state(model: Qwen2_5_VL, group: TPGroup, *, dst: int | None = None, to_host: bool = False) -> dict:
    """HF-named full tensors of a parallelized model (collective: every rank of the group calls it). With `dst`,
    only that group rank receives them (the others get {}): what a checkpoint needs, without a full copy on
    every GPU; `to_host` moves each tensor to the CPU as soon as it is whole."""
    t, tp = model.config.text, group.size
    lm = model.model.language_model
    prefix = "model.language_model"
    qkv_rows = [layout.qkv_rows(t, tp, r) for r in range(tp)]
    gate_up_rows = [layout.gate_up_rows(t, tp, r) for r in range(tp)]
    q, kv, i = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim, t.intermediate_size
    receive = dst is None or group.rank == dst
    state = {n: p.detach() for n, p in model.named_parameters() if not n.startswith(("lm_head", f"{prefix}.layers"))}
    state |= {n: p.detach() for n, p in lm.layers.named_parameters(prefix=f"{prefix}.layers") if "layernorm" in n}
    for index, layer in enumerate(lm.layers):
        at, attn, mlp = f"{prefix}.layers.{index}", layer.self_attn, layer.mlp
        tensors = (attn.qkv_weight, attn.qkv_bias, attn.o_slab, mlp.gate_up, mlp.down_slab)
        qkv_w, qkv_b, o, gate_up, down = (_gather(x, group, dst) for x in tensors)
        if not receive:
            continue
        w = layout.scatter_rows(qkv_w, qkv_rows, q + 2 * kv)
        b = layout.scatter_rows(qkv_b, qkv_rows, q + 2 * kv)
        for name, rows in zip(("q_proj", "k_proj", "v_proj"), w.split([q, kv, kv]), strict=True):
            state[f"{at}.self_attn.{name}.weight"] = rows
        for name, rows in zip(("q_proj", "k_proj", "v_proj"), b.split([q, kv, kv]), strict=True):
            state[f"{at}.self_attn.{name}.bias"] = rows
        state[f"{at}.self_attn.o_proj.weight"] = torch.cat(o).t()
        gate, up = layout.scatter_rows(gate_up, gate_up_rows, 2 * i).split([i, i])
        state[f"{at}.mlp.gate_proj.weight"], state[f"{at}.mlp.up_proj.weight"] = gate, up
        state[f"{at}.mlp.down_proj.weight"] = torch.cat(down).t()
        if to_host:  # this layer's full tensors leave the GPU now
            state |= {n: v.cpu() for n, v in state.items() if n.startswith(f"{at}.")}
    embed = _gather(lm.embed_tokens.weight, group, dst)
    head = None if t.tie_word_embeddings else _gather(model.lm_head.weight, group, dst)
    if not receive:
        return {}
    state[f"{prefix}.embed_tokens.weight"] = torch.cat(embed)
    if head is not None:
        state["lm_head.weight"] = torch.cat(head)
    return {n: v.cpu() for n, v in state.items()} if to_host else state  # .cpu() of a host tensor is itself


def materialise(model: Qwen2_5_VL, group: TPGroup) -> Qwen2_5_VL:
    """A fresh full model holding the parallelized model's weights (collective)."""
    state = full_state(model, group)
    fresh = Qwen2_5_VL(model.config, dtype=model.lm_head.weight.dtype, device=model.device)
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return fresh
