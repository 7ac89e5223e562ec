"""Scoring sampled responses: split (prefix once per prompt, suffixes in length batches) or unsplit (the oracle).

The unsplit path is textbook GRPO: every response is scored over its full sequence prompt ++ response, so
each prompt is recomputed once per response. The split path scores batches of responses of similar lengths,
across prompts (`row_batches`), each row attending to its own prompt's boundary; for the attached actor
boundary it swaps in a leaf copy so each batch's backward stops at the boundary; the accumulated boundary
gradient then flows through the prefix graph once (`backward_through_prefix`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from rollplex.models.boundary import Boundary
from rollplex.models.generate import Rollout
from rollplex.models.inputs import Prompt
from rollplex.models.model import Qwen2_5_VL
from rollplex.models.scores import SuffixOut, token_scores


@dataclass(frozen=True)
class LeafBoundary:
    """An attached boundary and a detached copy whose tensors are autograd leaves."""

    attached: Boundary
    leaf: Boundary

    @staticmethod
    def of(b: Boundary) -> LeafBoundary:
        detach = lambda t: t.detach().requires_grad_(t.requires_grad)  # noqa: E731
        leaf = replace(
            b,
            keys=tuple(detach(k) for k in b.keys),
            values=tuple(detach(v) for v in b.values),
            first_logprobs=detach(b.first_logprobs),
        )
        return LeafBoundary(b, leaf)

    def backward_through_prefix(self) -> None:
        """Sends the gradients gathered on the leaf copy into the prefix: decoder layers, merger, vision."""
        pairs = [
            (a, leaf.grad)
            for a, leaf in zip(
                (*self.attached.keys, *self.attached.values, self.attached.first_logprobs),
                (*self.leaf.keys, *self.leaf.values, self.leaf.first_logprobs),
                strict=True,
            )
            if leaf.grad is not None and a.requires_grad
        ]
        if pairs:
            torch.autograd.backward([a for a, _ in pairs], [g for _, g in pairs])


PADDING_WASTE = 0.25  # at most this much of a length batch's tokens are padding (unless it holds one response)


@dataclass(frozen=True)
class RowBatch:
    """Responses scored together: flat indices p * N + n into the step's [P, N] responses, padded to `width`."""

    index: Tensor  # [B] int64, on the responses' device
    width: int  # the batch's longest response


def row_batches(rollout: Rollout, max_rows: int, max_waste: float = PADDING_WASTE) -> list[RowBatch]:
    """The step's P x N responses in batches of similar lengths across prompts, at most `max_rows` each.

    Responses of a long-tailed rollout differ in length by 10x and more: scoring a group padded to its longest
    would mostly compute padding, and scoring each group on its own makes many small calls (host-bound on an
    H200). With `max_rows` = N a batch never holds more rows or tokens than one group, as the planner counts."""
    lens = rollout.response_lens.flatten().tolist()  # the one host sync of a scoring pass
    device = rollout.responses.device
    return [
        RowBatch(torch.tensor(b, device=device), max(1, max(lens[i] for i in b)))
        for b in length_batches(lens, max_waste, max_rows)
    ]


def score_batch(
    model: Qwen2_5_VL, boundary: Boundary, rollout: Rollout, batch: RowBatch, temperature: float = 1.0
) -> SuffixOut:
    """Log-probs and entropy [B, width] of one batch of responses, each attending to its prompt's boundary."""
    num_samples = rollout.responses.shape[1]
    responses = rollout.responses.flatten(0, 1).index_select(0, batch.index)[:, : batch.width]
    lens = rollout.response_lens.flatten().index_select(0, batch.index)
    return model.suffix_rows(boundary, batch.index // num_samples, responses, lens, temperature)


def length_batches(
    lens: Sequence[int], max_waste: float = PADDING_WASTE, max_rows: int | None = None
) -> list[list[int]]:
    """Indices of `lens` in batches of similar lengths, longest first: a batch takes the next-longest response
    while padding stays at most `max_waste` of its tokens (count x longest <= (1 + max_waste) x sum) and it
    holds fewer than `max_rows`."""
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and (max_rows is None or len(batches[-1]) < max_rows):
            batch = batches[-1]
            longest, total = lens[batch[0]], sum(lens[j] for j in batch) + lens[i]
            if (len(batch) + 1) * longest <= (1 + max_waste) * total:
                batch.append(i)
                continue
        batches.append([i])
    return batches


def score_group_unsplit(
    model: Qwen2_5_VL, prompt: Prompt, responses: Tensor, lens: Tensor, temperature: float = 1.0
) -> SuffixOut:
    """The oracle: each of the N responses [N, R] scored over prompt ++ response, the prompt recomputed."""
    num, width = responses.shape
    hidden = model.whole_response_hidden(prompt, responses, lens)  # [N, R, H]
    tokens = responses.to(hidden.device)
    logprobs, entropies = token_scores(
        hidden.flatten(0, 1), model.lm_head, tokens.flatten(), model.config.text.vocab_size, temperature
    )
    mask = torch.arange(width, device=hidden.device) < lens.to(hidden.device)[:, None]
    return SuffixOut(
        logprobs=logprobs.view(num, width).where(mask, 0.0)[None],
        entropy=entropies.view(num, width).where(mask, 0.0)[None],
    )


def score_all(
    model: Qwen2_5_VL,
    prompts: Sequence[Prompt],
    boundary: Boundary | None,
    rollout: Rollout,
    temperature: float = 1.0,
) -> SuffixOut:
    """Every response's scores [P, N, R] (reference scoring): from the boundary in length batches across
    prompts, or unsplit, group by group, without one."""
    if boundary is None:
        outs = [score_group_unsplit(model, prompt, rollout.responses[p], rollout.response_lens[p], temperature)
                for p, prompt in enumerate(prompts)]  # fmt: skip
        return SuffixOut(torch.cat([o.logprobs for o in outs]), torch.cat([o.entropy for o in outs]))
    num_prompts, num_samples, width = rollout.responses.shape
    logprobs = torch.zeros(num_prompts * num_samples, width, device=rollout.responses.device)
    entropy = torch.zeros_like(logprobs)
    for batch in row_batches(rollout, max_rows=num_samples):
        out = score_batch(model, boundary, rollout, batch, temperature)
        logprobs[:, : batch.width].index_copy_(0, batch.index, out.logprobs.to(logprobs.device))
        entropy[:, : batch.width].index_copy_(0, batch.index, out.entropy.to(entropy.device))
    return SuffixOut(logprobs.view(num_prompts, num_samples, width), entropy.view(num_prompts, num_samples, width))
