"""The cost model: each phase's FLOPs and bytes for one step of a compiled plan, and its bound on a device.

bound = max(FLOPs / peak FLOP/s, HBM bytes / HBM bandwidth, host bytes / host-link bandwidth) for each part of
an op (rollout's prefill and its decode are two parts, one after the other), summed per phase timer (the keys
of `time_s`: `rollout`, `ref_prefix`, ...). The counts follow the model config, the step's token counts
(`StepTokens`: each prompt's tokens and patches, each response's length) and the plan's choices (recompute,
where the prefix's saved tensors and the optimizer state live). Conventions: a matmul pass
costs 2 x parameters x tokens, its backward twice that, a recompute what it reruns of the forward; attention 4 x width x
queries x keys per layer, half of it when causal; decode reads every weight (but an untied input embedding's
table, whose rows it gathers) and every live KV once per step. Per GPU: training counts divide by the train TP
degree, rollout's by the rollout TP degree. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from rollplex.graph.decisions import Decisions, PrefixActivations, Recompute
from rollplex.graph.ir import (
    NodeKind,
    Op,
    Part,
    Role,
    backpropagated_prompts,
    op,
    ops,
    prefilled_decodes,
    steps,
    steps_of,
)
from rollplex.graph.memobject import Component, Residency
from rollplex.graph.workload import PerGpu
from rollplex.layout import shapes as S
from rollplex.models.config import ModelConfig, TextConfig, VisionConfig

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
class StepTokens:
    """The token counts of one step on one training rank: per prompt, its tokens and vision patches (with the
    temporal patches of its video); per prompt and sample, the response's length."""

    prompt_tokens: tuple[int, ...]
    patches: tuple[int, ...]
    frames: tuple[int, ...]  # temporal patches (grid_t) of each prompt's video
    response_lens: tuple[tuple[int, ...], ...]

    @property
    def num_responses(self) -> int:
        return sum(len(r) for r in self.response_lens)

    @property
    def response_tokens(self) -> int:
        return sum(sum(r) for r in self.response_lens)

    def of_prompts(self, share: range) -> StepTokens:
        """The token counts of the prompts in `share` and of their responses."""
        fields = (self.prompt_tokens, self.patches, self.frames, self.response_lens)
        return StepTokens(*(tuple(f[i] for i in share) for f in fields))


@dataclass(frozen=True, slots=True)
class Cost:
    flops: float = 0.0
    hbm_bytes: float = 0.0
    host_bytes: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.flops + other.flops, self.hbm_bytes + other.hbm_bytes, self.host_bytes + other.host_bytes)

    def scaled(self, k: float) -> Cost:
        return Cost(self.flops * k, self.hbm_bytes * k, self.host_bytes * k)

    def bound_s(self, peaks: DevicePeaks) -> float:
        return max(self.flops / peaks.flops, self.hbm_bytes / peaks.hbm_bytes_s, self.host_bytes / peaks.host_bytes_s)


def phase_costs(
    ops_: Sequence[Op],
    model: ModelConfig,
    gpu: PerGpu,
    d: Decisions,
    tokens: StepTokens,
    held: bool = False,
    deferred: bool = False,
) -> dict[str, tuple[Cost, ...]]:
    """{timer: the parts of its ops, in order} of one step. Under `update_beside_prefix`: `held`, the step's actor
    prefix runs the step before's actor update beside it (priced as this step's, the two as one part: one
    resource's work beside another's); `deferred`, the step's own actor update runs on past it, its update timer
    waiting for the gradient norm only."""
    split = {o.role for o in ops_ if o.part is Part.SUFFIX}  # the roles whose scoring starts at a boundary
    embedder = vision_embedder(ops_)
    prefilled = prefilled_decodes(ops_)
    out: dict[str, tuple[Cost, ...]] = {}
    for o in ops_:
        kept = backpropagated_prompts(ops_, o) if o.part is Part.PREFIX else None
        graph_share = None if kept is None else 1.0 / kept.count
        parts = op_parts(o, model, gpu, d, tokens, o.role in split, o is embedder, o.id in prefilled, graph_share)
        if deferred and _is_actor_update(o):
            parts = (grad_norm_pass(model.text, model.vision, gpu.train_tp, d),)
        out[timer_of(o)] = out.get(timer_of(o), ()) + parts
    if held and "actor_prefix" in out:
        out["actor_prefix"] = (total(out["actor_prefix"]) + actor_update(ops_, model, gpu, d, tokens),)
    return out


