"""The runtime's step: after each step it drops the graph tensors no later step reads (`free_dead`), and keeps the
rest; the time between its ops is the record's `gaps_s`, by boundary its `gaps_at`."""

import time

from run_testkit import spec_text

from rollplex.data.source import batch_at, open_dataset
from rollplex.executors import runtime
from rollplex.executors.engines import build_engines
from rollplex.executors.runtime import free_dead, run_iteration
from rollplex.graph.ir import DATASET, Lifetime
from rollplex.graph.load import parse_spec
from rollplex.graph.plan import compile_plan


def test_a_tensor_leaves_the_store_after_its_last_step_and_the_prompts_stay():
    life = {DATASET: Lifetime(0, 1), "boundary": Lifetime(1, 2), "responses": Lifetime(0, 5), "grads": Lifetime(5, 6)}
    store = {DATASET: [], "examples": [], "boundary": object(), "responses": object(), "grads": object()}
    assert free_dead(store, life, 1) == []
    assert set(store) == {DATASET, "examples", "boundary", "responses", "grads"}
    assert free_dead(store, life, 2) == ["boundary"]
    assert set(store) == {DATASET, "examples", "responses", "grads"}
    free_dead(store, life, 6)
    assert set(store) == {DATASET, "examples"}


def test_the_host_work_between_ops_is_the_steps_gaps(monkeypatch):
    """`gaps_s`: the time from each op's end to the next's start, where the runtime frees the dead tensors (and, on a
    GPU, hands the cache back): a pause there shows in it and in no phase."""
    plan = compile_plan(parse_spec(spec_text()))
    engines = build_engines(plan)
    examples = batch_at(open_dataset(plan.loaded.spec.workload.dataset, engines.tokenizer, 3), 0, 2)
    plain = run_iteration(plan.graph, engines, examples)
    pause_s, calls = 0.05, []

    def slow_free(*args):
        calls.append(None)
        time.sleep(pause_s)
        return free_dead(*args)

    monkeypatch.setattr(runtime, "free_dead", slow_free)
    paused = run_iteration(plan.graph, engines, examples)
    between = len(calls) - 1  # after every step; the last one's after the last op
    assert paused.gaps_s - plain.gaps_s >= between * pause_s * 0.9 and between >= 4
    assert sum(paused.times.values()) - sum(plain.times.values()) < between * pause_s / 2
    assert paused.gaps_s == sum(paused.gaps_at.values())  # every boundary's gap, named by the two ops' phases
    assert set(paused.gaps_at) == set(plain.gaps_at) and "actor_suffix_backward-update" in paused.gaps_at
    assert all(paused.gaps_at[k] - plain.gaps_at[k] >= pause_s * 0.9 for k in paused.gaps_at)
