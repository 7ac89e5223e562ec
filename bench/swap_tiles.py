"""The decode step's four GEMMs through `swap_gemm` over its tiles: where each choice of weight rows per program
and K split puts a product against the weight bytes it must read.

    python bench/swap_tiles.py --rows 8 32 64 --out bench/results/swap_tiles_3b_h200.json

Each product is launched as the fused decode step launches it (Qwen2.5-VL-3B at TP 1): the QKV projection with
its bias, o_proj and down_proj as the fp32 parts of a K split (the kernel after them adds them), gate_up with
silu(gate) * up inside the GEMM (K unsplit), and each but gate_up followed by the kernel that reads its parts in
the step (the residual add and the next norm, or the rotary and the cache write: a split's extra parts cost there;
`--alone` leaves it out). For each row count, the default tile (`swap_tiles`) and every alternative (64, 32 or 16
weight rows a program, K in 1-4 parts where the product may split, and with `--stages` shallower pipelines, which
let two programs share an SM) run as a CUDA graph of one call per layer (36 layers, each its own weight, so no
call finds its weight in L2) and are checked against the default (parts added in fp32). Programs past one wave
(132 SMs, one program an SM at the deepest pipeline) run as a second, partly idle wave: gate_up's 172 tiles of 64
rows are 1.3 waves. The bound: the weight bytes over the measured copy bandwidth.

With `--compile-only` each tile runs once and nothing is timed (Triton compiles on the host: start a few with
different `--products` in parallel first). Off a GPU (the tests) it runs under Triton's interpreter at the widths
times `--scale`, times from the host clock.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch
from decode import copy_bandwidth, replay_seconds, write_sweep  # bench/: this folder

from rollplex.kernels.swap_gemm import swap_product, swap_stages, swap_tiles
from rollplex.kernels.tiles import NUM_SMS_H200, Tiles, shortest_part

PRODUCTS = {  # name: (weight rows, K, bias, pair: gate rows of the [gate; up] block or 0), the 3B model at TP 1
    "qkv": (2560, 2048, True, 0),
    "o_proj": (2048, 2048, False, 0),
    "gate_up": (22016, 2048, False, 11008),
    "down": (2048, 11008, False, 0),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", nargs="+", type=int, default=[8, 32, 64], help="decode rows (tokens)")
    ap.add_argument("--products", nargs="+", default=list(PRODUCTS), choices=list(PRODUCTS))
    ap.add_argument("--block-n", nargs="+", type=int, default=[64, 32, 16], help="weight rows a program")
    ap.add_argument("--splits", nargs="+", type=int, default=[1, 2, 3, 4], help="K parts (unpaired products)")
    ap.add_argument("--stages", nargs="+", type=int, default=[0],
                    help="pipeline stages (0: the deepest that fits; fewer let two programs share an SM)")  # fmt: skip
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--scale", type=float, default=1.0, help="the widths times this (tests: small)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--alone", action="store_true", help="time each product without the kernel that reads it")
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bandwidth = copy_bandwidth() if device.type == "cuda" else None
    cases = []
    for name in args.products:
        rows_w, k, has_bias, pair = PRODUCTS[name]
        rows_w, k = _scaled(rows_w, args.scale), _scaled(k, args.scale)
        pair = rows_w // 2 if pair else 0  # one [gate; up] block
        weights = [_weight(rows_w, k, has_bias, seed, device) for seed in range(args.layers)]
        for m in args.rows:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device, _dtype(device))
            n = rows_w // 2 if pair else rows_w
            read = None if args.alone else _reader(name, m, n, x.dtype, device)
            default = swap_tiles(m, n, k, NUM_SMS_H200, paired=pair > 0, element_size=x.element_size())
            expected = None
            for tiles in [
                default,
                *(t for t in _alternatives(default, k, args, pair > 0, x.element_size()) if t != default),
            ]:
                call = _call(x, n, pair, tiles)
                parts = call(weights[0])
                if read is not None:
                    read(parts)  # compiles it for this many parts
                out = parts.float().sum(0)
                expected = out if expected is None else expected
                case = {"product": name, "rows": m, "tiles": dataclasses.asdict(tiles), "default": tiles == default,
                        "programs": -(-n // tiles.block_n) * tiles.split_k,
                        "max_diff_from_default": float((out - expected).abs().max())}  # fmt: skip
                if not args.compile_only:
                    timed = call if read is None else lambda w, c=call, r=read: r(c(w))
                    seconds = replay_seconds([lambda w=w, c=timed: c(w) for w in weights], args.replays) / len(weights)
                    weight_bytes = weights[0][0].numel() * weights[0][0].element_size()
                    case.update(us=seconds * 1e6, weight_mbytes=weight_bytes / 1e6, with_reader=read is not None)
                    if bandwidth:
                        case.update(of_bound=weight_bytes / bandwidth / seconds)
                    print(f"{name:<8} rows {m:>3} {_label(case):<22} {case['us']:8.2f} us"
                          + (f" ({case['of_bound']:.1%} of the bound)" if bandwidth else ""), flush=True)  # fmt: skip
                cases.append(case)
    if args.compile_only:
        return
    table(cases)
    if args.out:
        write_sweep(args.out, cases, bandwidth)


def _scaled(value: int, scale: float) -> int:
    """A width times `scale`, kept a multiple of 128 (whole swapped tiles, also in each half of a [gate; up]
    block) and at least 128."""
    return max(128, round(value * scale / 128) * 128)


def _weight(rows: int, k: int, has_bias: bool, seed: int, device: torch.device) -> tuple:
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(rows, k, generator=g, device=device, dtype=_dtype(device)) * k**-0.5
    return w, torch.randn(rows, generator=g, device=device, dtype=_dtype(device)) if has_bias else None


def _dtype(device: torch.device) -> torch.dtype:
    """bf16 on a GPU; fp32 under the interpreter, which has no bf16."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _alternatives(default: Tiles, k: int, args: argparse.Namespace, paired: bool, size: int) -> list[Tiles]:
    """Every (weight rows a program, K parts with none empty, pipeline stages) of the options; a stage count is
    capped at the deepest that fits, 0 is that deepest."""
    out = []
    for n in args.block_n:
        deepest = swap_stages(default.block_m, n, paired, size)
        stage_counts = dict.fromkeys(min(s, deepest) if s else deepest for s in args.stages)
        for split in [1] if paired else args.splits:
            if shortest_part(k, split, default.block_k) > 0:
                out += [dataclasses.replace(default, block_n=n, split_k=split, num_stages=s) for s in stage_counts]
    return out


