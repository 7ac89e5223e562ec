import itertools
import random

import pytest
import torch

from rollplex.data import rewards
from rollplex.data.rewards import (
    TAGS,
    choice_letter,
    combine,
    get_reward,
    is_correct,
    load_reward,
    parse_number,
    register,
    reward_terms,
    rouge_l_f1,
    word_error_rate,
)
from rollplex.data.tokenizer import CharTokenizer, response_text
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
        "<think><think>x</think><answer>B</answer>",
        "<think>x</think><answer>B</answer></answer>",
        "<think>x</think><answer><answer>B</answer>",
        "<think>x</think><think>y</think><answer>B</answer>",
        "<think>x</think><answer>B</answer><answer>C</answer>",
        "<think>x</think><answer>B</answer><|im_end|>",
        "",
    ],
)
def test_format_gives_zero_to_anything_else(text):
    assert get_reward("format")(text, CHOICE) == 0.0


@pytest.mark.parametrize("name", ["format", "accuracy", "tags"])
def test_a_response_that_stops_scores_as_the_same_text_cut_at_max_tokens(name):
    tokenizer = CharTokenizer()
    fn = get_reward(name)
    for text in ("<think>x</think><answer>B</answer>", " <think></think>\n<answer> B </answer> ", "<answer>B</answer>"):
        stopped = [*tokenizer.encode(text), tokenizer.special.eos]
        assert response_text(tokenizer, stopped) == text
        assert fn(response_text(tokenizer, stopped), CHOICE) == fn(text, CHOICE)
    assert get_reward("format")(response_text(tokenizer, stopped[:-3]), CHOICE) == 0.0  # cut inside the answer


def test_the_response_text_leaves_out_special_tokens_but_keeps_the_r1_tags():
    tokenizer = CharTokenizer()
    sp = tokenizer.special
    ids = [sp.vision_start, *tokenizer.encode("<think>a</think>"), sp.pad, sp.im_start, *tokenizer.encode("b"), sp.eos]
    assert response_text(tokenizer, ids) == "<think>a</think>b"
    assert tokenizer.decode(ids).endswith("b<|im_end|>")  # the plain decode keeps everything


def brute_force_tags(text: str) -> float:
    """Oracle: the most tag occurrences, taken in text order, whose kinds strictly increase, less the others."""
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
    return 0.25 * max(0, best - (len(found) - best))


def test_tags_equal_the_brute_force_longest_ordered_run_of_tags_less_the_rest():
    rng = random.Random(0)
    tags = get_reward("tags")
    for _ in range(300):
        text = "".join(rng.choice([*TAGS, "x", " "]) for _ in range(rng.randint(0, 9)))
        assert tags(text, CHOICE) == brute_force_tags(text), text


def test_tags_credit_partial_formats_and_not_tag_soup():
    tags = get_reward("tags")
    assert tags("<think>x</think><answer>B</answer>", CHOICE) == 1.0
    assert tags("<think>x</think><answer>B</answer> and more text", CHOICE) == 1.0
    assert tags("<think> hmm", CHOICE) == 0.25
    assert tags("</think><answer></answer>", CHOICE) == 0.75
    assert tags("</think><answer></answer><think>", CHOICE) == 0.5
    assert tags("<answer></think></think><think></answer>", CHOICE) == 0.0  # two in order, three others
    assert tags("<think><think></think><answer></answer>", CHOICE) == 0.75
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
        ("B", "choice", "<answer>A</answer> wait <answer>B</answer>", 0.0),
        ("B", "choice", "<answer>B</answer> wait <answer>A</answer>", 1.0),
        ("(B)", "choice", "<answer>B</answer>", 1.0),  # a reference in an option's label form
        ("B. green", "choice", "<answer>B</answer>", 1.0),
        ("B.", "choice", "<answer>(B)</answer>", 1.0),
        ("(B)", "choice", "<answer>A</answer>", 0.0),
        ("B", "choice", "<answer>\n B \n</answer>", 1.0),
        ("B", "choice", "<answer>B", 0.0),
        ("B", "choice", "</answer>B<answer>", 0.0),
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
        ("STOP HERE", "ocr", "<answer>STOP HERE</answer>", 1.0),
        ("STOP HERE NOW", "ocr", "<answer>STOP THERE NOW</answer>", 1 - 1 / 3),
        ("STOP HERE", "ocr", "<answer>a b c d e</answer>", 0.0),  # 5 edits over 2 words: floored at 0
        ("STOP HERE", "ocr", "<answer></answer>", 0.0),
        ("the cat sat on the mat", "free_form", "<answer>The cat sat on the mat.</answer>", 1.0),
        ("the cat sat", "free_form", "<answer>a cat sat down</answer>", 2 * (2 / 4) * (2 / 3) / (2 / 4 + 2 / 3)),
        ("the cat sat", "free_form", "<answer>dogs bark</answer>", 0.0),
        ("10", "regression", "<answer>10</answer>", 1.0),
        ("10", "regression", "<answer>about 12 metres</answer>", 0.8),
        ("10", "regression", "<answer>-30</answer>", 0.0),
        ("10", "regression", "<answer>none</answer>", 0.0),
        ("0", "regression", "<answer>0</answer>", 1.0),
    ],
)
def test_accuracy_compares_the_first_answer_by_kind(answer, kind, text, expected):
    assert get_reward("accuracy")(text, example(answer, kind)) == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize("kind", ["choice", "number", "ocr", "free_form", "regression", "exact"])
