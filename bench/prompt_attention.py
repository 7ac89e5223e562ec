"""The prefix's decoder attention over packed prompts, one layer's call: every prompt in one ragged cuDNN call each
way (`cudnn_ragged.CudnnRaggedKernels`, where cudnn-frontend is installed), one causal cuDNN call a prompt
(`prompt_rows.PromptCausal`) and the prompts padded into one SDPA call, forward and forward + backward.

    python bench/prompt_attention.py --model 3b --iters 10 --out prompt_attention_3b_h200.json

Each goes through `PackedPromptKV` (q [1, H, T, D], k and v [1, G, T, D] of the prompts end to end; each form also
makes the boundary's padded K and V), bf16, CUDA-event medians after two untimed calls (the first builds cuDNN's
graphs); `peak_mib` is the allocator's peak over a forward + backward above what it held before (the inputs), and
`max_diff` each form's output and gradients against the padded call's. The ragged kernels start at the
capacities a run gives them (`--capacity` tokens a prompt). The bound is each prompt's own causal FLOPs (forward
2 H D n^2, with backward 2.5x more) at the H200's bf16 peak; `useful` is the share of the padded call's causal
work that is a prompt's own. The default lengths are the 3B spec's first step's prompts. Off a GPU a smoke run:
float32, the plain-torch calls in place of cuDNN's.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from flex_suffix import median_ms  # (bench/ is first on the path, as for every `python bench/X.py`)

from rollplex.bench.provenance import source_commit
from rollplex.models.attention import attention_length
from rollplex.models.cascade import REFERENCE, MathDense
from rollplex.models.config import load_model_config
from rollplex.models.cudnn_ragged import Capacity, CudnnRaggedKernels, ragged_attention_available
from rollplex.models.prompt_rows import CUDNN_CAUSAL, PackedPromptKV, PromptRows

PEAK_FLOPS = 796e12  # the H200's bf16 dense peak (`graph.modelcost.KNOWN_PEAKS`)
FIRST_STEP_PROMPTS = (4910, 6077, 5151, 4953, 6031, 5357, 6757, 6532)  # the 3B spec's step 1


def forms(num_prompts: int, capacity: int, device: torch.device) -> dict:
    """Each form's (dense, ragged) attention calls for `PackedPromptKV`."""
    if device.type != "cuda":
        return {"ragged": (None, REFERENCE), "per_prompt": (MathDense(causal=True), None), "padded": (None, None)}
    found = {}
    if ragged_attention_available(device):
        total = num_prompts * capacity
        found["ragged"] = (None, CudnnRaggedKernels(True, Capacity(num_prompts, capacity, capacity, total, total)))
    return found | {"per_prompt": (CUDNN_CAUSAL, None), "padded": (None, None)}


def measure(lens: tuple[int, ...], heads: int, groups: int, head_dim: int, iters: int, capacity: int) -> dict:
    cuda = torch.cuda.is_available()
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    rows = PromptRows.of(torch.tensor(lens), device)
    total = sum(lens)
    q, k, v = (torch.randn(1, h, total, head_dim, device=device, dtype=dtype) for h in (heads, groups, groups))
    grad = torch.randn_like(q)
    result, outputs = {}, {}
    for name, (dense, ragged) in forms(len(lens), capacity, device).items():
        inputs = [x.detach().requires_grad_() for x in (q, k, v)]

        def forward(inputs=inputs, dense=dense, ragged=ragged):
            attention = PackedPromptKV(rows.real, rows.num_prompts, rows.length, rows.lens, dense, ragged)
            return attention(0, *inputs)

        def forward_backward(forward=forward, inputs=inputs):
            out = forward()
            return out, *torch.autograd.grad(out, inputs, grad)

        for _ in range(2):
            forward_backward()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        outputs[name] = [x.float() for x in forward_backward()]
        peak = (torch.cuda.max_memory_allocated() - before) / 2**20 if cuda else 0.0
        with torch.no_grad():
            result[name] = {"forward_ms": median_ms(forward, iters)}
        result[name]["forward_backward_ms"] = median_ms(forward_backward, iters)
        result[name]["peak_mib"] = peak
    base = outputs["padded"]
    for name, got in outputs.items():  # output, dq, dk, dv against the padded call's
        result[name]["max_diff"] = [(a - b).abs().max().item() for a, b in zip(got, base, strict=True)]
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
    ap.add_argument("--capacity", type=int, default=8192, help="the ragged kernels' tokens a prompt (the budget)")
    ap.add_argument("--out", help="write the result here (JSON)")
    args = ap.parse_args()
    if len(args.lens) < 2 or min(args.lens) < 1 or len(set(args.lens)) == 1:
        sys.exit("prompt_attention: --lens takes two or more lengths >= 1, not all equal (nothing padded otherwise)")
    text = load_model_config(args.model if args.model == "tiny" else f"qwen2_5_vl_{args.model}").text
    result = measure(
        tuple(args.lens), text.num_attention_heads, text.num_key_value_heads, text.head_dim, args.iters, args.capacity
    )
    result.update(model=args.model, lens=args.lens, commit=source_commit(),
                  gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")  # fmt: skip
    for name in [n for n in ("ragged", "per_prompt", "padded") if n in result] + ["bound"]:
        forward, both = result[name]["forward_ms"], result[name]["forward_backward_ms"]
        extra = ""
        if "peak_mib" in result[name]:
            extra = f"   peak {result[name]['peak_mib']:7.0f} MiB   max diff {max(result[name]['max_diff']):.2e}"
        print(f"{name:10s} forward {forward:8.3f} ms   forward + backward {both:8.3f} ms{extra}")
    print(f"the padded call's useful share of causal work: {result['useful']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
