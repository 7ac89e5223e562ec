"""Tensor-parallel decoder layers over shards in the training engine's layout, used by training and rollout.

The same modules serve the trainer at TP t (parameters: this rank's Megatron-layout shards) and a rollout
replica at TP r bound over q = t / r training shards (`bind.py`: parameters are the rollout-sized buffers whose
regions the q training ranks own). They differ only in how many training shards one tensor holds:
- QKV [rows, hidden]: `INTERLEAVED` (Megatron: per query group its q heads, k, v) is split by a free view,
  whatever the number of groups; `GROUPED` (vLLM: all q, k, v) is the Case-3 copy path's layout.
- [gate; up] of `num_blocks` training shards back to back ([g_0; u_0; g_1; u_1; ...]): the gated product
  pairs each block's halves through a view of the GEMM output.
- o_proj / down_proj stored transposed ([I, O] slabs, q of them back to back): y = x @ slab.
- vocabulary-parallel embedding and LM head (the head gathers the full logits).
- under sequence parallelism (training only), the attention and MLP take this rank's rows of the sequence,
  gather them into their column-parallel GEMM (saving only the rows) and reduce-scatter their row-parallel
  output back to rows (`group.py`); the norms between them run on the rows (`SequenceParallelNorm`).
Not here: where the shards come from (`model.py`, `bind.py`), attention cores (`rollplex.models.attention`).
"""

from __future__ import annotations

from enum import Enum

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rollplex.models.attention import Attention
from rollplex.models.layers import RMSNorm, gpu_compiled, rms_norm
from rollplex.models.rotary import apply_rotary
from rollplex.parallel.group import (
    TPGroup,
    copy_to,
    gather_from,
    reduce_from,
    reduce_scatter_sequence,
    sequence_linear,
)


class QKVOrder(Enum):
    INTERLEAVED = "interleaved"  # Megatron-Core: per query group [q heads; k; v]
    GROUPED = "grouped"  # vLLM: [all q heads; all k heads; all v heads]


def _param(t: Tensor, trainable: bool) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=trainable)


