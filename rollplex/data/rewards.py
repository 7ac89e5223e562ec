"""Rewards: `(response_text, example) -> float`, found by name in a registry or imported by path.

The text is what a grader sees: the sampled tokens decoded without the stop token and without special
tokens (`rollplex.data.tokenizer.response_text`), so a response that stops scores as one cut at the same
text. Built in:

    format      1.0 iff the text is one `<think>...</think>` block then one `<answer>...</answer>` block, with
                only whitespace before, between and after them and no tag inside either block; else 0.0
    answer_format  the answer-only form `<answer>X</answer>`, step by step (`answer_format_reward`): credit a
                random-weight policy can climb towards a well-formed answer for the example's kind
    accuracy    the first `<answer>` block's content, stripped ("" without a block), as Video-R1 reads it,
                against `example.answer` by `example.answer_kind` (`accuracy_reward` says how each kind scores)
    tags        0.25 per tag of the longest run of <think> </think> <answer> </answer> in that order, less 0.25
                per other tag in the text, floored at 0: 1.0 for the four tags once each, in order, whatever
                else the text holds; partial credit a random-weight policy can climb, and none for tag soup
    brevity     1 / (1 + characters / 1000): differs between responses of different lengths, so that a
                random-weight benchmark (`workload.replay_lengths`) has non-zero advantages and a real update
Names joined by `+` sum their rewards (`get_reward("format+accuracy")`, Video-R1's reward); `combine`
gives other weights. `load_reward("pkg.module:fn")` takes a user's function. The registry is a plain dict
of pure functions; this module holds no other state.
"""

from __future__ import annotations

import importlib
import math
import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from rollplex.data.types import AnswerKind, Example
from rollplex.errors import RunFailed

RewardFn = Callable[[str, Example], float]
REWARDS: dict[str, RewardFn] = {}

TAGS = ("<think>", "</think>", "<answer>", "</answer>")
NUMBER_REL_TOL = 1e-4
NUMBER_ABS_TOL = 1e-6
_NO_TAG = r"(?:(?!</?think>|</?answer>).)*"
_FORMAT = re.compile(rf"\s*<think>{_NO_TAG}</think>\s*<answer>{_NO_TAG}</answer>\s*", re.DOTALL)
_TAG = re.compile("|".join(map(re.escape, TAGS)))
_TAG_SPLIT = re.compile("(" + "|".join(map(re.escape, TAGS)) + ")")
_ANSWER = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)
_LETTER = re.compile(r"\(?([A-Za-z])(\)?[.:]?)(?:\s+(.*))?", re.DOTALL)  # letter, its mark, the option's text
_NUMBER = re.compile(r"[-+]?(?:(\d+(?:,\d+)*)(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")  # group 1: the whole part
_THOUSANDS = re.compile(r"\d{1,3}(?:,\d{3})+")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ROUGE_TOKEN = re.compile(r"[a-z0-9]+")


def register(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: adds a reward function to `REWARDS` under `name`."""

    def add(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward '{name}' is already registered")
        REWARDS[name] = fn
        return fn

    return add


def get_reward(name: str) -> RewardFn:
    """A registered reward, or the sum of several joined by '+' (e.g. 'format+accuracy')."""
    names = [n.strip() for n in name.split("+")]
    unknown = [n for n in names if n not in REWARDS]
    if unknown:
        raise ValueError(f"unknown reward '{unknown[0]}'; registered: {', '.join(sorted(REWARDS))}")
    return REWARDS[names[0]] if len(names) == 1 else combine(dict.fromkeys(names, 1.0))


def combine(weights: Mapping[str, float]) -> RewardFn:
    """The weighted sum of registered rewards: sum(w * REWARDS[name](text, example))."""
    fns = {name: get_reward(name) for name in weights}

    def weighted(text: str, example: Example) -> float:
        return sum(w * fns[name](text, example) for name, w in weights.items())

    return weighted


def load_reward(spec: str) -> RewardFn:
    """A reward function by import path 'package.module:function'."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward '{spec}' is not an import path: write it as 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"reward '{spec}': cannot import module '{module_name}' ({e})") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward '{spec}': module '{module_name}' has no attribute '{attr}'")
    if not callable(fn):
        raise ValueError(f"reward '{spec}': '{attr}' is a {type(fn).__name__}, not a function")
    return fn


@dataclass(frozen=True)
class RewardTerms:
    """The spec's rewards: each term scored on its own (the per-reward metrics) and their weighted sum."""

    names: tuple[str, ...]
    weights: tuple[float, ...]
    fns: tuple[RewardFn, ...]

    def scores(self, text: str, example: Example) -> tuple[float, ...]:
        """Every term's unweighted score of one response; a score that is not a finite number stops the run (one
        NaN would make its whole group's advantages NaN)."""
        out = []
        for name, fn in zip(self.names, self.fns, strict=True):
            value = fn(text, example)
            try:
                score = float(value)
            except (TypeError, ValueError):
                score = math.nan
            if not math.isfinite(score):
                raise RunFailed(f"reward '{name}' scored a response {value!r}: a reward must be a finite number")
            out.append(score)
        return tuple(out)

    def total(self, scores: Sequence[float]) -> float:
        return sum(w * s for w, s in zip(self.weights, scores, strict=True))


