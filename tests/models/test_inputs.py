"""`back_to_back` and `pixels_of`: a step's patches in one host tensor, read by the prefixes without a copy."""

from __future__ import annotations

import pytest
import torch

from rollplex.models.inputs import back_to_back, pixels_of


def test_back_to_back_keeps_every_patch_and_lays_them_out_one_after_another(prompts):
    staged = back_to_back(prompts, pin=False)
    visuals = [v for p in prompts for v in p.visuals]
    laid = [v for p in staged for v in p.visuals]
    assert len(visuals) == len(laid) >= 2 and [p.input_ids for p in staged] == [p.input_ids for p in prompts]
    storage = laid[0].pixel_values.untyped_storage().data_ptr()
    offset = 0
    for before, after in zip(visuals, laid, strict=True):
        assert torch.equal(before.pixel_values, after.pixel_values) and after.grid_thw == before.grid_thw
        assert after.pixel_values.untyped_storage().data_ptr() == storage
        assert after.pixel_values.storage_offset() == offset
        offset += after.pixel_values.numel()


def test_pixels_of_a_run_of_staged_visuals_is_a_view_and_of_others_a_copy(prompts):
    laid = [v for p in back_to_back(prompts, pin=False) for v in p.visuals]
    run = pixels_of(laid)
    assert run.untyped_storage().data_ptr() == laid[0].pixel_values.untyped_storage().data_ptr()
    assert torch.equal(run, torch.cat([v.pixel_values for v in laid]))
    swapped = pixels_of(laid[::-1])  # not back to back in this order: concatenated
    assert swapped.untyped_storage().data_ptr() != run.untyped_storage().data_ptr()
    assert torch.equal(swapped, torch.cat([v.pixel_values for v in laid[::-1]]))


def test_prompts_without_visuals_are_returned_as_they_are(inputs):
    text = [inputs.prompt(5), inputs.prompt(3)]
    assert back_to_back(text, pin=False) == text


def test_the_prefix_of_staged_prompts_is_the_prefix_of_the_prompts(model, prompts):
    staged = back_to_back(prompts, pin=False)
    for a, b in zip(model.prefix(prompts, attached=False).keys, model.prefix(staged, attached=False).keys, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_staged_patches_are_pinned_and_copied_from_where_they_lie(model, prompts):
    laid = [v for p in back_to_back(prompts, pin=True) for v in p.visuals]
    assert all(v.pixel_values.is_pinned() for v in laid)
    run = pixels_of(laid)
    assert run.is_pinned()
    gpu = model.to("cuda")
    assert torch.equal(gpu.model.visual(laid).cpu(), gpu.model.visual([v for p in prompts for v in p.visuals]).cpu())
