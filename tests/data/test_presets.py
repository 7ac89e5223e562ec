import numpy as np
import pytest

from rollplex.data.presets import PRESETS, get_preset, sample_response_lengths

# Median prompt tokens we aim for (the paper: 470-5,900 at the median over the four tasks).
PROMPT_MEDIAN_RANGES = {
    "clevrer": (500, 1500),
    "perception_test": (1500, 3000),
    "star": (1000, 2500),
    "llava_video": (5500, 6300),
}


def median_prompt(name: str, num: int = 400) -> float:
    preset = PRESETS[name]
    return float(np.median([preset.prompt_tokens(preset.layout(0, i)) for i in range(num)]))


@pytest.mark.parametrize("name", list(PROMPT_MEDIAN_RANGES))
def test_median_prompt_lengths_land_in_the_range_shaped_on_the_paper(name):
    lo, hi = PROMPT_MEDIAN_RANGES[name]
    assert lo <= median_prompt(name) <= hi


@pytest.mark.parametrize("name", list(PROMPT_MEDIAN_RANGES))
def test_prompt_fraction_at_the_median_is_within_the_papers_79_to_98_percent(name):
    prompt = median_prompt(name)
    response = float(np.median(sample_response_lengths(PRESETS[name], 4000, seed=0)))
    assert 0.79 <= prompt / (prompt + response) <= 0.98


@pytest.mark.parametrize("name", list(PROMPT_MEDIAN_RANGES))
def test_response_lengths_are_long_tailed_and_clipped_to_the_budget(name):
    dist = PRESETS[name].response
    lengths = sample_response_lengths(PRESETS[name], 20000, seed=1)
    assert lengths.dtype == np.int64 and lengths.min() >= dist.low and lengths.max() <= dist.high
    assert abs(np.median(lengths) - dist.median) <= 0.05 * dist.median
    assert np.mean(lengths) > np.median(lengths)  # right-skewed
    assert np.percentile(lengths, 99) > 2.5 * np.median(lengths)


def test_llava_video_responses_reach_the_2k_budget():
    lengths = sample_response_lengths(PRESETS["llava_video"], 20000, seed=0)
    assert lengths.max() == 2048


def test_response_lengths_are_a_pure_function_of_the_seed():
    preset = PRESETS["star"]
    assert np.array_equal(sample_response_lengths(preset, 64, 7), sample_response_lengths(preset, 64, 7))
    assert not np.array_equal(sample_response_lengths(preset, 64, 7), sample_response_lengths(preset, 64, 8))


@pytest.mark.parametrize("name", list(PRESETS))
def test_layouts_are_deterministic_and_within_the_preset_ranges(name):
    preset = PRESETS[name]
    for i in range(50):
        layout = preset.layout(3, i)
        assert layout == preset.layout(3, i)
        assert preset.frames[0] <= layout.num_frames <= preset.frames[1] and layout.num_frames % 2 == 0
        assert preset.height[0] <= layout.height <= preset.height[1]
        assert preset.text_tokens[0] <= layout.num_text_tokens <= preset.text_tokens[1]
        h, w = preset.frame_size(layout)
        assert h * w <= preset.vision.max_pixels and h % 28 == 0 and w % 28 == 0


@pytest.mark.parametrize("name", list(PRESETS))
def test_a_tiny_preset_has_few_visual_tokens_and_short_responses(name):
    tiny = PRESETS[name].tiny()
    for i in range(20):
        layout = tiny.layout(0, i)
        assert layout.num_frames in (2, 4)
        assert tiny.num_video_tokens(layout) <= 2 * 9
    assert tiny.response.high <= 64


def test_an_unknown_preset_name_lists_the_choices():
    with pytest.raises(ValueError, match="clevrer, perception_test, star, llava_video"):
        get_preset("kinetics")
