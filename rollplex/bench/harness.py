"""`rollplex bench SPEC`: one schedule timed phase by phase (`run_schedule`).

Each schedule trains `warmup + steps` steps from the same initial weights and data (engines built afresh,
nothing written to disk), with a device synchronisation around every op so that an op's time runs until the
GPU has done its work (`_OpClock`). Per measured step it keeps the phase times, the cost model's bounds at the
step's real token counts, the device memory per phase (`memprobe.py`: the driver's used bytes, so VMM regions
and the runtime count as in the plan), the first step's rollout and gradient sketch, and the last step's
timeline. Not here: the result document comparing the schedules (`document.py`), argument parsing (`cli.py`),
the plot (`report/timeline.py`), baseline runs saved for later benches (`baseline.py`).
"""

from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass, field

import torch

from rollplex.bench.agreement import (
    grad_sketch,
    same_rollout,
)
from rollplex.bench.stalls import StepStalls
from rollplex.data.prefetch import staged
from rollplex.data.source import batch_at, open_dataset
from rollplex.executors.bounds import prefix_backward_bound_s, step_bounds, step_tokens
from rollplex.executors.collector import collections_between_steps
from rollplex.executors.engines import build_engines
from rollplex.executors.memprobe import PhaseMemory, chain
from rollplex.executors.runtime import run_iteration
from rollplex.graph.cost import timer_of
from rollplex.graph.ir import NodeKind, Op, Part, Phase, Schedule
from rollplex.graph.load import LoadedSpec
from rollplex.graph.plan import compile_plan

Span = tuple[str, str, float, float]  # (lane, label, start s, end s) from the iteration's start


@dataclass
class ScheduleRun:
    step_s: list[float] = field(default_factory=list)
    times: list[dict[str, float]] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    device_slowdown: list[float] = field(default_factory=list)  # per step: decode beside chunks, on the device
    beside_fraction: list[float] = field(default_factory=list)
    prefix_backward_s: list[float] = field(default_factory=list)  # the actor's backward through its prefix
    longest_response: list[int] = field(default_factory=list)  # tokens: the step's decode steps, at most
    stalls: list[dict] = field(default_factory=list)  # `StepStalls.as_dict()` per step: gc, allocator retries
    timeline: list[Span] = field(default_factory=list)  # of the last step
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # the actor's after the last step, on the CPU
    peak_bytes: dict[Phase, int] = field(default_factory=dict)  # device bytes in use, max over the measured steps
    allocator_bytes: dict[Phase, tuple[int, int]] = field(default_factory=dict)  # (allocated, reserved) maxima
    first_rollout: tuple[torch.Tensor, torch.Tensor] | None = None  # (responses, lengths) of step 1, on the CPU
    first_grads: torch.Tensor | None = None  # `grad_sketch` of step 1's gradients, FP32 on the CPU
    bounds: list[dict[str, float]] = field(default_factory=list)  # per measured step: each phase's bound, s
    device_bounds: list[dict[str, float]] = field(default_factory=list)  # the same without the host link
    prefix_backward_bounds: list[float] = field(default_factory=list)  # per measured step (split schedules)
    scoring_attention: str = ""  # `scoring_label` of the actor's engine: what the gradient noise floor follows


def scoring_label(model) -> str:
    """What a model's scoring attention runs on: cuDNN's ragged calls (their backward accumulates dq with atomics,
    or not: "cudnn deterministic"), FlexAttention (a GPU) or SDPA with a dense mask (the CPU)."""
    kernels = model.suffix_kernels
    if kernels is not None:
        return "cudnn deterministic" if kernels[0].deterministic else "cudnn"
    return "flex" if model.device.type == "cuda" else "sdpa"


