"""A time plan's efficiencies from a bench result, a run's metrics or by hand; a bad source is one line."""

import json
from pathlib import Path

import pytest

from rollplex.cli import main
from rollplex.errors import SpecError
from rollplex.report.efficiency import read_efficiencies

SPEC = "specs/qwen2_5_vl_3b_h200.yaml"


def run_metrics(tmp_path, steps):
    """A metrics.jsonl of `steps` records: (time_s, bound_s) each."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        "".join(json.dumps({"step": i + 1, "time_s": t, "bound_s": b}) + "\n" for i, (t, b) in enumerate(steps))
    )
    return str(path)


def test_a_runs_metrics_give_each_phases_median_ratio_after_its_first_step(tmp_path):
    bounds = {"rollout": 4.0, "ref_prefix": 1.0, "update": 1.0}
    seconds = [(40.0, 9.0), (8.0, 2.0), (13.0, 4.0), (5.0, 5.0)]  # (rollout, update); ref_prefix beside decode: 0
    steps = [({"rollout": r, "ref_prefix": 0.0, "update": u, "step": r + u}, bounds) for r, u in seconds]
    found = read_efficiencies(run_metrics(tmp_path, steps), "rollplex")
    # the first step (0.1 and 0.11) left out; ref_prefix ran beside decode (no seconds of its own): unpriced
    assert found == pytest.approx({"rollout": 0.5, "update": 0.25})
    one = read_efficiencies(run_metrics(tmp_path, steps[:1]), "rollplex")
    assert one == pytest.approx({"rollout": 0.1, "update": 1 / 9})


def test_a_runs_efficiency_is_of_its_device_bound_so_its_own_plan_predicts_it_back(tmp_path):
    """The 7B plan's actor prefix is bound by the host link (the update streams beside it): an efficiency of the
    whole bound, applied to the device bound alone, would predict a third less than the run took."""
    from rollplex.graph import timeplan
    from rollplex.graph.load import load_spec
    from rollplex.graph.modelcost import KNOWN_PEAKS, Cost
    from rollplex.graph.plan import compile_plan
    from rollplex.graph.timeplan import UPDATE_BESIDE

    plan = compile_plan(load_spec("specs/qwen2_5_vl_7b_h200.yaml"))
    peaks = KNOWN_PEAKS[plan.loaded.spec.cluster.gpu]
    (row,) = [r for r in timeplan.time_plan(plan) if r.timer == "actor_prefix"]
    device = Cost(row.cost.flops, row.cost.hbm_bytes).bound_s(peaks)
    assert device < row.bound_s  # the link's time is the bound
    taken = 2.5 * row.bound_s
    record = {"time_s": {"actor_prefix": taken}, "bound_s": {"actor_prefix": row.bound_s}, "update_beside_prefix": True}
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({**record, "device_bound_s": {"actor_prefix": device}}) + "\n")
    found = read_efficiencies(str(path), "rollplex")
    assert found == pytest.approx({UPDATE_BESIDE: device / taken})
    (again,) = [r for r in timeplan.time_plan(plan, found) if r.timer == "actor_prefix"]
    assert again.predicted_s == pytest.approx(taken)
    path.write_text(json.dumps(record) + "\n")  # an older run's metrics: the whole bound
    assert read_efficiencies(str(path), "rollplex") == pytest.approx({UPDATE_BESIDE: 0.4})
    old, new = {**record, "step": 2}, {**record, "step": 3, "device_bound_s": {"actor_prefix": device}}
    path.write_text("".join(json.dumps(r) + "\n" for r in (record, old, new)))  # resumed across the field
    assert read_efficiencies(str(path), "rollplex") == pytest.approx({UPDATE_BESIDE: (0.4 + device / taken) / 2})


def test_a_bench_result_gives_its_schedules_efficiencies_and_serials_for_the_rest(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(
        json.dumps({"efficiency": {"serial": {"rollout": 0.5, "ref_prefix": 0.6}, "rollplex": {"rollout": 0.4}}})
    )
    assert read_efficiencies(str(path), "rollplex") == {"rollout": 0.4, "ref_prefix": 0.6}  # a prefix run alone
    assert read_efficiencies(str(path), "unsplit") == {"rollout": 0.5, "ref_prefix": 0.6}
    device = {"serial": {"rollout": 0.55}, "rollplex": {"update": 0.3}}  # of the device bound: preferred
    path.write_text(json.dumps({"efficiency": {"serial": {"rollout": 0.5}}, "device_efficiency": device}))
    assert read_efficiencies(str(path), "rollplex") == {"rollout": 0.55, "update": 0.3}
    whole = {"serial": {"rollout": 0.5}, "rollplex": {"update": 0.2}}  # serial from a baseline saved before it
    path.write_text(json.dumps({"efficiency": whole, "device_efficiency": {"rollplex": {"update": 0.3}}}))
    assert read_efficiencies(str(path), "rollplex") == {"rollout": 0.5, "update": 0.3}


def test_efficiencies_set_by_hand_predict_those_phases_only(capsys):
    assert read_efficiencies("rollout=0.5, update=0.25", "serial") == {"rollout": 0.5, "update": 0.25}
    assert main(["compile", SPEC, "--dry-run", "--format", "json", "--efficiency", "rollout=0.5"]) == 0
    rows = {r["phase"]: r for r in json.loads(capsys.readouterr().out)["time_plan"]}
    assert rows["rollout"]["predicted_s"] == pytest.approx(rows["rollout"]["bound_s"] / 0.5, rel=1e-3)
    assert rows["update"]["predicted_s"] is None


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("rollout=fast", "'rollout=fast' is not PHASE=NUMBER"),
        ("decode=0.5", "no phase 'decode'"),
        ("rollout=1.5", "rollout 1.5 is not in (0, 1]"),
        ("rollout=nan", "rollout nan is not in (0, 1]"),
        ("missing.json", "not a bench result with efficiencies"),
    ],
)
def test_a_bad_source_is_one_line_naming_it(source, message):
    with pytest.raises(SpecError, match="--efficiency") as caught:
        read_efficiencies(source, "serial")
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_metrics_without_bounds_are_refused_in_one_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "time_s": {"rollout": 1.0}}) + "\n")
    with pytest.raises(SpecError, match="not a run's metrics with bounds"):
        read_efficiencies(str(path), "serial")
    path.write_text(json.dumps({"step": 1, "time_s": {"rollout": 0.0}, "bound_s": {"rollout": 1.0}}) + "\n")
    with pytest.raises(SpecError, match="no step with a phase's bound and seconds"):
        read_efficiencies(str(path), "serial")


def test_a_cpu_bench_without_efficiencies_is_refused_in_one_line(tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"efficiency": {"serial": {}, "rollplex": {}}, "device_efficiency": {}}))
    with pytest.raises(SpecError, match=r"a bench result without efficiencies \(run on a CPU\?\); give a GPU"):
        read_efficiencies(str(path), "rollplex")


def test_a_run_ends_with_each_phases_median_seconds_bound_and_efficiency_slowest_first():
    from rollplex.report.efficiency import run_summary

    bounds = {"rollout": 4.0, "ref_prefix": 1.0, "update": 1.0, "reward": 0.0}
    seconds = [(40.0, 9.0), (8.0, 2.0), (16.0, 4.0), (10.0, 5.0)]
    times = [{"rollout": r, "ref_prefix": 0.0, "update": u, "reward": 0.5, "step": r + u + 0.5} for r, u in seconds]
    records = [{"step": i + 3, "time_s": t, "bound_s": bounds} for i, t in enumerate(times)]
    line = run_summary(records)
    assert line == (  # ref_prefix ran beside decode: no seconds of its own; reward has no bound
        "phases, medians of steps 4-6 (seconds, bound, efficiency): rollout 10.00 s (bound 4.00, 0.40); "
        "update 4.00 s (bound 1.00, 0.25); reward 0.50 s; step 15.50 s"
    )
    assert run_summary(records[:1]).startswith("phases, medians of step 3 (")


def test_a_run_that_timed_its_backward_through_the_prefix_names_it_within_the_actors_phase():
    from rollplex.report.efficiency import run_summary

    parts = [(5.0, 3.0, 1.5), (6.0, 4.0, 1.0), (5.5, 3.0, 1.2)]  # (phase, prefix backward, its bound)
    records = [
        {"step": i + 1, "time_s": {"actor_suffix_backward": a, "step": a}, "bound_s": {"actor_suffix_backward": 2.5},
         "prefix_backward_s": p, "prefix_backward_bound_s": b}
        for i, (a, p, b) in enumerate(parts)
    ]  # fmt: skip
    line = run_summary(records)  # warm: steps 2-3
    assert "actor_suffix_backward 5.75 s (bound 2.50, 0.44), of it the backward through the prefix 3.50 s " in line
    assert "(bound 1.10, 0.32)" in line  # the median of 1.0 / 4.0 and 1.2 / 3.0
    del records[2]["prefix_backward_s"], records[2]["prefix_backward_bound_s"]  # a step without it: not named
    assert "backward through the prefix" not in run_summary(records)


def test_the_backward_through_the_prefix_is_predicted_at_its_own_efficiency_from_each_source(tmp_path, capsys):
    path = tmp_path / "bench.json"
    efficiency = {"serial": {"actor_suffix_backward": 0.5}}
    path.write_text(json.dumps({"efficiency": efficiency, "prefix_backward_efficiency": {"serial": 0.6}}))
    assert read_efficiencies(str(path), "rollplex") == {"actor_suffix_backward": 0.5, "prefix_backward": 0.6}
    both = {"serial": 0.6, "rollplex": 0.55}
    path.write_text(json.dumps({"efficiency": efficiency, "prefix_backward_efficiency": both}))
    assert read_efficiencies(str(path), "rollplex")["prefix_backward"] == 0.55
    steps = [({"actor_suffix_backward": s, "step": s}, {"actor_suffix_backward": 1.0}) for s in (9.0, 2.0, 4.0)]
    metrics = run_metrics(tmp_path, steps)
    records = [json.loads(line) for line in Path(metrics).read_text().splitlines()]
    for r, seconds in zip(records, (5.0, 1.0, 3.0), strict=True):
        r |= {"prefix_backward_s": seconds, "prefix_backward_bound_s": 0.6}
    Path(metrics).write_text("".join(json.dumps(r) + "\n" for r in records))
    assert read_efficiencies(metrics, "rollplex") == pytest.approx(
        {"actor_suffix_backward": 0.375, "prefix_backward": 0.4}
    )
    assert main(["compile", SPEC, "--dry-run", "--format", "json", "--efficiency", "prefix_backward=0.5"]) == 0
    part = json.loads(capsys.readouterr().out)["prefix_backward"]
    assert part["efficiency"] == 0.5 and part["predicted_s"] == pytest.approx(part["bound_s"] / 0.5, rel=1e-3)
    assert main(["compile", SPEC, "--dry-run", "--efficiency", "prefix_backward=0.5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    (line,) = [x for x in lines if x.startswith("  of it, through the prefix")]
    assert line.split()[-2:] == ["0.50", f"{part['predicted_s']:.2f}"]
    (step,) = [x for x in lines if x.startswith("step ")]
    assert step.split()[-1] == "-"  # no phase priced: no step prediction


def test_a_runs_steps_give_the_prefix_and_update_efficiencies_by_where_the_update_ran(tmp_path):
    """A prefix that held the step before's update, and an update phase that only waited for the gradient norm,
    give keys of their own, so a plan that runs the two apart is priced at neither; a step with a clean prefix (the
    first after a checkpoint joined the update) or a joined update gives the plain ones. By hand the keys are
    accepted like a timer's."""
    from rollplex.graph.timeplan import UPDATE_BESIDE, UPDATE_DEFERRED

    def step(i, held, deferred, prefix_s, update_s):
        bounds = {"actor_prefix": 1.5 if held else 1.0, "update": 0.01 if deferred else 1.0, "rollout": 4.0}
        times = {"actor_prefix": prefix_s, "update": update_s, "rollout": 8.0}
        return {
            "step": i,
            "time_s": times,
            "bound_s": bounds,
            "update_beside_prefix": held,
            "update_deferred": deferred,
        }

    records = [step(1, False, True, 9.0, 9.0), step(2, True, True, 2.5, 0.04), step(3, True, False, 3.0, 2.0),
               step(4, False, True, 2.0, 0.05), step(5, True, True, 2.5, 0.04)]  # fmt: skip
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    found = read_efficiencies(str(path), "rollplex")  # step 1 (cold) left out
    assert found == pytest.approx({UPDATE_BESIDE: 0.6, "actor_prefix": 0.5, UPDATE_DEFERRED: 0.25, "update": 0.5,
                                   "rollout": 0.5})  # fmt: skip
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if not k.startswith("update_")}) + "\n"
                            for r in records))  # fmt: skip
    older = read_efficiencies(str(path), "rollplex")  # before the keys: every step counts as apart
    assert set(older) == {"actor_prefix", "update", "rollout"}
    assert read_efficiencies(f"{UPDATE_BESIDE}=0.5,{UPDATE_DEFERRED}=0.2", "rollplex") == {
        UPDATE_BESIDE: 0.5, UPDATE_DEFERRED: 0.2}  # fmt: skip


