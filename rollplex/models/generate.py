"""Rollout: N sampled responses per prompt, decoded with a KV cache over a shared prompt boundary.

Each prompt is prefilled once (`Qwen2_5_VL.prefix`, detached); its N samples decode together, batched over all
prompts, each attending to the one prompt KV and to its own response cache (`SharedPrefixAttention`). Runs
on whatever device the model is on; the generator must live there too. Not here: sampling rules
(`sampling.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rollplex.models.boundary import Boundary
from rollplex.models.cache import ResponseCache
from rollplex.models.inputs import Prompt
from rollplex.models.model import Qwen2_5_VL
from rollplex.models.sampling import Rows, SamplingParams, sample, tempered


@dataclass(frozen=True)
class Rollout:
    responses: Tensor  # [P, N, R] int64, 0 after each response's end; R = the longest response
    response_lens: Tensor  # [P, N] int64, stop token included
    logprobs: Tensor  # [P, N, R] float32: each token's log-prob at the sampling temperature (no top-p), 0 after end


@torch.no_grad()
def generate(
    model: Qwen2_5_VL,
    prompts: Sequence[Prompt],
    *,
    num_samples: int,
    params: SamplingParams,
    generator: torch.Generator,
    beside: Callable[[int], None] | None = None,
    max_lens: Tensor | None = None,
    rows: Rows | None = None,
    boundary: Boundary | None = None,
) -> Rollout:
    """Samples `num_samples` responses to each prompt; the same generator state gives the same rollout.

    beside: called after each decode step with the live batch size, to run other work in between
    (`rollplex.rollout.beside`).
    max_lens [P, N]: per-sequence length budgets (a sequence ends at its budget if no stop token came first).
    rows (index, total): the P x N sequences are rows `index` of a larger batch, whose random numbers each step
    draws (`sample`; a data-parallel rank's share of the step).
    boundary: the prompts' prefill, already made (the actor prefix's: `run.rollout_prefill`); none runs here then."""
    if num_samples < 1:
        raise ValueError(f"num_samples {num_samples} must be at least 1")
    boundary = boundary if boundary is not None else model.prefix(prompts, attached=False)
    num_prompts, batch = boundary.num_prompts, boundary.num_prompts * num_samples
    dtype = boundary.keys[0].dtype
    cache = ResponseCache(model.config.text, batch, params.max_tokens, dtype=dtype, device=model.device)
    stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=model.device)
    temperature = params.logprob_temperature
    dist = tempered(boundary.first_logprobs, temperature).repeat_interleave(num_samples, dim=0)  # [P*N, V]
    tokens, logprobs = [], []
    lens = torch.zeros(batch, dtype=torch.long, device=model.device)
    done = torch.zeros(batch, dtype=torch.bool, device=model.device)
    budget = None if max_lens is None else max_lens.flatten().to(model.device)
    for step in range(params.max_tokens):
        token = sample(dist, params, generator, rows)  # [P*N]
        tokens.append(token)
        logprobs.append(dist.gather(-1, token[:, None])[:, 0])
        lens += ~done
        done |= torch.isin(token, stop_ids)
        if budget is not None:
            done |= lens >= budget
        if bool(done.all()) or step + 1 == params.max_tokens:
            break
        logits = model.response_logits(boundary, token.view(num_prompts, num_samples, 1), cache)
        dist = tempered(logits, temperature).view(batch, -1)
        if beside is not None:
            beside(int((~done).sum()))
    return collect_rollout(torch.stack(tokens, dim=-1), torch.stack(logprobs, dim=-1), lens, num_prompts)


def collect_rollout(tokens: Tensor, logprobs: Tensor, lens: Tensor, num_prompts: int) -> Rollout:
    """From tokens and log-probs [P*N, R] of every sample (R = the longest response), zeroed past each end."""
    is_real = torch.arange(tokens.shape[1], device=tokens.device) < lens[:, None]
    return Rollout(
        responses=tokens.where(is_real, 0).unflatten(0, (num_prompts, -1)),
        response_lens=lens.unflatten(0, (num_prompts, -1)),
        logprobs=logprobs.where(is_real, 0.0).unflatten(0, (num_prompts, -1)),
    )
