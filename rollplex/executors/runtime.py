"""The runtime: executes one iteration by walking a compiled graph's steps, op by op.

Each op is dispatched on (kind, role, part) to a handler that reads its inputs from the step's tensor store by
the IR's tensor names (an input is known by the kind and role of the op that makes it) and writes its outputs
there; a tensor leaves the store after the last step that reads it (the compiled lifetimes), so what the plan
counts freed is freed. A trained role's scoring runs inside its backward, in length batches of responses, as
`fuse_scoring` compiled it (the scoring op itself does nothing; the backward writes its outputs); with several
mini-batches (`split_minibatches`) each has its own backward and update, and its prefix rerun.
Under `rollplex`, the prefixes that share Phase-1 steps with decode run beside it: chunk by chunk between
decode steps, on the stream of `sharing.policy` (inline on the CPU), one chunk in flight at most.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise

import networkx as nx
import torch

from rollplex.errors import SpecError
from rollplex.executors.critic import train_critic
from rollplex.executors.draws import burn, length_budgets
from rollplex.executors.engines import Engines
from rollplex.executors.grading import grade
from rollplex.executors.ppo import advantages
from rollplex.executors.prefix_jobs import (
    PREFIX_JOBS,
    actor_prefix_job,
    critic_prefix_job,
    job_options,
    paged_out_after,
    ref_prefix_job,
)
from rollplex.executors.record import StepRecord
from rollplex.executors.scoring import LeafBoundary, score_all
from rollplex.executors.training import MiniBatchInputs, train_minibatch
from rollplex.graph.cost import timer_of, timers
from rollplex.graph.ir import (
    DATASET,
    Lifetime,
    MiniBatch,
    NodeKind,
    Op,
    Part,
    Role,
    beside_decode,
    lifetimes,
    op,
    ops,
    producer,
    steps,
    steps_of,
)
from rollplex.models.chunks import drain
from rollplex.models.shared_vision import SharedVision
from rollplex.rollout.slowdown import decode_slowdown, decode_time, device_mark, seconds_between

Store = dict[str, object]


@dataclass(frozen=True)
class Gradients:
    """The backward's output: gradients now sit in the actor's `.grad`s, ready for the update."""

    num_tokens: int


Handler = Callable[[Engines, nx.DiGraph, Op, Store, StepRecord], None]


def run_iteration(
    g: nx.DiGraph,
    engines: Engines,
    examples: Sequence,
    *,
    before_op: Callable[[Op], None] | None = None,
    after_op: Callable[[Op], None] | None = None,
) -> StepRecord:
    store: Store = {"prompts": [e.prompt for e in examples], "examples": list(examples)}
    store["vision"] = SharedVision() if engines.freeze_vision else None
    record = StepRecord(times=dict.fromkeys(timers(list(ops(g))), 0.0))
    done: set[str] = set()
    pager, paged_steps = engines.reference_pager, steps_of(g, Role.REFERENCE)
    life = lifetimes(g)
    last_prefix = max((s.index for s in steps(g) if any(op(g, n).part is Part.PREFIX for n in s.ops)), default=-1)
    phase, freed, uncached = None, [], False
    cuda = engines.actor.device.type == "cuda"
    emptying = cuda and engines.empty_cache_at_phases  # else only where memory outside the allocator is mapped
    marks = []  # (timer, start, end) of each op: CUDA events on a GPU, so that no op waits for the device
    for i, s in enumerate(steps(g)):
        if (s.phase is not phase or freed) and emptying:
            uncached = _update_in_flight(engines)  # emptying the cache now would wait for the update: after it
            if not uncached:
                torch.cuda.empty_cache()  # what the last phase or step freed goes back to the driver, as planned
        phase = s.phase
        if pager is not None and i in paged_steps:
            pager.page_in()  # the plan's window: resident in the steps where the reference runs
        for name in s.ops:
            if name in done:
                continue  # ran beside decode
            o = op(g, name)
            if engines.update_beside_prefix and (o.role, o.part) != (Role.ACTOR, Part.PREFIX):
                engines.optimizer.finish()  # only the actor prefix runs beside the last step's deferred update
                if uncached:  # its workspace and gradients back to the driver (a graph capture needs it there)
                    torch.cuda.empty_cache()
                    uncached = False
            beside = [op(g, n) for n in beside_decode(g, name)] if o.kind is NodeKind.DECODE else []
            for each in (o, *beside):
                if before_op is not None:
                    before_op(each)
            start = device_mark(cuda)
            if beside:
                _decode(engines, g, o, store, record, beside)
            else:
                _handler(o)(engines, g, o, store, record)
            marks.append((timer_of(o), start, device_mark(cuda)))
            if (o.role, o.part) == (Role.ACTOR, Part.PREFIX) and _update_in_flight(engines):
                start = device_mark(cuda)  # what the prefix left of the last step's update: the stream waits for it
                engines.optimizer.finish()
                marks.append(("update", start, device_mark(cuda)))
            for each in (o, *beside):
                done.add(each.id)
                if after_op is not None:
                    after_op(each)
        if pager is not None and i in paged_steps and i + 1 not in paged_steps:
            pager.page_out()  # the steps without the reference (actor backward, update) get its pages
        if i == last_prefix:
            store["vision"] = None  # the frozen tower's output: no prefix reads it after this step
        freed = free_dead(store, life, s.index)
    for timer, start, end in marks:  # device seconds: from the device reaching the op to its last kernel's end
        record.times[timer] += seconds_between(start, end)
    for a, b in pairwise(marks):
        boundary = f"{a[0]}-{b[0]}"
        record.gaps_at[boundary] = record.gaps_at.get(boundary, 0.0) + max(seconds_between(a[2], b[1]), 0.0)
    record.gaps_s = sum(record.gaps_at.values())
    return record


def _update_in_flight(engines: Engines) -> bool:
    """Whether the last step's update still runs (`sharing.update_beside_prefix`)."""
    return engines.update_beside_prefix and engines.optimizer.in_flight is not None


