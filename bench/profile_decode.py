"""Where a decode step's time goes: graph replay alone vs the whole step, and each kernel's GPU time.

    python bench/profile_decode.py --model 3b --batch 32 --prompt-tokens 512

Runs one rollout (which captures the graphs), then times replays of the full-batch graph back to back (no
sampling, no host work), and profiles the same step run eagerly: per kernel name, GPU microseconds per step.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from rollplex.models.config import load_model_config
from rollplex.models.inputs import Prompt
from rollplex.models.model import Qwen2_5_VL
from rollplex.models.sampling import SamplingParams
from rollplex.rollout.engine import RolloutEngine

NUM_SAMPLES = 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="3b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = Qwen2_5_VL(load_model_config(f"qwen2_5_vl_{args.model}"), dtype=torch.bfloat16, device="cuda").eval()
    g = torch.Generator().manual_seed(0)
    prompts = [Prompt(torch.randint(100, 10_000, (args.prompt_tokens,), generator=g)) for _ in range(args.batch // 8)]
    engine = RolloutEngine(model)
    params = SamplingParams(max_tokens=args.tokens)
    for seed in (0, 1):
        generator = torch.Generator("cuda").manual_seed(seed)
        engine.generate(prompts, num_samples=NUM_SAMPLES, params=params, generator=generator)
    step_ms = engine.stats.decode_s / engine.stats.num_steps * 1e3
    graphs, rows = engine.graphs, args.batch
    graphs.step.step.fill_(args.tokens // 2)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(50):
        graphs.graphs[rows].replay()
    torch.cuda.synchronize()
    replay_ms = (time.perf_counter() - start) / 50 * 1e3
    with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            graphs.step.forward(rows)
        torch.cuda.synchronize()
    print(f"\nstep (with sampling and host) {step_ms:.3f} ms, graph replay alone {replay_ms:.3f} ms")
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / 5
    print(f"eager kernels: {total / 1e3:.3f} ms of GPU time per step")
    print(f"{'us/step':>9} {'calls/step':>10}  kernel")
    for e in events[: args.top]:
        print(f"{e.device_time_total / 5:>9.1f} {e.count / 5:>10.0f}  {e.key[:110]}")


if __name__ == "__main__":
    main()
