"""What one pass of the model costs over one step's tokens: the FLOPs, HBM bytes and host-link bytes of the vision
encoder, a prompt's prefill, the responses' scoring (from a boundary, or over whole sequences), a backward and what
it reruns, decode and the optimizer's update, for a model config and a step's token counts (`StepTokens`: each
prompt's tokens and patches, each response's length); and the peaks (`DevicePeaks`) that bound a `Cost` on a
device. Independent of any plan: which ops of a compiled plan run which passes is `cost.py`'s (a pass of the model
here, not a compiler pass: those are `passes.py`).

Conventions: a matmul pass costs 2 x parameters x tokens, its backward twice that, a recompute what it reruns of the
forward; attention 4 x width x queries x keys per layer, half of it when causal; decode reads every weight (but an
untied input embedding's table, whose rows it gathers) and every live KV once per step. Per GPU: training counts
divide by the train TP degree, rollout's by the rollout TP degree. Pure: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache

from rollplex.graph.decisions import Decisions, PrefixActivations, Recompute
from rollplex.graph.memobject import Residency
from rollplex.layout import shapes as S
from rollplex.models.config import TextConfig, VisionConfig

STATE_BYTES = 12  # FP32 master weight and two Adam moments per parameter
UPDATE_HBM_BYTES = 30  # per parameter: state read and written, FP32 gradient read, BF16 weight written
GRAD_NORM_BYTES = 4  # per parameter: the FP32 gradient read once for its norm


@dataclass(frozen=True, slots=True)
class DevicePeaks:
    """What one GPU does at best: dense bf16 matmul FLOP/s, HBM copy bandwidth, pinned host link (one way)."""

    name: str
    flops: float
    hbm_bytes_s: float
    host_bytes_s: float


# The H200's measured (docs/results.md); the others from the vendors' figures: 0.8 of dense bf16 peak, 0.9 of HBM,
# the host link as the H200 measures over PCIe Gen5 x16 (the H100 and H800, one die: the H800's NVLink and FP64
# are what is cut) and about half that over the A100's Gen4.
KNOWN_PEAKS = {
    "H200": DevicePeaks("NVIDIA H200", 796e12, 4.27e12, 55.3e9),
    "H100": DevicePeaks("NVIDIA H100 SXM", 989e12 * 0.8, 3.35e12 * 0.9, 55e9),
    "H800": DevicePeaks("NVIDIA H800", 989e12 * 0.8, 3.35e12 * 0.9, 55e9),
    "A100": DevicePeaks("NVIDIA A100 80GB", 312e12 * 0.8, 2.0e12 * 0.9, 25e9),
}


@dataclass(frozen=True, slots=True)
class GroupLengths:
    """What the cost model needs of one prompt's response lengths: their count, sum, sum of squares and longest."""

    count: int
    total: int
    squares: int
    longest: int

    @staticmethod
    def of(lens: tuple[int, ...]) -> GroupLengths:
        return GroupLengths(len(lens), sum(lens), sum(r * r for r in lens), max(lens, default=0))


RECORDED_FIELDS = ("prompt_tokens", "patches", "frames", "response_lens")  # what a run's metrics keep of a step


@dataclass(frozen=True, slots=True)
class StepTokens:
    """The token counts of one step on one training rank: per prompt, its tokens and vision patches (with the
    temporal patches of its video); per prompt and sample, the response's length. `groups` sums each prompt's
    lengths once, so that the many plans a dry-run prices cost per prompt, not per response."""

    prompt_tokens: tuple[int, ...]
    patches: tuple[int, ...]
    frames: tuple[int, ...]  # temporal patches (grid_t) of each prompt's video
    response_lens: tuple[tuple[int, ...], ...]
    groups: tuple[GroupLengths, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(GroupLengths.of(lens) for lens in self.response_lens))

    @property
    def num_responses(self) -> int:
        return sum(g.count for g in self.groups)

    @property
    def response_tokens(self) -> int:
        return sum(g.total for g in self.groups)

    def of_prompts(self, share: range) -> StepTokens:
        """The token counts of the prompts in `share` and of their responses."""
        fields = (self.prompt_tokens, self.patches, self.frames, self.response_lens)
        return StepTokens(*(tuple(f[i] for i in share) for f in fields))

    def record(self) -> dict[str, tuple]:
        """The counts as a run's metrics line keeps them (`timeplan.recorded_tokens` reads them back)."""
        return {name: getattr(self, name) for name in RECORDED_FIELDS}


