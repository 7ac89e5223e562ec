"""The prefix's decoder attention over packed prompts, one layer's call: one causal cuDNN call a prompt
(`prompt_rows.PromptCausal`) against the prompts padded into one SDPA call, forward and forward + backward.

    python bench/prompt_attention.py --model 3b --iters 10 --out prompt_attention_3b_h200.json

Both go through `PackedPromptKV` (q [1, H, T, D], k and v [1, G, T, D] of the prompts end to end; each form also
makes the boundary's padded K and V), bf16, CUDA-event medians after two untimed calls (the first builds cuDNN's
graphs). The bound is each prompt's own causal FLOPs (forward 2 H D n^2, with backward 2.5x more) at the H200's
bf16 peak; `useful` is the share of the padded call's causal work that is a prompt's own. The default lengths are
the 3B spec's first step's prompts. Off a GPU a smoke run: float32, the plain-torch call in place of cuDNN's.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from flex_suffix import median_ms  # (bench/ is first on the path, as for every `python bench/X.py`)

from rollplex.bench.provenance import source_commit
from rollplex.models.attention import attention_length
from rollplex.models.cascade import MathDense
from rollplex.models.config import load_model_config
from rollplex.models.prompt_rows import CUDNN_CAUSAL, PackedPromptKV, PromptRows

PEAK_FLOPS = 796e12  # the H200's bf16 dense peak (`graph.modelcost.KNOWN_PEAKS`)
FIRST_STEP_PROMPTS = (4910, 6077, 5151, 4953, 6031, 5357, 6757, 6532)  # the 3B spec's step 1


def measure(lens: tuple[int, ...], heads: int, groups: int, head_dim: int, iters: int) -> dict:
    cuda = torch.cuda.is_available()
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    rows = PromptRows.of(torch.tensor(lens), device)
    total = sum(lens)
    q, k, v = (torch.randn(1, h, total, head_dim, device=device, dtype=dtype) for h in (heads, groups, groups))
    grad = torch.randn_like(q)
    forms = {"per_prompt": CUDNN_CAUSAL if cuda else MathDense(causal=True), "padded": None}
    result = {}
    for name, dense in forms.items():
        inputs = [x.detach().requires_grad_() for x in (q, k, v)]

        def forward(inputs=inputs, dense=dense):
            attention = PackedPromptKV(rows.real, rows.num_prompts, rows.length, rows.lens, dense)
            return attention(0, *inputs)

        def forward_backward(forward=forward, inputs=inputs):
            torch.autograd.grad(forward(), inputs, grad)

        for _ in range(2):
            forward_backward()
        with torch.no_grad():
            result[name] = {"forward_ms": median_ms(forward, iters)}
        result[name]["forward_backward_ms"] = median_ms(forward_backward, iters)
    flops = sum(2 * heads * head_dim * n * n for n in lens)  # causal: half of 4 H D n^2
    padded = len(lens) * attention_length(max(lens)) ** 2
    result["bound"] = {"forward_ms": 1e3 * flops / PEAK_FLOPS, "forward_backward_ms": 3.5e3 * flops / PEAK_FLOPS}
    result["useful"] = sum(n * n for n in lens) / padded
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="3b", help="3b, 7b, ... (qwen2_5_vl_<this>), or tiny")
    ap.add_argument("--lens", nargs="+", type=int, default=list(FIRST_STEP_PROMPTS), help="prompt lengths (tokens)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", help="write the result here (JSON)")
    args = ap.parse_args()
    if len(args.lens) < 2 or min(args.lens) < 1 or len(set(args.lens)) == 1:
        sys.exit("prompt_attention: --lens takes two or more lengths >= 1, not all equal (nothing padded otherwise)")
    text = load_model_config(args.model if args.model == "tiny" else f"qwen2_5_vl_{args.model}").text
    result = measure(tuple(args.lens), text.num_attention_heads, text.num_key_value_heads, text.head_dim, args.iters)
    result.update(model=args.model, lens=args.lens, commit=source_commit(),
                  gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")  # fmt: skip
    for name in ("per_prompt", "padded", "bound"):
        forward, both = result[name]["forward_ms"], result[name]["forward_backward_ms"]
        print(f"{name:10s} forward {forward:8.3f} ms   forward + backward {both:8.3f} ms")
    print(f"the padded call's useful share of causal work: {result['useful']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
