"""How one decode step reads a decoder layer's projections, for each way the actor's weights can be stored.

- a full model (`rollplex.models.decoder`): the packed [q; k; v] and [gate; up] views and HF [O, I] weights;
- a tensor-parallel layer (`rollplex.parallel.layers`, a rollout replica bound over training shards): Megatron's
  interleaved QKV through the permuted GEMM (`rollplex.kernels.qkv_gemm`) when it holds several query groups,
  else as it lies; [gate; up] blocks paired through a view; o_proj / down_proj as stored [I, O] slabs; the
  outputs of o_proj and down_proj summed over the rollout group when it has several ranks.
Every path returns q, k, v in the grouped order the fused rotary kernel expects and reads the weights in place.
The projections the step's fused kernels read next (qkv, o_proj, down_proj) come as parts [S, rows, N]
(`rollplex.kernels.decode_ops`): one part, or with `fused` a K split's partials for that kernel to add.
`DecodeKernels` picks the kernels. With `triton_gemm`, every projection (qkv, o_proj, gate_up, down_proj) runs
through our GEMMs (`rollplex.kernels.transposed_gemm`) instead of cuBLAS, and with `pdl` those and silu_mul
launch as programmatic dependents, so that with the step's other kernels a layer is one chain in which each
kernel launches while the one before drains. With `fused`, a split's sum happens in the norm or rotary kernel
after it and silu inside the gate_up GEMM: up to four launches fewer per layer (two at 3B, where only down_proj
splits). With `ahead`, each of the fused chain's kernels lets the next one launch before it waits for the one
before it, and each swapped GEMM pulls the first blocks of its weights into L2 while the kernels before it run
(`rollplex.kernels.pdl`). At decode rows the HF-layout products run on `rollplex.kernels.swap_gemm` where it
fits; the unfused gate_up takes the kernel the fused one would (`gate_up_swaps`), so both give the same bits.
`BY_NAME` maps the spec's `run.decode_kernels` to these.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from rollplex.kernels.decode_ops import silu_mul
from rollplex.kernels.transposed_gemm import (
    gate_up_silu,
    gate_up_swaps,
    linear,
    linear_parts,
    matmul_transposed,
    matmul_transposed_parts,
)
from rollplex.models.decoder import SelfAttention
from rollplex.models.packing import packed_view
from rollplex.parallel.group import SINGLE, TPGroup
from rollplex.parallel.layers import ParallelSelfAttention, QKVOrder


@dataclass(frozen=True, slots=True)
class DecodeKernels:
    """Which kernels a decode step runs (see the module docstring); the default is cuBLAS, launched plainly."""

    triton_gemm: bool = False  # every projection through our GEMMs
    pdl: bool = False  # our kernels launch as programmatic dependents (Hopper)
    fused: bool = False  # splits summed by the kernel after them, silu inside the gate_up GEMM (our GEMMs only)
    ahead: bool = False  # each kernel lets the next launch before it waits; GEMMs prefetch weights meanwhile

    def __post_init__(self) -> None:
        assert self.triton_gemm or not self.fused, "fused decode kernels run on our GEMMs: set triton_gemm"
        assert self.fused or not self.ahead, "ahead launches chain the fused kernels: set fused"


CUBLAS = DecodeKernels()  # the default
BY_NAME = {  # `run.decode_kernels`
    "cublas": CUBLAS,
    "rollplex": DecodeKernels(triton_gemm=True),
    "rollplex_pdl": DecodeKernels(triton_gemm=True, pdl=True),
    "rollplex_fused": DecodeKernels(triton_gemm=True, pdl=True, fused=True),
    "rollplex_ahead": DecodeKernels(triton_gemm=True, pdl=True, fused=True, ahead=True),
}


@dataclass(frozen=True)
class LayerWeights:
    """One layer's decode projections over normed activations [rows, hidden]."""

    qkv_weight: Tensor
    qkv_bias: Tensor
    interleaved_groups: int  # > 1: qkv_weight is Megatron-interleaved over this many query groups
    num_heads: int
    num_groups: int
    head_dim: int
    o: Tensor  # [O, I] (transposed=False) or the stored [I, O] slab
    gate_up: Tensor  # [blocks * 2 * I_block, hidden]
    num_blocks: int
    down: Tensor
    transposed: bool
    group: TPGroup
    kernels: DecodeKernels = CUBLAS

    def qkv(self, x: Tensor) -> Tensor:
        """Parts [S, rows, (heads + 2 groups) D]: all q, then k, then v."""
        if self.interleaved_groups > 1:
            from rollplex.kernels.qkv_gemm import qkv_grouped_from_megatron

            w, b = self.qkv_weight, self.qkv_bias
            return qkv_grouped_from_megatron(x, w, b, self.num_heads, self.num_groups, self.head_dim)[None]
        if self.kernels.fused:
            return linear_parts(x, self.qkv_weight, self.qkv_bias, pdl=self.kernels.pdl, ahead=self.kernels.ahead)
        if self.kernels.triton_gemm:
            return linear(x, self.qkv_weight, self.qkv_bias, pdl=self.kernels.pdl)[None]
        return F.linear(x, self.qkv_weight, self.qkv_bias)[None]

    def out(self, attended: Tensor) -> Tensor:
        """Parts [S, rows, hidden] of o_proj."""
        return self._row_parallel(attended, self.o)

    def mlp(self, x: Tensor) -> Tensor:
        """Parts [S, rows, hidden] of down(silu(gate) * up), each [gate; up] block paired inside the gate_up GEMM
        (`fused`) or through a view of its output."""
        block_rows = self.gate_up.shape[0] // (2 * self.num_blocks)
        if self.kernels.fused:
            hidden = gate_up_silu(x, self.gate_up, block_rows, pdl=self.kernels.pdl, ahead=self.kernels.ahead)
            return self._row_parallel(hidden, self.down)
        if self.kernels.triton_gemm:  # the kernel `gate_up_silu` would take: the fused step gives the same bits
            swap = gate_up_swaps(x, self.gate_up, block_rows)
            y = linear(x, self.gate_up, pdl=self.kernels.pdl, swap=swap, split=False)
        else:
            y = F.linear(x, self.gate_up)
        rows, width = y.shape[0], y.shape[1] // self.num_blocks
        out = y.new_empty(rows * self.num_blocks, width // 2)
        hidden = silu_mul(y.view(rows * self.num_blocks, width), out, pdl=self.kernels.pdl).view(rows, -1)
        return self._row_parallel(hidden, self.down)

    def _row_parallel(self, x: Tensor, w: Tensor) -> Tensor:
        """Parts of x W^T for o_proj / down_proj, summed over the rollout group (one part) when it has several ranks:
        w is the stored [I, O] slab (transposed) or HF's [O, I]."""
        if self.kernels.fused and self.group.size == 1:
            parts = matmul_transposed_parts if self.transposed else linear_parts
            return parts(x, w, pdl=self.kernels.pdl, ahead=self.kernels.ahead)
        if self.kernels.triton_gemm:
            y = (matmul_transposed if self.transposed else linear)(x, w, pdl=self.kernels.pdl)
        else:
            y = x @ w if self.transposed else F.linear(x, w)
        if self.group.size > 1:
            dist.all_reduce(y, group=self.group.group)
        return y[None]


def layer_weights(layer: nn.Module, kernels: DecodeKernels = CUBLAS) -> LayerWeights:
    """How a decode step reads `layer`'s projections, with `kernels`."""
    return replace(_layer_weights(layer), kernels=kernels)


def _layer_weights(layer: nn.Module) -> LayerWeights:
    attn, mlp = layer.self_attn, layer.mlp
    if isinstance(attn, SelfAttention):
        qkv_w = _packed(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
        qkv_b = _packed(attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)
        return LayerWeights(
            qkv_w, qkv_b, 1, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.o_proj.weight,
            _packed(mlp.gate_proj.weight, mlp.up_proj.weight), 1, mlp.down_proj.weight, False, SINGLE,
        )  # fmt: skip
    assert isinstance(attn, ParallelSelfAttention), f"no decode path for {type(attn).__name__}"
    interleaved = attn.num_groups if attn.order is QKVOrder.INTERLEAVED else 1
    return LayerWeights(
        attn.qkv_weight.detach(), attn.qkv_bias.detach(), interleaved, attn.num_heads, attn.num_groups,
        attn.head_dim, attn.o_slab.detach(), mlp.gate_up.detach(), mlp.num_blocks, mlp.down_slab.detach(), True,
        attn.group,
    )  # fmt: skip


def _packed(*tensors: Tensor) -> Tensor:
    view = packed_view(*tensors)
    if view is None:
        raise ValueError("the model's projections are not packed: call model.pack_projections() after moving it")
    return view
