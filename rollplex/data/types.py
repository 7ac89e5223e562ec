"""The unit of training data: one prompt, its verifiable answer, and how to check it.

This module is only the type; `synthetic` and `video_r1` build examples and `rewards` scores against them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollplex.models.inputs import Prompt


class AnswerKind(StrEnum):
    """How a response's `<answer>` is compared with the reference answer (Video-R1's problem types, and
    `exact` for short synthetic answers); `rollplex.data.rewards.accuracy_reward` says how each one scores."""

    CHOICE = "choice"  # multiple choice: the option letter, "B"
    NUMBER = "number"  # numerical: a number, equal within a relative tolerance
    OCR = "ocr"  # text read off the video: 1 - word error rate
    FREE_FORM = "free_form"  # a sentence: ROUGE-L F1
    REGRESSION = "regression"  # a measured quantity: 1 - relative error, floored at 0
    EXACT = "exact"  # a short string, equal after normalisation (case, punctuation, articles, spaces)


@dataclass(frozen=True)
class Example:
    """One prompt with its reference answer. `meta` holds provenance (source, index, question kind...)."""

    prompt: Prompt
    answer: str
    answer_kind: AnswerKind
    meta: Mapping[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "answer_kind", AnswerKind(self.answer_kind))
        except ValueError:
            kinds = ", ".join(k.value for k in AnswerKind)
            raise ValueError(f"answer_kind {self.answer_kind!r} is not one of: {kinds}") from None
