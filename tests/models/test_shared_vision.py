"""`SharedVision`: a group's vision work runs once, whichever prefix job drives it, and serves later groups of the
same prompts."""

import pytest
import torch

from rollplex.models.chunks import drain
from rollplex.models.shared_vision import SharedVision


def work(log: list, value: torch.Tensor, chunks: int = 3):
    def run():
        for i in range(chunks):
            log.append(i)
            if i < chunks - 1:
                yield
        return value

    return run


def test_two_jobs_interleaved_run_the_groups_work_once_and_both_read_it():
    prompts, counts, log = [object(), object()], [2, 1], []
    out = torch.arange(6.0).view(3, 2)
    shared = SharedVision()
    a = shared.features(prompts, counts, work(log, out))
    b = shared.features(prompts, counts, work(log, out))
    next(a)  # a runs the first chunk, b the second, a the third: each chunk once
    next(b)
    with pytest.raises(StopIteration) as done_a:
        next(a)
    with pytest.raises(StopIteration) as done_b:
        next(b)
    assert log == [0, 1, 2] and shared.runs == 1
    assert done_a.value.value is out and done_b.value.value is out


def test_a_later_group_of_prompts_already_embedded_reads_their_parts():
    prompts, log = [object(), object(), object()], []
    out = torch.arange(12.0).view(6, 2)
    shared = SharedVision()
    drain(shared.features(prompts, [1, 2, 3], work(log, out)))
    later = drain(shared.features(prompts[1:], [2, 3], work(log, torch.zeros(5, 2))))
    assert torch.equal(later, out[1:]) and shared.runs == 1 and log == [0, 1, 2]
    drain(shared.features([*prompts[:1], object()], [1, 1], work(log, torch.zeros(2, 2))))
    assert shared.runs == 2  # a group with a prompt not yet embedded runs its own work


def test_an_output_that_needs_gradients_is_refused():
    out = torch.zeros(1, 2, requires_grad=True)
    with pytest.raises(ValueError, match="freeze the vision tower"):
        drain(SharedVision().features([object()], [1], work([], out, 1)))
