"""What one iteration produced (`runtime.run_iteration`), for the metrics (`loop`): each phase's device
seconds, the rollout and its rewards, the training sums and the device's gaps between ops."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rollplex.executors.training import TrainTotals


@dataclass
class StepRecord:
    """What one iteration produced, for metrics."""

    times: dict[str, float] = field(default_factory=dict)  # per timer of the graph's ops (`cost.timers`)
    stats: dict[str, float] = field(default_factory=dict)
    rewards: torch.Tensor | None = None
    response_lens: torch.Tensor | None = None
    responses: torch.Tensor | None = None  # [P, N, R] token ids of the rollout
    reward_terms: dict[str, float] = field(default_factory=dict)  # each reward's mean over the step's responses
    chunks: list[tuple[str, float, float]] = field(default_factory=list)  # (op, start, end) of prefix chunks
    prefix_backward_s: float | None = None  # device seconds of the actor's backward through its prefix (split)
    train: TrainTotals = field(default_factory=TrainTotals)  # the training sums over the step's mini-batches
    gaps_s: float = 0.0  # device seconds from each op's end to the next's start (the host's work between ops)
    gaps_at: dict[str, float] = field(default_factory=dict)  # gaps_s by boundary ("timer-next timer"), summed
