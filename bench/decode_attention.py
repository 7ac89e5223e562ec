"""Decode attention alone at the rollout's shapes, over its launch options: where each choice of
`DecodeAttentionShape`'s chunk lengths and the partial kernel's warps and stages puts a layer's attention against
the bytes it must read.

    python bench/decode_attention.py --batch 8 32 64 --live 512 1536 --prompt-chunks 128 256 512 \
        --own-chunks 64 128 256 --warps 4 8 --out bench/results/decode_attention_3b_h200.json

Per batch (batch / 8 prompts of 8 sequences each; Qwen2.5-VL-3B's 16 heads over 2 kv heads of 128 by default),
per live response length (the step counter: each sequence has that many own keys, plus the one it writes) and per
option set, a CUDA graph of one call per layer (each layer its own prompt and response KV, as in a decode step,
so no layer's keys are in L2 from the call before) is replayed and timed. Every option set's output is checked
against the default's (the shape's own picks, 4 warps, 3 stages). The bound: the live prompt and own keys and
values over the measured copy bandwidth. The table lists each case's default and its fastest option sets.

With `--compile-only` each option set runs once per batch and live length and nothing is timed: Triton compiles
on the host, so start a few of those in parallel (split the option lists) before the timed run. Off a GPU (the
tests) the same runs under Triton's interpreter at the sizes given, times from the host clock.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
from decode import copy_bandwidth, replay_seconds, write_sweep  # bench/: this folder

from rollplex.kernels.decode_attention import DecodeAttention, DecodeAttentionShape

NUM_SAMPLES = 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", nargs="+", type=int, default=[8, 32, 64], help="sequences, a multiple of 8")
    ap.add_argument("--live", nargs="+", type=int, default=[512, 1536], help="own keys of each sequence")
    ap.add_argument("--prompt-tokens", type=int, default=5888)
    ap.add_argument("--tokens", type=int, default=2048, help="the response cache's length")
    ap.add_argument("--heads", type=int, nargs=3, default=[16, 2, 128], metavar=("H", "KV", "D"))
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--prompt-chunks", nargs="+", type=int, default=[128, 256, 512])
    ap.add_argument("--own-chunks", nargs="+", type=int, default=[64, 128, 256])
    ap.add_argument("--warps", nargs="+", type=int, default=[4])
    ap.add_argument("--stages", nargs="+", type=int, default=[3])
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bandwidth = copy_bandwidth() if device.type == "cuda" else None  # bytes moved per second, as decode.py
    options = [None, *itertools.product(args.prompt_chunks, args.own_chunks, args.warps, args.stages)]
    cases = []
    for batch in args.batch:
        layers = [Layer(args, batch, seed) for seed in range(args.layers)]
        for live in args.live:
            step = torch.tensor([min(live, args.tokens - 1)], device=device)
            default = None
            for option in options:
                case, out = time_option(args, layers, batch, step, option, default, bandwidth)
                default = out if option is None else default
                cases.append(case)
                if args.compile_only:
                    continue
                print(
                    f"batch {batch:>3} live {live:>5} {case['options']:<24} {case['us_per_layer']:8.2f} us"
                    + (f" ({case['of_bound']:.1%} of the bound)" if bandwidth else ""),
                    flush=True,
                )
    if args.compile_only:
        return
    table(cases)
    if args.out:
        write_sweep(args.out, cases, bandwidth)


class Layer:
    """One layer's inputs: queries, the prompts' KV [P, G, S, D] and the sequences' own KV [B, G, R, D]."""

    def __init__(self, args: argparse.Namespace, batch: int, seed: int) -> None:
        heads, kv_heads, dim = args.heads
        device = "cuda" if torch.cuda.is_available() else "cpu"
        g = torch.Generator(device=device).manual_seed(seed)
        bf16 = lambda *shape: torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16)  # noqa: E731
        self.prompts = batch // NUM_SAMPLES
        self.q = bf16(batch, heads, dim)
        self.prompt_k = bf16(self.prompts, kv_heads, args.prompt_tokens, dim)
        self.prompt_v = bf16(self.prompts, kv_heads, args.prompt_tokens, dim)
        self.own_k, self.own_v = bf16(batch, kv_heads, args.tokens, dim), bf16(batch, kv_heads, args.tokens, dim)
        self.prompt_lens = torch.full((self.prompts,), args.prompt_tokens, device=device)
        self.row_count = torch.full((self.prompts,), NUM_SAMPLES, device=device)
        self.row_start = self.row_count.cumsum(0) - self.row_count
        self.slots = torch.arange(batch, device=device)
        self.batch_prompts = torch.arange(self.prompts, device=device)  # every prompt has all its rows
        self.out = torch.empty_like(self.q)

    def call(self, attention: DecodeAttention, step: torch.Tensor) -> torch.Tensor:
        return attention(
            self.q, self.prompt_k, self.prompt_v, self.prompt_lens, self.row_start, self.row_count, self.own_k,
            self.own_v, self.slots, step, self.out, self.batch_prompts, self.prompts,
        )  # fmt: skip


