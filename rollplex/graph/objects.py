"""The byte model: every object one GPU holds during an iteration, its bytes, class and HBM window.

`memory_objects` reads the compiled graph (roles, split parts, steps, lifetimes) and prices each object
(`memobject.MemObject`) from the model's shapes. An object is in HBM exactly in its `live` steps; elsewhere it
is `outside` (host, dropped, or absent). `lower_residency` turns this list into the per-phase plan.
"""

from __future__ import annotations

from collections.abc import Iterator

import networkx as nx

from rollplex.graph import memobject as M
from rollplex.graph.ir import (
    DATASET,
    NodeKind,
    Part,
    Role,
    TensorClass,
    backpropagated_prompts,
    lifetimes,
    ops,
    steps,
    tensors,
)
from rollplex.graph.memobject import GIB, PROMPT_INPUTS, Component, Context, MemObject, Residency
from rollplex.graph.spec import Spec
from rollplex.graph.workload import per_gpu
from rollplex.layout import shapes as S
from rollplex.layout.sharing import sharing_report
from rollplex.models.config import ModelConfig


def make_context(g: nx.DiGraph, spec: Spec, model: ModelConfig) -> Context:
    p = spec.parallel
    in_place = p.qkv_sharing == "in_place"
    sharing = sharing_report(model.text, p.train_tp, p.rollout_tp, in_place=in_place)
    return Context(g, spec, model, per_gpu(spec, model), sharing)


def role_steps(c: Context, role: Role, *, kinds: tuple[NodeKind, ...] = (), part: Part | None = None) -> set[int]:
    """Steps running an op of `role` (optionally only of these kinds / this part)."""
    chosen = {
        o.id for o in ops(c.g) if o.role is role and (not kinds or o.kind in kinds) and (part is None or o.part is part)
    }
    return {s.index for s in steps(c.g) if chosen & set(s.ops)}


def span(indices: set[int]) -> frozenset[int]:
    return frozenset(range(min(indices), max(indices) + 1)) if indices else frozenset()


def memory_objects(c: Context) -> list[MemObject]:
    objects = [MemObject("runtime", Component.RESERVE, TensorClass.PHASE_LOCAL, _reserve(c), _all(c), Residency.ABSENT)]
    trained = {o.role for o in ops(c.g) if o.kind is NodeKind.UPDATE}
    for role in sorted({o.role for o in ops(c.g) if o.role not in (None, Role.ROLLOUT)}, key=lambda r: r.value):
        objects += list(_model_state(c, role, role in trained))
        objects += list(_boundary(c, role))
    objects += list(_shared_vision(c))
    objects += list(_rollout(c))
    objects += list(_data(c))
    return objects


def _all(c: Context) -> frozenset[int]:
    return frozenset(s.index for s in steps(c.g))


def _reserve(c: Context) -> int:
    return int(c.spec.memory.runtime_reserve_gib * GIB)


def _paged_window(c: Context, role: Role) -> frozenset[int]:
    """Frozen weights the plan may page (`memory.page_reference`) are in HBM only where their role runs."""
    return frozenset(role_steps(c, role))


def _model_state(c: Context, role: Role, trained: bool) -> Iterator[MemObject]:
    """A role's weights, and for a trained role its gradients, activations and optimizer state. Under
    `model.freeze_vision` the vision tower is held once (the actor's; a frozen role reads it) and has no
    gradients or optimizer state."""
    t, tp, frozen = c.model.text, c.gpu.train_tp, c.spec.model.freeze_vision
    vision = S.vision_params(c.model.vision, stored=True)
    trained_vision = 0 if frozen else vision
    paged = not trained and c.spec.memory.page_reference  # frozen weights may wait on the host between uses
    live = _paged_window(c, role) if paged else _all(c)  # trained ones live on: each update writes them in place
    outside = Residency.HOST
    llm = S.value_model_params_per_rank(t, tp) if role is Role.CRITIC else S.llm_params_per_rank(t, tp)
    llm_bytes = llm * S.BF16 if role is Role.CRITIC else c.sharing.train_shard_bytes_per_gpu  # its scalar head
    if role is Role.ACTOR and _shares(c):
        llm_bytes = c.sharing.shared_bytes_per_gpu
    host = llm_bytes if paged else 0
    window = _all(c)  # weights outlive the iteration
    yield MemObject(
        role.value, Component.WEIGHTS, TensorClass.REGENERABLE, llm_bytes, live, outside, False, host, window
    )
    if not (frozen and not trained):
        vhost = vision * S.BF16 if paged else 0
        yield MemObject(
            role.value, Component.WEIGHTS, TensorClass.REGENERABLE, vision * S.BF16, live, outside, True, vhost, window
        )
    backward = role_steps(c, role, kinds=(NodeKind.BACKWARD,))
    if not backward:
        return
    update = role_steps(c, role, kinds=(NodeKind.UPDATE,))
    grads_live = _gradient_window(c, role)
    for n, is_vision in ((llm, False), (trained_vision, True)):
        if not n:
            continue
        yield MemObject(
            role.value,
            Component.GRADIENTS,
            TensorClass.PHASE_LOCAL,
            n * S.FP32,
            grads_live,
            Residency.ABSENT,
            is_vision,
        )
    yield from _activations(c, role, backward)
    if update:
        yield from _optimizer_state(c, role, llm, trained_vision)


