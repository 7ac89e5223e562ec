"""The next step's examples, made on a worker thread while the current step trains.

Making a step's examples (rendering or decoding its videos, patchifying them) takes seconds of host time, which
a training loop that asks for them at the start of each step adds to every step's wall time. `Prefetch` asks for
the batch at the next data position as soon as the current one is taken, on one worker thread: the work is
mostly array code (numpy releases the interpreter lock for it; a renderer's per-frame Python holds it in short
spells), so the trainer's thread keeps launching kernels. The examples are those `batch_at` gives at the same
positions, in the same order (a data-parallel rank's share of them), their patches staged in one host tensor,
pinned for a GPU (`models.inputs.back_to_back`: the prefixes read them from there without a copy of their own); a
failure to make a batch is raised where that batch is taken.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

from rollplex.data.source import Dataset, batch_at
from rollplex.data.types import Example
from rollplex.models.inputs import back_to_back


def staged(examples: Sequence[Example], pin: bool) -> list[Example]:
    """The examples with their patches back to back in one host tensor (pinned when `pin`)."""
    prompts = back_to_back([e.prompt for e in examples], pin)
    return [replace(e, prompt=p) for e, p in zip(examples, prompts, strict=True)]


def staged_batch(
    dataset: Dataset, position: int, size: int, pin: bool, share: Callable[[int], Sequence[int]] | None = None
) -> list[Example]:
    """`batch_at`, or with `share` (a data-parallel rank's, `DataParallel.share`) that rank's examples of it,
    staged (`staged`): a rank pins only the patches it trains on."""
    examples = batch_at(dataset, position, size)
    if share is not None:
        examples = [examples[i] for i in share(len(examples))]
    return staged(examples, pin)


class Prefetch:
    """`take(position)` is `staged_batch(dataset, position, size, pin, share)`, made ahead when the last `take`
    announced it. `pin`: the patches go to a GPU (pinned host memory copies to it without staging)."""

    def __init__(
        self, dataset: Dataset, size: int, pin: bool = False, share: Callable[[int], Sequence[int]] | None = None
    ) -> None:
        self.dataset, self.size, self.pin, self.share = dataset, size, pin, share
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollplex-data")
        self._ahead: tuple[int, Future] | None = None
        self.waited_s = 0.0  # how long the last `take` waited for its batch

    def take(self, position: int, next_position: int | None = None) -> list[Example]:
        """The batch at `position`; then starts making the one at `next_position` (None: no next step)."""
        begin = time.perf_counter()
        if self._ahead is not None and self._ahead[0] == position:
            examples = self._ahead[1].result()
        else:
            if self._ahead is not None:
                self._ahead[1].cancel()
            examples = staged_batch(self.dataset, position, self.size, self.pin, self.share)
        self.waited_s = time.perf_counter() - begin
        self._ahead = None
        if next_position is not None:
            made = self._pool.submit(staged_batch, self.dataset, next_position, self.size, self.pin, self.share)
            self._ahead = (next_position, made)
        return examples

    def close(self) -> None:
        """Drops a batch made ahead that no step will take; does not wait for one being made."""
        if self._ahead is not None:
            self._ahead[1].cancel()
            self._ahead = None
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Prefetch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
