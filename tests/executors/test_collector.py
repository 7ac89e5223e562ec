import gc
import weakref

from rollplex.executors.collector import FULL_EVERY, collections_between_steps


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
