"""Saved-tensor offload and recompute: two context managers around a training forward.

What it is: the two ways the training prefix gives back the device memory its autograd graph would hold
between Phase 1 and Phase 2. `SavedTensorOffload` copies every tensor autograd saves into a host pool
(`torch.autograd.graph.saved_tensors_hooks`) and copies it back when backward asks; `recompute` runs the
given modules under `torch.utils.checkpoint` so backward recomputes their activations. Neither changes a
gradient: the copies are exact and the recomputation replays the same ops. What it is not: a policy — which
module is offloaded or recomputed is the plan's decision.

The boundary KV stays attached either way: offload moves the bytes of a saved tensor, never the graph.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.utils.checkpoint

from rollplex.memory.host_pool import Block, HostPool, copy_on


@dataclass(frozen=True, slots=True)
class OffloadStats:
    num_tensors: int  # saved tensors copied into the pool
    num_bytes: int
    num_kept: int  # saved tensors left where they were: resident, small, or no room in the pool
    num_bytes_kept: int


class _Saved:
    """A saved tensor that lives in the pool: its host copy, device, and the events that order its bytes."""

    __slots__ = ("__weakref__", "device", "events", "host", "unpacked")

    def __init__(self, host: torch.Tensor, device: torch.device, events: list) -> None:
        self.host, self.device, self.events = host, device, events
        self.unpacked: torch.Tensor | None = None


def _free_after(pool: HostPool, block: Block, events: list) -> None:
    pool.free(block, after=events[-1] if events else None)


def _storage_ptr(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class SavedTensorOffload:
    """Offloads the tensors autograd saves inside the context to `pool`; backward brings them back.

    A saved tensor:

        DEVICE --pack (forward)--> HOST (pool block; on CUDA the copy runs on a side stream)
        HOST --unpack (backward)--> DEVICE (a fresh contiguous tensor, same values, kept by the handle)
        --autograd drops the saved handle--> device copy dropped, block FREE (once the copies are done)

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
        self._counts = [0, 0, 0, 0]  # offloaded tensors, bytes; kept tensors, bytes
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._seen: dict[int, tuple[weakref.ref, tuple[int, int], weakref.ref]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self) -> SavedTensorOffload:
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
            return seen[2]()  # saved again (q, k, v of one input; a rotary table in every layer): one copy
        num_bytes = tensor.numel() * tensor.element_size()
        if not self._offloadable(tensor, num_bytes):
            self._counts[2] += 1
            self._counts[3] += num_bytes
            return tensor
        block, host = self.pool.allocate_like(tensor, f"saved {tuple(tensor.shape)} {tensor.dtype}")
        events = list(_copy_out(self._stream(tensor.device), host, tensor))
        saved = _Saved(host, tensor.device, events)
        weakref.finalize(saved, _free_after, self.pool, block, events)
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

    @staticmethod
    def _unpack(saved: torch.Tensor | _Saved) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        if saved.unpacked is not None:
            return saved.unpacked
        out = saved.unpacked = torch.empty(saved.host.shape, dtype=saved.host.dtype, device=saved.device)
        if saved.device.type != "cuda":
            return out.copy_(saved.host)
        current = torch.cuda.current_stream(saved.device)
        for event in saved.events[-1:]:
            current.wait_event(event)
        out.copy_(saved.host, non_blocking=True)
        saved.events.append(current.record_event())
        return out


def _copy_out(stream: torch.cuda.Stream | None, host: torch.Tensor, tensor: torch.Tensor) -> tuple:
    """Copy `tensor` into `host`; on CUDA on `stream`, after the work that made it, keeping its memory
    from reuse until the copy is done. Returns the copy's event (none on CPU)."""
    if stream is None:
        host.copy_(tensor)
        return ()
    made = torch.cuda.current_stream(tensor.device).record_event()
    tensor.record_stream(stream)
    return (copy_on(stream, host, tensor, after=(made,)),)


@contextmanager
def recompute(modules: Iterable[torch.nn.Module]) -> Iterator[int]:
    """Inside the context each module's forward runs under non-reentrant `torch.utils.checkpoint`: it saves
    only its inputs, and backward reruns it (same ops, same RNG state) to get its activations. Yields the
    number of modules wrapped; on exit every module has its own forward again.

    Under saved-tensor hooks (an enclosing `SavedTensorOffload`), torch hands a checkpointed region its
    inputs back as distinct tensors, so a module that branches on input identity (`nn.MultiheadAttention`
    tests `query is key`) recomputes different ops and checkpoint refuses it: recompute such modules
    outside offload, or their parents.
    """
    patched: list[tuple[torch.nn.Module, object]] = []
    try:
        for module in modules:
            patched.append((module, module.__dict__.get("forward")))
            module.forward = _checkpointed(module.forward)
        yield len(patched)
    finally:
        for module, own in patched:
            if own is None:
                del module.forward
            else:
                module.forward = own


def _checkpointed(forward):
    def run(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
