"""A deferred step (`ChunkedAdamW.step(defer=True)`): the caller's stream goes on after the grad norm; a reader
that waits for a parameter (`wait_for`) or for all of it (`finish`) sees what a joined step writes, bit for bit."""

import pytest
import torch
from test_optimizer import make_params, set_grads

from rollplex.memory.in_flight import AHEAD, UpdateInFlight
from rollplex.memory.optimizer import ChunkedAdamW

SHAPES = [(96, 130)] * 12 + [(7,), (3, 50)]  # many chunks of one parameter or several
# on the GPU, state large enough that the streams are still busy when the host reads (0.8 GB, ~15 ms over the link):
# a reader that did not wait, or gradients handed back too early, would read or feed stale values
GPU_SHAPES = [(2048, 4096)] * 8 + [(7,), (3, 50)]


def pair(device, dtype, shapes=SHAPES, **kwargs):
    kwargs = {"chunk_bytes": 12 * 4096, "max_grad_norm": 0.5, "fp32_grads": True, **kwargs}
    ours, theirs = make_params(shapes, device=device, dtype=dtype), make_params(shapes, device=device, dtype=dtype)
    return ours, theirs, ChunkedAdamW(ours, **kwargs), ChunkedAdamW(theirs, **kwargs)


def test_off_a_gpu_a_deferred_step_is_the_step_and_leaves_nothing_in_flight():
    ours, theirs, deferred, joined = pair("cpu", torch.float32)
    for seed in (1, 2):
        set_grads(ours, seed)
        set_grads(theirs, seed)
        assert torch.equal(deferred.step(defer=True), joined.step())
        assert deferred.in_flight is None
        deferred.wait_for(ours)
        deferred.finish()
        deferred.zero_grad()
        joined.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kept", [0, 5 << 26])  # every chunk streamed; the last five kept in HBM
@pytest.mark.parametrize("set_to_none", [True, False])  # gradients dropped, or zeroed in place (which joins)
def test_on_the_gpu_a_deferred_step_gives_each_reader_that_waits_the_joined_steps_values(kept, set_to_none):
    ours, theirs, deferred, joined = pair("cuda", torch.bfloat16, GPU_SHAPES, chunk_bytes=1 << 26, resident_bytes=kept)
    for seed in (1, 2):  # the second step starts with the first still in flight
        set_grads(ours, seed)
        set_grads(theirs, seed)
        expected = joined.step()
        norm = deferred.step(defer=True)
        assert deferred.in_flight is not None and float(norm) == float(expected)
        deferred.zero_grad(set_to_none)  # the gradients the streams still read stay held, or are read first
        clutter = [torch.full(p.shape, float("nan"), device="cuda") for p in ours for _ in range(2)]  # reuse bait
        seen = []
        for p in ours:  # as the next prefix reads its modules, in order
            deferred.wait_for([p])
            seen.append(p.detach().clone())
        del clutter
        assert all(torch.equal(a, b) for a, b in zip(seen, theirs, strict=True))
        joined.zero_grad()
    deferred.finish()
    assert deferred.in_flight is None
    for i in range(len(ours)):
        for row in range(3):
            assert torch.equal(deferred.read_param_state(i, row), joined.read_param_state(i, row))


class FakeEvent:
    def __init__(self, chunk, finished):
        self.chunk, self.finished = chunk, finished

    def query(self):
        return self.chunk in self.finished


class FakeStream:
    def __init__(self):
        self.waited = []

    def wait_event(self, event):
        self.waited.append(event.chunk)

    def wait_stream(self, stream):
        self.waited.append(stream)

    def record_event(self):
        return "done"


def test_an_update_in_flight_is_enqueued_a_few_chunks_ahead_and_through_each_readers_chunk():
    finished, enqueued = set(), []

    def work():
        for j in range(20):
            enqueued.append(j)
            yield FakeEvent(j, finished)

    update = UpdateInFlight(work(), {0: 0, 1: 3, 2: 12, 3: 19}, ("load", "adam"), held=("workspace",))
    update.pump()
    assert enqueued == list(range(AHEAD))  # nothing finished: AHEAD chunks, no more
    finished.update({0, 1, 3})  # the first unfinished one bounds what goes ahead
    update.pump()
    assert len(enqueued) == 2 + AHEAD
    caller = FakeStream()
    update.wait_for([2, 0], caller)  # a reader enqueues through its parameter's last chunk, and waits for it
    assert len(enqueued) == 13 and caller.waited == [12, 0]
    update.wait_for([2], caller)  # once per parameter
    assert caller.waited == [12, 0]
    assert update.finish(caller) == "done" and enqueued == list(range(20))
    assert caller.waited[2:] == ["load", "adam"] and update.held == ()
