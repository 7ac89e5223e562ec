"""ChunkedAdamW at scale on one GPU: equality with torch.optim.AdamW, peak extra HBM vs the plan's bound,
and step time vs bytes moved over the measured host<->device bandwidth.

    python bench/chunked_adamw.py --params 3e9 --chunk-mib 1024 --out bench/results/chunked_adamw_3b.json

BF16 parameters with BF16 gradients live on the GPU; ChunkedAdamW keeps FP32 master weights and moments in
a pinned host pool. The oracle is clip_grad_norm_ + torch.optim.AdamW on an FP32 copy on the GPU.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from rollplex.graph.residency import OptimizerPlan
from rollplex.memory.optimizer import ChunkedAdamW

TENSOR_ELEMENTS = 64 << 20


def bandwidth(nbytes: int) -> dict[str, float]:
    """GB/s host->device, device->host, and both at once on two streams, over pinned memory."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / 3

    h2d = timed(lambda: dev.copy_(host, non_blocking=True))
    d2h = timed(lambda: host.copy_(dev, non_blocking=True))

    def both() -> None:
        with torch.cuda.stream(s1):
            dev.copy_(host, non_blocking=True)
        with torch.cuda.stream(s2):
            host2.copy_(dev2, non_blocking=True)

    bi = timed(both)
    return {"h2d_gbps": nbytes / h2d / 1e9, "d2h_gbps": nbytes / d2h / 1e9, "bidir_gbps": 2 * nbytes / bi / 1e9}


def ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """Spacing of bfloat16 numbers at |x| (8 significant bits)."""
    exponent = torch.floor(torch.log2(x.abs().clamp(min=2.0**-126)))
    return torch.pow(2.0, exponent - 7)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=3e9)
    ap.add_argument("--chunk-mib", type=int, default=1024)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    n = int(args.params)
    sizes = [TENSOR_ELEMENTS] * (n // TENSOR_ELEMENTS) + ([n % TENSOR_ELEMENTS] if n % TENSOR_ELEMENTS else [])
    params = [torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02 for s in sizes]
    grads = [torch.randn(s, device="cuda", dtype=torch.bfloat16) * 1e-3 for s in sizes]
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    start = time.perf_counter()
    opt = ChunkedAdamW(params, **hyper, max_grad_norm=1.0, chunk_bytes=args.chunk_mib << 20)
    setup_s = time.perf_counter() - start
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    bw = bandwidth(4 << 30)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        norm = opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak_extra = torch.cuda.max_memory_allocated() - base
    state_bytes = 12 * n
    plan = OptimizerPlan(state_bytes, args.chunk_mib << 20, len(opt.chunks), 3)
    # oracle: the same two steps with torch AdamW on an FP32 copy of the initial weights
    snapshot = [p.detach().float() for p in params]  # after the two steps, to compare
    ref = [torch.nn.Parameter(x) for x in _initial(sizes)]
    ref_opt = torch.optim.AdamW(ref, **hyper, foreach=False)
    for _ in range(2):
        for r, g in zip(ref, grads, strict=True):
            r.grad = g.float()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
        ref_opt.step()
    bf16_ok = all(
        ((s - r.detach()).abs() <= ulp_bf16(r.detach())).all().item() for s, r in zip(snapshot, ref, strict=True)
    )
    masters = opt.state_dict()["state"]
    master_err = max(
        ((masters[i]["master"].cuda() - r.detach()).abs().max() / r.detach().abs().max()).item()
        for i, r in enumerate(ref)
    )
    moved = opt.num_bytes_moved
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "params": n,
        "chunk_bytes": args.chunk_mib << 20,
        "num_chunks": len(opt.chunks),
        "bytes_moved_per_step": moved,
        "step_s": times,
        "setup_s": setup_s,
        **bw,
        "ideal_step_s_bidir": moved / (bw["bidir_gbps"] * 1e9),
        "step_over_ideal": times[-1] / (moved / (bw["bidir_gbps"] * 1e9)),
        "peak_extra_hbm_bytes": peak_extra,
        "optimizer_bound_bytes": opt.peak_device_bytes,
        "plan_bound_bytes": plan.workspace_bytes,
        "grad_norm": float(norm),
        "ref_grad_norm": float(ref_norm),
        "bf16_within_one_ulp_of_adamw": bf16_ok,
        "master_max_rel_err": master_err,
        "command": f"python bench/chunked_adamw.py --params {args.params:g} --chunk-mib {args.chunk_mib}",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


def _initial(sizes: list[int]) -> list[torch.Tensor]:
    """The same initial weights as main() drew (same seed, same order)."""
    torch.manual_seed(0)
    return [(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02).float() for s in sizes]


if __name__ == "__main__":
    main()
