"""Rewards: `(response_text, example) -> float`, found by name in a registry or imported by path.

Built in:
    format      1.0 iff the response is `<think>...</think><answer>...</answer>` (whitespace around and
                between the blocks allowed, nothing else), else 0.0
    tags        0.25 per tag among <think> </think> <answer> </answer> that appear in that order (the most
                such tags in any order-respecting choice): partial credit a random-weight policy can climb
    accuracy    the last `<answer>` block against `example.answer`: the option letter (choice), numeric
                equality within a tolerance (number), or equality after normalisation (exact)
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
from collections.abc import Callable, Mapping

from rollplex.data.types import AnswerKind, Example

RewardFn = Callable[[str, Example], float]
REWARDS: dict[str, RewardFn] = {}

TAGS = ("<think>", "</think>", "<answer>", "</answer>")
NUMBER_REL_TOL = 1e-4
NUMBER_ABS_TOL = 1e-6
_FORMAT = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)
_TAG = re.compile("|".join(map(re.escape, TAGS)))
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_LETTER = re.compile(r"^\(?([A-Z])(?:[.):]|\s|$)|^\(?([a-z])\)?\.?$")
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_ARTICLES = re.compile(r"\b(a|an|the)\b")


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


@register("format")
def format_reward(text: str, example: Example) -> float:
    return 1.0 if _FORMAT.fullmatch(text) else 0.0


@register("brevity")
def brevity_reward(text: str, example: Example) -> float:
    return 1.0 / (1.0 + len(text) / 1000)


@register("tags")
def tags_reward(text: str, example: Example) -> float:
    """0.25 x the longest run of tags, in text order, whose kinds go strictly up <think> ... </answer>."""
    best = [0] * len(TAGS)  # best[k]: longest such run ending with tag kind k
    for match in _TAG.finditer(text):
        k = TAGS.index(match.group())
        best[k] = max(best[k], 1 + max(best[:k], default=0))
    return 0.25 * max(best)


@register("accuracy")
def accuracy_reward(text: str, example: Example) -> float:
    answers = _ANSWER.findall(text)
    if not answers:
        return 0.0
    given = answers[-1].strip()
    if example.answer_kind is AnswerKind.CHOICE:
        return 1.0 if _choice(given) == example.answer.strip().upper() else 0.0
    if example.answer_kind is AnswerKind.NUMBER:
        return 1.0 if _numbers_equal(given, example.answer) else 0.0
    return 1.0 if normalize_text(given) == normalize_text(example.answer) else 0.0


def _choice(given: str) -> str | None:
    """The option letter of an answer such as 'B', '(B)', 'B.', 'B) red', or a lone 'b'."""
    found = _LETTER.match(given)
    return (found.group(1) or found.group(2)).upper() if found else None


def parse_number(text: str) -> float | None:
    """The first number in `text` ('1,024' -> 1024.0, '3.5e2' -> 350.0), or None."""
    found = _NUMBER.search(text)
    if not found:
        return None
    try:
        return float(found.group().replace(",", ""))
    except ValueError:
        return None


def _numbers_equal(given: str, reference: str) -> bool:
    a, b = parse_number(given), parse_number(reference)
    return a is not None and b is not None and math.isclose(a, b, rel_tol=NUMBER_REL_TOL, abs_tol=NUMBER_ABS_TOL)


def normalize_text(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (SQuAD-style answer normalisation)."""
    text = text.lower().translate(str.maketrans("", "", string.punctuation))
    return " ".join(_ARTICLES.sub(" ", text).split())
