"""Where a whole GRPO step's GPU time and memory go, op by op: one schedule of a spec (serial by default), warm.

    python bench/profile_step.py specs/qwen2_5_vl_3b_h200.yaml --warmup 1 --top 25

Runs `--warmup` steps, then one measured step: per op of the compiled graph, wall seconds, the allocator's
bytes in use after it and its peak during it (torch's view; the driver's view is in `rollplex run`'s metrics),
and the parts of the scoring ops (each length batch's suffix forward, each loss backward, the backward through
the prefix). Then one more step with the actor's backward op under torch.profiler: its top `--top` kernels.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from rollplex.data.source import batch_at, open_dataset
from rollplex.executors import runtime, scoring
from rollplex.executors.engines import build_engines
from rollplex.executors.runtime import run_iteration
from rollplex.graph.ir import NodeKind, Op, Schedule
from rollplex.graph.load import load_spec
from rollplex.graph.pipeline import compile_graph
from rollplex.models.model import Qwen2_5_VL

GIB = 2**30
CUDA = torch.cuda.is_available()  # on the CPU (a smoke run of the script) times only, no memory


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--top", type=int, default=25, help="kernels listed (0: no profiled step)")
    ap.add_argument("--schedule", default="serial", choices=[s.value for s in Schedule])
    args = ap.parse_args()
    loaded = load_spec(args.spec)
    engines = build_engines(loaded)
    g = compile_graph(loaded.spec, schedule=Schedule(args.schedule))
    spec = loaded.spec
    dataset = open_dataset(spec.workload.dataset, engines.tokenizer, spec.run.seed, loaded.path.parent)
    size = spec.workload.prompts_per_step
    for i in range(args.warmup):
        begin = time.perf_counter()
        run_iteration(g, engines, batch_at(dataset, i * size, size))
        _sync()
        print(f"warm-up step {i + 1}: {time.perf_counter() - begin:.2f} s", flush=True)

    rows, parts = [], []
    _time_parts(parts)

    def before(o: Op) -> None:
        _sync()
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        rows.append([o.id, time.perf_counter()])

    def after(o: Op) -> None:
        _sync()
        rows[-1][1] = time.perf_counter() - rows[-1][1]
        rows[-1].extend(_gib())

    examples = batch_at(dataset, args.warmup * size, size)
    begin = time.perf_counter()
    run_iteration(g, engines, examples, before_op=before, after_op=after)
    _sync()
    print(f"\nmeasured step: {time.perf_counter() - begin:.2f} s")
    print(f"{'op':<28} {'wall s':>7} {'alloc GiB':>9} {'peak GiB':>9} {'reserved':>9}")
    for op_id, seconds, current, peak, reserved in rows:
        print(f"{op_id:<28} {seconds:>7.2f} {current:>9.1f} {peak:>9.1f} {reserved:>9.1f}")
    print(f"\nparts of the scoring ops\n{'part':<34} {'calls':>5} {'wall s':>7} {'max s':>6} {'peak GiB':>9}")
    for name in dict.fromkeys(n for n, _, _ in parts):
        mine = [(t, p) for n, t, p in parts if n == name]
        total, longest, peak = sum(t for t, _ in mine), max(t for t, _ in mine), max(p for _, p in mine)
        print(f"{name:<34} {len(mine):>5} {total:>7.2f} {longest:>6.2f} {peak:>9.1f}")
    if args.top:
        _profile_group(engines, g, dataset, size, args)


def _gib() -> list[float]:
    stats = torch.cuda.memory_stats() if CUDA else {}
    keys = [("allocated", "current"), ("allocated", "peak"), ("reserved", "current")]
    return [stats.get(f"{k}_bytes.all.{v}", 0) / GIB for k, v in keys]


def _timed(name: str, fn, parts: list):
    """fn wrapped: synchronised wall time and allocator peak of each call, appended to `parts`."""

    def wrapper(*a, **kw):
        _sync()
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        _sync()
        parts.append((name, time.perf_counter() - t0, _gib()[1]))
        return out

    return wrapper


def _time_parts(parts: list) -> None:
    """Times the pieces of the suffix and backward ops: each length batch's suffix forward (reference and
    actor), the actor's alone, each batch's loss backward, the one backward through the prefix."""
    runtime.score_batch = _timed("score_batch (actor fwd)", scoring.score_batch, parts)
    scoring.LeafBoundary.backward_through_prefix = _timed(
        "backward_through_prefix", scoring.LeafBoundary.backward_through_prefix, parts
    )
    backward = torch.Tensor.backward
    torch.Tensor.backward = _timed("loss.backward (suffix)", backward, parts)
    Qwen2_5_VL.suffix_rows = _timed("model.suffix_rows (a length batch)", Qwen2_5_VL.suffix_rows, parts)


def _profile_group(engines, g, dataset, size, args) -> None:
    """Kernels of one more step's actor scoring + backward, by GPU time (CUDA activity only: a whole step's
    host events take minutes to collect)."""
    activity = ProfilerActivity.CUDA if CUDA else ProfilerActivity.CPU
    prof = profile(activities=[activity])

    def before(o: Op) -> None:
        if o.kind is NodeKind.BACKWARD:
            _sync()
            prof.__enter__()

    def after(o: Op) -> None:
        if o.kind is NodeKind.BACKWARD:
            _sync()
            prof.__exit__(None, None, None)

    run_iteration(g, engines, batch_at(dataset, (args.warmup + 1) * size, size), before_op=before, after_op=after)
    key = "device_time_total" if CUDA else "cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: -getattr(e, key))
    total = sum(getattr(e, key) for e in events)
    print(f"\nactor backward op, kernels: {total / 1e6:.2f} s in all")
    print(f"{'GPU s':>7} {'calls':>7}  kernel")
    for e in events[: args.top]:
        print(f"{getattr(e, key) / 1e6:>7.3f} {e.count:>7}  {e.key[:110]}")


if __name__ == "__main__":
    main()
