"""Decode beside a compute-bound neighbour on a partition of the SMs: how much it slows a decode step under each
setting of the decode kernels (`run.decode_kernels`).

    python bench/decode_beside.py --model 3b --batch 32 64 --prompt-tokens 5888 --tokens 2048 --beside-sms 33 66 \
        --out bench/results/decode_beside_3b_h200.json

Under `sharing.policy: green` the prefixes run on a green context of `prefix_sms` SMs while decode keeps the
default context; a prefill kernel holds its SMs, so decode's kernels run on the rest, and decode slows down beside
the prefixes. This measures the decode step alone. (Our GEMMs are not planned for the SMs left: waves planned
that way did no better than cuBLAS beside the neighbour.)
After a short rollout that captures the graphs (one engine per kernel setting; sequences end after 4 tokens), the
full-batch graph is replayed `--steps` times from the middle of a `--tokens` response cache, alone and while a
stand-in for the prefix runs on a green context of P SMs: back-to-back bf16 matmuls [8192 x 8192], enough to
outlast the replays (`covered` says whether they did). `--settings`: names of `run.decode_kernels`. Needs a
CUDA GPU with green contexts (torch >= 2.9).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from decode import NUM_SAMPLES, captured  # bench/ is this script's folder

from rollplex.models.config import load_model_config
from rollplex.models.model import Qwen2_5_VL
from rollplex.rollout.engine import RolloutEngine
from rollplex.rollout.weights import BY_NAME

HOG = 8192  # the stand-in's square matmul side


class Hog:
    """Back-to-back matmuls on a green context of `sms` SMs (the prefix's stand-in)."""

    def __init__(self, sms: int) -> None:
        from torch.cuda.green_contexts import GreenContext

        self.context = GreenContext.create(num_sms=sms, device_id=torch.cuda.current_device())
        self.stream = self.context.Stream()
        g = torch.Generator(device="cuda").manual_seed(sms)
        self.a, self.b = (torch.randn(HOG, HOG, device="cuda", generator=g).bfloat16() for _ in range(2))
        self.c = torch.empty_like(self.a)
        self.matmul_s = self._time(5) / 5

    def _time(self, count: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        self.start(count)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def start(self, count: int) -> torch.cuda.Event:
        """Enqueues `count` matmuls on the partition; returns an event recorded after them."""
        with torch.cuda.stream(self.stream):
            for _ in range(count):
                torch.matmul(self.a, self.b, out=self.c)
            done = torch.cuda.Event(enable_timing=True)
            done.record()
        return done


def step_ms(engine: RolloutEngine, batch: int, tokens: int, steps: int, hog: Hog | None) -> tuple[float, bool]:
    """Milliseconds per replay of the full-batch graph (alone, or beside the hog), and whether the hog outlasted
    the replays."""
    graphs = engine.graphs  # the full batch: all its prompts, its chunk's graph
    graph, step = graphs.graphs[batch, graphs.launch_count(batch // NUM_SAMPLES)], graphs.step
    start_at = (tokens - steps) // 2
    step.step.fill_(start_at)
    for _ in range(3):
        graph.replay()  # warm
    step.step.fill_(start_at)
    torch.cuda.synchronize()
    hog_done = hog.start(int(2.0 * steps * 0.01 / hog.matmul_s) + 1) if hog else None  # >= 2x a 10 ms step
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    covered = hog_done is None or begin.elapsed_time(hog_done) >= begin.elapsed_time(end)
    return begin.elapsed_time(end) / steps, covered


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="3b")
    ap.add_argument("--batch", nargs="+", type=int, default=[32, 64])
    ap.add_argument("--prompt-tokens", type=int, default=5888)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--beside-sms", nargs="+", type=int, default=[33, 66])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--settings", nargs="+", default=list(BY_NAME), choices=list(BY_NAME))
    ap.add_argument("--capture-only", action="store_true", help="only build every setting's engine (compiles)")
    args = ap.parse_args()
    if args.out is None and not args.capture_only:
        sys.exit("decode_beside: --out FILE is required (or --capture-only)")
    if not torch.cuda.is_available():
        sys.exit("decode_beside: needs a CUDA GPU")
    torch.manual_seed(0)
    model = Qwen2_5_VL(load_model_config(f"qwen2_5_vl_{args.model}"), dtype=torch.bfloat16, device="cuda").eval()
    hogs = {} if args.capture_only else {p: Hog(p) for p in args.beside_sms}
    settings = {name: BY_NAME[name] for name in args.settings}
    rows = []
    for batch in args.batch:
        for name, kernels in settings.items():
            engine = captured(model, batch, args.prompt_tokens, args.tokens, kernels)
            if args.capture_only:
                continue
            alone, _ = step_ms(engine, batch, args.tokens, args.steps, None)
            for p, hog in hogs.items():
                beside, covered = step_ms(engine, batch, args.tokens, args.steps, hog)
                row = {"batch": batch, "setting": name, "beside_sms": p, "alone_ms": round(alone, 4),
                       "beside_ms": round(beside, 4), "slowdown": round(beside / alone, 4),
                       "covered": covered}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
            del engine
            torch.cuda.empty_cache()
    if args.capture_only:
        return
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": args.model,
        "command": "python bench/decode_beside.py " + " ".join(sys.argv[1:]),
        "hog_matmul_ms": {p: round(h.matmul_s * 1e3, 3) for p, h in hogs.items()},
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'batch':>5} {'setting':>22} {'P':>3} {'alone ms':>9} {'beside ms':>9} {'slowdown':>8} covered")
    for r in rows:
        print(f"{r['batch']:>5} {r['setting']:>22} {r['beside_sms']:>3} {r['alone_ms']:9.3f} {r['beside_ms']:9.3f} "
              f"{r['slowdown']:8.3f} {r['covered']}")  # fmt: skip


if __name__ == "__main__":
    main()
