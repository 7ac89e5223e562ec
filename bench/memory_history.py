"""Why the caching allocator reserves more than its peak of live tensors, read from its recorded history.

`record()` starts torch's allocator history (`torch.cuda.memory._record_memory_history`, Python stacks);
`finish()` takes the snapshot, stops recording and returns `analyse()`'s summary: the bytes allocated and
reserved replayed event by event from the counters at the start, their peaks, and every time the allocator grew
its reservation (a new segment, or more pages of an expandable one) with what was then allocated, reserved but
free (on the requesting stream and on others) and the rollplex frames of the allocation that asked for it. A
growth while the requesting stream already had that much free is fragmentation; one while the free bytes sat on
another stream is the per-stream pools; growth at the allocated peak itself is the live tensors. Used by
`bench/profile_step.py --memory-history`.
"""

from __future__ import annotations

from collections import defaultdict

GROW = ("segment_alloc", "segment_map")
SHRINK = ("segment_free", "segment_unmap")
GIB = 2**30


def record(max_entries: int = 2_000_000) -> dict[str, int]:
    """Starts the history; returns the counters it starts from."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    stats = torch.cuda.memory_stats()
    return {"allocated": stats["allocated_bytes.all.current"], "reserved": stats["reserved_bytes.all.current"]}


def finish(start: dict[str, int], top: int = 12) -> dict:
    """The snapshot's history analysed (`analyse`), with the counters at the end to check the replay; stops."""
    import torch

    snapshot = torch.cuda.memory._snapshot()
    stats = torch.cuda.memory_stats()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    summary = analyse(trace, start, top)
    summary["counters_at_end_gib"] = {
        "allocated": stats["allocated_bytes.all.current"] / GIB,
        "reserved": stats["reserved_bytes.all.current"] / GIB,
        "allocated_peak": stats["allocated_bytes.all.peak"] / GIB,
        "reserved_peak": stats["reserved_bytes.all.peak"] / GIB,
    }
    return summary


def analyse(trace: list[dict], start: dict[str, int], top: int = 12) -> dict:
    """The history's summary (sizes in GiB). `trace`: the snapshot's device trace, events in order, each with
    `action`, `addr`, `size`, `stream` and `frames` ([{filename, line, name}], innermost first); `start`: the
    allocated and reserved bytes when recording began."""
    allocated, reserved = start["allocated"], start["reserved"]
    peak_allocated, peak_reserved = allocated, reserved
    live_by_stream: dict[int, int] = defaultdict(int)  # bytes allocated since recording began, per stream
    reserved_by_stream: dict[int, int] = defaultdict(int)
    growths, pending = [], None
    for e in trace:
        action, size, stream = e["action"], e["size"], e.get("stream", 0)
        if action == "alloc":
            allocated += size
            live_by_stream[stream] += size
            if pending is not None:
                pending["where"] = where(e.get("frames", []))
                pending = None
        elif action == "free_completed":
            allocated -= size
            live_by_stream[stream] -= size
        elif action in GROW:
            free_here = reserved_by_stream[stream] - live_by_stream[stream]
            free_all = sum(reserved_by_stream.values()) - sum(live_by_stream.values())
            pending = {
                "gib": size / GIB,
                "stream": stream,
                "allocated_gib": allocated / GIB,
                "reserved_gib": reserved / GIB,
                "free_on_stream_gib": free_here / GIB,
                "free_elsewhere_gib": (free_all - free_here) / GIB,
                "where": where(e.get("frames", [])),
            }
            growths.append(pending)
            reserved += size
            reserved_by_stream[stream] += size
        elif action in SHRINK:
            reserved -= size
            reserved_by_stream[stream] -= size
        peak_allocated, peak_reserved = max(peak_allocated, allocated), max(peak_reserved, reserved)
    by_site: dict[str, float] = defaultdict(float)
    for g in growths:
        by_site[g["where"]] += g["gib"]
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
        "growth_by_site_gib": dict(sorted(by_site.items(), key=lambda kv: -kv[1])[:top]),
        "largest_growths": sorted(growths, key=lambda g: -g["gib"])[:top],
    }


def where(frames: list[dict], depth: int = 3) -> str:
    """The innermost `depth` rollplex frames of a stack, as file:line name; '?' where none."""
    mine = [f for f in frames if "rollplex" in f.get("filename", "")]
    return " < ".join(f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in mine[:depth]) or "?"
