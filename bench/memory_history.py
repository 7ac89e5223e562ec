"""Why the caching allocator reserves more than its peak of live tensors, read from its recorded history.

`History` starts torch's allocator history (`torch.cuda.memory._record_memory_history`, without stack traces:
capturing them inside a compiled, checkpointed backward fails under torch 2.11, pytorch/pytorch#179536);
`mark(name)` puts a marker in it (an allocation of a size no tensor of the step has, freed at once), so what
follows is attributed to `name`; `finish()` takes the snapshot, stops recording and returns `analyse()`'s
summary: the bytes allocated and reserved replayed event by event from the counters at the start, their peaks,
and every time the allocator grew its reservation (a new segment, or more pages of an expandable one) with
what was then allocated, reserved but free (on the requesting stream and on others) and the marker it followed.
A growth while the requesting stream already had that much free is fragmentation; one while the free bytes sat
on another stream is the per-stream pools; growth at the allocated peak itself is the live tensors. Used by
`bench/profile_step.py --memory-history`.
"""

from __future__ import annotations

from collections import defaultdict

GROW = ("segment_alloc", "segment_map")
SHRINK = ("segment_free", "segment_unmap")
GIB = 2**30


MARKER_BYTES = 3 * 2**20 + 2**10 * 7  # + 1 KiB per marker: sizes between large-pool blocks no tensor here has


class History:
    """The allocator's history from construction to `finish()`, with named markers in it."""

    def __init__(self, max_entries: int = 2_000_000) -> None:
        import torch

        self.torch, self.names = torch, {}
        torch.cuda.memory._record_memory_history(max_entries=max_entries, context=None)
        stats = torch.cuda.memory_stats()
        self.start = {k: stats[f"{k}_bytes.all.current"] for k in ("allocated", "reserved")}

    def mark(self, name: str) -> None:
        size = MARKER_BYTES + 2**10 * len(self.names)
        self.names[size] = name
        self.torch.empty(size, dtype=self.torch.uint8, device="cuda")  # freed at once

    def finish(self, top: int = 12) -> dict:
        """The snapshot's history analysed (`analyse`), with the counters at the end to check the replay; stops."""
        torch = self.torch
        snapshot = torch.cuda.memory._snapshot()
        stats = torch.cuda.memory_stats()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snapshot["device_traces"][torch.cuda.current_device()]
        summary = analyse(trace, self.start, self.names, top)
        summary["counters_at_end_gib"] = {k: stats[f"{k}_bytes.all.current"] / GIB for k in ("allocated", "reserved")}
        return summary


def analyse(trace: list[dict], start: dict[str, int], markers: dict[int, str], top: int = 12) -> dict:
    """The history's summary (sizes in GiB). `trace`: the snapshot's device trace, events in order, each with
    `action`, `addr`, `size` and `stream`; `start`: the allocated and reserved bytes when recording began;
    `markers`: the marker sizes and their names (an alloc of one of these sizes freed by the next event)."""
    allocated, reserved = start["allocated"], start["reserved"]
    peak_allocated, peak_reserved = allocated, reserved
    live_by_stream: dict[int, int] = defaultdict(int)  # bytes allocated since recording began, per stream
    reserved_by_stream: dict[int, int] = defaultdict(int)
    growths, at = [], "(before the first marker)"
    for i, e in enumerate(trace):
        action, size, stream = e["action"], e["size"], e.get("stream", 0)
        following = trace[i + 1] if i + 1 < len(trace) else {}
        if action == "alloc" and size in markers and following.get("addr") == e["addr"]:
            at = markers[size]
        if action == "alloc":
            allocated += size
            live_by_stream[stream] += size
        elif action == "free_completed":
            allocated -= size
            live_by_stream[stream] -= size
        elif action in GROW:
            free_here = reserved_by_stream[stream] - live_by_stream[stream]
            free_all = sum(reserved_by_stream.values()) - sum(live_by_stream.values())
            growths.append({
                "gib": size / GIB,
                "stream": stream,
                "allocated_gib": allocated / GIB,
                "reserved_gib": reserved / GIB,
                "free_on_stream_gib": free_here / GIB,
                "free_elsewhere_gib": (free_all - free_here) / GIB,
                "at": at,
            })  # fmt: skip
            reserved += size
            reserved_by_stream[stream] += size
        elif action in SHRINK:
            reserved -= size
            reserved_by_stream[stream] -= size
        peak_allocated, peak_reserved = max(peak_allocated, allocated), max(peak_reserved, reserved)
    by_site: dict[str, float] = defaultdict(float)
    for g in growths:
        by_site[g["at"]] += g["gib"]
    grown_below_peak = [g for g in growths if g["allocated_gib"] + g["gib"] < peak_allocated / GIB - 0.5]
    return {
        "events": len(trace),
        "start_gib": {k: v / GIB for k, v in start.items()},
        "end_gib": {"allocated": allocated / GIB, "reserved": reserved / GIB},
        "peak_allocated_gib": peak_allocated / GIB,
        "peak_reserved_gib": peak_reserved / GIB,
        "reserved_above_live_peak_gib": (peak_reserved - peak_allocated) / GIB,
        "growths": len(growths),
        "grown_gib": sum(g["gib"] for g in growths),
        "grown_below_live_peak_gib": sum(g["gib"] for g in grown_below_peak),
        "grown_with_free_on_stream_gib": sum(min(g["gib"], g["free_on_stream_gib"]) for g in growths),
        "growth_by_marker_gib": dict(sorted(by_site.items(), key=lambda kv: -kv[1])[:top]),
        "largest_growths": sorted(growths, key=lambda g: -g["gib"])[:top],
    }