def free_dead(store: Store, life: dict[str, Lifetime], step: int) -> list[str]:
    """Drops from the store every graph tensor that no step after `step` reads (its compiled lifetime ends), so
    its memory goes back as the plan counts it gone; their names. The dataset's prompts stay for the whole step."""
    dead = [name for name in store if name in life and name != DATASET and life[name].last <= step]
    for name in dead:
        del store[name]
    return dead


def _handler(o: Op) -> Handler:
    if o.fused_into is not None:
        return _in_backward
    key = (o.kind, o.role, o.part)
    if key not in HANDLERS and o.kind is NodeKind.FORWARD and o.role in (Role.ACTOR, Role.CRITIC):
        problem = f"op '{o.id}' scores for a trained role, and another op reads its scores before the role's backward"
        raise SpecError("graph", problem, "the runtime scores inside the backward: read them after it")
    if key not in HANDLERS:
        raise NotImplementedError(f"op '{o.id}' ({o.kind.value}, {o.role}, {o.part.value}) has no CPU runtime yet")
    return HANDLERS[key]


def _decode(e: Engines, g: nx.DiGraph, o: Op, store: Store, record: StepRecord, prefixes: Sequence[Op] = ()) -> None:
    """Rollout; the `prefixes` (if any) advance chunk by chunk between its decode steps (`rollplex.rollout.beside`)."""
    prompts = store["prompts"]
    jobs = []
    for p in prefixes:
        job = PREFIX_JOBS[(p.kind, p.role, p.part)](e, prompts, store["vision"], **job_options(g, p, len(prompts)))
        jobs.append(paged_out_after(e, g, p, job))
    beside = e.prefix_streams.beside(jobs) if jobs else None
    shared = {} if e.dp is None else {"rows": e.dp.rows(len(prompts), e.group_size)}
    prefilled = [store[t] for t in o.inputs if t != DATASET]  # the actor prefix's boundary (`prefill_from_actor`)
    if prefilled:
        shared["boundary"] = prefilled[0].leaf.detached()
    rollout = e.rollout(
        prompts, num_samples=e.group_size, params=e.sampling, generator=e.generator, beside=beside,
        max_lens=length_budgets(e, len(prompts)), **shared,
    )  # fmt: skip
    if e.dp is not None and e.rollout_draws_per_step:
        burn(e, rollout, shared["rows"][1])
    store[o.outputs[0]] = rollout
    record.response_lens, record.responses = rollout.response_lens, rollout.responses
    stats = e.rollout_stats()
    if stats is not None:
        record.stats["decode_s"] = stats.decode_s
        if stats.step_spans:
            record.stats["decode_steps_s"], record.stats["decode_idle_s"] = decode_time(stats.step_spans)
    if beside is not None:
        chunks_during_decode = beside.num_chunks
        for p, result in zip(prefixes, beside.finish(), strict=True):
            if isinstance(result, LeafBoundary) and beside.stream is not None:
                result = replace(result, other_stream=True)  # its backward partly runs on that stream
            store[p.outputs[0]] = result
        record.chunks = [(prefixes[job].id, start, end) for job, start, end in beside.spans()]
        record.stats["prefix_chunks_during_decode"] = chunks_during_decode / max(beside.num_chunks, 1)
        slowdown = None if stats is None else decode_slowdown(stats.step_spans, [(s, t) for _, s, t in record.chunks])
        if slowdown is not None:
            record.stats["decode_slowdown"] = slowdown


