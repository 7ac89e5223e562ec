"""Per-GPU quantities of one iteration: who holds how many prompts, sequences and tokens.

Placement: training ranks form TP groups of `train_tp`; each data-parallel rank owns
`prompts_per_step / dp` prompts. Rollout replicas of `rollout_tp` GPUs are laid out so that the q training
ranks covering a rollout shard sit on that shard's GPUs (replica j uses GPUs k*q + j), which keeps every
training shard inside the rollout-sized region on its own GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollplex.graph.spec import Spec
from rollplex.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class PerGpu:
    num_gpus: int
    train_tp: int
    rollout_tp: int
    train_dp: int
    num_rollout_replicas: int
    prompts_per_rank: int  # prompts a training data-parallel rank prefixes and trains on
    prompts_per_replica: int  # prompts a rollout replica decodes
    group_size: int
    prompt_tokens: int
    response_tokens: int
    visual_tokens: int
    patches_per_prompt: int  # vision-encoder patches (4 per visual token)
    sequence_parallel: bool = False  # hidden-sized activations split over the TP ranks (`parallel.sequence_parallel`)
    microbatch_cap: int | None = None  # `memory.microbatch_tokens`

    @property
    def sequences_per_rank(self) -> int:
        return self.prompts_per_rank * self.group_size

    @property
    def microbatch_tokens(self) -> int:
        """A split training microbatch's response tokens: a prompt group's N responses at the longest length, or
        `memory.microbatch_tokens` (a whole response, one of the longest, at least; the rank's every response at
        most)."""
        group = self.group_size * self.response_tokens
        if self.microbatch_cap is None:
            return group
        return min(self.prompts_per_rank * group, max(self.microbatch_cap, self.response_tokens))


def per_gpu(spec: Spec, model: ModelConfig) -> PerGpu:
    n = spec.cluster.num_gpus
    t, r = spec.parallel.train_tp, spec.parallel.rollout_tp
    w = spec.workload
    replicas = n // r
    return PerGpu(
        num_gpus=n,
        train_tp=t,
        rollout_tp=r,
        train_dp=n // t,
        num_rollout_replicas=replicas,
        prompts_per_rank=w.prompts_per_step // (n // t),
        # replicas share a step's prompts (`parallel.split_rollout`), or each decodes its training rank's all
        prompts_per_replica=-(-w.prompts_per_step // replicas)
        if spec.parallel.split_rollout
        else w.prompts_per_step // (n // t),
        group_size=w.group_size,
        prompt_tokens=w.prompt_tokens,
        response_tokens=w.response_tokens,
        visual_tokens=w.num_visual_tokens,
        patches_per_prompt=w.num_visual_tokens * model.vision.merge_unit,
        sequence_parallel=spec.parallel.sequence_parallel,
        microbatch_cap=spec.memory.microbatch_tokens,
    )
