"""What the runtime does, decided by the compiler: the engines are built from these and from nothing else.

`decide` lowers the residency plan and the spec's settings into typed decisions: where the reference's
weights and the actor prefix's saved tensors wait between their steps, how the prefix gives its activations
back, what the training microbatch reruns in its backward, the pinned pool's size, the streamed optimizer's chunk, the
rollout KV arena's capacity, whether rollout reads the actor's own weights, and how prefix work shares the GPU
with decode. `as_dict` / `from_dict` carry them through `plan.json`. Pure: no torch, no I/O.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum

from rollplex.graph.memobject import GIB, Component, Context, Residency
from rollplex.graph.objects import rollout_kv_bytes
from rollplex.graph.residency import ResidencyPlan
from rollplex.graph.spec import Spec
from rollplex.layout import shapes as S

MIN_HOST_POOL = 64 << 20
HOST_POOL_MARGIN = 4  # a pool sized from the plan holds its figure plus a quarter (allocation rounding)
NO_UPDATE_CHUNK = 64 << 20  # the optimizer's chunk when the plan has no update to size one for


class PrefixActivations(Enum):
    OFFLOAD = "offload"  # every saved tensor of the attached prefix goes where `prefix_saved` says
    RECOMPUTE = "recompute"  # each vision block and decoder layer keeps its input; backward reruns it


class Recompute(Enum):
    """What the training microbatch's forward keeps for its backward (`memory.recompute`)."""

    NONE = "none"  # every tensor autograd saves
    SELECTIVE = "selective"  # each decoder layer's input and what its attention saves; backward reruns the rest
    FULL = "full"  # each decoder layer's and vision block's input; backward reruns the whole unit

    @property
    def reruns(self) -> bool:
        return self is not Recompute.NONE


class SharingPolicy(Enum):
    INLINE = "inline"
    STREAMS = "streams"
    GREEN = "green"
    MPS = "mps"


@dataclass(frozen=True, slots=True)
class Sharing:
    """How `rollplex` runs prefix work beside decode on a GPU (`sharing.*` of the spec)."""

    policy: SharingPolicy
    prefix_sms: int  # the green partition's SMs (unused when `adaptive`)
    adaptive: bool = False  # green partitions sized by the live decode batch
    layers_per_chunk: int = 1
    prompts_per_chunk: int | None = None  # None: all the step's prompts in one group
    tail_rows: int | None = None  # prefix work starts once decode's batch is at most this many rows; None: at once
    mps_trainer_percent: int | None = None  # None: no cap
    mps_rollout_percent: int | None = None

    @staticmethod
    def of(policy: str, prefix_sms: int | str = 0) -> Sharing:
        """A policy by the spec's names (`green`, 66 or "adaptive"), other settings at their defaults."""
        adaptive = prefix_sms == "adaptive"
        return Sharing(SharingPolicy(policy), 0 if adaptive else int(prefix_sms), adaptive)


