"""`lower_residency`: memory objects -> per-step HBM bytes, per-phase peaks, optimizer chunking, host pool.

Like a tinygrad-style planner: each object is open over its live steps; a step holds the sum of its open
objects, save that a role's objects taking turns within the step count only the largest turn (`held`); the peak
of a phase is its largest step. The streamed optimizer is sized last, into what the update
step leaves free: `pipeline_depth` chunks of FP32 state (load j+1, update j, offload j-1) at once, none where
all of the state stays in HBM (the optimizer updates it in place).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rollplex.graph.ir import NodeKind, Part, Phase, Role, TensorClass, ops, prefilled_decodes, steps
from rollplex.graph.memobject import GIB, Component, Context, MemObject, Residency, held, held_bytes
from rollplex.graph.objects import kept_layer_bytes, prompt_inputs_first

PIPELINE_DEPTH = 3
MAX_AUTO_CHUNK = 1 * GIB  # larger chunks stop helping once transfers overlap compute
MIN_AUTO_CHUNK = 256 * 2**20
# an update deferred beside the next actor prefix keeps in_flight.AHEAD chunks queued on the host link, and a first
# use in the prefix (a new cuDNN plan, a lazily loaded kernel) waits for all of them: small chunks keep that short
BESIDE_PREFIX_CHUNK = 128 * 2**20
CHUNK_ALIGN = 2 * 2**20  # VMM page granularity
STATE_BYTES_PER_ELEMENT = 12  # FP32 master + two Adam moments
SCRATCH_BYTES = 8 * 2**20  # the optimizer's 4 MiB scratch + one FP32 norm per chunk segment
SPEND_LIMIT = 0.9  # of the card, for choices made to save time: a run's device peaks sit up to ~10 % above the plan


@dataclass(frozen=True, slots=True)
class PhasePeak:
    phase: Phase
    steps: tuple[int, ...]
    peak_bytes: int
    peak_step: int


@dataclass(frozen=True, slots=True)
class OptimizerPlan:
    state_bytes: int  # FP32 master + moments this GPU updates
    chunk_bytes: int
    num_chunks: int
    pipeline_depth: int  # chunks staged at once; 0 where the whole state lives in HBM (updated in place)

    @property
    def workspace_bytes(self) -> int:
        """The chunks in flight, plus one chunk's FP32 gradient (what ChunkedAdamW carves)."""
        elements = self.chunk_bytes // STATE_BYTES_PER_ELEMENT
        return min(self.pipeline_depth, self.num_chunks) * self.chunk_bytes + 4 * elements + SCRATCH_BYTES


@dataclass(frozen=True, slots=True)
class HostPlan:
    needed_bytes_per_node: int
    pinned_bytes_per_node: int  # the pool allocated at start: the spec's size, or what is needed
    capacity_bytes_per_node: int

    @property
    def fits(self) -> bool:
        return self.needed_bytes_per_node <= self.pinned_bytes_per_node <= self.capacity_bytes_per_node


@dataclass(frozen=True, slots=True)
class ResidencyPlan:
    objects: tuple[MemObject, ...]
    step_bytes: tuple[int, ...]  # HBM in use in each step
    phases: tuple[PhasePeak, ...]
    optimizer: OptimizerPlan | None
    host: HostPlan
    capacity_bytes: int
    state_share_bytes: int = 0  # the share of the FP32 state kept in HBM where the rest streams (`keep_state_share`)
    update_beside: tuple[int, ...] = ()  # the steps the actor's update runs on into (`update_beside_steps`)
    layers_kept: int = 0  # the actor's last decoder layers kept whole under recompute (`keep_layers`)
    spent_layers_bytes: int = 0  # of them, the bytes `layers_kept: auto` spent on room the plan left idle

    @property
    def peak_bytes(self) -> int:
        return max(self.step_bytes, default=0)

    @property
    def need_bytes(self) -> int:
        """The peak without what only takes room the plan leaves idle (the FP32 state's share kept in HBM, the
        layers `layers_kept: auto` keeps whole): what the plan needs, the figure a change of the spec lowers."""
        return self.peak_bytes - self.state_share_bytes - self.spent_layers_bytes

    @property
    def fits_hbm(self) -> bool:
        return self.peak_bytes <= self.capacity_bytes

    @property
    def fits(self) -> bool:
        return self.fits_hbm and self.host.fits

    def in_hbm(self, step: int) -> list[MemObject]:
        """At the step's peak (`held`)."""
        return held(self.objects, step)


