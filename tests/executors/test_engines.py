"""What the engines refuse to build: data-parallel ranks that could not sample as one process would."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rollplex.errors import SpecError
from rollplex.executors.engines import _check_data_parallel
from rollplex.graph.load import parse_spec
from rollplex.graph.plan import compile_plan

DP2 = """
model: tiny
cluster: {{nodes: 1, gpus_per_node: 2, hbm_gib: 16, host_gib: 8}}
workload: {{prompts_per_step: 4, group_size: 2, prompt_tokens: 64, response_tokens: 6, visual_tokens: 8}}
algorithm: {{top_p: {top_p}}}
sharing: {{policy: {policy}}}
run: {{dtype: float32}}
"""


def check(device: str, top_p: float = 1.0, replicas: int = 1) -> None:
    plan = compile_plan(parse_spec(DP2.format(top_p=top_p, policy="streams")))
    tp = SimpleNamespace(exchange=SimpleNamespace(size=replicas))  # rollout replicas filled by one TP group
    _check_data_parallel(plan.loaded.spec, torch.device(device), tp)


def test_data_parallel_ranks_sample_in_process_with_top_p_one_on_a_gpu():
    check("cuda")  # nothing refused: the GPU sampler keys each row's numbers by its row in the whole step
    check("cpu", top_p=0.9)  # the CPU draws every rank's rows each step, top-p or not
    with pytest.raises(SpecError, match=r"algorithm\.top_p.*top-p on a GPU draws per batch row"):
        check("cuda", top_p=0.9)
    with pytest.raises(SpecError, match=r"sharing\.policy.*mps runs on one GPU"):
        parse_spec(DP2.format(top_p=1.0, policy="mps"))  # refused with the spec: two GPUs, two processes
    with pytest.raises(SpecError, match=r"parallel\.split_rollout.*reseeds each rollout replica"):
        check("cpu", replicas=2)  # the spec keeps split_rollout's default, true
