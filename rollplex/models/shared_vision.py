"""Each prompt's vision output computed once per step and read by every prefix that embeds it (`freeze_vision`).

With the vision tower frozen, the reference and the actor embed a prompt's video with the same weights (the
reference holds the actor's tower), so the output of the first prefix to embed it serves every later one, the
actor's rerun for a later mini-batch included. The output carries no autograd graph: the actor's gradient
stops at the embeddings. Prefix jobs run chunk by chunk and may interleave (beside decode): a group's vision
work is one generator that whichever job reaches it first drives, and the other job, arriving while it runs,
drives it further, so it runs once, in the same chunks and order in every schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

Chunks = Generator[None, None, Tensor]


@dataclass
class _Running:
    chunks: Chunks
    result: Tensor | None = None


class SharedVision:
    """One step's vision outputs, per prompt (keyed by the prompt object: a step's prompts live through it)."""

    def __init__(self) -> None:
        self._done: dict[int, Tensor] = {}
        self._running: dict[tuple[int, ...], _Running] = {}
        self.runs = 0  # groups whose vision work ran (a test's count)

    def features(self, prompts: Sequence, counts: Sequence[int], compute: Callable[[], Chunks]) -> Chunks:
        """The vision output [sum(counts), hidden] of `prompts` (prompt i has counts[i] visual tokens), pausing
        between the chunks of `compute()` when it has to run it."""
        keys = tuple(id(p) for p in prompts)
        if all(k in self._done for k in keys):
            return torch.cat([self._done[k] for k in keys])
        running = self._running.get(keys)
        if running is None:
            running = self._running[keys] = _Running(compute())
            self.runs += 1
        while running.result is None:
            try:
                next(running.chunks)
            except StopIteration as stop:
                running.result = stop.value
                if running.result.requires_grad:
                    message = "a shared vision output must not need gradients: freeze the vision tower"
                    raise ValueError(message) from None
                for k, part in zip(keys, running.result.split(list(counts)), strict=True):
                    self._done[k] = part
            else:
                yield
        return running.result
