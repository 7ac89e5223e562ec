"""VMM arena: device memory whose physical pages come and go while its addresses stay (CUDA VMM).

What it is: one virtual address range reserved once per device, carved into named regions; each region is
backed by one physical allocation (a multiple of the 2 MiB granularity) that can be released and mapped
again at the same address, so torch tensors, kernels and captured CUDA graphs that point into it stay
valid across a residency change. Regions export POSIX file descriptors, which another process imports to
map the same pages (see `ipc.py`). What it is not: an allocator for many small tensors (a region is
2 MiB-granular) or a cache: every map and release is an explicit residency decision of the plan.

GPU only: `cuda.bindings.driver` and `cupy` are imported on first use, never at import time. The calls
used are the ones verified on the H200 (DESIGN.md §6).
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from enum import Enum
from math import prod

import torch

from rollplex.memory.host_pool import Block, FirstFit


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


class RegionState(Enum):
    RESERVED = "reserved"  # addresses only
    MAPPED = "mapped"  # physical pages behind the addresses
    RELEASED = "released"  # pages freed, addresses kept


@dataclass(frozen=True, slots=True)
class Region:
    name: str
    address: int
    num_bytes: int  # mapped size: the request rounded up to the granularity


def _driver():
    from cuda.bindings import driver

    return driver


def _call(what: str, result: tuple):
    """Unwrap a cuda-bindings result tuple `(error, *values)`, raising CudaDriverError on failure."""
    drv = _driver()
    error, *values = result
    if error != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(error)
        raise CudaDriverError(f"{what} failed: {name.decode() if name else int(error)}")
    return values[0] if len(values) == 1 else None


def _allocation_prop(device: int):
    drv = _driver()
    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def _posix_fd():
    return _driver().CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


class _DriverState:
    """What the driver holds for one arena: the reservation, physical handles and mappings, by region
    name. `free_all` undoes all of it, whatever half-done state an error or Ctrl-C left; it is what
    `close()` and the arena's finalizer call, and it never raises."""

    def __init__(self, device: int) -> None:
        self.device = device
        self.base, self.size = 0, 0
        self.handles: dict[str, int] = {}
        self.mappings: dict[str, tuple[int, int]] = {}

    def undo(self, name: str) -> None:
        """Unmap and release whatever part of region `name` an interrupted map or attach left behind."""
        if name in self.mappings:
            self.unmap(name)
        if name in self.handles:
            self.release_handle(name)

    def unmap(self, name: str) -> None:
        address, size = self.mappings.pop(name)
        _call("cuMemUnmap", _driver().cuMemUnmap(address, size))

    def release_handle(self, name: str) -> None:
        _call("cuMemRelease", _driver().cuMemRelease(self.handles.pop(name)))

    def free_all(self) -> None:
        drv = _driver()
        drv.cuCtxSynchronize()
        for address, size in self.mappings.values():
            drv.cuMemUnmap(address, size)
        for handle in self.handles.values():
            drv.cuMemRelease(handle)
        if self.size:
            drv.cuMemAddressFree(self.base, self.size)
        self.mappings, self.handles, self.size = {}, {}, 0


