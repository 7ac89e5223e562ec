"""A frozen model's weights resident on the device only in the steps that use them (the reference), as the plan
has them (`rollplex.graph.objects`: a frozen role's weights live in its steps, on the host otherwise).

All of the model's parameters move into one region of a VMM arena (`vmm.py`), in parameter order, each on an
ALIGN boundary; the parameters stay the same `nn.Parameter` objects, now viewing the region. `page_out`
releases the region's pages, first copying it to a host buffer (pinned on a GPU) unless that buffer already
holds what the parameters hold (copied at an earlier page-out, no parameter written since: torch's version
counters say so); `page_in` maps fresh pages at the same addresses and copies the contents back, so every view
(and anything captured against it) stays valid. A frozen model crosses the link once a window, inwards:

    RESIDENT --page_out--> ON HOST (pages released) --page_in--> RESIDENT

The arena may be anything with `allocate`, `tensor`, `evict`, `restore` and `state` (tests use host memory).
"""

from __future__ import annotations

import torch
from torch import nn

from rollplex.memory.host_pool import ALIGNMENT as HOST_ALIGNMENT
from rollplex.memory.host_pool import HostPool
from rollplex.memory.vmm import RegionState

ALIGN = 256


class WeightPager:
    def __init__(self, model: nn.Module, arena, name: str = "reference weights") -> None:
        params = list(model.parameters())
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += -(-p.numel() * p.element_size() // ALIGN) * ALIGN
        self.arena, self.num_bytes = arena, total
        self.region = arena.allocate(total, name)
        flat = arena.tensor(self.region, torch.uint8, (total,))
        with torch.no_grad():
            for p, offset in zip(params, offsets, strict=True):
                view = flat[offset : offset + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
                view.copy_(p)
                p.data = view
        on_gpu = flat.is_cuda
        # pinned exactly (`HostPool`): pin_memory=True would round 15.4 GiB of 7B weights up to 16 GiB
        self._pool = HostPool(-(-total // HOST_ALIGNMENT) * HOST_ALIGNMENT, pin=on_gpu)
        self.host = self._pool.view(self._pool.allocate(total, name), torch.uint8, (total,))
        self.params = params
        self._host_versions: tuple[int, ...] | None = None  # the parameters' versions when `host` was written

    @property
    def resident(self) -> bool:
        return self.arena.state(self.region) is RegionState.MAPPED

    def page_out(self) -> None:
        """Device -> host where the host copy is stale, then the pages go back to the driver (waits for queued
        work on them)."""
        if not self.resident:
            return
        versions = self._versions()
        if versions == self._host_versions:
            self.arena.release(self.region)
        else:
            self.arena.evict(self.region, self.host)
            self._host_versions = versions

    def _versions(self) -> tuple[int, ...]:
        return tuple(p._version for p in self.params)

    def page_in(self) -> None:
        """Fresh pages at the same addresses, contents copied back on the current stream. The caching
        allocator first gives back its unused blocks: the pages come from what the previous phase freed."""
        if not self.resident:
            if self.host.is_pinned():
                torch.cuda.empty_cache()
            self.arena.restore(self.region, self.host)
