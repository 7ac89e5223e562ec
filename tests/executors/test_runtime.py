"""`free_dead`: after each step the runtime drops the graph tensors no later step reads, and keeps the rest."""

from rollplex.executors.runtime import free_dead
from rollplex.graph.ir import DATASET, Lifetime


def test_a_tensor_leaves_the_store_after_its_last_step_and_the_prompts_stay():
    life = {DATASET: Lifetime(0, 1), "boundary": Lifetime(1, 2), "responses": Lifetime(0, 5), "grads": Lifetime(5, 6)}
    store = {DATASET: [], "examples": [], "boundary": object(), "responses": object(), "grads": object()}
    assert free_dead(store, life, 1) == []
    assert set(store) == {DATASET, "examples", "boundary", "responses", "grads"}
    assert free_dead(store, life, 2) == ["boundary"]
    assert set(store) == {DATASET, "examples", "responses", "grads"}
    free_dead(store, life, 6)
    assert set(store) == {DATASET, "examples"}