def actor_update(ops_: Sequence[Op], model: ModelConfig, gpu: PerGpu, d: Decisions, tokens: StepTokens) -> Cost:
    """The actor's update of one step, whole (a critic's is not in it)."""
    parts = [op_parts(o, model, gpu, d, tokens, split=False) for o in ops_ if _is_actor_update(o)]
    return total([p for each in parts for p in each])


def _is_actor_update(o: Op) -> bool:
    return o.kind is NodeKind.UPDATE and o.role is Role.ACTOR


def vision_embedder(ops_: Sequence[Op]) -> Op | None:
    """Under `model.freeze_vision`, the prefix op counted for the step's one vision forward (`SharedVision`: the
    first prefix to reach a prompt runs it): the reference's, else the actor's first."""
    prefixes = [o for o in ops_ if o.kind is NodeKind.FORWARD and o.part is Part.PREFIX]
    return next((o for o in prefixes if o.role is Role.REFERENCE), prefixes[0] if prefixes else None)


def plan_phase_costs(
    plan, tokens: StepTokens, held: bool | None = None, deferred: bool | None = None
) -> dict[str, tuple[Cost, ...]]:
    """`phase_costs` of a compiled plan, the reference's page-ins first in the timers of the ops they precede.
    `held`, `deferred` (`phase_costs`): by default a step of the plan's steady state, both where it runs the actor's
    update on into the next actor prefix (`update_beside_prefix`, a graph with an actor prefix); False, False prices
    the prefix and the update each alone."""
    g, d = plan.graph, plan.decisions
    steady = d.update_beside_prefix and any(o.role is Role.ACTOR and o.part is Part.PREFIX for o in ops(g))
    held, deferred = steady if held is None else held, steady if deferred is None else deferred
    costs = phase_costs(list(ops(g)), plan.loaded.model, plan.context.gpu, d, tokens, held, deferred)
    for timer, num_bytes in reference_page_ins(plan):
        costs[timer] = (Cost(host_bytes=num_bytes), *costs[timer])
    return costs


def plan_actor_update(plan, tokens: StepTokens) -> Cost:
    """`actor_update` of a compiled plan: what the step before's update adds to an actor prefix that runs it."""
    return actor_update(list(ops(plan.graph)), plan.loaded.model, plan.context.gpu, plan.decisions, tokens)


def plan_prefix_backward(plan, tokens: StepTokens) -> Cost | None:
    """The actor's backwards through its prefix in a step of a compiled plan (`prefix_backward`, each mini-batch's
    through its own prompts'): a part of `actor_suffix_backward`; None unsplit."""
    g, model, gpu, d = plan.graph, plan.loaded.model, plan.context.gpu, plan.decisions
    backwards = [o for o in ops(g) if o.role is Role.ACTOR and o.kind is NodeKind.BACKWARD]
    if not backwards or not any(o.role is Role.ACTOR and o.part is Part.PREFIX for o in ops(g)):
        return None
    return prefix_backward(model.text, model.vision, tokens, gpu.train_tp, d, gpu.sequence_parallel)


def reference_page_ins(plan) -> list[tuple[str, int]]:
    """Where the plan pages the reference (`memory.page_reference`), its weights cross the host link inwards at
    the start of each run of consecutive steps that use them and leave without a copy (`WeightPager`): per run,
    the timer of its first reference op and the bytes (per GPU)."""
    if plan.decisions.reference_weights is not Residency.HOST:
        return []
    held = (o for o in plan.residency.objects if o.role == Role.REFERENCE.value and o.component is Component.WEIGHTS)
    weights = sum(o.bytes for o in held)
    used = steps_of(plan.graph, Role.REFERENCE)
    firsts = [
        next(op(plan.graph, n) for n in s.ops if op(plan.graph, n).role is Role.REFERENCE)
        for s in steps(plan.graph)
        if s.index in used and s.index - 1 not in used
    ]
    return [(timer_of(o), weights) for o in firsts]


