"""The compiler's pipeline, in order, and its one owner:

    build -> split_at_response -> split_minibatches -> [prefill_from_actor] -> fuse_scoring -> assign_phases
    -> assign_executors -> order_steps (graph passes, Graph -> Graph, `graph_passes` / `run_passes`)
    -> make_context -> memory_objects -> lower_residency -> decide (lowering, `lower`)

`run_passes` names the graph pass that failed and the passes that ran before it. `graph.plan.compile_plan`
runs the whole pipeline and assembles the `Plan`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import networkx as nx

from rollplex.graph.build import build, graph_spec_of
from rollplex.graph.decisions import Decisions, decide
from rollplex.graph.ir import Schedule
from rollplex.graph.memobject import Context
from rollplex.graph.objects import make_context, memory_objects
from rollplex.graph.passes import (
    assign_executors,
    assign_phases,
    fuse_scoring,
    order_steps,
    prefill_from_actor,
    split_at_response,
    split_minibatches,
)
from rollplex.graph.residency import ResidencyPlan, lower_residency
from rollplex.graph.spec import Spec
from rollplex.graph.verify import VerifyError, verify
from rollplex.models.config import ModelConfig

Pass = Callable[[nx.DiGraph], nx.DiGraph]


def graph_passes(schedule: Schedule, num_minibatches: int = 1, actor_prefill: bool = False) -> list[tuple[str, Pass]]:
    """`unsplit` (the textbook oracle) skips the split: every score runs over prompt ++ response.
    `actor_prefill` (`Spec.prefills_from_actor`): decode reads the actor prefix's boundary."""
    split = [] if schedule is Schedule.UNSPLIT else [("split_at_response", split_at_response)]
    prefill = [("prefill_from_actor", prefill_from_actor)] if actor_prefill and split else []
    return [
        *split,
        ("split_minibatches", partial(split_minibatches, num_minibatches=num_minibatches)),
        *prefill,
        ("fuse_scoring", fuse_scoring),
        ("assign_phases", assign_phases),
        ("assign_executors", assign_executors),
        ("order_steps", partial(order_steps, schedule=schedule)),
    ]


def run_passes(g: nx.DiGraph, passes: list[tuple[str, Pass]], *, check: bool = False) -> nx.DiGraph:
    done: list[str] = []
    for name, fn in passes:
        g = fn(g)
        if check:
            try:
                verify(g)
            except VerifyError as e:
                raise VerifyError(f"after pass '{name}' (ran before it: {', '.join(done) or 'none'}): {e}") from None
        done.append(name)
    return g


def compile_graph(spec: Spec, *, schedule: Schedule | None = None, check: bool = False) -> nx.DiGraph:
    """The spec's graph (or standard GRPO), split, phased, placed and ordered for `schedule`."""
    schedule = schedule or Schedule(spec.schedule)
    g = build(graph_spec_of(spec))
    if check:
        verify(g)
    passes = graph_passes(schedule, spec.algorithm.minibatches_per_step, spec.prefills_from_actor)
    return run_passes(g, passes, check=check)


@dataclass(frozen=True)
class Lowered:
    """A compiled graph lowered for one GPU: its per-rank context, residency plan and the runtime's decisions."""

    context: Context
    residency: ResidencyPlan
    decisions: Decisions


def lower(g: nx.DiGraph, spec: Spec, model: ModelConfig, decisions: Decisions | None = None) -> Lowered:
    """The lowering stages: the per-rank context, the memory objects of every step, their residency per phase,
    then the decisions (`decide`'s, unless given: a plan file carries its own)."""
    c = make_context(g, spec, model)
    residency = lower_residency(c, memory_objects(c))
    return Lowered(c, residency, decisions if decisions is not None else decide(c, residency))
