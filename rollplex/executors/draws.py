"""The random draws a rollout replays or must keep in step: the workload's response lengths
(`workload.replay_lengths`) and, on a data-parallel rank, the sampling draws of the other ranks' rows."""

from __future__ import annotations

import torch

from rollplex.executors.engines import Engines
from rollplex.models.generate import Rollout
from rollplex.models.sampling import sample


def length_budgets(e: Engines, num_prompts: int) -> torch.Tensor | None:
    """[P, N] response lengths drawn from the workload's distribution (`workload.replay_lengths`), capped at
    max tokens; the seed comes from the sampling generator, so a run (and its resume) draws the same ones. A
    data-parallel rank draws the whole step's and keeps its share."""
    if e.response_lengths is None:
        return None
    every = num_prompts * (1 if e.dp is None else e.dp.size)
    seed = int(torch.randint(2**31, (1,), generator=e.generator, device=e.generator.device))
    lengths = e.response_lengths.sample(every * e.group_size, seed).clip(max=e.sampling.max_tokens)
    lengths = torch.from_numpy(lengths).view(every, e.group_size)
    return lengths if e.dp is None else lengths[e.dp.share(every)]


def burn(e: Engines, rollout: Rollout, total_rows: int) -> None:
    """A data-parallel rank's generator draws on to the step's longest response, as one process sampling every
    rank's rows would (each decode step draws the random numbers of all of them)."""
    drawn = rollout.responses.shape[-1]
    longest = int(e.dp.max(drawn))
    vocab = e.actor.config.text.vocab_size
    for _ in range(longest - drawn):
        sample(torch.zeros(total_rows, vocab, device=e.generator.device), e.sampling, e.generator)