def _reward(e: Engines, g: nx.DiGraph, o: Op, store: Store, record: StepRecord) -> None:
    """Each response scored by every reward term (`grading.grade`); the summed reward goes on, the terms' means and
    the accuracy to the metrics."""
    rollout = _read(g, store, o, NodeKind.DECODE)
    grades = grade(rollout, store["examples"], e.tokenizer, e.reward)
    rewards = grades.rewards.to(rollout.responses.device)
    store[o.outputs[0]] = rewards
    record.rewards = rewards
    record.reward_terms = dict(zip(e.reward.names, (grades.term_sums / rewards.numel()).tolist(), strict=True))
    record.stats["accuracy"] = grades.num_correct / rewards.numel()


def _ref_prefix(e: Engines, g: nx.DiGraph, o: Op, store: Store, record: StepRecord) -> None:
    store[o.outputs[0]] = drain(ref_prefix_job(e, store["prompts"], store["vision"]))


def _ref_suffix(e: Engines, g: nx.DiGraph, o: Op, store: Store, record: StepRecord) -> None:
    boundary = _read(g, store, o, NodeKind.FORWARD, Role.REFERENCE, Part.PREFIX)
    with torch.no_grad():
        rollout = _read(g, store, o, NodeKind.DECODE)
        store[o.outputs[0]] = score_all(
            e.reference, store["prompts"], boundary, rollout, e.temperature, e.microbatch_tokens
        )


def _ref_whole(e: Engines, g: nx.DiGraph, o: Op, store: Store, record: StepRecord) -> None:
    with torch.no_grad():
        rollout = _read(g, store, o, NodeKind.DECODE)
        store[o.outputs[0]] = score_all(e.reference, store["prompts"], None, rollout, e.temperature)


def _actor_prefix(e: Engines, g: nx.DiGraph, o: Op, store: Store, record: StepRecord) -> None:
    prompts = store["prompts"]
    if o.minibatch is not None:  # a later mini-batch's prefix, on the weights the previous update wrote
        prompts = prompts[o.minibatch.prompts(len(prompts))]
    first = _update_in_flight(e)  # its inputs cross the link before the update's state does
    options = job_options(g, o, len(prompts))
    store[o.outputs[0]] = drain(actor_prefix_job(e, prompts, store["vision"], inputs_first=first, **options))


def _critic_prefix(e: Engines, g: nx.DiGraph, o: Op, store: Store, record: StepRecord) -> None:
    store[o.outputs[0]] = drain(critic_prefix_job(e, store["prompts"], store["vision"]))


def _critic_backward(e: Engines, g: nx.DiGraph, o: Op, store: Store, record: StepRecord) -> None:
    """The critic's scoring (the op it fuses), value loss and backward (`critic.py`); the values are its scoring's
    output, which the actor's backward reads."""
    scoring = op(g, o.fuses[0])
    rollout = _read(g, store, scoring, NodeKind.DECODE)
    boundary = _read(g, store, scoring, NodeKind.FORWARD, Role.CRITIC, Part.PREFIX, required=False)
    rewards = _read(g, store, o, NodeKind.REWARD)
    result = train_critic(
        e.critic,
        e.ppo,
        store["prompts"],
        rollout,
        rewards,
        boundary,
        e.critic_microbatch_memory,
        e.dp,
        e.microbatch_tokens,
    )
    store[scoring.outputs[0]] = result.values
    record.stats["value_loss"] = float(result.loss) if e.dp is None else e.dp.sum([float(result.loss)])[0]
    store[o.outputs[0]] = Gradients(int(rollout.response_lens.sum()))


def _critic_update(e: Engines, g: nx.DiGraph, o: Op, store: Store, record: StepRecord) -> None:
    _sum_grads(e.dp, e.critic_optimizer)
    record.stats["critic_grad_norm"] = float(e.critic_optimizer.step())
    e.critic_optimizer.zero_grad()


def _in_backward(e: Engines, g: nx.DiGraph, o: Op, store: Store, record: StepRecord) -> None:
    """A scoring op fused into its role's backward (`fuse_scoring`): the backward runs it and writes its outputs."""


