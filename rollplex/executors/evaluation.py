"""Held-out evaluation (the spec's `evaluation`): before step 1 (a fresh run's starting weights, as step 0), after
every K-th step and after the run's last, the actor answers a fixed set of held-out prompts, and their rewards,
accuracy and lengths are logged (`eval.jsonl`, TensorBoard's `eval/` scalars, a progress line).

The prompts run in batches of a step's prompts, each sampled as a step's rollout samples (the engine, group size,
temperature and top-p; the engine prefills them itself), so evaluation holds what the plan's rollout holds; its
accuracy is the mean over each prompt's group of samples. Nothing of it reaches training: each batch draws from a
generator of its own, seeded by the run's seed and the batch alone (every evaluation of a run samples with the same
random numbers, so two evaluations differ by the weights only), it runs once the step's update is whole, and it
changes no state a step reads: a run trains bit for bit as it would without it. Under data parallelism each rank
answers its share of each batch as it would its share of a step (the tokens of the one-process run), and the
ranks' sums make the figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rollplex.data.prefetch import staged_batch
from rollplex.data.source import Dataset, open_held_out
from rollplex.errors import SpecError
from rollplex.executors.engines import Engines
from rollplex.executors.grading import grade
from rollplex.executors.task import make_tokenizer
from rollplex.graph.load import LoadedSpec

SEED_SALT = 0xE7A1  # keeps the evaluation's random numbers apart from every other draw seeded by the run's seed


@dataclass(frozen=True)
class Evaluation:
    dataset: Dataset  # the held-out examples, in the order they are answered
    every: int  # after every K-th step (and the run's last)
    batch: int  # prompts a batch: a step's
    seed: int
    at_start: bool = True  # also before step 1 (step 0)

    def due(self, step: int, last_step: int) -> bool:
        return step % self.every == 0 or step == last_step

    @property
    def num_batches(self) -> int:
        return len(self.dataset) // self.batch

    def generator_seed(self, batch: int) -> int:
        return int(np.random.default_rng([self.seed, batch, SEED_SALT]).integers(2**62))


def open_evaluation(loaded: LoadedSpec) -> Evaluation | None:
    """The spec's evaluation, its held-out examples found (not yet made); None without one. A held-out file with
    fewer rows than `evaluation.prompts` is a SpecError."""
    spec, ev = loaded.spec, loaded.spec.evaluation
    if ev is None:
        return None
    w = spec.workload
    size = ev.prompts or w.prompts_per_step
    name = ev.dataset or w.dataset
    try:
        dataset = open_held_out(
            name, make_tokenizer(loaded), spec.run.seed, size, loaded.path.parent, w.mismatch_videos
        )
    except ValueError as e:
        raise loaded.locate(SpecError("evaluation.dataset" if ev.dataset else "workload.dataset", str(e))) from None
    return Evaluation(dataset, ev.every, w.prompts_per_step, spec.run.seed, ev.at_start)


def evaluate(
    e: Engines,
    ev: Evaluation,
    step: int,
    pin: bool = False,
    share: Callable[[int], Sequence[int]] | None = None,
    check: Callable[[list], None] | None = None,
) -> dict:
    """The held-out figures of the actor's weights as they are now, logged as evaluation `step`'s. `pin`, `share`:
    as the training data's (`data.prefetch.staged_batch`); `check`: called with each batch's examples first (the
    run's prompt budget)."""
    began = time.perf_counter()
    sums = np.zeros(5 + len(e.reward.names))  # responses, correct, reward, reward^2, tokens, then each term
    for b in range(ev.num_batches):
        examples = staged_batch(ev.dataset, b * ev.batch, ev.batch, pin, share)
        if check is not None:
            check(examples)
        shared = {} if e.dp is None else {"rows": e.dp.rows(len(examples), e.group_size)}
        generator = torch.Generator(e.generator.device).manual_seed(ev.generator_seed(b))
        prompts = [x.prompt for x in examples]
        rollout = e.rollout(prompts, num_samples=e.group_size, params=e.sampling, generator=generator, **shared)
        grades = grade(rollout, examples, e.tokenizer, e.reward)
        rewards = grades.rewards.double()
        tokens = float(rollout.response_lens.sum())
        counts = [grades.num_responses, grades.num_correct, float(rewards.sum()), float((rewards**2).sum()), tokens]
        sums += np.array(counts + grades.term_sums.tolist())
    if e.dp is not None:
        sums = np.array(e.dp.sum(sums.tolist()))
    return figures(step, sums, e.reward.names, len(ev.dataset), time.perf_counter() - began)


def figures(step: int, sums: np.ndarray, names: Sequence[str], num_prompts: int, seconds: float) -> dict:
    """Evaluation `step`'s line from the sums `evaluate` gathered (over every rank); `reward_std` as a step's
    (the sample standard deviation)."""
    n, correct, reward, square, tokens, *terms = sums.tolist()
    mean = reward / n
    return {
        "step": step,
        "prompts": num_prompts,
        "responses": round(n),
        "reward_mean": mean,
        "reward_std": max(square - n * mean**2, 0.0) ** 0.5 / max(n - 1, 1) ** 0.5,
        **{f"rewards/{name}": value / n for name, value in zip(names, terms, strict=True)},
        "accuracy": correct / n,
        "response_len_mean": tokens / n,
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
