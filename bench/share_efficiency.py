"""How much of the GPU decode and a compute-bound neighbour each keep when they share it, per way of sharing.

    python bench/share_efficiency.py --ways stream green:33 green:66 --out bench/results/share_green_3b_h200.json
    python bench/share_efficiency.py --ways mps:25 mps:50 mps:100 green:66 --out .../share_mps_3b_h200.json
    python bench/share_efficiency.py --self-percent 70 --ways mps:100 --out .../share_mps_self70_3b_h200.json

The decode step is the 3B rollout's full-batch CUDA graph (5,888-token prompts, replayed from the middle of a
2,048-token cache, as `decode_beside.py`); the neighbour stands in for the prefix work: back-to-back bf16
matmuls [8192 x 8192]. A way of sharing is where the neighbour runs: `stream` (a second stream, no partition),
`green:P` (a green context of P SMs in this process, the `green` policy) or `mps:P` (a child process, an MPS
client with CUDA_MPS_ACTIVE_THREAD_PERCENTAGE P; the `mps` policy's trainer). Any `mps:` way makes this
process an MPS client of a private daemon too, capped at `--self-percent` (default none: the `mps` policy's
rollout). For each way: decode's step time alone and beside the neighbour, and the neighbour's TFLOP/s alone
on the whole GPU (what serial's prefixes get) and beside decode, counted over the decode window from each
matmul's completion time. `kept` = decode alone / beside + neighbour beside / whole GPU: 1.0 is what time
slicing gives (the serial sum), above it the share saves time. Session 12 measured decode's slowdown beside
green partitions (`decode_beside.py`); this adds what the neighbour got and the MPS ways.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch

SIDE = 8192
MATMUL_FLOP = 2 * SIDE**3
WINDOW_S = 1.5  # decode replays per measurement: about this long


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


class InProcess:
    """The `stream` and `green:P` neighbours: matmuls enqueued on a stream of this process, an event after each."""

    def __init__(self, way: str) -> None:
        self.context = None
        if way == "stream":
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

    def start(self, seconds: float) -> None:
        count = int(seconds * self.alone_tflops * 1e12 / MATMUL_FLOP) + 1
        with torch.cuda.stream(self.stream):
            for _ in range(count):
                torch.matmul(self.a, self.b, out=self.c)
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self.events.append(event)

    def completed_in(self, begin: torch.cuda.Event, window_ms: float) -> tuple[int, bool]:
        torch.cuda.synchronize()
        times = [begin.elapsed_time(e) for e in self.events]
        self.events = []
        return sum(0 < t <= window_ms for t in times), max(times) >= window_ms


def decode_window(graph, step, start_at: int, steps: int) -> tuple[torch.cuda.Event, float]:
    """Replays `steps` decode steps; (begin event, window ms)."""
    step.step.fill_(start_at)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(steps):
        graph.replay()
    end.record()
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


def measure(way: str, graph, step, start_at: int, steps: int, alone_ms: float, whole_tflops: float, keep: list) -> dict:
    """One way's row. keep: holds the in-process neighbours to the end (a green context freed while torch still
    caches its stream's cuBLAS workspace could break a later call)."""
    if way.startswith("mps:"):
        proc, parent, own_alone = mps_neighbour(way.split(":")[1])
        parent.send("go")
        time.sleep(0.3)  # the neighbour is running
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _, window_ms = decode_window(graph, step, start_at, steps)
        t1 = time.perf_counter()
        parent.send("stop")
        done = parent.recv()
        proc.join(30)
        count, covered = sum(t0 < t <= t1 for t in done), bool(done) and done[-1] >= t1
        neighbour_s = t1 - t0
    else:
        hog = InProcess(way)
        own_alone = hog.alone_tflops
        hog.start(2.0 * steps * alone_ms / 1e3 + 0.3)
        time.sleep(0.05)
        begin, window_ms = decode_window(graph, step, start_at, steps)
        count, covered = hog.completed_in(begin, window_ms)
        neighbour_s = window_ms / 1e3
        keep.append(hog)
    beside_ms = window_ms / steps
    beside_tflops = count * MATMUL_FLOP / neighbour_s / 1e12
    return {
        "way": way, "decode_alone_ms": round(alone_ms, 4), "decode_beside_ms": round(beside_ms, 4),
        "decode_slowdown": round(beside_ms / alone_ms, 4), "neighbour_alone_tflops": round(own_alone, 1),
        "neighbour_whole_gpu_tflops": round(whole_tflops, 1), "neighbour_beside_tflops": round(beside_tflops, 1),
        "kept": round(alone_ms / beside_ms + beside_tflops / whole_tflops, 4), "covered": covered,
    }  # fmt: skip


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
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    bad = [w for w in args.ways if not (w == "stream" or (w.split(":")[0] in ("green", "mps") and ":" in w))]
    if bad:
        sys.exit(f"share_efficiency: unknown ways {bad}: use stream, green:P or mps:P")
    daemon = start_mps(args.self_percent) if any(w.startswith("mps:") for w in args.ways) else None
    if not torch.cuda.is_available():
        sys.exit("share_efficiency: needs a CUDA GPU")
    sys.path.insert(0, str(Path(__file__).parent))
    from decode import captured

    from rollplex.models.config import load_model_config
    from rollplex.models.model import Qwen2_5_VL
    from rollplex.rollout.weights import CUBLAS

    torch.manual_seed(0)
    model = Qwen2_5_VL(load_model_config(f"qwen2_5_vl_{args.model}"), dtype=torch.bfloat16, device="cuda").eval()
    whole = rate_alone(*matrices(3))
    if daemon is not None and args.self_percent is not None:  # this process is capped: an uncapped child's rate
        proc, parent, whole = mps_neighbour("100")
        parent.send("go"), parent.send("stop"), parent.recv(), proc.join(30)
    rows, keep = [], []
    for batch in args.batch:
        engine = captured(model, batch, args.prompt_tokens, args.tokens, CUBLAS)
        graph, step = engine.graphs.graphs[batch], engine.graphs.step
        start_at = args.tokens // 2
        _, warm_ms = decode_window(graph, step, start_at, 20)
        steps = max(20, int(WINDOW_S * 1e3 / (warm_ms / 20)))
        _, alone_window = decode_window(graph, step, start_at, steps)
        for way in args.ways:
            try:
                row = {"batch": batch, **measure(way, graph, step, start_at, steps, alone_window / steps, whole, keep)}
            except Exception as error:  # e.g. a green context inside an MPS client: recorded, not fatal
                row = {"batch": batch, "way": way, "error": " ".join(str(error).split())[:300]}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del engine
        torch.cuda.empty_cache()
    result = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
        "mps_self_percent": args.self_percent if daemon else None,
        "command": "python bench/share_efficiency.py " + " ".join(sys.argv[1:]), "rows": rows,
    }  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'batch':>5} {'way':>10} {'alone ms':>8} {'beside ms':>9} {'slowdown':>8} {'nb TF/s':>7} "
          f"{'whole':>6} {'beside':>6} {'kept':>6}")  # fmt: skip
    for r in rows:
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
