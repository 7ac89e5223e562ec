"""Test kit of the models tests: tiny prompts, and transformers' Qwen2.5-VL as the oracle."""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass

import torch

from rollplex.models.config import CONFIG_DIR, ModelConfig
from rollplex.models.inputs import Prompt, Visual
from rollplex.models.positions import num_visual_tokens

FIRST_TEXT_ID = 8  # ids below are special tokens in the tiny config


@dataclass(frozen=True)
class TinyInputs:
    """Builds prompts: ints are runs of random text tokens, visuals are wrapped in vision start/end tokens."""

    config: ModelConfig
    generator: torch.Generator

    def image(self, grid_hw: tuple[int, int]) -> Visual:
        return Visual(self._pixels((1, *grid_hw)), (1, *grid_hw), is_video=False)

    def video(self, grid_thw: tuple[int, int, int], second_per_grid_t: float) -> Visual:
        return Visual(self._pixels(grid_thw), grid_thw, is_video=True, second_per_grid_t=second_per_grid_t)

    def text(self, num_tokens: int) -> torch.Tensor:
        return torch.randint(FIRST_TEXT_ID, self.config.text.vocab_size, (num_tokens,), generator=self.generator)

    def prompt(self, *parts: int | Visual) -> Prompt:
        ids = [self.text(part) if isinstance(part, int) else self._visual_ids(part) for part in parts]
        return Prompt(torch.cat(ids), tuple(part for part in parts if isinstance(part, Visual)))

    def _visual_ids(self, visual: Visual) -> torch.Tensor:
        tokens = self.config.tokens
        pad = tokens.video if visual.is_video else tokens.image
        inner = [pad] * num_visual_tokens(visual, self.config.vision)
        return torch.tensor([tokens.vision_start, *inner, tokens.vision_end])

    def _pixels(self, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        vision = self.config.vision
        width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        t, h, w = grid_thw
        return torch.randn(t * h * w, width, generator=self.generator)


def hf_model_from_state(state: dict[str, torch.Tensor], hf_config_overrides: dict | None = None) -> torch.nn.Module:
    """transformers' Qwen2.5-VL built from the tiny config file, holding the given weights."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = json.loads((CONFIG_DIR / "tiny.json").read_text()) | (hf_config_overrides or {})
    hf_model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**config))
    hf_model.load_state_dict(state, strict=True)
    return hf_model.eval()


def hf_inputs(prompts: list[Prompt], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The keyword arguments of transformers' Qwen2.5-VL forward for right-padded prompts."""
    lens = [p.num_tokens for p in prompts]
    input_ids = torch.zeros(len(prompts), max(lens), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, : prompt.num_tokens] = prompt.input_ids
    mask = torch.arange(max(lens)) < torch.tensor(lens)[:, None]
    kwargs = {"input_ids": input_ids, "attention_mask": mask.long()}
    visuals = [v for p in prompts for v in p.visuals]
    for key, is_video in (("", False), ("_videos", True)):
        chosen = [v for v in visuals if v.is_video == is_video]
        if chosen:
            kwargs[f"pixel_values{key}"] = torch.cat([v.pixel_values for v in chosen])
            kwargs["video_grid_thw" if is_video else "image_grid_thw"] = torch.tensor([v.grid_thw for v in chosen])
    if any(v.is_video for v in visuals):
        kwargs["second_per_grid_ts"] = torch.tensor([v.second_per_grid_t for v in visuals if v.is_video])
    kwargs["mm_token_type_ids"] = (input_ids == config.tokens.image) * 1 + (input_ids == config.tokens.video) * 2
    return kwargs


def hf_logits(hf_model: torch.nn.Module, prompts: list[Prompt], config: ModelConfig) -> torch.Tensor:
    kwargs = hf_inputs(prompts, config)
    if "mm_token_type_ids" not in inspect.signature(hf_model.forward).parameters:
        del kwargs["mm_token_type_ids"]  # older transformers find visuals from the vision start tokens
    with torch.no_grad():
        return hf_model(**kwargs).logits
