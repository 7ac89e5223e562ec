"""The vision encoder equals transformers' Qwen2.5-VL vision tower (an unaligned MLP width stored padded too); its
windows partition every frame."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch
from models_testkit import hf_model_from_state
from safetensors import safe_open

from rollplex.models import attention
from rollplex.models import vision as vision_module
from rollplex.models.checkpoint import load_pretrained, save_checkpoint
from rollplex.models.chunks import drain
from rollplex.models.config import CONFIG_DIR
from rollplex.models.model import Qwen2_5_VL
from rollplex.models.rerun import Rerun
from rollplex.models.vision import pack_segments, segment_attention, segment_layout
from rollplex.models.vision_layout import patch_layout, segment_bounds, segment_groups, unit_positions, window_order


@pytest.mark.parametrize("packed", [False, True, "varlen"])
def test_vision_encoder_equals_transformers_on_an_image_and_a_video(model, inputs, packed, monkeypatch):
    if packed == "varlen":  # as on a GPU: in window order, each block's segments runs of consecutive patches
        model.model.visual.varlen = True
        calls = []
        real_varlen = vision_module.varlen_attention
        monkeypatch.setattr(vision_module, "varlen_attention", lambda *a: calls.append(1) or real_varlen(*a))
    elif packed:  # as on a GPU with cuDNN attention: each block's segments in one masked call, however padded
        monkeypatch.setattr(vision_module, "plans_per_shape", lambda device: True)
        monkeypatch.setattr(vision_module, "MAX_PACKING_WASTE", 100.0)
        calls = []
        real_packed = vision_module.packed_segment_attention
        monkeypatch.setattr(vision_module, "packed_segment_attention", lambda *a: calls.append(1) or real_packed(*a))
    visuals = [inputs.image((10, 6)), inputs.video((2, 12, 8), second_per_grid_t=2.0)]
    hf_visual = hf_model_from_state(model.state_dict()).model.visual
    grids = torch.tensor([visual.grid_thw for visual in visuals])
    with torch.no_grad():
        theirs = hf_visual(torch.cat([v.pixel_values for v in visuals]), grid_thw=grids).pooler_output
        ours = model.model.visual(visuals)
    assert (ours - theirs).abs().max() <= 1e-5
    if packed:
        assert len(calls) == model.config.vision.depth


def test_segment_attention_in_one_packed_call_equals_one_call_per_length(monkeypatch):
    monkeypatch.setattr(attention, "BUCKETS_PER_OCTAVE", 2)  # 17 segments run as 24 rows, lengths up to 4 as 4
    segment_ids = torch.cat([torch.arange(5).repeat_interleave(4), torch.arange(5, 8).repeat(3),
                             torch.arange(8, 17).repeat_interleave(2)])  # fmt: skip
    groups = segment_groups(segment_ids)
    assert sorted(g.shape[0] for g in groups) == [3, 5, 9]
    assert pack_segments(groups) is None  # 24 x 4 entries for 47 patches: over MAX_PACKING_WASTE
    monkeypatch.setattr(vision_module, "MAX_PACKING_WASTE", 2.5)
    packed = pack_segments(groups)
    assert packed.index.shape == (24, 4) and packed.sees.shape == (24, 1, 1, 4)
    assert torch.equal(packed.index.flatten()[packed.entry], torch.arange(segment_ids.numel()))  # each patch's own
    assert packed.entry.unique().numel() == segment_ids.numel()  # each patch has one entry of its own
    assert packed.index.flatten().bincount().max() <= 3  # the padding spreads over the patches
    assert packed.sees.any(dim=-1).all()  # every row, padding rows too, sees a key
    q, k, v = (torch.randn(segment_ids.numel(), 3, 8, requires_grad=True) for _ in range(3))
    outs = [segment_attention(q, k, v, layout) for layout in (groups, tuple(packed))]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    weights = torch.randn_like(outs[0])
    exact, padded = (torch.autograd.grad((out * weights).sum(), (q, k, v)) for out in outs)
    for ours, theirs in zip(padded, exact, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    autograd = torch.autograd.grad((_autograd_packed(q, k, v, packed) * weights).sum(), (q, k, v))
    for ours, theirs in zip(padded, autograd, strict=True):
        assert torch.equal(ours, theirs)  # the gathers' backward adds only the exact zeros torch's would


def _autograd_packed(q, k, v, packed):
    """The packed call with torch's own index_select backward (index_add over every entry, padding included)."""
    rows, width = packed.index.shape
    q_s, k_s, v_s = (x.index_select(0, packed.index.flatten()).view(rows, width, *x.shape[1:]).transpose(1, 2)
                     for x in (q, k, v))  # fmt: skip
    o = torch.nn.functional.scaled_dot_product_attention(q_s, k_s, v_s, attn_mask=packed.sees)
    return o.transpose(1, 2).reshape(rows * width, *q.shape[1:]).index_select(0, packed.entry)


