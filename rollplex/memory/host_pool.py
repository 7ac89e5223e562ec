"""Pinned host pool: one host buffer allocated once, sub-allocated first-fit, viewed as typed tensors.

What it is: the host side of residency — offloaded FP32 optimizer state, saved activations, evicted VMM
regions all live in one pool whose size the plan fixes (the pinned-host budget). What it is not: a caching
allocator. The pool never grows; a request that does not fit fails with `PoolExhausted`, which names the
request and the free bytes. `can_allocate` is the query, `allocate` the commit.

On a CUDA machine the buffer is page-locked, so copies between it and the device run asynchronously on a
stream (`copy_on`). On CPU it is plain memory and the same code runs without streams.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from math import prod

import torch

ALIGNMENT = 512  # bytes; a multiple of every dtype's size and of the DMA engines' preferred alignment


class PoolExhausted(MemoryError):
    """A host-pool request that does not fit in any free range."""


@dataclass(frozen=True, slots=True)
class Block:
    """A live placement in a pool: bytes [offset, offset + num_bytes) plus padding up to the alignment."""

    offset: int
    num_bytes: int
    name: str

    @property
    def end(self) -> int:
        return self.offset + self.num_bytes


def _round_up(num_bytes: int, alignment: int) -> int:
    return max(alignment, -(-num_bytes // alignment) * alignment)


class FirstFit:
    """First-fit placement over [0, capacity) with aligned offsets; pure Python, no memory of its own.

    A range of bytes:

        FREE --allocate--> LIVE --free--> FREE (merged with free neighbours)

    Invariants: free ranges are sorted, disjoint, never adjacent (coalesced), and with the live blocks
    they tile [0, capacity) exactly.
    """

    def __init__(self, capacity: int, alignment: int = ALIGNMENT) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment {alignment} must be a power of two")
        self.alignment = alignment
        self.capacity = capacity - capacity % alignment
        self._free: list[tuple[int, int]] = [(0, self.capacity)] if self.capacity else []
        self._live: dict[int, Block] = {}

    @property
    def num_free_bytes(self) -> int:
        return sum(size for _, size in self._free)

    @property
    def largest_free_bytes(self) -> int:
        return max((size for _, size in self._free), default=0)

    @property
    def live_blocks(self) -> tuple[Block, ...]:
        return tuple(sorted(self._live.values(), key=lambda b: b.offset))

    @property
    def free_ranges(self) -> tuple[tuple[int, int], ...]:
        return tuple(self._free)

    def can_allocate(self, num_bytes: int) -> bool:
        return self._first_fit(_round_up(num_bytes, self.alignment)) is not None

    def allocate(self, num_bytes: int, name: str) -> Block:
        size = _round_up(num_bytes, self.alignment)
        index = self._first_fit(size)
        if index is None:
            raise PoolExhausted(
                f"cannot place {name!r} ({num_bytes} bytes): {self.num_free_bytes} bytes free of "
                f"{self.capacity}, largest free range {self.largest_free_bytes} bytes; raise the pool size "
                "or free blocks first"
            )
        offset, free_size = self._free[index]
        if free_size == size:
            del self._free[index]
        else:
            self._free[index] = (offset + size, free_size - size)
        block = Block(offset, num_bytes, name)
        self._live[offset] = block
        return block

    def free(self, block: Block) -> None:
        if self._live.get(block.offset) != block:
            raise ValueError(f"block {block} is not live in this pool (freed twice, or from another pool)")
        del self._live[block.offset]
        self._insert_free(block.offset, _round_up(block.num_bytes, self.alignment))

    def _first_fit(self, size: int) -> int | None:
        return next((i for i, (_, free_size) in enumerate(self._free) if free_size >= size), None)

    def _insert_free(self, offset: int, size: int) -> None:
        index = next((i for i, (start, _) in enumerate(self._free) if start > offset), len(self._free))
        self._free.insert(index, (offset, size))
        if index + 1 < len(self._free) and offset + size == self._free[index + 1][0]:
            self._free[index] = (offset, size + self._free.pop(index + 1)[1])
        if index > 0 and sum(self._free[index - 1]) == offset:
            start, prev_size = self._free[index - 1]
            self._free[index - 1] = (start, prev_size + self._free.pop(index)[1])


def _pin(buffer: torch.Tensor) -> None:
    # cudaHostRegister rather than `pin_memory=True`: torch's caching host allocator rounds every pinned
    # request up to a power of two, which would pin 128 GiB for a 70 GiB pool.
    # The pages are faulted in first, by torch's threaded fill: registering then only locks them. Left to the
    # registration, one thread faults in every page (several times slower for a pool of tens of GiB).
    buffer.zero_()
    portable = 1  # cudaHostRegisterPortable: pinned for every device of the process
    error = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), portable)
    if int(error) != 0:
        raise RuntimeError(f"cudaHostRegister of {buffer.numel()} bytes failed with CUDA error {int(error)}")


def _unpin(buffer: torch.Tensor) -> None:
    torch.cuda.synchronize()  # no copy may still be queued on pages about to become pageable
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


class HostPool:
    """One host buffer of `num_bytes`, allocated (and pinned, if `pin`) once, handed out in aligned blocks.

    The pool:

        OPEN --close()--> CLOSED      (the buffer is unpinned and dropped; also at garbage collection)

    A block:

        FREE --allocate--> LIVE --free(block)--------------------------> FREE
                                \\--free(block, after=event)--> PENDING --event done--> FREE

    A deferred free (`after=`) lets a block go back while a copy out of it is still queued on a stream:
    it becomes placeable once the event has completed (`allocate` waits for pending events only when
    nothing else fits).
    """

    def __init__(
        self, num_bytes: int, *, pin: bool = False, alignment: int = ALIGNMENT, device: torch.device | None = None
    ) -> None:
        """`device`: where the buffer lives; the host by default, a GPU where the plan keeps the state in HBM
        (the same blocks and copies then stay on the device; nothing is pinned)."""
        if num_bytes <= 0:
            raise ValueError(f"a host pool needs a positive size, got num_bytes={num_bytes}")
        if pin and device is not None and torch.device(device).type != "cpu":
            raise ValueError(f"pin a host buffer only, not one on {device}")
        self._placement = FirstFit(num_bytes, alignment)
        self.buffer = torch.empty(self._placement.capacity, dtype=torch.uint8, device=device)  # [capacity] bytes
        self.pinned = pin
        self._pending: list[tuple[Block, torch.cuda.Event]] = []
        if pin:
            _pin(self.buffer)
        self._finalizer = weakref.finalize(self, _unpin if pin else _ignore, self.buffer)

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unpin and drop the buffer (views handed out keep their bytes alive, unpinned)."""
        self._finalizer()
        self.buffer = self.buffer[:0]

    @property
    def capacity(self) -> int:
        return self._placement.capacity

    @property
    def num_free_bytes(self) -> int:
        self._reap()
        return self._placement.num_free_bytes

    @property
    def live_blocks(self) -> tuple[Block, ...]:
        """Blocks not yet free: deferred frees whose event has completed are reaped first."""
        self._reap()
        return self._placement.live_blocks

    @property
    def placement(self) -> FirstFit:
        return self._placement

    def can_allocate(self, num_bytes: int) -> bool:
        self._reap()
        return self._placement.can_allocate(num_bytes)

    def allocate(self, num_bytes: int, name: str) -> Block:
        self._reap()
        if not self._placement.can_allocate(num_bytes) and self._pending:
            for _, event in self._pending:
                event.synchronize()
            self._reap()
        return self._placement.allocate(num_bytes, name)

    def free(self, block: Block, after: torch.cuda.Event | None = None) -> None:
        if after is None:
            self._placement.free(block)
        else:
            self._pending.append((block, after))

    def view(self, block: Block, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """The block's bytes as a contiguous tensor of `dtype` and `shape` (a view: no copy)."""
        num_bytes = prod(shape) * dtype.itemsize
        if num_bytes > block.num_bytes:
            raise ValueError(f"{shape} {dtype} needs {num_bytes} bytes; block {block.name!r} has {block.num_bytes}")
        return self.buffer[block.offset : block.offset + num_bytes].view(dtype).view(shape)

    def allocate_like(self, tensor: torch.Tensor, name: str) -> tuple[Block, torch.Tensor]:
        """A block holding a contiguous tensor of `tensor`'s shape and dtype, and that tensor."""
        block = self.allocate(tensor.numel() * tensor.element_size(), name)
        return block, self.view(block, tensor.dtype, tuple(tensor.shape))

    def _reap(self) -> None:
        done = [(block, event) for block, event in self._pending if event.query()]
        for block, event in done:
            self._pending.remove((block, event))
            self._placement.free(block)


def _ignore(buffer: torch.Tensor) -> None:
    del buffer


def aligned_total(sizes: Iterable[int]) -> int:
    """The bytes a pool needs for blocks of these sizes, each rounded up to ALIGNMENT."""
    return sum(-(-n // ALIGNMENT) * ALIGNMENT for n in sizes)


def on_stream(stream: torch.cuda.Stream | None):
    """A context that runs work on `stream`; none on CPU (stream None)."""
    return nullcontext() if stream is None else torch.cuda.stream(stream)


def tail_event(stream: torch.cuda.Stream | None) -> tuple[torch.cuda.Event, ...]:
    """An event at the tail of `stream`, to order later work after it (nothing on CPU)."""
    return () if stream is None else (stream.record_event(),)


def copy_on(
    stream: torch.cuda.Stream | None,
    dst: torch.Tensor,
    src: torch.Tensor,
    after: tuple[torch.cuda.Event, ...] = (),
) -> torch.cuda.Event | None:
    """Copy `src` into `dst` on `stream` once the events in `after` have completed; return an event that
    completes with the copy. With `stream=None` (CPU) the copy is immediate and no event is returned.

    The caller keeps both tensors alive until the returned event has completed.
    """
    if stream is None:
        dst.copy_(src)
        return None
    for event in after:
        stream.wait_event(event)
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    return done
