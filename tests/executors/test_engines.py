"""What the engines refuse to build: the spec's run refusals that apply on their device."""

from __future__ import annotations

import pytest
import torch

from rollplex.errors import SpecError
from rollplex.executors.engines import build_engines
from rollplex.graph.load import parse_spec
from rollplex.graph.plan import compile_plan

DP2 = """
model: tiny
cluster: {nodes: 1, gpus_per_node: 2, hbm_gib: 16, host_gib: 8}
workload: {prompts_per_step: 4, group_size: 2, prompt_tokens: 64, response_tokens: 6, visual_tokens: 8}
algorithm: {top_p: 0.9}
run: {dtype: float32}
"""


def test_a_gpu_only_refusal_stops_a_gpu_build_before_anything_is_made(monkeypatch):
    plan = compile_plan(parse_spec(DP2))
    monkeypatch.setattr("rollplex.executors.engines.init_parallel", lambda *a: pytest.fail("built past the check"))
    with pytest.raises(SpecError, match=r"algorithm\.top_p.*top-p on a GPU draws per batch row"):
        build_engines(plan, torch.device("cuda"))  # a device object only: nothing reaches CUDA