def time_option(
    args, layers: list[Layer], batch: int, step: torch.Tensor, option, default, bandwidth
) -> tuple[dict, torch.Tensor]:
    """One option set at one batch and live length: its case (microseconds per layer, bound, and the largest
    difference of its output from the default's) and its output at layer 0."""
    heads, kv_heads, dim = args.heads
    prompt_chunk, own_chunk, warps, stages = option or (0, 0, 4, 3)
    shape = DecodeAttentionShape(
        batch // NUM_SAMPLES, NUM_SAMPLES, heads, kv_heads, dim, args.prompt_tokens, args.tokens, prompt_chunk,
        own_chunk, block=args.block, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    attention = DecodeAttention(shape, step.device)
    out = layers[0].call(attention, step).clone()
    case = {
        "batch": batch, "live": int(step), "options": _name(shape), "prompt_chunk": shape.chunk_for(shape.num_prompts),
        "own_chunk": shape.own_chunk, "warps": warps, "stages": stages, "default": option is None,
        "max_diff_from_default": 0.0 if default is None else float((out.float() - default.float()).abs().max()),
    }  # fmt: skip
    if args.compile_only:
        return case, out
    seconds = replay_seconds([lambda x=x: x.call(attention, step) for x in layers], args.replays)
    read = sum(x.element_size() * x[..., : int(step) + 1, :].numel() for x in (layers[0].own_k, layers[0].own_v))
    read += 2 * layers[0].prompt_k.numel() * layers[0].prompt_k.element_size()
    case.update(us_per_layer=seconds / len(layers) * 1e6, mbytes_per_layer=read / 1e6)
    if bandwidth:
        case.update(bound_us=read / bandwidth * 1e6, of_bound=read / bandwidth / (seconds / len(layers)))
    return case, out


def _name(shape: DecodeAttentionShape) -> str:
    return f"p{shape.chunk_for(shape.num_prompts)}/o{shape.own_chunk}/w{shape.num_warps}/s{shape.num_stages}"


def table(cases: list[dict]) -> None:
    """Each batch and live length: the default, then the three fastest option sets."""
    keys = sorted({(c["batch"], c["live"]) for c in cases})
    print(f"\n{'batch':>5} {'live':>5} {'options':<24} {'us/layer':>8} {'of bound':>8} {'max diff':>8}")
    for batch, live in keys:
        mine = [c for c in cases if (c["batch"], c["live"]) == (batch, live)]
        best = sorted((c for c in mine if not c["default"]), key=lambda c: c["us_per_layer"])[:3]
        for c in [next(c for c in mine if c["default"]), *best]:
            share = f"{c['of_bound']:8.1%}" if "of_bound" in c else f"{'-':>8}"
            label = c["options"] + (" (default)" if c["default"] else "")
            print(
                f"{batch:>5} {live:>5} {label:<24} {c['us_per_layer']:8.2f} {share} {c['max_diff_from_default']:8.4f}"
            )


if __name__ == "__main__":
    main()