@dataclass(frozen=True, slots=True)
class Cost:
    """FLOPs, HBM bytes and host-link bytes of some work on one GPU; its bound on a device, the slowest of the three."""

    flops: float = 0.0
    hbm_bytes: float = 0.0
    host_bytes: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.hbm_bytes + other.hbm_bytes, self.host_bytes + other.host_bytes)

    def scaled(self, k: float) -> Cost:
        return Cost(self.flops * k, self.hbm_bytes * k, self.host_bytes * k)

    def bound_s(self, peaks: DevicePeaks) -> float:
        return max(self.flops / peaks.flops, self.hbm_bytes / peaks.hbm_bytes_s, self.host_bytes / peaks.host_bytes_s)


def layer_params(t: TextConfig) -> int:
    """Matmul parameters of one decoder layer: q, k, v, o, gate, up and down."""
    h, kv = t.hidden_size, t.num_key_value_heads * t.head_dim
    return 2 * h * h + 2 * h * kv + 3 * h * t.intermediate_size


def _llm_flops(t: TextConfig, tokens: float, tp: int) -> float:
    return 2 * t.num_hidden_layers * layer_params(t) * tokens / tp


def _head_flops(t: TextConfig, tokens: float, tp: int, value: bool = False) -> float:
    return 2 * t.hidden_size * (1 if value else t.vocab_size) * tokens / tp


def _attention_flops(t: TextConfig, queries: float, keys: float, tp: int, causal: bool) -> float:
    return 4 * t.hidden_size * queries * keys * t.num_hidden_layers / tp / (2 if causal else 1)


