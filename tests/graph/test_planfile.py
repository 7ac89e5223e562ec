"""`plan.json`: a compiled plan written and read back is the same plan; what the file says is what runs; a file
of another version or a broken one is refused in one line."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from rollplex.errors import SpecError
from rollplex.graph.ir import Schedule, lifetimes, ops, steps, tensors
from rollplex.graph.load import load_spec
from rollplex.graph.plan import compile_plan
from rollplex.graph.planfile import PLAN_VERSION, read_plan
from rollplex.report.jsonout import plan_to_json

SPECS = Path(__file__).resolve().parents[2] / "specs"


@pytest.mark.parametrize(
    ("name", "schedule"),
    [("qwen2_5_vl_3b_h200.yaml", Schedule.ROLLPLEX), ("tiny_cpu.yaml", Schedule.UNSPLIT),
     ("qwen2_5_vl_32b_h800x4.yaml", Schedule.SERIAL)],
)  # fmt: skip
def test_a_written_plan_reads_back_as_the_same_plan(tmp_path, name, schedule):
    plan = compile_plan(load_spec(SPECS / name), schedule)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_to_json(plan)))
    back = read_plan(path)
    assert back.decisions == plan.decisions and back.schedule is schedule
    assert back.loaded.spec == plan.loaded.spec and back.loaded.model == plan.loaded.model
    assert list(ops(back.graph)) == list(ops(plan.graph)) and steps(back.graph) == steps(plan.graph)
    assert lifetimes(back.graph) == lifetimes(plan.graph) and tensors(back.graph) == tensors(plan.graph)
    assert back.residency.step_bytes == plan.residency.step_bytes


def test_the_decisions_of_the_file_are_the_ones_read(tmp_path):
    plan = compile_plan(load_spec(SPECS / "tiny_cpu.yaml"))
    data = plan_to_json(plan)
    data["decisions"]["optimizer_chunk_bytes"] = 1 << 20
    data["decisions"]["sharing"]["policy"] = "streams"
    (tmp_path / "plan.json").write_text(json.dumps(data))
    back = read_plan(tmp_path / "plan.json")
    assert back.decisions.optimizer_chunk_bytes == 1 << 20 and back.decisions.sharing.policy.value == "streams"
    assert replace(back.decisions, optimizer_chunk_bytes=plan.decisions.optimizer_chunk_bytes,
                   sharing=plan.decisions.sharing) == plan.decisions  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: d.update(rollplex_plan_version=PLAN_VERSION + 1),
            f"plan version {PLAN_VERSION + 1}, this rollplex reads version {PLAN_VERSION}",
        ),
        (lambda d: d.pop("decisions"), "malformed plan (missing key 'decisions')"),
        (lambda d: d["decisions"].update(prefix_saved="disk"), "malformed plan ('disk' is not a valid Residency)"),
        (
            lambda d: d["spec"]["workload"].update(group_size=0),
            "malformed plan (spec.workload.group_size: Input should",
        ),
        (lambda d: d["spec"]["memory"].update(recompute="auto"), "malformed plan (its spec has memory.recompute auto)"),
        (
            lambda d: d["decisions"].update(optimizer_chunk_bytes=-5),
            "malformed plan (decisions.optimizer_chunk_bytes is -5: a whole number of bytes, at least 1)",
        ),
        (lambda d: d["decisions"].update(host_pool_bytes=1.5), "decisions.host_pool_bytes is 1.5"),
        (lambda d: d["decisions"].update(layers_kept=-1), "decisions.layers_kept is -1: a number of decoder layers"),
        (
            lambda d: d["decisions"].update(rollout_prompt_tokens="8k"),
            "decisions.rollout_prompt_tokens is '8k': a token",
        ),
        (lambda d: d.update(ops=[]), "malformed plan (its graph has no ops)"),
        (lambda d: d["decisions"].pop("optimizer_chunk_bytes"), "malformed plan (missing key 'optimizer_chunk_bytes')"),
        (lambda d: d.update(ops=d["ops"][1:]), "malformed plan (its graph: "),
    ],
)
def test_a_plan_of_another_version_or_a_broken_one_is_one_line(tmp_path, edit, message):
    data = plan_to_json(compile_plan(load_spec(SPECS / "tiny_cpu.yaml")))
    edit(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SpecError) as e:
        read_plan(path)
    assert message in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_file_that_is_not_json_is_one_line(tmp_path):
    (tmp_path / "plan.json").write_bytes(b"\x00\xff not json")
    with pytest.raises(SpecError, match="cannot read the plan"):
        read_plan(tmp_path / "plan.json")


def test_a_plan_cut_short_is_read_as_a_plan_and_said_so(tmp_path, capsys):
    from rollplex.cli import main
    from rollplex.graph.planfile import is_plan_file

    text = json.dumps(plan_to_json(compile_plan(load_spec(SPECS / "tiny_cpu.yaml"))))
    (tmp_path / "plan.json").write_text(text[: len(text) // 2])
    assert is_plan_file(tmp_path / "plan.json")
    assert main(["run", str(tmp_path / "plan.json"), "--out", str(tmp_path / "run")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "cannot read the plan" in line and "YAML" not in line
