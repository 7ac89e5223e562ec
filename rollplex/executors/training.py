"""The actor's training pass over one mini-batch of the step's prompt groups, and the step's training totals.

A pass scores the mini-batch's responses in packed batches (`row_batches`: from the prompt boundary, split; or
over prompt ++ response, unsplit), takes each batch's GRPO loss and its backward, and then sends the gradient
gathered on the boundary through the prefix once. The first pass is the trainer's first scoring of the step's
tokens: its log-probs are the ratio's denominator (the old policy is the rollout's) and are compared with the
rollout engine's own (`logprob_diff_*`). With several mini-batches the first pass also scores every other
response without gradients, under the same weights, for the later passes, which run after an update.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rollplex.executors.dataparallel import OverlappedSum
from rollplex.executors.engines import Engines
from rollplex.executors.grpo import GroupLoss, LossScale, group_advantages, grpo_loss, loss_scale
from rollplex.executors.scoring import (
    LeafBoundary,
    microbatch_budget,
    row_batches,
    score_all,
    score_batch,
    score_group_unsplit,
)
from rollplex.graph.ir import MiniBatch
from rollplex.models.generate import Rollout
from rollplex.models.inputs import Prompt
from rollplex.models.scores import SuffixOut
from rollplex.rollout.slowdown import device_mark, seconds_between


@dataclass(frozen=True)
class MiniBatchInputs:
    """What a training pass reads. Tensors are the whole step's, [P, N, ...]; the pass takes its rows."""

    prompts: Sequence[Prompt]
    rollout: Rollout
    rewards: Tensor  # [P, N]
    ref: SuffixOut | None  # the reference's scores (None without a KL term)
    boundary: (
        LeafBoundary | None
    )  # the actor's attached boundary of the pass's prompts (all, first pass); unsplit: None
    old_logprobs: Tensor | None  # [P, N, R] every response under the rollout's weights, for passes after the first
    advantages: Tensor | None = None  # [P, N, R] per token (PPO's, from the critic); None: GRPO's per group


@dataclass
class TrainTotals:
    """The step's training sums, over its mini-batches; `stats` gives the metrics. Sums of device scalars are
    read once, by `stats`."""

    losses: list = field(default_factory=list)  # each mini-batch's loss (normalised over its own tokens)
    sums: dict = field(default_factory=lambda: dict.fromkeys(("kl", "entropy", "clipped"), 0.0))
    num_tokens: int = 0
    diff_sum: Tensor | float = 0.0  # |rollout log-prob - first trainer log-prob| over real tokens
    diff_max: Tensor | float = 0.0
    grad_norms: list[float] = field(default_factory=list)
    prefix_marks: list = field(default_factory=list)  # device marks around each backward through the prefix
    pending_sum: OverlappedSum | None = None  # data-parallel: the gradients' sum the last backward started

    def add(self, g: GroupLoss) -> None:
        self.losses[-1] = self.losses[-1] + g.loss.detach()
        for k in self.sums:
            self.sums[k] = self.sums[k] + getattr(g, k).detach()

    def agree(self, trainer: Tensor, rollout: Tensor, mask: Tensor) -> None:
        """Notes how far the trainer's log-probs [..., R] of real tokens (`mask`) are from the rollout's."""
        diff = (trainer.detach() - rollout.to(trainer.device)).abs() * mask
        self.diff_sum = self.diff_sum + diff.sum()
        self.diff_max = torch.maximum(torch.as_tensor(self.diff_max, device=diff.device), diff.max())

    def stats(self, dp=None) -> dict[str, float]:
        """The step's metrics; under data parallelism (`dp`) sums over every rank (whose `num_tokens` already
        counts the whole step)."""
        n = max(self.num_tokens, 1)
        sums = {k: float(v) for k, v in self.sums.items()}
        if dp is not None:
            keys = list(sums)
            reduced = dp.sum([sums[k] for k in keys] + [float(self.diff_sum)])
            sums = dict(zip(keys, reduced[:-1], strict=True))
            diff_sum, diff_max = reduced[-1], dp.max(float(self.diff_max))
            losses = dp.sum([float(x) for x in self.losses])
        else:
            diff_sum, diff_max, losses = float(self.diff_sum), float(self.diff_max), [float(x) for x in self.losses]
        stats = {
            "loss": sum(losses) / max(len(losses), 1),
            "kl": sums["kl"] / n,
            "entropy": sums["entropy"] / n,
            "clip_frac": sums["clipped"] / n,
            "logprob_diff_mean": diff_sum / n,
            "logprob_diff_max": diff_max,
        }
        if self.grad_norms:
            stats["grad_norm"] = sum(self.grad_norms) / len(self.grad_norms)
        return stats

    def prefix_backward_s(self) -> float | None:
        """Device seconds of the backwards through the prefix (after `stats` has synchronised), or None."""
        seconds = [seconds_between(start, end) for start, end in self.prefix_marks]
        return None if not seconds or None in seconds else sum(seconds)


