"""Each trained or reference role's prefix as a chunked job (`Qwen2_5_VL.prefix_chunks`): drained whole by its
op's handler (`runtime.py`), or advanced chunk by chunk beside decode (`rollplex.rollout.beside`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import nullcontext

import networkx as nx

from rollplex.executors.engines import Engines
from rollplex.executors.scoring import LeafBoundary
from rollplex.graph.ir import NodeKind, Op, Part, Role, backpropagated_prompts, ops, steps, steps_of
from rollplex.models.boundary import Boundary
from rollplex.models.chunks import each_inside
from rollplex.models.shared_vision import SharedVision


def ref_prefix_job(e: Engines, prompts: Sequence, vision: SharedVision | None) -> Generator[None, None, Boundary]:
    return e.reference.prefix_chunks(
        prompts, attached=False, layers_per_chunk=e.layers_per_chunk, prompts_per_chunk=e.prompts_per_chunk,
        vision=vision,
    )  # fmt: skip


def actor_prefix_job(
    e: Engines,
    prompts: Sequence,
    vision: SharedVision | None,
    inputs_first: bool = False,
    attached_prompts: int | None = None,
) -> Generator[None, None, LeafBoundary]:
    return _attached_prefix_job(e, e.actor, prompts, vision, e.prefix_memory, inputs_first, attached_prompts)


def _attached_prefix_job(
    e: Engines,
    model,
    prompts: Sequence,
    vision: SharedVision | None,
    memory,
    inputs_first: bool = False,
    attached_prompts: int | None = None,
) -> Generator[None, None, LeafBoundary]:
    """A trained role's prefix, its graph kept for the backward through it (of the first `attached_prompts`
    prompts only, if given), each chunk inside `memory`; `inputs_first`: all of its inputs copied to the device
    before it runs (`Qwen2_5_VL.prefix_chunks`)."""
    chunks = model.prefix_chunks(
        prompts, attached=True, layers_per_chunk=e.layers_per_chunk, prompts_per_chunk=e.prompts_per_chunk,
        rerun=e.prefix_rerun, vision=vision, inputs_first=inputs_first, attached_prompts=attached_prompts,
    )  # fmt: skip
    boundary = yield from each_inside(memory, chunks)
    return LeafBoundary.of(boundary)


def critic_prefix_job(
    e: Engines, prompts: Sequence, vision: SharedVision | None
) -> Generator[None, None, LeafBoundary]:
    return _attached_prefix_job(e, e.critic, prompts, vision, nullcontext)


def job_options(g: nx.DiGraph, p: Op, num_prompts: int) -> dict:
    """What prefix op `p`'s job takes beside its prompts: the actor's step prefix in a graph of mini-batches keeps
    the graph of mini-batch 1's prompts only (`backpropagated_prompts`)."""
    share = backpropagated_prompts(ops(g), p) if p.role is Role.ACTOR and p.minibatch is None else None
    return {} if share is None else {"attached_prompts": share.prompts(num_prompts).stop}


def paged_out_after(e: Engines, g: nx.DiGraph, p: Op, job: Generator) -> Generator:
    """A paged reference's prefix beside decode whose step ends the reference's window of steps gives its pages
    back as it ends, as the plan has them (resident in that step of decode only), not when decode ends."""
    if p.role is not Role.REFERENCE or e.reference_pager is None:
        return job
    step = next(s.index for s in steps(g) if p.id in s.ops)
    if step + 1 in steps_of(g, Role.REFERENCE):
        return job  # the reference runs in the next step too: it stays
    return _then(job, e.reference_pager.page_out)


def _then(job: Generator, after: Callable[[], None]) -> Generator:
    result = yield from job
    after()
    return result


PREFIX_JOBS: dict[tuple, Callable[[Engines, Sequence, SharedVision | None], Generator]] = {
    (NodeKind.FORWARD, Role.REFERENCE, Part.PREFIX): ref_prefix_job,
    (NodeKind.FORWARD, Role.ACTOR, Part.PREFIX): actor_prefix_job,
    (NodeKind.FORWARD, Role.CRITIC, Part.PREFIX): critic_prefix_job,
}