def test_accuracy_of_a_response_without_an_answer_block_is_zero_and_of_the_reference_one(kind):
    answer = {"choice": "B", "number": "3", "regression": "3"}.get(kind, "red ball")
    ex = example(answer, kind)
    for text in ("", "B", "3", "red ball", "<think>red ball</think>", "<answer>red ball", "<|im_end|>"):
        assert get_reward("accuracy")(text, ex) == 0.0, text
    assert get_reward("accuracy")(f"<think>x</think><answer>{answer}</answer>", ex) == 1.0
    assert is_correct(f"<answer> {answer} </answer>", ex) and not is_correct("<answer>-1</answer>", ex)


def test_word_error_rate_and_rouge_l_match_hand_counts():
    assert word_error_rate("a b c d", "a x c") == 2 / 4  # one substitution, one deletion
    assert word_error_rate("a b", "a b c d") == 1.0  # two insertions over two words
    assert rouge_l_f1("a b c d", "a c d e") == pytest.approx(2 * 0.75 * 0.75 / 1.5)  # LCS a c d
    assert rouge_l_f1("", "a") == rouge_l_f1("a", "") == 0.0


def test_reward_terms_score_each_term_and_sum_them_with_their_weights():
    terms = reward_terms([("format", 0.5), ("accuracy", 2.0)])
    scores = terms.scores("<think>x</think><answer>B</answer>", CHOICE)
    assert terms.names == ("format", "accuracy") and scores == (1.0, 1.0) and terms.total(scores) == 2.5


@pytest.mark.parametrize("value", [float("nan"), float("inf"), None, "high"])
def test_a_reward_that_is_not_a_finite_number_stops_the_run_in_one_line(value):
    from rollplex.data.rewards import RewardTerms
    from rollplex.errors import RunFailed

    terms = RewardTerms(("format", "mine"), (1.0, 1.0), (get_reward("format"), lambda text, example: value))
    with pytest.raises(RunFailed, match=r"reward 'mine' scored a response .*: a reward must be a finite number"):
        terms.scores("<think>x</think><answer>B</answer>", CHOICE)


def test_names_joined_by_plus_sum_their_rewards():
    text = "<think>x</think><answer>A</answer>"
    assert get_reward("format+accuracy")(text, CHOICE) == 1.0
    assert get_reward("format + tags + accuracy")(text, CHOICE) == 2.0


def test_combine_weights_each_reward():
    fn = combine({"format": 0.5, "accuracy": 2.0})
    assert fn("<think>x</think><answer>B</answer>", CHOICE) == 2.5
    assert fn("<answer>B</answer>", CHOICE) == 2.0


def test_an_unknown_reward_name_lists_the_registered_ones():
    with pytest.raises(
        ValueError, match=r"unknown reward .speed.; registered: accuracy, answer_format, brevity, format, tags"
    ):
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


