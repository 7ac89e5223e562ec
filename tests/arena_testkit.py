"""A stand-in for `rollplex.memory.vmm.VmmArena` on host (or any device) memory, for tests without VMM: released
pages come back full of 0xFF bytes (NaN in every float dtype), as fresh pages may hold anything."""

from __future__ import annotations

import math

import torch

from rollplex.memory.vmm import RegionState


class PoisoningArena:
    def __init__(self, device: torch.device | str = "cpu", num_bytes: int = 1 << 40) -> None:
        self.device, self.bytes, self.states, self.calls = device, {}, {}, []
        self.num_bytes = num_bytes  # the arena's size, as `VmmArena.num_bytes`

    def allocate(self, num_bytes: int, name: str) -> str:
        self.bytes[name] = torch.full((num_bytes,), 0xFF, dtype=torch.uint8, device=self.device)
        self.states[name] = RegionState.MAPPED
        self.calls.append(("allocate", name))
        return name

    def tensor(self, region: str, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return self.bytes[region][: math.prod(shape) * dtype.itemsize].view(dtype).view(shape)

    def state(self, region: str) -> RegionState:
        return self.states[region]

    def release(self, region: str) -> None:
        self.bytes[region].fill_(0xFF)
        self.states[region] = RegionState.RELEASED
        self.calls.append(("release", region))

    def map(self, region: str) -> None:
        self.states[region] = RegionState.MAPPED
        self.calls.append(("map", region))

    def evict(self, region: str, into: torch.Tensor) -> None:
        into.view(torch.uint8).view(-1).copy_(self.bytes[region][: into.numel() * into.element_size()])
        self.release(region)

    def restore(self, region: str, contents: torch.Tensor | None = None) -> None:
        self.map(region)
        if contents is not None:
            flat = contents.reshape(-1).view(torch.uint8)
            self.bytes[region][: flat.numel()].copy_(flat)

    def free(self, region: str) -> None:
        del self.bytes[region], self.states[region]
        self.calls.append(("free", region))
