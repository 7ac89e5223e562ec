"""A paged reference (`memory.page_reference`, `WeightPager` over a poisoning arena on the CPU): resident in its
steps only, back out as soon as its prefix beside decode ends, and the step unchanged."""

import pytest
import torch
from run_testkit import loaded, spec_text

from rollplex.data.source import batch_at, open_dataset
from rollplex.executors.engines import build_engines
from rollplex.executors.runtime import run_iteration
from rollplex.graph.ir import Schedule, steps
from rollplex.graph.load import parse_spec
from rollplex.graph.pipeline import compile_graph
from rollplex.graph.plan import compile_plan


@pytest.mark.parametrize("schedule", [Schedule.SERIAL, Schedule.ROLLPLEX])
def test_the_paged_reference_is_resident_in_its_steps_only_and_gives_the_same_step(schedule):
    from arena_testkit import PoisoningArena

    from rollplex.graph.ir import Role
    from rollplex.memory.pager import WeightPager

    spec = loaded()
    g = compile_graph(spec.spec, schedule=schedule)
    plain, paged = build_engines(compile_plan(spec)), build_engines(compile_plan(spec))
    paged.reference_pager = WeightPager(paged.reference, PoisoningArena())  # paged-out bytes read back as NaN
    paged.reference_pager.page_out()  # as the previous step left it
    dataset = open_dataset(spec.spec.workload.dataset, plain.tokenizer, 3)
    seen = {}
    a = run_iteration(g, plain, batch_at(dataset, 0, 2))
    b = run_iteration(
        g, paged, batch_at(dataset, 0, 2), before_op=lambda o: seen.update({o: paged.reference_pager.resident})
    )
    assert a.stats == b.stats and torch.equal(a.rewards, b.rewards)
    assert all(resident for o, resident in seen.items() if o.role is Role.REFERENCE)
    assert [resident for o, resident in seen.items() if o.id == "actor_update"] == [False]
    assert not paged.reference_pager.resident  # on the host until the next step


def test_a_paged_references_prefix_beside_decode_gives_its_pages_back_as_it_ends():
    from arena_testkit import PoisoningArena

    from rollplex.memory.pager import WeightPager

    # few chunks, and the engine's own prefill: decode with the reference prefix in step 0, the actor's in step 1
    text = spec_text() + "sharing: {layers_per_chunk: 99, prompts_per_chunk: null}\n"
    spec = parse_spec(text.replace("run: {", "run: {rollout_prefill: rollout, "))
    g = compile_graph(spec.spec, schedule=Schedule.ROLLPLEX)
    assert [s.ops for s in steps(g)][:2] == [("rollout", "ref_score.prefix"), ("rollout", "actor_score.prefix")]
    plain, paged = build_engines(compile_plan(spec)), build_engines(compile_plan(spec))
    paged.reference_pager = WeightPager(paged.reference, PoisoningArena())  # paged-out bytes read back as NaN
    decoded, outs, rollout, page_out = [], [], paged.rollout, paged.reference_pager.page_out

    def decode(*args, **kw):
        out = rollout(*args, **kw)
        decoded.append(True)
        return out

    def out():
        if paged.reference_pager.resident:
            outs.append(bool(decoded))
        page_out()

    paged.rollout, paged.reference_pager.page_out = decode, out
    dataset = open_dataset(spec.spec.workload.dataset, plain.tokenizer, 3)
    a, b = (run_iteration(g, engines, batch_at(dataset, 0, 2)) for engines in (plain, paged))
    assert a.stats == b.stats and torch.equal(a.rewards, b.rewards)
    assert outs == [False, True]  # out during decode, as its prefix ended; again after the suffix's step