OPTIONS = Example(
    prompt=Prompt(input_ids=torch.zeros(1, dtype=torch.int64)),
    answer="B",
    answer_kind="choice",
    meta={"options": ("A. red", "B. green", "C. blue", "D. yellow")},
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer>B</answer>", 1.0),
        (" \n<answer> C </answer>\n", 1.0),  # well formed, and wrong: accuracy's business
        ("<answer>B</answer>x", 0.75),
        ("<answer>B</answer></answer>", 0.75),
        ("<answer>B green</answer>", 0.5),
        ("<answer>B", 0.5),
        ("<answer>B<answer>", 0.5),
        ("<answer>E</answer>", 0.25),  # not an option
        ("<answer></answer>", 0.25),
        ("<answer>", 0.25),
        ("x<answer>B</answer>", 0.0),
        ("<think></think><answer>B</answer>", 0.0),
        ("B", 0.0),
        ("", 0.0),
    ],
)
def test_answer_format_climbs_one_step_per_well_placed_piece(text, expected):
    assert get_reward("answer_format")(text, OPTIONS) == expected


@pytest.mark.parametrize(
    ("kind", "good", "bad"),
    [("number", "<answer>-3.5</answer>", "<answer>three</answer>"),
     ("regression", "<answer>12</answer>", "<answer>n/a</answer>"),
     ("free_form", "<answer>a red ball</answer>", "<answer> </answer>")],
)  # fmt: skip
def test_answer_format_asks_each_kind_for_its_own_form(kind, good, bad):
    ex = example("3", kind)
    assert get_reward("answer_format")(good, ex) == 1.0 and get_reward("answer_format")(bad, ex) == 0.25


@pytest.mark.parametrize(
    ("given", "letter"),
    [("B", "B"), ("(C) green", "C"), ("A", "A"), ("(A)", "A"), ("A.", "A"), ("A)", "A"), ("A:", "A"), ("(A).", "A"),
     ("A. red", "A"), ("(B) blue", "B"), ("B) blue", "B"), ("B:\nblue", "B"), ("b", "B"), ("(b)", "B"),
     ("A lot of things", None), ("I think C", None), ("Blue", None), ("A.M.", None), ("A.red", None),
     ("b. blue", None), ("", None)],
)  # fmt: skip
def test_a_choice_answer_names_a_letter_only_when_the_letter_stands_alone_as_an_option_label(given, letter):
    assert choice_letter(given) == letter


@pytest.mark.parametrize(
    ("answer", "text"),
    [("A", "<answer>A lot of things</answer>"), ("I", "<answer>I think C</answer>"),
     ("C", "<answer>I think C</answer>")],
)  # fmt: skip
def test_a_word_that_begins_with_a_capital_earns_no_choice_accuracy(answer, text):
    assert get_reward("accuracy")(text, example(answer, "choice")) == 0.0


@pytest.mark.parametrize(
    ("text", "value"),
    [("1,000", 1000.0), ("12,345.5", 12345.5), ("-1,234,567", -1234567.0), ("1,024 frames", 1024.0),
     ("3, 4 and 5", 3.0), ("1000", 1000.0), ("1,2", None), ("1,0,0,0", None), ("1,5", None),
     ("12,34,567", None), ("1,2345", None), ("1,2 or 3", None), ("none", None)],
)  # fmt: skip
def test_a_comma_in_a_number_is_only_a_thousands_separator(text, value):
    assert parse_number(text) == value


def test_a_number_with_misplaced_commas_is_neither_accurate_nor_well_formed():
    assert get_reward("accuracy")("<answer>1,2</answer>", example("12", "number")) == 0.0
    assert get_reward("accuracy")("<answer>1,0,0,0</answer>", example("1000", "regression")) == 0.0
    assert get_reward("answer_format")("<answer>1,2</answer>", example("12", "number")) == 0.25
    assert get_reward("answer_format")("<answer>1,000</answer>", example("1000", "number")) == 1.0


@pytest.mark.parametrize(
    "options",
    [("red", "blue"), ("A. red", "B. blue"), ("(A) red", "(B) blue"), ("A) red", "B) blue"), ("A: red", "B: blue")],
)
def test_answer_format_takes_the_option_letters_from_their_positions_whatever_form_the_options_have(options):
    ex = Example(
        prompt=Prompt(input_ids=torch.zeros(1, dtype=torch.int64)),
        answer="A",
        answer_kind="choice",
        meta={"options": options},
    )
    fn = get_reward("answer_format")
    assert fn("<answer>A</answer>", ex) == fn("<answer>B</answer>", ex) == 1.0
    assert fn("<answer>C</answer>", ex) == 0.25
