"""The Qwen chat prompt: system turn, user turn with the vision pad tokens in place, open assistant turn.

    <|im_start|>system\n{system}<|im_end|>\n
    <|im_start|>user\n<|vision_start|><|video_pad|>*n<|vision_end|>{question}<|im_end|>\n
    <|im_start|>assistant\n

n = grid_t * grid_h * grid_w / merge_size**2 per visual (an image uses <|image_pad|>). Ids are built piece
by piece (special ids placed directly, text pieces encoded), which equals tokenizing the rendered string
whole because tokenizers split on special tokens before anything else. This module does not preprocess
pixels (see `video`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rollplex.data.tokenizer import Tokenizer
from rollplex.models.inputs import Prompt, Visual

DEFAULT_SYSTEM = "You are a helpful assistant."
R1_INSTRUCTION = "Think inside <think> </think>, then give the final answer inside <answer> </answer>."
ANSWER_INSTRUCTION = "Give the final answer inside <answer> </answer>."  # the answer-only form (`answer_format`)


def num_pad_tokens(visual: Visual, merge_size: int = 2) -> int:
    """Pad tokens that stand for one visual in the prompt: its patches over the spatial merge window."""
    return visual.num_patches // merge_size**2


def render_prompt(
    question: str, visuals: Sequence[Visual] = (), system: str | None = DEFAULT_SYSTEM, merge_size: int = 2
) -> str:
    """The prompt as text, pad tokens expanded (what the HF processor tokenizes)."""
    parts = [] if system is None else [f"<|im_start|>system\n{system}<|im_end|>\n"]
    parts.append("<|im_start|>user\n")
    for visual in visuals:
        pad = "<|video_pad|>" if visual.is_video else "<|image_pad|>"
        parts.append(f"<|vision_start|>{pad * num_pad_tokens(visual, merge_size)}<|vision_end|>")
    parts.append(f"{question}<|im_end|>\n<|im_start|>assistant\n")
    return "".join(parts)


def build_prompt(
    tokenizer: Tokenizer,
    question: str,
    visuals: Sequence[Visual] = (),
    system: str | None = DEFAULT_SYSTEM,
    merge_size: int = 2,
) -> Prompt:
    """Token ids of `render_prompt(...)` with the visuals attached, in order of appearance."""
    sp = tokenizer.special
    pieces: list[str | list[int]] = []
    if system is not None:
        pieces += [[sp.im_start], f"system\n{system}", [sp.eos], "\n"]
    pieces += [[sp.im_start], "user\n"]
    for visual in visuals:
        pad = sp.video if visual.is_video else sp.image
        pieces.append([sp.vision_start, *[pad] * num_pad_tokens(visual, merge_size), sp.vision_end])
    pieces += [question, [sp.eos], "\n", [sp.im_start], "assistant\n"]
    ids = _encode_pieces(tokenizer, pieces)
    return Prompt(input_ids=torch.tensor(ids, dtype=torch.int64), visuals=tuple(visuals))


def _encode_pieces(tokenizer: Tokenizer, pieces: Sequence[str | list[int]]) -> list[int]:
    """Ids of a mix of text and literal ids; adjacent texts are encoded together, as in the whole string."""
    ids: list[int] = []
    text = ""
    for piece in pieces:
        if isinstance(piece, str):
            text += piece
            continue
        ids += tokenizer.encode(text) if text else []
        ids += piece
        text = ""
    return ids + (tokenizer.encode(text) if text else [])


def num_text_tokens(tokenizer: Tokenizer, question: str, system: str | None = DEFAULT_SYSTEM) -> int:
    """Tokens of the prompt other than the visuals' (vision start/end and pads): what the text costs."""
    return build_prompt(tokenizer, question, (), system).num_tokens
