"""Measured per-phase device memory: what the GPU really holds in each phase of a step, for the plan's figures.

The plan counts every byte a phase holds on the GPU: the caching allocator's blocks, the VMM regions (rollout
KV, the paged reference, shared actor storage) and the runtime reserve. `torch.cuda.max_memory_allocated`
sees only the first, so the probe reads the driver instead: a thread samples `cudaMemGetInfo` (total - free:
every context, allocator, VMM mapping and library workspace of the device) every `interval_s`, and at each
op boundary, and keeps the maximum per phase. The phase is the one of the op that last started. Peaks
shorter than the interval between two samples can be missed; the allocator's blocks stay reserved after a
peak (the runtime empties the cache only where VMM pages must be mapped), so they are not.

Beside the driver's view, the caching allocator's own peaks per phase (`allocator_peaks`: bytes in live tensors
and bytes reserved, exact: torch's peak counters are reset at each phase change), so that a phase above its plan
can be read apart: live tensors the plan does not count (allocated), the allocator's slack (reserved less
allocated), or memory outside the allocator (driver less reserved: context, VMM regions, library workspaces).
The reset makes `torch.cuda.max_memory_allocated` a per-phase figure while the probe runs. Also per phase: the
allocator's retries (`allocator_retries`): a cudaMalloc that failed made it free its cached blocks, which waits for
the device, and try again; a phase near the GPU's capacity can lose seconds to them with no op to blame.

Not here: the plan (`rollplex.graph.plan`), what the probe is compared with (`bench.py`, `loop.py`).
Without CUDA the probe records nothing (`peaks()` and `allocator_peaks()` are empty).
"""

from __future__ import annotations

import threading

import torch

from rollplex.graph.ir import Op, Phase


class PhaseMemory:
    """Peak device bytes per phase over the ops it is told about (`before`/`after` hooks of `run_iteration`)."""

    def __init__(self, device: torch.device, interval_s: float = 0.002) -> None:
        self.device = device
        self.interval_s = interval_s
        self.phase: Phase | None = None
        self._peaks: dict[Phase, int] = {}
        self._allocator: dict[Phase, tuple[int, int]] = {}  # (allocated, reserved) peaks
        self._retries: dict[Phase, int] = {}
        self._retries_before = 0  # the allocator's count when the current phase began
        self._high_water = 0  # allocated bytes, max over every window between resets, phases or not
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if device.type == "cuda":
            if device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self._retries_before = _alloc_retries(self.device)
            self._thread = threading.Thread(target=self._sample_until_stopped, name="rollplex-memprobe", daemon=True)
            self._thread.start()

    def __enter__(self) -> PhaseMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self._end_allocator_phase()

    def before(self, o: Op) -> None:
        self._sample()
        if o.phase is not self.phase and self.device.type == "cuda":
            self._end_allocator_phase()
            torch.cuda.reset_peak_memory_stats(self.device)
        self.phase = o.phase
        self._sample()

    def after(self, o: Op) -> None:
        self._sample()

    def peaks(self) -> dict[Phase, int]:
        with self._lock:
            return dict(self._peaks)

    def allocator_peaks(self) -> dict[Phase, tuple[int, int]]:
        """(allocated, reserved) peak bytes of the caching allocator per phase."""
        return dict(self._allocator)

    def allocator_retries(self) -> dict[Phase, int]:
        """The caching allocator's retries per phase (each phase seen on a GPU, zero included)."""
        return dict(self._retries)

    def high_water(self) -> int:
        """The allocator's peak allocated bytes since the last reset before the probe started (what
        `torch.cuda.max_memory_allocated` would say without the probe's resets), up to the last phase change
        or `close`."""
        return self._high_water

    def _end_allocator_phase(self) -> None:
        peak = torch.cuda.max_memory_allocated(self.device)
        self._high_water = max(self._high_water, peak)
        retries, self._retries_before = self._retries_before, _alloc_retries(self.device)
        if self.phase is None:
            return
        self._retries[self.phase] = self._retries.get(self.phase, 0) + self._retries_before - retries
        allocated, reserved = self._allocator.get(self.phase, (0, 0))
        self._allocator[self.phase] = (max(allocated, peak), max(reserved, torch.cuda.max_memory_reserved(self.device)))

    def _sample_until_stopped(self) -> None:
        torch.cuda.set_device(self.device)
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        if self.device.type != "cuda" or self.phase is None:
            return
        free, total = torch.cuda.mem_get_info(self.device)
        with self._lock:
            phase = self.phase
            if phase is not None:
                self._peaks[phase] = max(self._peaks.get(phase, 0), total - free)


def _alloc_retries(device: torch.device) -> int:
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0)


def gib_by_phase(peaks: dict[Phase, int]) -> dict[str, float]:
    """{"1": GiB, ...}: per-phase peaks as metrics and bench results write them."""
    return {str(int(p)): round(b / 2**30, 2) for p, b in sorted(peaks.items())}


def allocator_gib_by_phase(peaks: dict[Phase, tuple[int, int]]) -> dict[str, dict[str, float]]:
    """{"1": {"allocated": GiB, "reserved": GiB}, ...}: `PhaseMemory.allocator_peaks` as results write them."""
    return {str(int(p)): {"allocated": round(a / 2**30, 2), "reserved": round(r / 2**30, 2)}
            for p, (a, r) in sorted(peaks.items())}  # fmt: skip


def chain(*hooks):
    """One op hook that calls each of `hooks` (None entries skipped) in order."""
    live = [h for h in hooks if h is not None]

    def call(o: Op) -> None:
        for h in live:
            h(o)

    return call