def test_segments_are_packed_only_where_attention_plans_per_shape(monkeypatch):
    segment_ids = torch.arange(40).repeat_interleave(64)  # 40 windows: packed with no padding at all
    cpu = torch.device("cpu")
    assert segment_layout(segment_ids, cpu)[0].dtype == torch.long  # one group per length
    monkeypatch.setattr(vision_module, "plans_per_shape", lambda device: True)
    assert segment_layout(segment_ids, cpu)[0].dtype == torch.bool  # a PackedSegments: its mask first


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


def test_in_window_order_windows_and_frames_are_runs_and_merge_units_stay_whole(config):
    layout = patch_layout([(1, 10, 6), (2, 12, 8)], config.vision)
    order = window_order(layout)
    ordered = layout.take(order)
    for kind in ("windows", "frames"):
        groups = segment_groups(getattr(layout, kind))
        bounds, longest = segment_bounds(getattr(ordered, kind))
        runs = [set(order[start:end].tolist()) for start, end in itertools.pairwise(bounds.tolist())]
        assert sorted(map(sorted, runs)) == sorted(m.tolist() for g in groups for m in g)  # a run is a segment
        assert longest == max(g.shape[1] for g in groups)
    unit = config.vision.merge_unit
    units = order.view(-1, unit)
    assert torch.equal(units - units[:, :1], torch.arange(unit).expand_as(units))  # a unit's patches, in order
    assert (units[:, 0] % unit == 0).all()
    positions = unit_positions(order, unit)
    assert torch.equal(units[positions, 0] // unit, torch.arange(units.shape[0]))  # each unit found where it lies
    with pytest.raises(AssertionError, match="not runs"):
        segment_bounds(layout.windows)  # in the processor's order a window is not a run


def test_the_tower_takes_window_order_only_where_flash_attention_runs_it():
    cuda = torch.device("cuda")  # checked before any CUDA call: a machine without a GPU answers too
    assert not vision_module.runs_varlen(torch.device("cpu"), torch.bfloat16, 80)
    assert not vision_module.runs_varlen(cuda, torch.float32, 80)  # flash takes 16-bit floats only
    assert not vision_module.runs_varlen(cuda, torch.bfloat16, 84)  # nor a head dim off the multiples of 8
    torch.use_deterministic_algorithms(True)
    try:
        assert not vision_module.runs_varlen(cuda, torch.bfloat16, 80)  # its backward adds atomically
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("rerun", [None, Rerun()])
def test_the_tower_in_window_order_gives_the_same_tokens_and_gradients(model, inputs, rerun):
    visuals = [inputs.image((10, 6)), inputs.video((2, 12, 8), second_per_grid_t=2.0)]
    visual = model.model.visual
    results = []
    for varlen in (False, True):
        visual.varlen = varlen
        visual.zero_grad()
        out = drain(visual.chunks(visuals, 1, rerun))
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in visual.parameters()]))
    (plain, plain_grads), (ordered, ordered_grads) = results
    torch.testing.assert_close(ordered, plain, rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(ordered_grads, plain_grads, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)


def test_full_attention_segments_are_frames(config):
    layout = patch_layout([(1, 10, 6), (2, 12, 8)], config.vision)
    sizes = sorted(n for group in segment_groups(layout.frames) for n in [group.shape[1]] * group.shape[0])
    assert sizes == [60, 96, 96]


WIDTH = 60  # not a multiple of MLP_ALIGN: stored 64 wide, as 3B's and 7B's 3420 are stored 3456 wide


@pytest.fixture
def unaligned(config):
    """The tiny config with a vision MLP width that gets padded, and a random model of it."""
    padded = dataclasses.replace(config, vision=dataclasses.replace(config.vision, intermediate_size=WIDTH))
    torch.manual_seed(0)
    return padded, Qwen2_5_VL(padded)


def _hf_overrides():
    vision = json.loads((CONFIG_DIR / "tiny.json").read_text())["vision_config"]
    return {"vision_config": vision | {"intermediate_size": WIDTH}}


def test_an_unaligned_vision_mlp_is_stored_padded_and_still_equals_transformers(unaligned, inputs):
    config, model = unaligned
    mlp = model.model.visual.blocks[0].mlp
    assert config.vision.stored_intermediate_size == 64
    assert mlp.gate_proj.weight.shape[0] == 64 == mlp.down_proj.weight.shape[1]
    assert not mlp.gate_proj.weight[WIDTH:].any() and not mlp.down_proj.weight[:, WIDTH:].any()
    state = model.state_dict()
    assert state["model.visual.blocks.0.mlp.gate_proj.weight"].shape == (WIDTH, config.vision.hidden_size)
    assert state["model.visual.blocks.0.mlp.down_proj.weight"].shape == (config.vision.hidden_size, WIDTH)
    hf_visual = hf_model_from_state(state, _hf_overrides()).model.visual
    visuals = [inputs.image((10, 6)), inputs.video((2, 12, 8), second_per_grid_t=2.0)]
    grids = torch.tensor([visual.grid_thw for visual in visuals])
    with torch.no_grad():
        theirs = hf_visual(torch.cat([v.pixel_values for v in visuals]), grid_thw=grids).pooler_output
        ours = model.model.visual(visuals)
    assert (ours - theirs).abs().max() <= 1e-5


def test_the_padding_gets_zero_gradients_and_adamw_leaves_it_zero(unaligned, inputs):
    _, model = unaligned
    prompts = [inputs.prompt(2, inputs.video((2, 8, 8), second_per_grid_t=1.5), 3)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(2):
        model(prompts).float().pow(2).mean().backward()
        for block in model.model.visual.blocks:
            mlp = block.mlp
            for grad in (mlp.gate_proj.weight.grad[WIDTH:], mlp.up_proj.bias.grad[WIDTH:],
                         mlp.down_proj.weight.grad[:, WIDTH:]):  # fmt: skip
                assert torch.equal(grad, torch.zeros_like(grad))
            assert mlp.gate_proj.weight.grad[:WIDTH].abs().sum() > 0  # the real rows do learn
        optimizer.step()
        optimizer.zero_grad()
    for block in model.model.visual.blocks:
        assert not block.mlp.up_proj.weight[WIDTH:].any() and not block.mlp.down_proj.weight[:, WIDTH:].any()


def test_checkpoints_of_a_padded_vision_mlp_hold_transformers_shapes_and_load_back(unaligned, tmp_path):
    config, model = unaligned
    save_checkpoint(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("model.visual.blocks.1.mlp.up_proj.weight").get_shape() == [WIDTH, config.vision.hidden_size]
    loaded = load_pretrained(tmp_path, dtype=torch.float32)  # built on uninitialised memory: padding zeroed
    for (name, a), (_, b) in zip(model.named_parameters(), loaded.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    again = Qwen2_5_VL(loaded.config)
    again.load_state_dict(model.state_dict())  # transformers' shapes are padded on the way in
    again.load_state_dict({n: p.detach() for n, p in model.named_parameters()})  # stored shapes pass as they are
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.usefixtures("cudnn_attention")
def test_on_a_gpu_the_packed_vision_attention_runs_on_cudnn_equals_one_call_per_length_and_stays_finite():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    windows = torch.cat([torch.arange(54).repeat_interleave(64), torch.arange(54, 61).repeat_interleave(48)])
    groups = [g.cuda() for g in segment_groups(windows)]  # 54 windows of 64 and 7 of 48: 61 rows run as 62
    layout = segment_layout(windows, torch.device("cuda"))
    assert layout[0].dtype == torch.bool and layout[1].shape == (62, 64)  # a padding row: the NaN guard runs
    q, k, v = (torch.randn(windows.numel(), 16, 80, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    outs = [segment_attention(q, k, v, groups)]
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):  # cuDNN must take the [rows, 1, 1, width] mask at head dim 80
        outs.append(segment_attention(q, k, v, layout))
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-3)  # cuDNN vs another kernel: 1 bf16 ulp
    exact, packed = (torch.autograd.grad(out.float().square().sum(), (q, k, v)) for out in outs)
    for ours, theirs in zip(packed, exact, strict=True):
        assert torch.isfinite(ours).all()
        torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.usefixtures("nondeterministic")
def test_on_a_gpu_varlen_vision_attention_equals_one_call_per_length():
    torch.manual_seed(0)
    device = torch.device("cuda")
    assert vision_module.runs_varlen(device, torch.bfloat16, 80)
    windows = torch.cat([torch.arange(54).repeat_interleave(64), torch.arange(54, 61).repeat_interleave(48)])
    groups = [g.cuda() for g in segment_groups(windows)]
    segments = vision_module.varlen_segments(windows, device)
    q, k, v = (torch.randn(windows.numel(), 16, 80, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    outs = [segment_attention(q, k, v, layout) for layout in (groups, segments)]
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-3)
    exact, varlen = (torch.autograd.grad(out.float().square().sum(), (q, k, v)) for out in outs)
    for ours, theirs in zip(varlen, exact, strict=True):
        assert torch.isfinite(ours).all()
        torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2)
