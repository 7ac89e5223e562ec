"""Batch sizes and layouts of the shrinking decode batch."""

from __future__ import annotations

import pytest
import torch

from rollplex.rollout.batch import bucket_for, bucket_sizes, layout, prompt_counts


def test_bucket_sizes_start_at_one_and_end_at_the_full_batch():
    assert bucket_sizes(1) == (1,)
    assert bucket_sizes(6) == (1, 2, 4, 6)
    assert bucket_sizes(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert bucket_sizes(40) == (1, 2, 4, 8, 16, 32, 40)


def test_the_bucket_is_the_smallest_size_that_holds_the_live_rows():
    sizes = bucket_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 3, 8, 9, 33, 64)] == [1, 4, 8, 16, 48, 64]
    with pytest.raises(ValueError, match="exceed"):
        bucket_for(65, sizes)


def test_layout_sorts_live_slots_pads_with_the_spare_slot_and_groups_rows_by_prompt():
    num_prompts, num_samples = 3, 4
    out = layout(torch.tensor([9, 1, 2, 11, 10]), 8, num_prompts, num_samples)
    assert out.slots.tolist() == [1, 2, 9, 10, 11, 12, 12, 12]
    assert out.row_count.tolist() == [2, 0, 3]
    assert out.prompts.tolist() == [0, 2, 1] and out.num_prompts == 2  # the prompts with rows first
    for p in range(num_prompts):
        rows = out.slots[out.row_start[p] : out.row_start[p] + out.row_count[p]]
        assert (rows // num_samples == p).all()


def test_a_batch_size_spans_from_the_prompts_its_fewest_live_sequences_need_to_every_prompt_it_can_hold():
    sizes = bucket_sizes(64)
    counts = prompt_counts(sizes, num_samples=8, num_prompts=8)
    assert counts[1] == (1,) and counts[2] == (1, 2) and counts[8] == tuple(range(1, 9))
    assert counts[16] == tuple(range(2, 9))  # 9-16 live sequences: at least 2 prompts of 8
    assert counts[48] == (5, 6, 7, 8) and counts[64] == (7, 8)
    for rows in sizes:  # every layout the engine can make lands on a counted case
        for live in range(1 if rows == 1 else sizes[sizes.index(rows) - 1] + 1, rows + 1):
            for first in range(0, 64 - live + 1, 7):  # live sequences packed from `first`: the fewest prompts
                assert layout(torch.arange(first, first + live), rows, 8, 8).num_prompts in counts[rows]
    assert prompt_counts((1, 2, 3), num_samples=3, num_prompts=1) == {1: (1,), 2: (1,), 3: (1,)}


def test_the_graphs_captured_are_one_a_batch_size_and_prompt_chunk_largest_first():
    """At the 3B rollout's shapes (8 prompts x 8 samples, 2 kv heads, 5,888-key prompts): 18 graphs, where one per
    batch size and prompt count would be 34."""
    from types import SimpleNamespace

    from rollplex.kernels.decode_attention import DecodeAttentionShape
    from rollplex.rollout.graphs import StepGraphs

    shape = SimpleNamespace(num_samples=8, num_prompts=8)
    attention = SimpleNamespace(shape=DecodeAttentionShape(8, 8, 16, 2, 128, 5888, 2048))
    step = SimpleNamespace(shape=shape, attention=attention, logits=torch.empty(0))
    graphs = StepGraphs(step, bucket_sizes(64))
    assert graphs.cases[:4] == ((64, 8), (48, 8), (48, 5), (32, 8)) and graphs.cases[-1] == (1, 1)
    assert len(graphs.cases) == 18 and sum(map(len, graphs.prompt_counts.values())) == 34
    assert {n for rows, n in graphs.cases if rows == 8} == {1, 2, 5, 8}
