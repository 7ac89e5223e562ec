"""A step's bounds as it ran: where the actor's update ran (held by the actor prefix, deferred past its step)."""

from pathlib import Path

import pytest

from rollplex.executors.bounds import step_bounds
from rollplex.graph import cost, modelcost, timeplan
from rollplex.graph.load import load_spec
from rollplex.graph.plan import compile_plan

SPECS = Path(__file__).resolve().parents[2] / "specs"


def test_a_steps_bounds_price_its_prefix_and_update_where_each_ran():
    plan = compile_plan(load_spec(SPECS / "qwen2_5_vl_7b_h200.yaml"))  # the update beside the next prefix
    assert plan.decisions.update_beside_prefix
    tokens = timeplan.planned_steps(plan)[0]
    peaks = modelcost.KNOWN_PEAKS["H200"]
    update = cost.plan_actor_update(plan, tokens).bound_s(peaks)
    steady, _ = step_bounds(plan, tokens)
    clean, _ = step_bounds(plan, tokens, held=False, deferred=True)  # the first step, or one after a checkpoint
    joined, _ = step_bounds(plan, tokens, held=True, deferred=False)  # a step whose update a checkpoint joined
    assert steady == step_bounds(plan, tokens, held=True, deferred=True)[0]
    assert clean["actor_prefix"] < steady["actor_prefix"] == joined["actor_prefix"]  # the link's bytes of both
    assert clean["update"] == steady["update"] < 0.1 * update  # the gradient norm only
    assert joined["update"] == pytest.approx(update, abs=1e-4)
    assert {k: v for k, v in clean.items() if k not in ("actor_prefix", "update")} == {
        k: v for k, v in joined.items() if k not in ("actor_prefix", "update")
    }
