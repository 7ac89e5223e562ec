import gc
import weakref

from run_testkit import loaded, spec_text

from rollplex.executors.collector import FULL_EVERY, collections_between_steps
from rollplex.executors.loop import RunOptions, train
from rollplex.graph.load import parse_spec
from rollplex.graph.plan import compile_plan


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> weakref.ref:
    """A reference cycle nothing else reaches: only a collection frees it."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_inside_no_automatic_collection_and_after_as_it_was():
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        with collections_between_steps() as collect:
            assert not gc.isenabled()
            collect()
        assert gc.isenabled() == enabled
    gc.enable()


def test_a_cycle_made_inside_a_step_lives_until_the_step_end_collection():
    with collections_between_steps() as collect:
        ref = cycle()
        for _ in range(2000):  # enough allocations to trigger automatic collections, were they on
            [Node() for _ in range(10)]
        assert ref() is not None
        assert collect() >= 0.0
        assert ref() is None


def test_a_cycle_among_older_objects_goes_by_the_next_full_collection():
    collected = []
    gc.callbacks.append(lambda phase, info: phase == "stop" and collected.append(info["generation"]))
    try:
        with collections_between_steps() as collect:
            old = Node()
            old.other = Node()
            old.other.other = old
            for _ in range(3):  # it outlives steps: promoted out of the young generations
                collect()
            ref = weakref.ref(old)
            del old
            collected.clear()
            for _ in range(FULL_EVERY):
                collect()
            assert ref() is None
            assert collected.count(2) == 1 and collected.count(1) == FULL_EVERY - 1  # one full, the rest young
    finally:
        gc.callbacks.pop()


def test_off_leaves_python_collector_alone():
    gc.enable()
    with collections_between_steps(on=False) as collect:
        assert gc.isenabled()
        assert collect() == 0.0


def test_a_run_collects_at_each_step_end_only_and_gives_the_collector_back(tmp_path):
    collections = []  # while automatic collection is off
    gc.callbacks.append(
        lambda phase, info: phase == "stop" and not gc.isenabled() and collections.append(info["generation"])
    )
    try:
        manual = train(compile_plan(loaded()), RunOptions(1, tmp_path / "manual", progress=False, tensorboard=False))
    finally:
        gc.callbacks.pop()
    assert gc.isenabled()
    assert collections == [1] and manual[0]["gc_s"] >= 0.0  # the step's end: the young generations
    off = parse_spec(spec_text().replace("seed: 3,", "seed: 3, manual_gc: false,"))
    assert not off.spec.run.manual_gc
    records = train(compile_plan(off), RunOptions(1, tmp_path / "auto", progress=False, tensorboard=False))
    assert records[0]["gc_s"] == 0.0 and records[0]["param_digest"] == manual[0]["param_digest"]
