"""What `rollplex run` refuses of a planned spec, from the spec alone."""

from __future__ import annotations

from rollplex.graph.load import parse_spec
from rollplex.graph.refusals import run_refusals

SPEC = """
model: tiny
cluster: {{nodes: 1, gpus_per_node: {gpus}, hbm_gib: 16, host_gib: 8}}
parallel: {{train_tp: {tp}, rollout_tp: 1, split_rollout: {split}, sequence_parallel: {sp}}}
workload: {{prompts_per_step: 4, group_size: 2, prompt_tokens: 64, response_tokens: 6, visual_tokens: 8}}
algorithm: {{top_p: {top_p}}}
run: {{dtype: float32, compiled_layers: {compiled}}}
"""


def refused(gpus=2, tp=1, split="true", sp="false", top_p=1.0, compiled="false") -> list[tuple[str, str]]:
    spec = parse_spec(SPEC.format(gpus=gpus, tp=tp, split=split, sp=sp, top_p=top_p, compiled=compiled)).spec
    return [(r.key, r.on) for r in run_refusals(spec)]


def test_a_spec_is_refused_only_for_what_the_runtime_cannot_do_as_planned():
    assert refused() == []  # two data-parallel ranks, top-p 1, no replicas to split
    assert refused(top_p=0.9) == [("algorithm.top_p", "cuda")]  # the CPU draws every rank's rows: runs there
    assert refused(gpus=1, top_p=0.9) == []  # one process: top-p as it is
    assert refused(gpus=2, tp=2) == []  # one TP group: no data parallelism to keep in step
    assert refused(gpus=4, tp=2) == [("parallel.split_rollout", "cpu")]  # two replicas per group, two DP ranks
    assert refused(gpus=4, tp=2, split="false") == []
    assert refused(gpus=2, tp=2, sp="true") == []  # sequence parallelism runs
    assert refused(compiled="true") == []  # the compiled layers' halves hold no collective at train_tp 1
    assert refused(gpus=2, tp=2, compiled="true") == [("run.compiled_layers", "cuda")]  # the CPU runs them eagerly
