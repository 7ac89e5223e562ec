import itertools
import random

import pytest
import torch

from rollplex.data import rewards
from rollplex.data.rewards import TAGS, combine, get_reward, load_reward, register
from rollplex.data.types import Example
from rollplex.models.inputs import Prompt


def example(answer: str, kind: str) -> Example:
    return Example(prompt=Prompt(input_ids=torch.zeros(1, dtype=torch.int64)), answer=answer, answer_kind=kind)


CHOICE = example("B", "choice")


@pytest.mark.parametrize(
    "text",
    [
        "<think>x</think><answer>B</answer>",
        "  <think>\nlet me see\n</think>\n\n<answer> B </answer>\n",
        "<think></think><answer></answer>",
    ],
)
def test_format_gives_one_to_think_then_answer(text):
    assert get_reward("format")(text, CHOICE) == 1.0


@pytest.mark.parametrize(
    "text",
    [
        "<answer>B</answer>",
        "<think>x</think>",
        "<answer>B</answer><think>x</think>",
        "so <think>x</think><answer>B</answer>",
        "<think>x</think><answer>B</answer> done",
        "<think>x<answer>B</answer>",
        "",
    ],
)
def test_format_gives_zero_to_anything_else(text):
    assert get_reward("format")(text, CHOICE) == 0.0


def brute_force_tags(text: str) -> float:
    """Oracle: the most tag occurrences, taken in text order, whose kinds strictly increase."""
    found = []
    for k, tag in enumerate(TAGS):
        start = text.find(tag)
        while start != -1:
            found.append((start, k))
            start = text.find(tag, start + 1)
    found.sort()
    best = 0
    for size in range(len(found) + 1):
        for subset in itertools.combinations(found, size):
            kinds = [k for _, k in subset]
            if all(a < b for a, b in itertools.pairwise(kinds)):
                best = max(best, size)
    return 0.25 * best


def test_tags_equal_the_brute_force_longest_ordered_run_of_tags():
    rng = random.Random(0)
    tags = get_reward("tags")
    for _ in range(300):
        text = "".join(rng.choice([*TAGS, "x", " "]) for _ in range(rng.randint(0, 9)))
        assert tags(text, CHOICE) == brute_force_tags(text), text


def test_tags_credit_partial_formats():
    tags = get_reward("tags")
    assert tags("<think>x</think><answer>B</answer>", CHOICE) == 1.0
    assert tags("<think> hmm", CHOICE) == 0.25
    assert tags("</answer><answer></think><think>", CHOICE) == 0.25
    assert tags("</think><answer></answer><think>", CHOICE) == 0.75
    assert tags("no tags", CHOICE) == 0.0


@pytest.mark.parametrize(
    ("answer", "kind", "text", "expected"),
    [
        ("B", "choice", "<answer>B</answer>", 1.0),
        ("B", "choice", "<answer> (B) green </answer>", 1.0),
        ("B", "choice", "<answer>B.</answer>", 1.0),
        ("B", "choice", "<answer>b</answer>", 1.0),
        ("B", "choice", "<answer>A</answer>", 0.0),
        ("B", "choice", "<answer>Blue</answer>", 0.0),
        ("B", "choice", "<answer>A</answer> wait <answer>B</answer>", 1.0),
        ("B", "choice", "B", 0.0),
        ("3", "number", "<answer>3</answer>", 1.0),
        ("3", "number", "<answer>3.0 squares</answer>", 1.0),
        ("1024", "number", "<answer>1,024</answer>", 1.0),
        ("0.5", "number", "<answer>.5</answer>", 1.0),
        ("3", "number", "<answer>3.01</answer>", 0.0),
        ("3", "number", "<answer>three</answer>", 0.0),
        ("circle", "exact", "<answer> The Circle. </answer>", 1.0),
        ("to the right", "exact", "<answer>To  the right!</answer>", 1.0),
        ("circle", "exact", "<answer>square</answer>", 0.0),
    ],
)
def test_accuracy_compares_the_last_answer_by_kind(answer, kind, text, expected):
    assert get_reward("accuracy")(text, example(answer, kind)) == expected


def test_names_joined_by_plus_sum_their_rewards():
    text = "<think>x</think><answer>A</answer>"
    assert get_reward("format+accuracy")(text, CHOICE) == 1.0
    assert get_reward("format + tags + accuracy")(text, CHOICE) == 2.0


def test_combine_weights_each_reward():
    fn = combine({"format": 0.5, "accuracy": 2.0})
    assert fn("<think>x</think><answer>B</answer>", CHOICE) == 2.5
    assert fn("<answer>B</answer>", CHOICE) == 2.0


def test_an_unknown_reward_name_lists_the_registered_ones():
    with pytest.raises(ValueError, match="unknown reward 'speed'; registered: accuracy, brevity, format, tags"):
        get_reward("format+speed")


def test_register_adds_a_reward_and_refuses_a_taken_name(monkeypatch):
    monkeypatch.setattr(rewards, "REWARDS", dict(rewards.REWARDS))

    @register("length")
    def length(text: str, ex: Example) -> float:
        return float(len(text))

    assert get_reward("length+format")("abc", CHOICE) == 3.0
    with pytest.raises(ValueError, match="already registered"):
        register("format")(length)


def test_load_reward_imports_a_function_by_path(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def brevity(text, ex):\n    return 1.0 / (1 + len(text))\nLIMIT = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward("my_rewards:brevity")("abc", CHOICE) == 0.25
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        load_reward("my_rewards:missing")
    with pytest.raises(ValueError, match="'LIMIT' is a int, not a function"):
        load_reward("my_rewards:LIMIT")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        ("just_a_name", "write it as 'package.module:function'"),
        (":fn", "write it as 'package.module:function'"),
    ],
)
def test_load_reward_errors_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        load_reward(spec)


def test_brevity_falls_with_length_and_stays_in_zero_one():
    brevity = get_reward("brevity")
    scores = [brevity("x" * n, None) for n in (0, 10, 1000, 100_000)]
    assert scores[0] == 1.0 and scores[2] == 0.5 and all(a > b > 0 for a, b in itertools.pairwise(scores))
