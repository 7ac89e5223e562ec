"""Trial: a stream-K decode GEMM against the picked split-K tiles and torch, for the shapes whose tiles leave SMs
idle (7B TP-1 QKV: 72 tiles of 64 columns on 132 SMs).

    python bench/streamk_trial.py --out streamk_trial_h200.json

Stream-K gives each of P programs an equal run of the (tile, K block) iterations in tile order, so a tile's K
loop may be shared by two or three programs. The partial products of a shared tile are summed in program
order, either by the program that holds its last K block, which waits on the others' flags (`fixup=inline`),
or by a second kernel (`fixup=kernel`). Both are deterministic: the partition and the order are fixed.
Timed as bench/gemm_layouts.py times (one CUDA graph, weights past L2). Under TRITON_INTERPRET=1 on the CPU it
only checks the products (`--check`).
"""

# ruff: noqa: B023 (trial code: closures called inside their loop iteration)
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rollplex.kernels.qkv_gemm import stored_rows
from rollplex.kernels.tiles import zero_tile


@triton.jit
def stream_k_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # element (k, n) of W^T at k * S_ROW + n * S_COL (n through the QKV row map when QKV)
    y_ptr,  # [M, N]
    p_ptr,  # [PROGRAMS * SLOTS, BLOCK_M, BLOCK_N] fp32 partials
    f_ptr,  # [PROGRAMS * SLOTS] int32 flags, zero between launches (inline fixup)
    M,
    N: tl.constexpr,
    K: tl.constexpr,
    S_ROW: tl.constexpr,
    S_COL: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    QKV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PROGRAMS: tl.constexpr,
    SLOTS: tl.constexpr,
    INLINE: tl.constexpr,
):
    KB: tl.constexpr = K // BLOCK_K
    COL_TILES: tl.constexpr = N // BLOCK_N
    pid = tl.program_id(0)
    total = ((M + BLOCK_M - 1) // BLOCK_M) * COL_TILES * KB
    start = pid * total // PROGRAMS
    end = (pid + 1) * total // PROGRAMS
    first_tile = start // KB
    ks = tl.arange(0, BLOCK_K)
    it = start
    while it < end:
        tile = it // KB
        kb0 = it - tile * KB
        kb1 = tl.minimum(KB, kb0 + end - it)
        rows = (tile // COL_TILES) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (tile % COL_TILES) * BLOCK_N + tl.arange(0, BLOCK_N)
        src = stored_rows(cols, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, 1) if QKV else cols
        x_tile = x_ptr + rows[:, None].to(tl.int64) * K + (kb0 * BLOCK_K + ks)[None, :]
        w_tile = w_ptr + (kb0 * BLOCK_K + ks)[:, None].to(tl.int64) * S_ROW + src[None, :].to(tl.int64) * S_COL
        acc = zero_tile(BLOCK_M, BLOCK_N)
        for _ in range(kb0, kb1):
            a = tl.load(x_tile, mask=rows[:, None] < M, other=0.0)
            b = tl.load(w_tile)
            acc = tl.dot(a, b, acc)
            x_tile += BLOCK_K
            w_tile += BLOCK_K * S_ROW
        inside = rows[:, None] < M
        y_tile = y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
        slot = pid * SLOTS + tile - first_tile
        p_tile = p_ptr + slot.to(tl.int64) * BLOCK_M * BLOCK_N + tl.arange(0, BLOCK_M)[:, None] * BLOCK_N
        p_tile += tl.arange(0, BLOCK_N)[None, :]
        if kb0 == 0 and kb1 == KB:
            tl.store(y_tile, acc.to(y_ptr.dtype.element_ty), mask=inside)
        elif INLINE and kb1 == KB:  # the tile's last part: add the earlier parts in program order, then store
            total_acc = zero_tile(BLOCK_M, BLOCK_N)
            q = ((tile * KB + 1) * PROGRAMS - 1) // total  # the program holding the tile's first K block
            while q < pid:
                q_slot = q * SLOTS + tile - (q * total // PROGRAMS) // KB
                while tl.atomic_cas(f_ptr + q_slot, 1, 0, sem="acquire") != 1:
                    pass
                q_tile = p_ptr + q_slot.to(tl.int64) * BLOCK_M * BLOCK_N
                q_tile += tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
                total_acc += tl.load(q_tile, mask=inside, other=0.0, cache_modifier=".cg")
                q += 1
            total_acc += acc
            tl.store(y_tile, total_acc.to(y_ptr.dtype.element_ty), mask=inside)
        else:
            tl.store(p_tile, acc, mask=inside)
            if INLINE:
                tl.debug_barrier()
                tl.atomic_xchg(f_ptr + slot, 1, sem="release")
        it += kb1 - kb0


@triton.jit
def stream_k_sum_kernel(
    y_ptr, p_ptr, M, N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PROGRAMS: tl.constexpr, SLOTS: tl.constexpr,
):  # fmt: skip
    """Per tile shared by several programs: the sum of their partials in program order."""
    KB: tl.constexpr = K // BLOCK_K
    COL_TILES: tl.constexpr = N // BLOCK_N
    tile = tl.program_id(0)
    total = ((M + BLOCK_M - 1) // BLOCK_M) * COL_TILES * KB
    q = ((tile * KB + 1) * PROGRAMS - 1) // total
    last = (((tile + 1) * KB) * PROGRAMS - 1) // total
    q_end = (q + 1) * total // PROGRAMS
    if q_end < (tile + 1) * KB:  # else one program holds the whole tile and stored it
        rows = (tile // COL_TILES) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (tile % COL_TILES) * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = rows[:, None] < M
        acc = zero_tile(BLOCK_M, BLOCK_N)
        while q <= last:
            q_slot = q * SLOTS + tile - (q * total // PROGRAMS) // KB
            q_tile = p_ptr + q_slot.to(tl.int64) * BLOCK_M * BLOCK_N
            q_tile += tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            acc += tl.load(q_tile, mask=inside, other=0.0)
            q += 1
        tl.store(y_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=inside)


def stream_k(x, w, n, s_strides, heads, block_n, block_k, programs, fixup, stages, workspace):
    """y [M, n] = x W^T with W read at (k, c) -> k * s_strides[0] + c * s_strides[1] (QKV rows mapped when
    heads); workspace: (partials, flags) from `workspace_for`."""
    m, k = x.shape
    block_m = 16 if m <= 16 else 64
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partials, flags = workspace
    slots = partials.shape[0] // programs
    nh, kv, d = heads or (1, 1, 1)
    stream_k_kernel[(programs,)](
        x, w, y, partials, flags, m, n, k, *s_strides, nh, kv, d, heads is not None, block_m, block_n, block_k,
        programs, slots, fixup == "inline", num_warps=4, num_stages=stages,
    )  # fmt: skip
    if fixup == "kernel":
        tiles = triton.cdiv(m, block_m) * (n // block_n)
        stream_k_sum_kernel[(tiles,)](y, partials, m, n, k, block_m, block_n, block_k, programs, slots)
    return y


def workspace_for(m, n, k, block_n, block_k, programs, device):
    block_m = 16 if m <= 16 else 64
    total = triton.cdiv(m, block_m) * (n // block_n) * (k // block_k)
    slots = triton.cdiv(triton.cdiv(total, programs), k // block_k) + 1
    partials = torch.empty(programs * slots, block_m, block_n, dtype=torch.float32, device=device)
    return partials, torch.zeros(programs * slots, dtype=torch.int32, device=device)


CASES = [  # (name, M, K, N, heads or None for a slab [K, N] (o_proj) / HF [N, K] (linear))
    ("7b_tp1_qkv", 32, 3584, 4608, (28, 4, 128)),
    ("7b_tp1_qkv", 64, 3584, 4608, (28, 4, 128)),
    ("7b_tp1_qkv", 8, 3584, 4608, (28, 4, 128)),
    ("3b_tp1_qkv", 32, 2048, 2560, (16, 2, 128)),
    ("3b_tp1_o_proj", 32, 2048, 2048, None),
    ("7b_tp1_o_proj", 32, 3584, 3584, None),
]


def operands(m, k, n, heads, device, dtype):
    from rollplex.kernels.qkv_layout import grouped_rows

    x = (torch.randn(m, k, device=device) * 1.0).to(dtype)
    if heads is None:
        w = (torch.randn(n, k, device=device) * k**-0.5).to(dtype)
        s = w.T.contiguous()
        return x, s, (n, 1), (lambda: torch.matmul(x, w.T)), w
    w = (torch.randn(n, k, device=device) * k**-0.5).to(dtype)  # Megatron order, bias left out
    rows = grouped_rows(*heads).to(device)
    w_grouped = w[rows].contiguous()
    return x, w, (1, k), (lambda: torch.matmul(x, w_grouped.T)), w_grouped


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path)
    p.add_argument("--check", action="store_true", help="only check the products (small, works on the CPU)")
    args = p.parse_args()
    if args.check:
        check()
        return
    from gemm_layouts import time_us

    from rollplex.kernels.qkv_gemm import qkv_grouped_from_megatron
    from rollplex.kernels.transposed_gemm import matmul_transposed

    results = []
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, m, k, n, heads in CASES:
        copies = max(2, -(-3 * l2 // (k * n * 2)))
        ops = [operands(m, k, n, heads, "cuda", torch.bfloat16) for _ in range(copies)]
        expected = ops[0][3]().float()
        if heads:
            ours = [lambda o=o: qkv_grouped_from_megatron(o[0], o[1], None, *heads) for o in ops]
        else:
            ours = [lambda o=o: matmul_transposed(o[0], o[1]) for o in ops]
        row = {"case": name, "M": m, "K": k, "N": n, "torch_us": time_us([o[3] for o in ops]),
               "picked_us": time_us(ours)}  # fmt: skip
        for block_n, block_k, stages, programs, fixup in [
            (64, 128, 6, sms, "inline"), (64, 128, 6, sms, "kernel"), (64, 64, 8, sms, "inline"),
            (64, 128, 4, sms, "inline"), (32, 128, 6, sms, "inline"), (128, 64, 6, sms, "inline"),
            (64, 128, 6, 2 * sms, "inline"),
        ]:  # fmt: skip
            if n % block_n or k % block_k or (heads and heads[2] % block_n):
                continue
            ws = workspace_for(m, n, k, block_n, block_k, programs, "cuda")
            calls = [lambda o=o, ws=ws: stream_k(o[0], o[1], n, o[2], heads, block_n, block_k, programs, fixup,
                                                 stages, ws) for o in ops]  # fmt: skip
            got = calls[0]().float()
            torch.testing.assert_close(got, expected, atol=3e-2, rtol=2e-2)
            again = calls[0]().float()
            assert torch.equal(got, again), "stream-K not repeatable"
            key = f"sk_n{block_n}_k{block_k}_s{stages}_p{programs}_{fixup}"
            try:
                row[key] = time_us(calls)
            except Exception as e:
                row[key] = repr(e)
        results.append(row)
        print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "triton": triton.__version__,
                                        "torch": torch.__version__, "results": results}, indent=1))  # fmt: skip


def check() -> None:
    device = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for m, k, n, heads in [
        (5, 256, 512, (2, 1, 128)),
        (20, 512, 256, None),
        (3, 384, 256, (2, 1, 64)),
        (40, 256, 1024, (4, 2, 128)),
    ]:
        for fixup in ("inline", "kernel"):
            for programs in (3, 7, 11):
                x, w, strides, ref, _ = operands(m, k, n, heads, device, dtype)
                ws = workspace_for(m, n, k, 64, 64, programs, device)
                y = stream_k(x, w, n, strides, heads, 64, 64, programs, fixup, 2, ws)
                tol = 1e-4 if dtype == torch.float32 else 2e-2
                torch.testing.assert_close(y.float(), ref().float(), atol=tol, rtol=tol)
                assert int(ws[1].sum()) == 0, "flags left set"
    print("stream_k: products match")


if __name__ == "__main__":
    main()
