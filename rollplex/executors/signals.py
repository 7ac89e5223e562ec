"""The signals that stop a run: Ctrl-C's SIGINT, and SIGTERM and SIGHUP (`kill`, `timeout`, a batch scheduler's
preemption, a closed terminal). Each raises `Stopped` where the process is, as Ctrl-C raises KeyboardInterrupt, so a
run that receives any of them ends as after Ctrl-C: the last completed step saved, one line said. `InterruptGate`
holds them back while a step's update must finish first.

Handlers are the main thread's to set (Python's rule); elsewhere both are left as they are.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rollplex.errors import Stopped

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def _raise(signum, frame) -> None:
    raise Stopped(signum)


@contextmanager
def stop_signals() -> Iterator[None]:
    """Every STOP_SIGNALS raises `Stopped` inside the block; the handlers before it come back after."""
    try:
        previous = {s: signal.signal(s, _raise) for s in STOP_SIGNALS}
    except ValueError:  # not the main thread: signals are not ours to set
        yield
        return
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class InterruptGate:
    """Holds the stop signals back from `hold()` to `release()`, then raises the first that came."""

    def __init__(self) -> None:
        self.pending = 0  # the first signal held back, 0 for none
        self.previous: dict | None = None
        self.why = ""  # said on stderr at the first signal held, if set

    def hold(self, why: str = "") -> None:
        self.why = why or self.why
        if self.previous is not None:  # held already
            return
        try:
            self.previous = {s: signal.signal(s, self._note) for s in STOP_SIGNALS}
        except ValueError:  # not the main thread: signals are not ours to hold
            self.previous = None

    def _note(self, signum, frame) -> None:
        if self.why and not self.pending:
            print(f"rollplex: {self.why}", file=sys.stderr, flush=True)
        self.pending = self.pending or signum

    def release(self, raise_pending: bool = True) -> int:
        """Lets the signals through again; the first that came meanwhile is raised now (`Stopped`), or, not
        `raise_pending`, returned (0: none came)."""
        if self.previous is not None:
            for s, handler in self.previous.items():
                signal.signal(s, handler)
            self.previous = None
        came, self.pending, self.why = self.pending, 0, ""
        if came and raise_pending:
            raise Stopped(came)
        return came
