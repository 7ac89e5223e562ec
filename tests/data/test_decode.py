import math

import av
import numpy as np
import pytest

from rollplex.data.decode import FrameSampling, decode_video, sample_indices

from .conftest import write_video


@pytest.fixture(scope="module")
def video(tmp_path_factory):
    return write_video(tmp_path_factory.mktemp("video") / "clip.mp4", num_frames=16, fps=8)


def all_frames(path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def test_sampled_frames_equal_decoding_every_frame_and_indexing(video):
    everything = all_frames(video)
    for count in (1, 4, 7, 16):
        decoded = decode_video(video, FrameSampling(num_frames=count))
        expected = everything[np.linspace(0, 15, count).round().astype(int)]
        assert decoded.frames.dtype == np.uint8 and np.array_equal(decoded.frames, expected)


def test_the_decoded_frames_are_the_written_ones(video):
    frames = decode_video(video, FrameSampling(num_frames=4)).frames
    red = frames[:, 32, 80, 0].astype(int)  # frame i was written with red level 15 * i
    assert np.all(np.abs(red - 15 * np.array([0, 5, 10, 15])) <= 4)


def test_sampling_more_frames_than_the_video_has_repeats_frames(video):
    decoded = decode_video(video, FrameSampling(num_frames=20))
    assert decoded.frames.shape[0] == 20 and decoded.sampled_fps == 20 / 16 * 8


def test_rate_sampling_takes_duration_times_rate_frames(video):
    decoded = decode_video(video, FrameSampling(num_frames=None, fps=2.0))  # 2 s at 8 fps
    assert decoded.frames.shape[0] == 4 and decoded.sampled_fps == 2.0


def test_rate_sampling_is_clamped_to_min_frames_and_to_the_video():
    sampling = FrameSampling(num_frames=None, fps=0.5, min_frames=4)
    assert sampling.count(total_frames=16, video_fps=8.0) == 4
    assert FrameSampling(num_frames=None, fps=100.0).count(total_frames=16, video_fps=8.0) == 16


def smart_nframes(total: int, video_fps: float, fps: float, min_frames=4, max_frames=768, factor=2) -> int:
    """qwen-vl-utils' frame count of rate sampling, written out: clamp, then round down to the factor."""
    low, high = math.ceil(min_frames / factor) * factor, math.floor(min(max_frames, total) / factor) * factor
    return math.floor(min(min(max(total / video_fps * fps, low), high), total) / factor) * factor


@pytest.mark.parametrize("total, video_fps, fps", [(113, 30, 2), (45, 10, 2), (17, 8, 100), (300, 30, 1), (9, 1, 2)])
def test_rate_sampling_counts_frames_as_qwen_vl_utils(total, video_fps, fps):
    assert FrameSampling(num_frames=None, fps=fps).count(total, video_fps) == smart_nframes(total, video_fps, fps)


def test_indices_spread_over_the_whole_video():
    assert sample_indices(16, 4).tolist() == [0, 5, 10, 15]


def test_frame_sampling_needs_exactly_one_of_a_count_and_a_rate():
    with pytest.raises(ValueError, match="exactly one"):
        FrameSampling(num_frames=8, fps=2.0)
    with pytest.raises(ValueError, match="exactly one"):
        FrameSampling(num_frames=None)
