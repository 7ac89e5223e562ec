"""Compiles the kernels for sm_90 (H100/H200) on a machine without a GPU and prints what the cubin uses.

Run as a script (the test runs it in a subprocess without TRITON_INTERPRET, which would replace the kernels by
interpreted functions). Prints one JSON line per (GEMM kernel, regime); with `decode`, one per decode kernel
at Qwen2.5-VL-7B shapes instead.
"""

from __future__ import annotations

import json
import struct
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from rollplex.kernels.qkv_gemm import qkv_gemm_kernel
from rollplex.kernels.tiles import Tiles, pick_tiles
from rollplex.kernels.transposed_gemm import gate_up_tiles, transposed_gemm_kernel

HOPPER = GPUTarget("cuda", 90, 32)
KERNELS = {
    "transposed": (
        transposed_gemm_kernel,
        {"x_ptr": "*bf16", "s_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "p_ptr": "*fp32", "M": "i32"},
        {
            "K": 5504,
            "N": 2048,
            "SPLIT_K": 1,
            "K_SPLIT": 5504,
            "S_ROW": 2048,
            "S_COL": 1,
            "HAS_BIAS": False,
            "USE_GDC": False,
            "PAIR": 0,
            "AHEAD": False,
        },  # down_proj of the 3B model at TP 2
    ),
    "linear": (  # the same kernel on HF's [O, I] weight with its bias: the decode step's qkv of the 3B model
        transposed_gemm_kernel,
        {"x_ptr": "*bf16", "s_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "p_ptr": "*fp32", "M": "i32"},
        {
            "K": 2048,
            "N": 2560,
            "SPLIT_K": 1,
            "K_SPLIT": 2048,
            "S_ROW": 1,
            "S_COL": 2048,
            "HAS_BIAS": True,
            "USE_GDC": False,
            "PAIR": 0,
            "AHEAD": False,
        },
    ),
    "gate_up": (  # the same kernel's silu(gate) * up: the fused decode step's gate_up of the 3B model
        transposed_gemm_kernel,
        {"x_ptr": "*bf16", "s_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "p_ptr": "*fp32", "M": "i32"},
        {
            "K": 2048,
            "N": 11008,
            "SPLIT_K": 1,
            "K_SPLIT": 2048,
            "S_ROW": 1,
            "S_COL": 2048,
            "HAS_BIAS": False,
            "USE_GDC": False,
            "PAIR": 11008,
            "AHEAD": False,
        },
    ),
    "qkv": (
        qkv_gemm_kernel,
        {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16", "p_ptr": "*fp32", "M": "i32"},
        {
            "K": 2048,
            "NUM_HEADS": 16,
            "NUM_KV_HEADS": 2,
            "HEAD_DIM": 128,
            "KV_REP": 1,
            "HAS_BIAS": True,
            "SPLIT_K": 1,
            "K_SPLIT": 2048,
        },
    ),
}


def compile_for_hopper(name: str, tiles: Tiles, split: tuple[int, int] | None = None, gdc: bool = False) -> dict:
    """`split`: (SPLIT_K, K_SPLIT) to compile the K-split variant instead of the unsplit one; `gdc`: the
    programmatic-dependent-launch variant (USE_GDC) of the transposed GEMM."""
    fn, signature, constexprs = KERNELS[name]
    if gdc:
        constexprs = {**constexprs, "USE_GDC": True}
    blocks = {"BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k, "GROUP_M": tiles.group_m}
    if split is not None:
        constexprs = {**constexprs, "SPLIT_K": split[0], "K_SPLIT": split[1]}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(signature))}  # what a launch specialises to
    src = ASTSource(fn=fn, signature=signature, constexprs={**constexprs, **blocks}, attrs=aligned)
    kernel = triton.compile(src, target=HOPPER, options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})
    ptx = kernel.asm["ptx"]
    return {"kernel": name, "block_m": tiles.block_m, "shared_bytes": kernel.metadata.shared,
            "wait_first": wait_first(ptx), "cp_async": "cp.async" in ptx, "wgmma": "wgmma" in ptx,
            "gdc": "griddepcontrol.wait" in ptx}  # fmt: skip


def decode_kernels() -> dict:
    """(kernel, signature, constexprs) of every decode kernel at 7B shapes (28 heads, 4 kv heads, D 128); those the
    decode step can launch as programmatic dependents in that variant (USE_GDC)."""
    from rollplex.kernels import cascade as da
    from rollplex.kernels import decode_ops as ops
    from rollplex.kernels import sampling as sa
    from rollplex.kernels import tiles

    ptrs = lambda *names, t="*bf16": {n: t for n in names}  # noqa: E731
    heads = {"H": 28, "HPG": 7, "D": 128}
    return {
        "partial": (da.partial_kernel, {**ptrs("q_ptr", "prompt_k_ptr", "prompt_v_ptr", "own_k_ptr", "own_v_ptr"),
            **ptrs("prompt_lens_ptr", "row_start_ptr", "row_count_ptr", "batch_prompts_ptr", "slots_ptr", "step_ptr",
                   t="*i64"),
            **ptrs("prompt_out_ptr", "prompt_lse_ptr", "own_out_ptr", "own_lse_ptr", t="*fp32"),
            **ptrs("stride_kp", "stride_kg", "stride_ks", "stride_vp", "stride_vg", "stride_vs", "max_rows",
                   "prompt_programs", t="i32"),
            "scale": "fp32"}, {**heads, "G": 4, "R": 2048, "ROWS": 8, "PROMPT_HEADS": 8, "OWN_HEADS": 16,
            "PROMPT_CHUNK": 256, "PROMPT_SPLITS": 32, "OWN_CHUNK": 256, "OWN_SPLITS": 8, "BLOCK": 64, "USE_GDC": True,
            "AHEAD": False}),
        "combine": (da.combine_kernel, {**ptrs("prompt_out_ptr", "prompt_lse_ptr", "own_out_ptr", "own_lse_ptr",
            t="*fp32"), "out_ptr": "*bf16", "max_rows": "i32"}, {"H": 28, "D": 128, "PROMPT_SPLITS": 32,
            "OWN_SPLITS": 8, "PROMPT_LANES": 32, "OWN_LANES": 8, "USE_GDC": True, "AHEAD": False}),
        "add_rms_norm": (ops.add_rms_norm_kernel, {**ptrs("delta_ptr", "residual_ptr", "weight_ptr", "out_ptr"),
            "eps": "fp32", "part_stride": "i32"}, {"N": 3584, "BLOCK": 4096, "HAS_DELTA": True, "PARTS": 4,
            "USE_GDC": True, "AHEAD": False}),
        "rotary_to_cache": (ops.rotary_to_cache_kernel, {**ptrs("qkv_ptr", "q_out_ptr", "k_cache_ptr", "v_cache_ptr"),
            **ptrs("cos_ptr", "sin_ptr", t="*fp32"), **ptrs("slots_ptr", "next_positions_ptr", "step_ptr", t="*i64"),
            "part_stride": "i32"}, {"H": 28, "G": 4, "D": 128, "R": 2048, "NUM_SAMPLES": 8, "PARTS": 2,
            "USE_GDC": True, "AHEAD": False}),
        "silu_mul": (ops.silu_mul_kernel, ptrs("gate_up_ptr", "out_ptr"), {"N": 18944, "BLOCK": 1024, "USE_GDC": True}),
        "sample_partial": (sa.sample_partial_kernel, {"logits_ptr": "*bf16", "temperature_ptr": "*fp32",
            "partial_ptr": "*fp32", "index_ptr": "*i32",
            **ptrs("slots_ptr", "column_ptr", "seed_ptr", "batch_rows_ptr", "batch_slots_ptr", t="*i64")},
            {"V": 152064, "SPLITS": 38, "BLOCK": 4096}),
        "sample_finish": (sa.sample_finish_kernel, {"partial_ptr": "*fp32", "index_ptr": "*i32", "done_ptr": "*i8",
            "logprobs_ptr": "*fp32", **ptrs("slots_ptr", "column_ptr", "stop_ptr", "tokens_ptr", "last_token_ptr",
            "max_lens_ptr", t="*i64")}, {"R": 2048, "SPLITS": 38, "SPLITS_POW2": 64, "MAX_STOP": 16}),
        "sum_splits": (tiles.sum_splits_kernel, {"p_ptr": "*fp32", "y_ptr": "*bf16", "NUMEL": "i32"},
            {"SPLIT_K": 4, "BLOCK": 1024, "USE_GDC": True}),
    }  # fmt: skip


def compile_decode_kernel(name: str, fn, signature: dict, constexprs: dict) -> dict:
    names = list(fn.arg_names)
    ordered = {n: signature[n] for n in names if n in signature}
    missing = [n for n in names if n not in signature and n not in constexprs]
    assert not missing, f"{name}: no type for {missing}"
    kernel = triton.compile(ASTSource(fn=fn, signature=ordered, constexprs=constexprs), target=HOPPER)
    ptx = kernel.asm["ptx"]
    return {"kernel": name, "shared_bytes": kernel.metadata.shared, "gdc": "griddepcontrol.wait" in ptx,
            **before_wait(ptx), **registers(kernel.asm["cubin"])}  # fmt: skip


def registers(cubin: bytes) -> dict:
    """Registers a thread and local-memory bytes a thread (where registers spill) of the cubin's kernel, read from
    its ELF `.nv.info` attributes (REGCOUNT 0x2f, FRAME_SIZE 0x11), which `triton.compile` fills without a GPU
    (Triton's own register counts need the driver)."""
    section_at = struct.unpack_from("<Q", cubin, 0x28)[0]  # ELF64: the section headers' offset, then their size,
    entry_size, count, names = struct.unpack_from("<HHH", cubin, 0x3A)  # count and the names section's index
    sections = [struct.unpack_from("<IIQQQQ", cubin, section_at + i * entry_size) for i in range(count)]
    strings = sections[names][4]
    found = {}
    for name, _, _, _, offset, size in sections:
        if cubin[strings + name : cubin.index(b"\0", strings + name)] != b".nv.info":
            continue
        at = offset
        while at < offset + size:  # records: format byte, attribute byte, then by format a value or a sized one
            form, attribute = cubin[at], cubin[at + 1]
            if form == 0x04:  # sized: u16 size, then (kernel symbol, value) for the attributes read here
                length = struct.unpack_from("<H", cubin, at + 2)[0]
                if length == 8:
                    found[attribute] = struct.unpack_from("<I", cubin, at + 8)[0]
                at += 4 + length
            else:
                at += 2 if form == 0x01 else 4
    return {"registers": found.get(0x2F), "local_bytes": found.get(0x11, 0)}


def swap_kernel(pair: int) -> tuple:
    """The swapped decode GEMM at the 3B model's decode shapes: qkv with its bias (pair 0) or the fused gate_up."""
    from rollplex.kernels.swap_gemm import swap_gemm_kernel

    signature = {"x_desc": "tensordesc<bf16[32, 128]>", "w_desc": "tensordesc<bf16[64, 128]>", "w_ptr": "*bf16",
                 "b_ptr": "*bf16", "y_ptr": "*bf16", "p_ptr": "*fp32", "M": "i32"}  # fmt: skip
    shape = {"N": 11008, "HAS_BIAS": False} if pair else {"N": 2560, "HAS_BIAS": True}
    constexprs = {**shape, "K": 2048, "QKV": False, "NUM_HEADS": 1, "NUM_KV_HEADS": 1, "HEAD_DIM": 1, "KV_REP": 1,
                  "BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 1, "K_SPLIT": 2048, "PAIR": pair,
                  "USE_GDC": True, "LINE": 64}  # fmt: skip
    return swap_gemm_kernel, signature, constexprs


def ahead_kernels() -> dict:
    """The kernels `ahead` launches (`rollplex.kernels.pdl`), each with AHEAD set: the swapped GEMM also with its
    weight prefetch."""
    chain = {
        n: k for n, k in decode_kernels().items() if n in ("partial", "combine", "add_rms_norm", "rotary_to_cache")
    }
    gemms = {"swap_qkv": (*swap_kernel(0)[:2], {**swap_kernel(0)[2], "PREFETCH_K": 2048}),
             "swap_gate_up": (*swap_kernel(11008)[:2], {**swap_kernel(11008)[2], "PREFETCH_K": 256})}  # fmt: skip
    return {name: (fn, sig, {**ce, "AHEAD": True}) for name, (fn, sig, ce) in {**chain, **gemms}.items()}


def launch_order(ptx: str) -> dict:
    """Where a dependent launch lets the next kernel go (before or after it waits) and what it does before it
    waits (`before_wait`)."""
    wait, launch = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    return {"launch_first": 0 <= launch < wait, **before_wait(ptx)}


def before_wait(ptx: str) -> dict:
    """What a dependent launch does before its first griddepcontrol.wait in the PTX (everything, where it never
    waits; a kernel whose branches each wait, as the attention's partials, shows the first branch): global loads
    and L2 prefetches counted, and which kinds of global write or asynchronous copy it issues (a write there could
    race the kernel before it; a load may read only what no kernel of the chain writes, `pdl.enter`)."""
    wait = ptx.find("griddepcontrol.wait")
    before = ptx if wait < 0 else ptx[:wait]
    writes = [op for op in ("st.global", "cp.async", "atom.global", "red.global") if op in before]
    return {"loads_before_wait": before.count("ld.global"), "writes_before_wait": writes,
            "prefetches_before_wait": before.count("prefetch.global.L2")}  # fmt: skip


def wait_first(ptx: str) -> bool | None:
    """Whether griddepcontrol.wait comes before every global memory access of the kernel (None: it never waits):
    a dependent launch that read or wrote before it could race the kernel before it."""
    at = ptx.find("griddepcontrol.wait")
    if at < 0:
        return None
    accesses = (ptx.find(op) for op in ("ld.global", "st.global", "cp.async", "atom.global", "red.global"))
    return all(a < 0 or at < a for a in accesses)


def window_kernels() -> list[dict]:
    """The window attention's kernels as launched on the vision tower's windows (64 rows, head dim 80, bf16)."""
    from rollplex.kernels import window_attention as wa

    shape = {"D": 80, "BLOCK": wa.MAX_RUN, "BLOCK_D": 128}
    ints = {n: "i32" for n in ("q_row", "k_row", "v_row", "out_row", "grad_row", "heads")}
    found = []
    for name, fn, warps in (("forward", wa._forward_kernel, wa.FORWARD_WARPS),
                            ("backward", wa._backward_kernel, wa.BACKWARD_WARPS)):  # fmt: skip
        types = {n: "*fp32" if n == "lse_ptr" else "*i32" if n == "bounds_ptr" else "*bf16" for n in fn.arg_names}
        signature = {n: ints.get(n, "fp32" if n == "scale" else types[n]) for n in fn.arg_names if n not in shape}
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=shape), target=HOPPER,
                                options={"num_warps": warps})  # fmt: skip
        found.append({"kernel": name, "shared_bytes": kernel.metadata.shared, "wgmma": "wgmma" in kernel.asm["ptx"],
                      **registers(kernel.asm["cubin"])})  # fmt: skip
    return found


