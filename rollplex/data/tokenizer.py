"""Tokenizers: a small protocol, a character tokenizer for tiny models, and a wrapper of a checkpoint's
`tokenizer.json`.

`CharTokenizer` is what CPU tests and random-weight benchmarks use: one id per printable ASCII character,
with the Qwen special tokens (and the R1 tags `<think>`, `</think>`, `<answer>`, `</answer>`) as single
ids. Its default layout fits the tiny config's vocabulary of 128:

    0 <|endoftext|> (pad)   1 <|bos|>   2 <|im_end|> (eos)   3 <|vision_start|>   4 <|vision_end|>
    5 <|vision_pad|>   6 <|image_pad|>   7 <|video_pad|>   8 <|im_start|>   9 <think>   10 </think>
    11 <answer>   12 </answer>   13.. the 100 characters of `string.printable`

Characters outside `string.printable` encode as `?` (lossy by design: tiny models need no Unicode).
`HFTokenizer` wraps `tokenizers.Tokenizer.from_file(<checkpoint>/tokenizer.json)` for real Qwen checkpoints.
This module does not build prompts (see `chat`).
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import tokenizers

PAD = "<|endoftext|>"
BOS = "<|bos|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
VISION_PAD = "<|vision_pad|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
R1_TAGS = ("<think>", "</think>", "<answer>", "</answer>")

CHAR_SPECIALS = (
    PAD,
    BOS,
    IM_END,
    VISION_START,
    VISION_END,
    VISION_PAD,
    IMAGE_PAD,
    VIDEO_PAD,
    IM_START,
    *R1_TAGS,
)
UNKNOWN_CHAR = "?"


@dataclass(frozen=True)
class SpecialIds:
    """Ids of the tokens that prompt building and sampling need."""

    pad: int
    eos: int  # <|im_end|>: ends every turn, and a sampled response
    im_start: int
    vision_start: int
    vision_end: int
    image: int
    video: int


class Tokenizer(Protocol):
    """What rollplex needs from a tokenizer. `encode` maps special-token strings in `text` to their ids."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def special(self) -> SpecialIds: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """`skip_special`: leave out the special tokens (`<|im_end|>`, the vision tokens...), as a grader reads."""
        ...


def response_text(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """What the rewards score: a response's tokens decoded without special tokens, its stop token among them."""
    return tokenizer.decode(ids, skip_special=True)


class CharTokenizer:
    """One id per character; special tokens and R1 tags are single ids (layout in the module docstring).

    `overrides` moves named special tokens to other ids (see `for_model`); the rest keep their defaults.
    """

    def __init__(self, overrides: Mapping[str, int] | None = None) -> None:
        tokens = [*CHAR_SPECIALS, *string.printable]
        self._id_of = {tok: i for i, tok in enumerate(tokens)} | dict(overrides or {})
        if len(set(self._id_of.values())) != len(self._id_of):
            raise ValueError(f"special-token ids {dict(overrides or {})} collide with the default layout")
        self._token_of = {i: tok for tok, i in self._id_of.items()}
        self._special_ids = frozenset(self._id_of[t] for t in CHAR_SPECIALS if t not in R1_TAGS)
        specials = sorted(CHAR_SPECIALS, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, specials)) + ")")
        self._special = SpecialIds(
            pad=self._id_of[PAD],
            eos=self._id_of[IM_END],
            im_start=self._id_of[IM_START],
            vision_start=self._id_of[VISION_START],
            vision_end=self._id_of[VISION_END],
            image=self._id_of[IMAGE_PAD],
            video=self._id_of[VIDEO_PAD],
        )

    @classmethod
    def for_model(cls, eos: int, vision_start: int, vision_end: int, image: int, video: int) -> CharTokenizer:
        """A char tokenizer whose special ids match a model config's (`ModelConfig.tokens` fields)."""
        wanted = {
            IM_END: eos,
            VISION_START: vision_start,
            VISION_END: vision_end,
            IMAGE_PAD: image,
            VIDEO_PAD: video,
        }
        default = CharTokenizer()._id_of
        return cls({tok: i for tok, i in wanted.items() if default[tok] != i})

    @property
    def vocab_size(self) -> int:
        return max(self._token_of) + 1

    @property
    def special(self) -> SpecialIds:
        return self._special

    def token_id(self, token: str) -> int:
        return self._id_of[token]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in self._split.split(text):
            if piece in self._id_of and len(piece) > 1:
                ids.append(self._id_of[piece])
            else:
                ids.extend(self._id_of.get(ch, self._id_of[UNKNOWN_CHAR]) for ch in piece)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Ids the model's vocabulary has beyond this tokenizer's (padding rows) decode to nothing. The R1 tags are
        text, as in a real Qwen tokenizer: `skip_special` keeps them."""
        skipped = self._special_ids if skip_special else frozenset()
        return "".join(self._token_of.get(int(i), "") for i in ids if int(i) not in skipped)


class HFTokenizer:
    """A checkpoint's `tokenizer.json` (Qwen2.5-VL or any tokenizer that has the Qwen special tokens)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, source: str = "<memory>") -> None:
        self._tok = tokenizer
        self._special = SpecialIds(
            eos=self._id(IM_END, source),
            im_start=self._id(IM_START, source),
            vision_start=self._id(VISION_START, source),
            vision_end=self._id(VISION_END, source),
            image=self._id(IMAGE_PAD, source),
            video=self._id(VIDEO_PAD, source),
            pad=self._id(PAD, source, fallback=IM_END),
        )

    @classmethod
    def from_dir(cls, checkpoint_dir: str | Path) -> HFTokenizer:
        """Loads `<checkpoint_dir>/tokenizer.json` (a path to the file itself also works)."""
        import tokenizers

        path = Path(checkpoint_dir)
        path = path / "tokenizer.json" if path.is_dir() else path
        if not path.is_file():
            raise ValueError(f"no tokenizer.json at {path}: pass a checkpoint directory that holds one")
        return cls(tokenizers.Tokenizer.from_file(str(path)), source=str(path))

    def _id(self, token: str, source: str, fallback: str | None = None) -> int:
        found = self._tok.token_to_id(token)
        if found is None and fallback is not None:
            found = self._tok.token_to_id(fallback)
        if found is None:
            raise ValueError(f"tokenizer {source} has no token {token}: it is not a Qwen2.5-VL tokenizer")
        return found

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special(self) -> SpecialIds:
        return self._special

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)