@dataclass(frozen=True, slots=True)
class Decisions:
    reference_weights: Residency  # HBM, or HOST: paged in for the steps that use them
    prefix_saved: Residency  # HBM: kept where autograd put them; HOST: offloaded to the pinned pool
    optimizer_state: Residency  # HBM: the FP32 state updated in place; HOST: streamed from the pinned pool
    prefix_activations: PrefixActivations
    recompute: Recompute  # what the training microbatch keeps for its backward, and what it reruns
    host_pool_bytes: int  # this process's pinned pool for the prefix's saved tensors (its GPU's share of the
    # node's `memory.host_pool_gib`, else what the plan puts there; 0 when they stay in HBM)
    optimizer_chunk_bytes: int  # FP32 state (master + moments) per streamed chunk
    rollout_kv_bytes: int  # the rollout KV arena's capacity: a rollout that needs more is refused
    weight_sharing: bool  # rollout reads the actor's weights; False: a copy, refreshed after each update
    sharing: Sharing
    freeze_vision: bool = False  # the vision tower is not trained; both prefixes share each prompt's vision output
    distributed_optimizer: bool = False  # ZeRO-1: the FP32 state split over the training data-parallel ranks
    optimizer_kept_bytes: int = 0  # with the state on the host: the share of it kept in HBM (its first chunks)
    update_beside_prefix: bool = False  # the actor's update runs on into the next step's actor prefix
    layers_kept: int = 0  # under recompute, the actor's last decoder layers that keep every tensor (no rerun)
    rollout_prompt_tokens: int = 0  # the prompt length the rollout's decode shapes hold at least (the workload's
    # prompt budget, rounded as the engine rounds it): shorter prompts share one shape; 0: each rollout's own

    def as_dict(self) -> dict:
        return _plain(asdict(self))

    @staticmethod
    def from_dict(d: dict) -> Decisions:
        """The decisions of a plan file (`planfile.py`); ValueError for a byte count that is not a whole number of
        bytes (at least one for the optimizer's chunk)."""
        for key in ("host_pool_bytes", "optimizer_chunk_bytes", "rollout_kv_bytes", "optimizer_kept_bytes"):
            value = d.get(key, 0) if key == "optimizer_kept_bytes" else d[key]  # the one with a default may be left out
            least = 1 if key == "optimizer_chunk_bytes" else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"decisions.{key} is {value!r}: a whole number of bytes, at least {least}")
        for key, what in (("layers_kept", "a number of decoder layers"), ("rollout_prompt_tokens", "a token count")):
            value = d.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"decisions.{key} is {value!r}: {what}, at least 0")
        s = d["sharing"]
        sharing = Sharing(**{**s, "policy": SharingPolicy(s["policy"])})
        return Decisions(
            **{
                **d,
                "reference_weights": Residency(d["reference_weights"]),
                "prefix_saved": Residency(d["prefix_saved"]),
                "optimizer_state": Residency(d["optimizer_state"]),
                "prefix_activations": PrefixActivations(d["prefix_activations"]),
                "recompute": Recompute(d["recompute"]),
                "sharing": sharing,
            }
        )


def decide(c: Context, r: ResidencyPlan) -> Decisions:
    """Requires: the residency plan of `c`'s graph. Ensures: every decision the runtime takes."""
    spec, objects = c.spec, r.objects
    reference = [o for o in objects if o.role == "reference" and o.component is Component.WEIGHTS]
    paged = bool(reference) and all(o.host_bytes > 0 for o in reference)
    planned = sum(o.host_bytes for o in objects if o.role == "actor" and o.component is Component.PREFIX_SAVED)
    state = [o for o in objects if o.component in (Component.MASTER, Component.MOMENTS)]  # every trained role's
    pool = spec.memory.host_pool_gib
    offloaded = planned > 0
    per_node = int(pool * GIB) // spec.cluster.gpus_per_node if pool is not None else None  # one process a GPU
    pool_bytes = per_node if per_node is not None else planned + planned // HOST_POOL_MARGIN
    return Decisions(
        reference_weights=Residency.HOST if paged else Residency.HBM,
        prefix_saved=Residency.HOST if offloaded else Residency.HBM,
        optimizer_state=Residency.HOST if any(o.host_bytes for o in state) else Residency.HBM,
        prefix_activations=PrefixActivations(spec.memory.prefix_activations),
        recompute=Recompute(spec.memory.recompute),
        host_pool_bytes=max(MIN_HOST_POOL, pool_bytes) if offloaded else 0,
        optimizer_chunk_bytes=r.optimizer.chunk_bytes if r.optimizer is not None else NO_UPDATE_CHUNK,
        rollout_kv_bytes=rollout_kv_bytes(c),
        rollout_prompt_tokens=S.prompt_capacity(c.gpu.prompt_tokens),
        weight_sharing=spec.memory.weight_sharing,
        sharing=_sharing(spec),
        freeze_vision=spec.model.freeze_vision,
        distributed_optimizer=spec.parallel.distributed_optimizer and c.gpu.train_dp > 1,
        optimizer_kept_bytes=r.state_share_bytes,
        update_beside_prefix=bool(r.update_beside),
        layers_kept=r.layers_kept,
    )


def _sharing(spec: Spec) -> Sharing:
    s = spec.sharing
    adaptive = s.prefix_sms == "adaptive"
    return Sharing(
        policy=SharingPolicy(s.policy),
        prefix_sms=0 if adaptive else s.prefix_sms,
        adaptive=adaptive,
        layers_per_chunk=s.layers_per_chunk,
        prompts_per_chunk=s.prompts_per_chunk,
        tail_rows=s.tail_rows,
        mps_trainer_percent=s.mps_trainer_percent,
        mps_rollout_percent=s.mps_rollout_percent,
    )


def _plain(value):
    """Enums as their values, recursively: what JSON holds."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
