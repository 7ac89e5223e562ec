"""`RemoteRollout`: rollout in a child process whose model reads the parent actor's weights in place.

What it is: the rollout engine of the `mps` policy. At construction the parent moves every parameter and
buffer of its actor into one shared byte storage (`param.data = view`: the trainer, autograd and optimizer
keep the same `nn.Parameter`s, now over shared pages) and spawns a child (multiprocessing "spawn") that
builds the model on the meta device and points each of its tensors at the same bytes, so the child reads
the very pages the parent's optimizer writes; no weight is ever copied. Each group of tensors that shared a
storage (the packed [q; k; v] and [gate; up] of `packing.py`) keeps its layout, so both sides still read
those packs as one matrix. The storage is, on a GPU, one region of a `VmmArena` whose pages the child maps
through `rollplex.memory.ipc`; on the CPU, a shared-memory tensor sent through the pipe (same layout code).
The child samples with `RolloutEngine` on a GPU (KV in its own VMM arena, as `make_rollout` does) and
with `generate` on the CPU. What it is not: a scheduler (prefix work runs in the caller's process, between
`start` and `result` or through `beside`), or a copy of the weights (a write in either process is seen by
the other).

Rules of the road:
- Reproducibility: each rollout draws ONE seed from the caller's generator (`draw_seed`, the draw
  `RolloutEngine.decode` makes) and the child samples with `torch.Generator(device).manual_seed(seed)`: the
  remote rollout equals `generate(actor, ..., generator=torch.Generator().manual_seed(seed))` on the CPU.
- Visibility: `start` synchronises the parent's device first, so the child sees the last update; the parent
  must not write the weights between `start` and `result` (reading them, as prefix work does, is fine).
- Memory: on a GPU the actor's parameters keep the arena alive (the byte storage owns it), so the actor stays
  valid after `close()`; do not move the actor (`.to()`) afterwards, which would unshare it.
- Environment: `env` is applied to the child's `os.environ` before it touches CUDA (the MPS daemon's
  `client_env`, with its active-thread percentage).

Lifecycle:

    STARTING (child spawned, weights attached) -> IDLE --start()--> IN FLIGHT --result()--> IDLE ...
    any state --close() / exit / garbage collection--> CLOSED (child stopped; the actor keeps its weights)
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rollplex.errors import RunFailed
from rollplex.models.config import ModelConfig
from rollplex.models.generate import Rollout, generate
from rollplex.models.inputs import Prompt
from rollplex.models.model import Qwen2_5_VL
from rollplex.models.sampling import SamplingParams
from rollplex.rollout.shared_weights import TensorSlot, move_into, named_tensors, plan_slots, shared_model

if TYPE_CHECKING:
    from rollplex.rollout.beside import Beside

POLL_S = 0.05  # how often a wait checks that the child is still alive
BESIDE_POLL_S = 0.001  # longest pause between two calls of `beside` while the child decodes


def draw_seed(generator: torch.Generator) -> int:
    """The one seed a rollout takes from the caller's generator (the child seeds its own generator with it)."""
    return int(torch.randint(2**62, (1,), generator=generator, device=generator.device))


@dataclass(frozen=True)
class _Setup:
    config: ModelConfig
    dtype: torch.dtype
    device: str
    num_bytes: int
    slots: tuple[tuple[str, TensorSlot], ...]
    storage: Tensor | None = None  # CPU: the shared-memory bytes themselves (torch's reductions share them)
    handles: str | None = None  # GPU: the socket of the `HandleServer` that sends the arena region
    num_threads: int = 1  # the parent's intra-op threads: CPU sums reduce in the same order on both sides
    cudnn_attention: bool = True  # the parent's `run.cudnn_attention` and `run.deterministic`, as its engines set them
    deterministic: bool = False
    decode_kernels: str = "cublas"  # `run.decode_kernels` (GPU)
    kv_bytes: int | None = None  # the plan's rollout KV, the child's arena (GPU); None: the device's memory
    prompt_tokens: int = 0  # the plan's prompt length the child's decode shapes hold at least (GPU)


@dataclass(frozen=True)
class _Request:
    prompts: tuple[Prompt, ...]
    num_samples: int
    params: SamplingParams
    seed: int
    max_lens: Tensor | None


@dataclass(frozen=True)
class _Reply:
    rollout: Rollout | None = None  # tensors on the CPU
    stats: object | None = None  # the child's `RolloutStats` (GPU), else None
    error: str | None = None  # "Type: message" of the child's exception, on one line


@dataclass(frozen=True)
class _Stop:
    pass


