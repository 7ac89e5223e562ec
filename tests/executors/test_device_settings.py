"""`run.suffix_attention` resolved per device: cuDNN's ragged scoring only on a GPU with cudnn-frontend, never with
cuDNN attention off (deterministic kernels keep it: its backward then runs on cuDNN's deterministic kernels); an
explicit cudnn without the package is a one-line error."""

from __future__ import annotations

import pytest
import torch

from rollplex.executors import device_settings
from rollplex.executors.device_settings import suffix_attention
from rollplex.graph.spec_runtime import RunSpec

GPU = torch.device("cuda")


@pytest.mark.parametrize("setting", ["auto", "flex", "cudnn"])
def test_the_cpu_scores_with_flex_whatever_the_setting(setting):
    assert suffix_attention(RunSpec(suffix_attention=setting), torch.device("cpu")) == "flex"


@pytest.mark.parametrize(
    ("installed", "run", "expected"),
    [
        (True, {}, "cudnn"),
        (False, {}, "flex"),
        (True, {"deterministic": True}, "cudnn"),
        (True, {"cudnn_attention": False}, "flex"),
        (True, {"suffix_attention": "flex"}, "flex"),
        (True, {"suffix_attention": "cudnn"}, "cudnn"),
    ],
)
def test_auto_on_a_gpu_picks_cudnn_only_where_it_is_installed_and_allowed(monkeypatch, installed, run, expected):
    monkeypatch.setattr("rollplex.models.cudnn_ragged.ragged_attention_available", lambda device: installed)
    assert suffix_attention(RunSpec(**run), GPU) == expected


def test_an_explicit_cudnn_without_cudnn_frontend_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr("rollplex.models.cudnn_ragged.ragged_attention_available", lambda device: False)
    with pytest.raises(ValueError, match="cudnn-frontend is not installed") as error:
        suffix_attention(RunSpec(suffix_attention="cudnn"), GPU)
    assert "\n" not in str(error.value)


def test_the_spec_refuses_cudnn_scoring_with_cudnn_off_and_takes_it_with_deterministic_kernels():
    with pytest.raises(ValueError, match="set suffix_attention: flex"):
        RunSpec(suffix_attention="cudnn", cudnn_attention=False)
    assert RunSpec(suffix_attention="cudnn", deterministic=True).suffix_attention == "cudnn"


def test_the_module_keeps_its_import_of_cudnn_frontend_lazy():
    assert "cudnn" not in vars(device_settings)
