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
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from rollplex.data.presets import LengthDistribution, synthetic_preset
from rollplex.data.rewards import RewardTerms
from rollplex.data.tokenizer import Tokenizer
from rollplex.errors import SpecError
from rollplex.executors.dataparallel import DataParallel
from rollplex.executors.device_settings import (
    resolve_device,
    scoring_kernels,
    set_cudnn_attention,
    set_determinism,
    set_expandable_segments,
)
from rollplex.executors.distributed import TPSetup, init_parallel
from rollplex.executors.grpo import GrpoConfig
from rollplex.executors.policies import PrefixStreams, decode_kernels_for, make_prefix_streams, make_remote_rollout
from rollplex.executors.ppo import PpoConfig
from rollplex.executors.residency import (
    make_microbatch_memory,
    make_prefix_memory,
    make_prefix_rerun,
    make_reference_pager,
)
from rollplex.executors.task import make_reward, make_tokenizer, sampling_params
from rollplex.graph.decisions import Decisions, SharingPolicy
from rollplex.graph.ir import Role, roles
from rollplex.graph.load import LoadedSpec
from rollplex.graph.memobject import Residency
from rollplex.graph.plan import Plan
from rollplex.graph.refusals import run_refusals
from rollplex.graph.spec import Spec
from rollplex.graph.spec_algorithm import AlgorithmSpec
from rollplex.graph.spec_files import initial_weights, model_dir
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


def make_rollout(
    actor: Qwen2_5_VL, kernels: str = "auto", kv_bytes: int | None = None, prompt_tokens: int = 0
) -> tuple[RolloutFn, Callable[[], object | None]]:
    """The rollout of the actor's device, and what reports its last rollout's `RolloutStats` (None on the CPU).
    On a GPU the rollout KV lives in a VMM arena of the plan's `kv_bytes` whose region is released when a rollout
    ends (the plan's phase-local rollout KV), its decode shapes hold the plan's `prompt_tokens` at least, and
    decode runs `kernels` (`run.decode_kernels`; the CPU runs the plain loop)."""
    if actor.device.type == "cuda":
        from rollplex.memory.vmm import VmmArena
        from rollplex.rollout.engine import RolloutEngine
        from rollplex.rollout.weights import BY_NAME

        kernels = decode_kernels_for(kernels, actor.device)
        device = actor.device.index if actor.device.index is not None else torch.cuda.current_device()
        kv_bytes = kv_bytes or torch.cuda.get_device_properties(device).total_memory
        arena = VmmArena(kv_bytes, device)
        engine = RolloutEngine(actor, kv_arena=arena, kernels=BY_NAME[kernels], prompt_tokens=prompt_tokens)
        return engine.generate, lambda: engine.stats
    return partial(generate, actor), lambda: None


def build_engines(plan: Plan, device: torch.device | str | None = None) -> Engines:
    """The engines of a compiled plan, on `device` (default: the spec's `run.device`): the models its graph's roles
    need, and every memory and sharing decision as `plan.decisions` has it. The steps run in this order because
    seeds and storage depend on it."""
    loaded, d = plan.loaded, plan.decisions
    spec, a, sharing = loaded.spec, loaded.spec.algorithm, plan.decisions.sharing
    tp, dp, device = _checked_parallel(plan, _device(spec, device))
    actor = _actor(loaded, d, device, tp)
    reference = _reference(plan, actor, device, tp)
    bound = None if tp is None else bind_rollout(actor, tp.exchange, tp.rollout, QKVPath(spec.parallel.qkv_sharing))
    rollout_model, publish = _rollout_model(actor, bound, d.weight_sharing)
    # under mps the rollout's weights move into shared storage: before the optimizer sees the actor's
    remote = _remote_rollout(rollout_model, spec.run.decode_kernels, d)
    optimizer = _actor_optimizer(actor, a, d, tp, dp, bound)
    sampling = sampling_params(loaded)
    critic, critic_optimizer = _critic(plan, actor, device, tp)
    reference_pager = _reference_pager(reference, d)
    rollout, rollout_stats = remote or make_rollout(
        rollout_model, spec.run.decode_kernels, d.rollout_kv_bytes, d.rollout_prompt_tokens
    )
    if spec.run.compiled_layers:  # the scoring models' layers and blocks; decode has kernels of its own
        _compile_layers(actor, reference, critic)
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


