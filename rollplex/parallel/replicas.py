"""Rollout replicas that share the prompts: with q = train_tp / rollout_tp replicas on the GPUs, each samples
its contiguous share of a step's prompts and every rank receives the whole rollout (the trainer needs all of it).

Sampling stays reproducible, one of two ways. Where the rollout keys each sequence's random numbers by its row
in the step's batch (`rows`: the GPU engine's fused sampler; top-p 1), a replica samples its share with the shared
generator and its rows in the step, so it samples exactly the tokens one replica sampling everything would (and
a data-parallel rank's replicas those of the one-process run). Elsewhere all ranks draw one seed from the shared
generator (so its state stays equal on every rank, and a checkpoint's state resumes every rank), and replica j
samples from a generator seeded with seed + j: the samples differ from a single replica's; greedy rollouts are
identical.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rollplex.layout.shapes import shares
from rollplex.models.generate import Rollout
from rollplex.models.inputs import Prompt
from rollplex.parallel.group import TPGroup


def gather_rollouts(part: Rollout, replicas: TPGroup) -> Rollout:
    """The replicas' rollouts concatenated over prompts in replica order, responses padded to the longest."""
    mine = (part.responses.cpu(), part.response_lens.cpu(), part.logprobs.cpu())
    parts: list = [None] * replicas.size
    dist.all_gather_object(parts, mine, group=replicas.group)
    width = max(r.shape[2] for r, _, _ in parts)
    pad = lambda t: F.pad(t, (0, width - t.shape[2]))  # noqa: E731
    device = part.responses.device
    return Rollout(
        responses=torch.cat([pad(r) for r, _, _ in parts]).to(device),
        response_lens=torch.cat([n for _, n, _ in parts]).to(device),
        logprobs=torch.cat([pad(lp) for _, _, lp in parts]).to(device),
    )


def split_rollout(rollout: Callable[..., Rollout], replicas: TPGroup, *, keyed: bool = False) -> Callable[..., Rollout]:
    """`rollout` run by each replica on its share of the prompts (one rank of every replica is in `replicas`:
    the exchange group). `keyed`: `rollout` takes `rows` (index, total) and keys each row's random numbers by it;
    a data-parallel rank's `rows` then locate its share in the whole step. Falls back to every replica sampling
    everything when there are fewer prompts than replicas."""

    def run(
        prompts: Sequence[Prompt], *, num_samples: int, params, generator: torch.Generator, rows=None, **kw
    ) -> Rollout:
        if rows is not None:
            kw["rows"] = rows
        if len(prompts) < replicas.size:
            return rollout(prompts, num_samples=num_samples, params=params, generator=generator, **kw)
        share = shares(len(prompts), replicas.size)[replicas.rank]
        if kw.get("max_lens") is not None:  # length budgets [P, N] follow their prompts
            kw["max_lens"] = kw["max_lens"][share.start : share.stop]
        if keyed and params.top_p >= 1:  # the shared generator, and this share's rows (top-p draws per batch row)
            index, total = rows if rows is not None else (range(len(prompts) * num_samples), len(prompts) * num_samples)
            kw["rows"] = (list(index)[share.start * num_samples : share.stop * num_samples], total)
        else:  # a data-parallel rank's rows would not survive a reseed: the spec refuses that pairing
            assert rows is None, "split replicas reseed: they cannot sample a data-parallel rank's rows"
            seed = int(torch.randint(2**62, (1,), generator=generator, device=generator.device))
            generator = torch.Generator(generator.device).manual_seed(seed + replicas.rank)
        part = rollout(
            [prompts[i] for i in share], num_samples=num_samples, params=params, generator=generator, **kw
        )  # fmt: skip
        return gather_rollouts(part, replicas)

    return run
