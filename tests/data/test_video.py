import sys
import types

import numpy as np
import pytest
import torch
from transformers.image_utils import SizeDict
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from rollplex.data.video import VisionSpec, preprocess_image, preprocess_video, smart_resize

SIZES = [(100, 150), (28, 28), (57, 300), (480, 640), (33, 41), (720, 1280)]


def frames_of(num: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (num, height, width, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def hf_video_patchify():
    """transformers' Qwen2VLVideoProcessor.patchify (pure torch).

    The video processor module imports torchvision at the top for its resize, and torchvision cannot be
    installed here; we import the module with empty stand-ins for the torchvision modules (transformers
    is imported first, so its cached availability checks stay False), take `patchify`, and remove them.
    """
    import transformers  # noqa: F401  (its torchvision checks run, and are cached, without the stand-ins)

    names = [
        "torchvision",
        "torchvision.transforms",
        "torchvision.transforms.v2",
        "torchvision.transforms.v2.functional",
    ]
    stubs = {n: types.ModuleType(n) for n in names if n not in sys.modules}
    sys.modules.update(stubs)
    try:
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    finally:
        for name in stubs:
            del sys.modules[name]
    return Qwen2VLVideoProcessor.patchify


def hf_resized_normalized(frames: np.ndarray, spec: VisionSpec) -> torch.Tensor:
    """[T, C, H, W] float32 frames resized, rescaled and normalised by the transformers PIL processor."""
    hf = Qwen2VLImageProcessorPil(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
    size = SizeDict(shortest_edge=spec.min_pixels, longest_edge=spec.max_pixels)
    out = []
    for frame in frames:
        x = hf.process_image(frame, do_convert_rgb=True)
        x = hf.resize(x, size=size, resample=hf.resample, factor=spec.factor)
        x = hf.normalize(hf.rescale(x, hf.rescale_factor), hf.image_mean, hf.image_std)
        out.append(torch.from_numpy(np.asarray(x, dtype=np.float32)))
    return torch.stack(out)


def test_smart_resize_matches_transformers():
    rng = np.random.default_rng(0)
    for _ in range(500):
        h, w = (int(v) for v in rng.integers(10, 3000, size=2))
        lo = int(rng.integers(1, 200)) * 28 * 28
        hi = lo + int(rng.integers(0, 2000)) * 28 * 28
        assert smart_resize(h, w, 28, lo, hi) == hf_smart_resize(h, w, 28, lo, hi)


def test_image_pixels_equal_the_transformers_pil_image_processor_exactly():
    spec = VisionSpec.for_images()
    hf = Qwen2VLImageProcessorPil()
    for i, (h, w) in enumerate(SIZES):
        image = frames_of(1, h, w, seed=i)[0]
        ref = hf(images=[image], return_tensors="pt")
        ours = preprocess_image(image, spec)
        assert ours.grid_thw == tuple(ref["image_grid_thw"][0].tolist())
        assert torch.equal(ours.pixel_values, ref["pixel_values"]), (h, w)
        assert ours.is_video is False


def test_image_pixels_match_with_custom_pixel_bounds():
    spec = VisionSpec(min_pixels=56 * 56, max_pixels=84 * 84)
    hf = Qwen2VLImageProcessorPil(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
    image = frames_of(1, 300, 200)[0]
    ref = hf(images=[image], return_tensors="pt")
    ours = preprocess_image(image, spec)
    assert torch.equal(ours.pixel_values, ref["pixel_values"])


@pytest.mark.parametrize("num_frames", [4, 5, 1])
def test_video_pixels_equal_transformers_video_patchify_of_pil_processed_frames(num_frames, hf_video_patchify):
    """Oracle: frames resized/rescaled/normalised by the transformers PIL image processor's own methods, then
    patched by the transformers video processor's `patchify` (which pads odd frame counts by repeating the
    last frame). The real video processor resizes with torchvision (not installable here), whose bicubic
    differs from PIL's in rounding: on that path the pixels agree only approximately."""
    spec = VisionSpec(min_pixels=56 * 56, max_pixels=112 * 168)
    frames = frames_of(num_frames, 90, 170, seed=num_frames)
    ref_frames = hf_resized_normalized(frames, spec)
    ref, gt, gh, gw = hf_video_patchify(None, ref_frames[None], spec.patch_size, spec.merge_size, 2)
    ours = preprocess_video(frames, spec, fps=2.0)
    assert ours.grid_thw == (gt, gh, gw)
    assert torch.equal(ours.pixel_values, ref[0])


def test_video_rows_interleave_the_image_processor_rows_of_each_frame_pair():
    """A second oracle without stand-ins: the image processor patches each frame alone (repeating it over
    the temporal patch); the video row of frames (2k, 2k+1) takes, per channel, one of each."""
    spec = VisionSpec.for_images()
    frames = frames_of(4, 64, 100)
    hf = Qwen2VLImageProcessorPil()
    per_frame = [hf(images=[f], return_tensors="pt")["pixel_values"].reshape(-1, 3, 2, 14, 14) for f in frames]
    expected = torch.cat(
        [torch.stack([per_frame[2 * k][:, :, 0], per_frame[2 * k + 1][:, :, 0]], dim=2) for k in range(2)]
    ).reshape(-1, 3 * 2 * 14 * 14)
    assert torch.equal(preprocess_video(frames, spec).pixel_values, expected)


def test_an_image_is_a_one_frame_video():
    spec = VisionSpec.for_images()
    image = frames_of(1, 70, 90)[0]
    as_video = preprocess_video(image[None], spec)
    as_image = preprocess_image(image, spec)
    assert torch.equal(as_video.pixel_values, as_image.pixel_values)
    assert as_video.grid_thw == as_image.grid_thw and as_video.grid_thw[0] == 1


def test_a_target_size_resizes_to_exactly_that_size():
    spec = VisionSpec()
    out = preprocess_video(frames_of(2, 100, 100), spec, size=(56, 112))
    assert out.grid_thw == (1, 4, 8)
    assert out.pixel_values.shape == (32, spec.patch_dim) and out.pixel_values.dtype == torch.float32


def test_a_target_size_off_the_28_pixel_grid_is_rejected():
    with pytest.raises(ValueError, match="multiples of 28"):
        preprocess_video(frames_of(2, 100, 100), VisionSpec(), size=(50, 112))


def test_second_per_grid_t_is_the_temporal_patch_over_the_sampling_rate():
    assert preprocess_video(frames_of(4, 56, 56), VisionSpec(), fps=4.0).second_per_grid_t == 0.5


def test_frames_that_are_not_rgb_uint8_are_rejected():
    with pytest.raises(ValueError, match="uint8"):
        preprocess_video(np.zeros((2, 56, 56, 3), np.float32), VisionSpec())
    with pytest.raises(ValueError, match=r"\[T>0, H, W, 3\]"):
        preprocess_video(np.zeros((2, 56, 56), np.uint8), VisionSpec())


def test_pixel_bounds_must_be_ordered():
    with pytest.raises(ValueError, match="min_pixels <= max_pixels"):
        VisionSpec(min_pixels=100, max_pixels=10)
