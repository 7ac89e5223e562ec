"""The layout GEMMs against torch on the materialised layout, for Qwen2.5-VL shapes, on one GPU.

    python bench/gemm_layouts.py --out bench/results/gemm_layouts_h200.json [--sweep]
    # compile in parallel first: for i in $(seq 0 23); do python bench/gemm_layouts.py --sweep --compile-only \
    #     --shard $i/24 & done; wait

Per model (3B, 7B), rollout TP (1, 2), projection (o_proj and down_proj stored [I, O]: `matmul_transposed`;
fused qkv stored in Megatron order: `qkv_grouped_from_megatron`) and M rows (decode 1-64, prefill 4096):
the kernel's time and torch's on the weight rearranged the way torch wants it (x @ W^T on [O, I]; addmm with
the grouped qkv weight and bias), after checking that the outputs agree. Both are timed the way decode runs
them: one CUDA graph calls the product on enough copies of the weight to pass three times the L2 cache, so each
call reads its weight from HBM as a model's next layer would, and no launch gaps are counted. `speed` is torch
time / kernel time with the tiles the launcher picks; the targets are 0.9 for decode and 0.8 for prefill and
`meets_target` judges the picked tiles only. `--sweep` also times other tile configs per shape (for decode:
column tile widths times forced K splits) and records the fastest, to set the picking rules from.
Needs a CUDA GPU: the CPU interpreter times nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

ROWS = (1, 8, 32, 64, 4096)
DECODE_TARGET, PREFILL_TARGET = 0.9, 0.8


@dataclass(frozen=True, slots=True)
class Shape:
    model: str
    tp: int
    op: str  # o_proj | down_proj | qkv
    in_features: int
    out_features: int
    heads: tuple[int, int, int] | None = None  # (num_heads, num_kv_heads, head_dim) local to the rank, for qkv


def shapes(model: str, tp: int) -> list[Shape]:
    from rollplex.models.config import load_model_config

    t = load_model_config(f"qwen2_5_vl_{model}").text
    nh, kv, d = t.num_attention_heads // tp, max(1, t.num_key_value_heads // tp), t.head_dim
    return [
        Shape(model, tp, "o_proj", nh * d, t.hidden_size),
        Shape(model, tp, "down_proj", t.intermediate_size // tp, t.hidden_size),
        Shape(model, tp, "qkv", t.hidden_size, (nh + 2 * kv) * d, (nh, kv, d)),
    ]


def swap_candidates(shape: Shape, num_rows: int):
    """`swap_gemm`'s tiles for a fused QKV at decode rows: K split 1-8 ways (no part left empty), K tiles of 128
    and 256 rows, each with the deepest pipeline (up to 8 stages) that fits."""
    from rollplex.kernels.swap_gemm import SWAP_BLOCK_N, swap_tiles
    from rollplex.kernels.tiles import SHARED_BYTES, shortest_part

    if shape.heads is None or num_rows > 64:
        return []
    base = swap_tiles(num_rows, shape.out_features, shape.in_features, 132)
    found = []
    for block_k, k in itertools.product((128, 256), (1, 2, 3, 4, 6, 8)):
        stages = min(8, SHARED_BYTES // ((base.block_m + SWAP_BLOCK_N) * block_k * 2))
        if shortest_part(shape.in_features, k, block_k) > 0 and stages >= 2:
            found.append(replace(base, block_k=block_k, num_stages=stages, split_k=k))
    return found


def candidates(shape: Shape, num_rows: int, wide: bool = False):
    """Tile configs the sweep tries besides the picked one. Decode: each column tile width (16-128) times K
    unsplit or split 2, 3, 4 or 8 ways on every row (no part left empty), each with the deepest pipeline that
    fits one program per SM and the deepest that fits two; `wide` adds 8 warps and K tiles of 64 and 256 (for
    32-128 wide tiles split at most 3 ways). Prefill: other tile shapes and orderings, each with the
    launcher's wave rule and as one launch."""
    from rollplex.kernels.tiles import PREFILL, SHARED_BYTES, Tiles, pick_tiles, shortest_part

    if num_rows > 64:
        shapes = [replace(PREFILL, num_stages=4), replace(PREFILL, group_m=4), replace(PREFILL, group_m=16)]
        shapes += [replace(PREFILL, block_n=128, num_warps=w, num_stages=4) for w in (4, 8)]
        shapes += [Tiles(128, 128, 128, 8, 8, 3), Tiles(64, 256, 64, 8, 4, 4), Tiles(256, 128, 64, 8, 8, 3)]
        return [replace(t, split_k=k) for t in [PREFILL, *shapes] for k in (None, 1)][1:]  # PREFILL itself: picked
    base = pick_tiles(num_rows, 1 << 20)

    def deepest(n: int, budget: int) -> int | None:
        fitting = [s for s in (6, 4, 3, 2) if (base.block_m + n) * base.block_k * 2 * s <= budget]
        return fitting[0] if fitting else None

    found = []
    for n in (16, 32, 64, 128):
        for k in (1, 2, 3, 4, 8):
            if shortest_part(shape.in_features, k, base.block_k) <= 0:
                continue
            for stages in dict.fromkeys(deepest(n, b) for b in (SHARED_BYTES, SHARED_BYTES // 2)):
                if stages is not None:
                    found.append(replace(base, block_n=n, num_stages=stages, split_k=k))
    if wide:
        for n, k, block_k, warps in itertools.product((32, 64, 128), (1, 2, 3), (64, 128, 256), (4, 8)):
            stage = (base.block_m + n) * block_k * 2
            stages = next((s for s in (8, 6, 4, 3, 2) if s * stage <= SHARED_BYTES), None)
            config = replace(base, block_n=n, block_k=block_k, num_warps=warps, num_stages=stages, split_k=k)
            if stages is not None and shortest_part(shape.in_features, k, block_k) > 0 and config not in found:
                found.append(config)
    return found


def operands(shape: Shape, num_rows: int) -> tuple[Callable, Callable]:
    """(kernel(tiles, swap), torch()) closures over random bf16 operands in the stored and the materialised layout
    (`swap`: the fused QKV through `swap_gemm` with `tiles`)."""
    from rollplex.kernels.qkv_gemm import qkv_grouped_from_megatron
    from rollplex.kernels.qkv_layout import grouped_rows, num_stored_rows
    from rollplex.kernels.transposed_gemm import matmul_transposed

    def rand(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, device="cuda") * scale).to(torch.bfloat16)

    x = rand(num_rows, shape.in_features)
    if shape.heads is None:
        w = rand(shape.out_features, shape.in_features, scale=shape.in_features**-0.5)  # [O, I]
        s = w.T.contiguous()  # as stored: [I, O]
        return (lambda tiles=None, swap=False: matmul_transposed(x, s, tiles)), (lambda: torch.matmul(x, w.T))
    nh, kv, d = shape.heads
    n = num_stored_rows(nh, kv, d)
    w, b = rand(n, shape.in_features, scale=shape.in_features**-0.5), rand(n)  # as stored: Megatron order
    rows = grouped_rows(nh, kv, d).cuda()
    w_grouped, b_grouped = w[rows].contiguous(), b[rows].contiguous()  # as vLLM would hold them
    kernel = lambda tiles=None, swap=None: qkv_grouped_from_megatron(x, w, b, nh, kv, d, tiles=tiles, swap=swap)  # noqa: E731
    return kernel, (lambda: torch.addmm(b_grouped, x, w_grouped.T))


def weight_copies(shape: Shape) -> int:
    """Copies of the weight that together pass three times the L2 cache (at least two)."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(2, -(-3 * l2 // (shape.in_features * shape.out_features * 2)))


def time_us(calls: list[Callable], min_ms: float = 30.0) -> float:
    """Microseconds per call, from replays of one CUDA graph that makes every call once (each on its own copy of
    the weight), repeated until a replay set lasts at least `min_ms`."""
    for call in calls:  # compile before the capture (the captured calls allocate from the graph's pool)
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = 1
    while True:
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        if start.elapsed_time(end) >= min_ms:
            return start.elapsed_time(end) * 1e3 / (replays * len(calls))
        replays *= 4


def compile_only(shape: Shape, num_rows: int, sweep: bool, wide: bool = False, swap: bool = False) -> None:
    """Runs every tile config once: fills triton's on-disk cache, so that parallel `--compile-only --shard`
    processes can compile what one timing process then only times."""
    kernel, _ = operands(shape, num_rows)
    kernel()
    for tiles in (swap_candidates(shape, num_rows) if swap else candidates(shape, num_rows, wide)) if sweep else []:
        kernel(tiles, swap or None)
    torch.cuda.synchronize()


def measure(shape: Shape, num_rows: int, sweep: bool, wide: bool = False, swap: bool = False) -> dict:
    from rollplex.kernels.swap_gemm import SWAP_BLOCK_N, swap_tiles
    from rollplex.kernels.tiles import DECODE_MAX_M, pick_tiles, sm_count, wave_parts

    pairs = [operands(shape, num_rows) for _ in range(weight_copies(shape))]
    kernels, baselines = [k for k, _ in pairs], [b for _, b in pairs]
    expected = baselines[0]().float()
    torch.testing.assert_close(kernels[0]().float(), expected, atol=3e-2, rtol=2e-2)
    num_sms = sm_count(torch.device("cuda"))  # what the launcher plans with
    swapped = shape.heads is not None and num_rows <= DECODE_MAX_M and shape.heads[2] % SWAP_BLOCK_N == 0
    if swapped:  # what qkv_grouped_from_megatron launches (swap_fits holds for these operands)
        picked = swap_tiles(num_rows, shape.out_features, shape.in_features, num_sms)
        parts = [(0, num_rows, asdict(picked))]
    else:
        picked = pick_tiles(num_rows, shape.out_features, shape.in_features, num_sms, n_contiguous=shape.heads is None)
        parts = [
            (first, end, asdict(t))
            for first, end, t in wave_parts(num_rows, shape.out_features, shape.in_features, picked, num_sms)
        ]
    kernel_us, torch_us = time_us(kernels), time_us(baselines)
    target = DECODE_TARGET if num_rows <= 64 else PREFILL_TARGET
    row = {**asdict(shape), "rows": num_rows, "kernel_us": kernel_us, "torch_us": torch_us,
           "speed": torch_us / kernel_us, "target": target, "tiles": asdict(picked), "parts": parts,
           "copies": len(pairs), "kernel": "swap_gemm" if swapped else "pointer"}  # fmt: skip
    if sweep:
        swept, use_swap = (
            (swap_candidates(shape, num_rows), True) if swap else (candidates(shape, num_rows, wide), None)
        )
        for t in swept:  # a config timed and never checked could set a picking rule
            torch.testing.assert_close(kernels[0](t, use_swap).float(), expected, atol=3e-2, rtol=2e-2)
        timed = [(time_us([lambda k=k, t=t: k(t, use_swap) for k in kernels]), t) for t in swept]
        best_us, best = min(timed, key=lambda p: p[0]) if timed else (kernel_us, picked)
        row |= {"best_us": best_us, "best_speed": torch_us / best_us, "best_tiles": asdict(best),
                "swept": [{"us": us, "tiles": asdict(t)} for us, t in timed]}  # fmt: skip
    row["meets_target"] = row["speed"] >= target
    return row


def print_table(results: list[dict]) -> None:
    print(f"{'model':>5} {'tp':>2} {'op':>9} {'M':>5} {'K':>6} {'N':>6} {'kernel us':>10} {'torch us':>9} "
          f"{'speed':>6} {'best':>6} {'target':>6}")  # fmt: skip
    for r in results:
        best = f"{r['best_speed']:6.2f}" if "best_speed" in r else f"{'-':>6}"
        print(f"{r['model']:>5} {r['tp']:>2} {r['op']:>9} {r['rows']:>5} {r['in_features']:>6} "
              f"{r['out_features']:>6} {r['kernel_us']:10.1f} {r['torch_us']:9.1f} {r['speed']:6.2f} {best} "
              f"{r['target']:6.2f}{'' if r['meets_target'] else '  MISS'}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="JSON file to write (required unless --compile-only)")
    p.add_argument("--models", nargs="+", default=["3b", "7b"], choices=["3b", "7b", "32b", "72b"])
    p.add_argument("--tp", nargs="+", type=int, default=[1, 2])
    p.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    p.add_argument("--ops", nargs="+", default=["o_proj", "down_proj", "qkv"], choices=["o_proj", "down_proj", "qkv"])
    p.add_argument("--sweep", action="store_true", help="also time alternative tile configs")
    p.add_argument("--wide", action="store_true", help="with --sweep: decode also over warps and K tile sizes")
    p.add_argument("--swap", action="store_true", help="with --sweep: sweep swap_gemm's tiles (fused QKV, decode)")
    p.add_argument("--compile-only", action="store_true", help="only compile (warm triton's cache); no --out")
    p.add_argument("--shard", default="0/1", help="I/N: only every N-th (shape, rows) case from the I-th")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gemm_layouts: needs a CUDA GPU (timing under the CPU interpreter means nothing)")
    if args.out is None and not args.compile_only:
        sys.exit("gemm_layouts: --out FILE is required (or --compile-only)")
    torch.manual_seed(0)
    first, every = (int(v) for v in args.shard.split("/"))
    cases = [(s, m) for model in args.models for tp in args.tp for s in shapes(model, tp) for m in args.rows
             if s.op in args.ops]  # fmt: skip
    cases = cases[first::every]
    if args.compile_only:
        for s, m in cases:
            compile_only(s, m, args.sweep, args.wide, args.swap)
        return
    results = [measure(s, m, args.sweep, args.wide, args.swap) for s, m in cases]
    print_table(results)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": _triton_version()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    best = sum(max(r["speed"], r.get("best_speed", 0.0)) >= r["target"] for r in results)
    print(
        f"wrote {args.out}: {sum(r['meets_target'] for r in results)}/{len(results)} shapes meet the target with "
        f"the picked tiles" + (f", {best}/{len(results)} with the best swept" if args.sweep else "")
    )


def _triton_version() -> str:
    import triton

    return triton.__version__


if __name__ == "__main__":
    main()
