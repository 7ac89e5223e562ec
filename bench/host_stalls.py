"""Which host calls wait for an update's streamed copies: each call's host time just after a deferred
`ChunkedAdamW` step has queued its chunks (`sharing.update_beside_prefix`: the actor prefix's calls meet those
copies), against the same call with nothing queued.

    python bench/host_stalls.py --gib 16 --out bench/results/host_stalls_h200.json

The 7B prefix beside the update leaves the device idle for 120-200 ms at a time while the host sits in one call
(`cudaMemsetAsync`, a kernel launch) before cuDNN's attention; each stall lasts about as long as the chunks the
update keeps queued take to drain. Each call below is made in a state the runtime meets, a first use where the
call sets something up (what it sets up runs inside the timed call), and timed on the host alone:

- launch: a kernel launched before (an in-place add on a small tensor)
- kernel_first: the first launch of a torch kernel this process has not launched (a special function: under
  CUDA's lazy loading, the default, its code is loaded into the context then)
- memset: `cudaMemsetAsync` of a device buffer (through cupy), as cuDNN's attention zeroes its workspace
- sdpa_new: causal GQA attention (the prefix's call, on whichever backend torch picks: cuDNN on an H200) at a
  length this process has not run: a new cuDNN plan
- sdpa_again: the same call again
- matmul_new: a bf16 matmul at a row count this process has not run (cuBLAS picks a kernel)
- alloc: a tensor of --alloc-mib after the allocator's cache went back to the driver (new pages mapped; under
  expandable segments, as the runtime runs)
- pin: a pinned host tensor of a size the host allocator has not cached (cudaHostAlloc)

A call much slower queued than idle, by about the drain time, waits for the copies: the runtime should not make
it while an update streams (plan it before, or keep fewer chunks queued: `--ahead`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

CASES = ("launch", "kernel_first", "memset", "sdpa_new", "sdpa_again", "matmul_new", "alloc", "pin")


FIRST_KERNELS = (  # special functions no earlier call of the process ran: one per trial
    "bessel_j0", "bessel_j1", "bessel_y0", "bessel_y1", "modified_bessel_i0", "modified_bessel_i1",
    "modified_bessel_k0", "modified_bessel_k1", "scaled_modified_bessel_k0", "scaled_modified_bessel_k1",
    "erfcx", "i0e", "i1e", "ndtri", "log_ndtr", "spherical_bessel_j0", "airy_ai", "entr", "sinc", "i1",
)  # fmt: skip


class Calls:
    """Each case's call, made fresh at trial k (a length, row count or size no earlier trial used)."""

    def __init__(self, torch, args: argparse.Namespace) -> None:
        self.torch, self.args = torch, args
        self.small = torch.zeros(1 << 16, device="cuda")
        self.a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        self.qkv: list = []
        self.pinned: list = []  # kept, so that no later trial finds a cached block of its size

    def run(self, case: str, k: int) -> None:
        t = self.torch
        if case == "launch":
            self.small.add_(1.0)
        elif case == "kernel_first":
            getattr(t.special, FIRST_KERNELS[k])(self.small)
        elif case == "memset":
            import cupy

            stream = t.cuda.current_stream().cuda_stream
            cupy.cuda.runtime.memsetAsync(self.small.data_ptr(), 0, self.small.numel() * 4, stream)
        elif case in ("sdpa_new", "sdpa_again"):
            t.nn.functional.scaled_dot_product_attention(*self.qkv, is_causal=True, enable_gqa=True)
        elif case == "matmul_new":
            t.mm(self.a[: 1000 + 8 * (k + 1)], self.a)
        elif case == "alloc":
            t.empty(self.args.alloc_mib << 18, device="cuda")  # float32: MiB x 2^18 elements
        elif case == "pin":
            self.pinned.append(t.empty(64 << 18, pin_memory=True))
        else:
            raise ValueError(case)

    def prepare(self, case: str, k: int) -> None:
        """What the case needs before its timed call, with nothing in flight."""
        if case in ("sdpa_new", "sdpa_again"):
            length = self.args.length + 16 * (k + 1) + (8 if case == "sdpa_again" else 0)  # no other trial's
            self.qkv = [
                self.torch.randn(1, h, length, 128, device="cuda", dtype=self.torch.bfloat16)
                for h in (self.args.heads, self.args.kv_heads, self.args.kv_heads)
            ]
        if case == "sdpa_again":
            self.run(case, k)  # planned here: the timed call finds the plan
        if case == "alloc":
            self.torch.cuda.empty_cache()
        self.torch.cuda.synchronize()


