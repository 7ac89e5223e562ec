"""Workload presets shaped like the paper's four Video-R1 tasks, and their response-length distributions.

The paper (Rollplex, sec. 2.2 and 4.1) trains on CLEVRER, PerceptionTest, LLaVA-Video-178K and STAR through
Video-R1 and reports median prompts of roughly 470-5,900 tokens, prompt tokens 79-98 % of a sample at the
median, an 8k prompt budget and a 2k response budget. It does not publish per-task frame counts or
resolutions, so the numbers below are OUR CHOICE, shaped on those figures and on Qwen2.5-VL's processor
(one visual token per 28x28 px per 2 frames; Video-R1 samples ~16 frames at <= 128-256 x 28x28 px):

| preset          | frames | source h | w/h      | max px   | text tok | prompt med | response med/sigma/max |
|-----------------|--------|----------|----------|----------|----------|------------|------------------------|
| clevrer         | 8-16   | 320      | 1.5      | 128*28^2 | 100-200  | ~0.85k     | 220 / 0.6 / 1024       |
| perception_test | 12-20  | 480-1080 | 16/9 4/3 | 256*28^2 | 150-300  | ~2.1k      | 180 / 0.7 / 1536       |
| star            | 12-24  | 270-480  | 4/3 16/9 | 192*28^2 | 200-350  | ~1.8k      | 200 / 0.7 / 1536       |
| llava_video     | 40-56  | 360-1080 | 16/9 4/3 | 256*28^2 | 150-300  | ~5.9k      | 150 / 1.0 / 2048       |

`colour` is shaped on no paper task: one large object per clip, asked its colour among four options in a
fixed order (chance 0.25), the colours taken in turn so that every step asks each option equally often (a
policy gains nothing from a favourite letter). The answer depends on the video alone, and a random-weight
tiny model learns it on a CPU (`specs/tiny_cpu.yaml`, the learning check); objects of the other presets'
size fill one patch of a tiny frame, too little of the prompt for the tiny model to find in minutes.

Prompt fraction at the median: clevrer ~0.80, perception_test ~0.92, star ~0.90, llava_video ~0.98
(medians of 400 sampled layouts; prompt = text + 2 + visual tokens).
Response lengths are log-normal (median, sigma) clipped to [min, max]: a long tail, as in rollout.
`Preset.tiny()` keeps a preset's shape at CPU-test scale (2-4 frames of 56-84 px, responses / 16).
Text-token counts are in the tokens of whatever tokenizer builds the prompt, and a floor: a question is
never cut, so a question longer than its budget (likely with `CharTokenizer`) makes a longer prompt.
This module only describes workloads; `synthetic` renders them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np

from rollplex.data.sizes import VisionSpec, grid_thw, output_size

_PX = 28 * 28


class QuestionKind(StrEnum):
    """What a synthetic example asks (`rollplex.data.synthetic.ask` writes the question and its answer)."""

    FASTEST_COLOUR = "fastest_colour"  # choice among shuffled colours
    COUNT_SHAPE = "count_shape"  # number
    FASTEST_SHAPE = "fastest_shape"  # exact: circle or square
    COUNT_BOUNCES = "count_bounces"  # number
    COLOUR = "colour"  # choice: the colour of the scene's one object, options in palette order


@dataclass(frozen=True)
class LengthDistribution:
    """Long-tailed token counts: round(median * exp(sigma * N(0, 1))), clipped to [low, high]."""

    median: int
    sigma: float
    low: int
    high: int

    def __post_init__(self) -> None:
        if not 0 < self.low <= self.median <= self.high or self.sigma < 0:
            raise ValueError(f"need 0 < low <= median <= high and sigma >= 0, got {self}")

    def sample(self, num_samples: int, seed: int) -> np.ndarray:
        """[num_samples] int64 lengths, a pure function of `seed`."""
        z = np.random.default_rng(seed).standard_normal(num_samples)
        return np.clip(np.round(self.median * np.exp(self.sigma * z)), self.low, self.high).astype(np.int64)


@dataclass(frozen=True)
class Layout:
    """The sizes of one example: frames sampled, source frame size, text tokens of the prompt."""

    num_frames: int
    height: int
    width: int
    num_text_tokens: int


@dataclass(frozen=True)
class Preset:
    """A workload's shape. Ranges are inclusive; frame counts are drawn among the even numbers in range."""

    name: str
    frames: tuple[int, int]
    height: tuple[int, int]
    aspects: tuple[float, ...]
    vision: VisionSpec
    text_tokens: tuple[int, int]
    response: LengthDistribution
    fps: float = 2.0
    num_options: int = 4
    questions: tuple[QuestionKind, ...] = tuple(k for k in QuestionKind if k is not QuestionKind.COLOUR)
    objects: tuple[int, int] = (3, 6)  # moving objects per scene
    palette: int = 8  # the scene's colours come from the first `palette` of `scene.COLOURS`
    radius: tuple[float, float] = (0.06, 0.12)  # of each object, a fraction of the shorter frame side
    balanced: bool = False  # one object, its colour the palette's in turn: every `palette` examples ask each once
    answer_only: bool = False  # the prompt asks for the answer block alone (no <think>), as `answer_format` scores

    def __post_init__(self) -> None:
        for label, (lo, hi) in (
            ("frames", self.frames),
            ("height", self.height),
            ("text_tokens", self.text_tokens),
        ):
            if not 0 < lo <= hi:
                raise ValueError(f"preset {self.name}: {label} range {(lo, hi)} must satisfy 0 < low <= high")
        if not self.aspects or self.num_options < 2 or not self.questions:
            raise ValueError(f"preset {self.name}: needs an aspect ratio, two options and a question kind")
        if not 0 < self.objects[0] <= self.objects[1] <= self.palette:
            raise ValueError(f"preset {self.name}: objects {self.objects} need 0 < low <= high <= palette")
        if self.balanced and self.objects != (1, 1):
            raise ValueError(f"preset {self.name}: a balanced preset has one object per scene")

    def layout(self, seed: int, index: int) -> Layout:
        """The sizes of example `index`: a pure function of (seed, index)."""
        rng = np.random.default_rng([seed, index, 0x1A40])
        evens = np.arange(self.frames[0] + self.frames[0] % 2, self.frames[1] + 1, 2)
        num_frames = int(rng.choice(evens)) if len(evens) else self.frames[0]
        height = int(rng.integers(self.height[0], self.height[1] + 1))
        width = round(height * float(rng.choice(self.aspects)))
        text = int(rng.integers(self.text_tokens[0], self.text_tokens[1] + 1))
        return Layout(num_frames=num_frames, height=height, width=width, num_text_tokens=text)

    def frame_size(self, layout: Layout) -> tuple[int, int]:
        """Frame size after Qwen's smart resize."""
        return output_size(layout.height, layout.width, self.vision)

    def num_video_tokens(self, layout: Layout) -> int:
        t, h, w = grid_thw(layout.num_frames, *self.frame_size(layout), self.vision)
        return t * h * w // self.vision.merge_size**2

    def prompt_tokens(self, layout: Layout) -> int:
        """Prompt length the layout asks for: text, vision start/end, and one pad per visual token."""
        return layout.num_text_tokens + 2 + self.num_video_tokens(layout)

    def tiny(self) -> Preset:
        """The same workload at CPU-test scale: 2-4 frames of <= 84x84 px, responses / 16, same texts."""
        r = self.response
        return replace(
            self,
            name=f"{self.name}-tiny",
            frames=(2, 4),
            height=(56, 84),
            vision=replace(self.vision, min_pixels=56 * 56, max_pixels=84 * 84),
            response=LengthDistribution(max(2, r.median // 16), r.sigma, 1, max(4, r.high // 32)),
        )


def sample_response_lengths(preset: Preset, num_samples: int, seed: int) -> np.ndarray:
    """[num_samples] response lengths drawn from the preset's distribution (to force lengths in benchmarks)."""
    return preset.response.sample(num_samples, seed)


def _video(max_tokens: int) -> VisionSpec:
    return VisionSpec(min_pixels=16 * _PX, max_pixels=max_tokens * _PX)


PRESETS: dict[str, Preset] = {
    "clevrer": Preset(
        name="clevrer",
        frames=(8, 16),
        height=(320, 320),
        aspects=(1.5,),
        vision=_video(128),
        text_tokens=(100, 200),
        response=LengthDistribution(median=220, sigma=0.6, low=16, high=1024),
    ),
    "perception_test": Preset(
        name="perception_test",
        frames=(12, 20),
        height=(480, 1080),
        aspects=(16 / 9, 4 / 3),
        vision=_video(256),
        text_tokens=(150, 300),
        response=LengthDistribution(median=180, sigma=0.7, low=16, high=1536),
        num_options=3,
    ),
    "star": Preset(
        name="star",
        frames=(12, 24),
        height=(270, 480),
        aspects=(4 / 3, 16 / 9),
        vision=_video(192),
        text_tokens=(200, 350),
        response=LengthDistribution(median=200, sigma=0.7, low=16, high=1536),
    ),
    "llava_video": Preset(
        name="llava_video",
        frames=(40, 56),
        height=(360, 1080),
        aspects=(16 / 9, 4 / 3),
        vision=_video(256),
        text_tokens=(150, 300),
        response=LengthDistribution(median=150, sigma=1.0, low=8, high=2048),
    ),
    "colour": Preset(
        name="colour",
        frames=(8, 16),
        height=(320, 320),
        aspects=(1.5,),
        vision=_video(128),
        text_tokens=(1, 1),
        response=LengthDistribution(median=16, sigma=0.3, low=8, high=64),
        questions=(QuestionKind.COLOUR,),
        objects=(1, 1),
        palette=4,
        radius=(0.3, 0.4),
        balanced=True,
        answer_only=True,
    ),
}


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"unknown workload preset '{name}'; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]


def synthetic_preset(name: str) -> Preset:
    """The preset of a `synthetic:<preset>[@tiny]` dataset name (ValueError for a bad name or scale)."""
    preset_name, _, scale = name.removeprefix("synthetic:").partition("@")
    if scale not in ("", "tiny"):
        raise ValueError(f"dataset '{name}': unknown scale '@{scale}'; use '@tiny' or nothing")
    preset = get_preset(preset_name)
    return preset.tiny() if scale else preset