def _actor_backward(e: Engines, g: nx.DiGraph, o: Op, store: Store, record: StepRecord) -> None:
    """One mini-batch's (or the whole step's) scoring (the op it fuses), loss and backward (`training`). Its inputs,
    by the ops that produce them: the rollout, the rewards, the reference's scores, the critic's values (PPO), the
    first mini-batch's scores of every response (later mini-batches' old log-probs)."""
    scoring = op(g, o.fuses[0])
    rollout = _read(g, store, scoring, NodeKind.DECODE)
    rewards = _read(g, store, o, NodeKind.REWARD)
    values = _read(g, store, o, NodeKind.FORWARD, Role.CRITIC, required=False)
    old = [t for t in o.inputs if t not in scoring.outputs and _made_by(g, t, NodeKind.FORWARD, Role.ACTOR)]
    x = MiniBatchInputs(
        prompts=store["prompts"],
        rollout=rollout,
        rewards=rewards,
        ref=_read(g, store, o, NodeKind.FORWARD, Role.REFERENCE, required=False),
        boundary=_read(g, store, scoring, NodeKind.FORWARD, Role.ACTOR, Part.PREFIX, required=False),
        old_logprobs=store[old[0]] if old else None,
        advantages=None if values is None else advantages(e.ppo, rewards, values, rollout, e.dp),
    )
    every = train_minibatch(e, o.minibatch or MiniBatch(0, 1), x, record.train)
    if every is not None:
        store[scoring.outputs[1]] = every
    record.stats.update(record.train.stats(e.dp))  # one host sync (and, data-parallel, the sums over the ranks)
    record.prefix_backward_s = record.train.prefix_backward_s()
    store[o.outputs[0]] = Gradients(int(rollout.response_lens.sum()))


def _update(e: Engines, g: nx.DiGraph, o: Op, store: Store, record: StepRecord) -> None:
    pending, record.train.pending_sum = record.train.pending_sum, None
    if pending is not None:  # started inside the backward (`OverlappedSum`)
        pending.finish()
    else:
        _sum_grads(e.dp, e.optimizer)
    norm = e.optimizer.step(defer=True) if e.update_beside_prefix else e.optimizer.step()  # (the norm is waited for)
    record.train.grad_norms.append(float(norm))
    record.stats["grad_norm"] = sum(record.train.grad_norms) / len(record.train.grad_norms)
    e.optimizer.zero_grad()
    e.publish()


def _sum_grads(dp, optimizer) -> None:
    """Data-parallel: each rank's loss is its share of the step's, so the summed gradients are the step's."""
    if dp is not None:
        grads = [optimizer.grad_of(i) for i in range(len(optimizer.params))]
        dp.all_reduce_grads([g for g in grads if g is not None])


def _read(
    g: nx.DiGraph,
    store: Store,
    o: Op,
    kind: NodeKind,
    role: Role | None = None,
    part: Part | None = None,
    *,
    required: bool = True,
):
    """The value of the op's input that an op of this kind (and role, and part; a scoring op when no part is given)
    produces: the IR's tensor names, whatever the spec calls them, connect an op to what it reads."""
    found = [store[t] for t in o.inputs if _made_by(g, t, kind, role, part)]
    if not found and required:
        raise ValueError(f"op '{o.id}' reads nothing a {kind.value} op makes; its inputs are {list(o.inputs)}")
    return found[0] if found else None


def _made_by(g: nx.DiGraph, tensor: str, kind: NodeKind, role: Role | None = None, part: Part | None = None) -> bool:
    maker = producer(g, tensor)
    if maker is None or maker.kind is not kind or (role is not None and maker.role is not role):
        return False
    return maker.part is part if part is not None else maker.part is not Part.PREFIX


HANDLERS: dict[tuple, Handler] = {
    (NodeKind.DECODE, Role.ROLLOUT, Part.WHOLE): _decode,
    (NodeKind.REWARD, None, Part.WHOLE): _reward,
    (NodeKind.FORWARD, Role.REFERENCE, Part.PREFIX): _ref_prefix,
    (NodeKind.FORWARD, Role.REFERENCE, Part.SUFFIX): _ref_suffix,
    (NodeKind.FORWARD, Role.REFERENCE, Part.WHOLE): _ref_whole,
    (NodeKind.FORWARD, Role.ACTOR, Part.PREFIX): _actor_prefix,
    (NodeKind.FORWARD, Role.CRITIC, Part.PREFIX): _critic_prefix,
    (NodeKind.BACKWARD, Role.CRITIC, Part.WHOLE): _critic_backward,
    (NodeKind.UPDATE, Role.CRITIC, Part.WHOLE): _critic_update,
    (NodeKind.BACKWARD, Role.ACTOR, Part.WHOLE): _actor_backward,
    (NodeKind.UPDATE, Role.ACTOR, Part.WHOLE): _update,
}
