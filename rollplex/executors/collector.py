"""Python's garbage collector during a training run: it never starts inside a step.

A collection of the oldest generation walks every object Python tracks, and a process that holds a model's
modules, a tokenizer and a dataset tracks hundreds of thousands. One that starts while a step runs holds the host
that launches the step's kernels, and the device idles for as long. So, while a run trains (`run.manual_gc`):

    ENTRY:      automatic collection off
    EACH STEP:  `collect()` at its end collects the two young generations: what the step made (nothing is
                collected while it runs, so all of it is young) and what the step before left; every FULL_EVERY-th
                call collects all three (the old generation: what outlived two steps); beside a deferred update
                the device is busy meanwhile. A reference cycle that becomes garbage inside a step lives until the
                step's end, one among old objects until the next full collection
    EXIT:       automatic collection as it was
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import count

FULL_EVERY = 10  # step-end collections from one full collection to the next


@contextmanager
def collections_between_steps(on: bool = True) -> Iterator[Callable[[], float]]:
    """Yields `collect()`: a step's collection (generations 0 and 1, every FULL_EVERY-th call all three), returning
    its seconds. `on=False` leaves Python's collector alone; `collect()` then does nothing and returns 0."""
    if not on:
        yield lambda: 0.0
        return
    was_enabled = gc.isenabled()
    gc.disable()
    calls = count(1)

    def collect() -> float:
        began = time.perf_counter()
        gc.collect(2 if next(calls) % FULL_EVERY == 0 else 1)
        return time.perf_counter() - began

    try:
        yield collect
    finally:
        if was_enabled:
            gc.enable()
