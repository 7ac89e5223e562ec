"""Synthetic video QA: seeded scenes of moving shapes with questions whose answers the simulation knows.

Example `i` of `SyntheticVideoQA(preset, tokenizer, seed)` is a pure function of (preset, seed, i), so a
run resumes at any data position and two processes agree on every example. The preset fixes the sizes
(frames, resolution, text tokens; see `presets`); the scene and the question come from the seed:

    fastest_colour  choice  "Which colour is the object that moves fastest?" + shuffled lettered options
    count_shape     number  "How many squares are in the video?"
    fastest_shape   exact   "What shape is the object that moves fastest?"  -> "circle" | "square"
    count_bounces   number  "How many times does the red circle bounce off the edges of the frame?"
    colour          choice  "Which colour is the object?" + the palette's colours as options, in order

The question is preceded by scene-description filler words until the prompt's text reaches the layout's
text-token count (one word over at most). `mismatch_videos` (a control run) shows example i's question and
answer with the video of another example drawn from (seed, i), so that the answer cannot be read from what the
model sees. Frames
are rendered at the preset's post-resize size, so the pixel path costs no resampling. This module does not
score responses (see `rewards`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import numpy as np

from rollplex.data.chat import ANSWER_INSTRUCTION, DEFAULT_SYSTEM, R1_INSTRUCTION, build_prompt, num_text_tokens
from rollplex.data.presets import Preset, QuestionKind
from rollplex.data.scene import COLOURS, Scene, Shape, render, sample_scene, trajectories
from rollplex.data.tokenizer import Tokenizer
from rollplex.data.types import AnswerKind, Example
from rollplex.data.video import preprocess_video

FILLER = (
    "The video shows simple shapes moving over a plain background.",
    "Each object keeps its speed and bounces off the edges of the frame.",
    "Every object has a colour of its own, and no two objects share one.",
    "Some objects are circles and the others are squares.",
    "Watch the whole clip before you answer, and count carefully.",
)


@dataclass(frozen=True)
class Question:
    kind: QuestionKind
    text: str
    answer: str
    answer_kind: AnswerKind
    options: tuple[str, ...] = ()


def ask(kind: QuestionKind, scene: Scene, bounces: np.ndarray, rng: np.random.Generator, num_options: int) -> Question:
    """One question about `scene` with its answer (`bounces` from `trajectories` on the rendered size)."""
    fastest = max(scene.things, key=lambda thing: thing.speed)
    if kind is QuestionKind.COLOUR:
        return _colour(scene.things[0].colour, num_options)
    if kind is QuestionKind.FASTEST_COLOUR:
        return _fastest_colour(scene, fastest.colour, rng, num_options)
    if kind is QuestionKind.COUNT_SHAPE:
        shape = Shape(rng.choice([s.value for s in Shape]))
        count = sum(thing.shape is shape for thing in scene.things)
        text = f"How many {shape.value}s are in the video? Give only the number."
        return Question(kind, text, str(count), AnswerKind.NUMBER)
    if kind is QuestionKind.FASTEST_SHAPE:
        text = "What shape is the object that moves fastest? Answer with one word: circle or square."
        return Question(kind, text, fastest.shape.value, AnswerKind.EXACT)
    i = int(rng.integers(len(scene.things)))
    thing = scene.things[i]
    text = f"How many times does the {thing.colour} {thing.shape.value} bounce off the edges of the frame?"
    return Question(kind, f"{text} Give only the number.", str(int(bounces[i])), AnswerKind.NUMBER)


def _fastest_colour(scene: Scene, answer: str, rng: np.random.Generator, num_options: int) -> Question:
    others = [c for c in (t.colour for t in scene.things) if c != answer]
    absent = [c for c in COLOURS if c != answer and c not in others]
    distractors = [*rng.permutation(others), *rng.permutation(absent)][: num_options - 1]
    options = [answer, *distractors]
    options = [options[j] for j in rng.permutation(len(options))]
    letters = [chr(ord("A") + j) for j in range(len(options))]
    lines = [f"{letter}. {colour}" for letter, colour in zip(letters, options, strict=True)]
    text = "Which colour is the object that moves fastest?\nOptions:\n" + "\n".join(lines)
    text += "\nGive only the option letter."
    return Question(QuestionKind.FASTEST_COLOUR, text, letters[options.index(answer)], AnswerKind.CHOICE, tuple(lines))


def _colour(answer: str, num_options: int) -> Question:
    """The one object's colour among the first `num_options` colours, always in the same order and letters."""
    options = list(COLOURS)[:num_options]
    lines = tuple(f"{chr(ord('A') + j)}. {colour}" for j, colour in enumerate(options))
    text = "Which colour is the object?\nOptions:\n" + "\n".join(lines) + "\nGive only the option letter."
    return Question(QuestionKind.COLOUR, text, chr(ord("A") + options.index(answer)), AnswerKind.CHOICE, lines)


