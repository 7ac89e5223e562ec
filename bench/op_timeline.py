"""Where one op's wall time goes on the device, unperturbed: which engines are busy (kernels, host-to-device and
device-to-host copies) over its span, and whether the host stalls in launches.

    python bench/op_timeline.py specs/qwen2_5_vl_7b_h200.yaml --op actor_score.prefix --warmup 2 --out timeline.json

Runs `--warmup` steps of the spec's schedule, then one more under torch.profiler, recording only the ops whose id
contains `--op` (the profiler starts before the op and stops after it; nothing is synchronised inside). With
`sharing.update_beside_prefix` the actor prefix's span also holds the last step's update, so this shows whether
the two share the device or wait on each other. Per op: its device span, the busy time of each engine (the union of
its intervals: compute kernels by stream, copies by direction), the busy share of each engine per tenth of the span,
the host's longest launch calls (a launch that blocks is one whose device queue is full) and its other CUDA runtime
calls by total time (a synchronisation blocks), the longest idle stretches of the busiest compute stream with the
kernel that ends each and when the host launched it (launched before the stretch began: the stream waited on the
device for something queued before that kernel) and the last copy on that stream within the stretch (a copy that
was launched early and started late waited in the copy engine's queue; no copy: the stream waited on an event),
the longest stretches in which the host made no CUDA call, the torch ops that issued the device memsets
(`cudaMemsetAsync`: a library's workspace zeroing, which may queue behind other streams' copies), and the garbage
collector's time inside the op (the steps run under `run.manual_gc` as `rollplex run` runs them). `--python` runs
one more step with the op under cProfile: the host's time by Python function.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from bisect import bisect_left
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from rollplex.bench.stalls import StepStalls
from rollplex.data.prefetch import staged_batch
from rollplex.data.source import open_dataset
from rollplex.executors.collector import collections_between_steps
from rollplex.executors.engines import build_engines
from rollplex.executors.runtime import run_iteration
from rollplex.graph.ir import Op, Schedule
from rollplex.graph.load import load_spec
from rollplex.graph.plan import compile_plan
from rollplex.memory import in_flight

BINS = 10
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cudaMemcpyAsync", "cuLaunchKernel", "cudaGraphLaunch")


def engine(name: str, stream: int) -> str:
    """The engine an interval occupies: a copy direction, or compute on its stream."""
    if name.startswith("Memcpy HtoD"):
        return "copy host->device"
    if name.startswith("Memcpy DtoH"):
        return "copy device->host"
    if name.startswith(("Memcpy", "Memset")):
        return "copy on device"
    return f"compute, stream {stream}"


def union_s(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds within [lo, hi] that at least one interval covers."""
    covered, end = 0.0, lo
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, hi)
        if b > a:
            covered, end = covered + b - a, b
    return covered


def summarise(prof, op_id: str) -> dict:
    device, launches, calls, kernels, launched, host, copies = {}, [], {}, {}, {}, [], {}
    events = prof.events()
    for e in events:
        if e.device_type == DeviceType.CUDA:
            name = engine(e.name, e.device_resource_id)
            device.setdefault(name, []).append((e.time_range.start, e.time_range.end))
            kernels.setdefault(name, []).append((e.time_range.start, e.id, e.name))
            if name.startswith("copy"):
                copies.setdefault(e.device_resource_id, []).append((e.time_range.end, e.time_range.start, e.id, e.name))
            continue
        took = e.time_range.end - e.time_range.start
        if e.name.startswith(("cuda", "cu")):
            host.append((e.time_range.start, e.time_range.end))
        if e.name in LAUNCHES:
            launches.append(took)
            launched[e.id] = e.time_range.start
        elif e.name.startswith(("cuda", "cu")):
            calls.setdefault(e.name, []).append(took)
    spans = [iv for ivs in device.values() for iv in ivs]
    if not spans:
        return {"op": op_id, "device_s": 0.0}
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    width = (hi - lo) / BINS
    engines = {}
    for name, ivs in sorted(device.items()):
        engines[name] = {
            "busy_s": round(union_s(ivs, lo, hi) / 1e6, 4),
            "busy_per_tenth": [
                round(union_s(ivs, lo + k * width, lo + (k + 1) * width) / width, 2) for k in range(BINS)
            ],
        }
    launches.sort(reverse=True)
    busiest = max((n for n in device if n.startswith("compute")), key=lambda n: union_s(device[n], lo, hi))
    stream_id = int(busiest.rsplit(" ", 1)[1])
    return {
        "op": op_id,
        "device_s": round((hi - lo) / 1e6, 4),
        "engines": engines,
        "launches": len(launches),
        "launch_s": round(sum(launches) / 1e6, 4),
        "longest_launches_ms": [round(x / 1e3, 2) for x in launches[:5]],
        "runtime_calls": runtime_calls(calls),
        "idle_gaps": idle_gaps(
            device[busiest], lo, hi, busiest, sorted(kernels[busiest]), launched, sorted(copies.get(stream_id, []))
        ),
        "host_gaps_ms": host_gaps(host, lo),
        "memsets_by_op": issuers(events, "cudaMemsetAsync"),
    }


