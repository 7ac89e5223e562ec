"""`RolloutEngine`: the rollout of `rollplex.models.generate`, fast on a GPU.

Each prompt is prefilled once (`Qwen2_5_VL.prefix`); its N samples then decode together with CUDA-graph
steps (`graphs.py`). The host never waits for the step it just launched: after launching step k it reads the
finished flags of step k - 1 (copied to pinned memory behind it), so launches run one step ahead of the GPU.
When the live sequences fit a smaller captured batch or span fewer prompts, the batch is compacted (`batch.py`);
until then, a finished sequence keeps decoding and its extra tokens are dropped. All of this depends only on the sampled
tokens, so a seed gives one rollout. Sampling runs on the device: inside the graph (temperature, greedy), or
between replays with torch when top-p < 1.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rollplex.layout.shapes import prompt_capacity
from rollplex.memory.vmm import RegionState
from rollplex.models.boundary import Boundary
from rollplex.models.generate import Rollout, collect_rollout
from rollplex.models.inputs import Prompt
from rollplex.models.model import Qwen2_5_VL
from rollplex.models.sampling import SamplingParams, sample, tempered
from rollplex.rollout.batch import bucket_for, bucket_sizes, layout
from rollplex.rollout.graphs import StepGraphs
from rollplex.rollout.slowdown import DeviceClock, StepSpan
from rollplex.rollout.step import DecodeShape, DecodeStep, can_fuse_sampling, check_rows, kv_bytes
from rollplex.rollout.weights import CUBLAS, DecodeKernels

POSITION_QUANTUM = 1024


@dataclass(frozen=True)
class RolloutStats:
    prefill_s: float
    decode_s: float
    num_steps: int  # decode steps launched
    row_steps: int  # sum over steps of the batch rows computed (padding and finished rows included)
    batch_sizes: tuple[int, ...]  # the batch size of each step
    step_spans: tuple[StepSpan, ...] = ()  # (start s, end s, rows) of each step, when timed (see RolloutEngine)


@dataclass(frozen=True)
class _Started:
    """A rollout whose decode buffers hold its prompts and first tokens (`RolloutEngine._start`)."""

    graphs: StepGraphs
    run: _Run
    began: float  # perf_counter when decode began (after any prefill)


class RolloutEngine:
    """Rollout for one model; keeps its decode buffers and graphs while later rollouts fit their shape.

    With a `kv_arena` (`rollplex.memory.vmm.VmmArena`), the KV caches live in one region of it whose pages are
    released when a rollout ends and mapped again when the next begins, at the same addresses, so the captured
    graphs stay valid while the training phases use the memory (the plan's phase-local rollout KV):

        (first rollout) allocate -> MAPPED -- rollout ends --> RELEASED -- next rollout --> MAPPED ...

    Decode steps are timed with CUDA events (`RolloutStats.step_spans`, on the host's perf_counter clock) when
    work runs beside them, or always with `time_steps` (rollout in its own process, `remote.py`: the trainer's
    prefix chunks are on the same clock, so the decode slowdown is measured across the two processes).
    """

    def __init__(
        self,
        model: Qwen2_5_VL,
        kv_arena=None,
        *,
        time_steps: bool = False,
        kernels: DecodeKernels = CUBLAS,
        prompt_tokens: int = 0,
    ) -> None:
        """kernels: the decode step's (`weights.DecodeKernels`; default cuBLAS, launched plainly; the spec's
        `run.decode_kernels` picks the others). prompt_tokens: the prompt length every decode shape holds at least
        where the KV arena (if any) holds such a shape (the plan's budget, `Decisions.rollout_prompt_tokens`):
        rollouts of shorter prompts then share one shape, its graphs captured once; 0: each rollout's own
        capacity, a new shape (graphs captured again) whenever a rollout's prompts outgrow it."""
        hopper = model.device.type == "cuda" and torch.cuda.get_device_capability(model.device)[0] >= 9
        if kernels.pdl and not hopper:
            raise ValueError(f"pdl: programmatic dependent launch needs a Hopper or newer GPU, not {model.device}")
        self.model = model
        self.time_steps = time_steps
        self.kernels = kernels
        self.prompt_tokens = prompt_tokens
        self.graphs: StepGraphs | None = None
        self.stats: RolloutStats | None = None
        self.kv_arena, self.kv_region, self._regions = kv_arena, None, 0

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Prompt],
        *,
        num_samples: int,
        params: SamplingParams,
        generator: torch.Generator,
        max_lens: Tensor | None = None,
        beside: Callable[[int], None] | None = None,
        rows: tuple[Sequence[int], int] | None = None,
        boundary: Boundary | None = None,
    ) -> Rollout:
        """Samples num_samples responses to each prompt (see `rollplex.models.generate.generate`).

        max_lens [P, N]: per-sequence length budgets (benchmarks replay a workload's length distribution with
        them). beside: called after each decode step is launched, to enqueue other work (`beside.py`). rows
        (index, total): the sequences are rows `index` of a step of `total` (a data-parallel rank's share); each
        samples the tokens that row would in a rollout of the whole step (in-graph sampling only). boundary:
        the prompts' prefill, already made (the actor prefix's: `run.rollout_prefill`); none runs here then.
        """
        start = time.perf_counter()
        started = self._start(  # a prefill made here is held only until the decode buffers have its KV
            self._prefill(prompts) if boundary is None else boundary, num_samples, params, generator, max_lens, rows
        )
        rollout, stats = self._steps(started, params, beside)
        self.stats = RolloutStats(started.began - start, *stats)
        return rollout

    def _prefill(self, prompts: Sequence[Prompt]) -> Boundary:
        boundary = self.model.prefix(prompts, attached=False)
        _sync(self.model.device)
        return boundary

    @torch.no_grad()
    def decode(
        self,
        boundary: Boundary,
        *,
        num_samples: int,
        params: SamplingParams,
        generator: torch.Generator,
        max_lens: Tensor | None = None,
        beside: Callable[[int], None] | None = None,
        rows: tuple[Sequence[int], int] | None = None,
    ) -> tuple[Rollout, tuple]:
        """The rollout from prefilled prompts, and (decode_s, num_steps, row_steps, batch_sizes, step_spans)."""
        return self._steps(self._start(boundary, num_samples, params, generator, max_lens, rows), params, beside)

    def _start(
        self,
        boundary: Boundary,
        num_samples: int,
        params: SamplingParams,
        generator: torch.Generator,
        max_lens: Tensor | None,
        rows: tuple[Sequence[int], int] | None,
    ) -> _Started:
        """The decode buffers loaded with the prompts' KV and the first tokens drawn: `boundary` is not needed
        after this."""
        if num_samples < 1:
            raise ValueError(f"num_samples {num_samples} must be at least 1")
        if rows is not None and not can_fuse_sampling(params):
            raise ValueError("top-p sampling draws per batch row: a share of a step's rows needs top_p 1")
        if rows is not None:
            check_rows(rows, boundary.num_prompts * num_samples)
        began = time.perf_counter()
        graphs = self._graphs_for(boundary, num_samples, params)
        if self.kv_region is not None and self.kv_arena.state(self.kv_region) is RegionState.RELEASED:
            torch.cuda.empty_cache()  # the training phases' cached blocks go back first: the KV takes their pages
            self.kv_arena.map(self.kv_region)  # fresh pages at the same addresses: contents are rewritten below
        step = graphs.step
        seed = int(torch.randint(2**62, (1,), generator=generator, device=generator.device))
        step.load(boundary, params, seed, max_lens, rows)
        run = _Run(step, boundary.num_prompts, num_samples, params, generator)
        run.first_token(boundary.first_logprobs.repeat_interleave(num_samples, dim=0))
        return _Started(graphs, run, began)

    def _steps(self, started: _Started, params: SamplingParams, beside: Callable[[int], None] | None) -> tuple:
        """The decode steps of a started rollout, and (decode_s, num_steps, row_steps, batch_sizes, step_spans)."""
        graphs, run = started.graphs, started.run
        live = torch.arange(run.num_sequences)
        (rows, prompts), sizes = run.place(live, graphs.sizes), []
        timed = beside is not None or self.time_steps
        clock, marks = (DeviceClock(cuda=self.model.device.type == "cuda"), []) if timed else (None, [])
        for k in range(params.max_tokens - 1):
            start_mark = clock.mark() if clock else None
            logits = graphs.run(rows, prompts)
            if clock:
                marks.append((start_mark, clock.mark(), rows))
            run.next_token(rows, k + 1, logits)
            sizes.append(rows)
            if beside is not None:
                beside(rows)
            live = run.live_after_previous_step()
            if live.numel() == 0:
                break
            if bucket_for(live.numel(), graphs.sizes) < rows or run.prompts_of(live) < prompts:
                rows, prompts = run.place(live, graphs.sizes)
        rollout = run.collect()
        _sync(self.model.device)
        if self.kv_region is not None:
            self.kv_arena.release(self.kv_region)  # the training phases get the KV's pages
        spans = tuple((clock.seconds(s), clock.seconds(e), r) for s, e, r in marks)
        return rollout, (time.perf_counter() - started.began, len(sizes), sum(sizes), tuple(sizes), spans)

    def _graphs_for(self, boundary: Boundary, num_samples: int, params: SamplingParams) -> StepGraphs:
        if self.graphs is not None and self.graphs.step.shape.fits(boundary, num_samples, params):
            return self.graphs
        self.graphs = None
        if self.model.device.type == "cuda":
            torch.cuda.empty_cache()
        shape = self._shape(boundary, num_samples, params, self.prompt_tokens)
        if self.kv_arena is not None and kv_bytes(self.model, shape) > self.kv_arena.num_bytes:
            shape = self._shape(boundary, num_samples, params, 0)  # the floor does not fit: this rollout's own
        self.graphs = StepGraphs(
            DecodeStep(self.model, shape, self._kv_storage(shape), self.kernels), bucket_sizes(shape.num_slots - 1)
        )
        return self.graphs

    @staticmethod
    def _shape(boundary: Boundary, num_samples: int, params: SamplingParams, prompt_tokens: int) -> DecodeShape:
        """The decode shape of a rollout, holding prompts of at least `prompt_tokens` and a rotary table past the
        larger of its next positions and that floor (positions usually stay below a prompt's length; a rollout
        whose positions pass the table gets a new shape, `DecodeShape.fits`)."""
        longest = max(boundary.max_prompt_len, prompt_tokens)
        position = max(int(boundary.next_positions.max()), prompt_tokens)
        return DecodeShape(
            num_prompts=boundary.num_prompts,
            num_samples=num_samples,
            max_prompt_len=prompt_capacity(longest),
            max_tokens=params.max_tokens,
            max_position=_round_up(position + params.max_tokens + 1, POSITION_QUANTUM),
            fused_sampling=can_fuse_sampling(params),
        )

    def _kv_storage(self, shape: DecodeShape) -> Tensor | None:
        """A fresh arena region for this shape's caches (the previous shape's region is freed), or None. The arena's
        size is the plan's rollout KV: a shape that needs more is refused."""
        if self.kv_arena is None:
            return None
        num_bytes = kv_bytes(self.model, shape)
        if num_bytes > self.kv_arena.num_bytes:
            raise ValueError(
                f"this rollout's KV caches need {num_bytes / 2**30:.2f} GiB, more than the plan's "
                f"{self.kv_arena.num_bytes / 2**30:.2f} GiB: raise memory.rollout_kv_gib or leave it unset"
            )
        if self.kv_region is not None:
            self.kv_arena.free(self.kv_region)
        self._regions += 1
        self.kv_region = self.kv_arena.allocate(num_bytes, f"rollout KV {self._regions}")
        return self.kv_arena.tensor(self.kv_region, torch.uint8, (num_bytes,))