def phase_bounds(costs: dict[str, tuple[Cost, ...]], peaks: DevicePeaks) -> dict[str, float]:
    """Seconds at the bound of each timer: its parts one after another."""
    return {k: sum(part.bound_s(peaks) for part in parts) for k, parts in costs.items()}


def total(parts: Sequence[Cost]) -> Cost:
    out = Cost()
    for part in parts:
        out = out + part
    return out


TIMERS = (
    "rollout", "reward", "ref_prefix", "actor_prefix", "critic_prefix", "ref_suffix", "actor_suffix_backward",
    "critic_suffix_backward", "update",
)  # fmt: skip


def timer_of(o: Op) -> str:
    """The `time_s` key (one of `TIMERS`) an op's seconds count under, at run time and in the time plan (a step
    records the timers of its graph's ops, `timers`)."""
    if o.kind is NodeKind.DECODE:
        return "rollout"
    if o.kind in (NodeKind.REWARD, NodeKind.UPDATE):
        return o.kind.value
    who = {Role.REFERENCE: "ref", Role.CRITIC: "critic"}.get(o.role, "actor")
    if o.part is Part.PREFIX:
        return f"{who}_prefix"
    return "ref_suffix" if who == "ref" else f"{who}_suffix_backward"


def timers(ops_: Sequence[Op]) -> tuple[str, ...]:
    """The timers of these ops, in `TIMERS` order."""
    used = {timer_of(o) for o in ops_}
    return tuple(t for t in TIMERS if t in used)


def op_parts(o: Op, model: ModelConfig, gpu: PerGpu, d: Decisions, tokens: StepTokens, split: bool,
             embeds_vision: bool = True, prefilled: bool = False, graph_share: float | None = None
             ) -> tuple[Cost, ...]:  # fmt: skip
    """An op's parts, one after another: rollout's prefill (unless `prefilled`: it reads a prefix's boundary,
    `prefill_from_actor`) then its decode; one part for any other op (`op_cost`)."""
    if o.kind is NodeKind.DECODE:
        t, v = model.text, model.vision
        tokens = slowest_replica(t, tokens, gpu)
        prefill = () if prefilled else (prefix_forward(t, v, tokens, gpu.rollout_tp),)
        return *prefill, decode(t, tokens, gpu.rollout_tp)
    return (op_cost(o, model, gpu, d, tokens, split, embeds_vision, graph_share),)