def lower_residency(c: Context, objects: list[MemObject]) -> ResidencyPlan:
    """Requires: objects from `memory_objects` on a graph with steps.
    Ensures: every step's HBM sum; the phase peaks; an optimizer workspace object in each update step."""
    capacity = int(c.spec.cluster.hbm_gib * GIB)
    optimizer = None
    beside = update_beside_steps(c)
    update = _update_steps(c) | beside  # where the update's workspace and the gradients it reads are held
    if beside:
        objects = [replace(o, live=o.live | beside) if _held_by_update(o) else o for o in objects]
        objects = [*objects, prompt_inputs_first(c, beside)]
    host_room = int((c.spec.memory.host_pool_gib or c.spec.cluster.host_gib) * GIB) // c.spec.cluster.gpus_per_node
    named = c.spec.memory.layers_kept != "auto"
    if named:  # the spec's number: held like the activations, before any choice spends HBM
        objects, kept = keep_layers(c, objects, capacity)
    objects = spend_hbm(objects, capacity, update, c.spec.memory)
    objects = keep_in_hbm_when_room(objects, capacity, update, host_room, c.spec.memory)
    unshared, share, room = objects, 0, _spend_room(objects, capacity, update)
    if c.spec.memory.optimizer_state == "auto":
        objects, share = keep_state_share(unshared, room, STATE_SHARE_GRANULE)
    if update:
        optimizer = plan_optimizer(c, objects, update, capacity)
        if share % optimizer.chunk_bytes:  # the optimizer keeps whole chunks: so does the plan (less is still room)
            objects, share = keep_state_share(unshared, room, optimizer.chunk_bytes)
        live = frozenset(update)
        objects = [
            *objects,
            MemObject(
                "optimizer",
                Component.OPTIMIZER_CHUNKS,
                TensorClass.PHASE_LOCAL,
                optimizer.workspace_bytes,
                live,
                Residency.ABSENT,
            ),
        ]
    spent = 0
    if not named:  # auto: what is left idle after every other choice
        before = max(held_bytes(objects, s.index) for s in steps(c.g))
        objects, kept = keep_layers(c, objects, int(capacity * SPEND_LIMIT))
        spent = max(held_bytes(objects, s.index) for s in steps(c.g)) - before
    step_bytes = tuple(held_bytes(objects, s.index) for s in steps(c.g))
    return ResidencyPlan(
        tuple(objects), step_bytes, _phase_peaks(c, step_bytes), optimizer, plan_host(c, objects), capacity, share,
        tuple(sorted(beside)), kept, spent,
    )  # fmt: skip


def keep_layers(c: Context, objects: list[MemObject], room: int) -> tuple[list[MemObject], int]:
    """`memory.layers_kept`: the actor's last decoder layers that keep every tensor under recompute (each
    `kept_layer_bytes` more), as one object over its microbatch's activations' steps: the spec's number (placed
    first, as the activations are), or at auto the most that keep each of those steps within `room` (SPEND_LIMIT
    of the card) after every other object: HBM that would sit idle, each layer kept one rerun less in backward.
    They are held in the activations' turn, so they may first fill what the backward through the prefix holds in
    its turn. Returns the objects and the layers kept."""
    per_layer = kept_layer_bytes(c, Role.ACTOR)
    activations = [o for o in objects if o.role == "actor" and o.component is Component.ACTIVATIONS and not o.vision]
    if not activations or per_layer == 0:
        return objects, 0
    first = activations[0]

    def keeping(n: int) -> list[MemObject]:  # held with the microbatch's activations, in their turn
        name = f"activations, last {n} layers kept whole"
        kept = MemObject("actor", Component.LAYERS_KEPT, TensorClass.PHASE_LOCAL, n * per_layer, first.live,
                         Residency.ABSENT, name=name, turn=first.turn)  # fmt: skip
        return [*objects, kept] if n else objects

    chosen = c.spec.memory.layers_kept
    if chosen == "auto":
        fits = (n for n in range(c.model.text.num_hidden_layers, 0, -1) if _within(keeping(n), first.live, room))
        chosen = next(fits, 0)
    return keeping(chosen), chosen