class _Run:
    """The per-rollout state of `RolloutEngine.decode` beside the step's buffers: finished flags on the host."""

    def __init__(
        self, step: DecodeStep, num_prompts: int, num_samples: int, params: SamplingParams, generator: torch.Generator
    ) -> None:
        self.step, self.params, self.generator = step, params, generator
        self.num_prompts, self.num_samples = num_prompts, num_samples
        self.num_sequences = num_prompts * num_samples
        self.stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=step.slots.device)
        self.num_columns = 0
        self.flags: deque[tuple[Tensor, torch.cuda.Event | None]] = deque()
        done = step.done  # two host copies of the done flags, used in turn: one in flight, one being read
        self.spare = deque(torch.empty(done.shape, dtype=done.dtype, pin_memory=done.is_cuda) for _ in range(2))

    def first_token(self, dist: Tensor) -> None:
        """Token 0 of every sequence, from its prompt's next-token distribution dist [P * N, V]."""
        slots = torch.arange(self.num_sequences, device=dist.device)
        if self.step.shape.fused_sampling:  # the kernel divides by the temperature itself
            self.step.sample(dist, slots, torch.zeros(1, dtype=torch.long, device=dist.device))
        else:
            self._record(slots, 0, tempered(dist, self.params.logprob_temperature))
        self._columns_done(1)

    def next_token(self, rows: int, column: int, logits: Tensor) -> None:
        """After a step's replay: token `column` was sampled in-graph, or is sampled here (top-p)."""
        if not self.step.shape.fused_sampling:
            self._record(self.step.slots[:rows], column, tempered(logits, self.params.logprob_temperature))
        self._columns_done(column + 1)

    def _record(self, slots: Tensor, column: int, dist: Tensor) -> None:
        """Samples token `column` of the sequences in `slots` from dist [rows, V] with torch (any top-p)."""
        s = self.step
        token = sample(dist, self.params, self.generator)
        s.tokens[slots, column] = token
        s.logprobs[slots, column] = dist.gather(-1, token[:, None])[:, 0]
        s.last_token[slots] = token
        ends = torch.isin(token, self.stop_ids) | (column + 1 >= s.max_lens[slots])
        s.done[slots] |= ends.to(torch.int8)

    def place(self, live: Tensor, sizes: tuple[int, ...]) -> tuple[int, int]:
        """Lays the live sequences out in the smallest captured batch that holds them; returns its size and how
        many prompts its rows span."""
        rows = bucket_for(live.numel(), sizes)
        batch = layout(live, rows, self.num_prompts, self.num_samples)
        self.step.slots[:rows].copy_(batch.slots)
        self.step.row_start.copy_(batch.row_start)
        self.step.row_count.copy_(batch.row_count)
        self.step.batch_prompts.copy_(batch.prompts)
        return rows, batch.num_prompts

    def prompts_of(self, live: Tensor) -> int:
        """How many prompts the live sequences belong to."""
        return int((live // self.num_samples).unique().numel())

    def live_after_previous_step(self) -> Tensor:
        """Slots not finished as of the step before the one just launched (the host lags one step)."""
        assert len(self.flags) == 2, "one step in flight, one step to read"
        flags, event = self.flags.popleft()
        if event is not None:
            event.synchronize()
        live = (flags[: self.num_sequences] == 0).nonzero()[:, 0]
        self.spare.append(flags)
        return live

    def collect(self) -> Rollout:
        tokens = self.step.tokens[: self.num_sequences, : self.num_columns]
        is_stop = torch.isin(tokens, self.stop_ids)
        first_stop = torch.where(is_stop.any(dim=1), is_stop.int().argmax(dim=1) + 1, self.num_columns)
        lens = torch.minimum(first_stop, self.step.max_lens[: self.num_sequences])
        longest = int(lens.max())
        logprobs = self.step.logprobs[: self.num_sequences, :longest]
        return collect_rollout(tokens[:, :longest], logprobs, lens, self.num_prompts)

    def _columns_done(self, num_columns: int) -> None:
        """Notes the columns written and queues a host copy of the done flags behind them."""
        self.num_columns = num_columns
        done, flags = self.step.done, self.spare.popleft()
        flags.copy_(done, non_blocking=done.is_cuda)
        event = None
        if done.is_cuda:
            event = torch.cuda.Event()
            event.record()
        self.flags.append((flags, event))


def _round_up(n: int, quantum: int) -> int:
    return -(-n // quantum) * quantum


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
