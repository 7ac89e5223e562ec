"""Where one op's wall time goes on the device, unperturbed: which engines are busy (kernels, host-to-device and
device-to-host copies) over its span, and whether the host stalls in launches.

    python bench/op_timeline.py specs/qwen2_5_vl_7b_h200.yaml --op actor_score.prefix --warmup 2 --out timeline.json

Runs `--warmup` steps of the spec's schedule, then one more under torch.profiler, recording only the ops whose id
contains `--op` (the profiler starts before the op and stops after it; nothing is synchronised inside). With
`sharing.update_beside_prefix` the actor prefix's span also holds the last step's update, so this shows whether
the two share the device or wait on each other. Per op: its device span, the busy time of each engine (the union of
its intervals: compute kernels by stream, copies by direction) and their bytes where the profiler records them, the
busy share of each engine per tenth of the span, and the host's longest launch calls (a launch that blocks is one
whose device queue is full).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from rollplex.data.prefetch import staged_batch
from rollplex.data.source import open_dataset
from rollplex.executors.engines import build_engines
from rollplex.executors.runtime import run_iteration
from rollplex.graph.ir import Op, Schedule
from rollplex.graph.load import load_spec
from rollplex.graph.plan import compile_plan

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
    device, launches = {}, []
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            device.setdefault(engine(e.name, e.device_resource_id), []).append((e.time_range.start, e.time_range.end))
        elif e.name in LAUNCHES:
            launches.append(e.time_range.end - e.time_range.start)
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
    return {
        "op": op_id,
        "device_s": round((hi - lo) / 1e6, 4),
        "engines": engines,
        "launches": len(launches),
        "launch_s": round(sum(launches) / 1e6, 4),
        "longest_launches_ms": [round(x / 1e3, 2) for x in launches[:5]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec")
    ap.add_argument("--op", default="actor_score.prefix", help="profile the ops whose id contains this")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--schedule", default="rollplex", choices=[s.value for s in Schedule])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    loaded = load_spec(args.spec)
    plan = compile_plan(loaded, Schedule(args.schedule))
    engines, g, spec = build_engines(plan), plan.graph, loaded.spec
    cuda = engines.actor.device.type == "cuda"
    dataset = open_dataset(spec.workload.dataset, engines.tokenizer, spec.run.seed, loaded.path.parent)
    size = spec.workload.prompts_per_step
    for i in range(args.warmup):
        begin = time.perf_counter()
        run_iteration(g, engines, staged_batch(dataset, i * size, size, cuda))
        print(f"warm-up step {i + 1}: {time.perf_counter() - begin:.2f} s", flush=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    rows, running = [], {}

    def before(o: Op) -> None:
        if args.op in o.id:
            running[o.id] = (profile(activities=activities), time.perf_counter())
            running[o.id][0].__enter__()

    def after(o: Op) -> None:
        if o.id in running:
            prof, began = running.pop(o.id)
            host_s = time.perf_counter() - began  # the host's part: until its last launch returned
            if cuda:
                torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            rows.append({**summarise(prof, o.id), "host_s": round(host_s, 4)})

    run_iteration(g, engines, staged_batch(dataset, args.warmup * size, size, cuda), before_op=before, after_op=after)
    for row in rows:
        print(f"\n{row['op']}: device span {row['device_s']:.3f} s, host {row['host_s']:.3f} s, "
              f"{row.get('launches', 0)} launches taking {row.get('launch_s', 0):.3f} s (longest "
              f"{row.get('longest_launches_ms', [])} ms)")  # fmt: skip
        for name, e in row.get("engines", {}).items():
            print(f"  {name:<28} busy {e['busy_s']:>7.3f} s  per tenth {e['busy_per_tenth']}")
    if args.out:
        args.out.write_text(json.dumps({"spec": args.spec, "op": args.op, "ops": rows}, indent=1))


if __name__ == "__main__":
    main()
