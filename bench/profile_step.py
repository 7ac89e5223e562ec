"""Where a whole GRPO step's GPU time and memory go, op by op: one schedule of a spec (serial by default), warm.

    python bench/profile_step.py specs/qwen2_5_vl_3b_h200.yaml --warmup 1 --top 25

Runs `--warmup` steps, then one measured step: per op of the compiled graph, wall seconds, the allocator's
bytes in use after it and its peak during it (torch's view; the driver's view is in `rollplex run`'s metrics),
the parts of the prefix ops (each group's embedding + vision encoder, each chunk of decoder layers, the
boundary's concatenation) and of the scoring ops (each length batch's suffix forward, each loss backward, the
backward through the prefix). Then one more step with the ops whose id contains `--kernels` (default: the
actor's backward) under torch.profiler: their wall time, their kernels' GPU time (far less than the wall: the
host is the bottleneck) and their top `--top` kernels. Under `--schedule rollplex` the prefix parts are timed
with a device synchronisation around each chunk, so Phase 1 does not overlap as it would unprofiled; the
Phase 2 and 3 ops are measured as usual.

    python bench/profile_step.py specs/qwen2_5_vl_3b_h200.yaml --kernels prefix   # both prefixes' kernels
    python bench/profile_step.py specs/qwen2_5_vl_3b_h200.yaml --kernels prefix,suffix,backward  # a table each
    python bench/profile_step.py specs/qwen2_5_vl_3b_h200.yaml --kernels backward_through_prefix  # that call only
    python bench/profile_step.py specs/qwen2_5_vl_3b_h200.yaml --kernels suffix_rows,suffix_backward  # each call
    python bench/profile_step.py specs/qwen2_5_vl_3b_h200.yaml --kernels backward_through_prefix --shapes  # + by op

With `--memory-history PATH` the allocator's history is recorded over the measured step's Phase 2 (the phase
whose driver-side peak sits above the plan) and its summary written as JSON (`bench/memory_history.py`): where
the allocator grew its reservation, and whether the bytes it then held free could have served the request.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from rollplex.bench.variants import with_prompts_per_chunk
from rollplex.data.prefetch import staged_batch
from rollplex.data.source import open_dataset
from rollplex.executors import runtime, scoring
from rollplex.executors.engines import build_engines
from rollplex.executors.runtime import run_iteration
from rollplex.graph.ir import Op, Phase, Schedule
from rollplex.graph.load import load_spec
from rollplex.graph.plan import compile_plan
from rollplex.models import model as model_module
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
    ap.add_argument(
        "--kernels",
        default="actor_backward",
        help="profile the ops whose id contains this, or each call of a function: backward_through_prefix, "
        "suffix_rows (a length batch's scoring forward) or suffix_backward (its loss backward); comma-separated: "
        "a table each",
    )
    ap.add_argument("--prompts-per-chunk", help="the prefixes' prompt grouping (N or all; default: the spec's)")
    ap.add_argument(
        "--host",
        action="store_true",
        help="also record host activity in the profiled ops and list their torch ops by self host time",
    )
    ap.add_argument(
        "--shapes",
        action="store_true",
        help="also list the profiled ops' torch ops by their input shapes and the GPU time of the kernels each "
        "launches itself (what a kernel row such as an elementwise add is summing, and how often)",
    )
    ap.add_argument("--memory-history", type=Path, help="write the allocator's Phase-2 history summary here (JSON)")
    args = ap.parse_args()
    functions = [f in PART_FUNCTIONS for f in args.kernels.split(",") if f]
    if any(functions) and not all(functions):
        # a function runs inside ops: its profiler would nest in the op's, and stopping it ends the op's session
        sys.exit(f"profile_step: --kernels takes op ids or {', '.join(PART_FUNCTIONS)}, not both in one run")
    loaded = load_spec(args.spec)
    if args.prompts_per_chunk:
        loaded = with_prompts_per_chunk(loaded, args.prompts_per_chunk)
    plan = compile_plan(loaded, Schedule(args.schedule))
    engines, g = build_engines(plan), plan.graph
    spec = loaded.spec
    dataset = open_dataset(spec.workload.dataset, engines.tokenizer, spec.run.seed, loaded.path.parent)
    size = spec.workload.prompts_per_step
    for i in range(args.warmup):
        begin = time.perf_counter()
        run_iteration(g, engines, staged_batch(dataset, i * size, size, CUDA))
        _sync()
        print(f"warm-up step {i + 1}: {time.perf_counter() - begin:.2f} s", flush=True)

    rows, parts, started = [], [], {}
    history = _History(args.memory_history) if args.memory_history and CUDA else None
    _time_parts(parts, history.mark if history is not None else lambda name: None)

    def before(o: Op) -> None:  # under rollplex, decode's and its beside ops' befores come first, then the afters
        _sync()
        if history is not None:
            history.at(o.phase, f"op {o.id}")
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        started[o.id] = time.perf_counter()

    def after(o: Op) -> None:
        _sync()
        rows.append([o.id, time.perf_counter() - started.pop(o.id), *_gib()])

    examples = staged_batch(dataset, args.warmup * size, size, CUDA)
    begin = time.perf_counter()
    run_iteration(g, engines, examples, before_op=before, after_op=after)
    _sync()
    if history is not None:
        history.at(None)
    print(f"\nmeasured step: {time.perf_counter() - begin:.2f} s")
    print(f"{'op':<28} {'wall s':>7} {'alloc GiB':>9} {'peak GiB':>9} {'reserved':>9}")
    for op_id, seconds, current, peak, reserved in rows:
        print(f"{op_id:<28} {seconds:>7.2f} {current:>9.1f} {peak:>9.1f} {reserved:>9.1f}")
    print("\nparts of the prefix and scoring ops (the first also counts rollout's prefill)")
    print(f"{'part':<34} {'calls':>5} {'wall s':>7} {'max s':>6} {'peak GiB':>9}  each call (up to 8)")
    for name in dict.fromkeys(n for n, _, _ in parts):
        mine = [(t, p) for n, t, p in parts if n == name]
        total, longest, peak = sum(t for t, _ in mine), max(t for t, _ in mine), max(p for _, p in mine)
        each = " ".join(f"{t:.2f}" for t, _ in mine) if len(mine) <= 8 else ""
        print(f"{name:<34} {len(mine):>5} {total:>7.2f} {longest:>6.2f} {peak:>9.1f}  {each}")
    if args.top:
        _profile_group(engines, g, dataset, size, args)


class _History:
    """Records the allocator's history from the first Phase-2 op to the first op after Phase 2 (or the step's
    end), marked at each op and each timed part, and writes its summary to `path`."""

    def __init__(self, path: Path) -> None:
        sys.path.insert(0, str(Path(__file__).parent))
        import memory_history

        self.path, self.module, self.recording, self.done = path, memory_history, None, False

    def at(self, phase: Phase | None, name: str = "") -> None:
        if phase is Phase.TRAIN and self.recording is None and not self.done:
            self.recording = self.module.History()
        elif phase is not Phase.TRAIN and self.recording is not None:
            summary = self.recording.finish()
            self.path.write_text(json.dumps(summary, indent=1) + "\n")
            self.recording, self.done = None, True
            print(
                f"allocator history of Phase 2 -> {self.path}: peak allocated {summary['peak_allocated_gib']:.2f},"
                f" reserved {summary['peak_reserved_gib']:.2f} GiB"
            )
            for marker, gib in list(summary["growth_by_marker_gib"].items())[:8]:
                print(f"  grew {gib:6.2f} GiB after {marker}")
        self.mark(name)

    def mark(self, name: str) -> None:
        if self.recording is not None and name:
            self.recording.mark(name)


def _gib() -> list[float]:
    stats = torch.cuda.memory_stats() if CUDA else {}
    keys = [("allocated", "current"), ("allocated", "peak"), ("reserved", "current")]
    return [stats.get(f"{k}_bytes.all.{v}", 0) / GIB for k, v in keys]


def _timed(name: str, fn, parts: list, mark):
    """fn wrapped: synchronised wall time and allocator peak of each call, appended to `parts`; `mark(name)`
    before each call."""

    def wrapper(*a, **kw):
        mark(name)
        _sync()
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        _sync()
        parts.append((name, time.perf_counter() - t0, _gib()[1]))
        return out

    return wrapper


def _timed_chunks(name: str, fn, parts: list, mark):
    """A chunked job's function (`rollplex.models.chunks`) wrapped: the synchronised wall time of all its chunks
    (not the pauses between them) and their allocator peak, one entry in `parts` per job; `mark(name)` before
    each chunk."""

    def wrapper(*a, **kw):
        chunks, seconds, peak = fn(*a, **kw), 0.0, 0.0
        while True:
            mark(name)
            _sync()
            if CUDA:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            try:
                next(chunks)
            except StopIteration as done:
                _sync()
                parts.append((name, seconds + time.perf_counter() - t0, max(peak, _gib()[1])))
                return done.value
            _sync()
            seconds, peak = seconds + time.perf_counter() - t0, max(peak, _gib()[1])
            yield

    return wrapper


def _time_parts(parts: list, mark) -> None:
    """Times the pieces of the prefix ops (each group's embedding and vision encoder, each call running decoder
    layers for a group, the concatenation of the groups' boundaries) and of the suffix and backward ops: each
    length batch's suffix forward (reference and actor), the actor's alone, each batch's loss backward, the
    one backward through the prefix."""
    Qwen2_5_VL._input_chunks = _timed_chunks("embedding + vision (a group)", Qwen2_5_VL._input_chunks, parts, mark)
    model_module._GroupPrefix.run = _timed(
        "decoder layers (a group, a chunk)", model_module._GroupPrefix.run, parts, mark
    )
    model_module.concat_boundaries = _timed("concat_boundaries", model_module.concat_boundaries, parts, mark)
    runtime.score_batch = _timed("score_batch (actor fwd)", scoring.score_batch, parts, mark)
    scoring.LeafBoundary.backward_through_prefix = _timed(
        "backward_through_prefix", scoring.LeafBoundary.backward_through_prefix, parts, mark
    )
    backward = torch.Tensor.backward
    torch.Tensor.backward = _timed("loss.backward (suffix)", backward, parts, mark)
    Qwen2_5_VL.suffix_rows = _timed("model.suffix_rows (a length batch)", Qwen2_5_VL.suffix_rows, parts, mark)


KERNEL_CLASSES = (  # (class, substrings of a kernel's name), first match wins; names lower-cased
    ("attention", ("flash", "fmha", "cudnn", "attention", "flex")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas", "matmul")),
    ("fused (triton)", ("triton_",)),
    ("copy", ("memcpy", "memset", "copy", "cat", "index", "gather", "scatter")),
    ("elementwise (torch)", ("elementwise", "vectorized", "reduce_kernel")),
)


def kernel_class(name: str) -> str:
    """The class a kernel's name puts it in (`KERNEL_CLASSES`), else "other"."""
    lower = name.lower()
    return next((cls for cls, keys in KERNEL_CLASSES if any(k in lower for k in keys)), "other")


PART_FUNCTIONS = {  # `--kernels` names that profile each call of a function inside an op: (owner, attribute)
    "backward_through_prefix": (scoring.LeafBoundary, "backward_through_prefix"),
    "suffix_rows": (Qwen2_5_VL, "suffix_rows"),
    "suffix_backward": (torch.Tensor, "backward"),  # each length batch's loss backward (the prefix's is separate)
}


def _profile_group(engines, g, dataset, size, args) -> None:
    """Kernels of one more step's ops whose id contains one of `--kernels` (comma-separated), or of each call of
    a function `PART_FUNCTIONS` names, by GPU time (CUDA
    activity only: a whole step's host events take minutes to collect), one table per filter, each with its
    kernels' GPU time by class (`kernel_class`). Under rollplex a prefix op runs beside decode (its chunks are
    not ops of their own): profile it under serial."""
    activities = [ProfilerActivity.CUDA] if CUDA else []
    if args.host or args.shapes or not CUDA:
        activities.append(ProfilerActivity.CPU)
    key = "device_time_total" if CUDA else "cpu_time_total"
    filters = [f for f in args.kernels.split(",") if f]
    host = {f: {} for f in filters}  # filter -> torch op -> [self host seconds, calls]
    shaped = {f: {} for f in filters}  # filter -> (torch op, input shapes) -> [its own kernels' seconds, calls]
    running: list = []  # (profiler, start) of the op being profiled
    wall = dict.fromkeys(filters, 0.0)
    each = {f: [] for f in filters}  # filter -> (wall s, kernels' GPU s) of each call
    kernels = {f: {} for f in filters}  # filter -> kernel name -> [seconds, calls]
    picked = {f: [] for f in filters}

    def matching(o: Op) -> str | None:
        return next((f for f in filters if f in o.id and f not in PART_FUNCTIONS), None)

    def start() -> None:
        _sync()
        running.append((profile(activities=activities, record_shapes=args.shapes), time.perf_counter()))
        running[-1][0].__enter__()

    def stop(f: str, name: str) -> None:
        _sync()
        prof, t0 = running.pop()
        seconds = time.perf_counter() - t0
        wall[f] += seconds
        prof.__exit__(None, None, None)
        picked[f].append(name)
        call_kernels = 0.0
        for e in prof.key_averages():
            if getattr(e, "is_user_annotation", False):
                continue  # a range on the device's timeline (with host activity on): its kernels are counted already
            if CUDA and e.device_type == DeviceType.CPU:  # a host event: its self time, by op (under --host)
                if not args.host:
                    continue  # CUDA runtime calls, recorded with the device's activity
                seconds_calls = host[f].setdefault(e.key, [0.0, 0])
                seconds_calls[0] += e.self_cpu_time_total / 1e6
            else:
                seconds_calls = kernels[f].setdefault(e.key, [0.0, 0])
                seconds_calls[0] += getattr(e, key) / 1e6
                call_kernels += getattr(e, key) / 1e6
            seconds_calls[1] += e.count
        each[f].append((seconds, call_kernels))
        if args.shapes:
            for e in prof.key_averages(group_by_input_shape=True):
                own = e.self_device_time_total if CUDA else e.self_cpu_time_total
                if e.device_type == DeviceType.CPU and own > 0:
                    seconds_calls = shaped[f].setdefault((e.key, str(e.input_shapes)), [0.0, 0])
                    seconds_calls[0] += own / 1e6
                    seconds_calls[1] += e.count

    def before(o: Op) -> None:
        if matching(o) is not None:
            start()

    def after(o: Op) -> None:
        if (f := matching(o)) is not None:
            stop(f, o.id)

    def profiled(f: str, fn):
        def wrapper(*a, **kw):
            start()
            try:
                return fn(*a, **kw)
            finally:
                stop(f, f)

        return wrapper

    originals = {f: getattr(*PART_FUNCTIONS[f]) for f in filters if f in PART_FUNCTIONS}
    for f, fn in originals.items():
        setattr(*PART_FUNCTIONS[f], profiled(f, fn))
    batch = staged_batch(dataset, (args.warmup + 1) * size, size, CUDA)
    try:
        run_iteration(g, engines, batch, before_op=before, after_op=after)
    finally:
        for f, fn in originals.items():
            setattr(*PART_FUNCTIONS[f], fn)
    for f in filters:
        _print_kernels(f, picked[f], wall[f], kernels[f], args.top)
        if 1 < len(each[f]) <= 8:
            print("each call, wall / kernels s: " + ", ".join(f"{w:.2f} / {k:.2f}" for w, k in each[f]))
        if host[f]:
            print(f"host: torch ops and runtime calls by self host time, {sum(s for s, _ in host[f].values()):.2f} s")
            print(f"{'host s':>7} {'calls':>7}  op")
            for op, (seconds, calls) in sorted(host[f].items(), key=lambda kv: -kv[1][0])[: args.top]:
                print(f"{seconds:>7.3f} {calls:>7}  {op[:110]}")
        if shaped[f]:
            clock = "GPU" if CUDA else "host"
            print(f"torch ops by input shapes, by their own kernels' {clock} time")
            print(f"{clock + ' s':>7} {'calls':>7}  op  shapes")
            for (op, shapes), (seconds, calls) in sorted(shaped[f].items(), key=lambda kv: -kv[1][0])[: args.top]:
                print(f"{seconds:>7.3f} {calls:>7}  {op}  {shapes[:100]}")


def _print_kernels(name: str, picked: list[str], wall: float, kernels: dict, top: int) -> None:
    if not picked:
        print(f"\nno op id contains {name!r}: nothing profiled")
        return
    events = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    total = sum(seconds for seconds, _ in kernels.values())
    calls = f" ({len(picked)} calls)" if len(set(picked)) < len(picked) else ""
    print(f"\n{', '.join(dict.fromkeys(picked))}{calls}: {wall:.2f} s wall (profiled), kernels {total:.2f} s in all")
    by_class: dict[str, list] = {}
    for kernel, (seconds, calls) in kernels.items():
        entry = by_class.setdefault(kernel_class(kernel), [0.0, 0])
        entry[0], entry[1] = entry[0] + seconds, entry[1] + calls
    print(
        "by class: "
        + ", ".join(f"{c} {s:.3f} s ({n})" for c, (s, n) in sorted(by_class.items(), key=lambda kv: -kv[1][0]))
    )
    print(f"{'GPU s':>7} {'calls':>7}  kernel")
    for kernel, (seconds, calls) in events[:top]:
        print(f"{seconds:>7.3f} {calls:>7}  {kernel[:110]}")


if __name__ == "__main__":
    main()
