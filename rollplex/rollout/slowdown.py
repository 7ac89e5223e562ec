"""How much the prefix work beside decode slowed decode down, measured inside one rollout.

Each decode step is an interval on the GPU timeline with its batch size; each prefix chunk is an interval on
the prefix stream's. A step that overlaps any chunk ran beside prefix work. Its duration is compared with
steps of the same batch size that ran alone (a step's time depends on its batch size, and prefix work runs
early, while the batch is still large), and the ratios are averaged over the overlapped steps. No second
rollout, no change to the schedule: the rollout measures its own slowdown.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Sequence
from itertools import pairwise
from statistics import fmean

import torch

StepSpan = tuple[float, float, int]  # (start s, end s, batch rows)


def merge(spans: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same time."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def overlaps(busy: list[tuple[float, float]], start: float, end: float) -> bool:
    """Whether [start, end) meets any of the merged intervals `busy`."""
    i = bisect_left(busy, (end,)) - 1  # the last interval starting before `end`
    return i >= 0 and busy[i][1] > start


def decode_slowdown(steps: Sequence[StepSpan], chunks: Sequence[tuple[float, float]]) -> float | None:
    """Mean, over the decode steps that overlapped a chunk, of their duration over the mean duration of the
    steps of their batch size that overlapped none; None when no batch size has steps of both kinds."""
    busy = merge(chunks)
    by_rows: dict[int, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for start, end, rows in steps:
        by_rows[rows][0 if overlaps(busy, start, end) else 1].append(end - start)
    ratios = [t / fmean(alone) for beside, alone in by_rows.values() if beside and alone for t in beside]
    return fmean(ratios) if ratios else None


def decode_time(steps: Sequence[StepSpan]) -> tuple[float, float]:
    """(seconds the decode steps ran, seconds between one step's end and the next's start): the second is the
    device's time in the rollout outside its steps (the host's work between replays, batch re-layouts)."""
    busy = sum(end - start for start, end, _ in steps)
    idle = sum(max(0.0, nxt[0] - prev[1]) for prev, nxt in pairwise(steps))
    return busy, idle


def device_mark(cuda: bool):
    """A point in time without a host sync: a CUDA event on the current stream, or perf_counter seconds."""
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def seconds_between(start, end) -> float:
    """Seconds from mark `start` to mark `end` (waits for `end` to be reached on the device)."""
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3


class DeviceClock:
    """Marks on one timeline in perf_counter seconds: perf_counter itself without CUDA, else CUDA events on the
    current stream, placed on the host's clock through an origin taken right after a device synchronisation
    (read them after the work is done)."""

    def __init__(self, cuda: bool) -> None:
        self.origin_event = None
        if cuda:
            torch.cuda.synchronize()
            self.origin_event = torch.cuda.Event(enable_timing=True)
            self.origin_event.record()
        self.origin = time.perf_counter()

    def mark(self):
        return device_mark(self.origin_event is not None)

    def seconds(self, mark) -> float:
        if self.origin_event is None:
            return mark
        return self.origin + seconds_between(self.origin_event, mark)
