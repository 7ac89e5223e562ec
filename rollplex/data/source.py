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


def batch_at(dataset: Dataset, position: int, size: int) -> list[Example]:
    """`size` examples from data position `position`, wrapping around the dataset."""
    return [dataset[(position + i) % len(dataset)] for i in range(size)]
