"""The spec's `workload.dataset` -> a dataset of `Example`s indexed by data position.

`synthetic:<preset>` (clevrer, perception_test, star, llava_video), `synthetic:<preset>@tiny` for its
CPU-scale version, or a path to a Video-R1-style JSON / JSONL file (relative to the spec).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from rollplex.data.presets import synthetic_preset
from rollplex.data.synthetic import SyntheticVideoQA
from rollplex.data.tokenizer import Tokenizer
from rollplex.data.types import Example
from rollplex.data.video_r1 import VideoR1Dataset
from rollplex.graph.spec_files import dataset_file

SYNTHETIC_SIZE = 1 << 20  # examples are made on demand from (seed, index)


class Dataset(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, index: int) -> Example: ...


def open_dataset(
    name: str, tokenizer: Tokenizer, seed: int, base: Path | None = None, mismatch_videos: bool = False
) -> Dataset:
    """`mismatch_videos` (synthetic only): the control whose questions are shown another example's video."""
    if name.startswith("synthetic:"):
        preset = synthetic_preset(name)
        return SyntheticVideoQA(
            preset, tokenizer, seed=seed, num_examples=SYNTHETIC_SIZE, mismatch_videos=mismatch_videos
        )
    return VideoR1Dataset(dataset_file(name, base), tokenizer)


class HeldOut:
    """Examples `start` .. `start + size - 1` of `dataset`, as examples 0 .. size - 1."""

    def __init__(self, dataset: Dataset, start: int, size: int) -> None:
        if start + size > len(dataset):
            raise ValueError(f"{size} held-out examples asked for, and the file has {len(dataset) - start}")
        self.dataset, self.start, self.size = dataset, start, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Example:
        if not 0 <= index < self.size:
            raise IndexError(f"held-out example {index} out of range [0, {self.size})")
        return self.dataset[self.start + index]


def open_held_out(
    name: str, tokenizer: Tokenizer, seed: int, size: int, base: Path | None = None, mismatch_videos: bool = False
) -> HeldOut:
    """`size` examples no run trains on: a synthetic preset's past SYNTHETIC_SIZE (a training run wraps around
    before them; the same seed draws them), or a file's first `size` rows (a held-out file)."""
    if name.startswith("synthetic:"):
        preset = synthetic_preset(name)
        every = SyntheticVideoQA(
            preset, tokenizer, seed=seed, num_examples=SYNTHETIC_SIZE + size, mismatch_videos=mismatch_videos
        )
        return HeldOut(every, SYNTHETIC_SIZE, size)
    return HeldOut(VideoR1Dataset(dataset_file(name, base), tokenizer), 0, size)


def batch_at(dataset: Dataset, position: int, size: int) -> list[Example]:
    """`size` examples from data position `position`, wrapping around the dataset."""
    return [dataset[(position + i) % len(dataset)] for i in range(size)]
