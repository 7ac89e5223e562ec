"""The per-step count of host stalls: garbage collection, the CUDA allocator's retries and compiles."""

from __future__ import annotations

import gc

import pytest
import torch

from rollplex.bench.stalls import StepStalls


def test_collections_inside_the_step_are_timed_and_full_ones_counted():
    junk = [[i] for i in range(200_000)]  # something for the collector to walk
    with StepStalls(torch.device("cpu")) as stalls:
        gc.collect()
        gc.collect(0)
    del junk
    assert stalls.gc_s > 0 and stalls.full_collections == 1
    assert stalls.as_dict()["full_collections"] == 1


def test_collections_outside_the_step_are_not_counted_and_the_callback_is_gone():
    with StepStalls(torch.device("cpu")) as stalls:
        pass
    before = len(gc.callbacks)
    gc.collect()
    assert stalls.gc_s == 0 and stalls.full_collections == 0 and len(gc.callbacks) == before
    assert stalls.describe() == ""


def test_the_callback_is_removed_when_the_step_raises():
    before = len(gc.callbacks)
    with pytest.raises(RuntimeError), StepStalls(torch.device("cpu")):
        raise RuntimeError("step failed")
    assert len(gc.callbacks) == before


def test_without_cuda_the_allocator_counts_stay_zero_and_a_long_collection_is_described():
    with StepStalls(torch.device("cpu")) as stalls:
        pass
    assert (stalls.alloc_retries, stalls.device_allocs) == (0, 0)
    stalls.gc_s, stalls.full_collections, stalls.alloc_retries = 0.25, 2, 3
    assert stalls.describe() == "gc 0.25 s (2 full), 3 allocator retries"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_new_device_allocations_are_counted():
    device = torch.device("cuda")
    torch.cuda.empty_cache()
    with StepStalls(device) as stalls:
        x = torch.empty(64 << 20, dtype=torch.uint8, device=device)  # a fresh 64 MiB segment: one cudaMalloc
    del x
    assert stalls.device_allocs >= 1 and stalls.alloc_retries == 0


def test_a_compile_inside_the_step_is_counted_and_described():
    fn = torch.compile(lambda x: x - 1, backend="eager", dynamic=False)
    with StepStalls(torch.device("cpu")) as stalls:
        fn(torch.ones(2))
    assert (stalls.as_dict()["torch_compiles"], stalls.as_dict()["triton_compiles"]) == (1, 0)
    assert stalls.describe() == "1 compiles"
