"""The spec's sections that choose how the runtime runs a plan on the device (`run`, `sharing`); the rest of the
YAML spec is in `spec.py`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveInt, model_validator

from rollplex.graph.spec_base import Strict


class RunSpec(Strict):
    steps: PositiveInt = Field(10, description="Training steps.")
    seed: int = Field(0, ge=0, description="Seed of sampling, data order and initial weights.")
    checkpoint_every: PositiveInt | None = Field(None, description="Save a checkpoint every K steps.")
    keep_checkpoints: PositiveInt | None = Field(
        None,
        description="After each save only the newest K complete checkpoints stay, the older ones removed (a 7B "
        "checkpoint with its FP32 optimizer state is about 110 GB); null keeps every one.",
    )
    dtype: Literal["float32", "bfloat16"] = Field("bfloat16", description="Model dtype.")
    init: Literal["auto", "random", "checkpoint"] = Field(
        "auto",
        description="The first weights: random (from `seed`), or checkpoint (`model`'s folder's safetensors); auto: "
        "checkpoint where `model` names a folder that holds weights (model.safetensors or its index), else random.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where `rollplex run` trains: auto is the GPU when there is one, else the CPU."
    )
    deterministic: bool = Field(
        False,
        description="Deterministic GPU kernels (torch.use_deterministic_algorithms): reruns, and serial vs rollplex, "
        "give bitwise the same weights. Off, the attention backwards (cuDNN's, flash's, memory-efficient) accumulate "
        "with atomics and weights differ at rounding level between runs. On costs some attention-backward speed: "
        "torch then never runs attention on cuDNN itself (whatever `cudnn_attention` says), for the whole process, "
        "the vision tower attends through gathers and a mask instead of flash attention's variable-length kernel, "
        "and the scoring attention's cuDNN backward (`suffix_attention`) runs on cuDNN's deterministic kernels where "
        "their workspace fits `memory.runtime_reserve_gib` (tens of GiB at the shipped video workloads), else the "
        "scoring runs on FlexAttention.",
    )
    cudnn_attention: bool = Field(
        True,
        description="Whether torch may run attention on cuDNN's fused kernels (process-wide, set at every engine "
        "build, and in the mps rollout process). cuDNN plans each new attention shape on the host and keeps the plan "
        "for the process, so the runtime pads causal calls and packs vision segments to meet few shapes. false: "
        "flash and memory-efficient kernels only, which plan nothing. Scoring attention is `suffix_attention`'s.",
    )
    suffix_attention: Literal["auto", "flex", "cudnn"] = Field(
        "auto",
        description="The scoring attention on a GPU (each packed response token over its prompt's KV and its own "
        "earlier tokens): flex (one FlexAttention call with a block mask); cudnn (two parts merged by their "
        "log-sum-exps, the prompt part and the own-response part, each one call of cuDNN's fused attention over "
        "ragged segments through cudnn-frontend, `pip install rollplex[gpu]`); auto: cudnn where cudnn-frontend is "
        "installed and `cudnn_attention` is on, else flex. The CPU scores with SDPA and a dense mask either way.",
    )
    manual_gc: bool = Field(
        True,
        description="Python's garbage collector never starts inside a step: `rollplex run` turns automatic "
        "collection off and collects at each step's end, the young generations each time and all of them every "
        "10th step (metrics: gc_s). A full collection that starts mid-step holds the host, and the device waits for "
        "it. false: Python's default collector.",
    )
    compiled_layers: bool = Field(
        False,
        description="On a GPU, each decoder layer and vision block of the trained and reference models runs its "
        "two halves around the attention (norm, QKV projections and rotary; output projection, residuals, norm and "
        "MLP) as one Inductor region each, forward and backward, instead of compiling only their elementwise "
        "chains: the chains fuse with the GEMMs' neighbours and autograd sees one node a half. One compile serves "
        "every layer (per grad mode and model); new token counts may still compile now and then. Numbers differ "
        "from false at rounding level. Measured no faster on the 3B (docs/results.md). Needs parallel.train_tp 1.",
    )
    rollout_prefill: Literal["auto", "rollout", "actor_prefix"] = Field(
        "auto",
        description="Where the rollout's prompt KV and first-token log-probs come from: rollout (the rollout engine "
        "prefills each prompt); actor_prefix (the actor's prefix, which computes the same numbers on the same "
        "weights: it then runs before decode instead of beside it, and the rollout prefills nothing); auto: "
        "actor_prefix where the spec allows it, else rollout. actor_prefix needs one GPU, one mini-batch, "
        "weight_sharing and a rollout in the trainer's process (not sharing.policy mps); the unsplit schedule, "
        "which has no prefix, prefills.",
    )
    decode_kernels: Literal["auto", "cublas", "rollplex", "rollplex_pdl", "rollplex_fused", "rollplex_ahead"] = Field(
        "auto",
        description="The GPU rollout's decode kernels, the same in both schedules: cublas (the projections on "
        "cuBLAS); rollplex (on rollplex's GEMMs); rollplex_pdl (those, and every rollplex kernel of the step, "
        "launched as programmatic dependents: Hopper or newer); rollplex_fused (rollplex_pdl with up to four "
        "launches fewer per layer: a K split summed by the norm or rotary kernel after it, silu inside the gate_up "
        "GEMM); rollplex_ahead (rollplex_fused with each kernel letting the next launch before it waits, and each "
        "GEMM pulling its first weight blocks into L2 meanwhile); auto: rollplex_fused on Hopper or newer, cublas "
        "before it. All decode bitwise alike; their speeds are in docs/results.md.",
    )

    @model_validator(mode="after")
    def _cudnn_scoring(self) -> RunSpec:
        if self.suffix_attention == "cudnn" and not self.cudnn_attention:
            raise ValueError("suffix_attention cudnn runs cuDNN's attention, but cudnn_attention is off; set "
                             "suffix_attention: flex")  # fmt: skip
        return self


def scoring_choice(run: RunSpec) -> str:
    """`run.suffix_attention` as far as the spec decides it: "flex" (asked for, or cuDNN's attention is off),
    "cudnn" (asked for), or "auto" (cudnn where the GPU's process has cudnn-frontend, else flex:
    `executors.device_settings.suffix_attention` resolves it there)."""
    if run.suffix_attention == "flex" or not run.cudnn_attention:
        return "flex"
    return run.suffix_attention


class SharingSpec(Strict):
    policy: Literal["inline", "streams", "green", "mps"] = Field(
        "green",
        description="How `rollplex` runs prefix work beside rollout decode on a GPU: inline (between decode "
        "steps, on decode's stream), streams (its own stream), green (its own stream on a partition of "
        "`prefix_sms` SMs, torch green contexts), mps (rollout in a child process reading the actor's weights "
        "in place, both processes clients of an MPS daemon the run starts and stops; both schedules use it; it samples "
        "from one seed a step drawn from the run's generator, so its tokens differ from an in-process rollout's). "
        "One chunk at most is in flight; the CPU runs prefix work inline (under mps, rollout still runs in "
        "its own process).",
    )
    mps_trainer_percent: int | None = Field(
        None, ge=1, le=100, description="Under mps: the trainer process's active-thread percentage (null: no cap)."
    )
    mps_rollout_percent: int | None = Field(
        None, ge=1, le=100, description="Under mps: the rollout process's active-thread percentage (null: no cap)."
    )
    prefix_sms: PositiveInt | Literal["adaptive"] = Field(
        66,
        description="SMs of the prefix partition under `green` (an H200 has 132), or adaptive: each chunk gets "
        "a partition sized by the live decode batch (half the SMs at the rollout's full batch, more as it drains).",
    )
    layers_per_chunk: PositiveInt = Field(1, description="Decoder layers (and vision blocks) of prefix work per chunk.")
    tail_rows: PositiveInt | None = Field(
        None,
        description="Prefix work beside decode waits for the rollout's tail: its first chunk starts once the live "
        "decode batch (a captured batch size) is at most this many rows, where decode reads every weight for a few "
        "rows and leaves SMs idle; what is left when decode ends runs after it on the whole device. null: from the "
        "first decode step. Not under mps (decode runs in another process).",
    )
    prompts_per_chunk: PositiveInt | None = Field(
        1,
        description="Prompts of prefix work per chunk (both schedules run prefixes in these groups; the actor's "
        "prefix backward rematerialises one group's layer at a time); null: all in one batch.",
    )
    update_beside_prefix: bool | Literal["auto"] = Field(
        "auto",
        description="The actor's update runs on while the next step's actor prefix starts: each module of the "
        "prefix waits for its own parameters' chunks, decode and everything after it for the whole update. Takes "
        "effect where decode reads the actor prefix (`run.rollout_prefill`), which then runs first and copies all "
        "of its inputs to the device before it starts; the plan counts the update's workspace, the gradients it "
        "reads and those inputs in that prefix's steps. auto: on where the actor's FP32 state streams from the "
        "host pool (its update is the link's time, the prefix's is compute) and the plan with it fits with a lower "
        "step bound; false: the update ends its step.",
    )

    @model_validator(mode="after")
    def _tail_rows(self) -> SharingSpec:
        if self.tail_rows is not None and self.policy == "mps":
            raise ValueError("tail_rows needs decode in this process; leave it out under policy mps")
        return self
