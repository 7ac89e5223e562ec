"""The Qwen2.5-VL vision encoder: patch embedding, blocks with window / full attention and 2D rotary, patch
merger.

Input: the visuals' preprocessed patches. Output: one embedding per merged token, in the order the prompt's
image/video tokens hold them. Parameter names follow HF (`patch_embed.proj`, `blocks.{i}.attn.qkv`,
`merger.mlp.0`). On a GPU the tower runs in window order (`runs_varlen`): the patches are permuted once on
the way in, every block's segments are runs of consecutive patches that flash attention's variable-length
kernel reads in place (no gathers, no padding, no mask), and the merged tokens are put back in the processor's
order on the way out. Not here: which patch attends to which (`vision_layout.py`), the rotary tables
(`rotary.py`).
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Generator, Sequence
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rollplex.models.attention import attention_length, plans_per_shape
from rollplex.models.chunks import drain
from rollplex.models.config import VisionConfig
from rollplex.models.inputs import Visual, pixels_of, to_device
from rollplex.models.layers import GatedMLP, RMSNorm
from rollplex.models.prompt_rows import Rows
from rollplex.models.rerun import Rerun, run_unit
from rollplex.models.rotary import rotated_packed_qkv, vision_rotary
from rollplex.models.vision_layout import patch_layout, segment_bounds, segment_groups, unit_positions, window_order

VISION_NORM_EPS = 1e-6
MLP_LEAVES = ("gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias", "down_proj.weight")


class VarlenSegments(NamedTuple):
    """Segments that are runs of consecutive patches (the tower in window order): `bounds` [segments + 1] int32
    on the attention's device (`vision_layout.segment_bounds`), `longest` the longest run."""

    bounds: Tensor
    longest: int


class VisionInputs(NamedTuple):
    """What the tower reads of some visuals, on its device: built (the layout's index work on the host, then the
    copies) before any of the tower's compute, so that a caller can copy every group's inputs at once
    (`Qwen2_5_VL.prefix_chunks` with `inputs_first`)."""

    pixels: Tensor  # [S, C]: the patches in the processor's order
    order: Tensor | None  # [S]: the window order the tower runs in (`window_order`); None: the processor's
    rows: Tensor  # [S]: each patch's row and column in its frame, in the tower's order (the 2D rotary)
    cols: Tensor
    frames: VarlenSegments | tuple[Tensor, ...]  # the full-attention blocks' segments
    windows: VarlenSegments | tuple[Tensor, ...]  # the window blocks'
    units: Tensor | None  # the merged tokens back to the processor's order (`unit_positions`); None: in it


FLASH_DTYPES = (torch.bfloat16, torch.float16)


