"""Where one op's time goes module by module, and what held the host: per call of each vision block, decoder layer,
embedding, merger, final norm and LM head, its device time (CUDA events on the op's stream) and its host time; the
device's wait at each module's gate on a deferred update (`sharing.update_beside_prefix`); the garbage collector's
collections inside the op; the allocator's counters over it.

    python bench/module_times.py specs/qwen2_5_vl_7b_h200.yaml --op actor_score.prefix --warmup 3 --out F.json

Runs `--warmup` steps under Python's own collector, then one step per `--gc` variant with the op timed:

- python: Python's collector as it is (`run.manual_gc: false`): a collection may start inside the op
- manual: as `rollplex run` runs by default (`run.manual_gc: true`): collections at step ends only

A call whose device time is long and whose host time is as long held the host (a collection, a synchronisation, a
plan built for a new shape), and the device waited for it; one whose device time is long and whose host time is
short waited on the device (an event, a copy). On a CPU the device's times are the host's.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from rollplex.data.prefetch import staged_batch
from rollplex.data.source import open_dataset
from rollplex.executors.collector import collections_between_steps
from rollplex.executors.engines import build_engines
from rollplex.executors.runtime import run_iteration
from rollplex.graph.ir import Op, Schedule
from rollplex.graph.load import load_spec
from rollplex.graph.plan import compile_plan

VARIANTS = ("python", "manual")
ALLOCATOR = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")


def units(model) -> dict[str, torch.nn.Module]:
    """The modules timed per call, by name."""
    visual, lm = model.model.visual, model.model.language_model
    out = {"patch_embed": visual.patch_embed, "merger": visual.merger, "embed": lm.embed_tokens, "norm": lm.norm}
    out["lm_head"] = model.lm_head
    out |= {f"vision block {i}": b for i, b in enumerate(visual.blocks)}
    return out | {f"layer {i}": layer for i, layer in enumerate(lm.layers)}


@dataclass(frozen=True)
class HostMark:
    """On a CPU, where the device is the host: a moment, read as a CUDA event is."""

    seconds: float

    def elapsed_time(self, other: HostMark) -> float:
        return (other.seconds - self.seconds) * 1e3


def allocator_counts() -> dict[str, int]:
    stats = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
    return {k: stats.get(k, 0) for k in ALLOCATOR}


class CallTimer:
    """Forward hooks on `modules` that, while `on`, record each call's events on the current stream and host
    times; around the forward pre-hooks of each module with parameters of its own (where a deferred update's gate
    waits for their chunks, `memory.in_flight.gate_modules`), an event before and one after (`gates`); the garbage
    collector's collections meanwhile (`collections`)."""

    def __init__(self, modules: dict[str, torch.nn.Module], model: torch.nn.Module | None = None) -> None:
        self.on, self.calls, self.gates, self.collections, self._open = False, [], [], [], {}
        self._gc_began: float | None = None
        for name, module in modules.items():
            module.register_forward_pre_hook(self._pre(name))
            module.register_forward_hook(self._post(name))
        for name, module in model.named_modules() if model is not None else ():
            if next(module.parameters(recurse=False), None) is not None:  # built: its gate is registered already
                module.register_forward_pre_hook(self._pre(f"gate {name}"), prepend=True)
                module.register_forward_pre_hook(self._gated(name))
        gc.callbacks.append(self._on_gc)

    def _gated(self, name: str) -> Callable:
        def hook(module, args) -> None:
            if self.on and f"gate {name}" in self._open:
                self.gates.append((name, self._open.pop(f"gate {name}"), self.mark()))

        return hook

    @staticmethod
    def mark() -> tuple[torch.cuda.Event | HostMark, float]:
        """An event on the current stream (on a CPU, the moment), and the host's time."""
        if not torch.cuda.is_available():
            return HostMark(time.perf_counter()), time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream())
        return event, time.perf_counter()

    def _pre(self, name: str) -> Callable:
        def hook(module, args) -> None:
            if self.on:
                self._open[name] = self.mark()

        return hook

    def _post(self, name: str) -> Callable:
        def hook(module, args, output) -> None:
            if self.on and name in self._open:
                self.calls.append((name, self._open.pop(name), self.mark()))

        return hook

    def _on_gc(self, phase: str, info: dict) -> None:
        if not self.on:
            return
        if phase == "start":
            self._gc_began = time.perf_counter()
        elif self._gc_began is not None:
            self.collections.append((info["generation"], self._gc_began, time.perf_counter()))
            self._gc_began = None