class VmmArena:
    """One reserved virtual range on a device, carved into named regions with releasable pages.

    The arena:

        OPEN (range reserved) --close() / exit / garbage collection--> CLOSED (no mapping, handle or range left)

    A region:

        reserve ─> RESERVED ─map─> MAPPED ─release─> RELEASED ─restore (fresh pages, contents copied back)─┐
                                     ^                                                                    │
                                     └────────────────────────────────────────────────────────────────────┘
        attach (imported handle) ─> MAPPED (shared pages)      free: any state ─> gone, addresses reusable

    Tensors made by `tensor()` keep their address and strides through release and restore; touching one
    while its region is RELEASED is an illegal-address error, and every tensor dies with `close()`.
    `release` and `close` synchronise the device first: no queued kernel may touch pages being unmapped.
    """

    def __init__(self, num_bytes: int, device: int = 0) -> None:
        torch.empty(1, device=f"cuda:{device}")  # the device's primary context exists and is initialised
        self.device = device
        self._driver = _DriverState(device)
        self._finalizer = weakref.finalize(self, self._driver.free_all)
        with torch.cuda.device(device):
            option = _driver().CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            self.granularity = _call(
                "cuMemGetAllocationGranularity",
                _driver().cuMemGetAllocationGranularity(_allocation_prop(device), option),
            )
            size = -(-num_bytes // self.granularity) * self.granularity
            reserved = _call("cuMemAddressReserve", _driver().cuMemAddressReserve(size, self.granularity, 0, 0))
            self._driver.base, self._driver.size = int(reserved), size
        self._placement = FirstFit(size, self.granularity)
        self._regions: dict[str, tuple[Region, Block]] = {}
        self._states: dict[str, RegionState] = {}
        self._imported: set[str] = set()

    def __enter__(self) -> VmmArena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Unmap every region, release every handle, free the range. Idempotent."""
        with torch.cuda.device(self.device):
            self._finalizer()
        self._regions.clear()
        self._states.clear()

    @property
    def num_bytes(self) -> int:
        return self._driver.size

    def state(self, region: Region) -> RegionState:
        return self._states[region.name]

    def reserve(self, num_bytes: int, name: str) -> Region:
        if name in self._regions:
            raise ValueError(f"region {name!r} already exists in this arena; free it first or pick another name")
        block = self._placement.allocate(num_bytes, name)
        size = -(-num_bytes // self.granularity) * self.granularity
        region = Region(name, self._driver.base + block.offset, size)
        self._regions[name] = (region, block)
        self._states[name] = RegionState.RESERVED
        return region

    def allocate(self, num_bytes: int, name: str) -> Region:
        """Reserve a region and back it with fresh pages (contents undefined)."""
        region = self.reserve(num_bytes, name)
        self.map(region)
        return region

    def map(self, region: Region) -> None:
        """RESERVED or RELEASED -> MAPPED: create fresh physical pages at the region's addresses."""
        self._expect(region, RegionState.RESERVED, RegionState.RELEASED)
        if region.name in self._imported:
            raise ValueError(f"region {region.name!r} was imported: attach a fresh handle instead of mapping")
        try:
            with torch.cuda.device(self.device):
                handle = _driver().cuMemCreate(region.num_bytes, _allocation_prop(self.device), 0)
                self._driver.handles[region.name] = int(_call("cuMemCreate", handle))
            self._map_handle(region)
        except BaseException:
            self._driver.undo(region.name)
            raise

    def release(self, region: Region) -> None:
        """MAPPED -> RELEASED: the pages go back to the driver, the addresses stay reserved."""
        self._expect(region, RegionState.MAPPED)
        torch.cuda.synchronize(self.device)
        self._driver.unmap(region.name)
        self._driver.release_handle(region.name)
        self._states[region.name] = RegionState.RELEASED

    def restore(self, region: Region, contents: torch.Tensor | None = None) -> None:
        """RELEASED -> MAPPED at the same addresses; if given, `contents` (host or device bytes, e.g. a
        host-pool view filled by `evict`) are copied back on the current stream."""
        self.map(region)
        if contents is not None:
            flat = contents.reshape(-1).view(torch.uint8)
            self.tensor(region, torch.uint8, (flat.numel(),)).copy_(flat, non_blocking=True)

    def evict(self, region: Region, into: torch.Tensor) -> None:
        """Copy the region's first `into.nbytes` bytes into `into` (say, a pinned host-pool view), then release."""
        flat = into.reshape(-1).view(torch.uint8)
        flat.copy_(self.tensor(region, torch.uint8, (flat.numel(),)), non_blocking=True)
        self.release(region)

    def free(self, region: Region) -> None:
        """Any state -> gone: pages released if mapped, addresses back to the arena for later regions."""
        if self._states[region.name] is RegionState.MAPPED:
            self.release(region)
        _, block = self._regions.pop(region.name)
        del self._states[region.name]
        self._imported.discard(region.name)
        self._placement.free(block)

    def tensor(self, region: Region, dtype: torch.dtype, shape: tuple[int, ...], offset: int = 0) -> torch.Tensor:
        """A contiguous torch tensor of `dtype` and `shape` over the region's bytes from `offset`."""
        num_bytes = prod(shape) * dtype.itemsize
        if offset % dtype.itemsize or offset + num_bytes > region.num_bytes:
            raise ValueError(
                f"{shape} {dtype} at offset {offset} does not fit region {region.name!r} of {region.num_bytes} bytes"
            )
        flat = _byte_tensor(region.address + offset, num_bytes, self.device)
        return flat.view(dtype).view(shape)

    def export(self, region: Region) -> int:
        """A POSIX file descriptor for the region's current pages; the caller closes it (after sending).
        A later release + restore makes new pages: export again to share them."""
        self._expect(region, RegionState.MAPPED)
        handle = self._driver.handles[region.name]
        return int(
            _call("cuMemExportToShareableHandle", _driver().cuMemExportToShareableHandle(handle, _posix_fd(), 0))
        )

    def attach(self, name: str, num_bytes: int, fd: int) -> Region:
        """Map pages exported by another process (`export`) into a new region. Consumes `fd`."""
        try:
            region = self.reserve(num_bytes, name)
        except BaseException:
            os.close(fd)
            raise
        try:
            with torch.cuda.device(self.device):
                handle = _driver().cuMemImportFromShareableHandle(fd, _posix_fd())
                self._driver.handles[name] = int(_call("cuMemImportFromShareableHandle", handle))
            self._imported.add(name)
            self._map_handle(region)
        except BaseException:
            self._driver.undo(name)
            self.free(region)
            raise
        finally:
            os.close(fd)
        return region

    def _map_handle(self, region: Region) -> None:
        drv = _driver()
        with torch.cuda.device(self.device):
            _call("cuMemMap", drv.cuMemMap(region.address, region.num_bytes, 0, self._driver.handles[region.name], 0))
            self._driver.mappings[region.name] = (region.address, region.num_bytes)
            access = drv.CUmemAccessDesc()
            access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = self.device
            access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            _call("cuMemSetAccess", drv.cuMemSetAccess(region.address, region.num_bytes, [access], 1))
        self._states[region.name] = RegionState.MAPPED

    def _expect(self, region: Region, *states: RegionState) -> None:
        state = self._states.get(region.name)
        if state not in states:
            wanted = " or ".join(s.name for s in states)
            raise ValueError(f"region {region.name!r} is {state.name if state else 'unknown'}, expected {wanted}")


def _byte_tensor(address: int, num_bytes: int, device: int) -> torch.Tensor:
    """A uint8 torch tensor over device memory the arena owns (CuPy `UnownedMemory` + DLPack)."""
    import cupy

    memory = cupy.cuda.UnownedMemory(address, num_bytes, None, device)
    array = cupy.ndarray((num_bytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
    return torch.from_dlpack(array)