def _within(objects: list[MemObject], live: frozenset[int], room: int) -> bool:
    return all(held_bytes(objects, s) <= room for s in live)


def spend_hbm(objects: list[MemObject], capacity: int, update: set[int], memory) -> list[MemObject]:
    """HBM for what would otherwise cross the host link every step, while every step stays within SPEND_LIMIT of
    the card: the actor prefix's saved tensors (out in Phase 1, back in its backward), then the FP32 optimizer
    state (streamed at each update). `memory.prefix_saved` / `memory.optimizer_state` force either way; `auto`
    decides by fit."""
    objects = list(objects)
    room = _spend_room(objects, capacity, update)
    everywhere = frozenset(room)
    families = (
        (memory.prefix_saved, lambda o: o.component is Component.PREFIX_SAVED, None),
        (memory.optimizer_state, lambda o: o.component in (Component.MASTER, Component.MOMENTS), everywhere),
    )
    for choice, member, live in families:
        if choice == "host":
            continue
        trial = [
            replace(o, live=live or o.window, host_bytes=0, outside=Residency.ABSENT)
            if member(o) and o.host_bytes
            else o
            for o in objects
        ]
        if choice == "hbm" or all(held_bytes(trial, s) <= room[s] for s in room):
            objects = trial
    return objects


def _spend_room(objects: list[MemObject], capacity: int, update: set[int]) -> dict[int, int]:
    """Per step, the HBM that choices made to save time may fill: SPEND_LIMIT of the card, less the smallest
    optimizer pipeline in update steps."""
    limit = int(capacity * SPEND_LIMIT)
    return {s: limit - (PIPELINE_DEPTH * MIN_AUTO_CHUNK if s in update else 0) for s in _all_steps(objects)}


STATE_SHARE_GRANULE = 256 * 2**20  # the share of the FP32 state before the optimizer's chunk is known