class RemoteRollout:
    """Rollout in a spawned child over the actor's shared weights; see the module docstring."""

    def __init__(
        self,
        actor: Qwen2_5_VL,
        env: dict[str, str] | None = None,
        kernels: str = "cublas",
        kv_bytes: int | None = None,
        prompt_tokens: int = 0,
        startup_timeout_s: float = 600.0,
        close_timeout_s: float = 30.0,
    ) -> None:
        self.device = actor.device
        self._in_flight, self._stats = False, None
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(child_conn, dict(env or {})), name="rollplex-rollout", daemon=True
        )
        self._process.start()
        child_conn.close()
        self._finalizer = weakref.finalize(self, _stop_child, self._process, self._conn, close_timeout_s)
        tensors = named_tensors(actor)
        num_bytes, slots = plan_slots(tensors)
        self.storage = self._allocate(num_bytes)
        move_into(tensors, self.storage, slots)
        setup = _Setup(
            actor.config, actor.lm_head.weight.dtype, str(self.device), num_bytes, tuple(slots.items()),
            num_threads=torch.get_num_threads(), cudnn_attention=torch.backends.cuda.cudnn_sdp_enabled(),
            deterministic=torch.are_deterministic_algorithms_enabled(), decode_kernels=kernels, kv_bytes=kv_bytes,
            prompt_tokens=prompt_tokens,
        )  # fmt: skip
        if self.device.type == "cuda":
            self._hand_over(setup, startup_timeout_s)
        else:
            self._send(replace(setup, storage=self.storage))
        self._receive(startup_timeout_s)

    def __enter__(self) -> RemoteRollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __call__(
        self,
        prompts: Sequence[Prompt],
        *,
        num_samples: int,
        params: SamplingParams,
        generator: torch.Generator,
        max_lens: Tensor | None = None,
        beside: Beside | None = None,
    ) -> Rollout:
        """`start` then `result`; `beside` (a `rollplex.rollout.beside.Beside`) is called over and over in this
        process while the child decodes, until its jobs are done or the rollout is back."""
        self.start(prompts, num_samples=num_samples, params=params, generator=generator, max_lens=max_lens)
        if beside is not None:
            while not beside.done and not self._conn.poll(BESIDE_POLL_S):
                beside()
        return self.result()

    def start(
        self,
        prompts: Sequence[Prompt],
        *,
        num_samples: int,
        params: SamplingParams,
        generator: torch.Generator,
        max_lens: Tensor | None = None,
    ) -> None:
        """Sends a rollout request and returns at once. Draws one seed from `generator`; on a GPU, first waits
        for this process's device work, so the child sees the last write to the weights."""
        if self._in_flight:
            raise RuntimeError("a rollout is already in flight: call result() before starting another")
        if not self._finalizer.alive:
            raise RuntimeError("this RemoteRollout is closed")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        cpu_lens = None if max_lens is None else max_lens.cpu()
        self._send(_Request(tuple(prompts), num_samples, params, draw_seed(generator), cpu_lens))
        self._in_flight = True

    def result(self) -> Rollout:
        """Waits for the rollout `start` asked for; its tensors on the actor's device."""
        if not self._in_flight:
            raise RuntimeError("no rollout in flight: call start() first")
        self._in_flight = False
        reply = self._receive(None)
        self._stats = reply.stats
        return _moved(reply.rollout, self.device)

    def stats(self) -> object | None:
        """The last rollout's `RolloutStats` on a GPU, None on the CPU."""
        return self._stats

    def close(self) -> None:
        """Stops the child (idempotent). The actor keeps its weights in the shared storage."""
        self._finalizer()

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _allocate(self, num_bytes: int) -> Tensor:
        """The shared bytes: a region of a fresh `VmmArena` on a GPU, shared memory on the CPU."""
        if self.device.type != "cuda":
            return torch.empty(num_bytes, dtype=torch.uint8).share_memory_()
        from rollplex.memory.vmm import VmmArena

        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self._arena = VmmArena(num_bytes, index)
        self._region = self._arena.allocate(num_bytes, "actor weights")
        return _owning_bytes(self._arena, self._region)

    def _hand_over(self, setup: _Setup, timeout_s: float) -> None:
        """GPU: sends the setup and the region's pages (blocks until the child has mapped them)."""
        from rollplex.memory.ipc import HandleServer, share_regions

        torch.cuda.synchronize(self.device)  # the weights are in place before the child reads them
        torch.cuda.empty_cache()  # the old copies' blocks go back to the driver, for the child's KV
        with HandleServer(timeout_s) as server:
            self._send(replace(setup, handles=server.path))
            share_regions(server, self._arena, [self._region])

    def _send(self, message: object) -> None:
        try:
            self._conn.send(message)
        except OSError as error:
            raise RunFailed(f"the rollout process is gone (exit code {self._process.exitcode})") from error

    def _receive(self, timeout_s: float | None) -> _Reply:
        """The child's next reply; a one-line RuntimeError if it reports an error or times out, `RunFailed` (the
        CLI's one line, exit 1) if it died."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._conn.poll(POLL_S):
            if not self._process.is_alive() and not self._conn.poll(0):
                raise RunFailed(f"the rollout process died (exit code {self._process.exitcode})")
            if deadline is not None and time.monotonic() > deadline:
                raise RuntimeError(f"the rollout process did not answer within {timeout_s:g} s")
        try:
            reply = self._conn.recv()
        except (EOFError, OSError) as error:
            raise RunFailed(f"the rollout process died (exit code {self._process.exitcode})") from error
        if reply.error is not None:
            raise RuntimeError(f"rollout process: {reply.error}")
        return reply


def _owning_bytes(arena, region) -> Tensor:
    """A uint8 tensor over an arena region that keeps the arena alive (CuPy memory owned by it + DLPack), so
    tensors viewing it outlive the `RemoteRollout` safely."""
    import cupy

    memory = cupy.cuda.UnownedMemory(region.address, region.num_bytes, arena, arena.device)
    array = cupy.ndarray((region.num_bytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
    return torch.from_dlpack(array)


def _moved(rollout: Rollout, device: torch.device) -> Rollout:
    """The rollout with its tensors on `device`."""
    values = {f.name: getattr(rollout, f.name) for f in fields(rollout)}
    return Rollout(**{k: v.to(device) if isinstance(v, Tensor) else v for k, v in values.items()})


def _stop_child(process: multiprocessing.Process, conn, timeout_s: float) -> None:
    """Asks the child to stop, then terminates it if it does not; closes the pipe. Never raises."""
    if process.is_alive():
        with contextlib.suppress(OSError):  # the child died in between
            conn.send(_Stop())
        process.join(timeout_s)
        if process.is_alive():
            process.terminate()
            process.join(timeout_s)
    conn.close()


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {' '.join(str(error).split())}"


def _serve(conn, env: dict[str, str]) -> None:
    """The child's entry: environment first (before anything touches CUDA), then the model, then requests."""
    os.environ.update(env)
    try:
        setup = conn.recv()
        torch.set_num_threads(setup.num_threads)  # not the inherited OMP_NUM_THREADS: the parent's own count
        _apply_flags(setup)
        model, _arena = _attach(setup)  # the arena (GPU) must outlive the model
        rollout, stats = _engine(model, setup.decode_kernels, setup.kv_bytes, setup.prompt_tokens)
    except Exception as error:
        conn.send(_Reply(error=_one_line(error)))
        return
    conn.send(_Reply())
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the parent is gone
            return
        if isinstance(message, _Stop):
            return
        conn.send(_answer(message, rollout, stats, model.device))