@cache  # a dry-run prices each prompt's video once for every plan it weighs
def vision_forward(v: VisionConfig, patches: int, frames: int, tp: int) -> float:
    """FLOPs of the vision encoder over one video: the patch embedding, its blocks' matmuls, window attention
    (windows of (window_size / patch_size)^2 patches) and full attention within each temporal patch, and the
    merger."""
    hv, iv = v.hidden_size, v.intermediate_size
    embed = 2 * v.in_channels * v.temporal_patch_size * v.patch_size**2 * hv * patches
    block = 2 * (4 * hv * hv + 3 * hv * iv) * patches
    window = (v.window_size // v.patch_size) ** 2
    per_frame = patches / max(frames, 1)
    full = len(v.fullatt_block_indexes)
    attention = 4 * hv * patches * (full * per_frame + (v.depth - full) * min(window, per_frame))
    merged = hv * v.merge_unit
    merger = 2 * (merged * merged + merged * v.out_hidden_size) * patches / v.merge_unit
    return (embed + v.depth * block + attention + merger) / tp


def prefix_forward(t: TextConfig, v: VisionConfig, tokens: StepTokens, tp: int, vision: bool = True) -> Cost:
    """Vision encoder (unless `vision` is False: another op's output) and prompt prefill of every prompt, and the
    last position's logits."""
    flops = 0.0
    for length, patches, frames in zip(tokens.prompt_tokens, tokens.patches, tokens.frames, strict=True):
        flops += (vision_forward(v, patches, frames, 1) if vision else 0.0) + _llm_flops(t, length, tp)
        flops += _attention_flops(t, length, length, tp, causal=True) + _head_flops(t, 1, tp)
    return Cost(flops=flops)


def suffix_forward(t: TextConfig, tokens: StepTokens, tp: int, value: bool = False) -> Cost:
    """Every response over its prompt's boundary: matmuls, attention to the prompt and to itself
    (`suffix_attention_flops`), the LM head (a `value` model's scalar head)."""
    flops = suffix_attention_flops(t, tokens, tp)
    for g in tokens.groups:
        flops += _llm_flops(t, g.total, tp) + _head_flops(t, g.total, tp, value)
    return Cost(flops=flops)


def suffix_attention_flops(t: TextConfig, tokens: StepTokens, tp: int) -> float:
    """The suffix's attention: each response's tokens to its prompt's and to their own earlier ones."""
    flops = 0.0
    for length, g in zip(tokens.prompt_tokens, tokens.groups, strict=True):  # each term linear in r, or in r * r
        flops += _attention_flops(t, g.total, length, tp, causal=False) + _attention_flops(t, g.squares, 1, tp, True)
    return flops


def whole_forward(t: TextConfig, v: VisionConfig, tokens: StepTokens, tp: int, value: bool = False) -> Cost:
    """Textbook scoring: every response over prompt ++ response, the prompt (and its video) recomputed each time;
    the decoder's attention `whole_attention_flops`."""
    flops = whole_attention_flops(t, tokens, tp) + whole_vision_flops(v, tokens)
    for length, g in zip(tokens.prompt_tokens, tokens.groups, strict=True):
        flops += _llm_flops(t, g.count * length + g.total, tp) + _head_flops(t, g.total, tp, value)
    return Cost(flops=flops)


def whole_vision_flops(v: VisionConfig, tokens: StepTokens) -> float:
    """Textbook scoring's vision encoder: each response's sequence runs its prompt's video again."""
    flops = 0.0
    for patches, frames, g in zip(tokens.patches, tokens.frames, tokens.groups, strict=True):
        flops += g.count * vision_forward(v, patches, frames, 1)
    return flops


def whole_attention_flops(t: TextConfig, tokens: StepTokens, tp: int) -> float:
    """The decoder's causal attention of every response over prompt ++ response."""
    flops = 0.0
    for length, g in zip(tokens.prompt_tokens, tokens.groups, strict=True):
        whole_squares = g.count * length * length + 2 * length * g.total + g.squares  # (length + r)^2 summed over r
        flops += _attention_flops(t, whole_squares, 1, tp, causal=True)
    return flops


def backward(split: bool, t: TextConfig, v: VisionConfig, tokens: StepTokens, tp: int, d: Decisions,
             sp: bool = False, value: bool = False) -> Cost:  # fmt: skip
    """A trained role's scoring forward, its backward (twice the forward; a frozen vision tower, which only unsplit
    scoring runs, needs none) and what backward reruns of it (`d.recompute`: every decoder layer, every one but its
    attention, or nothing; not the LM head, which no recompute checkpoints; the actor's last `d.layers_kept`
    decoder layers nothing; a trained vision tower all of its blocks); split, also `prefix_backward`. `value`: a
    value model's (PPO's critic: a scalar head, its prefix tensors kept in HBM)."""
    scoring = suffix_forward(t, tokens, tp, value) if split else whole_forward(t, v, tokens, tp, value)
    vision = 0.0 if split else whole_vision_flops(v, tokens)
    attention = (suffix_attention_flops if split else whole_attention_flops)(t, tokens, tp)
    head = sum(_head_flops(t, g.total, tp, value) for g in tokens.groups)
    layers = scoring.flops - vision - head
    decoder = {Recompute.NONE: 0.0, Recompute.SELECTIVE: layers - attention, Recompute.FULL: layers}[d.recompute]
    rerunning = 1 - (0 if value else d.layers_kept) / t.num_hidden_layers  # the decoder layers that rerun
    trained_vision = 0.0 if d.freeze_vision else vision
    rerun = (trained_vision if d.recompute.reruns else 0.0) + decoder * rerunning
    cost = scoring.scaled(3) + Cost(flops=rerun - 2 * (vision - trained_vision))
    return cost + prefix_backward(t, v, tokens, tp, d, sp, value) if split else cost


def prefix_backward(
    t: TextConfig, v: VisionConfig, tokens: StepTokens, tp: int, d: Decisions, sp: bool = False, value: bool = False
) -> Cost:
    """The backward through an attached prefix (twice its forward), its rerun under recompute, and (the actor's)
    saved tensors' way back from the host."""
    rerun = d.prefix_activations is PrefixActivations.RECOMPUTE
    cost = prefix_forward(t, v, tokens, tp, vision=not d.freeze_vision).scaled(3 if rerun else 2)
    if d.prefix_saved is Residency.HOST and not value:
        cost = cost + Cost(host_bytes=prefix_saved_bytes(t, v, tokens, tp, d, sp))
    return cost


def prefix_saved_bytes(
    t: TextConfig, v: VisionConfig, tokens: StepTokens, tp: int, d: Decisions, sp: bool = False
) -> float:
    """What the attached prefix keeps for its backward (all of it, or the layer inputs under recompute)."""
    prompt, patches = sum(tokens.prompt_tokens), 0 if d.freeze_vision else sum(tokens.patches)
    recompute = d.prefix_activations is PrefixActivations.RECOMPUTE
    llm = prompt * S.prefix_saved_bytes_per_token(t, tp, sp, recompute)
    per_patch = v.hidden_size * S.BF16 if recompute else S.vision_activation_bytes_per_patch(v, tp)
    return llm + patches * v.depth * per_patch


def decode(t: TextConfig, tokens: StepTokens, tp: int) -> Cost:
    """Decode to the longest response: each step reads every weight (but the rows of an untied input embedding it
    gathers: `decode_params_per_rank`) and each live sequence's KV so far, and each prompt's KV once (shared by its
    samples)."""
    weights = S.decode_params_per_rank(t, tp) * S.BF16
    kv = S.kv_bytes_per_token(t, tp)
    steps = max((g.longest for g in tokens.groups), default=0)
    own = sum(g.squares + g.total for g in tokens.groups) / 2  # each sequence reads 1, 2, ..., r of its own tokens
    live_prompts = sum(  # a prompt's KV is read while any of its samples is live
        length * g.longest for length, g in zip(tokens.prompt_tokens, tokens.groups, strict=True)
    )
    hbm = steps * weights + kv * (own + live_prompts)
    flops = 2 * S.decode_params_per_rank(t, tp) * tokens.response_tokens
    return Cost(flops=flops, hbm_bytes=hbm)


def grad_norm_pass(t: TextConfig, v: VisionConfig, tp: int, d: Decisions) -> Cost:
    """What of the update its step waits for when the rest runs beside the next prefix (`update_beside_prefix`):
    the global gradient norm, each FP32 gradient read once."""
    params = S.llm_params_per_rank(t, tp) + (0 if d.freeze_vision else S.vision_params(v, stored=True))
    return Cost(hbm_bytes=GRAD_NORM_BYTES * params)


def update(t: TextConfig, v: VisionConfig, tp: int, d: Decisions, keeps_share: bool = True, shards: int = 1) -> Cost:
    """The AdamW step over this rank's `shards`-th of the parameters (ZeRO-1; all of them without): its state and
    gradients read and written in HBM; over the host link when the state lives in the pinned pool (loaded and
    written back at once, each way on its own copy engine: the bound is one way's bytes), but for the share the
    plan keeps in HBM (`keeps_share`: the actor's update; a critic's state streams whole)."""
    params = S.llm_params_per_rank(t, tp) + (0 if d.freeze_vision else S.vision_params(v, stored=True))
    owned = -(-params // shards)
    kept = d.optimizer_kept_bytes if keeps_share else 0
    host = max(STATE_BYTES * owned - kept, 0) if d.optimizer_state is Residency.HOST else 0.0
    return Cost(hbm_bytes=UPDATE_HBM_BYTES * owned, host_bytes=host)