def measured_step(
    g, engines, batch, op_id: str, timer: CallTimer, collect: Callable[[], float]
) -> tuple[dict, list[tuple]]:
    """One step, the op's calls timed: the op's summary, and its calls [module, device ms from the op's start,
    device ms, host ms from its start, host ms]."""
    timer.calls.clear()
    timer.gates.clear()
    timer.collections.clear()
    marks: dict = {}

    def before(o: Op) -> None:
        if o.id == op_id:
            marks["stats"] = allocator_counts()
            marks["begin"] = CallTimer.mark()
            timer.on = True

    def after(o: Op) -> None:
        if o.id == op_id:
            marks["end"] = CallTimer.mark()
            timer.on = False
            marks["stats"] = {k: v - marks["stats"][k] for k, v in allocator_counts().items()}

    run_iteration(g, engines, batch, before_op=before, after_op=after)
    collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if "begin" not in marks:
        raise SystemExit(f"module_times: the step has no op {op_id!r}")
    (first, host0), (last, host1) = marks["begin"], marks["end"]

    def ms(event: torch.cuda.Event) -> float:
        return round(first.elapsed_time(event), 1)

    calls = [
        (name, ms(a), round(a.elapsed_time(b), 1), round((ha - host0) * 1e3, 1), round((hb - ha) * 1e3, 1))
        for name, (a, ha), (b, hb) in timer.calls
    ]
    by_kind: dict[str, float] = {}
    host_by_kind: dict[str, float] = {}
    for name, _, device_ms, _, host_ms in calls:
        kind = name.rsplit(" ", 1)[0] if name[-1].isdigit() else name
        by_kind[kind] = round(by_kind.get(kind, 0.0) + device_ms, 1)
        host_by_kind[kind] = round(host_by_kind.get(kind, 0.0) + host_ms, 1)
    collections = [(gen, round((t0 - host0) * 1e3, 1), round((t1 - t0) * 1e3, 1)) for gen, t0, t1 in timer.collections]
    gates = sorted(
        ((name, ms(a), round(a.elapsed_time(b), 1)) for name, (a, _), (b, _) in timer.gates), key=lambda w: -w[2]
    )
    row = {
        "device_ms": round(first.elapsed_time(last), 1),
        "host_ms": round((host1 - host0) * 1e3, 1),
        "device_ms_by_module": by_kind,
        "host_ms_by_module": host_by_kind,
        "collections": [c for c in collections if c[2] >= 1.0],  # [generation, host ms from the op's start, ms]
        "gc_ms": round(sum(c[2] for c in collections), 1),
        "gate_wait_ms": round(sum(w[2] for w in gates), 1),  # the device's, at the gates of a deferred update
        # the host's, between the marks around the gates: a deferred update's enqueueing, and the marks' own cost
        # (a step without a deferred update shows that alone)
        "gate_host_ms": round(sum((hb - ha) * 1e3 for _, (_, ha), (_, hb) in timer.gates), 1),
        "longest_gate_waits": gates[:8],  # [module, device ms from the op's start, ms]
        "allocator": marks["stats"],
        "calls": len(calls),
    }
    return row, calls


@contextmanager
def variant(name: str):
    """The collector as the variant has it, yielding the step-end `collect()`."""
    if name == "manual":
        with collections_between_steps(True) as collect:
            yield collect
    else:
        yield lambda: 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec")
    ap.add_argument("--op", default="actor_score.prefix", help="the op timed (its id)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--schedule", default="rollplex", choices=[s.value for s in Schedule])
    ap.add_argument("--gc", nargs="+", default=list(VARIANTS), help=f"variants, one measured step each: {VARIANTS}")
    ap.add_argument("--stall-ms", type=float, default=15.0, help="a call this long on the device or host is listed")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    unknown = sorted(set(args.gc) - set(VARIANTS))
    if unknown:
        sys.exit(f"module_times: unknown --gc variants {unknown}; choose from {list(VARIANTS)}")
    loaded = load_spec(args.spec)
    plan = compile_plan(loaded, Schedule(args.schedule))
    engines, g, spec = build_engines(plan), plan.graph, loaded.spec
    dataset = open_dataset(spec.workload.dataset, engines.tokenizer, spec.run.seed, loaded.path.parent)
    size, timer = spec.workload.prompts_per_step, CallTimer(units(engines.actor), engines.actor)
    cuda = engines.actor.device.type == "cuda"
    for i in range(args.warmup):
        begin = time.perf_counter()
        run_iteration(g, engines, staged_batch(dataset, i * size, size, cuda))
        print(f"warm-up step {i + 1}: {time.perf_counter() - begin:.2f} s", flush=True)
    rows = {}
    for i, name in enumerate(args.gc):
        with variant(name) as collect:
            batch = staged_batch(dataset, (args.warmup + i) * size, size, cuda)
            row, calls = measured_step(g, engines, batch, args.op, timer, collect)
        row["stalls"] = [c for c in calls if c[2] >= args.stall_ms or c[4] >= args.stall_ms]
        rows[name] = row
    engines.settle()  # as `rollplex run` ends: no deferred update or allocator event outlives the green contexts
    print(
        f"\n{args.op}: per variant, device and host ms, the garbage collector's ms inside it, the calls of at "
        f"least {args.stall_ms} ms [module, device ms from the op's start, device ms, host ms from it, host ms]"
    )
    for name, row in rows.items():
        print(f"  {name:<7} device {row['device_ms']:>8.1f}  host {row['host_ms']:>8.1f}  gc {row['gc_ms']:>7.1f} "
              f"{row['collections']}  gates {row['gate_wait_ms']:.1f} (host {row['gate_host_ms']:.1f})  "
              f"allocator {row['allocator']}")  # fmt: skip
        print(f"      device ms by module {row['device_ms_by_module']}")
        print(f"      host ms by module {row['host_ms_by_module']}")
        for stall in row["stalls"]:
            print(f"      {stall}")
    if args.out:
        command = "python bench/module_times.py " + " ".join(sys.argv[1:])
        args.out.write_text(json.dumps({"spec": args.spec, "op": args.op, "command": command, "variants": rows}))


if __name__ == "__main__":
    main()
