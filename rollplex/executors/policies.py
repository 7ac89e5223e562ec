"""GPU sharing policies (`sharing.policy`): where `rollplex` runs prefix work beside decode (`PrefixStreams`:
inline, a stream, a green partition, or partitions picked by the live batch) and, under `mps`, where rollout
runs (a child process over the actor's shared weights) and the MPS daemon both processes are clients of.
Not here: the engines themselves (`engines.py`), the chunk scheduler (`rollplex.rollout.beside`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from rollplex.errors import SpecError
from rollplex.graph.decisions import Sharing, SharingPolicy
from rollplex.graph.plan import Plan
from rollplex.models.generate import Rollout
from rollplex.models.model import Qwen2_5_VL
from rollplex.rollout.beside import AdaptivePartition, Beside

ADAPTIVE_SMS_FRACTIONS = (0.25, 0.5, 0.75)  # the partitions `green:adaptive` picks from, of the device's SMs


@dataclass(frozen=True)
class PrefixStreams:
    """Where `rollplex` runs prefix chunks beside decode (`sharing.policy`): `stream` (None: inline, on
    decode's stream), or under `green:adaptive` a stream per partition size picked by the live decode batch.
    `contexts` holds the green contexts that own the streams (alive as long as this is)."""

    stream: torch.cuda.Stream | None = None
    choose: Callable[[int], torch.cuda.Stream] | None = None
    contexts: tuple = ()
    tail_rows: int | None = None  # `sharing.tail_rows`

    def beside(self, jobs: Sequence[Generator]) -> Beside:
        return Beside(jobs, self.stream, self.choose, self.tail_rows)

    def free_allocator_events(self) -> None:
        """Call before the last reference to the green contexts goes (it leaves them alive). A tensor that recorded
        one of their streams leaves an event in the caching allocator when freed; an event that outlives its
        context makes the allocator's next query fail ("context is destroyed"). This waits for and frees every
        such event (on the current device: the one a process's engines use)."""
        if self.contexts:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            if hasattr(torch._C, "_host_emptyCache"):  # pinned host blocks keep events of the streams they were read on
                torch._C._host_emptyCache()


def make_prefix_streams(sharing: Sharing, device: torch.device) -> PrefixStreams:
    return replace(_streams(sharing, device), tail_rows=sharing.tail_rows)


def _streams(sharing: Sharing, device: torch.device) -> PrefixStreams:
    if device.type != "cuda" or sharing.policy is SharingPolicy.INLINE:
        return PrefixStreams()
    if sharing.policy in (SharingPolicy.STREAMS, SharingPolicy.MPS):  # under mps decode is another process
        return PrefixStreams(torch.cuda.Stream(device))
    from torch.cuda.green_contexts import GreenContext

    index = device.index if device.index is not None else torch.cuda.current_device()
    if not sharing.adaptive:
        context = GreenContext.create(num_sms=sharing.prefix_sms, device_id=index)
        return PrefixStreams(context.Stream(), contexts=(context,))
    total = torch.cuda.get_device_properties(index).multi_processor_count
    contexts = {round(total * f): GreenContext.create(num_sms=round(total * f), device_id=index)
                for f in ADAPTIVE_SMS_FRACTIONS}  # fmt: skip
    choose = AdaptivePartition({sms: c.Stream() for sms, c in contexts.items()}, total)
    return PrefixStreams(choose=choose, contexts=tuple(contexts.values()))


@contextmanager
def mps_session(plans: Sequence[Plan], cap_trainer: bool = True) -> Iterator[None]:
    """Under `sharing.policy: mps` on a GPU machine: a private MPS daemon for the run, and this process its
    client with the trainer's active-thread percentage, set before CUDA starts (call it before anything
    touches the GPU). A detached watcher quits the daemon once this process has exited, however it ends.
    Nothing for other policies, on the CPU, or without the MPS binaries (on a GPU the rollout then refuses to
    start: `make_remote_rollout`). cap_trainer False: no cap on this process (a process that runs only serial,
    where nothing runs beside the trainer: the cap would only slow it)."""
    from rollplex.memory.mps import CONTROL, MpsDaemon

    sharings = [p.decisions.sharing for p in plans]
    percents = {s.mps_trainer_percent for s in sharings if s.policy is SharingPolicy.MPS}
    if len(percents) > 1:
        raise SpecError("sharing.mps_trainer_percent", "one process has one MPS percentage", "bench one at a time")
    if not percents or all(p.loaded.spec.run.device == "cpu" for p in plans) or shutil.which(CONTROL) is None:
        yield
        return
    daemon, saved = MpsDaemon(), dict(os.environ)
    try:
        daemon.start()
    except RuntimeError as e:
        raise SpecError("sharing.policy", f"mps: {e}") from None
    client = daemon.client_env(percents.pop() if cap_trainer else None)
    daemon.stop_after_exit()  # quit once this process, a client, has exited: however it ends, SIGKILL included
    os.environ.update(client)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def make_remote_rollout(
    actor: Qwen2_5_VL,
    percent: int | None,
    kernels: str = "auto",
    kv_bytes: int | None = None,
    prompt_tokens: int = 0,
) -> tuple[Callable[..., Rollout], Callable[[], object | None]]:
    """The `mps` policy's rollout: a child process reading the actor's weights in place
    (`rollplex.rollout.remote`), with its own MPS active-thread percentage, decode `kernels`
    (`run.decode_kernels`), KV arena of `kv_bytes` and decode shapes of at least `prompt_tokens` (the plan's) on a
    GPU. On a GPU this process must be an MPS client already (`mps_session`, before CUDA starts)."""
    from rollplex.memory.mps import ACTIVE_THREAD_PERCENTAGE, CONTROL, PIPE_DIRECTORY
    from rollplex.rollout.remote import RemoteRollout

    env = {}
    if actor.device.type == "cuda":
        if PIPE_DIRECTORY not in os.environ:
            why = (
                "nvidia-cuda-mps-control is not on PATH" if shutil.which(CONTROL) is None else "not started by the CLI"
            )
            raise SpecError("sharing.policy", f"mps: this process is not an MPS client ({why})", "use green or streams")
        env[ACTIVE_THREAD_PERCENTAGE] = str(percent or 100)
        kernels = decode_kernels_for(kernels, actor.device)
    remote = RemoteRollout(actor, env=env, kernels=kernels, kv_bytes=kv_bytes, prompt_tokens=prompt_tokens)
    return remote, remote.stats


def decode_kernels_for(kernels: str, device: torch.device) -> str:
    """`run.decode_kernels` on this GPU: auto is rollplex_fused on Hopper or newer and cublas before it; a named
    setting that cannot run here (dependent launches need Hopper) is a SpecError."""
    from rollplex.rollout.weights import BY_NAME

    hopper = torch.cuda.get_device_capability(device)[0] >= 9
    if kernels == "auto":
        return "rollplex_fused" if hopper else "cublas"
    if BY_NAME[kernels].pdl and not hopper:
        name = torch.cuda.get_device_name(device)
        raise SpecError("run.decode_kernels", f"{kernels} needs a Hopper or newer GPU, not {name}", "use rollplex")
    return kernels
