"""The full forward equals transformers' Qwen2_5_VLForConditionalGeneration with the same weights."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from models_testkit import hf_logits, hf_model_from_state

from rollplex.models.model import INIT_STD, Qwen2_5_VL

TOLERANCE = 1e-4


def assert_logits_match(model: Qwen2_5_VL, hf_model: torch.nn.Module, prompts: list) -> None:
    ours = model(prompts).detach()
    theirs = hf_logits(hf_model, prompts, model.config)
    for row, prompt in enumerate(prompts):
        length = prompt.num_tokens
        assert (ours[row, :length] - theirs[row, :length]).abs().max() <= TOLERANCE


@pytest.fixture
def hf_model(model):
    return hf_model_from_state(model.state_dict())


def test_parameter_names_are_transformers_names(model, hf_model):
    assert set(model.state_dict()) == set(hf_model.state_dict())
    for name, tensor in hf_model.state_dict().items():
        assert model.state_dict()[name].shape == tensor.shape, name


def test_image_prompt_logits_equal_transformers(model, hf_model, inputs):
    prompts = [inputs.prompt(3, inputs.image((10, 6)), 5)]
    assert_logits_match(model, hf_model, prompts)


def test_video_prompt_logits_equal_transformers(model, hf_model, inputs):
    prompts = [inputs.prompt(2, inputs.video((2, 12, 8), second_per_grid_t=2.0), 4)]
    assert_logits_match(model, hf_model, prompts)


def test_right_padded_batch_logits_equal_transformers_row_by_row(model, hf_model, inputs):
    # whole seconds: transformers 5.17 truncates a fractional second_per_grid_t (test_positions covers those)
    prompts = [
        inputs.prompt(2, inputs.video((2, 8, 8), second_per_grid_t=1.0), 3),
        inputs.prompt(4, inputs.image((4, 6)), 9),
        inputs.prompt(6),
    ]
    assert_logits_match(model, hf_model, prompts)


def test_tied_embeddings_share_one_weight_and_match_transformers(config, inputs):
    text = dataclasses.replace(config.text, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2_5_VL(dataclasses.replace(config, text=text))
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    hf_model = hf_model_from_state(model.state_dict(), {"tie_word_embeddings": True})
    assert_logits_match(model, hf_model, [inputs.prompt(3, inputs.image((4, 4)), 2)])


def test_random_weights_are_initialised_as_transformers_does(config, inputs):
    # torch's default N(0, 1) embedding, tied as the LM head, gave one-hot predictions: zero entropy and zero
    # gradients in every random-weight benchmark; HF's init (N(0, 0.02)) keeps predictions near uniform
    text = dataclasses.replace(config.text, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2_5_VL(dataclasses.replace(config, text=text))
    for name, p in model.named_parameters():
        if p.ndim == 1:  # biases zero, norms one
            assert (p == float(not name.endswith("bias"))).all(), name
        else:
            assert abs(float(p.detach().std()) - INIT_STD) < 0.2 * INIT_STD, name
    logprobs = torch.log_softmax(model([inputs.prompt(3, inputs.image((4, 4)), 2)])[0, -1].detach(), dim=-1)
    assert float(-(logprobs.exp() * logprobs).sum()) > 0.95 * math.log(text.vocab_size)


def test_bfloat16_model_runs_and_stays_close_to_float32(model, inputs):
    prompts = [inputs.prompt(3, inputs.image((4, 4)), 2)]
    low = Qwen2_5_VL(model.config, dtype=torch.bfloat16)
    low.load_state_dict(model.state_dict())
    assert low.lm_head.weight.dtype == torch.bfloat16
    assert (low(prompts).float() - model(prompts)).abs().max() < 0.1


def test_meta_device_model_allocates_nothing(config):
    model = Qwen2_5_VL(config, device="meta")
    assert all(p.is_meta for p in model.parameters())


def test_a_bf16_model_is_built_in_bf16_not_cast_from_fp32(config, monkeypatch):
    made = []
    original = torch.nn.Linear.reset_parameters
    monkeypatch.setattr(
        torch.nn.Linear, "reset_parameters", lambda self: (made.append(self.weight.dtype), original(self))
    )
    Qwen2_5_VL(config, dtype=torch.bfloat16)
    assert made and set(made) == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # restored