def _device(spec: Spec, device: torch.device | str | None) -> torch.device:
    """The build's device (`device`, else `run.device`), with the spec's process-wide settings applied for it."""
    device = torch.device(device) if device is not None else resolve_device(spec.run.device)
    set_determinism(spec.run.deterministic)
    set_cudnn_attention(spec.run.cudnn_attention)
    set_expandable_segments(spec.memory.expandable_segments, device)
    return device


def _checked_parallel(plan: Plan, device: torch.device) -> tuple[TPSetup | None, DataParallel | None, torch.device]:
    """The tensor- and data-parallel groups and this rank's device, once the run refusals for `device` pass and
    the parallel settings fit the spec: before any model is made."""
    spec = plan.loaded.spec
    for refusal in run_refusals(spec):
        if refusal.on in ("any", device.type):
            raise SpecError(refusal.key, refusal.problem, refusal.fix)
    tp, dp, device = init_parallel(spec.parallel.train_tp, spec.parallel.rollout_tp, device)
    if dp is not None:
        dp = _with_minibatches(dp, spec)
    if not plan.decisions.weight_sharing and tp is not None:
        raise SpecError("memory.weight_sharing", "false runs with train_tp 1 only", "set it true under TP")
    return tp, dp, device


def _with_minibatches(dp: DataParallel, spec: Spec) -> DataParallel:
    """`dp` with the spec's mini-batches per step, which split each rank's share of the prompts evenly."""
    minibatches = spec.algorithm.minibatches_per_step
    if spec.workload.prompts_per_step % (minibatches * dp.size):
        raise SpecError("workload.prompts_per_step", f"{spec.workload.prompts_per_step} prompts do not split "
                        f"into {minibatches} mini-batches over {dp.size} data-parallel ranks",
                        f"use a multiple of {minibatches * dp.size}")  # fmt: skip
    return replace(dp, minibatches=minibatches)


def _actor(loaded: LoadedSpec, d: Decisions, device: torch.device, tp: TPSetup | None) -> Qwen2_5_VL:
    """The trained model from the spec's initial weights, its vision tower frozen when the plan freezes it; a
    SpecError when the plan keeps more decoder layers whole than the model has."""
    actor = _initial_model(loaded, device, tp)
    actor.suffix_kernels = scoring_kernels(loaded, device, tp)
    if d.layers_kept > (layers := loaded.model.text.num_hidden_layers):
        raise SpecError("decisions.layers_kept", f"{d.layers_kept} is more than the {layers} decoder layers",
                        f"use at most {layers}")  # fmt: skip
    if d.freeze_vision:
        actor.model.visual.requires_grad_(False)
    return actor


def _reference(plan: Plan, actor: Qwen2_5_VL, device: torch.device, tp: TPSetup | None) -> Qwen2_5_VL | None:
    """The frozen reference when the graph has one: a copy of the actor, or under tensor parallelism the initial
    weights built again (one full model on the device at a time); under `freeze_vision` it holds the actor's frozen
    tower instead of its own."""
    if Role.REFERENCE not in roles(plan.graph):
        return None
    if tp is None:
        reference = copy.deepcopy(actor).requires_grad_(False)
        reference.pack_projections()  # a deepcopy clones parameters one by one
    else:  # built again rather than copied: one full model on the device at a time
        reference = _initial_model(plan.loaded, device, tp).requires_grad_(False)
        reference.suffix_kernels = copy.deepcopy(actor.suffix_kernels)
    if plan.decisions.freeze_vision:
        reference.model.visual = actor.model.visual  # the frozen tower, held once
    return reference


