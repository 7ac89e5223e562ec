"""The LM head's log-prob and entropy over a scoring batch's tokens: eager torch (FP32 logits, each chunk
checkpointed) against the fused kernels (`rollplex/kernels/token_scores.py`), forward alone (the reference's
scoring) and forward + backward (the actor's).

    python bench/token_scores.py --model 3b --tokens 17800 --iters 5 --out token_scores_3b_h200.json

Both run through `models.scores.token_scores` in its chunks; the eager path is forced by wrapping the head so the
fused path does not take it. CUDA-event medians; the bound is the head's matmul FLOPs (forward 2 M H V; with
backward, the recomputed forward and the two gradient products: 4x) at the device's peak, the logits' bytes
counted too (bf16, written and read once a pass), the larger of the two.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from flex_suffix import median_ms  # (bench/ is first on the path, as for every `python bench/X.py`)

from rollplex.bench.provenance import source_commit
from rollplex.models.config import load_model_config
from rollplex.models.scores import token_scores

MODELS = ("3b", "7b", "32b", "72b")
PEAK_FLOPS, PEAK_BYTES = 796e12, 4.27e12  # the H200's bf16 dense and HBM copy peaks (`graph.modelcost.KNOWN_PEAKS`)


class Eager(torch.nn.Module):
    """The head behind a wrapper: `token_scores` takes its eager path."""

    def __init__(self, head: torch.nn.Linear) -> None:
        super().__init__()
        self.head = head

    def forward(self, x):
        return self.head(x)


def timed(fn, iters: int) -> float:
    """Median ms of `fn` after one untimed call (which compiles the kernels)."""
    fn()
    torch.cuda.synchronize()
    return median_ms(fn, iters)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="3b")
    p.add_argument("--tokens", type=int, default=17800)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.model not in MODELS:
        sys.exit(f"bench/token_scores.py: no model {args.model!r}; name one of {', '.join(MODELS)}")
    if not torch.cuda.is_available():
        sys.exit("bench/token_scores.py needs a CUDA GPU (it times the fused kernels against eager torch)")
    t = load_model_config(f"qwen2_5_vl_{args.model}").text
    g = torch.Generator(device="cuda").manual_seed(0)
    head = torch.nn.Linear(t.hidden_size, t.vocab_size, bias=False, device="cuda", dtype=torch.bfloat16)
    hidden = torch.randn(args.tokens, t.hidden_size, device="cuda", dtype=torch.bfloat16, generator=g)
    targets = torch.randint(0, t.vocab_size, (args.tokens,), device="cuda", generator=g)
    weights = torch.randn(2, args.tokens, device="cuda", generator=g)
    flops = 2 * args.tokens * t.hidden_size * t.vocab_size
    logit_bytes = 2 * 2 * args.tokens * t.vocab_size  # bf16, written and read

    def forward(h):
        with torch.no_grad():
            token_scores(hidden, h, targets, t.vocab_size)

    def backward(h):
        x = hidden.detach().requires_grad_()
        lp, ent = token_scores(x, h, targets, t.vocab_size)
        (weights[0] * lp + weights[1] * ent).sum().backward()
        head.weight.grad = None

    rows, out = [], {}
    for name, h in (("eager", Eager(head)), ("fused", head)):
        for kind, fn, passes in (("forward", forward, 1), ("forward+backward", backward, 4)):
            ms = timed(lambda fn=fn, h=h: fn(h), args.iters)
            bound = max(passes * flops / PEAK_FLOPS, (passes - 1 if passes > 1 else 1) * logit_bytes / PEAK_BYTES)
            out.setdefault(name, {})[kind] = {"ms": round(ms, 2), "efficiency": round(bound * 1e3 / ms, 3)}
            rows.append(f"{name:6s} {kind:17s} {ms:8.2f} ms  {bound * 1e3 / ms:5.2f} of its bound")
    with torch.no_grad():
        e = token_scores(hidden, Eager(head), targets, t.vocab_size)
        f = token_scores(hidden, head, targets, t.vocab_size)
    diff = max(float((a - b).abs().max()) for a, b in zip(e, f, strict=True))
    result = {"what": "LM-head log-prob and entropy, eager vs fused", "model": args.model, "tokens": args.tokens,
              "gpu": torch.cuda.get_device_name(), "commit": source_commit(), "max_abs_difference": diff,
              **out}  # fmt: skip
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
    print("\n".join(rows) + f"\nmax |eager - fused| of the scores: {diff:.2e}")


if __name__ == "__main__":
    main()
