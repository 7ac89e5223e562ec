"""Without a GPU, both kernels (and the transposed one's fused gate_up) still compile for sm_90 with the picked tiles
(and with K split), software-pipelined (cp.async), within Hopper's shared memory, and on wgmma tensor cores once the
M tile reaches 64; every decode kernel compiles too, writes nothing before it waits (and reads there only where
`pdl.enter` allows), and launched `ahead` lets the next kernel launch first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HOPPER_SHARED_BYTES = 227 * 1024


def compiled(*args: str) -> list[dict]:
    """The JSON lines of hopper_compile.py run with args, in a process without TRITON_INTERPRET (which would
    replace the kernels by interpreted functions)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("hopper_compile.py")
    out = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.mark.slow
def test_both_kernels_compile_for_hopper_pipelined_and_within_shared_memory():
    results = compiled()
    assert len(results) == 15  # per GEMM: decode 1 and 64 rows, prefill, decode with K in 4 masked parts; + PDL x 3
    for r in results:
        assert r["cp_async"] and r["shared_bytes"] <= HOPPER_SHARED_BYTES, r
        assert r["wgmma"] == (r["block_m"] >= 64), r
    assert [r["gdc"] for r in results] == [False] * 12 + [True] * 3  # only the dependent launches wait on the grid
    assert all(r["wait_first"] is (True if r["gdc"] else None) for r in results)  # before any global access


@pytest.mark.slow
def test_every_decode_kernel_compiles_for_hopper_within_shared_memory_and_registers():
    results = compiled("decode")
    assert [r["kernel"] for r in results] == [
        "partial", "combine", "add_rms_norm", "rotary_to_cache", "silu_mul", "sample_partial", "sample_finish",
        "sum_splits",
    ]  # fmt: skip
    assert all(r["shared_bytes"] <= HOPPER_SHARED_BYTES for r in results), results
    assert [r["gdc"] for r in results] == [True] * 5 + [False, False, True]  # sampling: no dependent launch
    # before it waits a dependent writes nothing, and only these read what no kernel of the chain writes
    # (`pdl.enter`): the attention its row map and the step, the norm its weight, rotary its position and tables
    dependents = [r for r in results if r["gdc"]]
    assert all(r["writes_before_wait"] == [] for r in dependents), results
    assert [r["kernel"] for r in dependents if r["loads_before_wait"]] == ["partial", "add_rms_norm", "rotary_to_cache"]
    # registers: every kernel but the partial attention keeps its values in registers (no local memory); the
    # partial's 64-row prompt tile ([N x heads-per-group] queries against a [64, 128] block) takes every register
    # a thread may have at 4 warps and spills, and its own-key programs share that allocation
    spills = {r["kernel"]: r["local_bytes"] for r in results if r["local_bytes"]}
    assert set(spills) <= {"partial"} and all(r["registers"] <= 255 for r in results), results


@pytest.mark.slow
def test_ahead_each_kernel_lets_the_next_launch_first_and_writes_nothing_before_it_waits():
    results = {r.pop("kernel"): r for r in compiled("ahead")}
    assert list(results) == ["partial", "combine", "add_rms_norm", "rotary_to_cache", "swap_qkv", "swap_gate_up"]
    assert all(r["launch_first"] and r["writes_before_wait"] == [] for r in results.values()), results
    assert results["swap_qkv"]["loads_before_wait"] == results["swap_gate_up"]["loads_before_wait"] == 0
    # 64 weight rows x 2048 elements in 128-byte lines over 128 threads; the pair: gate and up rows, 256 elements
    assert results["swap_qkv"]["prefetches_before_wait"] == 64 * 2048 // 64 // 128
    assert results["swap_gate_up"]["prefetches_before_wait"] == 2 * 64 * 256 // 64 // 128
    assert all(
        results[k]["prefetches_before_wait"] == 0 for k in ("partial", "combine", "add_rms_norm", "rotary_to_cache")
    )


@pytest.mark.slow
def test_the_window_attentions_kernels_compile_for_hopper_on_wgmma_without_spilling_registers():
    results = compiled("window")
    assert [r["kernel"] for r in results] == ["forward", "backward"]
    for r in results:
        assert r["wgmma"] and r["local_bytes"] == 0 and r["shared_bytes"] <= HOPPER_SHARED_BYTES, r
