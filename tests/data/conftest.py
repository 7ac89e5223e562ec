"""Fixtures shared by the data tests: a tiny Qwen-like tokenizer.json built here, and small video files."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pytest

QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
CORPUS = [
    "You are a helpful assistant.",
    "system\nuser\nassistant\n",
    "Which colour is the object that moves fastest? How many squares are in the video?",
    "Think inside <think> </think>, then give the final answer inside <answer> </answer>.",
    "The video shows simple shapes moving over a plain background. 0123456789",
]


@pytest.fixture(scope="session")
def tokenizer_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer.json with the Qwen special tokens, trained on a few sentences."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=QWEN_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    path = tmp_path_factory.mktemp("ckpt") / "tokenizer.json"
    tok.save(str(path))
    return path


def write_video(path: Path, num_frames: int = 16, height: int = 64, width: int = 96, fps: int = 8) -> Path:
    """An h264 (or mpeg4) video whose frame i has red level 15*i and a green bar at x = 5*i."""
    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(num_frames):
            frame = np.zeros((height, width, 3), np.uint8)
            frame[..., 0] = 15 * i
            frame[:, 5 * i : 5 * i + 10, 1] = 255
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path
