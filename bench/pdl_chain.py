"""Does a programmatic dependent launch (PDL) shorten a chain of decode GEMMs? On one Hopper GPU.

    python bench/pdl_chain.py --model 3b --out bench/results/pdl_chain_3b_h200.json

A decode step runs ~10 kernels per layer (36 layers for 3B) in one CUDA graph, and each small kernel pays a
launch and a ramp-up and drain in which little data moves: at batch 32 the 3B step takes 2.89 ms against a
1.50 ms HBM bound (README, "Rollout decode"). Under PDL the next kernel is launched while the one before drains,
and waits (griddepcontrol.wait) only before it reads. This times `--layers` dependent products
y <- y W_l^T at decode batch M, each W_l its own [d, d] weight (d = the model's hidden size: the o_proj shape;
the chain's weights pass the L2 cache, so each is read from HBM), inside one CUDA graph: torch.matmul (cuBLAS),
our transposed GEMM launched plainly, and the same with PDL. It reports microseconds and the HBM rate per
product. Ours with and without PDL must agree bitwise, and both must match torch within bf16 rounding.
Needs a CUDA GPU of compute capability 9.0 or newer.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch


def chain(x: torch.Tensor, weights: list[torch.Tensor], product: Callable) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        y = x
        for w in weights:
            y = product(y, w)
        return y

    return run


def measure(hidden: int, rows: int, layers: int) -> dict:
    from gemm_layouts import time_us  # bench/ is this script's folder: the same graph timing as the GEMM bench

    from rollplex.kernels.transposed_gemm import matmul_transposed

    g = torch.Generator(device="cuda").manual_seed(rows)
    w = [(torch.randn(hidden, hidden, device="cuda", generator=g) * hidden**-0.5).bfloat16() for _ in range(layers)]
    s = [t.T.contiguous() for t in w]  # stored [I, O]
    x = torch.randn(rows, hidden, device="cuda", generator=g).bfloat16()
    runs = {
        "torch": chain(x, w, lambda y, t: torch.matmul(y, t.T)),
        "ours": chain(x, s, lambda y, t: matmul_transposed(y, t)),
        "ours_pdl": chain(x, s, lambda y, t: matmul_transposed(y, t, pdl=True)),
    }
    row, outs = {"rows": rows, "layers": layers, "hidden": hidden}, {}
    for name, run in runs.items():
        try:  # one variant's failure (say, PDL under graph capture) is a result, not the end of the run
            outs[name] = run()
            us = time_us([run]) / layers  # one CUDA graph of the chain, replayed
            row[name] = {"us_per_product": us, "tb_per_s": hidden * hidden * 2 / us / 1e6}
        except Exception as e:
            row[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    torch_out = outs["torch"].float()
    row["relative_error_vs_torch"] = ((outs["ours"].float() - torch_out).norm() / torch_out.norm()).item()
    row["pdl_bitwise"] = "ours_pdl" in outs and torch.equal(outs["ours"], outs["ours_pdl"])
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="3b", choices=["3b", "7b"])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 32, 64, 128])
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        sys.exit("pdl_chain: needs a CUDA GPU of compute capability 9.0 or newer (programmatic dependent launch)")
    from rollplex.models.config import load_model_config

    hidden = load_model_config(f"qwen2_5_vl_{args.model}").text.hidden_size
    results = [measure(hidden, rows, args.layers) for rows in args.rows]
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"{'M':>4} {'torch us':>9} {'ours us':>8} {'PDL us':>7} {'TB/s':>5} bitwise")
    for r in results:
        us = [r[k].get("us_per_product", float("nan")) for k in ("torch", "ours", "ours_pdl")]
        rate = r["ours_pdl"].get("tb_per_s", float("nan"))
        print(f"{r['rows']:>4} {us[0]:9.2f} {us[1]:8.2f} {us[2]:7.2f} {rate:5.2f} {r['pdl_bitwise']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