def _call(x: torch.Tensor, n: int, pair: int, tiles: Tiles):
    """The product at `tiles` as the decode step launches it, as parts [S, M, N] (a paired product: one part)."""
    if pair:
        return lambda w: swap_product(x, w[0], None, n, tiles=tiles, pair=pair)[None]
    return lambda w: swap_product(x, w[0], w[1], n, tiles=tiles, unsummed=True)


def _reader(name: str, m: int, n: int, dtype: torch.dtype, device: torch.device):
    """The kernel the fused decode step runs on `name`'s parts, as a function of them (None for gate_up, read by a
    GEMM), timed only (its output is not checked here: tests/kernels/test_decode_ops.py does): o_proj's and down's
    parts go into the residual add and the next norm, QKV's into the rotary and the cache write (head_dim 128, one
    kv head for every ten heads, as the 3B model's 16 + 2 x 2)."""
    from rollplex.kernels.decode_ops import add_rms_norm, rotary_to_cache

    if name in ("o_proj", "down"):
        residual, weight = torch.randn(m, n, device=device, dtype=dtype), torch.ones(n, device=device, dtype=dtype)
        out = torch.empty(m, n, device=device, dtype=dtype)
        return lambda parts: add_rms_norm(parts, residual, weight, 1e-6, out)
    if name != "qkv":
        return None
    head_dim = 128
    groups = max(1, n // head_dim // 10)
    heads = n // head_dim - 2 * groups
    angles = torch.arange(8, device=device, dtype=torch.float32)[:, None] * torch.ones(head_dim, device=device)
    cos, sin = angles.cos(), angles.sin()
    slots, step = torch.arange(m, device=device), torch.zeros(1, dtype=torch.long, device=device)
    next_positions = torch.zeros(m + 1, dtype=torch.long, device=device)
    q = torch.empty(m, heads, head_dim, device=device, dtype=dtype)
    k_cache, v_cache = (torch.zeros(m, groups, 4, head_dim, device=device, dtype=dtype) for _ in range(2))

    return lambda parts: rotary_to_cache(parts, cos, sin, slots, next_positions, step, q, k_cache, v_cache, 1)


def _label(case: dict) -> str:
    t = case["tiles"]
    return f"n{t['block_n']}/k{t['split_k']}/s{t['num_stages']} ({case['programs']} programs)"


def table(cases: list[dict]) -> None:
    """Each product and row count: the default, then the three fastest alternatives."""
    print(f"\n{'product':<8} {'rows':>4} {'tiles':<32} {'us':>8} {'of bound':>8} {'max diff':>8}")
    for key in dict.fromkeys((c["product"], c["rows"]) for c in cases):
        mine = [c for c in cases if (c["product"], c["rows"]) == key]
        best = sorted((c for c in mine if not c["default"]), key=lambda c: c["us"])[:3]
        for c in [next(c for c in mine if c["default"]), *best]:
            share = f"{c['of_bound']:8.1%}" if "of_bound" in c else f"{'-':>8}"
            label = _label(c) + (" default" if c["default"] else "")
            print(f"{key[0]:<8} {key[1]:>4} {label:<32} {c['us']:8.2f} {share} {c['max_diff_from_default']:8.4f}")


if __name__ == "__main__":
    main()
