"""How the optimizer's flat FP32 state is cut: chunks that stream through the device and ZeRO-1 shards.

The parameters' elements, flattened and laid end to end, are one flat range. A `Chunk` is a run of it whose
state (12 bytes per element) fits a device slot, made of `Segment`s (a parameter's elements, or part of them); a
`Shard` is one data-parallel rank's run. Pure arithmetic on element counts: no tensors.
Not here: moving the state or updating it (`rollplex.memory.optimizer`).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

STATE_BYTES_PER_ELEMENT = 12  # FP32 master + exp_avg + exp_avg_sq


@dataclass(frozen=True, slots=True)
class Segment:
    """Elements [start, stop) of flattened parameter `param_index`, at `offset` in its chunk."""

    param_index: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class Chunk:
    segments: tuple[Segment, ...]
    numel: int


def plan_chunks(numels: Sequence[int], chunk_bytes: int, lo: int = 0, hi: int | None = None) -> tuple[Chunk, ...]:
    """Cut elements [lo, hi) of the parameters, flattened and laid end to end (default: all of them), into the
    fewest chunks whose FP32 state fits in `chunk_bytes`, equal to within one element; a parameter across a
    boundary is split between chunks."""
    capacity = chunk_bytes // STATE_BYTES_PER_ELEMENT
    if capacity < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes} is below one element's state ({STATE_BYTES_PER_ELEMENT} bytes)")
    hi = sum(numels) if hi is None else hi
    total = hi - lo
    num_chunks = max(1, -(-total // capacity))
    starts = [0, *accumulate(numels)]
    chunks = []
    for k in range(num_chunks):
        first_k, last_k = lo + k * total // num_chunks, lo + (k + 1) * total // num_chunks
        chunks.append(Chunk(flat_segments(starts, first_k, last_k), last_k - first_k))
    return tuple(chunks)


def flat_segments(starts: Sequence[int], first: int, last: int) -> tuple[Segment, ...]:
    """The parameters' pieces in flat elements [first, last): `starts` are the parameters' flat offsets (and the
    total last); each piece's `offset` is from `first`."""
    segments, i = [], bisect_right(starts, first) - 1
    while i < len(starts) - 1 and starts[i] < last:
        a, b = max(first, starts[i]), min(last, starts[i + 1])
        if a < b:
            segments.append(Segment(i, a - starts[i], b - starts[i], a - first))
        i += 1
    return tuple(segments)


@dataclass(frozen=True, slots=True)
class Shard:
    """ZeRO-1: the FP32 state split over `size` data-parallel ranks, this one `rank`, over process `group` (None:
    the default group). Rank r owns the flat elements [r * N // size, (r + 1) * N // size) of the N parameters'
    elements laid end to end: it keeps their master weights and moments, updates them, and sends their new
    values to every other rank, which writes them where its own go."""

    rank: int
    size: int
    group: object = None

    def bounds(self, total: int, rank: int | None = None) -> tuple[int, int]:
        r = self.rank if rank is None else rank
        return r * total // self.size, (r + 1) * total // self.size


def resident_chunks(chunks: Sequence[Chunk], num_bytes: int) -> int:
    """How many of the first chunks hold at most `num_bytes` of state together."""
    kept, held = 0, 0
    for chunk in chunks:
        held += STATE_BYTES_PER_ELEMENT * chunk.numel
        if held > num_bytes:
            break
        kept += 1
    return kept
