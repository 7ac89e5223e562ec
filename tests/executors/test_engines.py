"""What the engines build from a plan's decisions and the spec's run settings, and what they refuse: the run
refusals that apply on their device."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_testkit import loaded, spec_text

from rollplex.errors import SpecError
from rollplex.executors.engines import build_engines
from rollplex.graph.load import parse_spec
from rollplex.graph.plan import compile_plan
from rollplex.models.cudnn_ragged import CudnnRaggedKernels

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


EXPANDABLE_PROBE = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import run_testkit  # registers the spec's test reward
from rollplex.executors.engines import build_engines
from rollplex.graph.load import parse_spec
from rollplex.graph.plan import compile_plan
weight = build_engines(compile_plan(parse_spec(sys.stdin.read()))).actor.lm_head.weight
(segment,) = [s for s in torch.cuda.memory._snapshot()["segments"]
              if s["address"] <= weight.data_ptr() < s["address"] + s["total_size"]]
print(segment["is_expandable"])
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("expandable", [True, False])
def test_on_a_gpu_the_spec_decides_whether_the_allocator_maps_expandable_segments(expandable):
    """In a process of its own: a segment an earlier test made under the other setting can hold the small weight."""
    text = spec_text(kl=0.1, device="cuda") + f"memory: {{expandable_segments: {str(expandable).lower()}}}\n"
    probe = subprocess.run(
        [sys.executable, "-c", EXPANDABLE_PROBE, str(Path(__file__).parent)], input=text, capture_output=True, text=True
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.split()[-1] == str(expandable)  # the weight's segment, made under the spec's setting


@pytest.mark.parametrize("cudnn", [False, True])
def test_the_spec_decides_whether_attention_may_run_on_cudnn_and_a_later_build_resets_it(cudnn):
    text = spec_text(kl=0.1, device="cpu").replace("run: {", f"run: {{cudnn_attention: {str(cudnn).lower()}, ")
    try:
        build_engines(compile_plan(parse_spec(text)))
        assert torch.backends.cuda.cudnn_sdp_enabled() == cudnn
        build_engines(compile_plan(parse_spec(spec_text(kl=0.1, device="cpu"))))  # the default: torch may choose cuDNN
        assert torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)  # whatever failed above, later tests see torch's default


def test_the_optimizer_keeps_in_hbm_the_share_of_its_state_the_plan_keeps_there():
    from dataclasses import replace

    from rollplex.graph.memobject import Residency

    plan = compile_plan(loaded())
    streamed = replace(plan.decisions, optimizer_state=Residency.HOST, optimizer_chunk_bytes=12 * 50_000)
    whole = build_engines(replace(plan, decisions=streamed)).optimizer
    assert whole.num_streamed == len(whole.chunks) > 2 and whole.device_pool is None
    kept = sum(12 * chunk.numel for chunk in whole.chunks[:2])
    decisions = replace(streamed, optimizer_kept_bytes=kept)
    optimizer = build_engines(replace(plan, decisions=decisions)).optimizer
    assert optimizer.num_streamed == len(optimizer.chunks) - 2
    assert sum(block.num_bytes for block in optimizer.device_pool.live_blocks) == kept


def test_the_rollout_stops_at_the_models_ends():
    engines = build_engines(compile_plan(loaded()))
    assert (
        engines.sampling.stop_token_ids == engines.actor.config.tokens.stop_ids == (2,)
    )  # the tiny config's <|im_end|>


def test_the_cache_is_emptied_at_each_phase_unless_the_spec_keeps_it_until_a_mapping():
    text = spec_text(kl=0.1, device="cpu")
    assert build_engines(compile_plan(parse_spec(text))).empty_cache_at_phases
    kept = parse_spec(text + "memory: {empty_cache: mappings}\n")
    assert not build_engines(compile_plan(kept)).empty_cache_at_phases
    with pytest.raises(SpecError, match="empty_cache"):
        parse_spec(text + "memory: {empty_cache: never}\n")


def test_the_cache_kept_until_a_mapping_needs_the_rollout_in_this_process():
    text = spec_text(kl=0.1, device="cpu") + "sharing: {policy: mps}\n"
    parse_spec(text)
    with pytest.raises(SpecError, match="empty_cache mappings needs the rollout in this process"):
        parse_spec(text + "memory: {empty_cache: mappings}\n")


def _cudnn_scoring(monkeypatch, choice: str, build, takes: bool = True) -> SpecError | object:
    """build_engines of the tests' spec with `run.suffix_attention: choice`, as if it resolved to cudnn on this
    device and cuDNN took (`takes`) the model's dtype and head size, cuDNN's graph builds replaced by `build`: the
    engines, or the SpecError raised."""
    monkeypatch.setattr("rollplex.executors.device_settings.suffix_attention", lambda run, device: "cudnn")
    monkeypatch.setattr(CudnnRaggedKernels, "takes", staticmethod(lambda device, dtype, head_dim: takes))
    monkeypatch.setattr("rollplex.executors.device_settings.build_graphs", build)
    text = spec_text(kl=0.1, device="cpu").replace("run: {", f"run: {{suffix_attention: {choice}, ")
    try:
        return build_engines(compile_plan(parse_spec(text)))
    except SpecError as e:
        return e


def test_scoring_on_cudnn_builds_its_graphs_once_for_this_ranks_heads_and_each_model_keeps_its_own_capacities(
    monkeypatch,
):
    built = []
    engines = _cudnn_scoring(monkeypatch, "auto", lambda kernels, *shape: built.append((kernels, shape)) or 2**20)
    ((kernels, (_, dtype, heads, kv_heads, head_dim)),) = built
    text = engines.actor.config.text
    assert (heads, kv_heads, head_dim) == (text.num_attention_heads, text.num_key_value_heads, text.head_dim)
    assert dtype == engines.actor.lm_head.weight.dtype
    assert engines.actor.suffix_kernels is kernels
    reference = engines.reference.suffix_kernels
    assert [k.capacity for k in reference] == [k.capacity for k in kernels]
    assert all(r is not k for r, k in zip(reference, kernels, strict=True))  # each grows on its own


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_scoring_kernels_backward_is_deterministic_exactly_when_the_run_is(monkeypatch, deterministic):
    """`run.deterministic` reaches cuDNN's scoring kernels (their backward on cuDNN's deterministic kernels), the
    reference's and critic's copies included; off, the faster backward with atomics."""
    monkeypatch.setattr("rollplex.executors.engines.set_determinism", lambda on: None)  # torch's switch stays as is
    choice = "auto, deterministic: true" if deterministic else "auto"
    engines = _cudnn_scoring(monkeypatch, choice, lambda *a: 0)
    for model in (engines.actor, engines.reference):
        assert [k.deterministic for k in model.suffix_kernels] == [deterministic, deterministic]


def test_a_model_whose_dtype_or_head_size_cudnn_does_not_take_builds_no_graph_and_scores_on_flexattention(
    monkeypatch,
):
    engines = _cudnn_scoring(monkeypatch, "auto", lambda *a: pytest.fail("built a graph"), takes=False)
    assert engines.actor.suffix_kernels is None and engines.reference.suffix_kernels is None


def refuse(*args):
    raise RuntimeError("cudnnGraphNotSupportedError: no execution plan for this graph")


def test_where_cudnn_refuses_its_graphs_auto_scores_on_flexattention_and_says_why(monkeypatch, capsys):
    engines = _cudnn_scoring(monkeypatch, "auto", refuse)
    assert engines.actor.suffix_kernels is None and engines.reference.suffix_kernels is None
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if "FlexAttention" in ln]
    assert line.startswith("rollplex: scoring on FlexAttention: cuDNN refused") and "no execution plan" in line


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_scoring_workspace_beyond_the_runtime_reserve_scores_on_flexattention_and_says_so(
    monkeypatch, capsys, deterministic
):
    """The plan keeps no room for cuDNN's workspace beyond `memory.runtime_reserve_gib` (3 GiB by default): graphs
    that take more (the deterministic backward at a video workload's capacities) leave auto on FlexAttention."""
    monkeypatch.setattr("rollplex.executors.engines.set_determinism", lambda on: None)
    choice = "auto, deterministic: true" if deterministic else "auto"
    fits = _cudnn_scoring(monkeypatch, choice, lambda *a: 3 * 2**30)
    assert fits.actor.suffix_kernels is not None and capsys.readouterr().err == ""
    engines = _cudnn_scoring(monkeypatch, choice, lambda *a: 3 * 2**30 + 1)
    assert engines.actor.suffix_kernels is None and engines.reference.suffix_kernels is None
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if "FlexAttention" in ln]
    assert "a 3.0 GiB workspace" in line and "memory.runtime_reserve_gib: 3)" in line
    assert ("deterministic backward" in line) == deterministic


