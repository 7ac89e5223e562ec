"""Which sequences still decode, and how they sit in the rows of a batch of fixed (captured) size.

A rollout has P prompts x N samples: sequence s (its *slot* in the response cache) is sample s % N of prompt
s // N. The decode batch runs `rows` rows, a size from `bucket_sizes`: the live slots in increasing order,
then padding rows that all point at one spare slot (index P * N), whose results are never read. Rows of
the same prompt are therefore contiguous, which the cascade attention relies on; it reads only the prompts the
batch holds, and a batch is laid out again when its live sequences span fewer prompts.

Lifecycle of a sequence:

    LIVE --(samples a stop token, or reaches max_tokens)--> FINISHED (still computed until the batch shrinks)
         --(the live count falls to a smaller bucket, or the live sequences span fewer prompts: compaction)-->
    RETIRED (no longer in the batch)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def bucket_sizes(max_rows: int) -> tuple[int, ...]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 16 below max_rows, and max_rows itself."""
    sizes = {n for n in (1, 2, 4, 8) if n < max_rows} | set(range(16, max_rows, 16)) | {max_rows}
    return tuple(sorted(sizes))


def bucket_for(num_live: int, sizes: tuple[int, ...]) -> int:
    """The smallest captured size holding num_live rows."""
    for size in sizes:
        if size >= num_live:
            return size
    raise ValueError(f"{num_live} live sequences exceed the largest batch size {sizes[-1]}")


@dataclass(frozen=True)
class BatchLayout:
    """Rows of one batch size: slots [rows] int64; per prompt its first row and row count [P] int64; the prompts
    [P] int64, those with rows first (ascending), then the others."""

    slots: Tensor
    row_start: Tensor
    row_count: Tensor
    prompts: Tensor

    @property
    def rows(self) -> int:
        return self.slots.numel()

    @property
    def num_prompts(self) -> int:
        """How many prompts have rows in the batch."""
        return int((self.row_count > 0).sum())


def layout(live: Tensor, rows: int, num_prompts: int, num_samples: int) -> BatchLayout:
    """The batch of `rows` rows for the live slots `live` (any order, unique): sorted, then padding."""
    assert live.numel() <= rows, f"{live.numel()} live sequences in {rows} rows"
    spare = num_prompts * num_samples
    slots = torch.full((rows,), spare, dtype=torch.long)
    slots[: live.numel()] = live.sort().values
    counts = torch.bincount(live // num_samples, minlength=num_prompts)
    prompts = torch.cat([(counts > 0).nonzero()[:, 0], (counts == 0).nonzero()[:, 0]])
    return BatchLayout(slots, counts.cumsum(0) - counts, counts, prompts)


def prompt_counts(sizes: tuple[int, ...], num_samples: int, num_prompts: int) -> dict[int, tuple[int, ...]]:
    """Per batch size, how many prompts its rows can span: a batch of `rows` rows holds more live sequences than
    the next smaller size (else it would have shrunk to that size), so at least that many over num_samples, and
    at most min(rows, num_prompts)."""
    counts = {}
    for smaller, rows in zip((0, *sizes), sizes, strict=False):
        fewest = min(-(-(smaller + 1) // num_samples), num_prompts)
        counts[rows] = tuple(range(fewest, min(rows, num_prompts) + 1))
    return counts
