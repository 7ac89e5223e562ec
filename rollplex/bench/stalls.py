"""Host stalls inside a step that no op's kernels explain: Python's garbage collector, and the CUDA caching
allocator's retries (a cudaMalloc that fails makes it free its cached blocks, which synchronises the device,
and try again). Also counted: cudaMalloc calls, which are expected at every phase switch (the runtime empties
the cache there, runtime.py) and stand out only when a step makes many more than its neighbours.

Also the step's compiles (`executors.compiles`): Triton kernel variants and torch.compile graphs.

`rollplex bench` keeps them per step in its JSON (`per_step.stalls`) and names the garbage collector (from 50 ms),
any retries and any compiles in the step's progress line, so a step much slower than its neighbours says whether one
of them was the cause. Without CUDA the allocator counts stay 0.
"""

from __future__ import annotations

import gc
import time

import torch

from rollplex.executors.compiles import Compiles, compiled_so_far


class StepStalls:
    """Counts, between `__enter__` and `__exit__`: seconds in the garbage collector and its full (generation 2)
    collections; the allocator's retries and cudaMalloc calls on `device`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._counts_before = (0, 0)
        self.gc_s = 0.0
        self.full_collections = 0
        self.alloc_retries = 0
        self.device_allocs = 0
        self.compiles = Compiles()
        self._compiled_before = Compiles()
        self._gc_began: float | None = None

    def __enter__(self) -> StepStalls:
        self._counts_before, self._compiled_before = self._allocator_counts(), compiled_so_far()
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)
        (retries, allocs), (retries_before, allocs_before) = self._allocator_counts(), self._counts_before
        self.alloc_retries, self.device_allocs = retries - retries_before, allocs - allocs_before
        self.compiles = compiled_so_far().since(self._compiled_before)

    def as_dict(self) -> dict:
        return {"gc_s": round(self.gc_s, 4), "full_collections": self.full_collections,
                "alloc_retries": self.alloc_retries, "device_allocs": self.device_allocs,
                "triton_compiles": self.compiles.triton, "torch_compiles": self.compiles.torch}  # fmt: skip

    def describe(self) -> str:
        """What stalled the step, for its progress line: '' when nothing worth a mention (< 50 ms of gc)."""
        parts = [f"gc {self.gc_s:.2f} s ({self.full_collections} full)"] if self.gc_s >= 0.05 else []
        parts += [f"{self.alloc_retries} allocator retries"] if self.alloc_retries else []
        parts += [f"{self.compiles.total} compiles"] if self.compiles.total else []
        return ", ".join(parts)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_began = time.perf_counter()
        elif self._gc_began is not None:
            self.gc_s += time.perf_counter() - self._gc_began
            self.full_collections += int(info.get("generation") == 2)
            self._gc_began = None

    def _allocator_counts(self) -> tuple[int, int]:
        if self.device.type != "cuda":
            return 0, 0
        stats = torch.cuda.memory_stats(self.device)
        return stats.get("num_alloc_retries", 0), stats.get("num_device_alloc", 0)
