"""The per-phase device memory probe."""

from __future__ import annotations

import time

import pytest
import torch

from rollplex.executors.memprobe import PhaseMemory, chain
from rollplex.graph.ir import NodeKind, Op, Phase


def op_in(phase: Phase) -> Op:
    return Op(id=f"op{int(phase)}", kind=NodeKind.FORWARD, role=None, inputs=(), outputs=(), phase=phase)


def test_hooks_chain_in_order_and_skip_none():
    calls = []
    hook = chain(lambda o: calls.append(("a", o.id)), None, lambda o: calls.append(("b", o.id)))
    hook(op_in(Phase.TRAIN))
    assert calls == [("a", "op2"), ("b", "op2")]


def test_on_the_cpu_the_probe_records_nothing():
    with PhaseMemory(torch.device("cpu")) as memory:
        memory.before(op_in(Phase.ROLLOUT))
        memory.after(op_in(Phase.ROLLOUT))
    assert memory.peaks() == {} and memory.allocator_peaks() == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_each_phase_sees_what_the_device_held_during_it():
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before_any_phase = torch.empty(6 << 30, dtype=torch.uint8, device=device)  # 6 GiB before the probe's resets
    del before_any_phase
    torch.cuda.empty_cache()  # back to the driver: the 4 GiB below must be new device memory, not this block
    with PhaseMemory(device) as memory:
        memory.before(op_in(Phase.ROLLOUT))
        memory.after(op_in(Phase.ROLLOUT))
        memory.before(op_in(Phase.TRAIN))
        big = torch.empty(4 << 30, dtype=torch.uint8, device=device)  # 4 GiB, held for a moment only
        torch.cuda.synchronize()
        time.sleep(0.05)  # the sampling thread's turn
        del big
        torch.cuda.empty_cache()
        memory.after(op_in(Phase.TRAIN))
        memory.before(op_in(Phase.UPDATE))
        memory.after(op_in(Phase.UPDATE))
    peaks = memory.peaks()
    assert peaks[Phase.TRAIN] - peaks[Phase.ROLLOUT] >= 4 << 30
    assert abs(peaks[Phase.UPDATE] - peaks[Phase.ROLLOUT]) < 1 << 30
    allocator = memory.allocator_peaks()  # exact, per phase: the 4 GiB counts in the train phase only
    assert allocator[Phase.TRAIN][0] - allocator[Phase.ROLLOUT][0] >= 4 << 30
    assert allocator[Phase.TRAIN][1] >= allocator[Phase.TRAIN][0]
    assert allocator[Phase.TRAIN][0] - allocator[Phase.UPDATE][0] >= 4 << 30  # freed before the update phase
    assert memory.high_water() >= 6 << 30  # the peak before the first phase is not lost to the resets


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_phase_counts_the_allocators_retries_made_in_it():
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    cap = torch.cuda.memory_reserved(device) + (2 << 30)  # 2 GiB past what the allocator holds
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    try:
        with PhaseMemory(device) as memory:
            memory.before(op_in(Phase.ROLLOUT))
            cached = torch.empty(3 << 29, dtype=torch.uint8, device=device)  # 1.5 GiB, kept in the cache
            del cached
            memory.after(op_in(Phase.ROLLOUT))
            memory.before(op_in(Phase.TRAIN))
            other = torch.empty(7 << 28, dtype=torch.uint8, device=device)  # 1.75 GiB: fits once the cache is freed
            del other
            memory.after(op_in(Phase.TRAIN))
            memory.before(op_in(Phase.UPDATE))
            memory.after(op_in(Phase.UPDATE))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
    retries = memory.allocator_retries()
    assert retries[Phase.TRAIN] >= 1 and retries[Phase.ROLLOUT] == retries[Phase.UPDATE] == 0