def fill_question(
    tokenizer: Tokenizer, question: str, text_tokens: int, rng: np.random.Generator, system: str | None
) -> str:
    """`question` after the fewest filler words that bring the prompt's text to >= `text_tokens` tokens."""
    sentences = [FILLER[j] for j in rng.permutation(len(FILLER))]
    words = " ".join(sentences).split()
    words = (words * (text_tokens // len(words) + 1))[:text_tokens]  # every word costs >= 1 token

    def text(k: int) -> str:
        return " ".join(words[:k]) + "\n" + question if k else question

    lo, hi = 0, len(words)
    while lo < hi:  # smallest k with enough tokens (hi if none)
        mid = (lo + hi) // 2
        if num_text_tokens(tokenizer, text(mid), system) >= text_tokens:
            hi = mid
        else:
            lo = mid + 1
    return text(lo)


class SyntheticVideoQA:
    """`num_examples` synthetic examples of a preset's shape; example i depends only on (seed, i)."""

    def __init__(
        self,
        preset: Preset,
        tokenizer: Tokenizer,
        seed: int = 0,
        num_examples: int = 1024,
        system: str | None = DEFAULT_SYSTEM,
        mismatch_videos: bool = False,
    ) -> None:
        self.preset = preset
        self.tokenizer = tokenizer
        self.seed = seed
        self.num_examples = num_examples
        self.system = system
        self.mismatch_videos = mismatch_videos

    def __len__(self) -> int:
        return self.num_examples

    def __getitem__(self, index: int) -> Example:
        if not 0 <= index < self.num_examples:
            raise IndexError(f"example {index} out of range [0, {self.num_examples})")
        return self._example(index)

    def iter_from(self, start: int = 0) -> Iterator[Example]:
        """Examples start, start+1, ... (resume a run at a data position)."""
        for index in range(start, self.num_examples):
            yield self._example(index)

    def _scene(self, index: int, rng: np.random.Generator) -> Scene:
        """The scene example `index` asks about, drawn first from its generator `rng`; under a balanced preset its
        one object takes the palette's colours in turn (example i the (i mod palette)-th)."""
        scene = sample_scene(rng, self.preset.objects, self.preset.palette, self.preset.radius)
        if not self.preset.balanced:
            return scene
        (thing,) = scene.things
        return replace(scene, things=(replace(thing, colour=list(COLOURS)[index % self.preset.palette]),))

    def _shown(self, index: int) -> int:
        """The example whose video example `index` shows: itself, or (mismatched) another drawn from its seed."""
        if not self.mismatch_videos:
            return index
        offset = int(np.random.default_rng([self.seed, index, 0xD15]).integers(1, self.num_examples))
        return (index + offset) % self.num_examples

    def _example(self, index: int) -> Example:
        preset = self.preset
        layout = preset.layout(self.seed, index)
        rng = np.random.default_rng([self.seed, index, 0x5CE7E])
        scene = self._scene(index, rng)
        height, width = preset.frame_size(layout)
        shown_index = self._shown(index)
        shown = (
            scene
            if shown_index == index
            else self._scene(shown_index, np.random.default_rng([self.seed, shown_index, 0x5CE7E]))
        )
        frames = render(shown, layout.num_frames, height, width)
        _, bounces = trajectories(scene, layout.num_frames, height, width)
        question = ask(QuestionKind(rng.choice(list(preset.questions))), scene, bounces, rng, preset.num_options)
        instruction = ANSWER_INSTRUCTION if preset.answer_only else R1_INSTRUCTION
        text = fill_question(
            self.tokenizer, f"{question.text}\n{instruction}", layout.num_text_tokens, rng, self.system
        )
        visual = preprocess_video(frames, preset.vision, fps=preset.fps, size=(height, width))
        prompt = build_prompt(self.tokenizer, text, [visual], self.system, preset.vision.merge_size)
        meta = {
            "source": "synthetic",
            "preset": preset.name,
            "seed": self.seed,
            "index": index,
            "question_kind": question.kind.value,
            "options": question.options,
            "num_frames": layout.num_frames,
            "frame_size": (height, width),
            "mismatched_video": self.mismatch_videos,
        }
        return Example(prompt=prompt, answer=question.answer, answer_kind=question.answer_kind, meta=meta)
