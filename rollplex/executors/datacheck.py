"""The spec's budgets against its data, on the CPU, before any GPU time is spent (`rollplex compile --check-data`).

Renders the prompts of the first steps from `workload.dataset` (and a step's worth of the held-out prompts of an
`evaluation`) with the run's tokenizer and compares them with `workload.prompt_tokens` (a prompt over it stops
`rollplex run` at its first step, after the models are built) and with the visual tokens per prompt the planner
assumed (`workload.visual_tokens` or `video`). `check_budget` is the same budget check `rollplex run` makes on every
batch.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from rollplex.data.source import batch_at, open_dataset
from rollplex.errors import SpecError
from rollplex.graph.load import LoadedSpec
from rollplex.models.positions import num_visual_tokens


@dataclass(frozen=True)
class DataCheck:
    num_prompts: int
    shortest: int  # prompt tokens
    longest: int
    budget: int  # workload.prompt_tokens
    visual_median: int  # visual tokens per prompt, rendered
    visual_planned: int  # what the planner counts

    def line(self) -> str:
        return (
            f"data: {self.num_prompts} prompts of {self.shortest:,}-{self.longest:,} tokens (budget {self.budget:,}); "
            f"visual tokens per prompt median {self.visual_median:,} (the plan counts {self.visual_planned:,})"
        )


def check_budget(loaded: LoadedSpec, examples: Sequence, held_out: bool = False) -> None:
    """A one-line spec error when a prompt of `examples` is over `workload.prompt_tokens` (`held_out`: of the
    evaluation's held-out examples, which the error then names)."""
    budget = loaded.spec.workload.prompt_tokens
    longest = max(e.prompt.num_tokens for e in examples)
    if longest <= budget:
        return
    if held_out:
        problem = f"a held-out prompt has {longest} tokens, over workload.prompt_tokens {budget}"
        e = SpecError("evaluation.dataset", problem, "raise workload.prompt_tokens, or hold out shorter prompts")
    else:
        e = SpecError("workload.prompt_tokens", f"a prompt has {longest} tokens, over the budget {budget}", "raise it")
    raise loaded.locate(e)


def check_data(loaded: LoadedSpec, steps: int = 1) -> DataCheck:
    """Renders `steps` steps of prompts and checks them (`check_budget`); what it found."""
    from rollplex.executors.task import make_tokenizer

    w = loaded.spec.workload
    try:
        dataset = open_dataset(w.dataset, make_tokenizer(loaded), loaded.spec.run.seed, loaded.path.parent)
    except ValueError as e:
        raise loaded.locate(SpecError("workload.dataset", str(e))) from None
    examples = batch_at(dataset, 0, w.prompts_per_step * steps)
    check_budget(loaded, examples)
    if loaded.spec.evaluation is not None:  # a step's worth of the held-out prompts too
        from rollplex.executors.evaluation import open_evaluation

        held_out = open_evaluation(loaded).dataset
        check_budget(loaded, batch_at(held_out, 0, w.prompts_per_step), held_out=True)
    tokens = [e.prompt.num_tokens for e in examples]
    vision = loaded.model.vision
    visual = [sum(num_visual_tokens(v, vision) for v in e.prompt.visuals) for e in examples]
    return DataCheck(
        len(examples), min(tokens), max(tokens), w.prompt_tokens, int(statistics.median(visual)), w.num_visual_tokens
    )
