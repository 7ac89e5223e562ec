"""The spec's `algorithm` section: the RL algorithm, its loss, its optimizer and its rewards; the rest of the YAML
spec is in `spec.py`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, PositiveFloat, PositiveInt, field_validator

from rollplex.graph.spec_base import Strict

Beta = Annotated[float, Field(ge=0, lt=1)]  # an AdamW beta: a moment's decay a step


class RewardSpec(Strict):
    name: str = Field(description="A registered reward (`format`, `accuracy`, ...) or `module:function`.")
    weight: float = Field(1.0, description="Weight in the summed reward.")

    @field_validator("name")
    @classmethod
    def _registered(cls, name: str) -> str:
        """A registered name is checked here; a `module:function` is imported when the run starts (a spec runs no
        code when it is read)."""
        if ":" not in name:
            from rollplex.data.rewards import get_reward

            get_reward(name)  # ValueError naming the registered ones
        return name


class AlgorithmSpec(Strict):
    name: Literal["grpo", "ppo"] = Field(
        "grpo",
        description="The RL algorithm: grpo (advantages normalised within each prompt's group) or ppo (a critic: "
        "per-token advantages by GAE over its values, whitened over the step; its own clipped value loss and "
        "optimizer). Without a `graph`, each has its standard graph; a custom graph with a critic needs ppo.",
    )
    kl_coef: float = Field(0.04, ge=0, description="KL-to-reference coefficient; 0 drops the reference model.")
    clip_ratio: float = Field(
        0.2,
        gt=0,
        lt=1,
        description="The clip range epsilon of the ratio to the rollout's policy. It binds in a step's later "
        "mini-batches only (minibatches_per_step > 1): the first trains on-policy, at a ratio of exactly 1.",
    )
    loss_agg: Literal["token_mean", "seq_mean"] = Field("token_mean", description="How token losses are averaged.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient.")
    lr: PositiveFloat = Field(1e-6, description="AdamW learning rate.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay.")
    betas: tuple[Beta, Beta] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1).")
    eps: PositiveFloat = Field(1e-8, description="AdamW epsilon.")
    max_grad_norm: PositiveFloat | None = Field(1.0, description="Global gradient-norm clip; null disables it.")
    temperature: float = Field(
        1.0,
        ge=0,
        description="Rollout sampling temperature (0 = greedy). The trainer's log-probs, KL and entropy are of the "
        "logits divided by it too (by 1 when greedy), so that each token is scored as it was sampled. Under "
        "top_p < 1 they are of the whole tempered distribution, not the truncated one (as verl scores).",
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Rollout nucleus sampling threshold.")
    rewards: tuple[RewardSpec, ...] = Field(
        (RewardSpec(name="format"), RewardSpec(name="accuracy")),
        min_length=1,
        description="Rewards summed per response (at least one).",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="PPO: the discount of GAE.")
    lam: float = Field(0.95, ge=0, le=1, description="PPO: GAE's lambda.")
    value_clip: PositiveFloat = Field(
        0.2,
        description="PPO: how far a value may move from the first scoring's before its loss is clipped. PPO runs one "
        "mini-batch a step, which trains on that first scoring: the clip does not bind there (nor in verl's one "
        "epoch of one mini-batch).",
    )
    critic_lr: PositiveFloat | None = Field(None, description="PPO: the critic's AdamW learning rate; null: `lr`.")
    minibatches_per_step: PositiveInt = Field(
        1,
        description="Optimizer updates per step: the step's prompt groups are split into this many mini-batches "
        "(verl's ppo_mini_batch_size = prompts_per_step / this), each trained and applied in turn; later "
        "mini-batches rerun their actor prefixes on the updated weights and their ratio to the rollout's "
        "policy is clipped. Must divide the prompts of each training rank.",
    )
