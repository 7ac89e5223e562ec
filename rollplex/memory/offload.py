"""Saved-tensor offload and recompute: two context managers around a training forward.

What it is: the two ways the training prefix gives back the device memory its autograd graph would hold
between Phase 1 and Phase 2. `SavedTensorOffload` copies every tensor autograd saves into a host pool
(`torch.autograd.graph.saved_tensors_hooks`) and copies it back for backward, the next one it will ask for
while it works on this one; `recompute` runs the
given modules under `torch.utils.checkpoint` so backward recomputes their activations. Neither changes a
gradient: the copies are exact and the recomputation replays the same ops. What it is not: a policy — which
module is offloaded or recomputed is the plan's decision.

The boundary KV stays attached either way: offload moves the bytes of a saved tensor, never the graph.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import torch
import torch.utils.checkpoint

from rollplex.memory.host_pool import Block, HostPool, copy_on

LOOKBACK = 16  # saved tensors before the one backward asks for that may be sent back ahead of it


@dataclass(frozen=True, slots=True)
class OffloadStats:
    num_tensors: int  # saved tensors copied into the pool
    num_bytes: int
    num_kept: int  # saved tensors left where they were: resident, small, or no room in the pool
    num_bytes_kept: int
    num_ahead: int = 0  # saved tensors already on their way back when backward asked for them


class _Saved:
    """A saved tensor that lives in the pool: its host copy, device, the events that order its bytes, and its
    place among the tensors offloaded (backward asks for them in about the reverse order)."""

    __slots__ = ("__weakref__", "device", "events", "host", "index", "served", "shared", "unpacked")

    def __init__(self, host: torch.Tensor, device: torch.device, events: list, index: int) -> None:
        self.host, self.device, self.events, self.index = host, device, events, index
        self.unpacked: torch.Tensor | None = None
        self.served: set = set()  # the streams that asked for it: each waited for the copy back, each marked a user
        self.shared = False  # saved again later: its place in the order says nothing of when backward asks


def _free_after(pool: HostPool, block: Block, events: list, alive: list[int], ahead: dict, index: int) -> None:
    pool.free(block, after=events[-1] if events else None)
    alive[0] -= 1
    ahead.pop(index, None)  # sent back, never asked for: its bytes are no longer on their way


def _storage_ptr(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class SavedTensorOffload:
    """Offloads the tensors autograd saves inside the context to `pool`; backward brings them back.

    A saved tensor:

        DEVICE --pack (forward)--> HOST (pool block; on CUDA the copy runs on a side stream)
        HOST --ahead (backward asked for the one saved after it)--> ON ITS WAY (side stream, a fresh tensor)
        HOST or ON ITS WAY --unpack (backward)--> DEVICE (each stream that asks waits for the copy once and is
            marked a user of the tensor; kept by the handle)
        --autograd drops the saved handle--> device copy dropped, block FREE (once the copies are done)

    Backward asks for saved tensors in about the reverse of their saving order (the last layer's first). So
    when it asks for one, the tensors saved just before it start back on the side stream, as many as fit in the
    bytes of the largest tensor saved (under a checkpointed prefix, a layer's input or the boundary norm's FP32
    input): their copies run under this one's backward instead of on the caller's stream, which waits for them
    only when it needs them. A guess that misses (backward asks in another order) costs only the copies: every
    tensor is brought back once, and one never asked for leaves the bytes ahead when its graph is dropped.

    The context:

        OPEN (hooks installed) --exit--> CLOSED (hooks removed; offloaded tensors wait in the pool for backward)

    Tensors whose storage is one of `keep` (the parameters: resident anyway), tensors under `min_bytes`,
    and tensors that do not fit in the pool stay where they are and are counted as kept. A tensor saved
    twice is copied once, and brought back once, also when the saves come in different entries of the context
    while the tensor lives.
    """

    def __init__(self, pool: HostPool, keep: Iterable[torch.Tensor] = (), min_bytes: int = 1024) -> None:
        self.pool = pool
        self.min_bytes = min_bytes
        self._keep = {_storage_ptr(t) for t in keep}
        self._counts = [0, 0, 0, 0, 0]  # offloaded tensors, bytes; kept tensors, bytes; brought back ahead
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._order: list[weakref.ref] = []  # the offloaded tensors in saving order (`_Saved.index`)
        self._alive = [0]  # how many of them live (a cell: their finalizers count down)
        self._ahead: dict[int, int] = {}  # index -> bytes of the tensors on their way back, not yet asked for
        self._largest = 0  # bytes of the largest tensor offloaded: how far ahead the copies back may run
        self._seen: dict[int, tuple[weakref.ref, tuple[int, int], weakref.ref]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> SavedTensorOffload:
        if not self._alive[0]:  # the last backward consumed them (or their graphs were dropped): start over
            self._order.clear()
            self._ahead.clear()
            self._largest = 0
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        # what is still alive stays deduplicated when the context is entered again: a prompt group's rotary
        # tables are saved by every checkpointed layer, one chunk (one entry of this context) per layer
        self._seen = {k: v for k, v in self._seen.items() if v[0]() is not None and v[2]() is not None}

    def stats(self) -> OffloadStats:
        return OffloadStats(*self._counts)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _Saved:
        seen = self._seen.get(id(tensor))
        same = seen is not None and seen[0]() is tensor and seen[1] == (tensor._version, tensor.data_ptr())
        if same and seen[2]() is not None:
            seen[2]().shared = True  # saved again (q, k, v of one input; a rotary table in every layer): one copy
            return seen[2]()
        num_bytes = tensor.numel() * tensor.element_size()
        if not self._offloadable(tensor, num_bytes):
            self._counts[2] += 1
            self._counts[3] += num_bytes
            return tensor
        block, host = self.pool.allocate_like(tensor, f"saved {tuple(tensor.shape)} {tensor.dtype}")
        events = list(_copy_out(self._stream(tensor.device), host, tensor))
        saved = _Saved(host, tensor.device, events, len(self._order))
        self._order.append(weakref.ref(saved))
        self._alive[0] += 1
        self._largest = max(self._largest, num_bytes)
        weakref.finalize(saved, _free_after, self.pool, block, events, self._alive, self._ahead, saved.index)
        # the version catches in-place writes, the address a `.data =` swap (which keeps the version)
        self._seen[id(tensor)] = (weakref.ref(tensor), (tensor._version, tensor.data_ptr()), weakref.ref(saved))
        self._counts[0] += 1
        self._counts[1] += num_bytes
        return saved

    def _offloadable(self, tensor: torch.Tensor, num_bytes: int) -> bool:
        return (
            tensor.layout == torch.strided
            and num_bytes >= self.min_bytes
            and _storage_ptr(tensor) not in self._keep
            and self.pool.can_allocate(num_bytes)
        )

    def _stream(self, device: torch.device) -> torch.cuda.Stream | None:
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _unpack(self, saved: torch.Tensor | _Saved) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        if self._ahead.pop(saved.index, None) is not None:
            self._counts[4] += 1
        elif saved.unpacked is None:
            self._bring_back(saved, torch.cuda.current_stream(saved.device) if saved.device.type == "cuda" else None)
        if saved.device.type == "cuda":
            current = torch.cuda.current_stream(saved.device)
            if current not in saved.served:  # the copy back ran on the side stream or another asker's
                current.wait_event(saved.events[-1])
                saved.unpacked.record_stream(current)
                saved.served.add(current)
        if not saved.shared:
            self._send_ahead(saved.index)
        return saved.unpacked

    def _send_ahead(self, index: int) -> None:
        """Starts back the tensors saved just before `index` (the LOOKBACK before it at most), while the bytes on
        their way stay within the largest tensor's (at least one goes). Not a tensor saved more than once (its
        place in the order is its first save's), and none where the device has no room for it."""
        for j in range(index - 1, max(index - 1 - LOOKBACK, -1), -1):
            saved = self._order[j]()
            if saved is None or saved.unpacked is not None or saved.shared:
                continue
            num_bytes = saved.host.numel() * saved.host.element_size()
            if self._ahead and sum(self._ahead.values()) + num_bytes > self._largest:
                return
            try:
                self._bring_back(saved, self._stream(saved.device))
            except torch.OutOfMemoryError:  # no room to guess: backward brings each back when it asks
                return
            self._ahead[j] = num_bytes

    @staticmethod
    def _bring_back(saved: _Saved, stream: torch.cuda.Stream | None) -> None:
        """A fresh device tensor with the saved values, copied on `stream` (the caller's or the side stream; on
        the CPU at once). The tensor is taken from the caller's stream's memory: a side-stream copy first waits
        for what that stream has queued (the memory may still be read there) and the tensor is marked used by
        the side stream (its memory is not reused before the copy ends, even if backward never asks for it)."""
        out = saved.unpacked = torch.empty(saved.host.shape, dtype=saved.host.dtype, device=saved.device)
        if stream is None:
            out.copy_(saved.host)
            return
        current = torch.cuda.current_stream(saved.device)
        if stream != current:
            stream.wait_stream(current)
            out.record_stream(stream)
        for event in saved.events[-1:]:  # its copy out has ended
            stream.wait_event(event)
        with torch.cuda.stream(stream):
            out.copy_(saved.host, non_blocking=True)
            saved.events.append(stream.record_event())


def _copy_out(stream: torch.cuda.Stream | None, host: torch.Tensor, tensor: torch.Tensor) -> tuple:
    """Copy `tensor` into `host`; on CUDA on `stream`, after the work that made it, keeping its memory
    from reuse until the copy is done. Returns the copy's event (none on CPU)."""
    if stream is None:
        host.copy_(tensor)
        return ()
    made = torch.cuda.current_stream(tensor.device).record_event()
    tensor.record_stream(stream)
    return (copy_on(stream, host, tensor, after=(made,)),)


def recompute(modules: Iterable[torch.nn.Module]) -> AbstractContextManager[int]:
    """Inside the context each module's forward runs under non-reentrant `torch.utils.checkpoint`: it saves
    only its inputs, and backward reruns it (same ops, same RNG state) to get its activations. Yields the
    number of modules wrapped; on exit every module has its own forward again.

    Under saved-tensor hooks (an enclosing `SavedTensorOffload`), torch hands a checkpointed region its
    inputs back as distinct tensors, so a module that branches on input identity (`nn.MultiheadAttention`
    tests `query is key`) recomputes different ops and checkpoint refuses it: recompute such modules
    outside offload, or their parents.
    """
    return recompute_methods((module, "forward") for module in modules)


@contextmanager
def recompute_methods(units: Iterable[tuple[torch.nn.Module, str]]) -> Iterator[int]:
    """`recompute` of each (module, method name): a method its module calls on itself (a part of its forward)
    saves only its inputs and reruns in backward; what the module computes between such calls keeps what it
    saves. Yields the number of methods wrapped; on exit every module has its own methods again."""
    patched: list[tuple[torch.nn.Module, str, object]] = []
    try:
        for module, name in units:
            patched.append((module, name, module.__dict__.get(name)))
            setattr(module, name, _checkpointed(getattr(module, name)))
        yield len(patched)
    finally:
        for module, name, own in reversed(patched):
            if own is None:
                delattr(module, name)
            else:
                setattr(module, name, own)


def _checkpointed(forward):
    def run(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
