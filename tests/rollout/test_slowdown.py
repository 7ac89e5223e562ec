"""The decode slowdown a rollout measures from its own step and chunk intervals."""

from __future__ import annotations

import pytest

from rollplex.rollout.slowdown import decode_slowdown, decode_time, merge, overlaps


def test_merged_intervals_are_sorted_disjoint_and_cover_the_same_time():
    assert merge([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]


@pytest.mark.parametrize(("start", "end", "hit"), [(2, 3, False), (3.5, 4.5, True), (4.9, 5.2, True), (6, 7, False)])
def test_a_step_overlaps_a_chunk_when_their_intervals_meet(start, end, hit):
    assert overlaps(merge([(4, 5), (0, 1)]), start, end) is hit


def test_steps_beside_chunks_are_compared_with_lone_steps_of_their_batch_size():
    # 64-row steps take 4 ms alone and 5 ms beside a chunk; 16-row steps 2 ms, all alone
    steps = [(0.000, 0.005, 64), (0.005, 0.010, 64), (0.010, 0.014, 64), (0.014, 0.018, 64)]
    steps += [(0.018 + 0.002 * i, 0.020 + 0.002 * i, 16) for i in range(5)]
    chunks = [(0.001, 0.009)]
    assert decode_slowdown(steps, chunks) == pytest.approx(5 / 4)


def test_without_a_lone_step_of_the_same_size_there_is_no_estimate():
    assert decode_slowdown([(0.0, 0.005, 64), (0.005, 0.007, 16)], [(0.0, 0.004)]) is None
    assert decode_slowdown([(0.0, 0.004, 64)], []) is None  # nothing ran beside


def test_decode_time_sums_the_steps_and_the_gaps_between_them():
    steps = [(0.0, 0.004, 64), (0.005, 0.009, 64), (0.009, 0.011, 8), (0.014, 0.016, 8)]
    busy, idle = decode_time(steps)
    assert busy == pytest.approx(0.012) and idle == pytest.approx(0.004)  # 1 ms, none, 3 ms
    assert decode_time([(0.0, 0.002, 8)]) == pytest.approx((0.002, 0.0))
