"""Held-out evaluation (the spec's `evaluation`): before step 1 (a fresh run's starting weights, as step 0), after
every K-th step and after the run's last, the actor answers a fixed set of held-out prompts, and their rewards,
accuracy and lengths are logged (`eval.jsonl`, TensorBoard's `eval/` scalars, a progress line).

The prompts run in batches of a step's prompts, each sampled as a step's rollout samples (the engine, group size,
temperature and top-p; the engine prefills them itself), so evaluation holds what the plan's rollout holds; its
accuracy is the mean over each prompt's group of samples. Nothing of it reaches training: each batch draws from a
generator of its own, seeded by the run's seed and the batch alone (every evaluation of a run samples with the same
random numbers, so two evaluations differ by the weights only), it runs once the step's update is whole, and it
changes no state a step reads: a run trains as it would without it (bit for bit on the CPU, tested; on a GPU the
held-out prompts' lengths may compile kernels that later steps reuse). Under data parallelism each rank
answers its share of each batch as it would its share of a step (the tokens of the one-process run), and the
ranks' sums make the figures. A run resumed at a step whose evaluation was due evaluates it again (a stop may have
cut it short), before it trains on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np
import torch

from rollplex.data.prefetch import staged_batch
from rollplex.data.source import Dataset, open_held_out
from rollplex.errors import RunFailed, SpecError
from rollplex.executors.datacheck import check_budget
from rollplex.executors.grading import grade
from rollplex.executors.task import make_tokenizer
from rollplex.graph.load import LoadedSpec
from rollplex.graph.spec_files import dataset_file

if TYPE_CHECKING:
    from rollplex.executors.engines import Engines

SEED_SALT = 0xE7A1  # keeps the evaluation's random numbers apart from every other draw seeded by the run's seed


@dataclass(frozen=True)
class Evaluation:
    loaded: LoadedSpec
    dataset: Dataset  # the held-out examples, in the order they are answered
    every: int  # after every K-th step (and the run's last)
    prompts_per_batch: int  # a step's
    at_start: bool = True  # also before step 1 (step 0)

    def due(self, step: int, last_step: int) -> bool:
        return step % self.every == 0 or step == last_step

    @property
    def num_batches(self) -> int:
        return len(self.dataset) // self.prompts_per_batch

    def generator_seed(self, index: int) -> int:
        """The seed of batch `index`'s generator: the run's seed and the index alone."""
        return int(np.random.default_rng([self.loaded.spec.run.seed, index, SEED_SALT]).integers(2**62))


def open_evaluation(loaded: LoadedSpec) -> Evaluation | None:
    """The spec's evaluation, its held-out examples found (not yet made); None without one. A held-out file with
    fewer rows than `evaluation.prompts`, or that is the training file, is a SpecError."""
    spec, ev = loaded.spec, loaded.spec.evaluation
    if ev is None:
        return None
    w = spec.workload
    name, key = (ev.dataset, "evaluation.dataset") if ev.dataset else (w.dataset, "workload.dataset")
    try:
        base = loaded.path.parent
        files = not name.startswith("synthetic:") and not w.dataset.startswith("synthetic:")
        if files and dataset_file(name, base).resolve() == dataset_file(w.dataset, base).resolve():
            raise ValueError(f"'{name}' is the training file, whose examples are not held out; name another file")
        size = ev.prompts or w.prompts_per_step
        dataset = open_held_out(name, make_tokenizer(loaded), spec.run.seed, size, base, w.mismatch_videos)
    except ValueError as e:
        raise loaded.locate(SpecError(key, str(e))) from None
    return Evaluation(loaded, dataset, ev.every, w.prompts_per_step, ev.at_start)


@dataclass(frozen=True)
class Tally:
    """An evaluation's sums over the responses graded (of one rank, or of every rank)."""

    responses: float
    correct: float
    reward: float
    reward_squared: float
    tokens: float
    terms: tuple[float, ...]  # each reward term's sum

    def values(self) -> list[float]:
        return [*(getattr(self, f.name) for f in fields(self) if f.name != "terms"), *self.terms]

    @staticmethod
    def of(values: Sequence[float]) -> Tally:
        return Tally(*values[:5], terms=tuple(values[5:]))

    def __add__(self, other: Tally) -> Tally:
        return Tally.of([a + b for a, b in zip(self.values(), other.values(), strict=True)])

    def over(self, dp) -> Tally:
        """The sums over every data-parallel rank (`dp` None: this process's)."""
        return self if dp is None else Tally.of(dp.sum(self.values()))


def evaluate(e: Engines, ev: Evaluation, step: int, share: Callable[[int], Sequence[int]] | None = None) -> dict:
    """The held-out figures of the actor's weights as they are now, logged as evaluation `step`'s. `share`: a
    data-parallel rank's examples of a batch (`DataParallel.share`), as the training data's."""
    began, tally = time.perf_counter(), None
    for index in range(ev.num_batches):
        examples = _batch(ev, index, e.actor.device.type == "cuda", share, step)
        shared = {} if e.dp is None else {"rows": e.dp.rows(len(examples), e.group_size)}
        generator = torch.Generator(e.generator.device).manual_seed(ev.generator_seed(index))
        prompts = [x.prompt for x in examples]
        rollout = e.rollout(prompts, num_samples=e.group_size, params=e.sampling, generator=generator, **shared)
        grades = grade(rollout, examples, e.tokenizer, e.reward)
        rewards = grades.rewards.double()
        batch = Tally(
            grades.num_responses, grades.num_correct, float(rewards.sum()), float((rewards**2).sum()),
            float(rollout.response_lens.sum()), tuple(grades.term_sums.tolist()),
        )  # fmt: skip
        tally = batch if tally is None else tally + batch
    return figures(step, tally.over(e.dp), e.reward.names, len(ev.dataset), time.perf_counter() - began)


def _batch(ev: Evaluation, index: int, pin: bool, share, step: int) -> list:
    """Batch `index` of the held-out examples, made and checked against the prompt budget; one line where one
    cannot be read."""
    try:
        examples = staged_batch(ev.dataset, index * ev.prompts_per_batch, ev.prompts_per_batch, pin, share)
    except ValueError as e:
        when = "of the starting weights" if step == 0 else f"after step {step}"
        raise RunFailed(f"the evaluation {when}: a held-out example: {e}; fix or drop that row") from None
    check_budget(ev.loaded, examples, held_out=True)
    return examples


def figures(step: int, tally: Tally, names: Sequence[str], num_prompts: int, seconds: float) -> dict:
    """Evaluation `step`'s line from its tally over every rank; `reward_std` as a step's (the sample standard
    deviation)."""
    n = tally.responses
    mean = tally.reward / n
    return {
        "step": step,
        "prompts": num_prompts,
        "responses": round(n),
        "reward_mean": mean,
        "reward_std": max(tally.reward_squared - n * mean**2, 0.0) ** 0.5 / max(n - 1, 1) ** 0.5,
        **{f"rewards/{name}": value / n for name, value in zip(names, tally.terms, strict=True)},
        "accuracy": tally.correct / n,
        "response_len_mean": tally.tokens / n,
        "time_s": round(seconds, 4),
    }


def eval_line(figures: dict) -> str:
    """The progress line of an evaluation."""
    which = "of the starting weights" if figures["step"] == 0 else f"after step {figures['step']}"
    return (
        f"evaluation {which}: accuracy {figures['accuracy']:.3f}, reward "
        f"{figures['reward_mean']:.3f} over {figures['responses']} responses to {figures['prompts']} held-out prompts "
        f"({figures['time_s']:.1f} s)"
    )
