"""Python's garbage collector during a training run: it never starts inside a step.

A collection of the oldest generation walks every object Python tracks, and a process that holds a model's
modules, a tokenizer and a dataset tracks hundreds of thousands. One that starts while a step runs holds the host
that launches the step's kernels, and the device idles for as long. So, while a run trains (`run.manual_gc`):

    ENTRY:      collect once, then freeze what is alive (`gc.freeze`: never walked again; reference counting still
                frees it), and turn automatic collection off
    EACH STEP:  `collect()` at its end walks only what is not frozen (beside a deferred update the device is busy
                meanwhile); a reference cycle that becomes garbage inside a step lives until then
    EXIT:       the collector as it was (what entry froze thawed, unless something else had frozen objects first)
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def collections_between_steps(on: bool = True) -> Iterator[Callable[[], float]]:
    """Yields `collect()`: a collection of every generation, returning its seconds. `on=False` leaves Python's
    collector alone; `collect()` then does nothing and returns 0."""
    if not on:
        yield lambda: 0.0
        return
    was_enabled, was_frozen = gc.isenabled(), gc.get_freeze_count() > 0
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield _collect
    finally:
        if not was_frozen:
            gc.unfreeze()
        if was_enabled:
            gc.enable()


def _collect() -> float:
    began = time.perf_counter()
    gc.collect()
    return time.perf_counter() - began