def _rollout_model(actor: Qwen2_5_VL, bound, weight_sharing: bool) -> tuple[Qwen2_5_VL, Callable[[], None]]:
    """The model rollout samples from, and what makes an update visible to it: under tensor parallelism the
    replica `bound` over the actor's shards; without weight sharing a copy of its own, refreshed after each
    update; otherwise the actor itself, with nothing to publish."""
    if bound is not None:
        return bound.model, bound.publish
    if not weight_sharing:
        rollout_model = copy.deepcopy(actor).requires_grad_(False)
        rollout_model.pack_projections()
        return rollout_model, partial(copy_weights, actor, rollout_model)
    return actor, lambda: None


def _remote_rollout(rollout_model: Qwen2_5_VL, kernels: str, d: Decisions) -> tuple[RolloutFn, Callable] | None:
    """Under the mps policy, the rollout and its stats in an MPS child process sharing `rollout_model`'s weights;
    otherwise None (rollout runs in this process)."""
    if d.sharing.policy is not SharingPolicy.MPS:
        return None
    return make_remote_rollout(
        rollout_model, d.sharing.mps_rollout_percent, kernels, d.rollout_kv_bytes, d.rollout_prompt_tokens
    )


def _actor_optimizer(
    actor: Qwen2_5_VL, a: AlgorithmSpec, d: Decisions, tp: TPSetup | None, dp: DataParallel | None, bound
) -> ChunkedAdamW:
    """The actor's optimizer as the plan places its state: ZeRO-1 over the data-parallel ranks under
    `distributed_optimizer`, and streaming each update into the `bound` rollout replica under tensor parallelism."""
    shard = Shard(dp.rank, dp.size, dp.group) if d.distributed_optimizer else None
    on_device = d.optimizer_state is Residency.HBM
    return make_optimizer(
        actor, a, tp, bound, d.optimizer_chunk_bytes, on_device, shard=shard, kept_bytes=d.optimizer_kept_bytes
    )


def _critic(
    plan: Plan, actor: Qwen2_5_VL, device: torch.device, tp: TPSetup | None
) -> tuple[Qwen2_5_VL | None, ChunkedAdamW | None]:
    """PPO's value model and its optimizer when the graph has a critic (None, None otherwise): the initial weights
    with a scalar head drawn from `run.seed + 1`, holding the actor's tower when the plan freezes it."""
    if Role.CRITIC not in roles(plan.graph):
        return None, None
    if tp is not None:
        raise SpecError("parallel.train_tp", "a critic trains with train_tp 1 only", "set train_tp: 1")
    loaded, d = plan.loaded, plan.decisions
    a = loaded.spec.algorithm
    critic = make_value_model(_initial_model(loaded, device, None), seed=loaded.spec.run.seed + 1)
    critic.suffix_kernels = copy.deepcopy(actor.suffix_kernels)
    if d.freeze_vision:
        critic.model.visual = actor.model.visual
    on_device = d.optimizer_state is Residency.HBM
    return critic, make_optimizer(critic, a, None, None, d.optimizer_chunk_bytes, on_device, lr=a.critic_lr or a.lr)


def _reference_pager(reference: Qwen2_5_VL | None, d: Decisions):
    """The reference's weight pager when the plan keeps its weights on the host (`make_reference_pager`), else None."""
    if reference is None or d.reference_weights is not Residency.HOST:
        return None
    return make_reference_pager(reference, own_vision=not d.freeze_vision)


def _compile_layers(*models: Qwen2_5_VL | None) -> None:
    """`run.compiled_layers`: every vision block and decoder layer of each model given (None: no such model)."""
    for model in models:
        if model is not None:
            compile_halves([*model.model.visual.blocks, *model.model.language_model.layers])


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
    if initial_weights(loaded) == "checkpoint":
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
