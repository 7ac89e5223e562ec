"""Chunked jobs: generators that pause (`yield`) between chunks of their work and return a result, so that a
scheduler can interleave them with other work (rollout decode). `drain` runs one to its end; `each_inside`
wraps every chunk of one in a context (a grad mode, saved-tensor hooks), never held across a pause.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager
from typing import TypeVar

T = TypeVar("T")


def drain(chunks: Generator[None, None, T]) -> T:
    """Runs a chunked job to its end, chunk after chunk, and returns its result."""
    while True:
        try:
            next(chunks)
        except StopIteration as done:
            return done.value


def each_inside(
    context: Callable[[], AbstractContextManager], chunks: Generator[None, None, T]
) -> Generator[None, None, T]:
    """A chunked job whose every chunk runs inside context() (entered and left around the chunk, never held
    across a pause: another job may run in between)."""
    while True:
        with context():
            try:
                next(chunks)
            except StopIteration as done:
                return done.value
        yield