def test_each_shipped_efficiency_is_what_its_named_source_gives():
    """The table the dry-run predicts at by default: every entry is what `--efficiency` reads from the run's metrics
    or bench result it names (in the repository), for a shipped model and a GPU the cost model prices; a run's steps
    ran the entry's schedule."""
    from rollplex.graph.modelcost import KNOWN_PEAKS
    from rollplex.report.efficiency import RECORDED, Recorded

    root = Path(__file__).resolve().parents[2]
    entries = [Recorded(**e) for e in json.loads(RECORDED.read_text())]
    shipped = {("H200", "qwen2_5_vl_3b", "rollplex"), ("H200", "qwen2_5_vl_3b", "serial")}
    assert {(e.gpu, e.model, e.schedule) for e in entries} >= shipped | {("H200", "qwen2_5_vl_7b", "rollplex")}
    assert len({(e.gpu, e.model, e.schedule) for e in entries}) == len(entries)  # one entry each
    for e in entries:
        path = root / e.source
        if path.suffix == ".jsonl":
            assert {json.loads(line)["schedule"] for line in path.read_text().splitlines() if line.strip()} == {
                e.schedule
            }
        assert e.efficiencies == pytest.approx(read_efficiencies(str(path), e.schedule), abs=5e-5), e.source
        assert e.gpu in KNOWN_PEAKS and (root / "rollplex/configs" / f"{e.model}.json").exists()


