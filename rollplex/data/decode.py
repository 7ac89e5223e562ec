"""Video files -> sampled RGB frames, with PyAV.

Frame sampling follows qwen-vl-utils (what Video-R1 uses): a fixed number of frames, or a rate in frames per
second, taken at `round(linspace(0, total - 1, n))`; the frame count of rate sampling is clamped to its bounds and
then rounded down to a multiple of the temporal patch, as `smart_nframes` does. Only the selected frames are
converted to RGB, so long videos cost decode time but not memory. This module does not resize or normalise (see
`video`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class FrameSampling:
    """Exactly one of `num_frames` (a fixed count) or `fps` (a rate, clamped to [min_frames, max_frames])."""

    num_frames: int | None = 16
    fps: float | None = None
    min_frames: int = 4
    max_frames: int = 768
    frame_factor: int = 2

    def __post_init__(self) -> None:
        if (self.num_frames is None) == (self.fps is None):
            raise ValueError(f"give exactly one of num_frames and fps, got {self.num_frames} and {self.fps}")
        if self.num_frames is not None and self.num_frames <= 0:
            raise ValueError(f"num_frames must be positive, got {self.num_frames}")
        if self.fps is not None and self.fps <= 0:
            raise ValueError(f"fps must be positive, got {self.fps}")

    def count(self, total_frames: int, video_fps: float) -> int:
        """How many frames to sample from a video of `total_frames` at `video_fps`."""
        if self.num_frames is not None:
            return self.num_frames
        f = self.frame_factor
        wanted = total_frames / video_fps * self.fps
        low = -(-self.min_frames // f) * f
        high = max(f, min(self.max_frames, total_frames) // f * f)
        return max(f, int(min(max(wanted, low), high, total_frames) // f) * f)  # clamped, then floored


def sample_indices(total_frames: int, count: int) -> np.ndarray:
    """[count] frame indices spread evenly over the video, first and last included (repeats if short)."""
    return np.linspace(0, total_frames - 1, count).round().astype(np.int64)


@dataclass(frozen=True)
class DecodedVideo:
    frames: np.ndarray  # [T, H, W, 3] uint8
    sampled_fps: float  # frames per second of video time among the sampled frames


def decode_video(path: str | Path, sampling: FrameSampling) -> DecodedVideo:
    """Decodes the sampled frames of the first video stream of `path` (raises av's errors as they come)."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        video_fps = float(stream.average_rate or stream.guessed_rate or 1.0)
        total = stream.frames or _count_packets(path)
    if total <= 0:
        raise ValueError(f"video {path} has no frames")
    count = sampling.count(total, video_fps)
    indices = sample_indices(total, count)
    frames = _decode_at(path, indices)
    return DecodedVideo(frames=frames, sampled_fps=count / total * video_fps)


def _count_packets(path: str | Path) -> int:
    import av

    with av.open(str(path)) as container:
        return sum(packet.size > 0 for packet in container.demux(video=0))


def _decode_at(path: str | Path, indices: np.ndarray) -> np.ndarray:
    """RGB frames at `indices` (sorted, repeats allowed); missing tail frames repeat the last decoded one."""
    import av

    wanted = set(indices.tolist())
    picked: dict[int, np.ndarray] = {}
    last = None
    with av.open(str(path)) as container:
        for i, frame in enumerate(container.decode(video=0)):
            if i > indices[-1]:
                break
            if i in wanted:
                picked[i] = last = frame.to_ndarray(format="rgb24")
    if last is None:
        raise ValueError(f"video {path} decoded to no frames")
    return np.stack([picked.get(i, last) for i in indices.tolist()])
