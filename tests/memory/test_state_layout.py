"""How the optimizer's flat FP32 state is cut into chunks (ZeRO-1 shards: `test_zero1.py`)."""

import random

import pytest

from rollplex.memory.state_layout import STATE_BYTES_PER_ELEMENT, plan_chunks


@pytest.mark.parametrize("seed", range(20))
def test_chunk_plans_cover_every_element_once_within_the_byte_budget(seed):
    rng = random.Random(seed)
    numels = [rng.choice([0, 1, 3, 100, 1000]) for _ in range(rng.randrange(1, 12))]
    if sum(numels) == 0:
        numels.append(1)
    chunk_bytes = STATE_BYTES_PER_ELEMENT * rng.choice([1, 2, 50, 333, 10_000])
    chunks = plan_chunks(numels, chunk_bytes)
    covered = [[0] * n for n in numels]
    for chunk in chunks:
        assert STATE_BYTES_PER_ELEMENT * chunk.numel <= chunk_bytes
        assert sum(s.numel for s in chunk.segments) == chunk.numel
        offsets = [s.offset for s in chunk.segments]
        assert offsets == sorted(offsets) and offsets[0] == 0
        for s in chunk.segments:
            for e in range(s.start, s.stop):
                covered[s.param_index][e] += 1
    assert all(count == 1 for row in covered for count in row)
    sizes = [chunk.numel for chunk in chunks]
    assert max(sizes) - min(sizes) <= 1, "chunks are byte-balanced"


def test_a_chunk_budget_below_one_element_is_refused():
    with pytest.raises(ValueError, match="chunk_bytes=11"):
        plan_chunks([4], 11)