def run_schedule(
    loaded: LoadedSpec, schedule: Schedule, steps: int, warmup: int, batches: dict[int, list] | None = None
) -> ScheduleRun:
    """`warmup + steps` steps of one schedule on fresh engines. `batches` (step -> examples), when given, is
    filled on first use and read after: every schedule of a bench trains on the very same examples, rendered
    once (a LLaVA-Video-like batch takes seconds of host time to render)."""
    # The last schedule's engines are unreachable but hold reference cycles: collect them before building these,
    # or two sets of pinned host pools live at once (3B: ~75 GiB each; the host OOM-killed a bench on the H200).
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    plan = compile_plan(loaded, schedule)
    engines, g, spec = build_engines(plan), plan.graph, loaded.spec
    dataset = open_dataset(spec.workload.dataset, engines.tokenizer, spec.run.seed, loaded.path.parent)
    device, out = engines.actor.device, ScheduleRun(scoring_attention=scoring_label(engines.actor))
    batches = {} if batches is None else batches
    with collections_between_steps(spec.run.manual_gc) as collect:
        for i in range(warmup + steps):
            if i not in batches:
                size = spec.workload.prompts_per_step
                batches[i] = batch_at(dataset, i * size, size)
            examples = staged(batches[i], pin=device.type == "cuda")  # as `rollplex run` stages them, per schedule
            clock = _OpClock(device)
            _sync(device)
            begin = time.perf_counter()
            with PhaseMemory(device) as memory, StepStalls(device) as stalls:
                before, after = chain(clock.before, memory.before), chain(clock.after, memory.after)
                if i == 0:
                    before = chain(before, _sketch_before_update(engines.optimizer, out))
                record = run_iteration(g, engines, examples, before_op=before, after_op=after)
                collect()  # as `rollplex run` does at a step's end (`run.manual_gc`)
                _sync(device)
                elapsed = time.perf_counter() - begin
            if i == 0:
                out.first_rollout = (record.responses.cpu(), record.response_lens.cpu())
            times = {k: clock.times.get(k, 0.0) for k in record.times}  # per phase, until the device is done
            if engines.is_main:  # a line per step: what a bench cut short by a time limit still tells
                phases = ", ".join(f"{k} {v:.2f}" for k, v in times.items() if v)
                peaks = " / ".join(f"{b / 2**30:.1f}" for _, b in sorted(memory.peaks().items()))
                kind = "warm-up" if i < warmup else "step"
                longest, stalled = int(record.response_lens.max()), stalls.describe()
                print(f"  {schedule.value} {kind} {i + 1}/{warmup + steps}: {elapsed:.2f} s ({phases}; longest "
                      f"response {longest} tokens)" + (f"; GiB per phase {peaks}" if peaks else "")
                      + (f"; {stalled}" if stalled else ""), file=sys.stderr, flush=True)  # fmt: skip
            if i < warmup:
                continue
            for phase, num_bytes in memory.peaks().items():
                out.peak_bytes[phase] = max(out.peak_bytes.get(phase, 0), num_bytes)
            for phase, (allocated, reserved) in memory.allocator_peaks().items():
                was = out.allocator_bytes.get(phase, (0, 0))
                out.allocator_bytes[phase] = (max(was[0], allocated), max(was[1], reserved))
            out.step_s.append(elapsed)
            out.times.append(times)
            out.decode_s.extend([record.stats["decode_s"]] if "decode_s" in record.stats else [])
            out.device_slowdown.extend([record.stats["decode_slowdown"]] if "decode_slowdown" in record.stats else [])
            out.beside_fraction.append(record.stats.get("prefix_chunks_during_decode", 0.0))
            out.prefix_backward_s.extend([record.prefix_backward_s] if record.prefix_backward_s is not None else [])
            out.longest_response.append(int(record.response_lens.max()))
            tokens = step_tokens(examples, record.response_lens)
            bounds, device_bounds = step_bounds(plan, tokens)
            out.bounds.append(bounds)
            if (prefix_bound := prefix_backward_bound_s(plan, tokens)) is not None:
                out.prefix_backward_bounds.append(prefix_bound)
            out.device_bounds.append(device_bounds)
            out.stalls.append(stalls.as_dict())
            beside = {op_id for op_id, _, _ in record.chunks}  # these ran as chunks: drawn chunk by chunk
            ops = [(lane, label, t0 - begin, t1 - begin) for lane, label, t0, t1 in clock.spans if label not in beside]
            out.timeline = ops + [("prefix stream", op_id, t0 - begin, t1 - begin) for op_id, t0, t1 in record.chunks]
    out.params = {n: p.detach().to("cpu", copy=True) for n, p in engines.actor.named_parameters()}
    examples = []  # their pinned patches recorded the engines' streams
    engines.settle()  # while the engines' green contexts live
    return out


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def _sketch_before_update(optimizer, out: ScheduleRun):
    def before(o: Op) -> None:
        if o.kind is NodeKind.UPDATE:
            out.first_grads = grad_sketch(optimizer.grad_of(i) for i in range(len(optimizer.params)))

    return before


def noise_floor_grads(serial: ScheduleRun, rerun: ScheduleRun) -> torch.Tensor | None:
    """The rerun's first-step gradient sketch, when its rollout was serial's (other tokens: no floor at all)."""
    return rerun.first_grads if same_rollout(serial.first_rollout, rerun.first_rollout) else None


class _OpClock:
    """before/after-op hooks that time each op between device synchronisations: `times` (per `timer_of` key)
    from the device idle before the op to the device idle after it. The runtime's own `StepRecord.times` stop
    when the host has launched an op's last kernel, which for an op the GPU lags behind (serial's batched
    prefixes: ~1 s on the 3B H200 bench) is well before its work is done. An op started while another is
    open runs beside it (rollplex's prefixes beside decode): its time is the open op's, counted once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.started: dict[str, float] = {}
        self.spans: list[Span] = []
        self.times: dict[str, float] = {}
        self._open: list[str] = []
        self._beside: set[str] = set()

    def before(self, o: Op) -> None:
        if self._open:
            self._beside.add(o.id)
        self._open.append(o.id)
        _sync(self.device)
        self.started[o.id] = time.perf_counter()

    def after(self, o: Op) -> None:
        _sync(self.device)
        end = time.perf_counter()
        self._open.remove(o.id)
        self.spans.append((_lane(o), o.id, self.started[o.id], end))
        if o.id not in self._beside:
            self.times[timer_of(o)] = self.times.get(timer_of(o), 0.0) + end - self.started[o.id]


def _lane(o: Op) -> str:
    if o.kind is NodeKind.DECODE:
        return "rollout"
    if o.kind is NodeKind.FORWARD and o.part is Part.PREFIX:
        return "prefix stream"
    return "trainer"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