class ParallelSelfAttention(nn.Module):
    """Grouped-query attention over `num_heads` local q heads in `num_groups` local query groups."""

    def __init__(
        self, qkv_weight: Tensor, qkv_bias: Tensor, o_slab: Tensor, num_heads: int, num_groups: int, head_dim: int,
        order: QKVOrder, group: TPGroup, *, trainable: bool, sequence_parallel: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        assert qkv_weight.shape[0] == (num_heads + 2 * num_groups) * head_dim, f"qkv rows {qkv_weight.shape[0]}"
        assert o_slab.shape[0] == num_heads * head_dim, f"o_proj slab must be stored [I, O], got {o_slab.shape}"
        self.qkv_weight, self.qkv_bias = _param(qkv_weight, trainable), _param(qkv_bias, trainable)
        self.o_slab = _param(o_slab, trainable)
        self.num_heads, self.num_groups, self.head_dim = num_heads, num_groups, head_dim
        self.order, self.group, self.sequence_parallel = order, group, sequence_parallel

    @property
    def o_weight(self) -> Tensor:
        """o_proj's weight in its logical [O, I-shard] orientation (nn.Linear's): a transposed view of the
        stored slab, no copy; writes through it reach the slab."""
        return self.o_slab.t()

    def split(self, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """y [B, T, rows] -> q [B, T, heads, D], k and v [B, T, groups, D]; views, no copy."""
        return split_qkv(y, self.order, self.num_heads, self.num_groups, self.head_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: Attention, layer: int) -> Tensor:
        """x [B, T, hidden] (replicated over the group) -> [B, T, hidden], summed over the group. Under sequence
        parallelism x and the output are this rank's rows [B, c, hidden] of the T = cos.shape[-2] tokens."""
        return self.output(attention(layer, *self.project(x, cos, sin)), x.shape[1])

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x as `forward` takes it -> the local heads' rotated q [B, heads, T, D], rotated k and v [B, groups, T, D]
        of all T tokens."""
        if self.sequence_parallel:
            y = sequence_linear(x, self.qkv_weight, self.qkv_bias, self.group)  # [B, size * c, rows]
            y = y[:, : cos.shape[-2]]  # the rows past T are padding
        else:
            y = F.linear(copy_to(x, self.group), self.qkv_weight, self.qkv_bias)
        q, k = rotated_qk(y, cos, sin, self.order, self.num_heads, self.num_groups, self.head_dim)
        return q, k, self.split(y)[2].transpose(1, 2)

    def output(self, out: Tensor, rows: int) -> Tensor:
        """The local heads' attention output [B, heads, T, D] -> o_proj's, summed over the group: [B, T, hidden],
        or under sequence parallelism this rank's `rows` of them (the input's rows: c)."""
        batch, num_tokens = out.shape[0], out.shape[2]
        out = out.transpose(1, 2).reshape(batch, num_tokens, self.num_heads * self.head_dim) @ self.o_slab
        if self.sequence_parallel:
            padded = rows * self.group.size  # the gathered rows `project` cut back to T
            return reduce_scatter_sequence(F.pad(out, (0, 0, 0, padded - num_tokens)), self.group)
        return reduce_from(out, self.group)


def split_qkv(
    y: Tensor, order: QKVOrder, num_heads: int, num_groups: int, head_dim: int
) -> tuple[Tensor, Tensor, Tensor]:
    """QKV GEMM output y [B, T, rows] in `order` -> q [B, T, heads, D], k and v [B, T, groups, D]; views."""
    b, t, d, g = y.shape[0], y.shape[1], head_dim, num_groups
    if order is QKVOrder.GROUPED:
        q, k, v = y.split([num_heads * d, g * d, g * d], dim=-1)
        return q.unflatten(-1, (num_heads, d)), k.unflatten(-1, (g, d)), v.unflatten(-1, (g, d))
    per_group = num_heads // g
    y = y.view(b, t, g, per_group + 2, d)
    return y[:, :, :, :per_group].flatten(2, 3), y[:, :, :, per_group], y[:, :, :, per_group + 1]


@gpu_compiled
def rotated_qk(
    y: Tensor, cos: Tensor, sin: Tensor, order: QKVOrder, num_heads: int, num_groups: int, head_dim: int
) -> tuple[Tensor, Tensor]:
    """q and k of the QKV GEMM output y (`split_qkv`), rotated: [B, heads, T, D] and [B, groups, T, D]. The split
    happens inside the compiled chain: a q or k view's strides are none of its sizes, and handed to a chain
    compiled for varying lengths each such stride becomes a symbol the kernel indexes its rows through."""
    q, k, _ = split_qkv(y, order, num_heads, num_groups, head_dim)
    return apply_rotary.eager(q.transpose(1, 2), cos, sin), apply_rotary.eager(k.transpose(1, 2), cos, sin)


class ParallelMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) over `num_blocks` [gate; up] shards and their stacked down_proj slabs."""

    def __init__(
        self, gate_up: Tensor, down_slab: Tensor, num_blocks: int, group: TPGroup, *, trainable: bool,
        sequence_parallel: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        assert gate_up.shape[0] == 2 * down_slab.shape[0], f"[gate; up] {gate_up.shape} vs down slab {down_slab.shape}"
        self.gate_up, self.down_slab = _param(gate_up, trainable), _param(down_slab, trainable)
        self.num_blocks, self.group, self.sequence_parallel = num_blocks, group, sequence_parallel

    @property
    def down_weight(self) -> Tensor:
        """down_proj's weight in its logical [O, I-shard] orientation: a transposed view of the stored slab."""
        return self.down_slab.t()

    def forward(self, x: Tensor) -> Tensor:
        """x [B, T, hidden] replicated, or under sequence parallelism this rank's rows [B, c, hidden] (the padding
        rows, zeros, go through the GEMMs and stay zeros)."""
        if self.sequence_parallel:
            y = sequence_linear(x, self.gate_up, None, self.group)
        else:
            y = F.linear(copy_to(x, self.group), self.gate_up)
        y = y.unflatten(-1, (self.num_blocks, 2, -1))
        out = gated(y) @ self.down_slab
        return reduce_scatter_sequence(out, self.group) if self.sequence_parallel else reduce_from(out, self.group)


@gpu_compiled
def gated(y: Tensor) -> Tensor:
    """silu(gate) * up of each block's [gate; up] pair in y [..., blocks, 2, I_block] -> [..., blocks * I_block].
    The whole GEMM output goes into the compiled chain, for the reason `rotated_qk` gives."""
    return (F.silu(y[..., 0, :]) * y[..., 1, :]).flatten(-2)


class SequenceParallelNorm(RMSNorm):
    """An RMSNorm over this rank's rows of the sequence: its weight's gradient is partial (these rows only), so
    backward sums it over the group (`copy_to`) before it accumulates; every rank then holds the same weight.
    Keeps the norm's parameter (and its name)."""

    def __init__(self, norm: RMSNorm, group: TPGroup) -> None:
        nn.Module.__init__(self)
        self.weight, self.eps, self.group = norm.weight, norm.eps, group

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, copy_to(self.weight, self.group), self.eps)


class VocabParallelEmbedding(nn.Module):
    """Rows [vocab_start, vocab_start + rows) of the embedding; other ids contribute zeros before the sum."""

    def __init__(self, weight: Tensor, vocab_start: int, group: TPGroup, *, trainable: bool) -> None:
        super().__init__()
        self.weight, self.vocab_start, self.group = _param(weight, trainable), vocab_start, group

    def forward(self, ids: Tensor) -> Tensor:
        if self.group.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(inside, local, 0), self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return reduce_from(out, self.group)


class VocabParallelHead(nn.Module):
    """The LM head over a vocabulary shard; returns the full logits (gathered over the group)."""

    def __init__(self, weight: Tensor | nn.Parameter, group: TPGroup, *, trainable: bool) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else _param(weight, trainable)  # tied: shared
        self.group = group

    def forward(self, hidden: Tensor) -> Tensor:
        return gather_from(F.linear(copy_to(hidden, self.group), self.weight), self.group)