def issuers(events, call: str, top: int = 8) -> list[dict]:
    """Who issued each host `call`: the innermost torch op above it (its profiler parent that is not itself a CUDA
    runtime call), by total host time in the call."""
    found: dict[str, list[float]] = {}
    for e in events:
        if e.name != call:
            continue
        parent = e.cpu_parent
        while parent is not None and parent.name.startswith(("cuda", "cu")):
            parent = parent.cpu_parent
        found.setdefault(parent.name if parent is not None else "(none)", []).append(
            e.time_range.end - e.time_range.start
        )
    return runtime_calls(found, top)


def runtime_calls(calls: dict[str, list[float]], top: int = 8) -> list[dict]:
    """The host's other CUDA runtime calls by total time (a synchronisation, or an allocation that frees the
    cache, is one that blocks)."""
    rows = [
        {"name": n, "count": len(ts), "total_ms": round(sum(ts) / 1e3, 2), "max_ms": round(max(ts) / 1e3, 2)}
        for n, ts in calls.items()
    ]
    return sorted(rows, key=lambda r: -r["total_ms"])[:top]


def idle_gaps(
    intervals: list[tuple[float, float]],
    lo: float,
    hi: float,
    stream: str,
    kernels: list,
    launched: dict,
    copies: list,
    top: int = 6,
) -> dict:
    """The longest stretches with nothing running on the busiest compute stream: [offset into the span, length,
    when the host launched the kernel that ends it (ms from the gap's start: before 0, the device waited on
    something else, after it the host was late), that kernel's name, and the last copy on the same stream that
    ended within the stretch as [its start, its length, its launch (ms from the gap's start), its name] (a copy
    launched early that starts late waited in the copy engine's queue; none: the stream waited on an event)]; and
    all its idle stretches summed by whether the device waited (the ending kernel launched before the stretch) or
    the host was late."""
    gaps, end = [], lo
    for a, b in sorted(intervals):
        if a > end:
            gaps.append((end, a))
        end = max(end, b)
    starts = [k[0] for k in kernels]
    waited = late_s = 0.0  # idle time ended by a kernel launched before the gap began (the device waited) or after
    for a, b in gaps:
        corr = kernels[min(bisect_left(starts, b), len(kernels) - 1)][1]
        if corr not in launched:  # no launch recorded: neither
            continue
        if launched[corr] <= a:
            waited += b - a
        else:
            late_s += b - a
    gaps.sort(key=lambda g: g[0] - g[1])
    rows = []
    for a, b in gaps[:top]:
        _, corr, name = kernels[min(bisect_left(starts, b), len(kernels) - 1)]
        late = round((launched[corr] - a) / 1e3, 1) if corr in launched else None
        ends = [c for c in copies if a < c[0] <= b + 100]  # (end, start, correlation, name), within 0.1 ms
        copy = None
        if ends:
            end_c, start_c, corr_c, name_c = ends[-1]
            launch_c = round((launched[corr_c] - a) / 1e3, 1) if corr_c in launched else None
            copy = [round((start_c - a) / 1e3, 1), round((end_c - start_c) / 1e3, 2), launch_c, name_c[:40]]
        rows.append([round((a - lo) / 1e3, 1), round((b - a) / 1e3, 1), late, name[:60], copy])
    summary = {"count": len(gaps), "device_waited_s": round(waited / 1e6, 4), "host_late_s": round(late_s / 1e6, 4)}
    return {"stream": stream, "gaps": rows, "idle": summary}


