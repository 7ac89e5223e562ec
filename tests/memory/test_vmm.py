import time

import pytest
import torch

from rollplex.memory.host_pool import HostPool, PoolExhausted
from rollplex.memory.vmm import Region, RegionState, VmmArena

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
MiB, GiB = 1 << 20, 1 << 30


def free_device_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def host_copy(pool: HostPool, region: Region, name: str) -> torch.Tensor:
    return pool.view(pool.allocate(region.num_bytes, name), torch.uint8, (region.num_bytes,))


def test_regions_are_granular_disjoint_and_report_their_state():
    with VmmArena(64 * MiB) as arena:
        assert arena.granularity == 2 * MiB
        a = arena.allocate(3 * MiB + 1, "a")
        b = arena.reserve(1, "b")
        assert a.num_bytes == 4 * MiB and b.num_bytes == 2 * MiB
        assert a.address % arena.granularity == 0 and a.address + a.num_bytes <= b.address
        assert arena.state(a) is RegionState.MAPPED and arena.state(b) is RegionState.RESERVED
        with pytest.raises(ValueError, match="'b' is RESERVED, expected MAPPED"):
            arena.release(b)
        with pytest.raises(ValueError, match="already exists"):
            arena.reserve(1, "a")
        with pytest.raises(PoolExhausted, match="'big'"):
            arena.reserve(128 * MiB, "big")


def test_contents_and_addresses_survive_release_and_restore():
    with VmmArena(64 * MiB) as arena, HostPool(16 * MiB, pin=True) as pool:
        region = arena.allocate(6 * MiB, "weights")
        weights = arena.tensor(region, torch.bfloat16, (1024, 3072))
        weights.copy_(torch.randn(1024, 3072, device="cuda"))
        expected, address = weights.clone(), weights.data_ptr()
        saved = host_copy(pool, region, "saved")
        arena.evict(region, into=saved)
        assert arena.state(region) is RegionState.RELEASED
        arena.restore(region, contents=saved)
        assert weights.data_ptr() == address
        assert torch.equal(weights, expected), "the same tensor object reads the restored bytes"
        assert torch.equal(arena.tensor(region, torch.bfloat16, (1024, 3072)), expected)


def test_released_pages_go_back_to_the_device_and_close_returns_everything():
    baseline = free_device_bytes()
    with VmmArena(4 * GiB) as arena:
        region = arena.allocate(2 * GiB, "big")
        arena.tensor(region, torch.uint8, (2 * GiB,)).fill_(7)
        mapped = free_device_bytes()
        assert baseline - mapped >= 2 * GiB
        arena.release(region)
        assert free_device_bytes() - mapped >= 2 * GiB - 64 * MiB
        arena.restore(region)
        assert free_device_bytes() <= mapped + 64 * MiB
    assert free_device_bytes() >= baseline - 64 * MiB


def test_an_error_inside_the_arena_context_still_unmaps_everything():
    baseline = free_device_bytes()
    with pytest.raises(RuntimeError, match="boom"), VmmArena(2 * GiB) as arena:
        arena.allocate(1 * GiB, "doomed")
        raise RuntimeError("boom")
    assert free_device_bytes() >= baseline - 64 * MiB


def test_a_captured_cuda_graph_replays_correctly_after_release_and_restore():
    with VmmArena(64 * MiB) as arena, HostPool(16 * MiB, pin=True) as pool:
        a_region, b_region = arena.allocate(4 * MiB, "a"), arena.allocate(4 * MiB, "b")
        a = arena.tensor(a_region, torch.float32, (1 << 20,))
        b = arena.tensor(b_region, torch.float32, (1 << 20,))
        a.copy_(torch.randn(1 << 20, device="cuda"))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up outside capture
            b.copy_(a * 2 + 1)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            b.copy_(a * 2 + 1)
            a.add_(1)
        saved_a = host_copy(pool, a_region, "a")
        arena.evict(a_region, into=saved_a)
        arena.release(b_region)
        arena.restore(a_region, contents=saved_a)
        arena.restore(b_region)
        before = a.clone()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(b, before * 2 + 1), "the graph read the restored region"
        assert torch.equal(a, before + 1), "the graph wrote the restored region"


def test_a_freed_region_gives_its_addresses_to_the_next_region():
    with VmmArena(8 * MiB) as arena:
        first = arena.allocate(8 * MiB, "first")
        arena.free(first)
        second = arena.allocate(8 * MiB, "second")
        assert second.address == first.address
        arena.tensor(second, torch.float32, (2 * MiB,)).fill_(1.0)
        torch.cuda.synchronize()


@pytest.mark.slow
def test_evicting_and_restoring_20_gib_measures_bandwidth_against_a_plain_pinned_copy():
    num_regions, region_bytes = 10, 2 * GiB
    total = num_regions * region_bytes
    if free_device_bytes() < 2 * total + 4 * GiB:
        pytest.skip("needs about 44 GiB of free device memory")
    with VmmArena(total) as arena, HostPool(total, pin=True) as pool:
        regions = [arena.allocate(region_bytes, f"r{i}") for i in range(num_regions)]
        for i, region in enumerate(regions):
            arena.tensor(region, torch.uint8, (region_bytes,)).fill_(i)
        saved = [host_copy(pool, r, r.name) for r in regions]
        evict_s = timed(lambda: [arena.evict(r, into=s) for r, s in zip(regions, saved, strict=True)])
        restore_s = timed(lambda: [arena.restore(r, contents=s) for r, s in zip(regions, saved, strict=True)])
        assert all(arena.tensor(r, torch.uint8, (4,)).tolist() == [i] * 4 for i, r in enumerate(regions))
        plain = torch.empty(total, dtype=torch.uint8, device="cuda")
        to_host_s = timed(lambda: pool.buffer[:total].copy_(plain, non_blocking=True))
        to_device_s = timed(lambda: plain.copy_(pool.buffer[:total], non_blocking=True))
    print(f"\nVMM evict {total / evict_s / 1e9:.1f} GB/s (plain pinned D2H {total / to_host_s / 1e9:.1f} GB/s)")
    print(f"VMM restore {total / restore_s / 1e9:.1f} GB/s (plain pinned H2D {total / to_device_s / 1e9:.1f} GB/s)")
    assert evict_s > 0 and restore_s > 0


def timed(work) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    work()
    torch.cuda.synchronize()
    return time.perf_counter() - start
