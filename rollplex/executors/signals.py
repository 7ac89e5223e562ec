"""The signals that stop a run: Ctrl-C's SIGINT, and SIGTERM and SIGHUP (`kill`, `timeout`, a batch scheduler's
preemption, a closed terminal, torchrun stopping the other ranks when one fails). Each raises `Stopped` where the
process is, as Ctrl-C raises KeyboardInterrupt, so a run that receives any of them ends as after Ctrl-C: the last
completed step saved, one line said. `InterruptGate` holds them back while a step's update must finish first.

A signal the process was started ignoring stays ignored (`nohup` ignores SIGHUP; a shell's background job, SIGINT).
Handlers are the main thread's to set (Python's rule); elsewhere both are left as they are.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rollplex.errors import Stopped

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


def _install(handler: Callable) -> dict | None:
    """`handler` for every stop signal not ignored; the handlers it replaced (None off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    heeded = [s for s in STOP_SIGNALS if signal.getsignal(s) is not signal.SIG_IGN]
    return {s: signal.signal(s, handler) for s in heeded}


def _restore(previous: dict | None) -> None:
    for s, handler in (previous or {}).items():
        signal.signal(s, handler)


def _raise(signum, frame) -> None:
    raise Stopped(signal.Signals(signum))


@contextmanager
def stop_signals() -> Iterator[None]:
    """Every stop signal not ignored raises `Stopped` inside the block; the handlers before it come back after."""
    previous = _install(_raise)
    try:
        yield
    finally:
        _restore(previous)


class InterruptGate:
    """Holds the stop signals back from `hold()` to `release()`, then raises the first that came."""

    def __init__(self) -> None:
        self.pending: signal.Signals | None = None  # the first signal held back
        self.previous: dict | None = None  # the handlers `hold` replaced, while it holds
        self.why = ""  # said on stderr at the first signal held, if set

    def hold(self, why: str = "") -> None:
        self.why = why or self.why
        if self.previous is None:  # else held already
            self.previous = _install(self._note)

    def _note(self, signum, frame) -> None:
        if self.why and self.pending is None:
            print(f"rollplex: {self.why}", file=sys.stderr, flush=True)
        self.pending = self.pending or signal.Signals(signum)

    def release(self, raise_pending: bool = True) -> signal.Signals | None:
        """Lets the signals through again; the first that came meanwhile is raised now (`Stopped`), or, not
        `raise_pending`, returned (None: none came)."""
        _restore(self.previous)
        self.previous = None
        came, self.pending, self.why = self.pending, None, ""
        if came is not None and raise_pending:
            raise Stopped(came)
        return came


def stop_line(signum: signal.Signals, out_dir: Path, checkpoints: bool) -> str:
    """What a stopped run says: the signal, the step saved in `out_dir` and how to go on from it."""
    from rollplex.executors import checkpointing

    found = checkpointing.latest(out_dir) if checkpoints else None
    if found is not None:
        kept = f"step {checkpointing.step_of(found)} is saved in {found}: go on with --resume --out {out_dir}"
    else:
        kept = "no checkpoint (--no-checkpoints)" if not checkpoints else "no step completed: nothing saved"
    return f"interrupted ({signum.name}); {kept}"