def test_a_scoring_workspace_beyond_the_reserve_under_an_explicit_cudnn_is_a_one_line_spec_error(monkeypatch):
    error = _cudnn_scoring(monkeypatch, "cudnn", lambda *a: 40 * 2**30)
    assert isinstance(error, SpecError) and error.where == "run.suffix_attention" and "\n" not in str(error)
    assert "40.0 GiB workspace" in str(error) and "raise memory.runtime_reserve_gib" in str(error)


def test_where_cudnn_refuses_its_graphs_an_explicit_cudnn_is_a_one_line_spec_error(monkeypatch):
    error = _cudnn_scoring(monkeypatch, "cudnn", refuse)
    assert isinstance(error, SpecError) and error.where == "run.suffix_attention"
    assert "no execution plan" in str(error) and "suffix_attention: flex" in str(error) and "\n" not in str(error)


def test_init_auto_starts_from_the_weights_of_a_model_folder_that_holds_them():
    """A spec naming a checkpoint's folder trains from its weights without `run.init: checkpoint` (auto); random
    asked for keeps the seed's weights."""
    from run_testkit import SPEC, stopping_checkpoint

    from rollplex.executors.engines import _initial_model

    def first(init: str) -> list[torch.Tensor]:
        text = SPEC.format(model=stopping_checkpoint(), kl=0.1, device="cpu", init=init)
        return list(_initial_model(parse_spec(text), torch.device("cpu"), None).parameters())

    auto, checkpoint, random = first("auto"), first("checkpoint"), first("random")
    assert all(torch.equal(a, c) for a, c in zip(auto, checkpoint, strict=True))
    assert not all(torch.equal(a, r) for a, r in zip(auto, random, strict=True))
