"""Actor weights shared by the trainer (TP t) and a rollout replica (TP r = t / q) on the same GPUs.

On each GPU, the rollout shard this GPU serves (rollout rank k = training rank // q) lives in one rollout-sized
storage. The q training ranks k*q .. k*q+q-1 each own one region of every tensor in it, and their training
parameters *are* those regions (views): the optimizer writes straight into rollout's weights. After an update,
`publish()` all-gathers each tensor within the q ranks (in place: a rank sends its region and receives the
others), after which every GPU holds its rollout shard whole. How rollout reads each tensor follows the
planner's classification (`rollplex.layout.sharing.classify`): Case 1 tensors as they lie ([gate; up] blocks
through a view of the GEMM output), Case 2 (o_proj, down_proj) as stored transposed slabs, Case 3 (the fused
QKV when a rollout rank holds several query groups) either in place (Megatron order, split by a view, or the
permuted GEMM of `rollplex.kernels.qkv_gemm` in decode) or, on the paper's path, from a grouped copy rebuilt
by `publish()` (the QKV training shards then stay outside the storage, as in the paper). Norms and the vision
encoder are replicated: rollout reads the training modules themselves.

Lifecycle of one binding: `bind_rollout` (training shards move into their regions; build the optimizer after)
-> [training step -> `publish()` -> rollout] ...
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.distributed as dist
from torch import Tensor, nn

from rollplex.layout.shapes import llm_families
from rollplex.layout.sharing import Case, classify
from rollplex.memory.optimizer import Writer, copy_into
from rollplex.models.config import TextConfig
from rollplex.models.model import Qwen2_5_VL
from rollplex.parallel import layout
from rollplex.parallel.group import SINGLE, TPGroup, all_gather_async, all_gather_into, all_gather_many
from rollplex.parallel.layers import (
    ParallelMLP,
    ParallelSelfAttention,
    QKVOrder,
    VocabParallelEmbedding,
    VocabParallelHead,
)

ALIGN = 256  # bytes: every tensor of the storage starts on a GEMM-friendly boundary


class QKVPath(Enum):
    IN_PLACE = "in_place"  # rollout reads Megatron's interleaved QKV where the trainer wrote it
    COPY = "copy"  # the paper's Case 3: a grouped copy, rebuilt after each update


@dataclass(frozen=True)
class Region:
    """One tensor of the rollout shard ([q * n, ...]) and this rank's part of it ([n, ...], the training param)."""

    whole: Tensor
    part: Tensor


@dataclass(frozen=True)
class GroupedCopy:
    """A Case-3 copy (the paper's path): the training shard stays a plain tensor; after every update the q
    shards are gathered into a transient buffer and dst = gathered[index] (the grouped rollout layout)."""

    part: Tensor  # this rank's training shard, in Megatron order
    index: Tensor
    dst: Tensor


@dataclass(frozen=True)
class BoundRollout:
    """The rollout replica (`model`, TP r) and how to publish an update into it.

    An update reaches rollout either all at once (`publish()` after the optimizer step) or streamed: the
    optimizer's `writer()` starts each region's all-gather as soon as the chunked optimizer has written that
    parameter, so the exchange runs under the rest of the update and `publish()` only waits for it."""

    model: Qwen2_5_VL
    storage: Tensor  # uint8: every shared region
    regions: tuple[Region, ...]
    copies: tuple[GroupedCopy, ...]
    exchange: TPGroup  # the q training ranks that fill one rollout shard
    pending: dict[int, dist.Work] = field(default_factory=dict)  # region index -> its streamed all-gather

    @property
    def shared_bytes(self) -> int:
        return sum(r.whole.numel() * r.whole.element_size() for r in self.regions)

    @property
    def copy_bytes(self) -> int:
        """HBM rollout uses for actor weights beyond the shared storage (the Case-3 copies)."""
        return sum(c.dst.numel() * c.dst.element_size() for c in self.copies)

    @torch.no_grad()
    def publish(self, *, coalesced: bool = True) -> None:
        """Makes the last update visible to rollout: waits for the streamed all-gathers, runs the others
        (one NCCL group launch unless not `coalesced`), then the Case-3 copies."""
        if self.exchange.size > 1:
            rest = [(r.whole, r.part) for k, r in enumerate(self.regions) if k not in self.pending]
            for work in self.pending.values():
                work.wait()
            self.pending.clear()
            if rest:
                all_gather_many(rest, self.exchange, coalesced=coalesced)
        for c in self.copies:
            gathered = torch.empty_like(c.dst)  # q Megatron shards back to back; freed after the copy
            all_gather_into(gathered, c.part, self.exchange)
            torch.index_select(gathered, 0, c.index, out=c.dst)

    def writer(self, params: list[Tensor]) -> Writer:
        """A `ChunkedAdamW` writer over `params` (the trainer's, in the optimizer's order) that streams the
        exchange: once every element of a bound parameter is written, its region's all-gather starts."""
        base = copy_into(params)
        region_of = {r.part.data_ptr(): k for k, r in enumerate(self.regions)}
        regions = [region_of.get(p.data_ptr()) for p in params]
        numels = [p.numel() for p in params]
        left = list(numels)

        def write(index: int, start: int, values: Tensor) -> None:
            base(index, start, values)
            left[index] -= values.numel()
            if left[index] == 0:
                left[index] = numels[index]
                k = regions[index]
                if k is not None and self.exchange.size > 1:
                    region = self.regions[k]
                    self.pending[k] = all_gather_async(region.whole, region.part, self.exchange)

        return write


