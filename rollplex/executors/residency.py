"""The plan's residency and recompute decisions made concrete for the engines: where the actor prefix's saved
tensors live (a host pool or HBM) and which of its units backward reruns, what the training microbatch
checkpoints, and the reference's weights paged from the host on a GPU. None of it changes a gradient. The plan
takes the decisions (`rollplex.graph.decisions`); `build_engines` holds what these return."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from rollplex.graph.decisions import Decisions, PrefixActivations, Recompute
from rollplex.graph.memobject import Residency
from rollplex.models.model import Qwen2_5_VL
from rollplex.models.rerun import Rerun


def make_prefix_memory(d: Decisions, actor: Qwen2_5_VL) -> Callable[[], AbstractContextManager]:
    """What gives back the attached actor prefix's saved tensors between Phase 1 and its backward, as the plan
    places them: what autograd keeps (everything under `PrefixActivations.OFFLOAD`, the inputs of the
    checkpointed units under `RECOMPUTE`, see `make_prefix_rerun`) goes to a host pool of the plan's size (pinned
    on a GPU) when the plan puts them on the host, and stays in HBM when it keeps them there. None of it changes a
    gradient."""
    from rollplex.memory.host_pool import HostPool
    from rollplex.memory.offload import SavedTensorOffload

    if d.prefix_saved is not Residency.HOST:
        return nullcontext
    pool = HostPool(d.host_pool_bytes, pin=actor.device.type == "cuda")
    offload = SavedTensorOffload(pool, keep=actor.parameters())
    return lambda: offload


def make_prefix_rerun(d: Decisions, device: torch.device) -> Rerun | None:
    """`PrefixActivations.RECOMPUTE`: each vision block and decoder layer of the actor prefix keeps only its input
    and backward reruns it, on this (the trainer's) stream even where the prefix ran beside decode on a partition
    of the SMs (`rollplex.models.rerun`); `OFFLOAD` keeps every activation (None)."""
    if d.prefix_activations is not PrefixActivations.RECOMPUTE:
        return None
    return Rerun(torch.cuda.current_stream(device) if device.type == "cuda" else None)


def make_microbatch_memory(d: Decisions, actor: Qwen2_5_VL, kept: int = 0) -> Callable[[], AbstractContextManager]:
    """The plan's `recompute` of the training microbatch, as the plan counts it: `FULL` checkpoints every decoder
    layer and vision block (inputs kept, backward reruns them); `SELECTIVE` each decoder layer's two halves around
    its attention (`DecoderLayer.before_attention`, `after_attention`: the attention's own saved tensors kept, it
    does not run twice) and every vision block whole; `NONE` keeps every activation. The last `kept` decoder layers
    (the actor's `d.layers_kept`) keep every activation either way."""
    from rollplex.memory.offload import recompute_methods

    if d.recompute is Recompute.NONE:
        return nullcontext
    layers = actor.model.language_model.layers[: len(actor.model.language_model.layers) - kept]
    halves = ("forward",) if d.recompute is Recompute.FULL else ("before_attention", "after_attention")
    units = [(b, "forward") for b in actor.model.visual.blocks] + [(x, h) for x in layers for h in halves]
    return lambda: recompute_methods(units)


def make_reference_pager(reference: Qwen2_5_VL, own_vision: bool = True):
    """On a GPU, the reference's weights in a VMM region, on the host outside the steps that use them (as the
    plan has them); without `own_vision` (the actor's frozen tower) its language model and head only. None on the
    CPU."""
    if reference.device.type != "cuda":
        return None
    if not own_vision:
        reference = torch.nn.ModuleList([reference.model.language_model, reference.lm_head])
    from rollplex.memory.pager import WeightPager
    from rollplex.memory.vmm import VmmArena

    device = reference.device.index if reference.device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(device).total_memory
    return WeightPager(reference, VmmArena(total, device))