def train_minibatch(e: Engines, mb: MiniBatch, x: MiniBatchInputs, totals: TrainTotals) -> Tensor | None:
    """Scores, loss and backward of mini-batch `mb`; gradients accumulate in the actor's `.grad`s. Returns every
    response's log-probs [P, N, R] when this is the first of several mini-batches (the later passes' old
    log-probs), else None."""
    num_prompts, num_samples, width = x.rollout.responses.shape
    rows = mb.prompts(num_prompts)
    part = Rollout(x.rollout.responses[rows], x.rollout.response_lens[rows], x.rollout.logprobs[rows])
    advantages = (x.advantages if x.advantages is not None else group_advantages(x.rewards))[rows]
    ref = x.ref.logprobs[rows] if x.ref is not None else None
    old = x.old_logprobs[rows] if x.old_logprobs is not None else None
    mask = torch.arange(width, device=part.responses.device) < part.response_lens[..., None]
    scale = loss_scale(mask)
    if e.dp is not None:  # the whole step's normaliser, over every data-parallel rank's responses
        scale = LossScale(*(int(x) for x in e.dp.sum([scale.num_tokens, scale.num_sequences])))
    totals.losses.append(0.0)
    first_of_many = mb.index == 0 and mb.count > 1
    every = _score_all_old(e, x) if first_of_many else None
    if every is not None:
        full = torch.arange(width, device=mask.device) < x.rollout.response_lens[..., None]
        totals.agree(every, x.rollout.logprobs, full)

    def step(out: SuffixOut, idx: tuple, cols: int) -> None:
        """The loss of the responses at `idx` (an index into the mini-batch's [P/M, N]) and its backward."""
        lp, m = out.logprobs, mask[idx][..., :cols]
        old_lp = lp.detach() if old is None else old[idx][..., :cols]  # the first pass is the first scoring
        ref_lp = ref[idx][..., :cols] if ref is not None else None
        adv = advantages[idx] if x.advantages is None else advantages[idx][..., :cols]
        g = grpo_loss(e.grpo, scale, lp, old_lp, ref_lp, adv, out.entropy, m)
        g.loss.backward()
        totals.add(g)
        if mb.count == 1:
            totals.agree(lp, part.logprobs[idx][..., :cols], m)

    if x.boundary is not None:
        for batch in row_batches(part, max_tokens=microbatch_budget(e.microbatch_tokens, e.group_size, width)):
            with e.microbatch_memory():
                out = score_batch(e.actor, x.boundary.leaf, part, batch, e.temperature)
            step(out, (batch.index // num_samples, batch.index % num_samples), batch.width)
        # autograd makes this stream wait for the backward's other streams (a prefix op outside the rerun units is
        # backpropagated on the stream it ran on, a green partition's beside decode): two marks here bracket it all
        cuda = part.responses.device.type == "cuda"
        start = device_mark(cuda)
        if e.dp is not None:  # the mini-batch's last backward: sum each bucket over the ranks as it completes
            totals.pending_sum = OverlappedSum(e.dp, e.optimizer, from_backward=e.prefix_rerun is None)
            totals.pending_sum.arm()
        x.boundary.backward_through_prefix()
        totals.prefix_marks.append((start, device_mark(cuda)))
    else:
        for p in range(rows.start, rows.stop):
            with e.microbatch_memory():
                out = score_group_unsplit(
                    e.actor, x.prompts[p], x.rollout.responses[p], x.rollout.response_lens[p], e.temperature
                )
            step(out, (slice(p - rows.start, p - rows.start + 1),), width)
    totals.num_tokens += scale.num_tokens
    return every


def _score_all_old(e: Engines, x: MiniBatchInputs) -> Tensor:
    """Every response's log-probs [P, N, R] under the weights the step began with, without gradients: from the
    boundary of all prompts (split) or over prompt ++ response (unsplit)."""
    boundary = x.boundary.leaf if x.boundary is not None else None
    with torch.no_grad():
        return score_all(e.actor, x.prompts, boundary, x.rollout, e.temperature, e.microbatch_tokens).logprobs
