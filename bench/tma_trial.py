"""Trial: decode GEMMs that load W (and x) through Hopper's TMA (triton tensor descriptors) against the picked
tiles and torch, for the shapes where the picked tiles miss or are close (7B TP-1 QKV at 32 rows).

    python bench/tma_trial.py --out tma_trial_h200.json      # on the GPU
    TRITON_INTERPRET=1 python bench/tma_trial.py --check     # products only, on the CPU

A W tile of BLOCK_N output columns is BLOCK_N consecutive stored rows when BLOCK_N divides head_dim (the QKV
row map keeps a head's rows together), so one descriptor load fetches it. K split as `tiles.sum_splits` sums.
"""

# ruff: noqa: B023, SIM108 (trial code: closures called inside their loop iteration)
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollplex.kernels.qkv_gemm import stored_rows
from rollplex.kernels.tiles import sum_splits, zero_tile


@triton.jit
def tma_kernel(
    x_desc,  # [M, K], block [BLOCK_M, BLOCK_K]
    w_desc,  # K_MAJOR: [rows, K] block [BLOCK_N, BLOCK_K]; else a slab [K, N] block [BLOCK_K, BLOCK_N]
    y_ptr,
    p_ptr,
    M,
    N: tl.constexpr,
    K: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QKV: tl.constexpr,
    K_MAJOR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_SPLIT: tl.constexpr,
    SWAP: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    first = tl.program_id(1) * K_SPLIT
    col0 = pid_n * BLOCK_N
    row0 = stored_rows(col0, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 1) if QKV else col0
    if SWAP:  # y^T = W x^T: W's columns fill the MMA's rows, the few tokens its columns
        acc_t = zero_tile(BLOCK_N, BLOCK_M)
        for k0 in range(first, tl.minimum(first + K_SPLIT, K), BLOCK_K):
            acc_t = tl.dot(w_desc.load([row0, k0]), x_desc.load([0, k0]).T, acc_t)
        acc = acc_t.T
    else:
        acc = zero_tile(BLOCK_M, BLOCK_N)
    for k0 in range(first, tl.minimum(first + K_SPLIT, K) if not SWAP else first, BLOCK_K):
        a = x_desc.load([0, k0])
        if K_MAJOR:
            acc = tl.dot(a, w_desc.load([row0, k0]).T, acc)
        else:
            acc = tl.dot(a, w_desc.load([k0, col0]), acc)
    rows = tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    inside = rows[:, None] < M
    if SPLIT_K == 1:
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=inside)
    else:
        p = p_ptr + tl.program_id(1).to(tl.int64) * M * N + rows[:, None] * N + cols[None, :]
        tl.store(p, acc, mask=inside)


