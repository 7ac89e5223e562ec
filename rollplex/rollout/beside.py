"""Prefix work beside rollout decode: chunked jobs (`Qwen2_5_VL.prefix_chunks`) advanced between decode steps.

`Beside` is the `beside` callable of `RolloutEngine.generate`: after each decode step is launched, it enqueues
the next chunk of the first unfinished job on its own stream (a plain stream, or one of a green context's
SM partition), but only when the chunk it enqueued before has finished on the GPU: at most one chunk is
ever in flight, so prefix work fills the GPU beside decode and never queues up in front of it (a free-running
prefill stream starves decode, DESIGN.md section 6). `finish` runs what is left on the caller's stream (the
whole device: decode is over) after the chunk in flight. Without CUDA (tests), chunks run in line. With
`choose`, each chunk's stream is picked from the live decode batch (`green:adaptive`: partitions of several
sizes); a chunk on another stream than the one before waits for it, so a job's chunks stay in order. With
`tail_rows`, the first chunk waits for the rollout's tail: a live batch of at most that many rows.

Lifecycle of a job:

    QUEUED --first chunk--> RUNNING (paused between chunks) --last chunk--> DONE (its result kept)
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import nullcontext

import torch

from rollplex.rollout.slowdown import DeviceClock


class Beside:
    def __init__(
        self,
        jobs: Sequence[Generator],
        stream: torch.cuda.Stream | None = None,
        choose: Callable[[int], torch.cuda.Stream] | None = None,
        tail_rows: int | None = None,
    ) -> None:
        self.jobs = list(jobs)
        self.tail_rows = tail_rows
        self.results: list[object] = [None] * len(self.jobs)
        self.stream = stream if choose is None else choose(0)
        self.choose = choose
        self.next_job = 0
        self.in_flight: torch.cuda.Event | None = None
        self.num_chunks = 0
        self.num_skipped = 0  # calls that found the previous chunk still running
        self.clock = DeviceClock(cuda=self.stream is not None)
        # the first chunk, on whichever stream, runs after what the caller queued before (its inputs are made there)
        self.caller = torch.cuda.current_stream().record_event() if self.stream is not None else None
        self._marks: list[tuple[int, object, object]] = []  # (job, start, end): perf_counter or CUDA events

    @property
    def done(self) -> bool:
        return self.next_job == len(self.jobs)

    def __call__(self, rows: int = 0) -> None:
        """Enqueues one chunk if the previous one has finished and, under `tail_rows`, the tail has begun (the hook
        between decode steps; `rows`: the live decode batch, which picks the stream under `choose`)."""
        if self.done or (self.tail_rows is not None and rows > self.tail_rows):
            return
        self.tail_rows = None  # begun: a batch never grows again
        if self.in_flight is not None and not self.in_flight.query():
            self.num_skipped += 1
            return
        if self.choose is not None:
            self._switch(self.choose(rows))
        self._advance()

    def finish(self) -> list[object]:
        """Runs every remaining chunk on the caller's stream, after the one in flight: decode is over, so what
        is left gets the whole device, not a green partition (and its backward too: autograd runs a node on
        its forward's stream). The caller's stream then holds all of it. Returns each job's result."""
        if self.stream is not None:
            caller = torch.cuda.current_stream()
            if not self.done:
                self._switch(caller)
            if self.stream is not caller:
                caller.wait_stream(self.stream)
        while not self.done:
            self._advance()
        return self.results

    def spans(self) -> list[tuple[int, float, float]]:
        """(job, start, end) of every chunk in perf_counter seconds; on a stream, GPU times (after `finish`)."""
        return [(job, self.clock.seconds(start), self.clock.seconds(end)) for job, start, end in self._marks]

    def _switch(self, stream: torch.cuda.Stream) -> None:
        if stream is not self.stream and self.in_flight is not None:
            stream.wait_event(self.in_flight)
        self.stream = stream

    def _advance(self) -> None:
        job = self.next_job
        if self.caller is not None:
            self.stream.wait_event(self.caller)
            self.caller = None
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            start = self.clock.mark()
            try:
                next(self.jobs[job])
            except StopIteration as finished:
                self.results[job] = finished.value
                self.next_job += 1
            end = self.clock.mark()
            if self.stream is not None:
                self.in_flight = end
        self._marks.append((job, start, end))
        self.num_chunks += 1


class AdaptivePartition:
    """`choose` of `Beside` for `green:adaptive`: a chunk runs in the partition whose size follows the live
    decode batch, half the SMs at the rollout's full batch (the largest batch seen) and up to all of them
    as the batch drains (the largest partition not above `total * (1 - rows / (2 * full))`)."""

    def __init__(self, streams: dict[int, torch.cuda.Stream], total_sms: int) -> None:
        self.streams = dict(sorted(streams.items()))
        self.total_sms = total_sms
        self.full_rows = 0

    def __call__(self, rows: int) -> torch.cuda.Stream:
        self.full_rows = max(self.full_rows, rows)
        return self.streams[adaptive_sms(rows, self.full_rows, tuple(self.streams), self.total_sms)]


def adaptive_sms(rows: int, full_rows: int, sizes: tuple[int, ...], total_sms: int) -> int:
    """The partition size (one of `sizes`, ascending) for a live batch of `rows` out of `full_rows`."""
    target = total_sms * (1 - rows / (2 * full_rows)) if full_rows else total_sms
    fitting = [s for s in sizes if s <= target]
    return fitting[-1] if fitting else sizes[0]