def _apply_flags(setup: _Setup) -> None:
    """The parent's process-wide kernel choices, in the child: its prefill attends as the parent's would."""
    torch.backends.cuda.enable_cudnn_sdp(setup.cudnn_attention)
    if setup.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(setup.deterministic)


def _answer(request: _Request, rollout: Callable[..., Rollout], stats: Callable[[], object | None], device) -> _Reply:
    """One rollout, its tensors on the CPU; or the error it raised, on one line. On a GPU the child's cached
    blocks then go back to the driver: the trainer's phases plan for that memory (the in-process engine shares
    the trainer's allocator, which empties its cache between phases)."""
    try:
        generator = torch.Generator(device).manual_seed(request.seed)
        out = rollout(
            list(request.prompts), num_samples=request.num_samples, params=request.params, generator=generator,
            max_lens=request.max_lens,
        )  # fmt: skip
        reply = _Reply(rollout=_moved(out, torch.device("cpu")), stats=stats())
    except Exception as error:
        reply = _Reply(error=_one_line(error))
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return reply


def _attach(setup: _Setup) -> tuple[Qwen2_5_VL, object]:
    """The child's model over the shared bytes, and what must outlive it (its arena on a GPU, else None)."""
    if torch.device(setup.device).type != "cuda":
        return shared_model(setup.config, setup.dtype, setup.storage, setup.slots), None
    from rollplex.memory.ipc import attach_regions
    from rollplex.memory.vmm import VmmArena

    torch.cuda.set_device(torch.device(setup.device))
    arena = VmmArena(setup.num_bytes, torch.cuda.current_device())
    (region,) = attach_regions(arena, setup.handles).values()
    storage = arena.tensor(region, torch.uint8, (setup.num_bytes,))
    return shared_model(setup.config, setup.dtype, storage, setup.slots), arena


def _engine(
    model: Qwen2_5_VL, kernels: str, kv_bytes: int | None, prompt_tokens: int = 0
) -> tuple[Callable[..., Rollout], Callable[[], object | None]]:
    """The child's rollout and its stats, as `rollplex.executors.engines.make_rollout` builds them."""
    if model.device.type == "cuda":
        from rollplex.executors.policies import decode_kernels_for
        from rollplex.memory.vmm import VmmArena
        from rollplex.rollout.engine import RolloutEngine
        from rollplex.rollout.weights import BY_NAME

        # the KV maps per rollout; steps timed for the decode slowdown the trainer's chunks cause
        device = torch.cuda.current_device()
        arena = VmmArena(kv_bytes or torch.cuda.get_device_properties(device).total_memory, device)
        resolved = decode_kernels_for(kernels, model.device)  # `auto` too
        engine = RolloutEngine(
            model, kv_arena=arena, time_steps=True, kernels=BY_NAME[resolved], prompt_tokens=prompt_tokens
        )
        return engine.generate, lambda: engine.stats
    return partial(generate, model), lambda: None