def reward_terms(terms: Sequence[tuple[str, float]]) -> RewardTerms:
    """(name, weight) pairs -> their functions: a registered name, or a `package.module:function` path."""
    fns = tuple(load_reward(name) if ":" in name else get_reward(name) for name, _ in terms)
    return RewardTerms(tuple(n for n, _ in terms), tuple(w for _, w in terms), fns)


def is_correct(text: str, example: Example) -> bool:
    """Whether the response's answer earns full accuracy (the `accuracy` metric counts these)."""
    return accuracy_reward(text, example) >= 1.0


@register("format")
def format_reward(text: str, example: Example) -> float:
    """1.0 iff `text` is `<think>...</think><answer>...</answer>` and nothing else but whitespace; no block may
    hold a tag (so repeated or nested tags score 0)."""
    return 1.0 if _FORMAT.fullmatch(text) else 0.0


@register("answer_format")
def answer_format_reward(text: str, example: Example) -> float:
    """The answer-only form, a step at a time: 0.25 when the text opens with `<answer>` (after whitespace), 0.5
    when a well-formed answer starts the block (an option letter for multiple choice, a number for numerical
    and regression, anything for the rest), 0.75 when the block closes around that answer alone, 1.0 when
    nothing but whitespace follows it."""
    pieces = [p for p in _TAG_SPLIT.split(text) if p]
    if pieces and not pieces[0].strip():
        pieces = pieces[1:]
    if not pieces or pieces[0] != "<answer>":
        return 0.0
    content = pieces[1] if len(pieces) > 1 and pieces[1] not in TAGS else ""
    answer = _well_formed(content.lstrip(), example)
    if not answer:
        return 0.25
    rest = pieces[2:] if content else pieces[1:]
    if not rest or rest[0] != "</answer>" or content.strip() != answer:
        return 0.5
    return 1.0 if not "".join(rest[1:]).strip() else 0.75


def _well_formed(content: str, example: Example) -> str:
    """The well-formed answer `content` starts with ('' if none): an option letter, a number, or the text."""
    kind = example.answer_kind
    if kind is AnswerKind.CHOICE:
        num_options = len(example.meta.get("options", ())) or len(string.ascii_uppercase)
        letters = {option_letter(i) for i in range(num_options)}
        return content[:1] if content[:1] in letters else ""
    if kind in (AnswerKind.NUMBER, AnswerKind.REGRESSION):
        return _number_at(_NUMBER.match(content)) or ""
    return content.strip()


def option_letter(index: int) -> str:
    """The letter of option `index` (from 0) of a multiple-choice question: A, B, C, ... by position. Datasets
    label their prompts' options with it (`video_r1` relabels an option whose own label disagrees), so an
    example's option letters follow from how many options it has, whatever form they were given in."""
    return chr(ord("A") + index)


@register("brevity")
def brevity_reward(text: str, example: Example) -> float:
    """1 / (1 + characters / 1000)."""
    return 1.0 / (1.0 + len(text) / 1000)


@register("tags")
def tags_reward(text: str, example: Example) -> float:
    """0.25 x (the longest run of tags, in text order, whose kinds go strictly up <think> ... </answer>, less
    every tag outside it), floored at 0."""
    best = [0] * len(TAGS)  # best[k]: longest such run ending with tag kind k
    num_tags = 0
    for match in _TAG.finditer(text):
        k = TAGS.index(match.group())
        best[k] = max(best[k], 1 + max(best[:k], default=0))
        num_tags += 1
    run = max(best)
    return 0.25 * max(0, run - (num_tags - run))


@register("accuracy")
def accuracy_reward(text: str, example: Example) -> float:
    """The answer (`answer_of`) against `example.answer`, by kind, in [0, 1]:

    choice      1.0 iff its option letter (`choice_letter`: 'B', '(B)', 'B.', 'B) red', a lone 'b') is the
                reference's (read the same way: 'B', '(B)', 'B. red')
    number      1.0 iff its first number (`parse_number`) equals the reference's within NUMBER_REL_TOL (relative)
    ocr         1 - word error rate (word-level edit distance / reference words), floored at 0
    free_form   ROUGE-L F1 over lower-case alphanumeric words
    regression  1 - |answer - reference| / |reference|, floored at 0 (0 without a number; a reference of 0
                scores 1 for an answer of exactly 0)
    exact       1.0 iff equal after `normalize_text`
    """
    given, reference = answer_of(text), example.answer.strip()
    kind = example.answer_kind
    if kind is AnswerKind.CHOICE:
        letter = choice_letter(given)
        return 1.0 if letter is not None and letter == (choice_letter(reference) or reference.upper()) else 0.0
    if kind is AnswerKind.NUMBER:
        return 1.0 if _numbers_equal(given, reference) else 0.0
    if kind is AnswerKind.OCR:
        return max(0.0, 1.0 - word_error_rate(reference, given))
    if kind is AnswerKind.FREE_FORM:
        return rouge_l_f1(reference, given)
    if kind is AnswerKind.REGRESSION:
        return _regression(given, reference)
    return 1.0 if normalize_text(given) == normalize_text(reference) else 0.0


