"""The spec's `workload` section, what a step trains on (prompts, samples, token budgets, the data), and its
`evaluation` section, the held-out prompts the actor answers between steps; the rest of the YAML spec is in
`spec.py`."""

from __future__ import annotations

from pydantic import Field, PositiveInt, field_validator, model_validator

from rollplex.graph.spec_base import Strict


class VideoSpec(Strict):
    frames: PositiveInt = Field(description="Frames sampled per video.")
    height: PositiveInt = Field(description="Frame height in pixels after resizing (a multiple of 28).")
    width: PositiveInt = Field(description="Frame width in pixels after resizing (a multiple of 28).")

    @field_validator("height", "width")
    @classmethod
    def _whole_patches(cls, pixels: int) -> int:
        if pixels % 28:
            raise ValueError(
                f"{pixels} is not a multiple of 28 (a merged 2 x 2 of 14-pixel patches); use {pixels // 28 * 28 or 28}"
            )
        return pixels


MAX_PROMPTS = 2**16  # prompts a step: beyond any run rollplex plans for (a dry-run draws each prompt it prices)
MAX_RESPONSES = 2**20  # responses a step, prompts x group


class WorkloadSpec(Strict):
    prompts_per_step: PositiveInt = Field(
        description=f"Prompts per training step, over the whole cluster (at most {MAX_PROMPTS:,})."
    )
    group_size: PositiveInt = Field(
        description=f"Responses sampled per prompt (GRPO's N); prompts_per_step x group_size at most {MAX_RESPONSES:,}."
    )
    prompt_tokens: PositiveInt = Field(description="Prompt token budget per prompt, visual tokens included.")
    response_tokens: PositiveInt = Field(description="Response token budget (max new tokens).")
    video: VideoSpec | None = Field(
        None,
        description="The plan's video budget, frames and their size, which sets the visual tokens it counts. The "
        "data brings its own videos (a Video-R1 file's decoded at 16 frames, a synthetic preset's drawn by it): "
        "`rollplex compile --check-data` compares them with this budget.",
    )
    visual_tokens: PositiveInt | None = Field(None, description="Visual tokens per prompt, instead of `video`.")
    dataset: str = Field("synthetic:clevrer", description="`synthetic:<preset>` or a Video-R1 JSON/JSONL path.")
    replay_lengths: bool = Field(
        False,
        description="Benchmarks with random weights: end each response at a length drawn from the synthetic "
        "preset's distribution (seeded from the run), so that decode follows the workload, not max tokens.",
    )

    mismatch_videos: bool = Field(
        False,
        description="A control run: each synthetic question and answer is shown the video of the next example, so "
        "the answer cannot be read from the video (accuracy should stay at chance).",
    )

    @field_validator("dataset")
    @classmethod
    def _synthetic(cls, dataset: str) -> str:
        return known_preset(dataset)

    @field_validator("prompts_per_step")
    @classmethod
    def _prompts(cls, prompts: int) -> int:
        if prompts > MAX_PROMPTS:
            raise ValueError(f"{prompts:,} prompts a step is more than rollplex plans for (at most {MAX_PROMPTS:,})")
        return prompts

    @model_validator(mode="after")
    def _consistent(self) -> WorkloadSpec:
        responses = self.prompts_per_step * self.group_size
        if responses > MAX_RESPONSES:
            raise ValueError(
                f"prompts_per_step x group_size = {responses:,} responses a step is more than rollplex plans for "
                f"(at most {MAX_RESPONSES:,})"
            )
        for key in ("replay_lengths", "mismatch_videos"):
            if getattr(self, key) and not self.dataset.startswith("synthetic:"):
                raise ValueError(f"{key} needs a synthetic:<preset> dataset, not '{self.dataset}'")
        if self.video is not None and self.visual_tokens is not None:
            raise ValueError("give either `video` or `visual_tokens`, not both")
        if self.num_visual_tokens > self.prompt_tokens:
            raise ValueError(
                f"{self.num_visual_tokens} visual tokens exceed prompt_tokens {self.prompt_tokens}; "
                "raise prompt_tokens or lower the video resolution"
            )
        return self

    @property
    def num_visual_tokens(self) -> int:
        if self.video is not None:
            v = self.video
            return -(-v.frames // 2) * (v.height // 28) * (v.width // 28)
        return self.visual_tokens or 0


class EvaluationSpec(Strict):
    every: PositiveInt = Field(description="Evaluate after every K-th step, and after the run's last.")
    at_start: bool = Field(
        True,
        description="Also evaluate the starting weights, before step 1 (logged as step 0; a resumed run does not "
        "repeat it): the figures the training moves from.",
    )
    prompts: PositiveInt | None = Field(
        None,
        description="Held-out prompts each evaluation answers, a multiple of workload.prompts_per_step: they run in "
        "batches of a step's prompts, each sampled as a step's rollout samples (its group_size, temperature and "
        "top_p), so that evaluation fits the plan's rollout; null: prompts_per_step.",
    )
    dataset: str | None = Field(
        None,
        description="The held-out examples: `synthetic:<preset>` (its examples past those any run trains on, drawn "
        "from the run's seed) or a Video-R1 JSON/JSONL path (its first `prompts` rows; relative to the spec); null: "
        "a synthetic training dataset's own held-out examples. A training file needs a held-out file named here.",
    )

    @field_validator("dataset")
    @classmethod
    def _synthetic(cls, dataset: str | None) -> str | None:
        return None if dataset is None else known_preset(dataset)


def known_preset(dataset: str) -> str:
    """`dataset` itself; a ValueError for a `synthetic:` name of an unknown preset or scale."""
    if dataset.startswith("synthetic:"):
        from rollplex.data.presets import synthetic_preset

        synthetic_preset(dataset)
    return dataset
