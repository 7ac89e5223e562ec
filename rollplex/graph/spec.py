"""The YAML spec's schema, in pydantic (the YAML boundary: nothing past it declares a pydantic model); with
`spec_base.py` (what any setting must be), `spec_workload.py` (the `workload` and `evaluation` sections),
`spec_algorithm.py` (the `algorithm` section) and `spec_runtime.py` (the `run` and `sharing` sections).

Sections: model, cluster, parallel, workload, algorithm, memory, schedule, sharing, graph (optional), run,
evaluation (optional).
Checks that need the model's shapes (TP divides the heads) live in `graph.load`, after the model is read.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt, field_validator, model_validator

from rollplex.graph.spec_algorithm import AlgorithmSpec
from rollplex.graph.spec_base import Strict
from rollplex.graph.spec_runtime import RunSpec, SharingSpec
from rollplex.graph.spec_workload import EvaluationSpec, WorkloadSpec

NodeKindName = Literal["decode", "forward", "backward", "update", "reward"]
RoleName = Literal["rollout", "reference", "actor", "critic"]
TensorClassName = Literal["permanent", "regenerable", "boundary", "phase-local"]


class ModelSpec(Strict):
    name: str = Field(description="A shipped config name, an HF config.json, or a checkpoint directory.")
    freeze_vision: bool = Field(
        False,
        description="The vision tower (patch embedding, blocks and merger) is not trained, as Video-R1's and EasyR1's "
        "configs do: no vision gradients or optimizer state, the reference reads the actor's tower, and each prompt's "
        "vision output is computed once per step for both prefixes. `model: NAME` is short for `model: {name: NAME}`.",
    )


GPU_MEMORY_GIB = {"H200": 140.4, "H100": 79.6, "H800": 79.6, "A100": 80.0}  # nvidia-smi's total of each (80 GB parts)


class ClusterSpec(Strict):
    nodes: PositiveInt = Field(1, description="Number of nodes.")
    gpus_per_node: PositiveInt = Field(1, description="GPUs per node.")
    hbm_gib: PositiveFloat = Field(le=4096, description="Usable HBM per GPU, GiB (an H800 80 GB: 79.6; an H200: 139).")
    host_gib: PositiveFloat = Field(le=1 << 20, description="Host memory per node that may be pinned, GiB.")
    gpu: Literal["H200", "H100", "H800", "A100"] = Field(
        "H200",
        description="The GPU model, whose peaks (FLOP/s, HBM and host-link bandwidth) bound the time plan and whose "
        "memory bounds hbm_gib.",
    )

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @model_validator(mode="after")
    def _fits_the_gpu(self) -> ClusterSpec:
        memory = GPU_MEMORY_GIB[self.gpu]
        if self.hbm_gib > memory:
            named = "gpu" in self.model_fields_set
            raise ValueError(
                f"hbm_gib {self.hbm_gib:g} is more than an {self.gpu}{'' if named else ' (the default gpu)'} has "
                f"({memory} GiB); set cluster.gpu to the GPU the run is on, or lower hbm_gib"
            )
        return self


class ParallelSpec(Strict):
    train_tp: PositiveInt = Field(1, description="Tensor-parallel degree of the trainer (actor, reference, critic).")
    rollout_tp: PositiveInt = Field(1, description="Tensor-parallel degree of rollout; must divide train_tp.")
    qkv_sharing: Literal["in_place", "copy"] = Field(
        "in_place",
        description="How rollout reads the fused QKV when a rollout rank holds several training shards' query "
        "groups (Case 3): in_place (zero-copy, Megatron order read directly) or copy (the paper's grouped copy).",
    )
    split_rollout: bool = Field(
        True,
        description="With train_tp / rollout_tp > 1 rollout replicas, each samples its share of the prompts "
        "(false: every replica samples all of them, as one replica would). On a GPU at top_p 1 a replica keys its "
        "random numbers by its rows in the step, so the tokens are one replica's; elsewhere each replica reseeds.",
    )
    distributed_optimizer: bool = Field(
        False,
        description="ZeRO-1: shard the FP32 master weights and Adam moments over the training data-parallel ranks. "
        "Each rank keeps, updates and checkpoints its share of the elements and sends their new values to the "
        "others; the plan counts the share. No effect with one data-parallel rank.",
    )
    sequence_parallel: bool = Field(
        False,
        description="Megatron sequence parallelism in training: from the decoder's first layer through its final "
        "norm each TP rank holds 1/train_tp of the sequence's rows (residual stream, layer norms, saved layer "
        "inputs); the TP layers all-gather the rows before their column-parallel GEMMs and reduce-scatter after "
        "their row-parallel ones. The planner divides those activations by train_tp. Rollout keeps whole rows.",
    )

    @model_validator(mode="after")
    def _ratio(self) -> ParallelSpec:
        if self.train_tp % self.rollout_tp:
            raise ValueError(
                f"rollout_tp {self.rollout_tp} does not divide train_tp {self.train_tp}; "
                f"set rollout_tp to a divisor of {self.train_tp}"
            )
        return self


class MemorySpec(Strict):
    rollout_kv_gib: PositiveFloat | None = Field(
        None, description="Rollout KV-cache budget per GPU, GiB; null sizes it to the workload."
    )
    recompute: Literal["auto", "none", "selective", "full"] = Field(
        "auto",
        description="Activation recompute for the training microbatch: none (every tensor autograd saves waits for "
        "the backward), selective (each decoder layer keeps its input and what its attention saves: its queries, "
        "keys, values, output and log-sum-exp; backward reruns the layer's projections, norms and MLP, not its "
        "attention; a vision block, which only unsplit scoring runs, reruns whole), full (each decoder layer and "
        "vision block keeps its input; backward reruns it), or auto: of those the plan fits with, the one that "
        "keeps the most unless one that reruns more has a lower step bound (bounds within 1 % are a tie, won by the "
        "plan that moves fewer bytes over the host link).",
    )
    layers_kept: Literal["auto"] | NonNegativeInt = Field(
        "auto",
        description="Under selective or full recompute, how many of the actor's last decoder layers keep every "
        "tensor autograd saves and do not rerun in backward (the others recompute as `recompute` says). A number "
        "is held as the activations are, before the plan places anything else; auto: as many as the steps that "
        "hold the training microbatch's activations have room for once everything else is placed (HBM the plan "
        "would leave idle: the FP32 state and the prefix's saved tensors come first, and the other `auto` "
        "settings are weighed with the layers as they are).",
    )
    microbatch_tokens: PositiveInt | None = Field(
        None,
        description="Response tokens a trained role scores and backpropagates at once from its prompts' boundary "
        "(its responses packed across prompts; a longer response alone); null: a prompt group's N responses at the "
        "step's longest length. Fewer hold fewer activations (what lets `recompute: none` fit) at more scoring "
        "calls; more (up to the rank's every response) make fewer calls. Scoring without gradients (the "
        "reference's) takes a group's tokens or a lower cap. Unsplit scoring (schedule unsplit) runs a group's "
        "whole sequences at once regardless.",
    )
    prefix_activations: Literal["auto", "offload", "recompute"] = Field(
        "auto",
        description="What the actor prefix saves for its backward: offload, every tensor autograd saves (where "
        "they wait: `prefix_saved`), or recompute, only each layer's input (backward reruns the layer); auto: "
        "offload where the plan fits with it at a step bound no higher than recompute's, else recompute.",
    )
    optimizer_chunk_mib: PositiveInt | None = Field(
        None,
        description="FP32 optimizer-state bytes per streamed chunk, MiB; null picks the largest that fits, at most "
        "1024, or 128 where the update streams beside the next actor prefix (a first use there, such as a new "
        "attention plan, waits for every chunk queued on the link).",
    )
    host_pool_gib: PositiveFloat | None = Field(
        None, description="Pinned host pool per node, GiB; null sizes it from the plan."
    )
    runtime_reserve_gib: float = Field(3.0, ge=0, description="Per-GPU reserve for CUDA context and workspaces.")
    weight_sharing: bool = Field(True, description="Share actor weights between training and rollout.")
    expandable_segments: bool = Field(
        True,
        description="On a GPU, torch's caching allocator maps its memory in expandable segments (the "
        "`expandable_segments` of PYTORCH_CUDA_ALLOC_CONF), so that blocks freed in one phase are reused by the next "
        "phase's other sizes (without it the allocator reserves well above the phase's peak of live tensors).",
    )
    empty_cache: Literal["phases", "mappings"] = Field(
        "phases",
        description="When torch's caching allocator hands its free blocks back to the driver: phases (at each phase "
        "change and after a step of the graph that freed its tensors, so the driver's usage follows the plan's phase "
        "peaks) or mappings (only before memory outside the allocator is mapped: the rollout's KV, the reference's "
        "pages; the blocks a phase frees stay cached for the next, which then maps fewer pages, and the driver's "
        "usage between those points is the allocator's largest reserve so far; not under sharing.policy mps, whose "
        "rollout maps its KV in a process of its own).",
    )
    optimizer_state: Literal["auto", "hbm", "host"] = Field(
        "auto",
        description="Where the FP32 master weights and Adam moments live: hbm (updated in place, no host traffic), "
        "host (the pinned pool, streamed through HBM in chunks at each update), or auto: hbm when every step still "
        "fits, else host but for the share that every step has room for, which stays in HBM (the first chunks: "
        "the parameters a forward reads first).",
    )
    prefix_saved: Literal["auto", "hbm", "host"] = Field(
        "auto",
        description="Where the actor prefix's saved tensors wait for its backward: hbm, host (the pinned pool: "
        "copied out under the prefix's compute and back under its backward's each step; the HBM they leave goes to "
        "the FP32 state's share kept in HBM), or auto: hbm when every step still fits, else host; and host where the "
        "FP32 state streams and the host plan fits with a lower step bound (the state's traffic is exposed in the "
        "update, theirs is not).",
    )
    page_reference: bool = Field(
        False,
        description="Let the plan keep the reference's weights in the pinned host pool outside the steps that use "
        "them (it does when the pool has room, else they stay in HBM); on a GPU the runtime pages them as the plan "
        "has them. Off (default): in HBM throughout, no paging copies.",
    )


class NodeSpec(Strict):
    id: str = Field(description="Unique node id.")
    kind: NodeKindName = Field(description="decode, forward, backward, update or reward.")
    role: RoleName | None = Field(None, description="Whose model runs it; reward nodes have none.")
    inputs: tuple[str, ...] = Field((), description="Tensors read.")
    outputs: tuple[str, ...] = Field((), description="Tensors written.")

    @model_validator(mode="after")
    def _role(self) -> NodeSpec:
        if self.kind == "reward" and self.role is not None:
            raise ValueError(f"node '{self.id}': a reward node has no role; remove `role`")
        if self.kind != "reward" and self.role is None:
            raise ValueError(f"node '{self.id}': a {self.kind} node needs a role (rollout/reference/actor/critic)")
        if self.kind == "decode" and self.role != "rollout":
            raise ValueError(f"node '{self.id}': a decode node runs on the rollout role; set role: rollout")
        return self


class TensorSpec(Strict):
    name: str = Field(description="Tensor name, as used in node inputs and outputs.")
    cls: TensorClassName = Field(alias="class", description="permanent, regenerable, boundary or phase-local.")


class GraphSpec(Strict):
    nodes: tuple[NodeSpec, ...] = Field(description="The iteration's nodes, in any order.")
    tensors: tuple[TensorSpec, ...] = Field((), description="Tensor classes; undeclared tensors are phase-local.")


class Spec(Strict):
    model: ModelSpec = Field(description="The model: a name (shipped config, HF config.json or checkpoint directory).")
    cluster: ClusterSpec
    parallel: ParallelSpec = ParallelSpec()
    workload: WorkloadSpec
    algorithm: AlgorithmSpec = AlgorithmSpec()
    memory: MemorySpec = MemorySpec()
    schedule: Literal["serial", "rollplex"] = Field("rollplex", description="How the compiled graph runs.")
    sharing: SharingSpec = SharingSpec()
    graph: GraphSpec | None = Field(None, description="A custom iteration graph; default: standard GRPO.")
    run: RunSpec = RunSpec()
    evaluation: EvaluationSpec | None = Field(
        None, description="Held-out evaluation between steps (`rollplex run`); null: none."
    )

    @field_validator("model", mode="before")
    @classmethod
    def _model_name(cls, value: object) -> object:
        return {"name": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _ppo(self) -> Spec:
        a = self.algorithm
        critic = self.graph is not None and any(n.role == "critic" for n in self.graph.nodes)
        if a.name == "grpo" and critic:
            raise ValueError("the graph has a critic: set algorithm.name: ppo")
        if a.name == "ppo" and self.graph is not None and not critic:
            raise ValueError("algorithm.name ppo needs a critic in the graph; or leave out `graph`")
        if a.name == "ppo" and a.minibatches_per_step > 1:
            raise ValueError("algorithm.minibatches_per_step > 1 runs with grpo only; set it to 1 under ppo")
        if a.name == "ppo" and self.parallel.train_tp > 1:
            raise ValueError("a critic trains with train_tp 1 only; set parallel.train_tp: 1 under ppo")
        return self

    @model_validator(mode="after")
    def _actor_reads(self) -> Spec:
        """A custom graph's actor backward reads what the algorithm's loss uses, and nothing it would drop: the
        reference's scores exactly when kl_coef > 0, a critic's values under ppo."""
        if self.graph is None:
            return self
        a = self.algorithm
        made_by = {t: n.role for n in self.graph.nodes if n.kind == "forward" for t in n.outputs}
        for n in (n for n in self.graph.nodes if n.kind == "backward" and n.role == "actor"):
            reads = {made_by.get(t) for t in n.inputs}
            if a.kl_coef > 0 and "reference" not in reads:
                raise ValueError(
                    f"algorithm.kl_coef {a.kl_coef} needs node '{n.id}' to read a reference forward node's output "
                    "(its KL term); add one to its inputs, or set algorithm.kl_coef: 0"
                )
            if a.kl_coef == 0 and "reference" in reads:
                raise ValueError(
                    f"node '{n.id}' reads the reference's scores, which algorithm.kl_coef 0 leaves unused; set "
                    "kl_coef above 0, or drop the reference from the graph"
                )
            if a.name == "ppo" and "critic" not in reads:
                raise ValueError(
                    f"algorithm.name ppo needs node '{n.id}' to read the critic's values (its advantages); add "
                    "them to its inputs"
                )
        return self

    @model_validator(mode="after")
    def _groups(self) -> Spec:
        if self.algorithm.name == "grpo" and self.workload.group_size < 2:
            why = "each advantage (a reward less its group's mean) is 0, so only the KL and entropy would train"
            raise ValueError(f"workload.group_size 1 under GRPO: {why}; use 2 or more, or algorithm.name ppo")
        return self

    @model_validator(mode="after")
    def _evaluation(self) -> Spec:
        ev, w = self.evaluation, self.workload
        if ev is None:
            return self
        if ev.prompts is not None and ev.prompts % w.prompts_per_step:
            whole = max(ev.prompts // w.prompts_per_step, 1) * w.prompts_per_step
            raise ValueError(
                f"{ev.prompts} held-out prompts are not a multiple of workload.prompts_per_step {w.prompts_per_step} "
                f"(evaluation runs in batches of a step's prompts); set evaluation.prompts to {whole}"
            )
        if ev.dataset is None and not w.dataset.startswith("synthetic:"):
            raise ValueError(
                f"evaluation needs held-out examples: the training file '{w.dataset}' has none of its own; name a "
                "held-out file as evaluation.dataset"
            )
        return self  # a held-out file that is the training file: `executors.evaluation`, which resolves both

    @model_validator(mode="after")
    def _mps(self) -> Spec:
        if self.sharing.policy == "mps" and self.cluster.num_gpus > 1:
            raise ValueError("sharing.policy mps runs on one GPU (its rollout process beside one trainer); use green "
                             "or streams with tensor or data parallelism")  # fmt: skip
        if self.sharing.policy == "mps" and self.memory.empty_cache == "mappings":
            raise ValueError("memory.empty_cache mappings needs the rollout in this process: under sharing.policy mps "
                             "its process maps its KV where this one's cache cannot make room; use phases")  # fmt: skip
        return self

    @property
    def prefills_from_actor(self) -> bool:
        """Whether decode reads the actor prefix's boundary instead of prefilling (`run.rollout_prefill`)."""
        return self.run.rollout_prefill != "rollout" and not self.actor_prefill_missing()

    def actor_prefill_missing(self) -> list[str]:
        """What `run.rollout_prefill: actor_prefix` needs and this spec lacks (nothing: it can run)."""
        needs = {
            "one GPU (cluster.gpus_per_node 1, one node)": self.cluster.num_gpus == 1,
            "algorithm.minibatches_per_step 1": self.algorithm.minibatches_per_step == 1,
            "memory.weight_sharing true": self.memory.weight_sharing,
            "a sharing.policy other than mps": self.sharing.policy != "mps",
        }
        return [need for need, met in needs.items() if not met]

    @model_validator(mode="after")
    def _rollout_prefill(self) -> Spec:
        missing = self.actor_prefill_missing() if self.run.rollout_prefill == "actor_prefix" else []
        if missing:
            raise ValueError(
                f"run.rollout_prefill actor_prefix needs {missing[0]}; or set run.rollout_prefill auto or rollout"
            )
        return self

    @model_validator(mode="after")
    def _layout(self) -> Spec:
        n, tp = self.cluster.num_gpus, self.parallel.train_tp
        if n % tp:
            raise ValueError(f"train_tp {tp} does not divide the cluster's {n} GPUs; use a divisor of {n}")
        dp = n // tp
        if self.workload.prompts_per_step % dp:
            raise ValueError(
                f"workload.prompts_per_step {self.workload.prompts_per_step} is not a multiple of the {dp} "
                "training data-parallel ranks; use a multiple of it"
            )
        per_rank, mbs = self.workload.prompts_per_step // dp, self.algorithm.minibatches_per_step
        if per_rank % mbs:
            raise ValueError(
                f"algorithm.minibatches_per_step {mbs} does not divide the {per_rank} prompts of each training "
                "rank; use a divisor of it"
            )
        return self