def vmm_allocator(arena, name: str = "rollout_actor") -> Callable[[int], Tensor]:
    """`allocate` for `bind_rollout` from a region of a `rollplex.memory.vmm.VmmArena`: rollout's actor weights
    at addresses that survive residency changes (captured graphs keep pointing at them)."""

    def allocate(num_bytes: int) -> Tensor:
        return arena.tensor(arena.allocate(num_bytes, name), torch.uint8, (num_bytes,))

    return allocate


def make_groups(
    train_tp: int, rollout_tp: int, rank: int, world: int | None = None
) -> tuple[TPGroup, TPGroup, TPGroup]:
    """This rank's (training, exchange, rollout) groups (collective: every rank of the world calls it, and every
    group is made on every rank in the same order). The world (default: train_tp ranks) holds world / train_tp
    tensor-parallel groups of consecutive ranks (one per data-parallel replica); within each, exchange groups
    are q consecutive ranks (one rollout shard) and a rollout replica takes one rank of each."""
    if rollout_tp < 1 or train_tp % rollout_tp:
        raise ValueError(f"rollout TP {rollout_tp} must divide training TP {train_tp} (q = t / r must be an integer)")
    q, world = train_tp // rollout_tp, world or train_tp
    train = exchange = rollout = SINGLE
    for base in range(0, world, train_tp):
        everyone = list(range(base, base + train_tp))
        g = dist.new_group(everyone) if train_tp > 1 else None
        if rank in everyone and train_tp > 1:
            train = TPGroup(train_tp, rank - base, g)
        for first in range(0, train_tp, q):
            members = everyone[first : first + q]
            g = dist.new_group(members) if q > 1 else None
            if rank in members and q > 1:
                exchange = TPGroup(q, rank - base - first, g)
        for j in range(q):
            members = everyone[j::q]
            g = dist.new_group(members) if rollout_tp > 1 else None
            if rank in members and rollout_tp > 1:
                rollout = TPGroup(rollout_tp, members.index(rank), g)
    return train, exchange, rollout


def _trained(model: Qwen2_5_VL, with_qkv: bool) -> list[tuple[nn.Module, str]]:
    """The sharded parameters of a parallelized model that live in the shared storage, as (module, attribute),
    in a fixed order; the fused QKV only when rollout reads it in place."""
    lm = model.model.language_model
    out = [(lm.embed_tokens, "weight")]
    for layer in lm.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(attn, ParallelSelfAttention), "bind a model parallelized with rollplex.parallel.parallelize"
        out += [(attn, "qkv_weight"), (attn, "qkv_bias")] if with_qkv else []
        out += [(attn, "o_slab"), (mlp, "gate_up"), (mlp, "down_slab")]
    if not model.config.text.tie_word_embeddings:
        out.append((model.lm_head, "weight"))
    return out


