"""`Prefetch`: the batches `batch_at` gives, the next one made on a worker thread while the caller works."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rollplex.data.prefetch import Prefetch
from rollplex.data.source import batch_at, open_dataset
from rollplex.data.tokenizer import CharTokenizer
from rollplex.data.types import Example
from rollplex.models.inputs import Prompt


class Recording:
    """A dataset of 10 examples that notes which thread made which index; while `gate` is clear, the makers of
    the indices in `held` wait for it."""

    def __init__(self, fail_at: int | None = None, held: tuple[int, ...] = ()) -> None:
        self.made: list[tuple[int, str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_at, self.held = fail_at, held

    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> Example:
        if index in self.held:
            self.gate.wait()
        if index == self.fail_at:
            raise OSError(f"example {index}: a video file could not be read")
        self.made.append((index, threading.current_thread().name))
        return Example(Prompt(torch.tensor([index])), str(index), "exact")


def answers(examples: list[Example]) -> list[str]:
    return [e.answer for e in examples]


def wait_until(condition, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_batches_are_batch_at_s_in_order_wrapping_around_the_dataset():
    dataset = Recording()
    with Prefetch(dataset, 4) as prefetch:
        taken = [answers(prefetch.take(p, p + 4 if p < 8 else None)) for p in (0, 4, 8)]
    assert taken == [answers(batch_at(dataset, p, 4)) for p in (0, 4, 8)]
    assert taken[2] == ["8", "9", "0", "1"]


def test_the_next_batch_is_made_on_the_worker_before_it_is_taken():
    dataset = Recording()
    with Prefetch(dataset, 3) as prefetch:
        prefetch.take(0, 3)
        wait_until(lambda: len(dataset.made) == 6)  # made while the caller did nothing
        assert [i for i, _ in dataset.made[3:]] == [3, 4, 5]
        assert all(name.startswith("rollplex-data") for _, name in dataset.made[3:])
        assert answers(prefetch.take(3)) == ["3", "4", "5"]
    assert len(dataset.made) == 6  # the last take announced no next step: nothing more made


def test_a_position_other_than_the_announced_one_is_made_there_and_then():
    dataset = Recording()
    with Prefetch(dataset, 2) as prefetch:
        prefetch.take(0, 2)
        assert answers(prefetch.take(6)) == ["6", "7"]


def test_a_failure_to_make_a_batch_is_raised_where_it_is_taken():
    dataset = Recording(fail_at=5)
    with Prefetch(dataset, 3) as prefetch:
        prefetch.take(0, 3)  # the batch at 3 fails on the worker: not here
        with pytest.raises(OSError, match="example 5"):
            prefetch.take(3)


def test_closing_does_not_wait_for_a_batch_being_made():
    dataset = Recording(held=(4,))
    prefetch = Prefetch(dataset, 2)
    dataset.gate.clear()
    prefetch.take(2, 4)  # the next batch's maker blocks
    begin = time.monotonic()
    prefetch.close()
    assert time.monotonic() - begin < 1.0
    dataset.gate.set()


def test_take_reports_how_long_it_waited():
    dataset = Recording(held=(0,))
    with Prefetch(dataset, 2) as prefetch:
        dataset.gate.clear()
        threading.Timer(0.3, dataset.gate.set).start()
        prefetch.take(0, 2)
        assert prefetch.waited_s >= 0.25
        wait_until(lambda: len(dataset.made) == 4)
        prefetch.take(2)
        assert prefetch.waited_s < 0.25


def test_a_synthetic_dataset_gives_the_same_examples_made_ahead():
    dataset = open_dataset("synthetic:clevrer@tiny", CharTokenizer(), seed=3)
    with Prefetch(dataset, 2) as prefetch:
        prefetch.take(0, 2)
        ahead = prefetch.take(2)
    for a, b in zip(ahead, batch_at(dataset, 2, 2), strict=True):
        assert torch.equal(a.prompt.input_ids, b.prompt.input_ids) and a.answer == b.answer
        for x, y in zip(a.prompt.visuals, b.prompt.visuals, strict=True):
            assert torch.equal(x.pixel_values, y.pixel_values)


def test_a_data_parallel_rank_takes_and_stages_only_its_share():
    dataset = Recording()
    with Prefetch(dataset, 4, share=lambda n: [1, 3]) as prefetch:
        assert answers(prefetch.take(0, 4)) == ["1", "3"]
        assert answers(prefetch.take(4)) == ["5", "7"]
