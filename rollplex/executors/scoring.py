"""Scoring sampled responses: split (prefix once per prompt, suffix per group) or unsplit (the oracle).

The unsplit path is textbook GRPO: every response is scored over its full sequence prompt ++ response, so
each prompt is recomputed once per response. The split path slices a `Boundary` per prompt group and, for
the attached actor boundary, swaps in a leaf copy so each group's backward stops at the boundary; the
accumulated boundary gradient then flows through the prefix graph once (`backward_through_prefix`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from rollplex.models.boundary import Boundary
from rollplex.models.generate import Rollout
from rollplex.models.inputs import Prompt
from rollplex.models.model import Qwen2_5_VL
from rollplex.models.scores import SuffixOut, token_scores


def group(b: Boundary, p: int) -> Boundary:
    """The boundary of prompt p alone (views, no copy)."""
    return Boundary(
        keys=tuple(k[p : p + 1] for k in b.keys),
        values=tuple(v[p : p + 1] for v in b.values),
        first_logprobs=b.first_logprobs[p : p + 1],
        next_positions=b.next_positions[p : p + 1],
        prompt_lens=b.prompt_lens[p : p + 1],
    )


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


def score_group_split(model: Qwen2_5_VL, boundary: Boundary, p: int, rollout: Rollout) -> SuffixOut:
    """Log-probs and entropy [1, N, R] of prompt p's N responses, from its boundary.

    Responses of a long-tailed rollout differ in length by 10x and more: scoring all N padded to the longest
    would mostly compute padding. They are scored in batches of similar lengths (`length_batches`), each
    padded only to its own longest; every batch reads the same prompt boundary (its gradients add up)."""
    b, responses, lens = group(boundary, p), rollout.responses[p : p + 1], rollout.response_lens[p : p + 1]
    num_samples, width = responses.shape[1:]
    batches = length_batches([int(n) for n in lens[0].tolist()])
    if len(batches) == 1:
        return model.suffix(b, responses, lens)
    logprobs, entropies = [], []
    order = []
    for idx in batches:
        rows = torch.tensor(idx, device=responses.device)
        longest = max(1, int(lens[0, rows].max()))
        out = model.suffix(b, responses[:, rows, :longest], lens[:, rows])
        logprobs.append(F.pad(out.logprobs, (0, width - longest)))
        entropies.append(F.pad(out.entropy, (0, width - longest)))
        order.extend(idx)
    back = torch.tensor(sorted(range(num_samples), key=order.__getitem__), device=responses.device)  # inverse
    return SuffixOut(torch.cat(logprobs, dim=1)[:, back], torch.cat(entropies, dim=1)[:, back])


def length_batches(lens: Sequence[int], max_waste: float = PADDING_WASTE) -> list[list[int]]:
    """Indices of `lens` in batches of similar lengths, longest first: a batch takes the next-longest response
    while padding stays at most `max_waste` of its tokens (count x longest <= (1 + max_waste) x sum)."""
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches:
            batch = batches[-1]
            longest, total = lens[batch[0]], sum(lens[j] for j in batch) + lens[i]
            if (len(batch) + 1) * longest <= (1 + max_waste) * total:
                batch.append(i)
                continue
        batches.append([i])
    return batches


def score_group_unsplit(model: Qwen2_5_VL, prompt: Prompt, responses: Tensor, lens: Tensor) -> SuffixOut:
    """The oracle: each of the N responses [N, R] scored over prompt ++ response, the prompt recomputed."""
    num, width = responses.shape
    ids = [torch.cat([prompt.input_ids, responses[n, : int(lens[n])].to(prompt.input_ids.device)]) for n in range(num)]
    seqs = [Prompt(x, prompt.visuals, response_start=prompt.num_tokens) for x in ids]
    hidden = model.hidden(seqs)  # [N, L, H]
    idx = torch.arange(width, device=hidden.device)
    rows = (prompt.num_tokens - 1 + idx).clamp(max=hidden.shape[1] - 1)  # the position before each token
    tokens = responses.to(hidden.device)
    logprobs, entropies = token_scores(
        hidden[:, rows].flatten(0, 1), model.lm_head, tokens.flatten(), model.config.text.vocab_size
    )
    mask = idx < lens.to(hidden.device)[:, None]
    return SuffixOut(
        logprobs=logprobs.view(num, width).where(mask, 0.0)[None],
        entropy=entropies.view(num, width).where(mask, 0.0)[None],
    )


def score_all(model: Qwen2_5_VL, prompts: Sequence[Prompt], boundary: Boundary | None, rollout: Rollout) -> SuffixOut:
    """Every group's scores [P, N, R] (reference scoring): from the boundary, or unsplit without one."""
    outs = []
    for p, prompt in enumerate(prompts):
        if boundary is not None:
            outs.append(score_group_split(model, boundary, p, rollout))
        else:
            outs.append(score_group_unsplit(model, prompt, rollout.responses[p], rollout.response_lens[p]))
    return SuffixOut(torch.cat([o.logprobs for o in outs]), torch.cat([o.entropy for o in outs]))
