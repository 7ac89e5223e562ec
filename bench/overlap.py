"""Phase 1 on one GPU: rollout decode with the reference and actor prefixes beside it, against running them
one after the other.

    python bench/overlap.py --model 3b --prompts 8 --samples 8 --prompt-tokens 5888 --policies streams green:66

Random-weight Qwen2.5-VL language model in bf16; text prompts (no vision encoder yet); response lengths drawn
from a long-tailed (log-normal) distribution, median `--median-len`, capped at `--max-len`, and replayed as
per-sequence length budgets. The prefixes run under no_grad here (an attached actor prefix of 47k tokens
would need its saved activations offloaded, which this bench does not model). Serial = rollout alone + both
prefixes alone (each timed on its own); a policy runs the prefixes as layer-by-layer chunks of one prompt
each beside decode, at most one chunk in flight (`rollplex.rollout.beside`). Reports the paper's Eq. 1 ideal
(T_D + T_P) / max(T_D, T_P), the measured speedup, the decode slowdown and whether outputs are unchanged.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

from rollplex.executors.bench import parse_policy
from rollplex.executors.policies import PrefixStreams, make_prefix_streams
from rollplex.graph.decisions import Sharing
from rollplex.models.config import load_model_config
from rollplex.models.inputs import Prompt
from rollplex.models.model import Qwen2_5_VL
from rollplex.models.sampling import SamplingParams
from rollplex.rollout.engine import RolloutEngine


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def policy_streams(policy: str, keep: list) -> PrefixStreams:
    """`inline`, `streams`, `green:<SMs>` or `green:adaptive` (`rollplex bench --policies`); `keep` holds the
    green contexts alive."""
    name, sms = parse_policy(policy)
    streams = make_prefix_streams(Sharing.of(name, sms), torch.device("cuda"))
    keep.append(streams)
    return streams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="3b")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=5888)
    ap.add_argument("--median-len", type=int, default=270)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--policies", nargs="+", default=["streams"])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    actor = Qwen2_5_VL(load_model_config(f"qwen2_5_vl_{args.model}"), dtype=torch.bfloat16, device="cuda").eval()
    reference = copy.deepcopy(actor)
    reference.pack_projections()
    g = torch.Generator().manual_seed(0)
    prompts = [Prompt(torch.randint(100, 10_000, (args.prompt_tokens,), generator=g)) for _ in range(args.prompts)]
    lens = torch.distributions.LogNormal(torch.tensor(float(args.median_len)).log(), torch.tensor(1.0))
    budgets = lens.sample((args.prompts, args.samples)).round().clamp(1, args.max_len).long().cuda()
    params = SamplingParams(max_tokens=args.max_len)
    engine = RolloutEngine(actor)

    def rollout(beside=None):
        gen = torch.Generator("cuda").manual_seed(1)
        return engine.generate(
            prompts, num_samples=args.samples, params=params, generator=gen, max_lens=budgets, beside=beside
        )

    def prefixes():
        with torch.no_grad():
            return [m.prefix([p], attached=False) for m in (reference, actor) for p in prompts]

    rollout()  # captures the graphs
    prefixes()
    alone, t_d = timed(rollout)
    decode_alone_s = engine.stats.decode_s
    expected, t_p = timed(prefixes)
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "command": "python bench/overlap.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "workload": {
            "prompts": args.prompts,
            "samples": args.samples,
            "prompt_tokens": args.prompt_tokens,
            "median_len": args.median_len,
            "max_len": args.max_len,
            "mean_len": round(float(budgets.float().mean()), 1),
        },
        "T_D_s": round(t_d, 4),
        "T_P_s": round(t_p, 4),
        "serial_s": round(t_d + t_p, 4),
        "ideal_speedup": round((t_d + t_p) / max(t_d, t_p), 4),
        "policies": [],
    }
    contexts: list = []
    for policy in args.policies:
        jobs = [m.prefix_chunks([p], attached=False) for m in (reference, actor) for p in prompts]
        beside = policy_streams(policy, contexts).beside(jobs)

        def together(beside=beside):
            out = rollout(beside)
            decode_s, during = engine.stats.decode_s, beside.num_chunks
            return out, beside.finish(), decode_s, during

        (out, boundaries, decode_s, during), total = timed(together)
        same = torch.equal(out.responses, alone.responses) and all(
            torch.equal(a.keys[-1], b.keys[-1]) and torch.equal(a.first_logprobs, b.first_logprobs)
            for a, b in zip(boundaries, expected, strict=True)
        )
        row = {
            "policy": policy,
            "total_s": round(total, 4),
            "speedup": round((t_d + t_p) / total, 4),
            "decode_s": round(decode_s, 4),
            "decode_slowdown": round(decode_s / decode_alone_s, 4),
            "chunks_during_decode": during,
            "chunks": beside.num_chunks,
            "outputs_equal": same,
        }
        print(json.dumps(row), flush=True)
        result["policies"].append(row)
    print(f"\nT_D {t_d:.3f} s, T_P {t_p:.3f} s, serial {t_d + t_p:.3f} s, ideal {result['ideal_speedup']:.3f}x")
    for r in result["policies"]:
        print(f"{r['policy']:>12}: {r['total_s']:.3f} s, {r['speedup']:.3f}x, decode x{r['decode_slowdown']:.3f}, "
              f"equal {r['outputs_equal']}")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
