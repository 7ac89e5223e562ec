"""The engines one process runs: actor (trained; rollout reads its weights), frozen reference, optimizer,
sampling, tokenizer and reward. Built from a compiled plan by `build_engines`; the runtime only uses them.

Rollout always reads the actor's own parameters, so training and rollout share every weight: on the CPU
through the plain decode loop (`rollplex.models.generate`), on a GPU through the graph-captured engine
(`rollplex.rollout`), which reads the packed projections in place. Under tensor parallelism
(`parallel.train_tp` > 1, one process per rank: `distributed.py`) the actor and reference are this rank's
Megatron-layout shards, rollout runs a replica at `parallel.rollout_tp` bound over them
(`rollplex.parallel.bind`), and `publish` after each update fills the replica's regions the other ranks own.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from rollplex.data.presets import LengthDistribution, synthetic_preset
from rollplex.data.rewards import RewardTerms, reward_terms
from rollplex.data.tokenizer import CharTokenizer, HFTokenizer, Tokenizer
from rollplex.errors import SpecError
from rollplex.executors.dataparallel import DataParallel
from rollplex.executors.distributed import TPSetup, init_parallel
from rollplex.executors.grpo import GrpoConfig
from rollplex.executors.policies import PrefixStreams, decode_kernels_for, make_prefix_streams, make_remote_rollout
from rollplex.executors.ppo import PpoConfig
from rollplex.graph.decisions import Decisions, PrefixActivations, Recompute, SharingPolicy
from rollplex.graph.ir import Role, roles
from rollplex.graph.load import LoadedSpec
from rollplex.graph.memobject import Residency
from rollplex.graph.plan import Plan
from rollplex.graph.refusals import run_refusals
from rollplex.graph.spec_files import model_dir
from rollplex.memory.in_flight import gate_modules
from rollplex.memory.optimizer import ChunkedAdamW
from rollplex.memory.state_layout import Shard
from rollplex.models.checkpoint import load_checkpoint
from rollplex.models.generate import Rollout, generate
from rollplex.models.layers import compile_halves
from rollplex.models.model import Qwen2_5_VL
from rollplex.models.rerun import Rerun
from rollplex.models.sampling import SamplingParams
from rollplex.models.values import make_value_model
from rollplex.parallel.bind import QKVPath, bind_rollout
from rollplex.parallel.model import parallelize, sharded_parameters
from rollplex.parallel.replicas import split_rollout

RolloutFn = Callable[..., Rollout]  # (prompts, *, num_samples, params, generator) -> Rollout


@dataclass
class Engines:
    actor: Qwen2_5_VL
    rollout: RolloutFn  # samples with the actor's weights
    rollout_stats: Callable[[], object | None]  # the last rollout's `RolloutStats` on a GPU, else None
    reference: Qwen2_5_VL | None
    optimizer: ChunkedAdamW
    sampling: SamplingParams
    generator: torch.Generator
    tokenizer: Tokenizer
    reward: RewardTerms
    grpo: GrpoConfig
    group_size: int
    microbatch_tokens: int | None = None  # `memory.microbatch_tokens`: a split microbatch's tokens (fewer or more)
    layers_per_chunk: int = 1  # decoder layers per chunk of prefix work beside decode
    prompts_per_chunk: int | None = None  # prompts per chunk of prefix work (both schedules); None: all
    prefix_streams: PrefixStreams = field(default_factory=lambda: PrefixStreams())  # where prefixes run beside decode
    tp: TPSetup | None = None  # tensor-parallel groups; None in a one-process run
    reference_pager: object | None = None  # `rollplex.memory.pager.WeightPager` of the reference (GPU), or None
    prefix_memory: Callable[[], AbstractContextManager] = nullcontext  # each actor-prefix chunk runs inside one
    prefix_rerun: Rerun | None = None  # `memory.prefix_activations: recompute`: the actor prefix's checkpointing
    microbatch_memory: Callable[[], AbstractContextManager] = nullcontext  # each training microbatch's forward
    response_lengths: LengthDistribution | None = None  # `workload.replay_lengths`: budgets drawn per rollout
    publish: Callable[[], None] = field(default=lambda: None)  # makes an update visible to rollout
    freeze_vision: bool = False  # the tower is frozen and the reference holds the actor's: prefixes share its output
    critic: Qwen2_5_VL | None = None  # PPO's value model (`rollplex.models.values`), when the graph has a critic
    critic_microbatch_memory: Callable[[], AbstractContextManager] = nullcontext  # the critic's, as the actor's
    critic_optimizer: ChunkedAdamW | None = None
    ppo: PpoConfig | None = None
    dp: DataParallel | None = None  # data-parallel ranks (`dataparallel.py`); None in a one-replica run
    rollout_draws_per_step: bool = True  # the CPU loop draws from `generator` each step; a GPU rollout once
    update_beside_prefix: bool = False  # the update runs on into the next actor prefix (`sharing.update_beside_prefix`)
    empty_cache_at_phases: bool = True  # `memory.empty_cache: phases`: free blocks go back at each phase change

    @property
    def temperature(self) -> float:
        """The temperature of every log-prob the trainer computes: rollout's (`SamplingParams.logprob_temperature`)."""
        return self.sampling.logprob_temperature

    @property
    def is_main(self) -> bool:
        """The rank that writes metrics and checkpoints (the only one without tensor or data parallelism)."""
        return (self.tp is None or self.tp.is_main) and (self.dp is None or self.dp.rank == 0)

    def settle(self) -> None:
        """The end of a run in this process (call after dropping the tensors that recorded the prefix streams): a
        deferred update joins, and no allocator event outlives the green contexts (`free_allocator_events`, which
        waits for the device)."""
        self.optimizer.finish()
        self.prefix_streams.free_allocator_events()