def slowest_replica(t: TextConfig, tokens: StepTokens, gpu: PerGpu) -> StepTokens:
    """What a training rank's rollout waits for: where its replicas share the prompts (`parallel.split_rollout`),
    the share that decodes the most bytes (they decode at once); else every prompt."""
    if gpu.prompts_per_replica >= gpu.prompts_per_rank:
        return tokens
    parts = [tokens.of_prompts(share) for share in S.shares(len(tokens.prompt_tokens), gpu.train_tp // gpu.rollout_tp)]
    return max(parts, key=lambda part: decode(t, part, gpu.rollout_tp).hbm_bytes)


def op_cost(o: Op, model: ModelConfig, gpu: PerGpu, d: Decisions, tokens: StepTokens, split: bool,
            embeds_vision: bool = True, graph_share: float | None = None) -> Cost:  # fmt: skip
    """One op's cost (parts summed); `split`: the op's role scores from a boundary (its backward has a prefix);
    `embeds_vision`: a prefix op runs the vision tower even under `freeze_vision` (`vision_embedder`);
    `graph_share`: the part of the step's prompts a prefix op keeps its graph for (`ir.backpropagated_prompts`;
    default its own share)."""
    t, v, tp = model.text, model.vision, gpu.train_tp
    share = _share(o, tokens)
    if o.kind is NodeKind.DECODE:
        return total(op_parts(o, model, gpu, d, tokens, split, embeds_vision))
    if o.kind is NodeKind.UPDATE:
        actor = o.role is Role.ACTOR  # a critic's optimizer is not sharded (ZeRO-1 is the actor's)
        shards = gpu.train_dp if d.distributed_optimizer and actor else 1
        return update(t, v, tp, d, keeps_share=actor, shards=shards)
    if o.kind is NodeKind.REWARD:
        return Cost()
    if o.kind is NodeKind.FORWARD and o.part is Part.PREFIX:
        cost = prefix_forward(t, v, tokens, tp, vision=embeds_vision or not d.freeze_vision).scaled(share)
        if o.role is Role.ACTOR and d.prefix_saved is Residency.HOST:
            saved = _prefix_saved_bytes(t, v, tokens, tp, d, gpu.sequence_parallel)
            cost = cost + Cost(host_bytes=(share if graph_share is None else graph_share) * saved)
        return cost
    if o.kind is NodeKind.FORWARD:
        if o.fused_into is not None:
            return Cost()  # a trained role's scoring runs fused with its backward (the backward op counts it)
        return (suffix_forward(t, tokens, tp) if o.part is Part.SUFFIX else whole_forward(t, v, tokens, tp)).scaled(
            share
        )
    value, sp = o.role is Role.CRITIC, gpu.sequence_parallel  # a value model: a scalar head for the LM head
    return backward(split, t, v, tokens, tp, d, sp, value).scaled(share)


def _share(o: Op, tokens: StepTokens) -> float:
    return 1.0 if o.minibatch is None else 1.0 / o.minibatch.count  # a mini-batch's share of the prompts, or all


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
    for lens in tokens.response_lens:
        flops += _llm_flops(t, sum(lens), tp) + _head_flops(t, sum(lens), tp, value)
    return Cost(flops=flops)


def suffix_attention_flops(t: TextConfig, tokens: StepTokens, tp: int) -> float:
    """The suffix's attention: each response's tokens to its prompt's and to their own earlier ones."""
    flops = 0.0
    for length, lens in zip(tokens.prompt_tokens, tokens.response_lens, strict=True):
        tokens_, squares = sum(lens), sum(r * r for r in lens)  # each term is linear in r, or in r * r
        flops += _attention_flops(t, tokens_, length, tp, causal=False) + _attention_flops(t, squares, 1, tp, True)
    return flops


def whole_forward(t: TextConfig, v: VisionConfig, tokens: StepTokens, tp: int, value: bool = False) -> Cost:
    """Textbook scoring: every response over prompt ++ response, the prompt (and its video) recomputed each time;
    the decoder's attention `whole_attention_flops`."""
    flops = whole_attention_flops(t, tokens, tp) + whole_vision_flops(v, tokens)
    for length, lens in zip(tokens.prompt_tokens, tokens.response_lens, strict=True):
        n, tokens_ = len(lens), sum(lens)
        flops += _llm_flops(t, n * length + tokens_, tp) + _head_flops(t, tokens_, tp, value)
    return Cost(flops=flops)


def whole_vision_flops(v: VisionConfig, tokens: StepTokens) -> float:
    """Textbook scoring's vision encoder: each response's sequence runs its prompt's video again."""
    flops = 0.0
    for patches, frames, lens in zip(tokens.patches, tokens.frames, tokens.response_lens, strict=True):
        flops += len(lens) * vision_forward(v, patches, frames, 1)
    return flops


def whole_attention_flops(t: TextConfig, tokens: StepTokens, tp: int) -> float:
    """The decoder's causal attention of every response over prompt ++ response."""
    flops = 0.0
    for length, lens in zip(tokens.prompt_tokens, tokens.response_lens, strict=True):
        n, tokens_, squares = len(lens), sum(lens), sum(r * r for r in lens)
        whole_squares = n * length * length + 2 * length * tokens_ + squares  # (length + r)^2 summed over r
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
    head = sum(_head_flops(t, sum(lens), tp, value) for lens in tokens.response_lens)
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
        cost = cost + Cost(host_bytes=_prefix_saved_bytes(t, v, tokens, tp, d, sp))
    return cost


def _prefix_saved_bytes(
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
    lens = [r for group in tokens.response_lens for r in group]
    steps = max(lens, default=0)
    own = sum(r * (r + 1) / 2 for r in lens)  # each sequence reads 1, 2, ..., r of its own tokens
    live_prompts = sum(  # a prompt's KV is read while any of its samples is live
        length * max(group, default=0) for length, group in zip(tokens.prompt_tokens, tokens.response_lens, strict=True)
    )
    hbm = steps * weights + kv * (own + live_prompts)
    flops = 2 * S.decode_params_per_rank(t, tp) * sum(lens)
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
