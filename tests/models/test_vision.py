"""The vision encoder equals transformers' Qwen2.5-VL vision tower; its windows partition every frame."""

from __future__ import annotations

import torch
from models_testkit import hf_model_from_state

from rollplex.models.vision_layout import patch_layout, segment_groups


def test_vision_encoder_equals_transformers_on_an_image_and_a_video(model, inputs):
    visuals = [inputs.image((10, 6)), inputs.video((2, 12, 8), second_per_grid_t=2.0)]
    hf_visual = hf_model_from_state(model.state_dict()).model.visual
    grids = torch.tensor([visual.grid_thw for visual in visuals])
    with torch.no_grad():
        theirs = hf_visual(torch.cat([v.pixel_values for v in visuals]), grid_thw=grids).pooler_output
        ours = model.model.visual(visuals)
    assert (ours - theirs).abs().max() <= 1e-5


def test_windows_partition_each_frame_into_squares_of_merge_units(config):
    grids = [(1, 10, 6), (2, 12, 8)]  # in merge units: 5 x 3 (ragged windows), 2 frames of 6 x 4
    layout = patch_layout(grids, config.vision)
    groups = segment_groups(layout.windows)
    members = torch.cat([group.flatten() for group in groups])
    assert torch.equal(members.sort().values, torch.arange(10 * 6 + 2 * 12 * 8))
    side = config.vision.window_size // config.vision.patch_size  # in patches
    for group in groups:
        assert (layout.frames[group] == layout.frames[group[:, :1]]).all()
        assert (layout.rows[group].amax(1) - layout.rows[group].amin(1) < side).all()
        assert (layout.cols[group].amax(1) - layout.cols[group].amin(1) < side).all()
    assert sum(group.shape[0] for group in groups) == 3 * 2 + 2 * 3 * 2


def test_full_attention_segments_are_frames(config):
    layout = patch_layout([(1, 10, 6), (2, 12, 8)], config.vision)
    sizes = sorted(n for group in segment_groups(layout.frames) for n in [group.shape[1]] * group.shape[0])
    assert sizes == [60, 96, 96]