def answer_of(text: str) -> str:
    """The content of the first `<answer>...</answer>` block, stripped; "" when there is none."""
    found = _ANSWER.search(text)
    return found.group(1).strip() if found else ""


def choice_letter(given: str) -> str | None:
    """The option letter an answer names, upper-cased, or None. The answer (stripped) must be the letter
    standing alone as an option's label: the letter, optionally in parentheses, optionally followed by one
    '.', ')' or ':' ('B', '(B)', 'B.', 'B)', 'B:', '(B).'), and, only when the letter is a capital with such a
    mark, then whitespace and the option's text ('B. red', '(B) red', 'B) red'). A lower-case letter counts
    only alone ('b', '(b)', 'b.'). Anything else names no option: a capital that begins a word or sentence
    ('A lot of things', 'I think C', 'Blue') is not read as a letter."""
    found = _LETTER.fullmatch(given.strip())
    if not found:
        return None
    letter, mark, text = found.groups()
    if text is not None and not (mark and letter.isupper()):
        return None
    return letter.upper()


def parse_number(text: str) -> float | None:
    """The first number in `text` ('1,024' -> 1024.0, '12,345.5' -> 12345.5, '3.5e2' -> 350.0), or None. A
    comma inside a number is a thousands separator: the whole part must be groups of three digits after the
    first ('1,000'); a number whose commas are not ('1,2', '1,0,0,0', '1,5') is not read at all (None, not
    its first digits or a later number). A comma followed by a space ends the number ('3, 4' -> 3.0)."""
    number = _number_at(_NUMBER.search(text))
    if number is None:
        return None
    value = float(number.replace(",", ""))
    return value if math.isfinite(value) else None


def _number_at(found: re.Match[str] | None) -> str | None:
    """The matched number's text, or None when there is none or its commas are not thousands separators."""
    if found is None:
        return None
    whole = found.group(1)
    if whole is not None and "," in whole and not _THOUSANDS.fullmatch(whole):
        return None
    return found.group()


def _numbers_equal(given: str, reference: str) -> bool:
    a, b = parse_number(given), parse_number(reference)
    return a is not None and b is not None and math.isclose(a, b, rel_tol=NUMBER_REL_TOL, abs_tol=NUMBER_ABS_TOL)


def _regression(given: str, reference: str) -> float:
    a, b = parse_number(given), parse_number(reference)
    if a is None or b is None:
        return 0.0
    relative = abs(a - b) / abs(b) if b != 0 else float(a != b)
    return max(0.0, 1.0 - relative)


def edit_distance(a: Sequence[str], b: Sequence[str]) -> int:
    """Levenshtein distance between two word sequences (insertions, deletions, substitutions cost 1)."""
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, start=1):
        current = [i]
        for j, y in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Word-level edit distance over the reference's word count (whitespace words, case kept), as Video-R1."""
    ref, hyp = reference.split(), hypothesis.split()
    return edit_distance(ref, hyp) / max(1, len(ref))


def rouge_l_f1(reference: str, hypothesis: str) -> float:
    """ROUGE-L F1: the longest common subsequence of lower-case alphanumeric words, as F1 of its precision
    (over the hypothesis) and recall (over the reference); 0 when either has no words."""
    ref, hyp = _ROUGE_TOKEN.findall(reference.lower()), _ROUGE_TOKEN.findall(hypothesis.lower())
    lcs = longest_common_subsequence(ref, hyp)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(hyp), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def longest_common_subsequence(a: Sequence[str], b: Sequence[str]) -> int:
    """The length of the longest sequence of words found, in order, in both `a` and `b`."""
    previous = [0] * (len(b) + 1)  # over b[:j], for the words of a so far
    for x in a:
        current = [0]
        for j, y in enumerate(b, start=1):
            current.append(previous[j - 1] + 1 if x == y else max(previous[j], current[j - 1]))
        previous = current
    return previous[-1]


def normalize_text(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (SQuAD-style answer normalisation)."""
    text = text.lower().translate(str.maketrans("", "", string.punctuation))
    return " ".join(_ARTICLES.sub(" ", text).split())
