"""The compiled plan is what runs: `rollplex run plan.json` trains as `rollplex run SPEC` does, the engines follow
the plan's decisions (an edited decision included), and the run's flags are checked in one line each."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
from run_testkit import ROOT, run, spec_text

from rollplex.cli import main
from rollplex.errors import SpecError
from rollplex.executors.engines import build_engines
from rollplex.graph.decisions import PrefixActivations, Recompute
from rollplex.graph.load import parse_spec
from rollplex.graph.memobject import Residency
from rollplex.graph.plan import compile_plan

TINY = str(ROOT / "specs/tiny_cpu.yaml")


def digests(out: Path) -> list[str]:
    return [json.loads(line)["param_digest"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_running_a_plan_file_trains_digest_for_digest_as_running_its_spec(tmp_path, capsys):
    common = ["--steps", "2", "--quiet", "--no-checkpoints"]
    assert main(["run", TINY, "--out", str(tmp_path / "spec"), *common]) == 0
    assert "rollplex:" not in capsys.readouterr().err  # --quiet: no start-up lines either
    assert main(["compile", TINY, "-o", str(tmp_path / "plan.json")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main(["run", str(tmp_path / "plan.json"), "--out", str(tmp_path / "plan"), *common]) == 0
    assert digests(tmp_path / "spec") == digests(tmp_path / "plan") and len(digests(tmp_path / "plan")) == 2


@pytest.mark.slow
def test_a_spec_written_in_json_runs_as_its_yaml_and_a_plan_runs_into_its_specs_folder(tmp_path, monkeypatch):
    import yaml

    common = ["--steps", "1", "--quiet", "--no-checkpoints"]
    (tmp_path / "tiny.json").write_text(json.dumps(yaml.safe_load(Path(TINY).read_text())))
    assert main(["run", TINY, "--out", str(tmp_path / "yaml"), *common]) == 0
    assert main(["run", str(tmp_path / "tiny.json"), "--out", str(tmp_path / "json"), *common]) == 0
    assert digests(tmp_path / "yaml") == digests(tmp_path / "json")
    monkeypatch.chdir(tmp_path)
    assert main(["compile", TINY, "-o", "plan.json"]) == 0
    assert main(["run", "plan.json", *common]) == 0
    assert digests(tmp_path / "runs" / "tiny_cpu") == digests(tmp_path / "yaml")  # runs/<spec name>, as a spec's


def test_the_engines_follow_the_plans_decisions():
    plan = compile_plan(parse_spec(spec_text() + "memory: {prefix_saved: host}\n"))
    assert plan.decisions.prefix_saved is Residency.HOST
    engines = build_engines(plan)
    assert len(engines.optimizer.chunks) == 1 and engines.prefix_memory().__class__.__name__ == "SavedTensorOffload"
    edited = replace(
        plan.decisions,
        optimizer_chunk_bytes=12 * 4096,  # the state of 4,096 elements per chunk
        prefix_saved=Residency.HBM,
        prefix_activations=PrefixActivations.RECOMPUTE,
        recompute=Recompute.FULL,
    )
    engines = build_engines(replace(plan, decisions=edited))
    numel = sum(p.numel() for p in engines.actor.parameters())
    assert len(engines.optimizer.chunks) == -(-numel // 4096)
    assert engines.prefix_rerun is not None and engines.prefix_memory().__class__.__name__ == "nullcontext"
    with engines.microbatch_memory() as wrapped:
        assert wrapped > 0
    with pytest.raises(SpecError, match=r"decisions.layers_kept.*3 is more than the 2 decoder layers"):
        build_engines(replace(plan, decisions=replace(edited, layers_kept=3)))


def test_rollout_from_a_copy_refreshed_after_each_update_trains_as_rollout_from_the_actor(tmp_path):
    shared = run(tmp_path, "rollplex", 3, name="shared")
    from rollplex.executors.loop import RunOptions, train

    text = spec_text() + "memory: {weight_sharing: false}\n"
    plan = compile_plan(parse_spec(text))
    assert not plan.decisions.weight_sharing
    copied = train(plan, RunOptions(3, tmp_path / "copied", progress=False, tensorboard=False))
    assert [r["param_digest"] for r in copied] == [r["param_digest"] for r in shared]
    assert [r["reward_mean"] for r in copied] == [r["reward_mean"] for r in shared]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "0"], "--steps 0; use --steps 1 or more"),
        (["--checkpoint-every", "-2"], "--checkpoint-every -2; use --checkpoint-every 1 or more"),
        (["--out", "{file}"], "is a file; give a directory"),
        (["--resume"], "--resume: no complete checkpoint in"),
        (["--no-checkpoints", "--checkpoint-every", "1"], "--no-checkpoints with --checkpoint-every"),
    ],
)
def test_bad_run_flags_are_one_line_and_exit_2(tmp_path, capsys, args, message):
    (tmp_path / "file").write_text("")
    args = [a.replace("{file}", str(tmp_path / "file")) for a in args]
    assert main(["run", TINY, "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_schedule_with_a_plan_file_and_a_resume_past_the_last_step_are_one_line(tmp_path, capsys):
    assert main(["compile", TINY, "-o", str(tmp_path / "plan.json")]) == 0
    assert main(["run", str(tmp_path / "plan.json"), "--schedule", "serial"]) == 2
    assert "a plan has its schedule" in capsys.readouterr().err
    assert main(["run", TINY, "--out", str(tmp_path / "run"), "--steps", "1", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["run", TINY, "--out", str(tmp_path / "run"), "--steps", "1", "--quiet", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "is step 1, and the run has 1 steps" in err and len(err.strip().splitlines()) == 1


def test_progress_on_a_terminal_is_a_bar_carrying_the_last_steps_reward_and_loss(tmp_path, monkeypatch):
    import io

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    assert main(["run", TINY, "--out", str(tmp_path), "--steps", "2", "--no-checkpoints"]) == 0
    drawn = terminal.getvalue()
    assert "steps:" in drawn and "reward " in drawn and "loss " in drawn
    assert "step 1/2:" not in drawn  # no log lines beside the bar


def test_progress_into_a_log_is_one_plain_line_a_step(tmp_path, capsys):
    """stderr is not a terminal here (pytest captures it): no redrawn bars, one line per step."""
    assert main(["run", TINY, "--out", str(tmp_path), "--steps", "2", "--no-checkpoints"]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 1/2", "step 2/2"], err
    assert "reward" in lines[0] and " s, " in lines[0]
    assert "\x1b[" not in err and "\r" not in err  # no cursor moves or carriage returns


def test_a_steps_line_names_the_allocators_retries_where_it_made_any():
    from rollplex.executors.progress import step_line as _step_line

    record = {"step": 3, "time_s": {"step": 14.5}, "reward_mean": 0.25, "loss": 0.0123}
    quiet = _step_line({**record, "alloc_retries_by_phase": {"1": 0, "2": 0, "3": 0}}, 4)
    assert quiet == _step_line(record, 4) == "step 3/4: 14.50 s, reward 0.250, loss 0.0123"
    retried = _step_line({**record, "alloc_retries_by_phase": {"1": 1, "2": 3, "3": 0}}, 4)
    assert retried == "step 3/4: 14.50 s, reward 0.250, loss 0.0123, 4 allocator retries (phase 1: 1, phase 2: 3)"


def test_a_warm_steps_line_names_its_compiles_and_the_first_step_does_not():
    from rollplex.executors.progress import step_line as _step_line

    record = {"step": 4, "time_s": {"step": 15.7}, "reward_mean": 0.25, "loss": 0.0123}
    compiles = {"triton": 2, "torch": 1, "kernels": ["_norm_backward", "_norm_backward"]}
    compiled = {**record, "compiles": compiles, "alloc_retries_by_phase": {"2": 2}}
    named = ", 3 compiles (triton 2: _norm_backward, torch 1)"
    line = f"step 4/5: 15.70 s, reward 0.250, loss 0.0123, 2 allocator retries (phase 2: 2){named}"
    assert _step_line(compiled, 5) == line
    assert _step_line(compiled, 5, warm=False) == line.removesuffix(named)
    none = {"triton": 0, "torch": 0, "kernels": []}
    assert _step_line({**record, "compiles": none}, 5).endswith("loss 0.0123")


def test_a_runs_metrics_count_each_steps_compiles(tmp_path):
    """Every step's record carries its compiles; off a GPU nothing is compiled (torch.compile and Triton act on a
    GPU only), so every count is 0."""
    assert main(["run", TINY, "--out", str(tmp_path), "--steps", "2", "--no-checkpoints", "--quiet"]) == 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["compiles"] for r in records] == [{"triton": 0, "torch": 0, "kernels": []}] * 2
