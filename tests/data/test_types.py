import pytest
import torch

from rollplex.data.types import AnswerKind, Example
from rollplex.models.inputs import Prompt

PROMPT = Prompt(input_ids=torch.zeros(1, dtype=torch.int64))


def test_an_answer_kind_given_as_a_string_becomes_the_enum():
    e = Example(prompt=PROMPT, answer="1", answer_kind="number")
    assert e.answer_kind is AnswerKind.NUMBER and e.answer_kind == "number"


def test_an_unknown_answer_kind_is_rejected_with_the_known_ones():
    with pytest.raises(
        ValueError, match="answer_kind 'essay' is not one of: choice, number, ocr, free_form, regression, exact"
    ):
        Example(prompt=PROMPT, answer="1", answer_kind="essay")


def test_examples_are_frozen():
    e = Example(prompt=PROMPT, answer="1", answer_kind=AnswerKind.NUMBER)
    with pytest.raises(AttributeError):
        e.answer = "2"
