"""Multimodal rotary position ids follow Qwen2.5-VL's rule (checked by hand on tiny prompts)."""

from __future__ import annotations

import pytest
import torch

from rollplex.models.positions import sequence_positions


def test_text_only_positions_count_up_on_all_three_axes(inputs, config):
    positions, next_position = sequence_positions(inputs.text(5), (), config)
    assert torch.equal(positions, torch.arange(5).expand(3, 5))
    assert next_position == 5


def test_an_image_is_a_grid_of_rows_and_columns_after_the_text_before_it(inputs, config):
    prompt = inputs.prompt(2, inputs.image((4, 6)), 1)  # text, text, start, 2 x 3 image tokens, end, text
    positions, next_position = sequence_positions(prompt.input_ids, prompt.visuals, config)
    image = positions[:, 3:9]
    assert image.tolist() == [[3] * 6, [3, 3, 3, 4, 4, 4], [3, 4, 5, 3, 4, 5]]
    assert positions[:, 9:].tolist() == [[6, 7]] * 3
    assert next_position == 8


def test_video_frames_are_spaced_by_tokens_per_second_times_second_per_grid_t(inputs, config):
    prompt = inputs.prompt(inputs.video((3, 4, 4), second_per_grid_t=0.75))  # step 2 * 0.75 = 1.5
    positions, _ = sequence_positions(prompt.input_ids, prompt.visuals, config)
    assert positions[0, 1:13].unique().tolist() == [1, 2, 4]  # 1 + floor(0, 1.5, 3.0)


def test_text_after_a_video_continues_after_its_largest_temporal_position(inputs, config):
    prompt = inputs.prompt(inputs.video((3, 4, 4), second_per_grid_t=2.0))  # temporal 1, 5, 9; rows 1..2
    positions, next_position = sequence_positions(prompt.input_ids, prompt.visuals, config)
    assert positions[:, -1].tolist() == [10, 10, 10]  # the vision end token
    assert next_position == 11


def test_visual_tokens_and_visuals_must_match(inputs, config):
    prompt = inputs.prompt(2, inputs.image((4, 4)), 2)
    with pytest.raises(ValueError, match="no visual"):
        sequence_positions(prompt.input_ids, (), config)
    with pytest.raises(ValueError, match="visuals"):
        sequence_positions(inputs.text(4), prompt.visuals, config)