if __name__ == "__main__":
    if sys.argv[1:] == ["window"]:
        print("\n".join(json.dumps(r) for r in window_kernels()))
        sys.exit()
    if sys.argv[1:] == ["ahead"]:
        for name, (fn, signature, constexprs) in ahead_kernels().items():
            names = list(fn.arg_names)
            ordered = {n: signature[n] for n in names if n in signature}
            ptx = triton.compile(ASTSource(fn=fn, signature=ordered, constexprs=constexprs), target=HOPPER).asm["ptx"]
            print(json.dumps({"kernel": name, **launch_order(ptx)}))
        sys.exit()
    if sys.argv[1:] == ["decode"]:
        for name, (fn, signature, constexprs) in decode_kernels().items():
            print(json.dumps(compile_decode_kernel(name, fn, signature, constexprs)))
        sys.exit()
    for name in (n for n in KERNELS if n != "gate_up"):
        for num_rows in (1, 64, 4096):
            print(json.dumps(compile_for_hopper(name, pick_tiles(num_rows, 2048))))
        print(json.dumps(compile_for_hopper(name, pick_tiles(1, 2048), split=(4, 1408))))  # masked parts
    print(json.dumps(compile_for_hopper("transposed", pick_tiles(1, 2048), gdc=True)))  # a dependent launch
    print(json.dumps(compile_for_hopper("linear", pick_tiles(32, 2560, 2048), gdc=True)))  # HF's layout, a bias
    print(json.dumps(compile_for_hopper("gate_up", gate_up_tiles(32, 11008, 2048, 132), gdc=True)))  # fused silu
