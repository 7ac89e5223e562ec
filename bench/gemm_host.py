"""The host's time in a GEMM call, at a row count it meets for the first time and again: whether a packed batch's
new token count costs the host a library's search for a kernel on every call that meets it.

    python bench/gemm_host.py --rows 20 --out bench/results/gemm_host_h200.json

The scoring passes run the decoder over a packed batch whose token count M is new in almost every step (the
responses' lengths), so each of its GEMMs (forward: x W^T; backward: dy W and dy^T x) meets a shape it has not
met. For `--rows` row counts drawn once in [512, 16384] and the 3B decoder's projections and LM head, each call
is timed on the host alone (the device drained before it, so no wait for a full launch queue counts) at its
first row count and again at the same one; the table gives the median host microseconds of each, per product.
Off a GPU (the tests) the same calls run on the CPU, and their times say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from rollplex.bench.provenance import source_commit

SHAPES = {  # the 3B decoder's projections and LM head: [N, K] of W
    "qkv": (2560, 2048),
    "o_proj": (2048, 2048),
    "gate_up": (22016, 2048),
    "down": (2048, 11008),
    "lm_head": (151936, 2048),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20, help="row counts, each new to the process")
    ap.add_argument("--scale", type=float, default=1.0, help="the shapes' widths times this (tests: small)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    draws = random.Random(0).sample(range(512, 16385), args.rows)
    rows = []
    for name, (n, k) in SHAPES.items():
        n, k = max(8, int(n * args.scale)), max(8, int(k * args.scale))
        w = torch.randn(n, k, device=device, dtype=dtype)
        torch.matmul(w[:64], w[:64].t())  # the library's first call at these widths
        torch.empty(max(draws) * (k + 2 * n), device=device, dtype=dtype)  # x, dy and the output: kept once freed
        for m in draws:
            x, dy = torch.randn(m, k, device=device, dtype=dtype), torch.randn(m, n, device=device, dtype=dtype)
            for product, a, b in (("x W^T", x, w.t()), ("dy W", dy, w), ("dy^T x", dy.t(), x)):
                first, again = _host_seconds(a, b), _host_seconds(a, b)
                rows.append(
                    {"shape": name, "product": product, "m": m, "first_us": first * 1e6, "again_us": again * 1e6}
                )
    print(f"{'shape':<8} {'product':<7} {'first us':>9} {'again us':>9}  (medians over {args.rows} new row counts)")
    for name in SHAPES:
        for product in ("x W^T", "dy W", "dy^T x"):
            mine = [r for r in rows if r["shape"] == name and r["product"] == product]
            first, again = (statistics.median(r[key] for r in mine) for key in ("first_us", "again_us"))
            print(f"{name:<8} {product:<7} {first:9.1f} {again:9.1f}")
    if args.out:
        gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        args.out.write_text(
            json.dumps(
                {
                    "gpu": gpu,
                    "torch": torch.__version__,
                    "commit": source_commit(),
                    "command": " ".join(sys.argv),
                    "calls": rows,
                }
            )
        )


def _host_seconds(a: torch.Tensor, b: torch.Tensor) -> float:
    """Host seconds of a @ b launched onto a drained device."""
    if a.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    torch.matmul(a, b)
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