def keep_state_share(objects: list[MemObject], room: dict[int, int], granule: int) -> tuple[list[MemObject], int]:
    """Where the actor's FP32 state stays on the host, the share of it that every step still has room for (after
    every other choice: it takes only HBM that would sit idle) stays in HBM, the optimizer's first chunks: each
    state object split in proportion, its kept part in HBM in every step, the rest on the host. Each byte kept is
    a byte less over the host link in each direction. The share is whole `granule`s (the optimizer's chunks).
    Returns the objects and the bytes kept."""
    state = [o for o in objects if o.role == "actor" and o.component in (Component.MASTER, Component.MOMENTS)]
    state = [o for o in state if o.host_bytes]
    total = sum(o.host_bytes for o in state)
    free = min(room[s] - held_bytes(objects, s) for s in room) if room else 0
    share = min(max(free, 0) // granule * granule, total)
    if not state or share == 0:
        return objects, 0
    everywhere = frozenset(room)
    out = []
    for o in objects:
        if o not in state:
            out.append(o)
            continue
        kept = o.host_bytes * share // total
        out.append(
            replace(
                o, bytes=kept, live=everywhere, host_bytes=0, outside=Residency.ABSENT, name=f"{o.label}, kept in HBM"
            )
        )
        out.append(replace(o, bytes=o.bytes - kept, host_bytes=o.host_bytes - kept))
    return out, sum(o.bytes for o in out if o.live and o.component in (Component.MASTER, Component.MOMENTS))


def keep_in_hbm_when_room(
    objects: list[MemObject], capacity: int, update: set[int], host_room: int, memory
) -> list[MemObject]:
    """The host pool takes what HBM need not hold. Only when the pool would exceed `host_room` (bytes per
    GPU) do frozen weights and prefix saved tensors stay in HBM over their window instead: largest first, a
    role's component whole (its decoder and vision parts together), each only if every step still fits
    (update steps keeping room for the smallest optimizer pipeline). Prefix saved tensors the spec sends to the
    host (`memory.prefix_saved: host`) stay there: the HBM they leave goes to the FP32 state's share
    (`keep_state_share`), which lowers the pool in turn."""
    objects = list(objects)
    room = {s: capacity - (PIPELINE_DEPTH * MIN_AUTO_CHUNK if s in update else 0) for s in _all_steps(objects)}
    forced = Component.PREFIX_SAVED if memory.prefix_saved == "host" else None
    groups: dict[tuple[str, str], list[int]] = {}  # a role's component, decoder and vision parts: moved together,
    for i, o in enumerate(objects):  # as the runtime moves them (one pager, one offload context)
        if o.movable and o.component is not forced:
            groups.setdefault((o.role, o.component), []).append(i)
    for members in sorted(groups.values(), key=lambda m: -sum(objects[i].bytes for i in m)):
        if sum(o.host_bytes for o in objects) <= host_room:
            break
        trial = [replace(o, live=o.window, host_bytes=0) if i in members else o for i, o in enumerate(objects)]
        if all(held_bytes(trial, s) <= room[s] for s in room):
            objects = trial
    return objects


def _all_steps(objects: list[MemObject]) -> set[int]:
    return {s for o in objects for s in o.live | o.window}


def update_beside_steps(c: Context) -> set[int]:
    """With `sharing.update_beside_prefix: true` (`compile_plan` settles auto), where decode reads the actor
    prefix's boundary (the prefix runs first, alone): that prefix's steps, which the actor's update of the step
    before runs on into. Else none."""
    if c.spec.sharing.update_beside_prefix is not True or not prefilled_decodes(ops(c.g)):
        return set()
    prefixes = {o.id for o in ops(c.g) if o.role is Role.ACTOR and o.part is Part.PREFIX}
    return {s.index for s in steps(c.g) if prefixes & set(s.ops)}


def _held_by_update(o: MemObject) -> bool:
    """The actor's gradients: a deferred update reads them until its last chunk."""
    return o.role == "actor" and o.component is Component.GRADIENTS


def _update_steps(c: Context) -> set[int]:
    ids = {n for n in c.g.nodes if c.g.nodes[n]["op"].kind is NodeKind.UPDATE}
    return {s.index for s in steps(c.g) if ids & set(s.ops)}


def plan_optimizer(c: Context, objects: list[MemObject], update: set[int], capacity: int) -> OptimizerPlan:
    state = sum(o.bytes for o in objects if o.cls is TensorClass.PERMANENT)
    used = max(held_bytes(objects, s) for s in update)
    if c.spec.memory.optimizer_chunk_mib is not None:
        chunk = c.spec.memory.optimizer_chunk_mib * 2**20
    else:
        free = max(capacity - used - SCRATCH_BYTES, 0) * STATE_BYTES_PER_ELEMENT // (PIPELINE_DEPTH * 12 + 8)
        most = BESIDE_PREFIX_CHUNK if update_beside_steps(c) else MAX_AUTO_CHUNK
        chunk = max(CHUNK_ALIGN, min(most, free) // CHUNK_ALIGN * CHUNK_ALIGN)
    chunk = min(chunk, max(state, 1))
    streams = any(o.host_bytes for o in objects if o.component in (Component.MASTER, Component.MOMENTS))
    return OptimizerPlan(state, chunk, -(-state // chunk), PIPELINE_DEPTH if streams else 0)


def plan_host(c: Context, objects: list[MemObject]) -> HostPlan:
    per_gpu = sum(o.host_bytes for o in objects)
    needed = per_gpu * c.spec.cluster.gpus_per_node
    pool = c.spec.memory.host_pool_gib
    pinned = int(pool * GIB) if pool is not None else needed
    return HostPlan(needed, pinned, int(c.spec.cluster.host_gib * GIB))


def _phase_peaks(c: Context, step_bytes: tuple[int, ...]) -> tuple[PhasePeak, ...]:
    peaks = []
    for phase in Phase:
        idx = tuple(s.index for s in steps(c.g) if s.phase is phase)
        if idx:
            top = max(idx, key=lambda i: step_bytes[i])
            peaks.append(PhasePeak(phase, idx, step_bytes[top], top))
    return tuple(peaks)