def resolve_device(setting: str) -> torch.device:
    """`run.device`: auto is the GPU when torch sees one; cuda without one is a one-line error."""
    if setting == "cuda" and not torch.cuda.is_available():
        raise ValueError("run.device is cuda but torch sees no GPU: use auto or cpu")
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def set_determinism(on: bool) -> None:
    """`run.deterministic`, process-wide (torch has no narrower switch); set from the spec at every build so that
    one run's setting never leaks into the next. cuBLAS needs a fixed workspace for deterministic results."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on)


def set_cudnn_attention(on: bool) -> None:
    """`run.cudnn_attention`, process-wide (torch's SDPA backend switch), set from the spec at every build."""
    torch.backends.cuda.enable_cudnn_sdp(on)


def set_expandable_segments(on: bool, device: torch.device) -> None:
    """`memory.expandable_segments` for the caching allocator's segments from now on (process-wide, set from the
    spec at every build). torch reads PYTORCH_CUDA_ALLOC_CONF once; this is its runtime switch."""
    if device.type != "cuda":
        return
    # the accelerator-wide setter where torch has it (2.13 deprecates the CUDA one), else the CUDA one
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter(f"expandable_segments:{on}")


def make_rollout(
    actor: Qwen2_5_VL, kernels: str = "auto", kv_bytes: int | None = None
) -> tuple[RolloutFn, Callable[[], object | None]]:
    """The rollout of the actor's device, and what reports its last rollout's `RolloutStats` (None on the CPU).
    On a GPU the rollout KV lives in a VMM arena of the plan's `kv_bytes` whose region is released when a rollout
    ends (the plan's phase-local rollout KV), and decode runs `kernels` (`run.decode_kernels`; the CPU runs the
    plain loop)."""
    if actor.device.type == "cuda":
        from rollplex.memory.vmm import VmmArena
        from rollplex.rollout.engine import RolloutEngine
        from rollplex.rollout.weights import BY_NAME

        kernels = decode_kernels_for(kernels, actor.device)
        device = actor.device.index if actor.device.index is not None else torch.cuda.current_device()
        kv_bytes = kv_bytes or torch.cuda.get_device_properties(device).total_memory
        engine = RolloutEngine(actor, kv_arena=VmmArena(kv_bytes, device), kernels=BY_NAME[kernels])
        return engine.generate, lambda: engine.stats
    return partial(generate, actor), lambda: None


def build_engines(plan: Plan, device: torch.device | str | None = None) -> Engines:
    """The engines of a compiled plan, on `device` (default: the spec's `run.device`): the models its graph's roles
    need, and every memory and sharing decision as `plan.decisions` has it."""
    loaded, d = plan.loaded, plan.decisions
    spec, config = loaded.spec, loaded.model
    device = torch.device(device) if device is not None else resolve_device(spec.run.device)
    set_determinism(spec.run.deterministic)
    set_cudnn_attention(spec.run.cudnn_attention)
    set_expandable_segments(spec.memory.expandable_segments, device)
    for refusal in run_refusals(spec):
        if refusal.on in ("any", device.type):
            raise SpecError(refusal.key, refusal.problem, refusal.fix)
    tp, dp, device = init_parallel(spec.parallel.train_tp, spec.parallel.rollout_tp, device)
    if dp is not None:
        minibatches = spec.algorithm.minibatches_per_step
        if spec.workload.prompts_per_step % (minibatches * dp.size):
            raise SpecError("workload.prompts_per_step", f"{spec.workload.prompts_per_step} prompts do not split "
                            f"into {minibatches} mini-batches over {dp.size} data-parallel ranks",
                            f"use a multiple of {minibatches * dp.size}")  # fmt: skip
        dp = replace(dp, minibatches=minibatches)
    if not d.weight_sharing and tp is not None:
        raise SpecError("memory.weight_sharing", "false runs with train_tp 1 only", "set it true under TP")
    actor = _initial_model(loaded, device, tp)
    if d.layers_kept > (layers := config.text.num_hidden_layers):
        raise SpecError("decisions.layers_kept", f"{d.layers_kept} is more than the {layers} decoder layers",
                        f"use at most {layers}")  # fmt: skip
    if d.freeze_vision:
        actor.model.visual.requires_grad_(False)
    reference = None
    if Role.REFERENCE in roles(plan.graph) and tp is None:
        reference = copy.deepcopy(actor).requires_grad_(False)
        reference.pack_projections()  # a deepcopy clones parameters one by one
    elif Role.REFERENCE in roles(plan.graph):  # built again rather than copied: one full model on the device at a time
        reference = _initial_model(loaded, device, tp).requires_grad_(False)
    if reference is not None and d.freeze_vision:
        reference.model.visual = actor.model.visual  # the frozen tower, held once
    bound = None
    if tp is not None:
        bound = bind_rollout(actor, tp.exchange, tp.rollout, QKVPath(spec.parallel.qkv_sharing))
    a = spec.algorithm
    rollout_model, publish = actor, (lambda: None) if bound is None else bound.publish
    if bound is not None:
        rollout_model = bound.model
    elif not d.weight_sharing:  # rollout samples from its own copy, refreshed after each update
        rollout_model = copy.deepcopy(actor).requires_grad_(False)
        rollout_model.pack_projections()
        publish = partial(copy_weights, actor, rollout_model)
    # under mps the rollout's weights move into shared storage: before the optimizer sees the actor's
    kernels, sharing = spec.run.decode_kernels, d.sharing
    remote = None
    if sharing.policy is SharingPolicy.MPS:
        remote = make_remote_rollout(rollout_model, sharing.mps_rollout_percent, kernels, d.rollout_kv_bytes)
    shard = Shard(dp.rank, dp.size, dp.group) if d.distributed_optimizer else None
    on_device = d.optimizer_state is Residency.HBM
    optimizer = make_optimizer(
        actor, a, tp, bound, d.optimizer_chunk_bytes, on_device, shard=shard, kept_bytes=d.optimizer_kept_bytes
    )
    sampling = SamplingParams(
        temperature=a.temperature,
        top_p=a.top_p,
        max_tokens=spec.workload.response_tokens,
        stop_token_ids=config.tokens.stop_ids,
    )
    critic, critic_optimizer = None, None
    if Role.CRITIC in roles(plan.graph):
        if tp is not None:
            raise SpecError("parallel.train_tp", "a critic trains with train_tp 1 only", "set train_tp: 1")
        critic = make_value_model(_initial_model(loaded, device, None), seed=spec.run.seed + 1)
        if d.freeze_vision:
            critic.model.visual = actor.model.visual
        critic_optimizer = make_optimizer(
            critic, a, None, None, d.optimizer_chunk_bytes, d.optimizer_state is Residency.HBM, lr=a.critic_lr or a.lr
        )
    reference_pager = None
    if reference is not None and d.reference_weights is Residency.HOST:
        reference_pager = make_reference_pager(reference, own_vision=not d.freeze_vision)
    rollout, rollout_stats = remote or make_rollout(rollout_model, kernels, d.rollout_kv_bytes)
    if spec.run.compiled_layers:  # the scoring models' layers and blocks; decode has kernels of its own
        for model in (actor, reference, critic):
            if model is not None:
                compile_halves([*model.model.visual.blocks, *model.model.language_model.layers])
    if d.update_beside_prefix:  # the next prefix's layers and blocks, each before it runs, wait for its chunks
        gate_modules(actor, optimizer, whole=[*actor.model.visual.blocks, *actor.model.language_model.layers])
    if tp is not None and tp.exchange.size > 1 and spec.parallel.split_rollout:
        rollout = split_rollout(rollout, tp.exchange, keyed=device.type == "cuda")  # the fused sampler keys rows
    return Engines(
        actor=actor,
        rollout=rollout,
        rollout_stats=rollout_stats,
        reference=reference,
        optimizer=optimizer,
        sampling=sampling,
        generator=torch.Generator(device).manual_seed(spec.run.seed),
        tokenizer=make_tokenizer(loaded),
        reward=make_reward(loaded),
        grpo=GrpoConfig(a.clip_ratio, a.kl_coef, a.entropy_coef, a.loss_agg),
        group_size=spec.workload.group_size,
        microbatch_tokens=spec.memory.microbatch_tokens,
        layers_per_chunk=sharing.layers_per_chunk,
        prompts_per_chunk=sharing.prompts_per_chunk,
        prefix_streams=make_prefix_streams(sharing, device),
        tp=tp,
        publish=publish,
        reference_pager=reference_pager,
        prefix_memory=make_prefix_memory(d, actor),
        prefix_rerun=make_prefix_rerun(d, device),
        microbatch_memory=make_microbatch_memory(d, actor, d.layers_kept),
        response_lengths=synthetic_preset(spec.workload.dataset).response if spec.workload.replay_lengths else None,
        freeze_vision=d.freeze_vision,
        critic=critic,
        critic_microbatch_memory=nullcontext if critic is None else make_microbatch_memory(d, critic),
        critic_optimizer=critic_optimizer,
        ppo=PpoConfig(a.gamma, a.lam, a.value_clip) if critic is not None else None,
        dp=dp,
        rollout_draws_per_step=device.type != "cuda",
        update_beside_prefix=d.update_beside_prefix,
        empty_cache_at_phases=spec.memory.empty_cache == "phases",
    )


@torch.no_grad()
def copy_weights(source: Qwen2_5_VL, target: Qwen2_5_VL) -> None:
    """Every parameter of `source` into `target`'s (same shapes and names), in place: the addresses a captured
    rollout reads stay valid."""
    for p, q in zip(source.parameters(), target.parameters(), strict=True):
        q.copy_(p)


def _initial_model(loaded: LoadedSpec, device: torch.device, tp: TPSetup | None) -> Qwen2_5_VL:
    """The spec's initial weights (random from `run.seed`, or the checkpoint); this rank's shards under
    tensor parallelism (the full model exists only until it is sharded). The same call gives the same weights."""
    spec = loaded.spec
    torch.manual_seed(spec.run.seed)
    model = Qwen2_5_VL(loaded.model, dtype=getattr(torch, spec.run.dtype), device=device)
    if spec.run.init == "checkpoint":
        load_checkpoint(model, model_dir(loaded))
    return model if tp is None else parallelize(model, tp.train, sequence_parallel=spec.parallel.sequence_parallel)


def make_optimizer(
    actor: Qwen2_5_VL,
    a,
    tp: TPSetup | None,
    bound,
    chunk_bytes: int,
    state_on_device: bool,
    lr: float | None = None,
    shard: Shard | None = None,
    kept_bytes: int = 0,
) -> ChunkedAdamW:
    """ChunkedAdamW over the actor's trainable parameters, gradients accumulated in FP32 (the plan's FP32
    gradients, the paper's Table 1), its FP32 state in HBM or in the pinned pool as the plan has it (`kept_bytes`
    of it in HBM all the same), in the plan's chunks; under tensor parallelism its grad norm counts the shards
    over the group, and it streams each bound parameter's exchange as soon as it has written it. `shard`: ZeRO-1
    over the data-parallel ranks."""
    params = [p for p in actor.parameters() if p.requires_grad]
    sharded = sharded_parameters(actor)
    return ChunkedAdamW(
        params,
        lr=a.lr if lr is None else lr,
        betas=a.betas,
        eps=a.eps,
        weight_decay=a.weight_decay,
        max_grad_norm=a.max_grad_norm,
        chunk_bytes=chunk_bytes,
        tp=None if tp is None else tp.train,
        sharded=[id(p) in sharded for p in params],
        write=None if bound is None else bound.writer(params),
        fp32_grads=True,
        state_on_device=state_on_device,
        resident_bytes=kept_bytes,
        shard=shard,
    )


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


def make_tokenizer(loaded: LoadedSpec) -> Tokenizer:
    """The checkpoint's own tokenizer when it has one; otherwise the character tokenizer on the model's ids."""
    directory = model_dir(loaded)
    if (directory / "tokenizer.json").is_file():
        return HFTokenizer.from_dir(directory)
    t = loaded.model.tokens
    return CharTokenizer.for_model(t.eos, t.vision_start, t.vision_end, t.image, t.video)


def make_reward(loaded: LoadedSpec) -> RewardTerms:
    """The spec's rewards, each with its weight; a `module:function` name is imported."""
    return reward_terms([(r.name, r.weight) for r in loaded.spec.algorithm.rewards])
