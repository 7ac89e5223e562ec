"""Compiles both kernels for sm_90 (H100/H200) on a machine without a GPU and prints what the cubin uses.

Run as a script (the test runs it in a subprocess without TRITON_INTERPRET, which would replace the kernels by
interpreted functions). Prints one JSON line per (kernel, regime).
"""

from __future__ import annotations

import json

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from rollplex.kernels.qkv_gemm import qkv_gemm_kernel
from rollplex.kernels.tiles import Tiles, pick_tiles
from rollplex.kernels.transposed_gemm import transposed_gemm_kernel

HOPPER = GPUTarget("cuda", 90, 32)
KERNELS = {
    "transposed": (
        transposed_gemm_kernel,
        {"x_ptr": "*bf16", "s_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32", "N": "i32"},
        {"K": 5504},  # down_proj of the 3B model at TP 2
    ),
    "qkv": (
        qkv_gemm_kernel,
        {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "M": "i32"},
        {"K": 2048, "NUM_HEADS": 16, "NUM_KV_HEADS": 2, "HEAD_DIM": 128, "KV_REP": 1, "HAS_BIAS": True},
    ),
}


def compile_for_hopper(name: str, tiles: Tiles) -> dict:
    fn, signature, constexprs = KERNELS[name]
    blocks = {"BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k, "GROUP_M": tiles.group_m}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(signature))}  # what a launch specialises to
    src = ASTSource(fn=fn, signature=signature, constexprs={**constexprs, **blocks}, attrs=aligned)
    kernel = triton.compile(src, target=HOPPER, options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})
    ptx = kernel.asm["ptx"]
    return {"kernel": name, "block_m": tiles.block_m, "shared_bytes": kernel.metadata.shared,
            "cp_async": "cp.async" in ptx, "wgmma": "wgmma" in ptx}  # fmt: skip


if __name__ == "__main__":
    for name in KERNELS:
        for num_rows in (1, 64, 4096):
            print(json.dumps(compile_for_hopper(name, pick_tiles(num_rows, 2048))))