def host_gaps(calls: list[tuple[float, float]], lo: float, top: int = 6) -> list[list[float]]:
    """The longest stretches in which the host made no CUDA call: [offset into the device span, length] in ms."""
    gaps, end = [], None
    for a, b in sorted(calls):
        if end is not None and a > end:
            gaps.append((end, a))
        end = b if end is None else max(end, b)
    gaps.sort(key=lambda g: g[0] - g[1])
    return [[round((a - lo) / 1e3, 1), round((b - a) / 1e3, 1)] for a, b in gaps[:top]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec")
    ap.add_argument("--op", default="actor_score.prefix", help="profile the ops whose id contains this")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--schedule", default="rollplex", choices=[s.value for s in Schedule])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--python", action="store_true", help="one more step with the op under cProfile (host time)")
    ap.add_argument("--ahead", type=int, help="a deferred update's chunks kept enqueued (default in_flight.AHEAD)")
    args = ap.parse_args()
    if args.ahead is not None:
        if args.ahead < 1:
            ap.error("--ahead is at least 1")
        in_flight.AHEAD = args.ahead
    loaded = load_spec(args.spec)
    plan = compile_plan(loaded, Schedule(args.schedule))
    engines, g, spec = build_engines(plan), plan.graph, loaded.spec
    cuda = engines.actor.device.type == "cuda"
    dataset = open_dataset(spec.workload.dataset, engines.tokenizer, spec.run.seed, loaded.path.parent)
    size = spec.workload.prompts_per_step
    with collections_between_steps(spec.run.manual_gc) as collect:  # the collector as `rollplex run` has it
        rows = measure(g, engines, dataset, size, args, collect)
        if args.python:
            python_profile(g, engines, staged_batch(dataset, (args.warmup + 1) * size, size, cuda), args.op)
    engines.settle()  # as `rollplex run` ends: no deferred update or allocator event outlives the green contexts
    for row in rows:
        print(f"\n{row['op']}: device span {row['device_s']:.3f} s, host {row['host_s']:.3f} s, "
              f"{row.get('launches', 0)} launches taking {row.get('launch_s', 0):.3f} s (longest "
              f"{row.get('longest_launches_ms', [])} ms); garbage collector {row['gc_s']:.3f} s "
              f"({row['full_collections']} full)")  # fmt: skip
        for name, e in row.get("engines", {}).items():
            print(f"  {name:<28} busy {e['busy_s']:>7.3f} s  per tenth {e['busy_per_tenth']}")
        for c in row.get("runtime_calls", []):
            print(f"  host {c['name']:<32} x{c['count']:<6} {c['total_ms']:>9.1f} ms (longest {c['max_ms']} ms)")
        for c in row.get("memsets_by_op", []):
            print(
                f"  memsets from {c['name']:<40} x{c['count']:<6} {c['total_ms']:>9.1f} ms (longest {c['max_ms']} ms)"
            )
        if gaps := row.get("idle_gaps"):
            print(f"  {gaps['stream']} idle [offset ms, length ms, launched ms after its start, next kernel]:")
            for gap in gaps["gaps"]:
                print(f"    {gap}")
            i = gaps["idle"]
            print(f"  {gaps['stream']} idle {i['count']} times: the device waited {i['device_waited_s']:.3f} s, "
                  f"the host was late {i['host_late_s']:.3f} s")  # fmt: skip
            print(f"  host without a CUDA call [offset ms, length ms]: {row['host_gaps_ms']}")
    if args.out:
        args.out.write_text(json.dumps({"spec": args.spec, "op": args.op, "ops": rows}, indent=1))


def measure(g, engines, dataset, size: int, args: argparse.Namespace, collect) -> list[dict]:
    """`--warmup` steps, then one with the matching ops profiled; each step ends with `collect()`."""
    cuda = engines.actor.device.type == "cuda"
    for i in range(args.warmup):
        begin = time.perf_counter()
        run_iteration(g, engines, staged_batch(dataset, i * size, size, cuda))
        collect()
        print(f"warm-up step {i + 1}: {time.perf_counter() - begin:.2f} s", flush=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    rows, running = [], {}

    def before(o: Op) -> None:
        if args.op in o.id:
            running[o.id] = (profile(activities=activities), StepStalls(engines.actor.device), time.perf_counter())
            running[o.id][0].__enter__()
            running[o.id][1].__enter__()

    def after(o: Op) -> None:
        if o.id in running:
            prof, stalls, began = running.pop(o.id)
            host_s = time.perf_counter() - began  # the host's part: until its last launch returned
            stalls.__exit__()
            if cuda:
                torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            rows.append({**summarise(prof, o.id), "host_s": round(host_s, 4), **stalls.as_dict()})

    run_iteration(g, engines, staged_batch(dataset, args.warmup * size, size, cuda), before_op=before, after_op=after)
    collect()
    return rows


def python_profile(g, engines, batch, op_id: str, top: int = 25) -> None:
    """One step with the matching ops under cProfile: where the host's time goes, by Python function."""
    prof = cProfile.Profile()

    def before(o: Op) -> None:
        if op_id in o.id:
            prof.enable()

    def after(o: Op) -> None:
        if op_id in o.id:
            prof.disable()

    run_iteration(g, engines, batch, before_op=before, after_op=after)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