def test_without_a_source_the_dry_run_predicts_at_the_shipped_run_of_the_model_on_its_gpu_and_schedule(capsys):
    from rollplex.report.efficiency import recorded_efficiencies

    assert main(["compile", SPEC, "--dry-run", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    recorded = recorded_efficiencies("H200", "qwen2_5_vl_3b", "rollplex")
    assert out["efficiency_source"] == recorded.line and "run_3b_h200" in recorded.source
    rows = {r["phase"]: r for r in out["time_plan"]}
    rollout = recorded.efficiencies["rollout"]
    assert rows["rollout"]["predicted_s"] == pytest.approx(rows["rollout"]["bound_s"] / rollout, rel=1e-3)
    assert main(["compile", SPEC, "--dry-run"]) == 0
    assert f"(the workload's mean step, {recorded.line})" in capsys.readouterr().out

    # a source given replaces it; a schedule no shipped run ran predicts nothing and says how to
    assert main(["compile", SPEC, "--dry-run", "--format", "json", "--efficiency", "rollout=0.5"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["efficiency_source"] == "predicted at --efficiency rollout=0.5"
    assert {r["phase"]: r["predicted_s"] for r in out["time_plan"]}["update"] is None
    assert main(["compile", "specs/qwen2_5_vl_7b_h200.yaml", "--dry-run", "--schedule", "serial"]) == 0
    assert "ships no run of this model on this GPU under the serial schedule" in capsys.readouterr().out