def tma_product(x, w, n, heads, k_major, block_n, block_k, split, stages, warps=4, swap=False):
    m, k = x.shape
    block_m = max(16, triton.next_power_of_2(m)) if swap else 16 if m <= 16 else 64
    x_desc = TensorDescriptor.from_tensor(x, [block_m, block_k])
    w_desc = TensorDescriptor.from_tensor(w, [block_n, block_k] if k_major else [block_k, block_n])
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partials = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    k_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    nh, kv, d = heads or (1, 1, 1)
    tma_kernel[(n // block_n, split)](
        x_desc, w_desc, y, partials, m, n, k, nh, kv, d, heads is not None, k_major, block_m, block_n, block_k,
        split, k_split, swap, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if split > 1:
        sum_splits(partials, y)
    return y


CASES = [  # (name, M, K, N, heads: QKV read K-major in Megatron order; None: an o_proj slab [K, N])
    ("7b_tp1_qkv", 32, 3584, 4608, (28, 4, 128)),
    ("7b_tp1_qkv", 64, 3584, 4608, (28, 4, 128)),
    ("7b_tp1_qkv", 8, 3584, 4608, (28, 4, 128)),
    ("7b_tp2_qkv", 32, 3584, 2304, (14, 2, 128)),
    ("3b_tp1_qkv", 32, 2048, 2560, (16, 2, 128)),
    ("3b_tp1_o_proj", 32, 2048, 2048, None),
    ("7b_tp1_o_proj", 32, 3584, 3584, None),
    ("7b_tp1_down_proj", 32, 18944, 3584, None),
]
CONFIGS = [  # (block_n, block_k, split, stages, warps, swap)
    (64, 128, 1, 6, 4, False),
    (128, 128, 3, 4, 4, False),
    (64, 128, 1, 6, 4, True),
    (64, 128, 1, 8, 4, True),
    (64, 256, 1, 4, 4, True),
    (128, 128, 1, 6, 4, True),
    (128, 128, 2, 6, 4, True),
    (64, 128, 2, 8, 4, True),
    (128, 64, 1, 8, 4, True),
    (64, 64, 1, 8, 4, True),
]


def operands(m, k, n, heads, device, dtype):
    from rollplex.kernels.qkv_layout import grouped_rows

    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) * k**-0.5).to(dtype)
    if heads is None:
        return x, w.T.contiguous(), (lambda: torch.matmul(x, w.T))
    w_grouped = w[grouped_rows(*heads).to(device)].contiguous()  # w is the Megatron order, w_grouped vLLM's
    return x, w, (lambda: torch.matmul(x, w_grouped.T))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path)
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    if args.check:
        check()
        return
    from gemm_layouts import time_us

    from rollplex.kernels.qkv_gemm import qkv_grouped_from_megatron
    from rollplex.kernels.transposed_gemm import matmul_transposed

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    results = []
    for name, m, k, n, heads in CASES:
        copies = max(2, -(-3 * l2 // (k * n * 2)))
        ops = [operands(m, k, n, heads, "cuda", torch.bfloat16) for _ in range(copies)]
        expected = ops[0][2]().float()
        if heads:
            ours = [lambda o=o: qkv_grouped_from_megatron(o[0], o[1], None, *heads) for o in ops]
        else:
            ours = [lambda o=o: matmul_transposed(o[0], o[1]) for o in ops]
        row = {"case": name, "M": m, "K": k, "N": n, "torch_us": time_us([o[2] for o in ops]),
               "picked_us": time_us(ours)}  # fmt: skip
        from rollplex.kernels.tiles import Tiles

        for stages in (4, 6):  # the picked kernel with 32-row tiles (not swept before)
            t = Tiles(32, 64, 128, num_stages=stages, split_k=1)
            call = qkv_grouped_from_megatron if heads else matmul_transposed
            extra = (None, *heads) if heads else ()
            row[f"picked_m32_s{stages}"] = time_us([lambda o=o: call(o[0], o[1], *extra, tiles=t) for o in ops])
        for block_n, block_k, split, stages, warps, swap in CONFIGS:
            if n % block_n or (heads and heads[2] % block_n) or (swap and not heads):
                continue
            key = f"tma_n{block_n}_k{block_k}_x{split}_s{stages}_w{warps}" + ("_swap" if swap else "")
            calls = [lambda o=o: tma_product(o[0], o[1], n, heads, heads is not None, block_n, block_k, split,
                                             stages, warps, swap) for o in ops]  # fmt: skip
            try:
                torch.testing.assert_close(calls[0]().float(), expected, atol=3e-2, rtol=2e-2)
                row[key] = time_us(calls)
            except Exception as e:  # a config that does not compile: out of shared memory
                row[key] = type(e).__name__
        results.append(row)
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                                        "torch": torch.__version__, "results": results}, indent=1))  # fmt: skip


def check() -> None:
    device = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for m, k, n, heads in [(5, 256, 512, (2, 1, 128)), (20, 512, 256, None), (40, 256, 1024, (4, 2, 128))]:
        for split in (1, 3):
            for swap in (False, True) if heads else (False,):
                x, w, ref = operands(m, k, n, heads, device, dtype)
                y = tma_product(x, w, n, heads, heads is not None, 64, 64, split, 2, swap=swap)
                torch.testing.assert_close(y.float(), ref().float(), atol=tol, rtol=tol)
    print("tma: products match")


if __name__ == "__main__":
    main()
