"""An update still running on the optimizer's streams: `ChunkedAdamW.step(defer=True)` returns without making the
caller's stream wait for it, so that the next step's work can start while the FP32 state streams.

What it holds: per parameter, the event after which its new values are written (its last chunk's Adam), the
streams' last events, and the tensors those streams still read or write (the step's workspace, the gradients),
which stay allocated until `finish` so the caching allocator cannot hand their memory to the caller's stream
early. Readers of a parameter wait for its event (`wait_for`, from a module's forward pre-hook, say); anything
else (the rest of the model, the optimizer's own state, the gradients) waits for all of it (`finish`).

    step(defer=True) --> IN FLIGHT --wait_for(params): the caller's stream waits for those params' chunks
                                   --finish(): the caller's stream waits for every stream; the tensors go back
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class UpdateInFlight:
    param_events: dict[int, torch.cuda.Event]  # parameter index -> event after its new values are written
    last_events: tuple[torch.cuda.Event, ...]  # each stream's last work of the step
    held: tuple  # what the streams still use: freed once the caller's stream is past `last_events`

    def wait_for(self, indices: Iterable[int], stream: torch.cuda.Stream) -> None:
        """`stream` waits until the new values of these parameters are written (once per parameter)."""
        for i in indices:
            event = self.param_events.pop(i, None)
            if event is not None:
                stream.wait_event(event)

    def finish(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        """`stream` waits for all of the step; returns the event that marks it done there."""
        for event in self.last_events:
            stream.wait_event(event)
        self.param_events.clear()
        self.held = ()
        return stream.record_event()


def gate_modules(model: nn.Module, optimizer) -> None:
    """A forward pre-hook on each module of `model` with parameters of its own: before it runs, the caller's stream
    waits for a deferred update's chunks of those parameters (`ChunkedAdamW.wait_for`; nothing when no update is in
    flight). The optimizer is held weakly (its pinned pool must not live on in the model's hooks)."""
    ref = weakref.ref(optimizer)

    def wait(module: nn.Module, args) -> None:
        if (alive := ref()) is not None and alive.in_flight is not None:
            alive.wait_for(module.parameters(recurse=False))

    for m in model.modules():
        if next(m.parameters(recurse=False), None) is not None:
            m.register_forward_pre_hook(wait)
