"""Backends of the residency manager: where an object's device pages and host copy actually live.

`CpuBackend`: CPU tensors stand for device pages (for CI and tests). `VmmBackend`: `VmmArena` regions and
`HostPool` blocks on the GPU, its CUDA modules imported on first use. Both follow `manager.Backend`.
"""

from __future__ import annotations

from math import prod
from typing import TYPE_CHECKING

import torch

from rollplex.memory.host_pool import ALIGNMENT, Block, HostPool
from rollplex.memory.manager import managed_objects, visits_host
from rollplex.memory.residency import ResidencyPlan

if TYPE_CHECKING:
    from rollplex.memory.manager import Event
    from rollplex.memory.vmm import Region, VmmArena

VMM_PAGE = 2 * 2**20  # the arena's granularity on the H200


def _view(flat: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    num_bytes = prod(shape) * dtype.itemsize
    if num_bytes > flat.numel():
        raise ValueError(f"{shape} {dtype} needs {num_bytes} bytes; {name!r} has {flat.numel()}")
    return flat[:num_bytes].view(dtype).view(shape)


class _Done:
    """A CPU 'event': CPU work is finished when it returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CpuBackend:
    """CPU tensors stand for device pages (for CI and tests); it counts mapped bytes and their peak.

    A region: RESERVED ──map / restore──> MAPPED ──release / evict──> RELEASED ──map / restore──> MAPPED.
    Pages that are not mapped hold `POISON` bytes, so a read of a dropped or freshly mapped region shows.
    """

    POISON = 0xA5

    def __init__(self) -> None:
        self._device: dict[str, torch.Tensor] = {}  # [num_bytes] uint8 per region
        self._host: dict[str, torch.Tensor] = {}
        self._mapped: set[str] = set()
        self.mapped_bytes = 0
        self.peak_bytes = 0

    def reset_peak(self) -> None:
        self.peak_bytes = self.mapped_bytes

    def is_mapped(self, name: str) -> bool:
        return name in self._mapped

    def reserve(self, name: str, num_bytes: int) -> None:
        self._device[name] = torch.full((num_bytes,), self.POISON, dtype=torch.uint8)

    def allocate_host(self, name: str, num_bytes: int) -> None:
        self._host[name] = torch.zeros(num_bytes, dtype=torch.uint8)

    def map(self, name: str) -> None:
        assert name not in self._mapped, f"{name!r} is mapped already"
        self._mapped.add(name)
        self.mapped_bytes += self._device[name].numel()
        self.peak_bytes = max(self.peak_bytes, self.mapped_bytes)

    def restore(self, name: str) -> None:
        self.map(name)
        self._device[name].copy_(self._host[name])

    def evict(self, name: str) -> None:
        self._host[name].copy_(self._device[name])
        self.release(name)

    def release(self, name: str) -> None:
        assert name in self._mapped, f"{name!r} is not mapped"
        self._mapped.remove(name)
        self._device[name].fill_(self.POISON)
        self.mapped_bytes -= self._device[name].numel()

    def tensor(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return _view(self._device[name], name, dtype, shape)

    def host_tensor(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return _view(self._host[name], name, dtype, shape)

    def record_event(self) -> Event:
        return _Done()

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        self._device.clear()
        self._host.clear()
        self._mapped.clear()


class VmmBackend:
    """`VmmArena` regions for device pages, `HostPool` blocks for host copies (GPU). Copies run on the
    current stream; the arena synchronizes the device before it releases pages."""

    def __init__(self, arena: VmmArena, pool: HostPool) -> None:
        self.arena, self.pool = arena, pool
        self._regions: dict[str, Region] = {}
        self._blocks: dict[str, Block] = {}

    def reserve(self, name: str, num_bytes: int) -> None:
        self._regions[name] = self.arena.reserve(max(num_bytes, 1), name)

    def allocate_host(self, name: str, num_bytes: int) -> None:
        self._blocks[name] = self.pool.allocate(num_bytes, name)

    def map(self, name: str) -> None:
        self.arena.map(self._regions[name])

    def restore(self, name: str) -> None:
        self.arena.restore(self._regions[name], contents=self._host_bytes(name))

    def evict(self, name: str) -> None:
        self.arena.evict(self._regions[name], into=self._host_bytes(name))

    def release(self, name: str) -> None:
        self.arena.release(self._regions[name])

    def tensor(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return self.arena.tensor(self._regions[name], dtype, shape)

    def host_tensor(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return self.pool.view(self._blocks[name], dtype, shape)

    def record_event(self) -> Event:
        event = torch.cuda.Event()
        event.record()
        return event

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.arena.device)

    def close(self) -> None:
        self.arena.close()
        self.pool.close()

    def _host_bytes(self, name: str) -> torch.Tensor:
        block = self._blocks[name]
        return self.pool.view(block, torch.uint8, (block.num_bytes,))


def vmm_backend(
    plan: ResidencyPlan, device: int = 0, *, exclude: frozenset[str] = frozenset(), pin: bool = True
) -> VmmBackend:
    """An arena and a pinned host pool sized for the plan's managed objects."""
    from rollplex.memory.vmm import VmmArena

    objects = managed_objects(plan, exclude).values()
    device_bytes = sum(-(-max(o.bytes, 1) // VMM_PAGE) * VMM_PAGE for o in objects)
    hosted = [o for o in objects if visits_host(o, len(plan.step_bytes))]
    host_bytes = sum(max(ALIGNMENT, -(-o.bytes // ALIGNMENT) * ALIGNMENT) for o in hosted) + ALIGNMENT
    return VmmBackend(VmmArena(device_bytes, device), HostPool(host_bytes, pin=pin))
