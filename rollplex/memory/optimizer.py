"""Chunked AdamW: FP32 master weights and Adam moments live in a host pool and stream through the device.

What it is: the Phase-3 update. Parameters (BF16 or FP32 model tensors) are cut into byte-balanced chunks;
each chunk's FP32 state (master + exp_avg + exp_avg_sq, 12 bytes per element) is loaded into a device slot,
updated, written back to the host, and its new values are written into a destination the caller chooses
(by default the parameters themselves; in rollplex, the snapshot rollout reads). On CUDA three streams
overlap load (j+1), Adam (j) and offload (j-1); on CPU the same loop runs in order with no streams. State the
plan keeps in HBM (all of it, `state_on_device`, or the first chunks, `resident_bytes`) is updated in its pool
block, nothing copied, first: the host link carries only the others, whose loads start at once.

Numerics: `clip_grad_norm_` (when `max_grad_norm` is set) then `torch.optim.AdamW(fused=True).step()` on each
element (its kernel: `adamw.adamw_`). The global grad norm and the clipping coefficient are complete before any
chunk commits. Gradients are read, never modified; with `fp32_grads` they accumulate in FP32 (`main_grads.py`).
What it is not: a `torch.optim.Optimizer` (one group, no closures, no AMSGrad); its state dict (`optimizer_state`)
has torch's layout plus each parameter's FP32 "master".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING

import torch

from rollplex.memory import optimizer_state
from rollplex.memory.adamw import AdamWConfig, adamw_
from rollplex.memory.host_pool import HostPool, aligned_total, copy_on, on_stream, tail_event
from rollplex.memory.in_flight import UpdateInFlight
from rollplex.memory.main_grads import MainGrads
from rollplex.memory.state_layout import STATE_BYTES_PER_ELEMENT, Chunk, Segment, Shard, plan_chunks, resident_chunks
from rollplex.memory.update_ranks import global_norm, share_updates

if TYPE_CHECKING:  # the group is only passed through: memory does not import parallel
    from rollplex.parallel.group import TPGroup

NUM_SLOTS = 3  # pipeline depth: load j+1 | adam j | offload j-1
SCRATCH_BYTES = 4 << 20  # allowance beside the workspace: allocator rounding, reduction scratch, scalars
Writer = Callable[[int, int, torch.Tensor], None]  # (param index, first flat element, new FP32 values)


def copy_into(tensors: Sequence[torch.Tensor]) -> Writer:
    """A writer that copies (and casts) new values into contiguous `tensors`, one per parameter."""
    flats = [t.detach().view(-1) for t in tensors]

    def write(index: int, start: int, values: torch.Tensor) -> None:
        flats[index][start : start + values.numel()].copy_(values)

    return write


@dataclass(frozen=True)
class _StepArgs:
    """What each chunk of one step reads: the settings, the step number, the clip coefficient, the writer, and
    the gradients (as they were when the step began: `zero_grad()` may drop them before the last chunk is enqueued;
    zeroing them in place joins the step first)."""

    config: AdamWConfig
    number: torch.Tensor  # 0-d FP32 on the device, made on the Adam stream (freed there, reused only there)
    coef: torch.Tensor | None
    write: Writer
    grads: list[torch.Tensor]


class ChunkedAdamW:
    """AdamW whose FP32 state lives in a host pool and visits the device one chunk at a time.

    A chunk's FP32 state, each step:

        HOST (pool block) --load--> STAGED (device slot m % 3) --adam--> UPDATED --offload--> HOST
                                                                    \\--write--> destination (BF16 or FP32)
        HBM (pool block, state kept on the device) --adam, in place--> UPDATED --write--> destination

    One step:

        start:  load the first streamed chunk    (load stream)
                grad-norm pass over all chunks   (adam stream: global norm, clip coefficient)
        loop j: the kept chunks in place, then load j+1 | adam j + write j | offload j-1  (three streams, events)
        end:    the caller's stream waits for all three; the workspace goes back to the allocator
                (deferred: it waits for the norm only; the chunks go as `wait_for` / `finish` ask: `in_flight.py`)

    Peak extra device bytes of a step: `peak_device_bytes` = `num_slots` x the chunk state (NUM_SLOTS, none where
    the state lives on the device) + an FP32 gradient buffer of one chunk + one norm per
    segment + SCRATCH_BYTES.
    Change hyperparameters (the learning rate, say) with `opt.config = replace(opt.config, lr=...)`.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        max_grad_norm: float | None = None,
        chunk_bytes: int = 256 << 20,
        *,
        pool: HostPool | None = None,
        write: Writer | None = None,
        tp: TPGroup | None = None,
        sharded: Sequence[bool] | None = None,
        fp32_grads: bool = False,
        state_on_device: bool = False,
        resident_bytes: int = 0,
        shard: Shard | None = None,
    ) -> None:
        """`state_on_device`: the FP32 state lives in HBM (the plan's choice when it fits; on a CPU model, in the
        model's memory) and each chunk is updated where it lives; by default it lives in pinned host memory.
        `resident_bytes`: with the state on the host, the first chunks of at most that many bytes of state stay in
        HBM all the same (the plan's share of the state that fits): a step updates those first, in place, while the
        others stream. The first are the parameters a forward reads first (the model's order), so that the next
        step's prefix can start on them while a deferred step still streams the rest.
        `shard`: this rank keeps and updates only its share of the state (ZeRO-1); the gradients must already be
        summed over the ranks."""
        self.params = list(params)
        self.main_grads = MainGrads(self.params) if fp32_grads else None
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.tp, self.sharded = tp, list(sharded or [False] * len(self.params))
        self.sharded_segments: torch.Tensor | None = None  # per segment, sharded over TP: `update_ranks.global_norm`
        assert len(self.sharded) == len(self.params), "one sharded flag per parameter"
        if sum(p.numel() for p in self.params) == 0:
            raise ValueError(f"ChunkedAdamW got {len(self.params)} parameters and no elements to update")
        self.config = AdamWConfig(lr, tuple(betas), eps, weight_decay, max_grad_norm)
        self.device = self.params[0].device
        self.starts = (0, *accumulate(p.numel() for p in self.params))  # flat offsets, then the total
        self.shard = shard
        if shard is not None and self.starts[-1] < shard.size:
            raise ValueError(f"{self.starts[-1]} elements cannot be sharded over {shard.size} ranks")
        self.lo, self.hi = (0, self.starts[-1]) if shard is None else shard.bounds(self.starts[-1])
        self.chunks = plan_chunks([p.numel() for p in self.params], chunk_bytes, self.lo, self.hi)
        self.chunk_elements = chunk_bytes // STATE_BYTES_PER_ELEMENT
        self.capacity = max(chunk.numel for chunk in self.chunks)
        kept = 0 if state_on_device else resident_chunks(self.chunks, resident_bytes)
        if kept == len(self.chunks):  # the whole state stays in HBM
            state_on_device, kept = True, 0
        self.num_streamed = len(self.chunks) - kept  # the last chunks, in `pool`; the kept ones in `device_pool`
        self.num_moved = 0 if state_on_device else self.num_streamed  # the others are updated where they live
        self.first_moved = len(self.chunks) - self.num_moved  # chunks from here on visit the device slots
        on_host = not state_on_device or self.device.type == "cpu"
        self.pool = pool or HostPool(
            aligned_total(STATE_BYTES_PER_ELEMENT * c.numel for c in self.chunks[kept:]),
            pin=on_host and self.device.type == "cuda",
            device=None if on_host else self.device,
        )
        self.device_pool = (
            HostPool(aligned_total(STATE_BYTES_PER_ELEMENT * c.numel for c in self.chunks[:kept]), device=self.device)
            if kept
            else None
        )
        self.pools = [self.device_pool] * kept + [self.pool] * self.num_streamed
        self.write = write or copy_into(self.params)  # where new values go; may be swapped between steps
        self.num_segments = sum(len(chunk.segments) for chunk in self.chunks)
        self._segments_of: list[list[tuple[int, Segment]]] = [[] for _ in self.params]  # (chunk, segment)
        for j, chunk in enumerate(self.chunks):
            for seg in chunk.segments:
                self._segments_of[seg.param_index].append((j, seg))
        self.blocks = tuple(
            self.pools[j].allocate(STATE_BYTES_PER_ELEMENT * c.numel, f"adamw chunk {j}")
            for j, c in enumerate(self.chunks)
        )
        cuda = self.device.type == "cuda"
        self._streams = tuple(torch.cuda.Stream(self.device) if cuda else None for _ in range(3))
        self._done: torch.cuda.Event | None = None
        self.in_flight: UpdateInFlight | None = None  # a deferred step's work still on the streams
        self.num_steps = 0
        self.last_grad_norm: torch.Tensor | None = None
        for i, p in enumerate(self.params):
            self.write_param_state(i, p.detach(), None, None)

    @property
    def num_slots(self) -> int:
        """Device slots a step stages chunks in: none where every chunk's state already lives on the device."""
        return min(NUM_SLOTS, self.num_moved)

    @property
    def workspace_bytes(self) -> int:
        return 4 * (self.capacity * (3 * self.num_slots + 1) + self.num_segments)

    @property
    def peak_device_bytes(self) -> int:
        return self.workspace_bytes + SCRATCH_BYTES

    @property
    def num_bytes_moved(self) -> int:
        """Bytes copied in one step: every moved chunk's state loaded and offloaded once (host<->device on a GPU)."""
        return 2 * STATE_BYTES_PER_ELEMENT * sum(chunk.numel for chunk in self.chunks[self.first_moved :])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drops the gradients (a deferred step keeps those it still reads), or with `set_to_none=False` zeroes them
        in place, once a deferred step's every chunk has read them (`finish`)."""
        if not set_to_none:
            self.finish()
        if self.main_grads is not None:
            self.main_grads.zero(set_to_none)
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def grad_of(self, i: int) -> torch.Tensor | None:
        """Parameter i's gradient as the next step reads it (its FP32 main grad under `fp32_grads`)."""
        return self.params[i].grad if self.main_grads is None else self.main_grads.grad_of(i)

    @torch.no_grad()
    def step(self, defer: bool = False) -> torch.Tensor:
        """One AdamW step over every chunk; returns the global grad norm (0-d FP32 on the device). With `defer`
        (on a GPU) the caller's stream waits for the norm only: the rest runs on (`in_flight`; `wait_for`,
        `finish`)."""
        self.finish()
        grads = [self.grad_of(i) for i in range(len(self.params))]
        missing = [i for i, g in enumerate(grads) if g is None]
        if missing:
            raise ValueError(f"parameters {missing[:8]} have no .grad; pass only parameters that receive gradients")
        slots, grad, norms = self._carve_workspace()  # a step that finds no memory leaves the count as it was
        load, adam, offload = self._streams
        for stream in (load, adam, offload):
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream(self.device))
        loaded = [()] * NUM_SLOTS
        if self.num_moved:
            loaded[0] = self._copy(load, self.first_moved, slots[0], into_host=False, after=())
        with on_stream(adam):
            coef = self._grad_norm_pass(norms, grads)
            self.num_steps += 1  # after all the step allocates: only a step that goes ahead counts
            number = torch.full((), float(self.num_steps), dtype=torch.float32, device=self.device)
        normed = tail_event(adam)
        step = _StepArgs(self.config, number, coef, self.write, grads)
        work = self._chunk_work(slots, grad, step, loaded)
        if defer and adam is not None and self.shard is None:
            self._defer(normed, work, (slots, grad, norms, grads))
        else:
            for _ in work:
                pass
            self._join()
        if self.shard is not None:
            share_updates(self)
        return self.last_grad_norm

    @torch.no_grad()
    def _chunk_work(
        self, slots: torch.Tensor, grad: torch.Tensor, step: _StepArgs, loaded: list
    ) -> Iterator[torch.cuda.Event | None]:
        """Enqueues the chunks one at a time (the kept in place, then load j+1 | adam j + write j | offload j);
        yields, after each, the event that marks chunk j's new values written (None on CPU). What a chunk reads of
        the optimizer's settings is fixed in `step` (a deferred step's last chunks are enqueued after the caller
        may change them)."""
        load, adam, offload = self._streams
        offloaded = [()] * NUM_SLOTS
        for j in range(len(self.chunks)):
            if j < self.first_moved:  # its state lives on the device: updated in its pool block, nothing copied
                with on_stream(adam):
                    self._adam(j, self.chunk_state(j).view(-1), grad, step)
                yield next(iter(tail_event(adam)), None)
                continue
            m = j - self.first_moved  # its turn among the moved chunks, which take the slots in turn
            if m + 1 < self.num_moved:
                k = (m + 1) % NUM_SLOTS
                loaded[k] = self._copy(load, j + 1, slots[k], into_host=False, after=offloaded[k])
            slot = slots[m % NUM_SLOTS]
            with on_stream(adam):
                for event in loaded[m % NUM_SLOTS]:
                    adam.wait_event(event)
                self._adam(j, slot, grad, step)
            written = tail_event(adam)
            offloaded[m % NUM_SLOTS] = self._copy(offload, j, slot, into_host=True, after=written)
            yield next(iter(written), None)

    def _defer(self, normed: tuple, work: Iterator[torch.cuda.Event], held: tuple) -> None:
        """The caller's stream waits for the grad norm only; the chunks are enqueued as `in_flight` is asked; `held`
        (the workspace, the gradients) stays allocated until then."""
        current = torch.cuda.current_stream(self.device)
        for event in normed:
            current.wait_event(event)
        last_chunk = {s.param_index: j for j, chunk in enumerate(self.chunks) for s in chunk.segments}
        self.in_flight = UpdateInFlight(work, last_chunk, self._streams, held)
        self.in_flight.pump()

    def wait_for(self, params: Iterable[torch.Tensor]) -> None:
        """The caller's stream waits until these parameters hold a deferred step's new values (nothing to wait for
        when no step is in flight)."""
        if self.in_flight is not None:
            indices = (self._index[id(p)] for p in params if id(p) in self._index)
            self.in_flight.wait_for(indices, torch.cuda.current_stream(self.device))

    def finish(self) -> None:
        """The caller's stream waits for all of a deferred step (parameters, state, gradients); its workspace and
        the gradients it read go back to the allocator."""
        if self.in_flight is not None:
            self._done = self.in_flight.finish(torch.cuda.current_stream(self.device))
            self.in_flight = None

    def _carve_workspace(self) -> tuple[torch.Tensor, ...]:
        """slots [num_slots, 3 * capacity], FP32 grad [capacity], norms [num_segments]."""
        c, n = self.capacity, self.num_slots
        workspace = torch.empty(self.workspace_bytes // 4, dtype=torch.float32, device=self.device)
        slots = workspace[: n * 3 * c].view(n, 3 * c)
        grad = workspace[n * 3 * c : (n * 3 + 1) * c]
        return slots, grad, workspace[(n * 3 + 1) * c :]

    def _grad_norm_pass(self, norms: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor | None:
        """Per segment the L2 norm of its gradient in FP32, read where it lies (torch's multi-tensor norm, as
        `clip_grad_norm_` takes it: a few launches for all of them, not two a segment), then the global norm."""
        views = [grads[s.param_index].reshape(-1)[s.start : s.stop] for chunk in self.chunks for s in chunk.segments]
        torch.stack(torch._foreach_norm(views, 2, dtype=torch.float32), out=norms)
        self.last_grad_norm = global_norm(self, norms)
        if self.config.max_grad_norm is None:
            return None
        return torch.clamp(self.config.max_grad_norm / (self.last_grad_norm + 1e-6), max=1.0)

    def _gather_grads(self, chunk: Chunk, grad: torch.Tensor, grads: Sequence[torch.Tensor]) -> None:
        for s in chunk.segments:
            grad[s.offset : s.offset + s.numel].copy_(grads[s.param_index].reshape(-1)[s.start : s.stop])

    def _adam(self, j: int, slot: torch.Tensor, grad: torch.Tensor, step: _StepArgs) -> None:
        chunk = self.chunks[j]
        master, exp_avg, exp_avg_sq = slot[: 3 * chunk.numel].view(3, chunk.numel)
        g = grad[: chunk.numel]
        self._gather_grads(chunk, g, step.grads)
        if step.coef is not None:
            g.mul_(step.coef)
        adamw_(master, exp_avg, exp_avg_sq, g, step.number, step.config)
        for s in chunk.segments:
            step.write(s.param_index, s.start, master[s.offset : s.offset + s.numel])

    def _copy(self, stream, j: int, slot: torch.Tensor, into_host: bool, after: tuple) -> tuple:
        """Chunk j's FP32 state between its pool block and a device slot; the event that ends the copy."""
        host = self.chunk_state(j).view(-1)
        device = slot[: host.numel()]
        event = copy_on(stream, *((host, device) if into_host else (device, host)), after=after)
        return () if event is None else (event,)

    def chunk_state(self, j: int) -> torch.Tensor:
        """Chunk j's FP32 state in its pool: rows master, exp_avg, exp_avg_sq."""
        return self.pools[j].view(self.blocks[j], torch.float32, (3, self.chunks[j].numel))

    def _join(self) -> None:
        if self._streams[1] is None:
            return
        current = torch.cuda.current_stream(self.device)
        for stream in self._streams:
            current.wait_stream(stream)
        self._done = current.record_event()

    def wait(self) -> None:
        """Until the last step's copies into the pool are done (the host reads the state after)."""
        self.finish()
        if self._done is not None:
            self._done.synchronize()

    def write_param_state(self, i: int, *rows: torch.Tensor | None, base: int = 0) -> None:
        """Parameter i's master, exp_avg and exp_avg_sq into the pool (None: zeros); each source holds the
        parameter's flat elements from `base` on (0: the whole parameter)."""
        self.wait()  # no step still reads or writes the pool
        for j, s in self._segments_of[i]:
            host = self.chunk_state(j)
            for row, source in enumerate(rows):
                part = host[row, s.offset : s.offset + s.numel]
                if source is None:
                    part.zero_()
                else:
                    part.copy_(source.reshape(-1)[s.start - base : s.stop - base])

    def own_range(self, i: int) -> tuple[int, int] | None:
        """The flat elements [start, stop) of parameter i whose state this optimizer keeps (all of them unless
        sharded), or None."""
        segments = [s for _, s in self._segments_of[i]]
        return (segments[0].start, segments[-1].stop) if segments else None

    @property
    def owned(self) -> list[int]:
        """The parameters with state here: all of them, or under ZeRO-1 those with elements in this share."""
        return [i for i in range(len(self.params)) if self._segments_of[i]]

    def read_param_state(self, i: int, row: int) -> torch.Tensor:
        """Row `row` of parameter i's state: its shape, or under ZeRO-1 the flat elements of `own_range`."""
        self.wait()  # the last step's state is in the pool
        start, stop = self.own_range(i)
        whole = self.shard is None
        out = torch.empty(self.params[i].shape if whole else (stop - start,), dtype=torch.float32)
        base = 0 if whole else start
        for j, s in self._segments_of[i]:
            out.view(-1)[s.start - base : s.stop - base].copy_(self.chunk_state(j)[row, s.offset : s.offset + s.numel])
        return out

    def state_dict(self) -> dict:
        """torch.optim.AdamW's layout plus each FP32 master (`optimizer_state.state_parts`), in one part."""
        (whole,) = optimizer_state.state_parts(self, max_bytes=None)
        return whole

    def state_parts(self, max_bytes: int | None = 1 << 30) -> Iterator[dict]:
        """`state_dict()` in parts of about `max_bytes` of state each (`optimizer_state.state_parts`)."""
        return optimizer_state.state_parts(self, max_bytes)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores a state dict, a part of one, or a torch AdamW state dict (`optimizer_state.load_state`)."""
        optimizer_state.load_state(self, state_dict)
