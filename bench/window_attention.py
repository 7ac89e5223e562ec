"""The vision tower's window attention at a spec's first step: flash attention's variable-length kernel (torch's
`varlen_attn`, what the tower ran on) against rollplex's one-program-a-window kernel (`kernels.window_attention`).

    python bench/window_attention.py specs/qwen2_5_vl_3b_h200.yaml [--iters 20] [--out F.json]

One block's call over every patch of the step's videos in window order (as the tower has them: q and k whole
tensors, v a view of the fused QKV output), forward and backward apart, CUDA-event medians after warm-up. The bound
is the bytes a call must move over an H200's 4.27 TB/s: forward q, k, v in and the output out; backward q, k, v,
the output and its gradient in, dq, dk, dv out (the log-sum-exp not counted). Prints each kernel's times and
efficiencies and their largest difference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from rollplex.data.source import batch_at, open_dataset
from rollplex.executors.task import make_tokenizer
from rollplex.graph.load import load_spec
from rollplex.kernels.window_attention import window_attention
from rollplex.models.vision import varlen_segments
from rollplex.models.vision_layout import patch_layout, window_order

BANDWIDTH = 4.27e12


def median_ms(fn, iters: int, calls: int = 5) -> float:
    """Median over `iters` of the mean time of `calls` calls back to back (the host's launch work overlaps the
    device's), after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out")
    args = ap.parse_args()
    loaded = load_spec(args.spec)
    spec, vision = loaded.spec, loaded.model.vision
    dataset = open_dataset(spec.workload.dataset, make_tokenizer(loaded), spec.run.seed, loaded.path.parent)
    examples = batch_at(dataset, 0, spec.workload.prompts_per_step)
    layout = patch_layout([v.grid_thw for e in examples for v in e.prompt.visuals], vision)
    device = torch.device("cuda")
    segments = varlen_segments(layout.take(window_order(layout)).windows, device)
    patches, heads, d = layout.rows.numel(), vision.num_heads, vision.head_dim
    qkv = torch.randn(patches, 3, heads, d, device=device, dtype=torch.bfloat16)
    grad = torch.randn(patches, heads, d, device=device, dtype=torch.bfloat16)
    from torch.nn.attention.varlen import varlen_attn

    bounds, longest = segments
    kernels = {
        "flash_varlen": lambda q, k, v: varlen_attn(q, k, v, bounds, bounds, longest, longest),
        "rollplex_window": lambda q, k, v: window_attention(q, k, v, *segments),
    }
    tensor = patches * heads * d * 2
    bound_ms = {"forward": 4 * tensor / BANDWIDTH * 1e3, "backward": 8 * tensor / BANDWIDTH * 1e3}
    # as the tower has them: q and k whole tensors (the rotary's outputs), v a view of the fused output
    inputs = [qkv[:, 0].contiguous(), qkv[:, 1].contiguous(), qkv[:, 2]]
    rows, outputs = {}, {}
    for name, fn in kernels.items():
        leaves = [x.detach().requires_grad_() for x in inputs]
        with torch.no_grad():
            forward = median_ms(lambda fn=fn: fn(*inputs), args.iters)
        out = fn(*leaves)
        backward = median_ms(lambda out=out, leaves=leaves: torch.autograd.grad(out, leaves, grad, retain_graph=True),
                             args.iters)  # fmt: skip
        rows[name] = {"forward_ms": forward, "backward_ms": backward}
        for key, bound in bound_ms.items():
            rows[name][f"{key}_efficiency"] = bound / rows[name][f"{key}_ms"]
        grads = torch.autograd.grad(out, leaves, grad)
        outputs[name] = (out.detach().float(), torch.stack(grads).float())
    (out_a, grad_a), (out_b, grad_b) = outputs.values()
    result = {
        "gpu": torch.cuda.get_device_name(),
        "command": "python bench/window_attention.py " + args.spec,
        "commit": os.environ.get("ROLLPLEX_COMMIT", ""),
        "shapes": {
            "patches": patches,
            "windows": segments.bounds.numel() - 1,
            "longest": segments.longest,
            "heads": heads,
            "head_dim": d,
        },
        "bound_ms": bound_ms,
        "kernels": rows,
        "max_abs_difference": {"out": float((out_a - out_b).abs().max()), "grad": float((grad_a - grad_b).abs().max())},
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{patches} patches, {result['shapes']['windows']} windows of at most {segments.longest}")
    print(f"{'kernel':<16} {'fwd ms':>8} {'eff':>5} {'bwd ms':>8} {'eff':>5}")
    for name, r in rows.items():
        print(f"{name:<16} {r['forward_ms']:8.3f} {r['forward_efficiency']:5.2f} {r['backward_ms']:8.3f} "
              f"{r['backward_efficiency']:5.2f}")  # fmt: skip
    print("max |difference|:", result["max_abs_difference"])


if __name__ == "__main__":
    main()
