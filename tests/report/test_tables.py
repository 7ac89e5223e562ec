"""The dry-run's time table: priced on the spec's GPU, and saying so when the spec leaves the GPU to its default."""

import re
from pathlib import Path

from rollplex.graph.cost import reference_page_ins
from rollplex.graph.load import parse_spec
from rollplex.graph.plan import compile_plan
from rollplex.graph.spec_runtime import RunSpec
from rollplex.report.tables import report, scoring_line, time_table

SPECS = Path(__file__).resolve().parents[2] / "specs"


def test_the_time_table_prices_the_specs_gpu_and_names_a_default_one():
    text = (SPECS / "qwen2_5_vl_32b_h800.yaml").read_text()
    h800 = time_table(compile_plan(parse_spec(text)))
    assert h800.startswith("Time per step on one NVIDIA H800 (bound: 791 TFLOP/s, 3.02 TB/s HBM, 55 GB/s")
    assert "not set" not in h800
    default = time_table(compile_plan(parse_spec(text.replace("  gpu: H800\n", ""))))
    assert default.startswith("Time per step on one NVIDIA H200")
    assert "(cluster.gpu is not set: priced on its default, the H200)" in default
    rollout = [float(line.split()[4]) for text in (h800, default) for line in text.splitlines()
               if re.match(r"rollout +[0-9.]+ ", line)]  # fmt: skip
    assert rollout[1] < rollout[0] < rollout[1] * 4.27 / 3.015  # its decode reads HBM at 3.02 TB/s, not 4.27


def test_the_residency_line_counts_a_paged_reference_once_per_page_in():
    plan = compile_plan(parse_spec((SPECS / "qwen2_5_vl_32b_h800.yaml").read_text()))
    line = next(x for x in time_table(plan).splitlines() if x.startswith("residency choices"))
    reference = line.split("reference weights: ")[1]
    moved = sum(n for _, n in reference_page_ins(plan))
    assert len(reference_page_ins(plan)) == 2 and f"{moved / 1e9:.1f} GB over the host link per step" in reference


def test_a_plan_over_the_host_names_the_pinned_need_in_its_verdict():
    text = (
        (SPECS / "qwen2_5_vl_3b_h200.yaml")
        .read_text()
        .replace("prefix_activations: recompute", "prefix_activations: offload")
    )
    plan = compile_plan(parse_spec(text))  # every tensor the prefix saves: far more than HBM or the pool holds
    verdict = report(plan, naive=False).splitlines()[-1]
    assert verdict.startswith("plan DOES NOT FIT: peak ")
    assert f"; pinned host {plan.residency.host.needed_bytes_per_node / 2**30:.2f} GiB of 100.00 GiB" in verdict


def test_the_scoring_line_says_what_the_runtime_resolves_the_suffix_attention_to():
    assert scoring_line(RunSpec()).startswith("auto (cuDNN's ragged calls where cudnn-frontend is installed")
    assert scoring_line(RunSpec(suffix_attention="cudnn")).startswith("cuDNN's ragged calls")
    deterministic = scoring_line(RunSpec(deterministic=True))  # cuDNN's deterministic backward where it fits
    assert deterministic.startswith(scoring_line(RunSpec()))
    assert "workspace fits memory.runtime_reserve_gib" in deterministic
    assert deterministic.endswith("else FlexAttention")
    assert scoring_line(RunSpec(deterministic=True, suffix_attention="cudnn")).endswith("else a spec error")
    for flex in (RunSpec(suffix_attention="flex"), RunSpec(cudnn_attention=False)):
        assert scoring_line(flex).startswith("FlexAttention (run.suffix_attention ")


def test_a_tiny_models_work_shows_in_two_significant_digits_not_as_zero():
    from rollplex.report.tables import _fixed

    assert [_fixed(x, 3) for x in (0.0, 1.9e-6, 0.0004, 0.0005, 2.5)] == ["0.000", "1.9e-06", "4.0e-04", "0.001",
                                                                           "2.500"]  # fmt: skip
    assert _fixed(3.4e-5, 1) == "3.4e-05" and _fixed(0.06, 1) == "0.1"
