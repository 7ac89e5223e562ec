import itertools
import random

import pytest
import torch

from rollplex.memory.host_pool import ALIGNMENT, FirstFit, HostPool, PoolExhausted, copy_on

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def assert_tiles_capacity(placement: FirstFit) -> None:
    spans = [(b.offset, -(-b.num_bytes // placement.alignment) * placement.alignment) for b in placement.live_blocks]
    spans += list(placement.free_ranges)
    spans.sort()
    position = 0
    for start, size in spans:
        assert start == position, "live blocks and free ranges must tile the pool without gaps or overlaps"
        position = start + max(size, placement.alignment)
    assert position == placement.capacity


def test_random_allocations_never_overlap_and_stay_aligned():
    rng = random.Random(0)
    placement = FirstFit(1 << 20, alignment=256)
    live = []
    for step in range(2000):
        if live and rng.random() < 0.45:
            placement.free(live.pop(rng.randrange(len(live))))
        else:
            size = rng.choice([1, 7, 256, 257, 4096, 30_000])
            if placement.can_allocate(size):
                live.append(placement.allocate(size, f"b{step}"))
            else:
                with pytest.raises(PoolExhausted):
                    placement.allocate(size, f"b{step}")
        blocks = sorted(placement.live_blocks, key=lambda b: b.offset)
        assert all(b.offset % 256 == 0 for b in blocks)
        assert all(a.end <= b.offset for a, b in itertools.pairwise(blocks))
        assert_tiles_capacity(placement)


def test_free_ranges_are_coalesced_so_freeing_everything_leaves_one_range():
    placement = FirstFit(64 * ALIGNMENT)
    blocks = [placement.allocate(ALIGNMENT, f"b{i}") for i in range(64)]
    assert not placement.can_allocate(1)
    for block in blocks[::2] + blocks[1::2]:
        placement.free(block)
    assert placement.free_ranges == ((0, 64 * ALIGNMENT),)


def test_first_fit_reuses_the_lowest_hole_that_fits():
    placement = FirstFit(8 * ALIGNMENT)
    a, b, c = (placement.allocate(2 * ALIGNMENT, name) for name in "abc")
    placement.free(a)
    placement.free(c)
    assert placement.allocate(ALIGNMENT, "d").offset == a.offset
    assert placement.allocate(2 * ALIGNMENT, "e").offset == c.offset
    assert b.offset == 2 * ALIGNMENT


def test_an_exhausted_pool_names_the_request_and_the_free_bytes():
    placement = FirstFit(4 * ALIGNMENT)
    placement.allocate(3 * ALIGNMENT, "master")
    with pytest.raises(PoolExhausted, match=r"'exp_avg' \(4096 bytes\): 512 bytes free"):
        placement.allocate(4096, "exp_avg")


def test_freeing_a_block_twice_is_an_error():
    placement = FirstFit(4 * ALIGNMENT)
    block = placement.allocate(10, "x")
    placement.free(block)
    with pytest.raises(ValueError, match="not live"):
        placement.free(block)


def test_typed_views_of_different_blocks_do_not_alias():
    with HostPool(1 << 16) as pool:
        a = pool.allocate(100 * 4, "a")
        b = pool.allocate(50 * 2, "b")
        va = pool.view(a, torch.float32, (10, 10))
        vb = pool.view(b, torch.bfloat16, (50,))
        va.fill_(1.5)
        vb.fill_(-2.0)
        assert torch.equal(va, torch.full((10, 10), 1.5))
        assert torch.equal(vb, torch.full((50,), -2.0, dtype=torch.bfloat16))
        assert va.data_ptr() % ALIGNMENT == vb.data_ptr() % ALIGNMENT


def test_a_view_larger_than_its_block_is_refused():
    with HostPool(1 << 12) as pool:
        block = pool.allocate(16, "small")
        with pytest.raises(ValueError, match="needs 32 bytes"):
            pool.view(block, torch.float32, (8,))


def test_allocate_like_copies_round_trip_through_the_pool():
    with HostPool(1 << 16) as pool:
        source = torch.randn(3, 5, 7)
        block, host = pool.allocate_like(source, "act")
        assert copy_on(None, host, source) is None
        assert torch.equal(host, source)
        pool.free(block)
        assert pool.num_free_bytes == pool.capacity


@pytest.mark.gpu
@needs_cuda
def test_a_pinned_pool_copies_to_and_from_the_device_on_a_stream():
    with HostPool(64 << 20, pin=True) as pool:
        assert pool.buffer.is_pinned()
        device = torch.randn(1 << 20, device="cuda")
        block, host = pool.allocate_like(device, "x")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        out_event = copy_on(stream, host, device)
        back = torch.empty_like(device)
        in_event = copy_on(stream, back, host, after=(out_event,))
        in_event.synchronize()
        assert torch.equal(back, device)
        pool.free(block, after=in_event)
        assert pool.allocate(pool.capacity, "everything").offset == 0


@pytest.mark.gpu
@needs_cuda
def test_a_deferred_free_becomes_placeable_once_its_event_completes():
    with HostPool(4 << 20, pin=True) as pool:
        block = pool.allocate(pool.capacity, "all")
        event = torch.cuda.Event()
        torch.cuda._sleep(10_000_000)
        event.record()
        pool.free(block, after=event)
        assert pool.allocate(1, "waits for the event").offset == 0
        assert event.query()
