"""The residency manager: carries out the plan's residency transitions at step barriers.

What it is: the runtime side of `ResidencyPlan`. Every object that is in HBM in some step owns one device
region (addresses fixed for the whole run) and, if it ever waits in the host pool, one host block.
`enter(step)` moves each object from where it is to where the plan puts it in `step`: frees first (evict,
page out, drop, release), then takes (restore, map), so a barrier never holds more than the larger of the
two steps. It refuses to unmap or remap a region that registered readers may still be reading.
What it is not: an allocator (the plan fixed every size) or a scheduler (the caller says when a step begins).

Backends (`backends.py`): `CpuBackend` (CPU tensors stand for device pages; CI and tests) and `VmmBackend`
(`VmmArena` + `HostPool`; GPU, CUDA modules imported on first use).
"""

from __future__ import annotations

import difflib
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING, Protocol

import torch

from rollplex.graph.ir import Phase, Step, TensorClass
from rollplex.memory.objects import MemObject, Residency
from rollplex.memory.residency import ResidencyPlan

if TYPE_CHECKING:
    pass

VMM_PAGE = 2 * 2**20  # the arena's granularity on the H200


class MappingInUse(RuntimeError):
    """A transition would change a mapping that registered readers may still be reading."""


class Event(Protocol):
    """What a reader hands over: a `torch.cuda.Event`, or any object with these two methods."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class Backend(Protocol):
    """Device regions and host blocks, by object name. `reserve` fixes a region's addresses (no pages)."""

    def reserve(self, name: str, num_bytes: int) -> None: ...
    def allocate_host(self, name: str, num_bytes: int) -> None: ...
    def map(self, name: str) -> None: ...  # fresh pages, contents undefined
    def restore(self, name: str) -> None: ...  # fresh pages, the host block's bytes copied in
    def evict(self, name: str) -> None: ...  # bytes copied into the host block, then pages released
    def release(self, name: str) -> None: ...  # pages released, addresses kept
    def tensor(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor: ...
    def host_tensor(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor: ...
    def record_event(self) -> Event: ...  # completes when the current stream's queued work has
    def synchronize(self) -> None: ...
    def close(self) -> None: ...


class Move(Enum):
    EVICT = "evict"  # HBM -> HOST: copy out, release the pages, keep the addresses
    PAGE_OUT = "page out"  # HBM -> HOST of frozen weights: the host block already holds them, no copy
    DROP = "drop"  # HBM -> DROPPED: release without copy; the producer rebuilds it
    RELEASE = "release"  # HBM -> ABSENT
    RESTORE = "restore"  # HOST -> HBM: fresh pages, the host copy copied back
    MAP = "map"  # DROPPED / ABSENT -> HBM: fresh pages, no contents

    @property
    def frees(self) -> bool:
        return self in (Move.EVICT, Move.PAGE_OUT, Move.DROP, Move.RELEASE)


@dataclass(frozen=True, slots=True)
class Transition:
    name: str
    move: Move
    to: Residency
    num_bytes: int


@dataclass(frozen=True, slots=True)
class StepStats:
    """One step's barriers, summed over every `enter` of that step."""

    step: int
    phase: Phase
    num_entries: int = 0
    num_transitions: int = 0
    bytes_to_device: int = 0
    bytes_to_host: int = 0
    seconds: float = 0.0

    def plus(self, moves: Sequence[Transition], seconds: float) -> StepStats:
        return replace(
            self,
            num_entries=self.num_entries + 1,
            num_transitions=self.num_transitions + len(moves),
            bytes_to_device=self.bytes_to_device + sum(t.num_bytes for t in moves if t.move is Move.RESTORE),
            bytes_to_host=self.bytes_to_host + sum(t.num_bytes for t in moves if t.move is Move.EVICT),
            seconds=self.seconds + seconds,
        )


@dataclass(frozen=True, slots=True)
class ManagerStats:
    steps: tuple[StepStats, ...]  # indexed by step

    @property
    def bytes_to_device(self) -> int:
        return sum(s.bytes_to_device for s in self.steps)

    @property
    def bytes_to_host(self) -> int:
        return sum(s.bytes_to_host for s in self.steps)

    @property
    def seconds(self) -> float:
        return sum(s.seconds for s in self.steps)

    def phase_seconds(self) -> dict[Phase, float]:
        out: dict[Phase, float] = {}
        for s in self.steps:
            out[s.phase] = out.get(s.phase, 0.0) + s.seconds
        return out


def object_name(o: MemObject) -> str:
    """The name reports print, e.g. 'reference vision weights (BF16)', 'runtime reserve'."""
    role = "" if o.component.startswith(o.role) else f"{o.role} "
    return f"{role}{'vision ' if o.vision else ''}{o.component}"


def is_frozen(o: MemObject) -> bool:
    """Frozen weights: their home is the host pool and HBM only ever reads them."""
    return o.cls is TensorClass.REGENERABLE and o.outside is Residency.HOST


def visits_host(o: MemObject, num_steps: int) -> bool:
    return any(o.residency(s) is Residency.HOST for s in range(num_steps))


def managed_objects(plan: ResidencyPlan, exclude: frozenset[str] = frozenset()) -> dict[str, MemObject]:
    """The plan's objects that are in HBM in some step, by name, less those in `exclude`."""
    objects = [o for o in plan.objects if o.live and object_name(o) not in exclude]
    named = {object_name(o): o for o in objects}
    assert len(named) == len(objects), "object names are unique within a plan"
    return named


def choose_move(now: Residency, then: Residency, frozen: bool) -> Move | None:
    """The device-side action from `now` to `then`; None when the pages stay as they are."""
    if (now is Residency.HBM) == (then is Residency.HBM):
        return None
    if then is Residency.HBM:
        return Move.RESTORE if now is Residency.HOST else Move.MAP
    if then is Residency.HOST:
        return Move.PAGE_OUT if frozen else Move.EVICT
    return Move.DROP if then is Residency.DROPPED else Move.RELEASE


class ResidencyManager:
    """Owns a region (and maybe a host block) per managed object and moves them at step barriers.

    One object (the region's addresses never change; `tensor()` views stay valid across every move):

        ABSENT ──map──> HBM ──evict (copy out) / page out──> HOST ──restore (copy in)──> HBM
                        │ │                                                      ^
                        │ └──drop──> DROPPED ──map (fresh pages)─────────────────┘
                        └──release──> ABSENT

    Frozen weights that visit the host pool start in HOST: fill `host_tensor(name, ...)` before the first
    `enter`. Every other object starts ABSENT. `enter` accepts any step, so iteration i+1's step 0 follows
    iteration i's last step. It ends with the device synchronized: the step's contents are in place.
    """

    def __init__(
        self, plan: ResidencyPlan, steps: Sequence[Step], backend: Backend, *, exclude: frozenset[str] = frozenset()
    ) -> None:
        if len(steps) != len(plan.step_bytes):
            raise ValueError(f"{len(steps)} steps given for a plan of {len(plan.step_bytes)}; pass steps(plan.graph)")
        self._plan, self._steps, self._backend = plan, tuple(steps), backend
        self._objects = managed_objects(plan, exclude)
        self._now: dict[str, Residency] = {}
        self._readers: dict[str, list[Event]] = {name: [] for name in self._objects}
        self._stats = tuple(StepStats(s.index, s.phase) for s in self._steps)
        for name, o in self._objects.items():
            backend.reserve(name, o.bytes)
            on_host = visits_host(o, len(steps))
            if on_host:
                backend.allocate_host(name, o.bytes)
            self._now[name] = Residency.HOST if on_host and is_frozen(o) else Residency.ABSENT

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._objects)

    @property
    def stats(self) -> ManagerStats:
        return ManagerStats(self._stats)

    def residency(self, name: str) -> Residency:
        self._object(name)
        return self._now[name]

    def tensor(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The object's region as a tensor; same address in every step, readable only while in HBM."""
        self._object(name)
        return self._backend.tensor(name, dtype, shape)

    def host_tensor(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        o = self._object(name)
        if not visits_host(o, len(self._steps)):
            raise ValueError(f"{name!r} never waits in the host pool in this plan, so it has no host block")
        return self._backend.host_tensor(name, dtype, shape)

    def transitions(self, step: int) -> tuple[Transition, ...]:
        """The query: what `enter(step)` would do from the current residencies, frees first."""
        if not 0 <= step < len(self._steps):
            raise ValueError(f"step {step} is not in the plan: steps are 0..{len(self._steps) - 1}")
        moves = []
        for name, o in self._objects.items():
            then = o.residency(step)
            move = choose_move(self._now[name], then, is_frozen(o))
            if move is not None:
                moves.append(Transition(name, move, then, o.bytes))
        return tuple(sorted(moves, key=lambda t: not t.move.frees))

    def enter(self, step: int, *, wait: bool = False) -> tuple[Transition, ...]:
        """The commit: every transition into `step`. With readers in flight on a region it would change,
        raises `MappingInUse` and changes nothing, unless `wait`, which synchronizes them first."""
        moves = self.transitions(step)
        start = time.perf_counter()
        for event in self._in_flight(step, moves, wait):
            event.synchronize()
        for t in moves:
            self._apply(t)
        self._backend.synchronize()
        self._now = {name: o.residency(step) for name, o in self._objects.items()}
        self._stats = tuple(s.plus(moves, time.perf_counter() - start) if s.step == step else s for s in self._stats)
        return moves

    def reading(self, name: str, event: Event) -> None:
        """Register work that reads (or writes) the object's pages until `event` completes."""
        self._object(name)
        if self._now[name] is not Residency.HBM:
            raise ValueError(f"{name!r} is {self._now[name].name}, not in HBM: its pages cannot be read now")
        self._readers[name] = [e for e in self._readers[name] if not e.query()] + [event]

    @contextmanager
    def reader(self, name: str) -> Iterator[None]:
        """`with manager.reader(name): launch(...)` registers an event recorded on the current stream at exit."""
        self._object(name)
        yield
        self.reading(name, self._backend.record_event())

    def close(self) -> None:
        self._backend.close()

    def _in_flight(self, step: int, moves: Sequence[Transition], wait: bool) -> list[Event]:
        busy = {t: [e for e in self._readers[t.name] if not e.query()] for t in moves}
        busy = {t: events for t, events in busy.items() if events}
        if busy and not wait:
            what = "; ".join(f"{t.move.value} {t.name!r} ({len(e)} reader(s) in flight)" for t, e in busy.items())
            raise MappingInUse(
                f"cannot enter step {step} ({self._steps[step].phase.title}): {what}; "
                f"let the readers finish or call enter({step}, wait=True)"
            )
        return [e for events in busy.values() for e in events]

    def _apply(self, t: Transition) -> None:
        b = self._backend
        act = {Move.EVICT: b.evict, Move.RESTORE: b.restore, Move.MAP: b.map}.get(t.move, b.release)
        act(t.name)
        self._now[t.name] = t.to  # kept exact if a later transition of this barrier fails
        self._readers[t.name].clear()

    def _object(self, name: str) -> MemObject:
        if name in self._objects:
            return self._objects[name]
        if any(object_name(o) == name for o in self._plan.objects):
            raise ValueError(f"{name!r} is in the plan but never in HBM (or excluded), so the manager has no region")
        close = difflib.get_close_matches(name, self._objects, n=3)
        hint = f"did you mean {', '.join(map(repr, close))}?" if close else f"known: {', '.join(self._objects)}"
        raise ValueError(f"no object named {name!r} in this plan; {hint}")
