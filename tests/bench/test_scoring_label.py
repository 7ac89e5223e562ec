"""`harness.scoring_label`: what a bench result says the first step's gradients ran through, which sets the
gradient noise floor (cuDNN's backward accumulates with atomics)."""

from types import SimpleNamespace

import torch

from rollplex.bench.harness import scoring_label
from rollplex.models.cudnn_ragged import suffix_kernels


def model(kernels, device: str) -> SimpleNamespace:
    return SimpleNamespace(suffix_kernels=kernels, device=torch.device(device))


def test_the_scoring_label_names_what_the_noise_floor_follows():
    """cuDNN's backward with or without atomics, FlexAttention on a GPU, SDPA on the CPU."""
    assert scoring_label(model(suffix_kernels(2, 2, 16, 32), "cuda")) == "cudnn"
    assert scoring_label(model(suffix_kernels(2, 2, 16, 32, deterministic=True), "cuda")) == "cudnn deterministic"
    assert scoring_label(model(None, "cuda")) == "flex"
    assert scoring_label(model(None, "cpu")) == "sdpa"
