"""How much of the GPU decode and a compute-bound neighbour each keep when they share it, per way of sharing.

    python bench/share_efficiency.py --ways stream green:33 green:66 --out bench/results/share_inprocess_3b_h200.json
    python bench/share_efficiency.py --ways mps:25 mps:50 mps:100 green:66 --out .../share_mps_3b_h200.json
    python bench/share_efficiency.py --self-percent 70 --ways mps:100 --out .../share_mps_self70_3b_h200.json
    python bench/share_efficiency.py --decode-sms 96 64 --ways rest --out .../share_split_cublas_3b_h200.json

The decode step is the 3B rollout's full-batch CUDA graph (5,888-token prompts, replayed from the middle of a
2,048-token cache, as `decode_beside.py`); the neighbour stands in for the prefix work: back-to-back bf16
matmuls [8192 x 8192]. A way of sharing is where the neighbour runs: `stream` (a second stream, no partition),
`green:P` (a green context of P SMs in this process, the `green` policy) or `mps:P` (a child process, an MPS
client with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE P; the `mps` policy's trainer). Any `mps:` way makes this
process an MPS client of a private daemon too, capped at `--self-percent` (default none: the `mps` policy's
rollout). For each way: decode's step time alone and beside the neighbour, and the neighbour's TFLOP/s alone
on the whole GPU (what serial's prefixes get) and beside decode, counted over the decode window from each
matmul's completion time. `kept` = decode alone / beside + neighbour beside / whole GPU: 1.0 is what time
slicing gives (the serial sum), above it the share saves time. `decode_beside.py` measures decode's slowdown
beside green partitions; this adds what the neighbour got and the MPS ways.

`--decode-sms D` splits the device into two disjoint green contexts (cuDevSmResourceSplitByCount through
cuda.bindings: torch's `GreenContext.create` makes one partition at a time, with no say in which SMs, and the
primary context, where decode runs under the `green` policy, is not partitioned at all): decode replays on a
stream of the D-SM one (its graphs captured on that stream: a graph captured on the primary context runs on
every SM, whatever stream replays it), with `--decode-kernels rollplex*` our GEMMs planned for D SMs, and the way `rest`
runs the neighbour on the other. Its rows give decode alone on its partition (`decode_partition_ms`), and
their `kept` is against that; against the whole GPU, take decode alone from a run without a split.

`--clocks`: nvidia-smi samples the SM clock, memory clock and power draw meanwhile (`gpu_clocks.py`), and each
row gets their medians over decode's window alone (`clocks_alone`) and beside the neighbour (`clocks_beside`):
whether decode slows beside the neighbour on SMs of its own because the clock drops under the power limit.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch

SIDE = 8192
MATMUL_FLOP = 2 * SIDE**3
WINDOW_S = 1.5  # decode replays per measurement: about this long
PENDING = 8  # matmuls an in-process neighbour keeps queued


def matrices(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    a, b = (torch.randn(SIDE, SIDE, device="cuda", generator=g).bfloat16() for _ in range(2))
    return a, b, torch.empty_like(a)


def rate_alone(a, b, c, count: int = 20) -> float:
    """TFLOP/s of the matmuls alone on the current stream."""
    torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(count):
        torch.matmul(a, b, out=c)
    torch.cuda.synchronize()
    return count * MATMUL_FLOP / (time.perf_counter() - start) / 1e12


def neighbour_child(conn, env: dict[str, str]) -> None:
    """The `mps:P` neighbour: an MPS client (env set before CUDA starts) that runs matmuls between 'go' and
    'stop' and sends back the host time of each completion."""
    os.environ.update(env)
    a, b, c = matrices(1)
    conn.send(rate_alone(a, b, c))
    conn.recv()  # go
    done = []
    while not conn.poll():
        torch.matmul(a, b, out=c)
        torch.cuda.synchronize()
        done.append(time.perf_counter())
    conn.recv()  # stop
    conn.send(done)


def disjoint_streams(decode_sms: int) -> tuple[torch.cuda.Stream, torch.cuda.Stream, int, int]:
    """(decode stream, rest stream, their SM counts): two green contexts over disjoint SMs of device 0."""
    from cuda.bindings import driver

    def check(result):
        error, *values = result if isinstance(result, tuple) else (result,)
        assert int(error) == 0, f"CUDA driver call failed: {error}"
        return values[0] if len(values) == 1 else values

    torch.cuda.init()
    print(f"splitting the device: {decode_sms} SMs for decode", file=sys.stderr, flush=True)
    device = check(driver.cuDeviceGet(torch.cuda.current_device()))
    whole = check(driver.cuDeviceGetDevResource(device, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    groups, _, rest = check(driver.cuDevSmResourceSplitByCount(1, whole, 0, decode_sms))
    streams = []
    for resource in (groups[0], rest):
        desc = check(driver.cuDevResourceGenerateDesc([resource], 1))
        context = check(
            driver.cuGreenCtxCreate(desc, device, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM)
        )
        raw = check(driver.cuGreenCtxStreamCreate(context, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
        streams.append(torch.cuda.ExternalStream(int(raw)))  # int(): the handle (getPtr() is its address)
    print(f"split: {groups[0].sm.smCount} + {rest.sm.smCount} SMs", file=sys.stderr, flush=True)
    return streams[0], streams[1], groups[0].sm.smCount, rest.sm.smCount


class InProcess:
    """The `stream`, `green:P` and `rest` neighbours: matmuls enqueued on a stream of this process (`rest`: the
    partition left beside decode's, `rest_stream`), an event after each."""

    def __init__(self, way: str, rest_stream: torch.cuda.Stream | None = None) -> None:
        self.context = None
        if way == "rest":
            assert rest_stream is not None, "the way rest needs --decode-sms"
            self.stream = rest_stream
        elif way == "stream":
            self.stream = torch.cuda.Stream()
        else:
            from torch.cuda.green_contexts import GreenContext

            sms = int(way.split(":")[1])
            self.context = GreenContext.create(num_sms=sms, device_id=torch.cuda.current_device())
            self.stream = self.context.Stream()
        self.a, self.b, self.c = matrices(2)
        with torch.cuda.stream(self.stream):
            self.alone_tflops = rate_alone(self.a, self.b, self.c)
        self.events: list[torch.cuda.Event] = []

    def top_up(self, pending: int = PENDING) -> None:
        """Keeps `pending` matmuls queued (the host must not enqueue seconds of them ahead: CUDA's launch queue
        then blocks it until most have run, alone, before the window opens)."""
        with torch.cuda.stream(self.stream):
            while sum(not e.query() for e in self.events[-pending:]) < pending:
                torch.matmul(self.a, self.b, out=self.c)
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self.events.append(event)

    def completed_in(self, begin: torch.cuda.Event, window_ms: float) -> tuple[int, bool]:
        torch.cuda.synchronize()
        times = [begin.elapsed_time(e) for e in self.events]
        self.events = []
        return sum(0 < t <= window_ms for t in times), max(times) >= window_ms


def decode_window(graph, step, start_at: int, steps: int, stream=None, between=None) -> tuple[torch.cuda.Event, float]:
    """Replays `steps` decode steps on `stream` (default: the current one), calling `between` after each
    launch and then until the last replay has run; (begin event, window ms)."""
    stream = stream or torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step.step.fill_(start_at)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(steps):
            graph.replay()
            if between is not None:
                between()
        end.record()
    while between is not None and not end.query():  # the host runs ahead of decode: keep feeding until it ends
        between()
        time.sleep(2e-4)
    end.synchronize()
    return begin, begin.elapsed_time(end)


def mps_neighbour(percent: str):
    """(process, pipe, its TFLOP/s alone) of an `mps:P` neighbour child, started and waiting for 'go'."""
    from rollplex.memory.mps import ACTIVE_THREAD_PERCENTAGE

    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(
        target=neighbour_child, args=(child, {ACTIVE_THREAD_PERCENTAGE: percent}), daemon=True
    )
    proc.start()
    return proc, parent, parent.recv()


def stop_neighbour(proc, parent) -> list[float]:
    """Stops a running `mps:P` neighbour; the host times of its completed matmuls."""
    parent.send("stop")
    done = parent.recv()
    proc.join(30)
    return done


def measure(
    way: str,
    graph,
    step,
    start_at: int,
    steps: int,
    alone_ms: float,
    whole_tflops: float,
    keep: list,
    split: tuple | None = None,
    clocks=None,
) -> dict:
    """One way's row. keep: holds the in-process neighbours to the end (a green context freed while torch still
    caches its stream's cuBLAS workspace could break a later call). split: (decode stream, rest stream) of
    `--decode-sms`: decode then replays on its partition. clocks: a `gpu_clocks.ClockLog` (`--clocks`) or None."""
    decode_stream, rest_stream = split or (None, None)
    wall0 = time.time()
    if way.startswith("mps:"):
        proc, parent, own_alone = mps_neighbour(way.split(":")[1])
        parent.send("go")
        time.sleep(0.3)  # the neighbour is running
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _, window_ms = decode_window(graph, step, start_at, steps, decode_stream)
        t1 = time.perf_counter()
        done = stop_neighbour(proc, parent)
        count, covered = sum(t0 < t <= t1 for t in done), bool(done) and done[-1] >= t1
        neighbour_s = t1 - t0
    else:
        hog = InProcess(way, rest_stream)
        own_alone = hog.alone_tflops
        hog.top_up()
        begin, window_ms = decode_window(graph, step, start_at, steps, decode_stream, hog.top_up)
        hog.top_up()  # still busy as the window closes
        count, covered = hog.completed_in(begin, window_ms)
        neighbour_s = window_ms / 1e3
        keep.append(hog)
    wall1 = time.time()
    beside_ms = window_ms / steps
    beside_tflops = count * MATMUL_FLOP / neighbour_s / 1e12
    return {
        "way": way, "decode_alone_ms": round(alone_ms, 4), "decode_beside_ms": round(beside_ms, 4),
        "decode_slowdown": round(beside_ms / alone_ms, 4), "neighbour_alone_tflops": round(own_alone, 1),
        "neighbour_whole_gpu_tflops": round(whole_tflops, 1), "neighbour_beside_tflops": round(beside_tflops, 1),
        "kept": round(alone_ms / beside_ms + beside_tflops / whole_tflops, 4), "covered": covered,
        **({} if clocks is None else {"clocks_beside": settled(clocks, wall0, wall1)}),
    }  # fmt: skip


def settled(clocks, t0: float, t1: float) -> dict | None:
    """The clocks' medians over [t0, t1], once nvidia-smi has written the window's last sample."""
    time.sleep(0.2)
    return clocks.window(t0, t1)


def measure_batch(
    args, model, batch: int, whole: float, keep: list, split, split_sms, kernels, clocks=None
) -> list[dict]:
    """Every way's row at one batch size (decode on `split`'s partition when given)."""
    from decode import NUM_SAMPLES, captured

    # under a split, the decode graphs are captured on decode's partition stream (StepGraphs captures on a
    # `torch.cuda.Stream()` of its own; a graph captured on the primary context ignores the stream it replays on)
    on_partition = mock.patch("torch.cuda.Stream", lambda *a, **k: split[0]) if split else nullcontext()
    with on_partition:
        engine = captured(model, batch, args.prompt_tokens, args.tokens, kernels)
    graphs = engine.graphs  # the full batch: all its prompts, its chunk's graph
    graph, step = graphs.graphs[batch, graphs.launch_count(batch // NUM_SAMPLES)], graphs.step
    start_at = args.tokens // 2
    _, warm_ms = decode_window(graph, step, start_at, 20)
    steps = max(20, int(WINDOW_S * 1e3 / (warm_ms / 20)))
    wall0 = time.time()
    _, alone_window = decode_window(graph, step, start_at, steps)
    extra = {} if clocks is None else {"clocks_alone": settled(clocks, wall0, time.time())}
    if split is not None:
        print(f"batch {batch}: decode alone on its partition", file=sys.stderr, flush=True)
        _, part_window = decode_window(graph, step, start_at, steps, split[0])
        extra |= {"decode_partition_ms": round(part_window / steps, 4), "partition_sms": split_sms}
    rows = []
    for way in args.ways:
        try:
            one = measure(way, graph, step, start_at, steps, alone_window / steps, whole, keep, split, clocks)
            row = {"batch": batch, **one, **extra}
        except Exception as error:  # e.g. a green context inside an MPS client: recorded, not fatal
            row = {"batch": batch, "way": way, "error": " ".join(str(error).split())[:300], **extra}
        rows.append(row)
        print(json.dumps(row), flush=True)
    del engine
    torch.cuda.empty_cache()
    return rows


def start_mps(self_percent: int | None):
    """A private MPS daemon, this process its client (before CUDA starts); the daemon is stopped at exit."""
    from rollplex.memory.mps import MpsDaemon

    daemon = MpsDaemon()
    daemon.start()
    os.environ.update(daemon.client_env(self_percent))
    return daemon


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ways", nargs="+", required=True, help="stream, green:P, mps:P")
    ap.add_argument("--self-percent", type=int, help="under MPS: this (decode) process's active-thread percentage")
    ap.add_argument("--model", default="3b")
    ap.add_argument("--batch", nargs="+", type=int, default=[32, 64])
    ap.add_argument("--prompt-tokens", type=int, default=5888)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--decode-sms", nargs="+", type=int, help="decode on a disjoint green partition of D SMs, per D")
    ap.add_argument(
        "--decode-kernels",
        default="cublas",
        choices=["cublas", "rollplex", "rollplex_pdl", "rollplex_fused"],
        help="a run.decode_kernels setting",
    )
    ap.add_argument("--clocks", action="store_true", help="nvidia-smi's SM clock and power over each window")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    bad = [w for w in args.ways if not (w in ("stream", "rest") or (w.split(":")[0] in ("green", "mps") and ":" in w))]
    if bad:
        sys.exit(f"share_efficiency: unknown ways {bad}: use stream, rest, green:P or mps:P")
    if "rest" in args.ways and args.decode_sms is None:
        sys.exit("share_efficiency: the way rest is the partition beside --decode-sms D: give D")
    daemon = start_mps(args.self_percent) if any(w.startswith("mps:") for w in args.ways) else None
    if not torch.cuda.is_available():
        sys.exit("share_efficiency: needs a CUDA GPU")
    sys.path.insert(0, str(Path(__file__).parent))
    from rollplex.kernels import tiles
    from rollplex.models.config import load_model_config
    from rollplex.models.model import Qwen2_5_VL
    from rollplex.rollout.weights import BY_NAME

    torch.manual_seed(0)
    model = Qwen2_5_VL(load_model_config(f"qwen2_5_vl_{args.model}"), dtype=torch.bfloat16, device="cuda").eval()
    whole = rate_alone(*matrices(3))
    if daemon is not None and args.self_percent is not None:  # this process is capped: an uncapped child's rate
        proc, parent, whole = mps_neighbour("100")
        parent.send("go")
        stop_neighbour(proc, parent)
    from gpu_clocks import ClockLog

    rows, keep, planned = [], [], tiles.sm_count
    clocks = ClockLog() if args.clocks else None
    with clocks or nullcontext():
        for requested in args.decode_sms or [None]:
            split, split_sms = None, None
            if requested is not None:
                decode_stream, rest_stream, decode_sms, rest_sms = disjoint_streams(requested)
                split, split_sms = (decode_stream, rest_stream), (decode_sms, rest_sms)
                keep.append(split)
                # our GEMMs plan their waves for decode's partition (a bench-only override, read at capture)
                tiles.sm_count = lambda device, n=decode_sms: n if device.type == "cuda" else planned(device)
            kernels = BY_NAME[args.decode_kernels]
            for batch in args.batch:
                rows += measure_batch(args, model, batch, whole, keep, split, split_sms, kernels, clocks)
            tiles.sm_count = planned
    result = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
        "mps_self_percent": args.self_percent if daemon else None, "decode_kernels": args.decode_kernels,
        "decode_sms_requested": args.decode_sms,
        "command": "python bench/share_efficiency.py " + " ".join(sys.argv[1:]), "rows": rows,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'batch':>5} {'way':>10} {'alone ms':>8} {'beside ms':>9} {'slowdown':>8} {'nb TF/s':>7} "
          f"{'whole':>6} {'beside':>6} {'kept':>6}")  # fmt: skip
    for r in rows:
        if "partition_sms" in r:
            print(f"{r['batch']:>5} decode on {r['partition_sms'][0]} SMs alone: {r['decode_partition_ms']:.3f} ms, "
                  f"neighbour on {r['partition_sms'][1]}")  # fmt: skip
        if "error" in r:
            print(f"{r['batch']:>5} {r['way']:>10} error: {r['error']}")
            continue
        print(f"{r['batch']:>5} {r['way']:>10} {r['decode_alone_ms']:8.3f} {r['decode_beside_ms']:9.3f} "
              f"{r['decode_slowdown']:8.3f} {r['neighbour_alone_tflops']:7.0f} "
              f"{r['neighbour_whole_gpu_tflops']:6.0f} {r['neighbour_beside_tflops']:6.0f} {r['kept']:6.3f}"
              f"{'' if r['covered'] else ' (not covered)'}")  # fmt: skip
    if daemon is not None:
        daemon.stop_after_exit()


if __name__ == "__main__":
    main()