def _carve(tensors: list[Tensor], q: int, allocate: Callable[[int], Tensor]) -> tuple[Tensor, list[Tensor]]:
    """One uint8 storage holding, for each tensor [n, ...], a [q * n, ...] tensor of its dtype."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-q * t.numel() * t.element_size() // ALIGN) * ALIGN
    storage = allocate(total)
    assert storage.dtype == torch.uint8 and storage.numel() >= total, "allocate(n) must return >= n uint8 bytes"
    wholes = []
    for t, offset in zip(tensors, offsets, strict=True):
        num_bytes = q * t.numel() * t.element_size()
        wholes.append(storage[offset : offset + num_bytes].view(t.dtype).view(q * t.shape[0], *t.shape[1:]))
    return storage, wholes


def grouped_index(t: TextConfig, train_tp: int, rollout_tp: int, k: int) -> Tensor:
    """index with bound[index] == the grouped (vLLM) QKV of rollout shard k, bound = q Megatron shards in rank order."""
    q = train_tp // rollout_tp
    stored = torch.cat([layout.qkv_rows(t, train_tp, k * q + j) for j in range(q)])
    wanted = layout.qkv_grouped_rows(t, rollout_tp, k)
    order = torch.argsort(stored)
    return order[torch.searchsorted(stored[order], wanted)]


def _qkv_case(model: Qwen2_5_VL, train_tp: int, rollout_tp: int) -> Case:
    family = next(f for f in llm_families(model.config.text) if f.name == "qkv.weight")
    return classify(family, model.config.text, train_tp, rollout_tp).case


@torch.no_grad()
def bind_rollout(
    model: Qwen2_5_VL,
    exchange: TPGroup,
    rollout: TPGroup,
    path: QKVPath = QKVPath.IN_PLACE,
    allocate: Callable[[int], Tensor] | None = None,
) -> BoundRollout:
    """Moves this rank's training shards into the rollout-sized storage and builds the rollout replica over it.

    `model` is parallelized at TP t = q * r (q = exchange.size, r = rollout.size); `allocate(n)` returns n uint8
    bytes on the model's device (default: torch.empty; on the GPU a VMM region). Create the optimizer after."""
    text, device, dtype = model.config.text, model.device, model.lm_head.weight.dtype
    q, r = exchange.size, rollout.size
    train_tp = model.model.language_model.layers[0].self_attn.group.size
    assert train_tp == q * r, f"training TP {train_tp} != exchange {q} x rollout {r}"
    allocate = allocate or (lambda n: torch.empty(n, dtype=torch.uint8, device=device))
    copy_qkv = path is QKVPath.COPY and _qkv_case(model, train_tp, r) is Case.COPIED
    owners = _trained(model, with_qkv=not copy_qkv)
    storage, wholes = _carve([getattr(m, a) for m, a in owners], q, allocate)
    regions = []
    for (module, attr), whole in zip(owners, wholes, strict=True):
        n = whole.shape[0] // q
        part = whole[exchange.rank * n : (exchange.rank + 1) * n]
        part.copy_(getattr(module, attr))
        setattr(module, attr, nn.Parameter(part))
        regions.append(Region(whole, part))
    if text.tie_word_embeddings:
        model.lm_head.weight = model.model.language_model.embed_tokens.weight
    whole = {(id(m), a): w for (m, a), w in zip(owners, wholes, strict=True)}
    replica = Qwen2_5_VL(model.config, dtype=dtype, device="meta")
    rlm, lm = replica.model.language_model, model.model.language_model
    replica.model.visual, rlm.norm = model.model.visual, lm.norm
    copies = []
    index = grouped_index(text, train_tp, r, rollout.rank).to(device) if copy_qkv else None
    for mine, theirs in zip(rlm.layers, lm.layers, strict=True):
        mine.input_layernorm, mine.post_attention_layernorm = theirs.input_layernorm, theirs.post_attention_layernorm
        attn, mlp = theirs.self_attn, theirs.mlp
        if copy_qkv:
            shards = (attn.qkv_weight.detach(), attn.qkv_bias.detach())
            copies += [GroupedCopy(s, index, s.new_empty(q * s.shape[0], *s.shape[1:])) for s in shards]
            qkv_w, qkv_b = copies[-2].dst, copies[-1].dst
        else:
            qkv_w, qkv_b = whole[id(attn), "qkv_weight"], whole[id(attn), "qkv_bias"]
        mine.self_attn = ParallelSelfAttention(
            qkv_w, qkv_b, whole[id(attn), "o_slab"], text.num_attention_heads // r, text.num_key_value_heads // r,
            text.head_dim, QKVOrder.GROUPED if copy_qkv else QKVOrder.INTERLEAVED, rollout, trainable=False,
        )  # fmt: skip
        mine.mlp = ParallelMLP(whole[id(mlp), "gate_up"], whole[id(mlp), "down_slab"], q, rollout, trainable=False)
    vocab = rollout.shard(text.vocab_size)
    embed = whole[id(lm.embed_tokens), "weight"]
    rlm.embed_tokens = VocabParallelEmbedding(embed, vocab.start, rollout, trainable=False)
    head = rlm.embed_tokens.weight if text.tie_word_embeddings else whole[id(model.lm_head), "weight"]
    replica.lm_head = VocabParallelHead(head, rollout, trainable=False)
    assert not any(p.is_meta for p in replica.parameters()), "the rollout replica kept a meta tensor"
    bound = BoundRollout(replica, storage, tuple(regions), tuple(copies), exchange)
    bound.publish()
    return bound
