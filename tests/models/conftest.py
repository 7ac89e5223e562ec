"""Fixtures of the models tests: the shipped tiny config, a seeded random-weight model, prompt builders."""

from __future__ import annotations

import pytest
import torch
from models_testkit import TinyInputs

from rollplex.models.config import ModelConfig, load_model_config
from rollplex.models.inputs import Prompt
from rollplex.models.model import Qwen2_5_VL


@pytest.fixture(scope="session")
def config() -> ModelConfig:
    return load_model_config("tiny")


@pytest.fixture
def inputs(config: ModelConfig) -> TinyInputs:
    return TinyInputs(config, torch.Generator().manual_seed(1234))


@pytest.fixture
def model(config: ModelConfig) -> Qwen2_5_VL:
    torch.manual_seed(0)
    return Qwen2_5_VL(config)


@pytest.fixture
def prompts(inputs: TinyInputs) -> list[Prompt]:
    """A video prompt, an image prompt and a text prompt, of different lengths."""
    return [
        inputs.prompt(2, inputs.video((2, 8, 8), second_per_grid_t=1.5), 3),
        inputs.prompt(4, inputs.image((4, 6)), 9),
        inputs.prompt(6),
    ]
