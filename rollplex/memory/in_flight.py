"""An update still running on the optimizer's streams: `ChunkedAdamW.step(defer=True)` returns without making the
caller's stream wait for it, so that the next step's work can start while the FP32 state streams.

The chunks are enqueued as the caller goes on, never all at once: a step of many parameters is thousands of
launches on the optimizer's streams, and once the device's queue of pending launches is full the host blocks in
the launch until the update has drained it, so an update enqueued whole would hold the host (and the caller's
stream, which it feeds) for the update's length. `pump` keeps AHEAD chunks enqueued and unfinished; a reader of a
parameter enqueues through the parameter's last chunk and waits for it (`wait_for`, from a module's forward
pre-hook, say); anything else (the rest of the model, the optimizer's own state, the gradients) enqueues the rest
and waits for all of it (`finish`). What the streams still read or write (the step's workspace, the gradients)
stays allocated until `finish`, so the caching allocator cannot hand its memory to the caller's stream early.

    step(defer=True) --> IN FLIGHT --pump(): up to AHEAD chunks enqueued and unfinished
                                   --wait_for(params): the caller's stream waits for those params' chunks
                                   --finish(): every chunk enqueued; the caller's stream waits for every stream
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

AHEAD = 6  # chunks enqueued ahead of the last finished one: twice the optimizer's load | adam | offload pipeline


@dataclass
class UpdateInFlight:
    work: Iterator[torch.cuda.Event]  # enqueues the next chunk; yields the event after its new values are written
    last_chunk: dict[int, int]  # parameter index -> the last chunk that writes it
    streams: tuple[torch.cuda.Stream, ...]  # the optimizer's
    held: tuple  # what the streams still use: freed once the caller's stream waits for them (`finish`)
    written: list[torch.cuda.Event] = field(default_factory=list)  # per chunk enqueued so far
    done: int = 0  # chunks known finished (a prefix of `written`)
    broken: bool = False  # enqueueing a chunk raised: the step's later chunks will never be written

    def pump(self) -> None:
        """Enqueues chunks until AHEAD of them are unfinished (asks the device, never waits for it)."""
        while self.done < len(self.written) and self.written[self.done].query():
            self.done += 1
        self._enqueue_through(self.done + AHEAD - 1)

    def wait_for(self, indices: Iterable[int], stream: torch.cuda.Stream) -> None:
        """`stream` waits until the new values of these parameters are written (once per parameter)."""
        self.pump()
        for i in indices:
            j = self.last_chunk.pop(i, None)
            if j is not None:
                self._enqueue_through(j)
                stream.wait_event(self.written[j])

    def finish(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        """Enqueues the rest; `stream` waits for all of the step; returns the event that marks it done there. A
        step whose enqueueing raised is refused: its parameters and state hold half an update."""
        if self.broken:
            raise RuntimeError("a deferred optimizer step was interrupted while enqueueing its chunks: the weights "
                               "and state hold half an update (resume from the last checkpoint)")  # fmt: skip
        self._enqueue_through(sys.maxsize)  # every chunk left
        for s in self.streams:
            stream.wait_stream(s)
        self.last_chunk.clear()
        self.held = ()
        return stream.record_event()

    def _enqueue_through(self, j: int) -> None:
        try:
            while len(self.written) <= j and (event := next(self.work, None)) is not None:
                self.written.append(event)
        except BaseException:
            self.broken = True
            raise


def gate_modules(model: nn.Module, optimizer, whole: Iterable[nn.Module]) -> None:
    """A forward pre-hook on each module of `model` with parameters of its own: before it runs, the caller's stream
    waits for a deferred update's chunks of those parameters (`ChunkedAdamW.wait_for`; nothing when no update is in
    flight). A module of `whole` waits for all its parameters, its submodules' included, and those get no hook of
    their own: a decoder layer or vision block, whose halves call their attention's `project` and `output` rather
    than its forward (a tensor-parallel attention holds its weights itself, and its hook would never run), reads
    its packed projections as one matrix (`models.packing.packed_linear`: q_proj's forward never runs), and may
    run compiled (a hook inside a compiled region would be traced, not run). The optimizer is held
    weakly (its pinned pool must not live on in the model's hooks)."""
    ref = weakref.ref(optimizer)

    def wait(module: nn.Module, args) -> None:
        if (alive := ref()) is not None and alive.in_flight is not None:
            alive.wait_for(module.parameters(recurse=module in units))

    units = set(whole)
    inside = {id(m) for unit in units for m in unit.modules() if m is not unit}
    for m in model.modules():
        if m in units or (id(m) not in inside and next(m.parameters(recurse=False), None) is not None):
            m.register_forward_pre_hook(wait)