def runs_varlen(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the tower runs in window order on flash attention's variable-length kernel: on a CUDA device of
    compute capability 8.0 or more where torch has the kernel, in 16-bit floats at a head dim flash takes (a
    multiple of 8, at most 256), unless deterministic algorithms are on (its backward accumulates over key
    blocks with atomics)."""
    if device.type != "cuda" or torch.are_deterministic_algorithms_enabled():
        return False
    if dtype not in FLASH_DTYPES or head_dim % 8 or head_dim > 256:
        return False
    has_kernel = importlib.util.find_spec("torch.nn.attention.varlen") is not None
    return has_kernel and torch.cuda.get_device_capability(device) >= (8, 0)


def varlen_attention(q: Tensor, k: Tensor, v: Tensor, segments: VarlenSegments) -> Tensor:
    """Attention within runs of consecutive rows: q, k, v [S, heads, D] -> [S, heads, D]. On a GPU one call: runs
    of at most `window_attention.MAX_RUN` rows (the windows) on rollplex's kernel, which holds a run in one
    program, longer ones (the frames) on flash attention's variable-length kernel; on the CPU (tests) one SDPA
    call per run."""
    if q.is_cuda:
        from rollplex.kernels.window_attention import MAX_RUN, window_attention

        bounds, longest = segments
        if longest <= MAX_RUN:
            return window_attention(q, k, v, bounds, longest)
        from torch.nn.attention.varlen import varlen_attn

        return varlen_attn(q, k, v, bounds, bounds, longest, longest)
    bounds = segments.bounds.tolist()
    runs = [
        F.scaled_dot_product_attention(*(x[start:end].transpose(0, 1) for x in (q, k, v))).transpose(0, 1)
        for start, end in itertools.pairwise(bounds)
    ]
    return torch.cat(runs)


def segment_attention(q: Tensor, k: Tensor, v: Tensor, groups: Sequence[Tensor] | VarlenSegments) -> Tensor:
    """Attention within segments: q, k, v [S, heads, D] -> [S, heads, D]. `groups`: from `segment_groups` (one
    call per segment length), a `PackedSegments` (one masked call for all; its first tensor is a bool mask,
    the groups' are int64), as `segment_layout` makes them, or `VarlenSegments` (runs of consecutive rows)."""
    if isinstance(groups, VarlenSegments):
        return varlen_attention(q, k, v, groups)
    if groups[0].dtype == torch.bool:
        return packed_segment_attention(q, k, v, PackedSegments(*groups))
    out = torch.zeros_like(q)
    for members in groups:  # [num_segments, length]
        q_s, k_s, v_s = (x[members].transpose(1, 2) for x in (q, k, v))  # [num_segments, heads, length, D]
        o = F.scaled_dot_product_attention(q_s, k_s, v_s)
        out = out.index_copy(0, members.flatten(), o.transpose(1, 2).flatten(0, 1))
    return out


MAX_PACKING_WASTE = 1.5  # packed entries per real one above which the calls stay one per segment length


class PackedSegments(NamedTuple):
    """All segments of a block type in one [rows, width] call, rows and width the `attention_length` of the
    segment count and of the longest segment: a run's videos of new sizes and frame counts meet a few shapes,
    where one call per segment length meets new ones every step (cuDNN plans each). Tensors, so that a rerun
    unit can keep them; built on the CPU (`pack_segments`), so that using them never waits for the GPU."""

    sees: Tensor  # [rows, 1, 1, width] bool: the keys a row's queries see (its segment's; a padding row: key 0)
    index: Tensor  # [rows, width] int64: each entry's patch (padding: distinct patches, masked and dropped)
    entry: Tensor  # [patches] int64: each patch's real entry, a position in index.flatten()


def pack_segments(groups: Sequence[Tensor]) -> PackedSegments | None:
    """`PackedSegments` of CPU `segment_groups` that partition the patches, or None where padding would pass
    MAX_PACKING_WASTE (e.g. an image's long frame beside a video's short ones)."""
    num_patches = sum(members.numel() for members in groups)
    rows = attention_length(sum(members.shape[0] for members in groups))
    width = attention_length(max(members.shape[1] for members in groups))
    if rows * width > MAX_PACKING_WASTE * num_patches:
        return None
    index = torch.arange(rows * width).remainder(num_patches).view(rows, width)
    real = torch.zeros(rows, width, dtype=torch.bool)
    row = 0
    for members in groups:
        index[row : row + members.shape[0], : members.shape[1]] = members
        real[row : row + members.shape[0], : members.shape[1]] = True
        row += members.shape[0]
    sees = real.clone()
    sees[:, 0] = True  # a padding row sees key 0 (a query that sees no key may come out NaN)
    positions = real.flatten().nonzero()[:, 0]
    entry = torch.full((num_patches,), -1).index_copy_(0, index.flatten()[positions], positions)
    assert (entry >= 0).all(), "the segments do not cover every patch"
    return PackedSegments(sees[:, None, None, :], index, entry)


def segment_layout(segment_ids: Tensor, device: torch.device) -> tuple[Tensor, ...]:
    """The `groups` of `segment_attention` on `device` for CPU segment ids: packed where SDPA may plan per shape
    (`plans_per_shape`) and the padding stays within MAX_PACKING_WASTE, else one group per segment length."""
    groups = segment_groups(segment_ids)
    packed = pack_segments(groups) if plans_per_shape(device) else None
    return tuple(to_device(t, device) for t in (packed if packed is not None else groups))


def packed_segment_attention(q: Tensor, k: Tensor, v: Tensor, packed: PackedSegments) -> Tensor:
    """`segment_attention` in one masked call. Equal to the per-length calls but for rounding: masked keys get
    zero weight and dropped queries zero gradient, so the padding adds exact zeros, and each patch's gradient is
    the one of its real entry (`Rows`: gathers both ways, no atomic adds)."""
    rows, width = packed.index.shape
    index = packed.index.flatten()
    q_s, k_s, v_s = (Rows.apply(x, index, packed.entry).view(rows, width, *x.shape[1:]).transpose(1, 2)
                     for x in (q, k, v))  # fmt: skip
    o = F.scaled_dot_product_attention(q_s, k_s, v_s, attn_mask=packed.sees)  # [rows, heads, width, D]
    return Rows.apply(o.transpose(1, 2).reshape(rows * width, *q.shape[1:]), packed.entry, None)


class PatchProj(nn.Conv3d):
    """A Conv3d whose kernel is the whole patch, applied as the equivalent matmul over flattened patches: pixels
    [S, in_channels * temporal_patch_size * patch_size**2] -> [S, hidden]. Its own forward reads the weight, so
    a forward pre-hook on it (a deferred update's gate, `rollplex.memory.in_flight.gate_modules`) runs first."""

    def forward(self, pixels: Tensor) -> Tensor:
        return F.linear(pixels.to(self.weight.dtype), self.weight.flatten(1))


class PatchEmbed(nn.Module):
    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        kernel = (vision.temporal_patch_size, vision.patch_size, vision.patch_size)
        self.proj = PatchProj(vision.in_channels, vision.hidden_size, kernel, stride=kernel, bias=False)

    def forward(self, pixels: Tensor) -> Tensor:
        """pixels [S, in_channels * temporal_patch_size * patch_size**2] -> [S, hidden]."""
        return self.proj(pixels)


class VisionAttention(nn.Module):
    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        self.num_heads = vision.num_heads
        self.qkv = nn.Linear(vision.hidden_size, 3 * vision.hidden_size)
        self.proj = nn.Linear(vision.hidden_size, vision.hidden_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, groups: Sequence[Tensor]) -> Tensor:
        return self.output(segment_attention(*self.project(x, cos, sin), groups))

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [S, hidden] -> rotated q and k, and v: [S, heads, D] each."""
        return rotated_packed_qkv(self.qkv(x).view(x.shape[0], 3, self.num_heads, -1), cos, sin)

    def output(self, out: Tensor) -> Tensor:
        """The attention's output [S, heads, D] -> the projection's [S, hidden]."""
        return self.proj(out.reshape(out.shape[0], -1))


class VisionMLP(GatedMLP):
    """The vision blocks' gated MLP, stored `MLP_ALIGN`-wide. Qwen2.5-VL-3B and 7B have a vision MLP width of
    3420: rows of 6,840 bytes, not 16-byte aligned, so cuBLAS runs the GEMMs that touch that dimension (9 of a
    block's 15 in forward + backward) on Ampere-era align-2 kernels, a large share of a step's backward time.
    Stored 3456 wide, gate/up have zero extra rows and down zero extra columns: the extra activations are
    silu(0) * 0 = 0, every gradient reaching the padding is exactly 0, and AdamW moves a zero with a zero
    gradient nowhere (its decay too), so outputs and updates are unchanged.

    Checkpoints and state dicts hold transformers' shapes (`hf_view`, `hf_padded`, and the hooks below)."""

    def __init__(self, vision: VisionConfig) -> None:
        super().__init__(vision.hidden_size, vision.stored_intermediate_size, bias=True)
        self.width = vision.intermediate_size
        self.register_state_dict_post_hook(_state_dict_in_hf_shapes)
        self.register_load_state_dict_pre_hook(_pad_loaded_state)

    @torch.no_grad()
    def zero_padding(self) -> None:
        for proj in (self.gate_proj, self.up_proj):
            proj.weight[self.width :].zero_()
            proj.bias[self.width :].zero_()
        self.down_proj.weight[:, self.width :].zero_()


def _hf_part(leaf: str, tensor: Tensor, width: int) -> Tensor:
    """The transformers-shaped view of a stored vision MLP tensor (`leaf`: e.g. "gate_proj.weight")."""
    if leaf == "down_proj.weight":
        return tensor[:, :width]
    return tensor[:width] if leaf in MLP_LEAVES else tensor


def _padded_part(leaf: str, tensor: Tensor, shape: torch.Size, width: int) -> Tensor:
    """A transformers-shaped vision MLP tensor zero-padded to its stored `shape`."""
    padded = torch.zeros(shape, dtype=tensor.dtype, device=tensor.device)
    _hf_part(leaf, padded, width).copy_(tensor)
    return padded


def _mlp_leaf(name: str) -> str | None:
    """ "gate_proj.weight" for "model.visual.blocks.3.mlp.gate_proj.weight"; None for a name outside the vision MLPs."""
    block, _, leaf = name.rpartition(".mlp.")
    return leaf if block.rpartition(".")[0].endswith("visual.blocks") else None


def hf_view(name: str, tensor: Tensor, vision: VisionConfig) -> Tensor:
    """The model's tensor `name` (a parameter, or optimizer state shaped like one) as transformers shapes it."""
    leaf = _mlp_leaf(name)
    return tensor if leaf is None else _hf_part(leaf, tensor, vision.intermediate_size)


def hf_padded(name: str, tensor: Tensor, shape: torch.Size, vision: VisionConfig) -> Tensor:
    """The inverse of `hf_view`: a transformers-shaped tensor as the model stores `name` (`shape`)."""
    leaf = _mlp_leaf(name)
    if leaf is None or tensor.shape == shape:
        return tensor
    return _padded_part(leaf, tensor, shape, vision.intermediate_size)


def hf_shaped(params: dict[str, Tensor], vision: VisionConfig) -> dict[str, Tensor]:
    """A model's named tensors as transformers shapes them (`hf_view`)."""
    return {name: hf_view(name, tensor, vision) for name, tensor in params.items()}


def _state_dict_in_hf_shapes(module: VisionMLP, state: dict, prefix: str, local_metadata: dict) -> None:
    for leaf in MLP_LEAVES:
        if prefix + leaf in state:
            state[prefix + leaf] = _hf_part(leaf, state[prefix + leaf], module.width)


def _pad_loaded_state(module: VisionMLP, state: dict, prefix: str, *args) -> None:
    """Pads transformers-shaped tensors to the stored shape (any other shape goes on to torch's own check)."""
    for leaf in MLP_LEAVES:
        key = prefix + leaf
        stored = module.get_parameter(leaf)
        if key in state and state[key].shape == _hf_part(leaf, stored, module.width).shape != stored.shape:
            state[key] = _padded_part(leaf, state[key], stored.shape, module.width)


class VisionBlock(nn.Module):
    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(vision.hidden_size, VISION_NORM_EPS)
        self.norm2 = RMSNorm(vision.hidden_size, VISION_NORM_EPS)
        self.attn = VisionAttention(vision)
        self.mlp = VisionMLP(vision)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, groups: Sequence[Tensor]) -> Tensor:
        return self.after_attention(x, segment_attention(*self.before_attention(x, cos, sin), groups))

    def before_attention(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The block up to its attention: q, k, v of the normed input (`VisionAttention.project`)."""
        return self.attn.project(self.norm1(x), cos, sin)

    def after_attention(self, x: Tensor, out: Tensor) -> Tensor:
        """The block from its attention's output on: the projection and the residual, the MLP and its residual
        (`layers.compile_halves` compiles each half as a region)."""
        x = x + self.attn.output(out)
        return x + self.mlp(self.norm2(x))


def _block_unit(
    block: VisionBlock, longest: int | None, x: Tensor, cos: Tensor, sin: Tensor, *groups: Tensor
) -> tuple[Tensor]:
    """A vision block as a rerun unit (`rollplex.models.rerun`); with `longest`, groups holds a `VarlenSegments`'
    bounds."""
    return (block(x, cos, sin, groups if longest is None else VarlenSegments(*groups, longest)),)


class PatchMerger(nn.Module):
    """Norms each patch, concatenates the m x m patches of a merge unit and projects them to the LLM width."""

    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        merged = vision.hidden_size * vision.merge_unit
        self.ln_q = RMSNorm(vision.hidden_size, VISION_NORM_EPS)
        self.mlp = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, vision.out_hidden_size))

    def forward(self, x: Tensor) -> Tensor:
        """x [S, hidden] -> [S / merge_unit, out_hidden]."""
        return self.mlp(self.ln_q(x).view(-1, self.mlp[0].in_features))


class VisionEncoder(nn.Module):
    def __init__(self, vision: VisionConfig) -> None:
        super().__init__()
        self.config = vision
        self.patch_embed = PatchEmbed(vision)
        self.blocks = nn.ModuleList(VisionBlock(vision) for _ in range(vision.depth))
        self.merger = PatchMerger(vision)
        self.varlen: bool | None = None  # window order on variable-length attention; None: `runs_varlen`

    def forward(self, visuals: Sequence[Visual]) -> Tensor:
        """Visuals -> [num_visual_tokens, out_hidden]: their merged tokens, concatenated in order."""
        return drain(self.chunks(visuals, blocks_per_chunk=len(self.blocks)))

    def inputs(self, visuals: Sequence[Visual]) -> VisionInputs:
        """What the tower reads of `visuals`, on its device (`VisionInputs`)."""
        device = self.merger.mlp[0].weight.device
        layout = patch_layout([visual.grid_thw for visual in visuals], self.config)
        dtype = self.merger.mlp[0].weight.dtype
        in_window_order = runs_varlen(device, dtype, self.config.head_dim) if self.varlen is None else self.varlen
        order = window_order(layout) if in_window_order else None
        layout = layout if order is None else layout.take(order)
        rows, cols = to_device(layout.rows, device), to_device(layout.cols, device)
        frames, windows = (
            segment_layout(ids, device) if order is None else varlen_segments(ids, device)
            for ids in (layout.frames, layout.windows)
        )
        pixels = to_device(pixels_of(visuals), device)
        if order is None:
            return VisionInputs(pixels, None, rows, cols, frames, windows, None)
        units = to_device(unit_positions(order, self.config.merge_unit), device)
        return VisionInputs(pixels, to_device(order, device), rows, cols, frames, windows, units)

    def chunks(
        self, visuals: Sequence[Visual] | VisionInputs, blocks_per_chunk: int, rerun: Rerun | None = None
    ) -> Generator[None, None, Tensor]:
        """`forward` as a generator that pauses after every `blocks_per_chunk` blocks (the patch embedding runs
        with the first ones, the merger with the last): the same ops in the same order. Under `rerun` each
        block keeps only its input (`rollplex.models.rerun`). `visuals`: or their inputs, already on the device
        (`inputs`)."""
        inputs = visuals if isinstance(visuals, VisionInputs) else self.inputs(visuals)
        cos, sin = vision_rotary(inputs.rows, inputs.cols, self.config.head_dim)
        pixels = inputs.pixels
        x = self.patch_embed(pixels if inputs.order is None else pixels.index_select(0, inputs.order))
        for index, block in enumerate(self.blocks):
            if index and index % blocks_per_chunk == 0:
                yield
            groups = inputs.frames if index in self.config.fullatt_block_indexes else inputs.windows
            longest, consts = (groups.longest, groups[:1]) if isinstance(groups, VarlenSegments) else (None, groups)
            (x,) = run_unit(rerun, partial(_block_unit, block, longest), x, block.parameters(), cos, sin, *consts)
        merged = self.merger(x)
        if inputs.units is None:
            return merged
        return Rows.apply(merged, inputs.units, None)


def varlen_segments(segment_ids: Tensor, device: torch.device) -> VarlenSegments:
    """`VarlenSegments` on `device` of CPU segment ids that run contiguously (`vision_layout.segment_bounds`)."""
    bounds, longest = segment_bounds(segment_ids)
    return VarlenSegments(to_device(bounds, device), longest)