def _gradient_window(c: Context, role: Role) -> frozenset[int]:
    """Where a role's FP32 gradients exist: from each mini-batch's first backward step to its update, which drops
    them (`zero_grad`), so not through the next mini-batch's prefix rerun and scoring between the two."""
    chosen = [o for o in ops(c.g) if o.role is role and o.kind in (NodeKind.BACKWARD, NodeKind.UPDATE)]
    windows: dict[int, set[str]] = {}
    for o in chosen:
        windows.setdefault(o.minibatch.index if o.minibatch else 0, set()).add(o.id)
    return frozenset().union(*(span({s.index for s in steps(c.g) if ids & set(s.ops)}) for ids in windows.values()))


def _optimizer_state(c: Context, role: Role, llm: int, vision: int) -> Iterator[MemObject]:
    sharded = c.spec.parallel.distributed_optimizer and role is Role.ACTOR  # a critic's optimizer is not sharded
    shard = c.gpu.train_dp if sharded else 1
    for n, is_vision in ((llm, False), (vision, True)):
        if not n:
            continue
        for comp, per_param in ((Component.MASTER, S.FP32), (Component.MOMENTS, 2 * S.FP32)):
            b = -(-n // shard) * per_param
            yield MemObject(role.value, comp, TensorClass.PERMANENT, b, frozenset(), Residency.HOST, is_vision, b)


def _activations(c: Context, role: Role, backward: set[int]) -> Iterator[MemObject]:
    t, tp = c.model.text, c.gpu.train_tp
    suffix = role_steps(c, role, kinds=(NodeKind.FORWARD,), part=Part.SUFFIX)
    split = bool(suffix)
    tokens = c.gpu.microbatch_tokens if split else c.gpu.group_size * (c.gpu.prompt_tokens + c.gpu.response_tokens)
    sp = c.gpu.sequence_parallel
    layer = S.layer_activation_bytes_per_token(t, tp, sp)
    out = S.output_activation_bytes_per_token(t, tp, sp, value=role is Role.CRITIC)
    kept = {  # per layer: what the layer keeps (rerunning, it holds one layer's activations more while it does)
        "none": layer,
        "selective": S.layer_input_bytes_per_token(t, tp, sp) + S.attention_saved_bytes_per_token(t, tp, not split),
        "full": S.layer_input_bytes_per_token(t, tp, sp),
    }[c.spec.memory.recompute]
    per_token = t.num_hidden_layers * kept + out + (0 if c.spec.memory.recompute == "none" else layer)
    head = 0 if role is Role.CRITIC else S.head_chunk_bytes(t, tp, tokens)
    # the steps that score and backpropagate (not a mini-batch's update or prefix rerun between them)
    live = (
        frozenset(suffix | backward) if split else frozenset(role_steps(c, role, kinds=(NodeKind.FORWARD,)) | backward)
    )
    yield MemObject(
        role.value,
        Component.ACTIVATIONS,
        TensorClass.PHASE_LOCAL,
        tokens * per_token + head,
        live,
        Residency.ABSENT,
        turn=M.SUFFIX_TURN if split else "",
    )
    if split:
        yield _suffix_attention(c, role, live)
        yield from _prefix_saved(c, role, backward)
    elif vision := _unsplit_vision_activations(c):
        yield MemObject(
            role.value, Component.ACTIVATIONS, TensorClass.PHASE_LOCAL, vision, live, Residency.ABSENT, True
        )


def kept_layer_bytes(c: Context, role: Role) -> int:
    """What keeping one more of `role`'s decoder layers whole (`memory.layers_kept`) adds to its microbatch's
    activations under the plan's recompute: the layer's saved tensors less what recompute keeps of it anyway (its
    input; under selective, its attention's), and under full recompute its copy of the suffix's keys, which it
    then holds too (`_suffix_attention`). 0 without recompute."""
    t, tp, g = c.model.text, c.gpu.train_tp, c.gpu
    how, sp = c.spec.memory.recompute, g.sequence_parallel
    if how == "none":
        return 0
    split = bool(role_steps(c, role, kinds=(NodeKind.FORWARD,), part=Part.SUFFIX))
    tokens = g.microbatch_tokens if split else g.group_size * (g.prompt_tokens + g.response_tokens)
    kept = S.layer_input_bytes_per_token(t, tp, sp)
    if how == "selective":
        kept += S.attention_saved_bytes_per_token(t, tp, not split)
    keys = suffix_keys_per_layer(c) if split and how == "full" else 0
    return tokens * (S.layer_activation_bytes_per_token(t, tp, sp) - kept) + keys


def _unsplit_vision_activations(c: Context) -> int:
    """Unsplit, a group's microbatch runs the vision tower once for each of its sequences (`hidden` over prompt ++
    response) and keeps its saved tensors: every block's (or under recompute, selective or full, each block's
    input, and one block's whole while backward reruns it) for each patch. None for a frozen tower: nothing in it
    needs a gradient."""
    if c.spec.model.freeze_vision:
        return 0
    v = c.model.vision
    full = S.vision_activation_bytes_per_patch(v, c.gpu.train_tp)
    per_patch = v.depth * v.hidden_size * S.BF16 + full if c.spec.memory.recompute != "none" else v.depth * full
    return c.gpu.group_size * c.gpu.patches_per_prompt * per_patch


def _suffix_attention(c: Context, role: Role, live: frozenset[int]) -> MemObject:
    """The scoring attention's keys and values (`PackedPrefixAttention`): per decoder layer, the prompts' boundary
    KV copied end to end beside the packed tokens' own, kv_bytes_per_token / layers for each of the rank's prompt
    tokens and a microbatch's response tokens. Saved for backward in every layer (under selective recompute too:
    the attention keeps what it saves); under full recompute the layer is checkpointed, and one layer's copy and,
    in backward, its gradient are alive at a time."""
    t = c.model.text
    layers = 2 if c.spec.memory.recompute == "full" else t.num_hidden_layers
    return MemObject(
        role.value, Component.SUFFIX_ATTENTION, TensorClass.PHASE_LOCAL, layers * suffix_keys_per_layer(c), live,
        Residency.ABSENT, turn=M.SUFFIX_TURN,
    )  # fmt: skip


def suffix_keys_per_layer(c: Context) -> int:
    """One decoder layer's keys and values of the scoring attention (`_suffix_attention`)."""
    t, g = c.model.text, c.gpu
    keys = g.prompts_per_rank * g.prompt_tokens + g.microbatch_tokens
    return keys * S.kv_bytes_per_token(t, g.train_tp) // t.num_hidden_layers


def _prefix_saved(c: Context, role: Role, backward: set[int]) -> Iterator[MemObject]:
    """Saved tensors of the attached prefix: offloaded (or reduced to layer inputs) as they are produced;
    one layer of one group of prompts (`sharing.prompts_per_chunk`) is in HBM while the prefix runs and again
    while backward rematerializes it, a turn of the backward step apart from the suffix's microbatches (freed
    before the backward through the prefix starts). Offloaded, the next layer's saved tensors come back during
    that layer's backward (`SavedTensorOffload`: at most the largest saved tensor ahead, a layer's input or the
    boundary norm's FP32 input): not counted, one tensor beside the layer in flight."""
    t, v, tp, g = c.model.text, c.model.vision, c.gpu.train_tp, c.gpu
    P, patches = g.prompt_tokens, g.patches_per_prompt
    sp = g.sequence_parallel
    full_llm, full_vis = S.layer_activation_bytes_per_token(t, tp, sp), S.vision_activation_bytes_per_patch(v, tp)
    recompute = c.spec.memory.prefix_activations != "offload"
    llm = P * S.prefix_saved_bytes_per_token(t, tp, sp, recompute)
    # the vision tower is replicated on every rank: whole blocks' inputs under recompute
    vis = patches * v.depth * (v.hidden_size * S.BF16 if recompute else full_vis)
    if c.spec.model.freeze_vision:
        vis = 0  # the shared vision output carries no graph: the gradient stops at the embeddings
    prefix = role_steps(c, role, part=Part.PREFIX)
    window = span(prefix | backward)
    first = next((o for o in ops(c.g) if o.role is role and o.part is Part.PREFIX), None)
    kept = backpropagated_prompts(ops(c.g), first) if first is not None else None
    prompts = g.prompts_per_rank // (kept.count if kept else 1)  # mini-batches: each its own prompts' graph
    for b, is_vision in ((llm, False), (vis, True)):
        if not b:
            continue
        size = b * prompts
        if role is not Role.ACTOR:  # only the actor's go to the host pool (`SavedTensorOffload`); a critic's stay
            yield MemObject(role.value, Component.PREFIX_SAVED, TensorClass.PHASE_LOCAL, size, window,
                            Residency.ABSENT, is_vision)  # fmt: skip
            continue
        yield MemObject(
            role.value,
            Component.PREFIX_SAVED,
            TensorClass.PHASE_LOCAL,
            size,
            frozenset(),
            Residency.HOST,
            is_vision,
            size,
            window,
        )
    in_flight = min(c.spec.sharing.prompts_per_chunk or g.prompts_per_rank, g.prompts_per_rank)  # one group's
    one_layer = in_flight * (P * full_llm + patches * full_vis)
    yield MemObject(
        role.value,
        Component.PREFIX_LAYER,
        TensorClass.PHASE_LOCAL,
        one_layer,
        frozenset(prefix | backward),
        Residency.ABSENT,
        turn=M.PREFIX_TURN,
    )


def _shared_vision(c: Context) -> Iterator[MemObject]:
    """`model.freeze_vision`: the step's vision output, from the first prefix that embeds a prompt to the last."""
    prefixes = set().union(
        *(role_steps(c, role, part=Part.PREFIX) for role in (Role.ACTOR, Role.REFERENCE, Role.CRITIC))
    )
    if not c.spec.model.freeze_vision or not prefixes:
        return
    itemsize = S.FP32 if c.spec.run.dtype == "float32" else S.BF16
    b = c.gpu.prompts_per_rank * c.gpu.visual_tokens * c.model.vision.out_hidden_size * itemsize
    yield MemObject("actor", Component.VISION_OUTPUT, TensorClass.PHASE_LOCAL, b, span(prefixes), Residency.ABSENT)


def _boundary(c: Context, role: Role) -> Iterator[MemObject]:
    t, g = c.model.text, c.gpu
    for name, info in tensors(c.g).items():
        prod = next((o for o in ops(c.g) if name in o.outputs), None)
        if info.cls is not TensorClass.BOUNDARY or prod is None or prod.role is not role:
            continue
        life = lifetimes(c.g)[name]
        live = frozenset(range(life.first, life.last + 1))
        prompts = g.prompts_per_rank // (prod.minibatch.count if prod.minibatch else 1)  # a mini-batch's rerun: its own
        kv = prompts * g.prompt_tokens * S.kv_bytes_per_token(t, g.train_tp)
        yield MemObject(role.value, Component.BOUNDARY_KV, TensorClass.BOUNDARY, kv, live, Residency.ABSENT)
        lp = prompts * (t.vocab_size // g.train_tp) * S.FP32
        yield MemObject(role.value, Component.BOUNDARY_LOGPROBS, TensorClass.BOUNDARY, lp, live, Residency.ABSENT)
        backward = frozenset(
            s.index for s in steps(c.g) for n in s.ops if c.g.nodes[n]["op"].kind is NodeKind.BACKWARD
            and name in c.g.nodes[n]["op"].inputs
        )  # fmt: skip
        if backward:  # the suffix backwards sum into a gradient as large as the KV, until the prefix backward reads it
            yield MemObject(
                role.value, Component.BOUNDARY_GRADIENT, TensorClass.PHASE_LOCAL, kv, backward, Residency.ABSENT
            )


def _shares(c: Context) -> bool:
    return c.spec.memory.weight_sharing and bool(role_steps(c, Role.ROLLOUT))


def _rollout(c: Context) -> Iterator[MemObject]:
    decode = frozenset(role_steps(c, Role.ROLLOUT))
    if not decode:
        return
    t, g = c.model.text, c.gpu
    yield MemObject(
        "rollout", Component.KV_CACHE, TensorClass.PHASE_LOCAL, rollout_kv_bytes(c), decode, Residency.ABSENT
    )
    always = _all(c)  # the Case-3 buffer and the rollout's own copy are allocated once and refreshed in place
    if _shares(c):
        buf = c.sharing.case3_buffer_bytes_per_gpu
        if buf:  # the paper's copy path; read in place, the Case-3 tensors are part of the shared storage
            yield MemObject("rollout", Component.CASE3_BUFFER, TensorClass.REGENERABLE, buf, always, Residency.ABSENT)
        return
    llm = S.llm_params_per_rank(t, g.rollout_tp) * S.BF16
    vision = S.vision_params(c.model.vision, stored=True) * S.BF16
    yield MemObject("rollout", Component.WEIGHTS, TensorClass.REGENERABLE, llm, always, Residency.ABSENT)
    yield MemObject("rollout", Component.WEIGHTS, TensorClass.REGENERABLE, vision, always, Residency.ABSENT, True)


def rollout_kv_bytes(c: Context) -> int:
    """The spec's budget, or the rollout engine's caches for the replica's sequences, laid out as the engine lays
    them out: each prompt's KV once (its capacity rounded up, `shapes.prompt_capacity`), each sequence's response
    KV, one spare slot, in the run's dtype."""
    if c.spec.memory.rollout_kv_gib is not None:
        return int(c.spec.memory.rollout_kv_gib * GIB)
    g = c.gpu
    slots = g.prompts_per_replica * g.group_size + 1
    tokens = g.prompts_per_replica * S.prompt_capacity(g.prompt_tokens) + slots * g.response_tokens
    itemsize = S.FP32 if c.spec.run.dtype == "float32" else S.BF16
    return tokens * S.kv_bytes_per_token(c.model.text, g.rollout_tp) // S.BF16 * itemsize


def _data(c: Context) -> Iterator[MemObject]:
    """Tensors the graph passes between nodes; the dataset's prompts wait in host memory, the step's and the next
    step's (`rollplex.data.prefetch` makes them during the step before)."""
    g, life = c.gpu, lifetimes(c.g)
    for name, info in tensors(c.g).items():
        prod = next((o for o in ops(c.g) if name in o.outputs), None)
        if info.cls is TensorClass.BOUNDARY or (prod and prod.kind in (NodeKind.BACKWARD, NodeKind.UPDATE)):
            continue
        if name == DATASET:
            b = 2 * g.prompts_per_rank * (g.patches_per_prompt * _patch_bytes(c) + g.prompt_tokens * 8)
            yield MemObject("data", Component.DATA, info.cls, b, frozenset(), Residency.HOST, host_bytes=b, name=name)
            continue
        per_seq = S.FP32 if prod.kind is NodeKind.REWARD else g.response_tokens * S.FP32
        live = frozenset(range(life[name].first, life[name].last + 1))
        yield MemObject(
            "data", Component.DATA, info.cls, g.sequences_per_rank * per_seq, live, Residency.ABSENT, name=name
        )


def prompt_inputs_first(c: Context, live: set[int]) -> MemObject:
    """The actor prefix's inputs, copied to the device before it runs while a deferred update's state takes the host
    link (`Qwen2_5_VL.prefix_chunks` with `inputs_first`): a step's patches in FP32 with four int64 index lists
    each, its tokens with six."""
    g = c.gpu
    b = g.prompts_per_rank * (g.patches_per_prompt * (_patch_bytes(c) + 4 * 8) + g.prompt_tokens * 6 * 8)
    return MemObject(
        "data", Component.DATA, TensorClass.PHASE_LOCAL, b, frozenset(live), Residency.ABSENT, name=PROMPT_INPUTS
    )


def _patch_bytes(c: Context) -> int:
    """One patch as the processor gives it: FP32 pixels."""
    v = c.model.vision
    return v.in_channels * v.temporal_patch_size * v.patch_size**2 * S.FP32