def make_update(torch, args: argparse.Namespace):
    """A ChunkedAdamW over --gib of FP32 state in the pinned pool, in --chunk-mib chunks, with gradients set."""
    from rollplex.memory import in_flight
    from rollplex.memory.optimizer import ChunkedAdamW

    in_flight.AHEAD = args.ahead
    elements = (args.gib << 30) // 12  # 12 bytes of state per element
    sizes = [elements // 8] * 8
    params = [torch.nn.Parameter(torch.zeros(n, device="cuda", dtype=torch.bfloat16)) for n in sizes]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    return ChunkedAdamW(params, chunk_bytes=args.chunk_mib << 20)


def trial(torch, calls: Calls, update, case: str, k: int, queued: bool) -> dict:
    calls.prepare(case, k)
    if queued:
        update.step(defer=True)  # the norm, then --ahead chunks queued on the optimizer's streams
    start = time.perf_counter()
    calls.run(case, k)
    host_ms = (time.perf_counter() - start) * 1e3
    if queued:
        update.finish()
    torch.cuda.synchronize()
    return {"host_ms": host_ms, "drain_ms": (time.perf_counter() - start) * 1e3}


def measure(args: argparse.Namespace) -> dict:
    import torch

    calls, update = Calls(torch, args), make_update(torch, args)
    update.step()  # the first step's allocations and kernels, outside the clock
    torch.cuda.synchronize()
    rows = []
    for case in args.cases:
        runs = {"idle": [], "queued": []}
        for k in range(args.trials):
            for queued in (False, True):
                runs["queued" if queued else "idle"].append(trial(torch, calls, update, case, 2 * k + queued, queued))
        row = {"case": case}
        for name, rs in runs.items():
            row[name] = {
                "host_ms_median": round(statistics.median(r["host_ms"] for r in rs), 3),
                "host_ms_max": round(max(r["host_ms"] for r in rs), 3),
                "drain_ms_median": round(statistics.median(r["drain_ms"] for r in rs), 1),
            }
        rows.append(row)
    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "queued_gib": round(min(args.ahead, update.num_moved) * args.chunk_mib / 1024, 2),
        "cases": rows,
    }


def table(result: dict) -> str:
    lines = [f"host ms of each call (median / max), {result['queued_gib']} GiB of state copies queued or none"]
    lines.append(f"{'case':<11} {'idle':>17} {'queued':>17} {'queued drain ms':>16}")
    for r in result["cases"]:
        idle, queued = (f"{r[k]['host_ms_median']:.2f} / {r[k]['host_ms_max']:.2f}" for k in ("idle", "queued"))
        lines.append(f"{r['case']:<11} {idle:>17} {queued:>17} {r['queued']['drain_ms_median']:>16.1f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES))
    ap.add_argument("--gib", type=int, default=16, help="FP32 state the update streams")
    ap.add_argument("--chunk-mib", type=int, default=1024)
    ap.add_argument("--ahead", type=int, default=6, help="chunks the deferred update keeps queued (in_flight.AHEAD)")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--length", type=int, default=4864, help="the attention calls' first length (new ones above)")
    ap.add_argument("--heads", type=int, default=28)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--alloc-mib", type=int, default=2048)
    ap.add_argument("--no-expandable", action="store_true", help="torch's allocator without expandable segments")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:
        sys.exit(f"host_stalls: unknown cases {unknown}; choose from {list(CASES)}")
    if not args.no_expandable:  # before torch's allocator starts, as the runtime sets it (memory.expandable_segments)
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if "kernel_first" in args.cases and 2 * args.trials > len(FIRST_KERNELS):
        sys.exit(
            f"host_stalls: kernel_first has {len(FIRST_KERNELS)} kernels, enough for {len(FIRST_KERNELS) // 2} trials"
        )
    import torch

    if not torch.cuda.is_available():
        sys.exit("host_stalls: needs a CUDA GPU (it times host calls beside streamed copies)")
    result = measure(args)
    result["command"] = "python bench/host_stalls.py " + " ".join(sys.argv[1:])
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(table(result))


if __name__ == "__main__":
    main()
