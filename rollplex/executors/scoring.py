"""Scoring sampled responses: split (prefix once per prompt, suffixes in length batches) or unsplit (the oracle).

The unsplit path is textbook GRPO: every response is scored over its full sequence prompt ++ response, so
each prompt is recomputed once per response. The split path scores batches of responses packed end to end,
across prompts (`row_batches`), each attending to its own prompt's boundary; for the attached actor
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
from rollplex.models.inputs import Prompt, to_device
from rollplex.models.model import Qwen2_5_VL
from rollplex.models.scores import SuffixOut, token_scores


@dataclass(frozen=True)
class LeafBoundary:
    """An attached boundary and a detached copy whose tensors are autograd leaves. `other_stream`: some of the
    prefix ran on another stream (a green partition beside decode), so part of its backward runs there too."""

    attached: Boundary
    leaf: Boundary
    other_stream: bool = False

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
        """Sends the gradients gathered on the leaf copy into the prefix: decoder layers, merger, vision.

        When part of it backpropagates on another stream, the caching allocator first hands back what it holds
        free: it keeps a pool per stream, so that stream would otherwise map new memory while this one's cache
        (the suffix backward's freed activations) sits idle, and the phase would hold both."""
        pairs = [
            (a, leaf.grad)
            for a, leaf in zip(
                (*self.attached.keys, *self.attached.values, self.attached.first_logprobs),
                (*self.leaf.keys, *self.leaf.values, self.leaf.first_logprobs),
                strict=True,
            )
            if leaf.grad is not None and a.requires_grad
        ]
        if not pairs:
            return
        if self.other_stream and pairs[0][0].is_cuda:
            torch.cuda.empty_cache()
        torch.autograd.backward([a for a, _ in pairs], [g for _, g in pairs])


@dataclass(frozen=True)
class RowBatch:
    """Responses scored together: flat indices p * N + n into the step's [P, N] responses (`index` on the
    responses' device), with each one's prompt and length on the host; `width` is the longest's length."""

    index: Tensor  # [B] int64
    rows: tuple[int, ...]
    lens: tuple[int, ...]
    width: int


def row_batches(rollout: Rollout, max_tokens: int) -> list[RowBatch]:
    """The step's P x N responses in batches of at most `max_tokens` tokens each (`token_batches`), across
    prompts. A batch runs packed (`Qwen2_5_VL.suffix_rows`): its cost is its tokens, not rows x longest, so
    the batches share the tokens whatever their lengths. Callers pass what the planner counts a microbatch: a
    group of the step's longest responses' tokens (N x R) or `memory.microbatch_tokens` (`microbatch_budget`)."""
    lens = rollout.response_lens.flatten().tolist()  # the one host sync of a scoring pass
    num_samples, device = rollout.responses.shape[1], rollout.responses.device
    return [
        RowBatch(
            index=to_device(torch.tensor(b, dtype=torch.long), device),
            rows=tuple(i // num_samples for i in b),
            lens=tuple(lens[i] for i in b),
            width=max(1, max(lens[i] for i in b)),
        )
        for b in token_batches(lens, max_tokens)
    ]


def microbatch_budget(cap: int | None, num_samples: int, width: int) -> int:
    """A split microbatch's tokens: a group of the step's longest responses (N x R, as the planner counts one), or
    `cap` (`memory.microbatch_tokens`, fewer or more)."""
    return num_samples * width if cap is None else cap


def score_batch(
    model: Qwen2_5_VL, boundary: Boundary, rollout: Rollout, batch: RowBatch, temperature: float = 1.0
) -> SuffixOut:
    """Log-probs and entropy [B, width] of one batch of responses, each attending to its prompt's boundary."""
    responses = rollout.responses.flatten(0, 1).index_select(0, batch.index)[:, : batch.width]
    return model.suffix_rows(boundary, batch.rows, responses, batch.lens, temperature)


def token_batches(lens: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of `lens` in batches of at most `max_tokens` summed lengths (a longer one alone): as many batches as
    first fit over the lengths longest first needs, their tokens balanced (`_dealt`; the first fit's batches where
    dealing finds no room). A batch's host work (launching every layer's kernels, forward and backward) hardly
    depends on its tokens, so a nearly empty last batch leaves the device waiting on the host where an even share
    keeps it busy. Within a batch, in index order: a prompt's responses together, so that a block of packed queries
    reads few prompts' KV."""
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    fitted = _first_fit(lens, order, max_tokens)
    dealt = _dealt(lens, order, max_tokens, len(fitted))
    return [sorted(b) for b in (dealt if dealt is not None else fitted)]


def _first_fit(lens: Sequence[int], order: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Each index in `order` to the first batch with room for it, or to a new batch: few batches, each full."""
    batches: list[list[int]] = []
    room: list[int] = []
    for i in order:
        fits = next((b for b, free in enumerate(room) if lens[i] <= free), None)
        if fits is None:
            batches.append([i])
            room.append(max_tokens - lens[i])
        else:
            batches[fits].append(i)
            room[fits] -= lens[i]
    return batches


def _dealt(lens: Sequence[int], order: Sequence[int], max_tokens: int, count: int) -> list[list[int]] | None:
    """Each index in `order` (longest first) to the batch of `count` with the fewest tokens that has room for it (an
    empty batch takes a longer one alone; ties to the first); None where one finds no room."""
    batches: list[list[int]] = [[] for _ in range(count)]
    tokens = [0] * count
    for i in order:
        room = [b for b in range(count) if not batches[b] or tokens[b] + lens[i] <= max_tokens]
        if not room:
            return None
        b = min(room, key=lambda b: tokens[b])
        batches[b].append(i)
        tokens[b] += lens[i]
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
    cap: int | None = None,
) -> SuffixOut:
    """Every response's scores [P, N, R], without gradients (the reference's, the old policy's): from the boundary
    in length batches across prompts of a group of the longest responses' tokens, or fewer where `cap`
    (`memory.microbatch_tokens`) is lower (the plan counts no scoring memory beyond the runtime reserve for a role
    that does not backpropagate), or unsplit, group by group, without one."""
    if boundary is None:
        outs = [score_group_unsplit(model, prompt, rollout.responses[p], rollout.response_lens[p], temperature)
                for p, prompt in enumerate(prompts)]  # fmt: skip
        return SuffixOut(torch.cat([o.logprobs for o in outs]), torch.cat([o.entropy for o in outs]))
    num_prompts, num_samples, width = rollout.responses.shape
    logprobs = torch.zeros(num_prompts * num_samples, width, device=rollout.responses.device)
    entropy = torch.zeros_like(logprobs)
    group = num_samples * width
    for batch in row_batches(rollout, max_tokens=min(microbatch_budget(cap, num_samples, width), group)):
        out = score_batch(model, boundary, rollout, batch, temperature)
        logprobs[:, : batch.width].index_copy_(0, batch.index, out.logprobs.to(logprobs.device))
        entropy[:, : batch.width].index_copy_(0, batch.index, out.entropy.to(entropy.device))
    return SuffixOut(logprobs.view(num_prompts, num_samples, width), entropy.view(num_prompts, num_samples, width))
