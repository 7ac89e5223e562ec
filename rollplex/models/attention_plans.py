"""The prefix's attention planned before the first step.

SDPA on cuDNN (the prefix's causal attention on a GPU, `attention.causal_sdpa`) builds a plan on the host the first
time it meets a shape, its forward without the log-sum-exp (a prefix under no_grad), its forward with it (an
attached prefix, a rerun) and its backward each their own, and the device waits meanwhile. The causal calls run at
`attention_length` buckets, so a run meets a few shapes per group size, but it meets them over its first steps:
each step with a new prompt length would pay for plans in every prefix and in the backward through the prefix.
`plan_prefix_attention` runs the first decoder layer once at each shape `prefix_attention_shapes` names, as a
prefix group runs it (`run_prefix_layer`, through `prompt_rows.layer_kv`), so that the steps find the plans made.

    steps' prompt lengths --prefix_attention_shapes--> (prompts, padded length), ... --plan_prefix_attention--> plans
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from rollplex.models.attention import attention_length
from rollplex.models.model import Qwen2_5_VL
from rollplex.models.prompt_rows import PromptRows, layer_kv
from rollplex.models.rotary import text_rotary

MARGIN = 1 / 16  # lengths this far beyond the steps' range are planned too (a bucket's width, either side)


def buckets_between(low: int, high: int) -> list[int]:
    """Every `attention_length` bucket a length in [low, high] pads to, in order."""
    out, length = [], attention_length(max(low, 1))
    while length <= attention_length(high):
        out.append(length)
        length = attention_length(length + 1)
    return out


def prefix_attention_shapes(
    prompt_lens: Iterable[Sequence[int]], prompts_per_chunk: int | None
) -> tuple[tuple[int, int], ...]:
    """(prompts, padded length) of the causal calls of prefixes over these steps' prompts (one sequence of lengths a
    step), grouped as the prefixes group them (`prompts_per_chunk`; None: a step's prompts in one group): per group
    size, every bucket from the shortest group's longest prompt to the longest's, `MARGIN` more either side (the
    lengths are a plan's estimate, and later steps bring others)."""
    spans: dict[int, tuple[int, int]] = {}
    for lens in prompt_lens:
        size = prompts_per_chunk or len(lens)
        for i in range(0, len(lens), size):
            group = lens[i : i + size]
            low, high = spans.get(len(group), (max(group), max(group)))
            spans[len(group)] = (min(low, max(group)), max(high, max(group)))
    return tuple(
        (size, length)
        for size, (low, high) in sorted(spans.items())
        for length in buckets_between(int(low * (1 - MARGIN)), int(high * (1 + MARGIN)))
    )


def plan_prefix_attention(model: Qwen2_5_VL, shapes: Iterable[tuple[int, int]]) -> None:
    """`run_prefix_layer` for a group of P prompts whose longest is one token short of L (the call pads it to L, as
    every length of that bucket but L itself), the others shorter, at each (P, L)."""
    for num_prompts, length in shapes:
        longest = length - 1 if attention_length(length - 1) == length else length  # <= 16 tokens: no buckets
        run_prefix_layer(model, [longest] + [longest - 1] * (num_prompts - 1))


def run_prefix_layer(model: Qwen2_5_VL, lens: Sequence[int]) -> None:
    """`model`'s first decoder layer as a prefix group of prompts of these lengths runs it (packed where they differ,
    `PromptRows`), on zeros, once under no_grad and once attached with a backward to its input only: no parameter
    gets a gradient, no module keeps state."""
    layer, text = model.model.language_model.layers[0], model.config.text
    device, dtype = model.device, model.lm_head.weight.dtype
    rows = PromptRows.of(torch.tensor(lens), device)
    shape, real = (None, ()) if rows is None else ((rows.num_prompts, rows.length), (rows.real,))
    batch, tokens = (1, sum(lens)) if rows is not None else (len(lens), lens[0])
    positions = torch.arange(tokens, device=device).expand(3, batch, -1)
    cos, sin = text_rotary(positions, text)
    x = torch.zeros(batch, tokens, text.hidden_size, dtype=dtype, device=device)
    with torch.no_grad():
        layer_kv(layer, shape, x, cos, sin, *real)
    x.requires_grad_(True)
    with torch.enable_grad():
        out, _, _ = layer_kv(layer, shape, x, cos, sin, *real)
        torch.autograd.grad(out, x, torch.ones_like(out))
